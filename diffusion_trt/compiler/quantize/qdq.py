"""One component's fp32 graph -> QDQ graph: :func:`quantize_onnx` (ranges from the cache or a calibrator, then
``onnxruntime.quantization.quantize_static`` in ``QuantFormat.QDQ``)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ...errors import BuildError, RuntimeInputError
from ...passes.onnx_files import save_onnx_file
from .cache import _load_cache, cache_key, find_cache, write_cache
from .calibrator import _data_reader, _quiet_ort_quantization, calibrate_ranges
from .exclusions import QUANTIZED_OP_TYPES, name_nodes, sensitive_nodes
from .spec import CALIBRATION_METHODS, SMOOTH_QUANT_MODULE, QuantizeSpec, onnx_precision_types, smooth_quant_unavailable

logger = logging.getLogger(__name__)

#: Graphs (with their ``*.data`` files) above this many bytes are saved and quantized with external data.
LARGE_MODEL_BYTES = 1_800_000_000

Feeds = Sequence[Mapping[str, np.ndarray]]


def quantize_onnx(
    fp32_path: Path,
    out_path: Path,
    spec: QuantizeSpec,
    feeds: Feeds | Callable[[], Feeds] | None,
    *,
    cache_settings: Mapping[str, Any],
    cache_in: str | Path | None = None,
    cache_out: Path | None = None,
    component: str = "unet",
    calibrate: Callable[[Path, Any, Path], Any] | None = None,
) -> dict[str, Any]:
    """Quantize ``fp32_path`` into a QDQ graph at ``out_path`` (weights external beside it when > 1.8 GB).

    Args:
        fp32_path: the fp32 optimized graph.
        feeds: captured calibration feeds, or a function returning them (called only on a cache miss); may be
            ``None`` when ``cache_in`` holds matching ranges.
        cache_settings: what the ranges depend on besides ``spec`` (prompt hash, seed, sizes, model hash...).
        cache_in: a calibration cache to reuse (:func:`find_cache`); used when its key matches.
        cache_out: folder to write ``<component>.json`` + ``<component>.ranges.json`` into (the artifact's
            ``calibration/``).
        calibrate: on a cache miss, ``calibrate(graph_path, method, ranges_path)`` writes the ranges of the graph
            (e.g. :class:`LoopCalibrator` through the denoising loop) instead of :func:`calibrate_ranges` over
            ``feeds``; ``feeds`` are then only fetched for SmoothQuant.

    Returns:
        Manifest facts: settings, excluded nodes per category, QDQ counts, cache path/key/reused, seconds.

    Raises:
        BuildError: SmoothQuant without Intel Neural Compressor, no feeds and no usable cache, or ORT failed.
    """
    t0 = time.perf_counter()
    settings = {**spec.settings(), **cache_settings, "component": component}
    key = cache_key(settings)
    check_smooth_quant(spec)
    model = onnx.load(str(fp32_path))
    name_nodes(model)
    excluded = sensitive_nodes(model, spec.exclude)
    meta_path = find_cache(cache_in, component)
    ranges_src = _cached_ranges(meta_path, key, settings, spec, component)
    smooth = spec.smooth_quant_alpha is not None
    needs_feeds = smooth or (ranges_src is None and calibrate is None)
    if callable(feeds):
        feeds = feeds() if needs_feeds else None
    if needs_feeds and not feeds:
        raise BuildError(f"{component}: no calibration data and no matching calibration cache")
    method = _ort_method(spec)
    large = _is_large(fp32_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dtrt-quant-") as tmp:
        named, ranges_tmp = _save_named(model, ranges_src, Path(tmp), large)
        del model
        tq = time.perf_counter()
        ranges_seconds = 0.0
        with _ort_quantization(component):
            if ranges_src is None and not smooth:
                _compute_ranges(named, feeds, ranges_tmp, method, calibrate)
                ranges_seconds = time.perf_counter() - tq
            _quantize_static(named, out_path, spec, feeds, method, ranges_tmp, _nodes(excluded), large)
        quant_seconds = time.perf_counter() - tq
        cache_rel = write_cache(cache_out, component, key, settings, ranges_tmp) if cache_out is not None else None
    reused = ranges_src is not None
    return {
        **spec.settings(),
        "excluded": {k: len(v) for k, v in excluded.items()},
        "excluded_nodes": _nodes(excluded),
        "qdq": qdq_counts(out_path),
        "calibration": {"cache": cache_rel, "key": key, "reused": reused,
                        "reused_from": str(meta_path) if reused else None,
                        "samples": 0 if reused else len(feeds or [])},
        "seconds": round(time.perf_counter() - t0, 3),
        "quantize_seconds": round(quant_seconds, 3),
        # of which: computing the ranges (calibrator; with ``calibrate``, the whole loop) / writing the QDQ graph
        "ranges_seconds": round(ranges_seconds, 3),
        "qdq_seconds": round(quant_seconds - ranges_seconds, 3),
    }


def check_smooth_quant(spec: QuantizeSpec) -> None:
    """A SmoothQuant alpha in [0, 1], and the library that runs it importable (no-op without SmoothQuant).

    Raises:
        RuntimeInputError: alpha outside [0, 1].
        BuildError: Intel Neural Compressor's adaptor cannot be imported (the message says which releases have it).
    """
    if spec.smooth_quant_alpha is not None:
        if not 0.0 <= spec.smooth_quant_alpha <= 1.0:
            raise RuntimeInputError(f"--smooth-quant-alpha {spec.smooth_quant_alpha} must be in [0, 1]")
        why = smooth_quant_unavailable()
        if why is not None:
            raise BuildError(
                f"SmoothQuant (--smooth-quant-alpha) runs through onnxruntime.quantization, which imports "
                f"{SMOOTH_QUANT_MODULE}: {why}. Only neural-compressor 2.x to 3.7.1 ship it (3.8 removed it) and "
                "those releases require numpy<2: install `neural-compressor>=2.4,<3.8` in an environment with "
                "numpy<2 (plus a setuptools that still has pkg_resources), or drop --smooth-quant-alpha"
            )


def _cached_ranges(meta_path: Path | None, key: str, settings: Mapping[str, Any], spec: QuantizeSpec,
                   component: str) -> Path | None:
    """The cached ranges file to reuse, or ``None`` (no cache, another key, or SmoothQuant); the verdict is logged."""
    ranges_src: Path | None = None
    if meta_path is not None:
        ranges_src, why = _load_cache(meta_path, key, settings)
        if ranges_src is None:
            logger.info("%s: calibration cache %s not used (%s): calibrating", component, meta_path, why)
        elif spec.smooth_quant_alpha is not None:
            logger.info("%s: calibration cache not used: SmoothQuant needs the calibration data itself", component)
            ranges_src = None
        else:
            logger.info("%s: calibration cache hit (%s): skipping calibration", component, meta_path)
    return ranges_src


def _ort_method(spec: QuantizeSpec) -> Any:
    """The ``onnxruntime.quantization.CalibrationMethod`` of ``spec`` (fp8: Distribution).

    Raises:
        RuntimeInputError: an unknown method name.
    """
    from onnxruntime.quantization import CalibrationMethod

    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile, "distribution": CalibrationMethod.Distribution}
    if spec._method_name() not in method:
        raise RuntimeInputError(f"--calibration-method {spec.method!r}: use one of {', '.join(CALIBRATION_METHODS)}")
    return method[spec._method_name()]


def _is_large(fp32_path: Path) -> bool:
    """Whether the graph and the ``*.data`` files beside it pass :data:`LARGE_MODEL_BYTES` (then external data)."""
    return fp32_path.stat().st_size + sum(
        p.stat().st_size for p in fp32_path.parent.glob("*.data")) > LARGE_MODEL_BYTES


def _nodes(excluded: Mapping[str, Sequence[str]]) -> list[str]:
    """The excluded node names of every category, sorted, once each."""
    return sorted({n for names in excluded.values() for n in names})


def _save_named(model: onnx.ModelProto, ranges_src: Path | None, tmp: Path, large: bool) -> tuple[Path, Path]:
    """Save the named graph into ``tmp`` (and copy the cached ranges there); return ``(graph, ranges file)``."""
    ranges_tmp = tmp / "ranges.json"
    if ranges_src is not None:
        shutil.copyfile(ranges_src, ranges_tmp)
    named = tmp / "named.onnx"
    save_onnx_file(model, named, external=large)
    return named, ranges_tmp


@contextlib.contextmanager
def _ort_quantization(component: str) -> Iterator[None]:
    """ONNX Runtime's quantization quietly (and with a linear fp8 NaN check), its failures as :class:`BuildError`
    naming the component."""
    try:
        with _quiet_ort_quantization(), _fp8_nan_check_once():
            yield
    except (BuildError, RuntimeInputError):
        raise
    except Exception as e:
        raise BuildError(f"{component}: onnxruntime.quantization.quantize_static failed: {type(e).__name__}: {e}") \
            from e


@contextlib.contextmanager
def _fp8_nan_check_once() -> Iterator[None]:
    """Make onnxruntime.quantization's float8 NaN check linear instead of quadratic while it runs.

    ``ONNXModel.initializer_extend`` (onnxruntime 1.32, onnx_model.py) re-checks EVERY float8 initializer of the
    graph for NaN bytes, in a Python loop over each byte (``list(init.raw_data)``), each time it adds one; the fp8
    quantizer adds one per quantized bias. For the SD-1.5 UNet (~860 M fp8 bytes, hundreds of biases) that is
    hours of pure Python (measured: still running after 25 min on the 2-core CPU host). Here the same test (a byte
    ``b`` with ``b & 127 == 127`` is NaN in E4M3FN: S.1111.111) runs with numpy, once per initializer (keyed by
    name and byte length; the quantizer never rewrites an fp8 initializer in place). Same ``ValueError`` message.
    """
    from onnxruntime.quantization import onnx_model

    original = onnx_model.ONNXModel._check_init
    checked: set[tuple[str, int]] = set()

    def check_init(self: Any, init: onnx.TensorProto, test: Any = None) -> onnx.TensorProto:
        del self, test
        if init.data_type == onnx.TensorProto.FLOAT8E4M3FN and init.HasField("raw_data"):
            key = (init.name, len(init.raw_data))
            if key not in checked:
                if (np.frombuffer(init.raw_data, dtype=np.uint8) & 127 == 127).any():
                    raise ValueError(f"Initializer {init.name!r} has nan.")
                checked.add(key)
        return init

    onnx_model.ONNXModel._check_init = check_init
    try:
        yield
    finally:
        onnx_model.ONNXModel._check_init = original


def _compute_ranges(named: Path, feeds: Feeds | None, ranges: Path, method: Any,
                    calibrate: Callable[[Path, Any, Path], Any] | None) -> None:
    """Write the ranges of ``named`` to ``ranges``: through ``calibrate`` when given, else over ``feeds``."""
    if calibrate is not None:
        calibrate(named, method, ranges)
    else:
        calibrate_ranges(named, feeds or [], ranges, method)


def _quantize_static(named: Path, out_path: Path, spec: QuantizeSpec, feeds: Feeds | None, method: Any,
                     ranges: Path, nodes_to_exclude: list[str], large: bool) -> None:
    """``quantize_static`` from the ranges file (SmoothQuant also reads ``feeds``) into ``out_path``."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    act, weight, sym = onnx_precision_types(spec.precision, spec.backend)
    smooth = spec.smooth_quant_alpha is not None
    extra: dict[str, Any] = {"ActivationSymmetric": sym, "WeightSymmetric": True}
    if smooth:
        extra.update({"SmoothQuant": True, "SmoothQuantAlpha": spec.smooth_quant_alpha})
    quantize_static(
        str(named), str(out_path), _data_reader(feeds or []) if smooth else None,
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=list(QUANTIZED_OP_TYPES),
        per_channel=spec.per_channel,
        activation_type=act,
        weight_type=weight,
        nodes_to_exclude=nodes_to_exclude,
        use_external_data_format=large,
        calibrate_method=method,
        extra_options=extra,
        calibration_cache_path=str(ranges),
    )


def qdq_counts(path: Path) -> dict[str, int]:
    """QuantizeLinear / DequantizeLinear node counts of the graph at ``path`` (weights not loaded)."""
    ops = Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)
    return {"QuantizeLinear": ops.get("QuantizeLinear", 0), "DequantizeLinear": ops.get("DequantizeLinear", 0)}

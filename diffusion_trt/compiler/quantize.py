"""Explicit int8 / fp8 quantization (QDQ graphs) with ONNX Runtime's calibrators, a cache and a quality gate.

::

    fp32 optimized ONNX ──name nodes──► ──exclusions (structural)──► onnxruntime.quantization.quantize_static
        (QuantFormat.QDQ, per-channel symmetric weights, per-tensor activations, calibrated on captured feeds)
        ──► QDQ ONNX (TensorRT consumes it directly; ORT CPU fuses it into int8 kernels)
        ──► quality gate (ORT CPU: per-step cosine of the noise prediction, final-image PSNR) ──► or refuse

Quantized op types: :data:`QUANTIZED_OP_TYPES` (Conv, MatMul, Gemm). Everything else (Softmax, the
normalizations, GELU, attention contrib ops) stays in the float precision of the graph. Sensitive nodes of the
quantized types are left float by :data:`DEFAULT_EXCLUDE`, each category found from the graph's structure (never
from exporter-made node names):

* ``first_conv``      Conv with no Conv upstream: ``conv_in`` reads the raw latents / image.
* ``last_conv``       Conv with no Conv downstream: ``conv_out`` writes the noise prediction / pixels.
* ``time_embedding``  Conv/MatMul/Gemm whose inputs depend on the ``timestep`` input only: the sinusoidal
                      embedding's MLP and every ResNet's ``time_emb_proj`` (NVIDIA ModelOpt's diffusers recipe
                      leaves the same layers unquantized).
* ``attention_scores`` MatMuls that feed a Softmax or read one (Q·Kᵀ and P·V, present where attention is not fused).
* ``softmax``, ``normalization``  Softmax and the normalization ops; not of a quantized type, listed so that they stay
                      excluded when ``op_types`` is widened.

Override with ``QuantizeConfig.exclude``: any of these category names and/or node names; ``()`` excludes nothing.

Activations: per-tensor. For TensorRT, symmetric int8 (zero point 0: what TensorRT's explicit quantization
takes). For ONNX Runtime CPU, asymmetric uint8 activations with int8 weights (ORT's recommended "U8S8" for x86).
fp8: E4M3 weights and activations (``QuantType.QFLOAT8E4M3FN``) with ORT's ``Distribution`` calibrator, the only
one ORT accepts for float8; TensorRT only, and only for compute capability >= 8.9 (checked by the caller, before
any calibration).

SmoothQuant: ``onnxruntime.quantization`` implements it (``extra_options={"SmoothQuant": True,
"SmoothQuantAlpha": a}``) by importing Intel Neural Compressor's ONNX Runtime adaptor
(:data:`SMOOTH_QUANT_MODULE`); it then smooths every MatMul whose input comes from a foldable op (attention
projections and feed-forward layers in the UNet). That adaptor ships with neural-compressor 2.x through 3.7.1 only
(3.8 removed it; ``pip install neural-compressor`` gets 3.10 without it), and every one of those releases requires
numpy<2, so it cannot be installed beside this project's numpy 2 environment; see :func:`smooth_quant_unavailable`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import math
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ..errors import BuildError, QualityGateError, RuntimeInputError
from .calibrate import CapturedData, Generation, LoopSettings, ort_unet_fn

logger = logging.getLogger(__name__)

QUANTIZED_OP_TYPES: tuple[str, ...] = ("Conv", "MatMul", "Gemm")
EXCLUDE_CATEGORIES: tuple[str, ...] = (
    "first_conv", "last_conv", "time_embedding", "attention_scores", "softmax", "normalization",
)
DEFAULT_EXCLUDE: tuple[str, ...] = EXCLUDE_CATEGORIES
_NORM_OPS = frozenset({"LayerNormalization", "GroupNormalization", "InstanceNormalization", "BatchNormalization",
                       "GroupNorm", "SkipGroupNorm", "SkipLayerNormalization", "SimplifiedLayerNormalization"})
CALIBRATION_METHODS: tuple[str, ...] = ("minmax", "entropy", "percentile")
CACHE_FORMAT = 1
#: Calibration feeds run per ``collect_data`` call. The histogram calibrators (entropy, percentile, fp8's
#: distribution) hold every calibrated tensor of every feed of a call until it is folded (478 tensors of up to
#: [2, 320, 64, 64] for the SD-1.5 UNet at 512x512), so one feed per call. MinMax holds two scalars per tensor.
CALIBRATION_CHUNK = 1
#: Prompts denoised together by the calibration loops (UNet batch 2 * CALIBRATION_BATCH with CFG); see
#: ``Generation.run(batch_size=...)``; part of the cache key (a larger batch changes float rounding). 1: on the
#: 2-core CPU host the augmented SD-1.5 graph (ORT, no graph optimizations, as ORT's calibrators run it) took
#: 32.1 s per prompt and UNet call at batch 4 vs 25.6 s at batch 2 (both at load ~4.3) and peaked at 20.7 GiB RSS
#: instead of 14.0 GiB (benchmarks/results/README.md); the torch UNet is ~10 % faster per image at batch 4.
CALIBRATION_BATCH = 1


@dataclass(frozen=True)
class Thresholds:
    """Quality-gate thresholds (defaults are what a usable int8 SD-1.x UNet reaches; see the docs below).

    Attributes:
        min_cosine: lowest allowed per-step cosine similarity between the quantized and the fp32 UNet's noise
            prediction on held-out inputs (worst step). Default 0.98: published int8 SD UNets keep ~0.99+.
        min_psnr: lowest allowed PSNR (dB) of the final held-out image vs fp32, worst prompt. Default 20 dB:
            the same composition, visible texture noise at most (the error compounds over the whole loop).
    """

    min_cosine: float = 0.98
    min_psnr: float = 20.0


def onnx_precision_types(precision: str, backend: str) -> tuple[Any, Any, bool]:
    """(activation QuantType, weight QuantType, symmetric activations) for a product precision and backend."""
    from onnxruntime.quantization import QuantType

    if precision == "fp8":
        return QuantType.QFLOAT8E4M3FN, QuantType.QFLOAT8E4M3FN, True
    if precision == "int8":
        if backend == "tensorrt":
            return QuantType.QInt8, QuantType.QInt8, True
        return QuantType.QUInt8, QuantType.QInt8, False
    raise RuntimeInputError(f"precision={precision!r} is not a quantized precision; use int8 or fp8")


#: What ``onnxruntime.quantization.quantize_static`` imports for SmoothQuant (neural-compressor 2.x..3.7.1).
SMOOTH_QUANT_MODULE = "neural_compressor.adaptor.ox_utils.smooth_quant"


def smooth_quant_unavailable() -> str | None:
    """Why ``onnxruntime.quantization``'s SmoothQuant cannot run here, or ``None`` when it can.

    Imports :data:`SMOOTH_QUANT_MODULE` (and with it neural-compressor, seconds) when the package is installed.
    """
    if importlib.util.find_spec("neural_compressor") is None:
        return "Intel Neural Compressor (neural-compressor) is not installed"
    try:
        importlib.import_module(SMOOTH_QUANT_MODULE)
    except Exception as e:  # noqa: BLE001 - any import failure means the same to the caller
        from importlib.metadata import PackageNotFoundError, version

        try:
            have = f"neural-compressor {version('neural-compressor')}"
        except PackageNotFoundError:
            have = "the installed neural_compressor"
        return f"{have} cannot import {SMOOTH_QUANT_MODULE} ({type(e).__name__}: {e})"
    return None


def smooth_quant_available() -> bool:
    """Whether ``onnxruntime.quantization``'s SmoothQuant can run here (see :func:`smooth_quant_unavailable`)."""
    return smooth_quant_unavailable() is None


# -- structure: node names and the sensitive-node categories ---------------------------------------------------


def name_nodes(model: onnx.ModelProto) -> int:
    """Give every unnamed (or duplicately named) node a unique name, ``<op_type>_q<index>``; return how many.

    ``quantize_static`` addresses nodes by name; names are only handles here, never matched on.
    """
    seen: set[str] = set()
    renamed = 0
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_q{i}"
            renamed += 1
        seen.add(node.name)
    return renamed


def sensitive_nodes(model: onnx.ModelProto, categories: Sequence[str]) -> dict[str, list[str]]:
    """Node names per exclusion category (see the module docstring); unknown strings are taken as node names.

    Returns:
        ``{category: [node names]}``; explicit node names are grouped under ``"named"``.

    Raises:
        RuntimeInputError: a string is neither a category nor a node of the graph.
    """
    graph = model.graph
    nodes = list(graph.node)
    names = {n.name for n in nodes}
    consts = {t.name for t in graph.initializer}
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    out: dict[str, list[str]] = {}
    wanted = list(dict.fromkeys(categories))
    for item in wanted:
        if item not in EXCLUDE_CATEGORIES and item not in names:
            raise RuntimeInputError(
                f"quantize exclusion {item!r} is neither a category ({', '.join(EXCLUDE_CATEGORIES)}) nor a node of "
                "the graph; fix --quantize-exclude"
            )
    quantizable = [n for n in nodes if n.op_type in QUANTIZED_OP_TYPES]

    # graph inputs each tensor depends on (constants depend on none); nodes are topologically sorted
    deps: dict[str, frozenset[str]] = {i.name: frozenset({i.name}) for i in graph.input if i.name not in consts}
    conv_above: dict[str, bool] = {}
    for n in nodes:
        # Shape/Size read a tensor's shape, not its values: `timestep.expand(sample.shape[0])` is timestep-only
        shape_only = n.op_type in ("Shape", "Size")
        d: frozenset[str] = frozenset() if shape_only else frozenset().union(
            *(deps.get(i, frozenset()) for i in n.input if i))
        above = any(conv_above.get(i, False) for i in n.input if i) or n.op_type == "Conv"
        for o in n.output:
            deps[o] = d
            conv_above[o] = above
    conv_below: dict[str, bool] = {}
    for n in reversed(nodes):
        below = any(conv_below.get(o, False) for o in n.output)
        for i in n.input:
            conv_below[i] = conv_below.get(i, False) or below or n.op_type == "Conv"

    def first(n: onnx.NodeProto) -> bool:
        return n.op_type == "Conv" and not conv_above.get(n.input[0], False)

    def last(n: onnx.NodeProto) -> bool:
        return n.op_type == "Conv" and not any(conv_below.get(o, False) for o in n.output)

    def time_only(n: onnx.NodeProto) -> bool:
        d = frozenset().union(*(deps.get(i, frozenset()) for i in n.input if i))
        return d == frozenset({"timestep"})

    def near_softmax(n: onnx.NodeProto) -> bool:
        if n.op_type != "MatMul":
            return False
        reads = any(producer.get(i) is not None and producer[i].op_type == "Softmax" for i in n.input)
        feeds = any(c.op_type == "Softmax" for o in n.output for c in consumers.get(o, []))
        return reads or feeds

    tests = {"first_conv": first, "last_conv": last, "time_embedding": time_only, "attention_scores": near_softmax}
    for item in wanted:
        if item in tests:
            out[item] = [n.name for n in quantizable if tests[item](n)]
        elif item == "softmax":
            out[item] = [n.name for n in nodes if n.op_type == "Softmax"]
        elif item == "normalization":
            out[item] = [n.name for n in nodes if n.op_type in _NORM_OPS]
        else:
            out.setdefault("named", []).append(item)
    return out


# -- ONNX Runtime's calibration data reader -------------------------------------------------------------------


def _data_reader(feeds: Sequence[Mapping[str, np.ndarray]]) -> Any:
    """A ``CalibrationDataReader`` over captured feeds (restartable, supports ORT's strided calibration)."""
    from onnxruntime.quantization import CalibrationDataReader

    class _Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.start, self.end = 0, len(feeds)
            self._it: Iterator[Mapping[str, np.ndarray]] | None = None

        def get_next(self) -> dict[str, np.ndarray] | None:
            if self._it is None:
                self._it = iter(feeds[self.start:self.end])
            return dict(next(self._it, None) or {}) or None

        def rewind(self) -> None:
            self._it = None

        def set_range(self, start_index: int, end_index: int) -> None:
            self.start, self.end, self._it = start_index, end_index, None

        def __len__(self) -> int:
            return len(feeds)

    return _Reader()


@contextlib.contextmanager
def _quiet_ort_quantization() -> Iterator[None]:
    """Drop onnxruntime.quantization's root-logger nags ("consider pre-processing") while it runs."""

    class _Filter(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "pre-process" not in record.getMessage()

    f = _Filter()
    logging.getLogger().addFilter(f)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(f)


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


# -- the calibration cache -----------------------------------------------------------------------------------


def cache_key(settings: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of everything the ranges depend on."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def find_cache(location: str | Path | None, component: str) -> Path | None:
    """The cache metadata file for ``component`` at ``location``: a ``<component>.json`` file, or a folder holding
    ``<component>.json`` or ``calibration/<component>.json`` (an artifact folder). ``None`` if there is none."""
    if location is None:
        return None
    p = Path(location).expanduser()
    if p.is_file():
        return p
    for cand in (p / f"{component}.json", p / "calibration" / f"{component}.json"):
        if cand.is_file():
            return cand
    return None


def _load_cache(meta_path: Path, key: str, settings: Mapping[str, Any]) -> tuple[Path | None, str]:
    """(ranges file, reason) when the cache at ``meta_path`` matches ``key``; (None, why not) otherwise."""
    from ..artifacts import sha256_file

    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        return None, f"unreadable ({e})"
    if meta.get("format") != CACHE_FORMAT or meta.get("key") != key:
        old = meta.get("settings", {})
        differ = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        return None, f"settings differ: {', '.join(differ) or 'format'}"
    ranges = meta_path.parent / str(meta.get("ranges", ""))
    if not ranges.is_file():
        return None, f"its ranges file {ranges} is missing"
    if sha256_file(ranges) != meta.get("ranges_sha256"):
        return None, f"{ranges} does not match its recorded sha256"
    return ranges, "key matches"


def calibrate_ranges(model_path: Path, feeds: Sequence[Mapping[str, np.ndarray]], out: Path, method: Any) -> Path:
    """Run ONNX Runtime's calibrator (``create_calibrator``, as ``quantize_static`` does) over ``feeds`` and save
    the tensor ranges with ``save_tensors_data`` (the cache format ``quantize_static(calibration_cache_path=...)``
    reads back). Deterministic: same graph and feeds give a byte-identical file.

    Raises:
        BuildError: no feeds.
    """
    from onnxruntime.quantization import create_calibrator
    from onnxruntime.quantization.calibrate import save_tensors_data

    if not feeds:
        raise BuildError(f"no calibration data for {model_path.name}: raise --calibration-size")
    with tempfile.TemporaryDirectory(prefix="dtrt-calib-") as tmp:
        calibrator = create_calibrator(
            model_path, list(QUANTIZED_OP_TYPES), augmented_model_path=str(Path(tmp) / "augmented.onnx"),
            calibrate_method=method, use_external_data_format=True,
        )
        # Feed in chunks to bound the memory of the intermediate outputs (every tensor of every feed, GBs for
        # SD-1.5); each collect_data call folds its chunk into the running ranges. Not ORT's own
        # max_intermediate_outputs: in onnxruntime 1.32 MinMaxCalibrater.collect_data clears the collected
        # outputs when that count is reached without computing their ranges ("No data is collected").
        for start in range(0, len(feeds), CALIBRATION_CHUNK):
            calibrator.collect_data(_data_reader(feeds[start:start + CALIBRATION_CHUNK]))
        ranges = calibrator.compute_data()
        del calibrator
    save_tensors_data(ranges, out)
    return out



class _ReplaySession:
    """Stands in for a calibrator's ``infer_session`` for one ``collect_data`` call: ``run`` returns outputs that
    were already computed for the very feed the reader gives (everything else goes to the real session)."""

    def __init__(self, session: Any, outputs: list[np.ndarray]) -> None:
        self._session = session
        self._outputs = outputs

    def run(self, output_names: Any, feeds: Any, *args: Any, **kwargs: Any) -> list[np.ndarray]:
        del output_names, feeds, args, kwargs
        return self._outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


class LoopCalibrator:
    """ONNX Runtime's calibrator driven by the denoising loop itself: one run of the augmented fp32 UNet graph per
    UNet call both continues the loop (its ``noise_pred``) and yields that call's tensor statistics.

    ::

        prompts ──loop (Generation.run, unet_fn=this.unet_fn)──► augmented graph: noise_pred + statistics per call
                                     captured step: on_capture=this.fold ──► calibrator.collect_data (its own merge)

    Why: capturing the inputs with the torch UNet and then replaying them through the augmented graph runs the
    UNet twice per captured step. Here the graph being quantized denoises: same prompts, seeds, schedule, size and
    captured steps, half the UNet runs; its inputs differ from the torch loop's by fp32 rounding only (the same
    function, other kernels). The statistics are folded by the calibrator's own ``collect_data`` (one call's
    outputs replayed through :class:`_ReplaySession`), one UNet call at a time: memory holds one call's
    intermediate outputs at most (MinMax: two scalars per tensor; histogram methods: the tensors).

    Deterministic: same graph, prompts and settings give a byte-identical ranges file on the same machine and
    library versions (ONNX Runtime's CPU kernels do not depend on timing).

    Args:
        model_path: the fp32 graph to calibrate (inputs ``sample``, ``timestep``, ``encoder_hidden_states``).
        method: an ``onnxruntime.quantization.CalibrationMethod``.
        work_dir: where the augmented graph is written (a temporary folder; ~ the size of the graph).
        output_name: the graph output the loop continues with.
    """

    def __init__(self, model_path: Path, method: Any, work_dir: Path, output_name: str = "noise_pred") -> None:
        from onnxruntime.quantization import create_calibrator

        self.calibrator = create_calibrator(
            model_path, list(QUANTIZED_OP_TYPES), augmented_model_path=str(Path(work_dir) / "augmented.onnx"),
            calibrate_method=method, use_external_data_format=True,
        )
        self.session = self.calibrator.infer_session
        names = [o.name for o in self.session.get_outputs()]
        if output_name not in names:
            raise BuildError(f"{model_path}: no output {output_name!r} to continue the calibration loop with")
        self._index = names.index(output_name)
        self._last: tuple[dict[str, np.ndarray], list[np.ndarray]] | None = None
        self.calls = 0
        self.folded = 0

    def unet_fn(self, sample: Any, timestep: Any, encoder_hidden_states: Any) -> Any:
        """A :data:`~.calibrate.UNetFn`: run the augmented graph, keep the statistics until :meth:`fold`."""
        import torch

        feeds = {"sample": sample.numpy(), "timestep": timestep.numpy(),
                 "encoder_hidden_states": encoder_hidden_states.numpy()}
        outputs = self.session.run(None, feeds)
        self._last = (feeds, outputs)
        self.calls += 1
        return torch.from_numpy(outputs[self._index])

    def fold(self) -> None:
        """Fold the statistics of the last UNet call into the ranges (the loop's ``on_capture``)."""
        if self._last is None:
            raise BuildError("LoopCalibrator.fold called before any UNet call")
        feeds, outputs = self._last
        self._last = None
        self.calibrator.infer_session = _ReplaySession(self.session, outputs)
        try:
            self.calibrator.collect_data(_data_reader([feeds]))
        finally:
            self.calibrator.infer_session = self.session
        self.folded += 1

    def save(self, out: Path) -> Path:
        """Write the ranges (``save_tensors_data``, the format of :func:`calibrate_ranges`); free the session.

        Raises:
            BuildError: nothing was folded.
        """
        from onnxruntime.quantization.calibrate import save_tensors_data

        if not self.folded:
            raise BuildError("no calibration data: the loop captured no UNet call; raise --calibration-size")
        save_tensors_data(self.calibrator.compute_data(), out)
        self.close()
        return out

    def close(self) -> None:
        """Drop the calibrator and its session (GBs for SD-1.5)."""
        self.calibrator = None  # type: ignore[assignment]
        self.session = None


# -- quantize -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizeSpec:
    """What :func:`quantize_onnx` does to one component.

    Attributes:
        precision: "int8" or "fp8".
        backend: "ort" or "tensorrt" (chooses the activation type, see the module docstring).
        method: "minmax", "entropy" or "percentile" (int8); fp8 always uses ORT's "distribution".
        per_channel: per-output-channel weight scales.
        exclude: exclusion categories and/or node names (module docstring).
        smooth_quant_alpha: SmoothQuant migration strength in [0, 1]; ``None`` = off.
    """

    precision: str
    backend: str
    method: str = "minmax"
    per_channel: bool = True
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    smooth_quant_alpha: float | None = None

    def settings(self) -> dict[str, Any]:
        act, weight, sym = onnx_precision_types(self.precision, self.backend)
        return {"precision": self.precision, "backend": self.backend, "method": self._method_name(),
                "per_channel": self.per_channel, "activation_type": act.name, "weight_type": weight.name,
                "symmetric_activations": sym, "smooth_quant_alpha": self.smooth_quant_alpha,
                "op_types": list(QUANTIZED_OP_TYPES)}

    def _method_name(self) -> str:
        return "distribution" if self.precision == "fp8" else self.method


def quantize_onnx(
    fp32_path: Path,
    out_path: Path,
    spec: QuantizeSpec,
    feeds: Sequence[Mapping[str, np.ndarray]] | Callable[[], Sequence[Mapping[str, np.ndarray]]] | None,
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
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, quantize_static

    t0 = time.perf_counter()
    settings = {**spec.settings(), **cache_settings, "component": component}
    key = cache_key(settings)
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
    model = onnx.load(str(fp32_path))
    name_nodes(model)
    excluded = sensitive_nodes(model, spec.exclude)
    nodes_to_exclude = sorted({n for names in excluded.values() for n in names})

    ranges_src: Path | None = None
    meta_path = find_cache(cache_in, component)
    if meta_path is not None:
        ranges_src, why = _load_cache(meta_path, key, settings)
        if ranges_src is None:
            logger.info("%s: calibration cache %s not used (%s): calibrating", component, meta_path, why)
        elif spec.smooth_quant_alpha is not None:
            logger.info("%s: calibration cache not used: SmoothQuant needs the calibration data itself", component)
            ranges_src = None
        else:
            logger.info("%s: calibration cache hit (%s): skipping calibration", component, meta_path)
    smooth = spec.smooth_quant_alpha is not None
    if callable(feeds):
        feeds = feeds() if smooth or (ranges_src is None and calibrate is None) else None
    if (smooth or (ranges_src is None and calibrate is None)) and not feeds:
        raise BuildError(f"{component}: no calibration data and no matching calibration cache")

    act, weight, sym = onnx_precision_types(spec.precision, spec.backend)
    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile, "distribution": CalibrationMethod.Distribution}
    if spec._method_name() not in method:
        raise RuntimeInputError(f"--calibration-method {spec.method!r}: use one of {', '.join(CALIBRATION_METHODS)}")
    extra: dict[str, Any] = {"ActivationSymmetric": sym, "WeightSymmetric": True}
    if spec.smooth_quant_alpha is not None:
        extra.update({"SmoothQuant": True, "SmoothQuantAlpha": spec.smooth_quant_alpha})
    large = fp32_path.stat().st_size + sum(
        p.stat().st_size for p in fp32_path.parent.glob("*.data")) > 1_800_000_000
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dtrt-quant-") as tmp:
        ranges_tmp = Path(tmp) / "ranges.json"
        if ranges_src is not None:
            shutil.copyfile(ranges_src, ranges_tmp)
        named = Path(tmp) / "named.onnx"
        onnx.save_model(model, str(named), save_as_external_data=large, all_tensors_to_one_file=True,
                        location="named.onnx.data")
        del model
        tq = time.perf_counter()
        ranges_seconds = 0.0
        try:
            with _quiet_ort_quantization(), _fp8_nan_check_once():
                if ranges_src is None and not smooth:
                    if calibrate is not None:
                        calibrate(named, method[spec._method_name()], ranges_tmp)
                    else:
                        calibrate_ranges(named, feeds or [], ranges_tmp, method[spec._method_name()])
                    ranges_seconds = time.perf_counter() - tq
                quantize_static(
                    str(named), str(out_path), _data_reader(feeds or []) if smooth else None,
                    quant_format=QuantFormat.QDQ,
                    op_types_to_quantize=list(QUANTIZED_OP_TYPES),
                    per_channel=spec.per_channel,
                    activation_type=act,
                    weight_type=weight,
                    nodes_to_exclude=nodes_to_exclude,
                    use_external_data_format=large,
                    calibrate_method=method[spec._method_name()],
                    extra_options=extra,
                    calibration_cache_path=str(ranges_tmp),
                )
        except (BuildError, RuntimeInputError):
            raise
        except Exception as e:
            raise BuildError(f"{component}: onnxruntime.quantization.quantize_static failed: {type(e).__name__}: {e}") \
                from e
        quant_seconds = time.perf_counter() - tq
        cache_rel = None
        if cache_out is not None:
            cache_out.mkdir(parents=True, exist_ok=True)
            ranges_dst = cache_out / f"{component}.ranges.json"
            shutil.copyfile(ranges_tmp, ranges_dst)
            from ..artifacts import sha256_file, write_json_atomic

            write_json_atomic(cache_out / f"{component}.json", {
                "format": CACHE_FORMAT, "key": key, "settings": settings,
                "ranges": ranges_dst.name, "ranges_sha256": sha256_file(ranges_dst),
            })
            cache_rel = f"{cache_out.name}/{component}.json"
    qmodel = onnx.load(str(out_path), load_external_data=False)
    ops = Counter(n.op_type for n in qmodel.graph.node)
    return {
        **spec.settings(),
        "excluded": {k: len(v) for k, v in excluded.items()},
        "excluded_nodes": nodes_to_exclude,
        "qdq": {"QuantizeLinear": ops.get("QuantizeLinear", 0), "DequantizeLinear": ops.get("DequantizeLinear", 0)},
        "calibration": {"cache": cache_rel, "key": key, "reused": ranges_src is not None,
                        "reused_from": str(meta_path) if ranges_src is not None else None,
                        "samples": 0 if ranges_src is not None else len(feeds or [])},
        "seconds": round(time.perf_counter() - t0, 3),
        "quantize_seconds": round(quant_seconds, 3),
        # of which: computing the ranges (calibrator; with ``calibrate``, the whole loop) / writing the QDQ graph
        "ranges_seconds": round(ranges_seconds, 3),
        "qdq_seconds": round(quant_seconds - ranges_seconds, 3),
    }


# -- the quality gate -----------------------------------------------------------------------------------------


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two arrays, flattened, in float64 (1.0 when both are all zero)."""
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    den = float(np.linalg.norm(x) * np.linalg.norm(y))
    return 1.0 if den == 0.0 else float(np.dot(x, y) / den)


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 1.0) -> float:
    """PSNR in dB of two images in [0, peak] (``inf`` when identical; reported as 99.0)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0.0 else min(99.0, 10.0 * math.log10(peak * peak / mse))


def cpu_session(path: Path, threads: int | None = None) -> Any:
    """An ONNX Runtime CPU session (full graph optimization: QDQ fuses into int8 kernels, as at run time)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def measure_quality(
    component: str,
    fp32_path: Path,
    quant_path: Path,
    reference: CapturedData,
    generation: Generation | None,
    prompts: Sequence[str],
    settings: LoopSettings,
) -> dict[str, Any]:
    """Compare the quantized graph with fp32 on held-out data (ONNX Runtime CPU for both graphs).

    UNet: per captured step, cosine similarity of the noise predictions of the fp32 and the quantized graph on
    the same held-out input; then every held-out prompt generated again with the quantized UNet, PSNR of its
    final image against the fp32 one (``reference.images``). VAE decoder: cosine and PSNR of the decoded images.

    Returns:
        ``{"cosine_min", "cosine_mean", "cosine_per_step", "psnr_min_db", "psnr_mean_db", "held_out_prompts",
        "steps", "seconds"}``.
    """
    t0 = time.perf_counter()
    ref_sess, q_sess = cpu_session(fp32_path), cpu_session(quant_path)
    feeds = reference.feeds[component]
    out_name = "noise_pred" if component == "unet" else "sample"
    cos = []
    for f in feeds:
        a = ref_sess.run([out_name], dict(f))[0]
        b = q_sess.run([out_name], dict(f))[0]
        cos.append(cosine(a, b))
    if component == "unet":
        assert generation is not None
        quant = generation.run(prompts, settings, ort_unet_fn(q_sess), decode=True)
        psnrs = [psnr(a, b) for a, b in zip(reference.images, quant.images, strict=True)]
    else:
        psnrs = []
        for f in feeds:
            a = ref_sess.run([out_name], dict(f))[0]
            b = q_sess.run([out_name], dict(f))[0]
            psnrs.append(psnr(np.clip(a * 0.5 + 0.5, 0, 1), np.clip(b * 0.5 + 0.5, 0, 1)))
    return {
        "cosine_min": round(min(cos), 6),
        "cosine_mean": round(float(np.mean(cos)), 6),
        "cosine_per_step": [round(c, 6) for c in cos],
        "psnr_min_db": round(min(psnrs), 3),
        "psnr_mean_db": round(float(np.mean(psnrs)), 3),
        "held_out_prompts": len(prompts),
        "steps": settings.to_json(),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def quality_gate(component: str, figures: dict[str, Any], thresholds: Thresholds, accept_quality_loss: bool) -> None:
    """Refuse (raise) when a figure is below its threshold, unless ``accept_quality_loss``; record the verdict.

    Adds ``thresholds``, ``passed`` and ``accepted_quality_loss`` to ``figures``.

    Raises:
        QualityGateError: naming the figure, its value, the threshold and the flags that change the outcome.
    """
    failures = []
    if figures["cosine_min"] < thresholds.min_cosine:
        failures.append(f"worst per-step cosine similarity {figures['cosine_min']:.4f} < --min-cosine "
                        f"{thresholds.min_cosine}")
    if figures["psnr_min_db"] < thresholds.min_psnr:
        failures.append(f"worst final-image PSNR {figures['psnr_min_db']:.2f} dB < --min-psnr {thresholds.min_psnr} dB")
    figures["thresholds"] = {"min_cosine": thresholds.min_cosine, "min_psnr_db": thresholds.min_psnr}
    figures["passed"] = not failures
    figures["accepted_quality_loss"] = bool(failures) and accept_quality_loss
    if failures and not accept_quality_loss:
        raise QualityGateError(
            f"quality gate: the quantized {component} is too far from fp32 on {figures['held_out_prompts']} held-out "
            f"prompts: {'; '.join(failures)}. Nothing was written. Pass --accept-quality-loss to write it anyway, or "
            "calibrate on more data (--calibration-size, --calibration-steps), exclude more layers "
            "(--quantize-exclude), or try --calibration-method entropy/percentile"
        )
    if failures:
        logger.warning("%s: quality below threshold, written anyway (--accept-quality-loss): %s",
                       component, "; ".join(failures))


# -- the compile stage ----------------------------------------------------------------------------------------


def check_fp8_target(precision: str, target_compute_capability: str | None) -> str | None:
    """fp8 only: the target GPU's compute capability, checked >= 8.9 before anything is calibrated.

    Args:
        target_compute_capability: ``--target-compute-capability``; ``None`` = this machine's CUDA GPU.

    Returns:
        The compute capability as "major.minor" (``None`` for int8, which every TensorRT GPU runs).

    Raises:
        BuildError: fp8 on a GPU older than 8.9, or no GPU here and no ``--target-compute-capability``.
    """
    from .. import trt_compat

    if precision != "fp8":
        return None
    cc = target_compute_capability
    if cc is None:
        import torch

        if not torch.cuda.is_available():
            raise BuildError(
                "precision fp8 needs a GPU of compute capability >= 8.9 (Ada Lovelace, Hopper or newer) and this "
                "machine has no CUDA GPU to check; pass --target-compute-capability (e.g. 8.9 or 9.0) for the GPU "
                "the engine is for, or use --precision int8"
            )
        cc = "{}.{}".format(*torch.cuda.get_device_capability())
    parsed = trt_compat.parse_compute_capability(cc)
    try:
        trt_compat.check_precision_supported(["fp8"], parsed)
    except BuildError as e:
        raise BuildError(f"{e} (or --precision int8); checked before calibrating") from None
    return trt_compat.format_compute_capability(parsed)


class QuantizeStage:
    """Calibrate -> quantize -> gate for the components of one compile, sharing the captured data.

    Calibration feeds are captured once, on the first cache miss (all components from the same loops): the UNet's
    ranges come from the loop its own fp32 graph drives (:class:`LoopCalibrator`, one UNet run per step), the VAE
    decoder's from the final latents of that loop (or of the torch UNet's loop when the UNet's ranges came from the
    cache, or with SmoothQuant, which needs the feeds themselves). The held-out reference once, on the first gate.

    Args:
        generation: the fp32 torch modules, tokenizer and scheduler (:class:`~.calibrate.Generation`).
        config: the ``QuantizeConfig`` (see diffusion_trt/config.py).
        precision, backend: "int8"/"fp8"; "ort"/"tensorrt".
        height, width: calibration image size (the profile's opt size).
        key_facts: more things the ranges depend on (model hash, pass pipeline, tool versions).
    """

    def __init__(self, generation: Generation, config: Any, precision: str, backend: str, height: int, width: int,
                 key_facts: Mapping[str, Any]) -> None:
        from .calibrate import prompts_sha256, read_prompts, select_prompts

        self.generation = generation
        self.config = config
        self.spec = QuantizeSpec(
            precision=precision, backend=backend, method=config.method,
            exclude=DEFAULT_EXCLUDE if config.exclude is None else tuple(config.exclude),
            smooth_quant_alpha=config.smooth_quant_alpha,
        )
        self.prompts = select_prompts(read_prompts(config.prompts), config.size)
        self.settings = LoopSettings(steps=config.steps, seed=config.seed, height=height, width=width)
        self.batch_size = CALIBRATION_BATCH
        # the UNet is calibrated through the loop its own fp32 graph drives (LoopCalibrator), prompts in batches
        self.key_facts = {**key_facts, "prompts_sha256": prompts_sha256(self.prompts), "size": config.size,
                          **{f"loop_{k}": v for k, v in self.settings.to_json().items()},
                          "loop_batch_size": self.batch_size, "loop_unet": "onnx"}
        self.thresholds = Thresholds(config.min_cosine, config.min_psnr)
        from .calibrate import HELD_OUT_PROMPTS

        self.held_out = list(HELD_OUT_PROMPTS[: config.held_out])
        self._data: CapturedData | None = None
        self._reference: CapturedData | None = None
        self.capture_seconds = 0.0

    def _feeds(self, component: str) -> list[dict[str, np.ndarray]]:
        """The captured feeds of ``component`` (the torch loop runs once if no loop ran yet: SmoothQuant, or a VAE
        decoder calibrated after a UNet cache hit)."""
        if self._data is None:
            t0 = time.perf_counter()
            logger.info("calibration: %d prompts x %d steps (seed %d, %dx%d, torch UNet)", len(self.prompts),
                        self.settings.steps, self.settings.seed, self.settings.width, self.settings.height)
            self._data = self.generation.run(self.prompts, self.settings, batch_size=self.batch_size)
            self.capture_seconds = time.perf_counter() - t0
        return self._data.feeds[component]

    def _loop_ranges(self, graph: Path, method: Any, out: Path) -> None:
        """Calibrate the UNet graph through the denoising loop it drives itself (:class:`LoopCalibrator`); the
        feeds the loop saw are kept for the components after it (the VAE decoder's) and for the record."""
        t0 = time.perf_counter()
        logger.info("calibration: %d prompts x %d steps (seed %d, %dx%d, the fp32 UNet graph through ONNX Runtime, "
                    "%d prompts per UNet call)", len(self.prompts), self.settings.steps, self.settings.seed,
                    self.settings.width, self.settings.height, self.batch_size)
        with tempfile.TemporaryDirectory(prefix="dtrt-calib-") as tmp:
            loop = LoopCalibrator(graph, method, Path(tmp))
            try:
                self._data = self.generation.run(
                    self.prompts, self.settings, loop.unet_fn, batch_size=self.batch_size,
                    final_latents="vae_decoder" in self.config.components, on_capture=loop.fold,
                )
                loop.save(out)
            finally:
                loop.close()
        self.capture_seconds = time.perf_counter() - t0

    def run(self, component: str, fp32_path: Path, out_path: Path, cache_out: Path) -> dict[str, Any]:
        """Quantize ``fp32_path`` into ``out_path``, store the cache in ``cache_out``, measure and gate.

        Returns:
            The manifest's ``quantization`` entry, ``quality`` included.

        Raises:
            QualityGateError: below a threshold without ``accept_quality_loss``.
        """
        loop = component == "unet" and self.spec.smooth_quant_alpha is None
        facts = quantize_onnx(fp32_path, out_path, self.spec, lambda: self._feeds(component),
                              cache_settings=self.key_facts, cache_in=self.config.cache, cache_out=cache_out,
                              component=component, calibrate=self._loop_ranges if loop else None)
        calibration = facts["calibration"]
        if not calibration["reused"] and self._data is not None:
            calibration["samples"] = len(self._data.feeds[component])
        calibration.update({"prompts_sha256": self.key_facts["prompts_sha256"], "seed": self.settings.seed,
                            "size": self.config.size, "steps": self.settings.steps,
                            "loop": "onnx" if loop else "torch", "batch_size": self.batch_size,
                            "capture_seconds": round(self.capture_seconds, 3)})
        self._share_cache(component, cache_out, facts)
        if self._reference is None:
            self._reference = self.generation.run(self.held_out, self.settings, decode=True)
        figures = measure_quality(component, fp32_path, out_path, self._reference, self.generation, self.held_out,
                                  self.settings)
        facts["quality"] = figures
        logger.info("%s %s quality: cosine min %.4f mean %.4f, PSNR min %.2f dB (%d held-out prompts)",
                    component, self.spec.precision, figures["cosine_min"], figures["cosine_mean"],
                    figures["psnr_min_db"], len(self.held_out))
        quality_gate(component, figures, self.thresholds, self.config.accept_quality_loss)
        return facts

    def _share_cache(self, component: str, cache_out: Path, facts: dict[str, Any]) -> None:
        """A ``--calibration-cache`` folder without this cache receives a copy (so later compiles reuse it)."""
        loc = self.config.cache
        if loc is None or facts["calibration"]["reused"]:
            return
        p = Path(loc).expanduser()
        if p.is_file() or p.suffix == ".json" or (p / "manifest.json").exists():
            return
        p.mkdir(parents=True, exist_ok=True)
        for name in (f"{component}.json", f"{component}.ranges.json"):
            shutil.copyfile(cache_out / name, p / name)
        logger.info("%s: calibration cache written to %s", component, p)

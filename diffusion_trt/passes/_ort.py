"""Run a graph with ONNX Runtime for the checks around the passes (fp16 range check, ``optimize --check``).

ONNX Runtime is imported lazily, only by the functions here: the passes themselves need only onnx,
onnx-graphsurgeon and numpy. Where a graph runs: the CPU provider when every op of the graph has a CPU kernel
there, otherwise CUDA when this ONNX Runtime has it; when neither can run it :func:`open_session` says why
(e.g. ``com.microsoft.GroupNorm`` has only a CUDA kernel, so an ``ort-cuda`` graph does not run on a CPU-only
machine).
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from diffusion_trt.errors import ModelFileError

logger = logging.getLogger(__name__)

#: Models bigger than this are handed to ONNX Runtime as a file with external data (protobuf stops at 2 GiB).
INLINE_LIMIT_BYTES = 1_800_000_000
#: Initializers of this size or more go to the data file of :func:`weights_on_disk` (onnx's own default threshold).
EXTERNAL_MIN_BYTES = 1024
#: The data file's name in :func:`weights_on_disk`'s folder.
WEIGHTS_FILE = "weights.data"

#: Intermediate tensors exposed per session when every activation is read (bounds the memory of one run).
EXPOSE_PER_RUN = 256
#: Bytes of exposed intermediate tensors per session run (by their inferred shapes): the count alone let the SD-1.5
#: VAE decoder's range check at 512x512 hold 256 full-resolution activations at once (18.2 GB peak RSS of a b1
#: compile on the H200 host, issue 28; 4x that at batch 4). Tensors of unknown size count as this budget / 16.
EXPOSE_BYTES_PER_RUN = 2 << 30

_ONNX_TO_NUMPY = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64,
                  TensorProto.INT64: np.int64, TensorProto.INT32: np.int32, TensorProto.INT8: np.int8,
                  TensorProto.UINT8: np.uint8, TensorProto.BOOL: np.bool_}


@dataclass
class Session:
    """An ONNX Runtime session and the provider it runs on ("CPUExecutionProvider" / "CUDAExecutionProvider")."""

    session: Any
    provider: str

    def run(self, feeds: Mapping[str, np.ndarray], names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """Run on ``feeds`` (cast to the dtypes the graph's inputs declare) and return ``{output name: array}``."""
        wanted = list(names) if names is not None else [o.name for o in self.session.get_outputs()]
        typed = self._typed(feeds)
        try:
            return dict(zip(wanted, self.session.run(wanted, typed), strict=True))
        except Exception as err:
            raise self._failure(typed, err) from err

    def run_values(self, feeds: Mapping[str, np.ndarray], names: Sequence[str]) -> Iterator[tuple[str, float]]:
        """``(name, peak(value))`` of each output ``names`` on ``feeds``, one at a time: ONNX Runtime's own buffers are
        read in place and each is released once read (``run`` copies all of them out first: twice a group's
        bytes at once)."""
        from onnxruntime import OrtValue

        typed = self._typed(feeds)
        try:
            values = self.session.run_with_ort_values(
                list(names), {name: OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for name, v in typed.items()})
        except Exception as err:
            raise self._failure(typed, err) from err
        for index, name in enumerate(names):
            value, values[index] = values[index], None
            yield name, peak(value.numpy())
            del value

    def _typed(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The feeds the graph takes, cast to the dtypes its inputs declare (others dropped)."""
        inputs = {i.name: i.type for i in self.session.get_inputs()}
        return {name: _as_type(value, inputs.get(name)) for name, value in feeds.items() if name in inputs}

    def _failure(self, typed: Mapping[str, np.ndarray], err: BaseException) -> ModelFileError:
        """The error of a run that failed on ``typed``: the feeds' shapes, the provider and ORT's first line."""
        shapes = ", ".join(f"{name}:{'x'.join(map(str, value.shape)) or 'scalar'}" for name, value in typed.items())
        return ModelFileError(
            f"the graph does not run on these inputs ({shapes}) on {self.provider}: {_first_line(err)}; give the "
            "real sizes with --shape NAME:DxD.. or real inputs with --inputs FILE.npz")


def _as_type(value: np.ndarray, ort_type: str | None) -> np.ndarray:
    table = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
             "tensor(int64)": np.int64, "tensor(int32)": np.int32}
    dtype = table.get(ort_type or "")
    return np.asarray(value, dtype=dtype) if dtype is not None else np.asarray(value)


def available_providers() -> list[str]:
    """The providers of the installed ONNX Runtime that :func:`open_session` may use, CPU first."""
    import onnxruntime as ort

    have = ort.get_available_providers()
    return [p for p in ("CPUExecutionProvider", "CUDAExecutionProvider") if p in have]


def open_session(model: onnx.ModelProto, providers: Iterable[str] | None = None) -> Session | str:
    """A session for ``model`` on the first provider (CPU, then CUDA) that can run every op of it, or the reason
    none can: ``"CPUExecutionProvider: ...NOT_IMPLEMENTED... GroupNorm...; CUDAExecutionProvider: not in this
    onnxruntime"``. Graph optimizations are off: what runs is the graph as written. ``model`` is not changed (a big
    one goes to ONNX Runtime as a file: :func:`weights_on_disk`)."""
    if model.ByteSize() < INLINE_LIMIT_BYTES:
        return _session(model.SerializeToString(), providers)
    with weights_on_disk(model) as (light, folder):
        return _session(_save_light(light, folder, "model.onnx"), providers)


def _session(source: Any, providers: Iterable[str] | None) -> Session | str:
    """:func:`open_session` on serialized bytes or a path."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # no arena: its blocks stay with the session to its end and are extended by powers of two, so a run of a big
    # graph (the VAE decoder's range check at batch 4: 512 MiB activations; issue 28) can hold more than its live
    # tensors; without it each tensor's memory goes back when the tensor dies
    options.enable_cpu_mem_arena = False
    options.log_severity_level = 4  # failures are reported by the caller, with the fix
    have = set(ort.get_available_providers())
    reasons: list[str] = []
    for provider in providers or ("CPUExecutionProvider", "CUDAExecutionProvider"):
        if provider not in have:
            reasons.append(f"{provider}: not in this onnxruntime ({ort.__version__})")
            continue
        try:
            session = ort.InferenceSession(source, options, providers=[provider])
        except Exception as err:  # noqa: BLE001 - ORT raises its own classes (Fail, NotImplemented...)
            reasons.append(f"{provider}: {_first_line(err)}")
            continue
        return Session(session, provider)
    return "; ".join(reasons)


@contextlib.contextmanager
def weights_on_disk(model: onnx.ModelProto) -> Iterator[tuple[onnx.ModelProto, Path]]:
    """``(light, folder)``: a copy of ``model`` whose initializers of :data:`EXTERNAL_MIN_BYTES` or more are
    references into one data file (:data:`WEIGHTS_FILE`) in a temporary ``folder``, written once; ``model`` is not
    changed. A graph saved into ``folder`` from ``light`` (or a variant of it: extra outputs) loads with those
    weights, so sessions of several variants of one big graph cost one write of the weights and no copy of them in
    memory.

    Why: the fp16 range check opens one session per group of exposed tensors; each used to copy the whole proto and
    write its weights again, and ``open_session`` rewrote the caller's proto into references to a folder it then
    deleted. (The SD-1.5 UNet, 3.4 GB fp32, is above ``fp16_check.MAX_CHECKED_WEIGHT_BYTES`` and is converted
    unchecked, so its passes' peak, 12.2 GB of a b1 compile on the H200 host on 2026-12-02, is not from here.)"""
    with tempfile.TemporaryDirectory(prefix="dtrt-ort-") as tmp:
        folder = Path(tmp)
        light = _light_copy(model)
        with open(folder / WEIGHTS_FILE, "wb") as data:
            for init in model.graph.initializer:
                light.graph.initializer.append(_external_or_copy(init, data))
        yield light, folder


def _light_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` without its initializers (the rest is small: nodes, value infos, opsets)."""
    light = onnx.ModelProto(ir_version=model.ir_version, producer_name=model.producer_name)
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    graph, out = model.graph, light.graph
    out.name = graph.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(out, field).extend(getattr(graph, field))
    return light


def _external_or_copy(init: TensorProto, data: Any) -> TensorProto:
    """A reference to ``init``'s bytes appended to the open file ``data``, or a copy of a small or non-raw tensor."""
    if init.data_location == TensorProto.EXTERNAL or not init.HasField("raw_data"):
        return init  # appended by copy: a tensor in typed fields, or one that already points elsewhere
    raw = init.raw_data
    if len(raw) < EXTERNAL_MIN_BYTES:
        return init
    ref = TensorProto(name=init.name, dims=init.dims, data_type=init.data_type, data_location=TensorProto.EXTERNAL)
    for key, value in (("location", WEIGHTS_FILE), ("offset", str(data.tell())), ("length", str(len(raw)))):
        entry = ref.external_data.add()
        entry.key, entry.value = key, value
    data.write(raw)
    return ref


def _save_light(light: onnx.ModelProto, folder: Path, name: str) -> str:
    """Save a graph whose weights are in ``folder``'s data file (:func:`weights_on_disk`); returns its path."""
    path = folder / name
    path.write_bytes(light.SerializeToString())
    return str(path)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


def float_tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """``{tensor name: ONNX elem type}`` for every float (fp32/fp16) node output of the main graph, from shape
    inference (models over 2 GiB: only the types the model already declares)."""
    return {name: elem for name, (elem, _size) in _float_tensors(model).items()}


def _float_tensors(model: onnx.ModelProto) -> dict[str, tuple[int, int | None]]:
    """``{tensor name: (ONNX elem type, bytes or None when a dim is not known)}`` of every float node output."""
    if model.ByteSize() < INLINE_LIMIT_BYTES:
        model = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    infos = [*model.graph.value_info, *model.graph.output]
    found: dict[str, tuple[int, int | None]] = {}
    for info in infos:
        tensor = info.type.tensor_type
        if tensor.elem_type not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        known = tensor.HasField("shape") and all(d is not None for d in dims)
        size = (4 if tensor.elem_type == TensorProto.FLOAT else 2) * int(np.prod(dims, dtype=np.int64)) if known \
            else None
        found[info.name] = (tensor.elem_type, size)
    return found


def exposure_groups(names: Sequence[str], sizes: Mapping[str, int | None],
                    budget: int = EXPOSE_BYTES_PER_RUN, most: int = EXPOSE_PER_RUN) -> list[list[str]]:
    """``names`` cut, in order, into groups of at most ``most`` tensors and ``budget`` bytes (a tensor larger than
    the budget alone; an unknown size counts as ``budget // 16``): the tensors one session run exposes."""
    groups: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name in names:
        size = sizes.get(name)
        size = budget // 16 if size is None else size
        if current and (len(current) >= most or used + size > budget):
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        groups.append(current)
    return groups


def probe_of(model: onnx.ModelProto, names: Sequence[str], types: Mapping[str, int]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph outputs exactly ``names`` (typed from ``types``), with only the nodes they
    depend on: the part of the graph that one exposure group needs.

    Why: ONNX Runtime runs every node of a session whatever outputs are asked for, so each group of the range check
    ran the whole graph again (the SD-1.5 VAE decoder at batch 4: dozens of full runs). The kept nodes compute the
    same values from the same inputs; only the nodes downstream of the group's last tensor are left out.
    """
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    graph = probe.graph
    keep = _ancestors(graph.node, set(names))
    del graph.output[:]
    graph.output.extend(onnx.helper.make_tensor_value_info(name, types[name], None) for name in names)
    nodes = [node for node, kept in zip(graph.node, keep, strict=True) if kept]
    del graph.node[:]
    graph.node.extend(nodes)
    return probe


def _ancestors(nodes: Sequence[onnx.NodeProto], wanted: set[str]) -> list[bool]:
    """For each node of a topologically sorted list, whether ``wanted`` tensors depend on it (inputs read inside
    its subgraphs, e.g. an If's branches, count as its inputs)."""
    needed = set(wanted)
    keep = [False] * len(nodes)
    for index in range(len(nodes) - 1, -1, -1):
        node = nodes[index]
        if needed.isdisjoint(node.output):
            continue
        keep[index] = True
        needed.update(_reads(node))
    return keep


def _reads(node: onnx.NodeProto) -> set[str]:
    """Every tensor name ``node`` reads, its subgraphs' node inputs included."""
    names = {name for name in node.input if name}
    for attr in node.attribute:
        for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            for inner in graph.node:
                names |= _reads(inner)
    return names


def activation_peaks(model: onnx.ModelProto, feed_list: Sequence[Mapping[str, np.ndarray]],
                     providers: Iterable[str] | None = None) -> tuple[dict[str, float], str] | str:
    """``({tensor: max |x| over the feeds (inf if any value is not finite)}, provider)`` for every float node
    output of ``model``, or the reason the model cannot run here.

    The tensors are read in groups of at most :data:`EXPOSE_PER_RUN` tensors and :data:`EXPOSE_BYTES_PER_RUN`
    bytes (:func:`exposure_groups`; one session each), so the memory of one run is bounded by that budget, not by
    the whole graph's activations.
    """
    tensors = _float_tensors(model)
    types = {name: elem for name, (elem, _size) in tensors.items()}
    produced = [name for node in model.graph.node for name in node.output if name in types]
    peaks: dict[str, float] = {}
    provider = ""
    if not produced:
        return peaks, provider
    groups = exposure_groups(produced, {name: size for name, (_elem, size) in tensors.items()},
                             EXPOSE_BYTES_PER_RUN, EXPOSE_PER_RUN)
    with contextlib.ExitStack() as stack:
        big = model.ByteSize() >= INLINE_LIMIT_BYTES
        light, folder = stack.enter_context(weights_on_disk(model)) if big else (model, None)
        for i, chunk in enumerate(groups):
            probe = probe_of(light, chunk, types)  # big: a copy without the weights
            source = _save_light(probe, folder, f"probe{i}.onnx") if folder else probe.SerializeToString()
            del probe
            session = _session(source, providers)
            if isinstance(session, str):
                return session
            provider = session.provider
            providers = [provider]  # the first chunk decided where the graph runs
            for feeds in feed_list:
                for name, value in session.run_values(feeds, chunk):
                    peaks[name] = max(peaks.get(name, 0.0), value)
            del session
    return peaks, provider


def peak(value: np.ndarray) -> float:
    """max |x| of a float array as a Python float; ``inf`` when it holds a NaN or an infinity; 0 when empty.

    From the array's max and min (NaN propagates through both), so no temporary the size of ``value`` is made (the
    VAE decoder's activations at batch 4: 512 MiB each); the same value as ``max(abs(x))``: both are exact."""
    if value.dtype.kind != "f" or value.size == 0:
        return 0.0
    high, low = float(np.max(value)), float(np.min(value))
    if not (np.isfinite(high) and np.isfinite(low)):
        return float("inf")
    return max(high, -low)


def numpy_dtype(elem_type: int) -> type[np.generic] | None:
    """The NumPy dtype of an ONNX elem type this module feeds (float, int, bool), else None."""
    return _ONNX_TO_NUMPY.get(elem_type)

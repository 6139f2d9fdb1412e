"""``diffusion-trt optimize``: the pass pipelines on any ONNX file, with a parity check.

::

    IN.onnx (+ external data) ─load─► opset >= 17 (onnx.version_converter when lower)
        ─optimize_model / optimize_fp16_checked (pipelines.py for the target and precision)─► OUT.onnx
        ─check (optional): original and optimized on the same inputs in ONNX Runtime─► max |a-b|, cosine per output

The engine is :func:`diffusion_trt.passes.optimize_model` (fp16: :func:`~diffusion_trt.passes.fp16_check.
optimize_fp16_checked`, which keeps overflowing activations in fp32 and refuses a graph it cannot make finite);
this module only loads, saves, makes inputs and compares. The command line in cli.py is a thin wrapper.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx.external_data_helper

from .artifact.folder import external_data_target, onnx_model_tensors
from .errors import ModelFileError, PassError
from .passes import PassContext, PassRecord, _ort, pipeline_for
from .passes.base import MIN_OPSET, default_domain_opset
from .passes.fp16_check import Fp16Check, optimize_fp16_checked
from .passes.onnx_files import save_onnx_file
from .passes.options import check_pass_options
from .passes.parity import OutputParity, worst_parity
from .passes.parity import failures as parity_failures

logger = logging.getLogger(__name__)

#: --target -> (backend, device) of :func:`diffusion_trt.passes.pipeline_for`.
TARGETS: dict[str, tuple[str, str]] = {"ort-cuda": ("ort", "cuda"), "ort-cpu": ("ort", "cpu"),
                                        "tensorrt": ("tensorrt", "cuda")}
PRECISIONS: tuple[str, ...] = ("fp32", "fp16")

#: Weights go to ``OUT.onnx.data`` beside the model when they pass this (protobuf cannot hold 2 GiB).
EXTERNAL_DATA_THRESHOLD_BYTES = 1_800_000_000

#: The most bytes one random input may take as drawn (float64/int64): SD's inputs take kB, a typo'd --shape TBs.
MAX_RANDOM_INPUT_BYTES = 4 << 30
_SHAPE = re.compile(r"^(?P<name>.+):(?P<dims>\d+(x\d+)*)$")


@dataclass
class Parity:
    """``--check``: where each graph ran and the per-output comparison; ``outputs`` empty and ``note`` set when a
    graph could not run here."""

    original_provider: str
    optimized_provider: str
    outputs: list[OutputParity] = field(default_factory=list)
    note: str = ""

    def failures(self, precision: str) -> list[str]:
        """The verdict of :mod:`diffusion_trt.passes.parity` (cosine >= MIN_COSINE, max abs within
        MAX_ABS_OF_SCALE[precision] x the output's scale, finite): one line per failing output; empty when every
        output passes or nothing could be compared (``note`` says why)."""
        return parity_failures(self.outputs, precision)

    def to_json(self) -> dict[str, Any]:
        return {"original_provider": self.original_provider, "optimized_provider": self.optimized_provider,
                "outputs": [o.to_json() for o in self.outputs], "note": self.note}


@dataclass
class OptimizeResult:
    """What :func:`optimize_file` did: the pass records, the fp16 check, the parity check, the files written."""

    target: str
    precision: str
    opset: tuple[int, int]  # (found, used)
    records: list[PassRecord]
    fp16_check: Fp16Check | None
    parity: Parity | None
    files: list[Path]
    seconds: float
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "precision": self.precision,
                "opset": {"found": self.opset[0], "used": self.opset[1]},
                "passes": [r.to_json() for r in self.records],
                "fp16_check": self.fp16_check.to_json() if self.fp16_check else None,
                "parity": self.parity.to_json() if self.parity else None,
                "files": [str(f) for f in self.files], "seconds": round(self.seconds, 2),
                "warnings": list(self.warnings)}


def parse_shape(text: str) -> tuple[str, list[int]]:
    """``"sample:1x4x64x64"`` -> ``("sample", [1, 4, 64, 64])``.

    Raises:
        ModelFileError: not NAME:DxDx... with positive integer dims.
    """
    m = _SHAPE.match(text.strip())
    if m is None or any(int(d) <= 0 for d in m.group("dims").split("x")):
        raise ModelFileError(f"--shape {text!r} is not NAME:DIMS with positive dims joined by x; "
                             "use e.g. --shape sample:1x4x64x64")
    return m.group("name"), [int(d) for d in m.group("dims").split("x")]


def load_model(path: Path) -> onnx.ModelProto:
    """Load an ONNX file with its external data, which must lie beside it (in its folder or below).

    The model is parsed once without its weights; every tensor that claims external data, wherever the protobuf
    holds it (:func:`~diffusion_trt.artifact.folder.onnx_model_tensors`: functions, their attribute defaults,
    ``training_info`` and subgraphs included), must name a regular file inside the model's folder, which is then read
    into the tensor. A location that is empty, absolute, has ``..`` or leads out through a symbolic link is refused
    before any file is opened: no tensor is left for ONNX Runtime to resolve against the working directory.

    Raises:
        ModelFileError: the file is missing, not an ONNX model, or an external-data file is missing or outside.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{str(path)!r} does not exist or is not a file; pass the path of an .onnx model")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # protobuf DecodeError and friends
        raise ModelFileError(f"{str(path)!r} is not an ONNX model ({type(err).__name__}: {err}); pass an .onnx "
                             "file") from err
    for tensor in onnx_model_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            _load_external(tensor, path)
    return model


def _load_external(tensor: onnx.TensorProto, model_path: Path) -> None:
    """Read one tensor's external data from beside ``model_path`` (see :func:`load_model`)."""
    location = next((e.value for e in tensor.external_data if e.key == "location"), "")
    target = external_data_target(model_path.name, location)
    base = model_path.parent.resolve()
    file = base.joinpath(target) if target is not None else None
    if file is None or not file.resolve().is_relative_to(base):
        raise ModelFileError(f"{str(model_path)!r}: tensor {tensor.name!r} has its external data at {location!r}, "
                             f"outside the model's folder {str(model_path.parent)!r}; keep the weight files next to "
                             "the .onnx file, as the exporter wrote them")
    if not file.is_file():
        raise ModelFileError(f"{str(model_path)!r}: its external data {str(file)!r} (tensor {tensor.name!r}) is "
                             "missing; keep the weight files next to the .onnx file, as the exporter wrote them")
    try:
        onnx.external_data_helper.load_external_data_for_tensor(tensor, str(base))
    except (OSError, ValueError) as err:
        raise ModelFileError(f"{str(model_path)!r}: the external data of tensor {tensor.name!r} in {location!r} "
                             f"cannot be read ({err}); re-export the model") from err
    tensor.data_location = onnx.TensorProto.DEFAULT
    del tensor.external_data[:]


def ensure_min_opset(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int, int]:
    """The model at opset >= 17 (the passes' minimum): converted with onnx.version_converter when lower.

    Returns:
        ``(model, found, used)``.

    Raises:
        ModelFileError: no default-domain opset, or the conversion failed (the message says which op).
    """
    found = default_domain_opset(model)
    if found is None:
        raise ModelFileError("the model imports no default-domain opset; it is not a standard ONNX graph")
    if found >= MIN_OPSET:
        return model, found, found
    try:
        converted = onnx.version_converter.convert_version(model, MIN_OPSET)
    except Exception as err:
        raise ModelFileError(
            f"the model uses opset {found} and onnx.version_converter could not raise it to {MIN_OPSET} "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); re-export it at opset "
            f"{MIN_OPSET} or newer") from err
    logger.info("opset %d -> %d (onnx.version_converter)", found, MIN_OPSET)
    return converted, found, MIN_OPSET


def random_feeds(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None = None, seed: int = 0,
                 count: int = 1) -> tuple[list[dict[str, np.ndarray]], list[str]]:
    """``count`` random input dicts for the graph's inputs, and the warnings about the dims made up.

    Float inputs are standard normal, integer inputs uniform in [0, 10), booleans random. Each dim comes from
    ``shapes[name]`` when given, else from the graph when it is a number, else 1 (a warning per input names the
    dims set to 1 and the ``--shape`` to give).

    Raises:
        ModelFileError: ``shapes`` names an input the graph does not have, or gives the wrong rank.
    """
    shapes = dict(shapes or {})
    inputs = _graph_inputs(model)
    unknown = [name for name in shapes if name not in inputs]
    if unknown:
        raise ModelFileError(f"--shape names {', '.join(map(repr, unknown))}, not an input of this graph; its "
                             f"inputs are {', '.join(inputs) or 'none'}")
    rng = np.random.default_rng(seed)
    warnings: list[str] = []
    dims: dict[str, list[int]] = {}
    for name, info in inputs.items():
        graph_dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                      for d in info.type.tensor_type.shape.dim]
        if name in shapes:
            if len(shapes[name]) != len(graph_dims):
                raise ModelFileError(f"--shape {name}:{'x'.join(map(str, shapes[name]))} has rank "
                                     f"{len(shapes[name])}; the input has rank {len(graph_dims)} "
                                     f"({_dims_text(graph_dims)})")
            dims[name] = list(shapes[name])
            continue
        made_up = [i for i, d in enumerate(graph_dims) if not isinstance(d, int) or d <= 0]
        dims[name] = [1 if i in made_up else int(d) for i, d in enumerate(graph_dims)]
        if made_up:
            warnings.append(f"input {name!r} ({_dims_text(graph_dims)}): unknown dim(s) set to 1; give "
                            f"--shape {name}:{'x'.join(map(str, dims[name]))} with the real sizes")
    for name, shape in dims.items():  # --shape x:1x99999999999 died in numpy (MemoryError, a traceback, exit 1)
        size = int(np.prod(shape, dtype=object)) * 8  # drawn as float64 / int64, then cast
        if size > MAX_RANDOM_INPUT_BYTES:
            raise ModelFileError(f"input {name!r} of shape {'x'.join(map(str, shape))} would take {size / 2**30:.1f} "
                                 f"GiB of random values, more than the {MAX_RANDOM_INPUT_BYTES >> 30} GiB random "
                                 f"inputs may take; give smaller dims with --shape {name}:..., or pass the arrays "
                                 "with --inputs FILE.npz")
    feeds = []
    for _ in range(count):
        feed: dict[str, np.ndarray] = {}
        for name, info in inputs.items():
            elem = info.type.tensor_type.elem_type
            dtype = _ort.numpy_dtype(elem)
            if dtype is None:
                raise ModelFileError(f"input {name!r} has ONNX type {onnx.TensorProto.DataType.Name(elem)}, which "
                                     "random inputs cannot make; pass --inputs FILE.npz")
            shape = dims[name]
            if np.dtype(dtype).kind == "f":
                feed[name] = rng.standard_normal(shape).astype(dtype)
            elif np.dtype(dtype).kind == "b":
                feed[name] = rng.integers(0, 2, shape).astype(bool)
            else:
                feed[name] = rng.integers(0, 10, shape).astype(dtype)
        feeds.append(feed)
    return feeds, warnings


def load_feeds(path: Path, model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """The inputs saved in an ``.npz`` (``np.savez(path, name=array, ...)``), checked against the graph's inputs.

    Raises:
        ModelFileError: not an .npz NumPy can read, a missing input, an extra name, or a wrong rank.
    """
    import zipfile

    if not zipfile.is_zipfile(path):  # np.load takes any other file for a pickle, and advises allow_pickle=
        raise ModelFileError(f"--inputs {str(path)!r} is not a NumPy .npz file (an .npz is a zip archive); write it "
                             "with numpy.savez(path, input_name=array, ...)")
    try:
        with np.load(path, allow_pickle=False) as data:
            feed = {name: data[name] for name in data.files}
    except Exception as err:
        raise ModelFileError(f"--inputs {str(path)!r} is not a NumPy .npz file ({type(err).__name__}: {err}); "
                             "write it with numpy.savez(path, input_name=array, ...)") from err
    inputs = _graph_inputs(model)
    missing = [name for name in inputs if name not in feed]
    extra = [name for name in feed if name not in inputs]
    if missing or extra:
        raise ModelFileError(f"--inputs {str(path)!r} holds {', '.join(feed) or 'nothing'}; the graph's inputs are "
                             f"{', '.join(inputs)} (missing: {', '.join(missing) or 'none'}, unknown: "
                             f"{', '.join(extra) or 'none'}); save one array per input under its name")
    for name, info in inputs.items():
        rank = len(info.type.tensor_type.shape.dim)
        if feed[name].ndim != rank:
            raise ModelFileError(f"--inputs: {name!r} has shape {feed[name].shape}, the graph's input has rank {rank}")
    return [feed]


def overridable_note(model: onnx.ModelProto) -> list[str]:
    """A warning when initializers are also graph inputs (ONNX's overridable initializers: torch's export with
    ``keep_initializers_as_inputs=True``, older exporters): the passes treat them as the constants they hold, so the
    optimized graph no longer takes them as inputs; a caller feeding them would be refused by name."""
    initializers = {init.name for init in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name in initializers]
    if not names:
        return []
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return [f"{len(names)} graph input(s) are also initializers ({shown}): they are optimized as the constants they "
            "hold, and the optimized graph does not take them as inputs"]


def _graph_inputs(model: onnx.ModelProto) -> dict[str, onnx.ValueInfoProto]:
    initializers = {init.name for init in model.graph.initializer}
    return {i.name: i for i in model.graph.input if i.name not in initializers}


def _dims_text(dims: Sequence[Any]) -> str:
    return "x".join("?" if d is None else str(d) for d in dims) or "scalar"


def save_model(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Write ``model`` to ``path``; weights beside it in ``{name}.data`` when they pass ~1.8 GB. Returns the files."""
    return save_onnx_file(model, path, external=model.ByteSize() >= EXTERNAL_DATA_THRESHOLD_BYTES)


def optimize_file(
    source: Path, output: Path, *, target: str, precision: str = "fp32", dump_dir: Path | None = None,
    pass_options: Mapping[str, Any] | None = None, check: bool = False, inputs: Path | None = None,
    shapes: Mapping[str, Sequence[int]] | None = None, seed: int = 0,
) -> OptimizeResult:
    """Optimize one ONNX file for ``target`` at ``precision`` and write ``output``.

    fp16 runs the range check (:mod:`diffusion_trt.passes.fp16_check`) on ``inputs`` (an .npz) or random inputs
    (``shapes`` for the dims the graph leaves open); ``check`` then compares original and optimized outputs, and a
    graph that fails the verdict is not written (``files`` empty; :func:`check_verdict` raises).

    Raises:
        ModelFileError: a bad file, inputs, shape or option (exit 2 on the command line).
        PassError: a pass failed, or the fp16 graph cannot be made finite (the message names the node).
    """
    start = time.perf_counter()
    if target not in TARGETS:
        raise ModelFileError(f"--target {target!r} is unknown; use one of {', '.join(TARGETS)}")
    backend, device = TARGETS[target]
    try:
        passes = pipeline_for(backend, device, precision, "model")
    except ValueError as err:
        raise ModelFileError(f"--target {target} --precision {precision}: {err}; ORT on CPU has no fp16 pipeline, "
                             "use --precision fp32 there or --target ort-cuda / tensorrt") from err
    options = dict(pass_options or {})
    try:
        check_pass_options(options)
    except ValueError as err:
        raise ModelFileError(f"--pass-option {err}") from err
    original = load_model(source)
    model, found, used = ensure_min_opset(original)
    feeds, warnings = (load_feeds(inputs, model), []) if inputs is not None else random_feeds(model, shapes, seed)
    warnings += overridable_note(model)
    for text in warnings:
        logger.warning("%s", text)
    ctx = PassContext(component=Path(source).stem, backend=backend, device=device, precision=precision,
                      opset=used, dump_dir=dump_dir, options=options)
    optimized, records, fp16 = optimize_fp16_checked(model, passes, ctx, feeds)
    # compared before it is written: a graph that fails the verdict is never written, so an OUTPUT that --overwrite
    # would replace stays as it was (it was written over, then removed)
    parity = compare(model, optimized, feeds) if check else None
    files = save_model(optimized, output) if parity is None or not parity.failures(precision) else []
    return OptimizeResult(target, precision, (found, used), records, fp16, parity, files,
                          time.perf_counter() - start, warnings)


def compare(original: onnx.ModelProto, optimized: onnx.ModelProto,
            feeds: Sequence[Mapping[str, np.ndarray]]) -> Parity:
    """Run both graphs on ``feeds`` and compare each output (as float32): max abs difference and cosine.

    The original runs where it can (CPU first); the optimized graph on the CPU provider when every op of the
    target has a kernel there, else on CUDA when this ONNX Runtime has it; when either cannot run, ``note`` says
    why and ``outputs`` is empty.
    """
    ref = _ort.open_session(original)
    new = _ort.open_session(optimized)
    if isinstance(ref, str) or isinstance(new, str):
        which = "the original graph" if isinstance(ref, str) else "the optimized graph"
        why = ref if isinstance(ref, str) else new
        return Parity("" if isinstance(ref, str) else ref.provider, "" if isinstance(new, str) else new.provider,
                      note=f"not compared: {which} cannot run on this machine ({why})")
    return Parity(ref.provider, new.provider, worst_parity((ref.run(feed), new.run(feed)) for feed in feeds))


def check_verdict(result: OptimizeResult) -> None:
    """``--check``'s verdict (:meth:`Parity.failures`): when an output fails it, the run fails; :func:`optimize_file`
    wrote nothing then (and any file written is removed), so a silently wrong graph is never left as OUTPUT, and an
    OUTPUT of an earlier run stays.

    Raises:
        PassError: an output fails (the message names it, its cosine and difference, and the thresholds).
    """
    why = result.parity.failures(result.precision) if result.parity is not None else []
    if not why:
        return
    for path in result.files:
        path.unlink(missing_ok=True)
    fix = ("Keep the nodes feeding that output in fp32 (--pass-option convert_fp16_fp32_nodes='[\"NAME\"]', names in "
           "--dump-passes) or use --precision fp32" if result.precision == "fp16" else
           "A pass changed what the graph computes: --dump-passes DIR writes the graph after each pass, to find which "
           "(the --pass-option keys that steer the passes: diffusion_trt/passes/options.py)")
    raise PassError(f"--check: the optimized graph does not match the original ({'; '.join(why)}); nothing was "
                    f"written. {fix}")


def _nonfinite_note(output: OutputParity) -> str:
    """The parity line's note on an original output that holds inf/NaN itself (compared on its finite values)."""
    if not output.original_nonfinite:
        return ""
    return (f"  (the original holds {output.original_nonfinite} inf/NaN on these inputs: compared where finite; "
            "real inputs: --inputs FILE.npz)")


def format_table(result: OptimizeResult) -> str:
    """The per-pass table (non-zero counts, then the rejection reasons), the fp16 check and the parity lines."""
    lines = [f"passes for {result.target}/{result.precision} (opset {result.opset[0]}"
             f"{' -> ' + str(result.opset[1]) if result.opset[1] != result.opset[0] else ''}):"]
    for rec in result.records:
        counts = ", ".join(f"{k}={v}" for k, v in rec.counts.items() if v) or "no change"
        lines.append(f"  {rec.name:<22} {counts} ({rec.seconds:.1f} s)")
        for reason, n in rec.rejections.items():
            lines.append(f"  {'':<22}   rejected {n}x: {reason}")
    if result.fp16_check is not None:
        lines.append(result.fp16_check.summary())
        if result.fp16_check.islands:
            lines.append("  kept fp32: " + ", ".join(result.fp16_check.islands[:12])
                         + (f" ... ({len(result.fp16_check.islands)} nodes)"
                            if len(result.fp16_check.islands) > 12 else ""))
    if result.parity is not None:
        p = result.parity
        if p.note:
            lines.append(f"check: {p.note}")
        else:
            lines.append(f"check: original on {p.original_provider}, optimized on {p.optimized_provider}")
            for o in p.outputs:
                lines.append(f"  {o.name:<22} max_abs={o.max_abs:.3g} cosine={o.cosine:.6f} (scale {o.scale:.3g})"
                             f"{'' if o.finite else '  NOT FINITE'}{_nonfinite_note(o)}")
    return "\n".join(lines)

"""The TensorRT engine stage: optimized ONNX -> serialized TensorRT plan, plus the manifest's build facts.

::

    model.onnx ──NetworkFromOnnxPath──► INetworkDefinition
        ──CreateConfig / CreateConfigRTX (flags, profiles, memory pool, targets) + our timing cache──►
        EngineBytesFromNetwork ──► model.plan

The loaders are Polygraphy's (``polygraphy.backend.trt``, bound to full TensorRT or TensorRT-RTX by
:func:`polygraphy_for`); the stage is :func:`engine_from_onnx` and :class:`TrtBuildConfig` says how to build. What
Polygraphy does not do stays here: the checks before any work (GPU, targets, precision per target, foreign ops,
the manifest's inputs), the profiles from the manifest, the framed timing cache and the messages. Neither
``tensorrt`` nor Polygraphy is imported at module level, so the config, the profile derivation and the
timing-cache rules are usable and tested on machines without TensorRT.

Precision: the product's precision names map to builder flags (:data:`PRECISION_FLAGS`). A graph that
carries Q/DQ nodes (explicit quantization) is built as a *strongly typed* network instead: TensorRT then
takes every tensor's type from the graph and the precision flags must not be set. On TensorRT 11 every
network is strongly typed and the precision flags no longer exist; the flags are skipped with a warning
and the graph's own types (fp16 weights from an fp16 export) decide.

Profiles: one dynamic profile from the manifest inputs' min/opt/max (the UNet's batch ``B2`` already
doubled for classifier-free guidance, see ``components.symbol_ranges``), one per extra range in the
config, and, unless disabled, a static "fast path" profile at the opt shape (TensorRT picks kernels for
exactly that shape). The runtime selects the narrowest profile that holds a call's shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import trt_compat
from ..artifact import folder as artifacts
from ..artifact.facts import BuildFacts
from ..artifact.manifest import Backend
from ..config import ShapeProfile
from ..errors import BuildError, RuntimeInputError
from .components import symbol_ranges

logger = logging.getLogger(__name__)

#: Builder precision flags per product precision. int8 / fp8 keep fp16 on so that layers without
#: quantized kernels fall back to fp16 instead of fp32 (TensorRT developer guide, "Explicit Quantization").
PRECISION_FLAGS: dict[str, tuple[str, ...]] = {
    "fp32": (),
    "fp16": ("fp16",),
    "bf16": ("bf16",),
    "int8": ("int8", "fp16"),
    "fp8": ("fp8", "fp16"),
}
#: Flags the config may name explicitly (``trt.BuilderFlag.<NAME.upper()>``).
KNOWN_FLAGS: tuple[str, ...] = ("fp16", "bf16", "int8", "fp8", "tf32")
#: ``IBuilderConfig.builder_optimization_level`` range; TensorRT's default is 3 (TensorRT API docs).
OPTIMIZATION_LEVELS = range(0, 6)
#: ONNX ops that make a graph explicitly quantized (and the network strongly typed).
QDQ_OPS: frozenset[str] = frozenset({"QuantizeLinear", "DequantizeLinear"})
#: Where a plan goes inside the component folder.
PLAN_NAME = "model.plan"


# -- configuration --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrtBuildConfig:
    """How to build TensorRT engines; saved in the manifest (``to_json``). ``None`` means "the default".

    Attributes:
        builder_optimization_level: 0..5 (``IBuilderConfig.builder_optimization_level``); higher searches
            more tactics (slower build, sometimes faster engine). ``None`` = TensorRT's default, 3.
        workspace_bytes: limit of the WORKSPACE memory pool (``set_memory_pool_limit``), bytes; ``None`` =
            TensorRT's default (the device's total memory).
        refittable: build with ``BuilderFlag.REFIT`` so weights can be swapped at run time (LoRA); costs
            some speed. Full TensorRT only: refused with ``library="tensorrt-rtx"``, as ``CompileConfig`` refuses it
            (:func:`~diffusion_trt.trt_compat.rtx_refit_refusal`).
        flags: precision flags to set, overriding :data:`PRECISION_FLAGS` for the precision; ``None`` =
            derive them from the precision.
        strongly_typed: build a strongly typed network (types from the graph, no precision flags).
            ``None`` = auto: strongly typed when the graph carries QuantizeLinear/DequantizeLinear nodes.
        static_profile: add a profile fixed at the opt shape (the fast path), when the range is dynamic.
        extra_profiles: more image-level ranges (batch / height / width), each one more profile with its own
            opt point; each must lie inside the artifact's profile (the runtime validates against that).
        library: "tensorrt" (full TensorRT: built on the GPU it runs on) or "tensorrt-rtx" (TensorRT for RTX: built
            anywhere for :attr:`compute_capabilities`); see :data:`~diffusion_trt.trt_compat.LIBRARIES`.
        compute_capabilities: TensorRT-RTX targets ("8.9", "current"); ``None`` = its portable set.
        weight_streaming: build with ``BuilderFlag.WEIGHT_STREAMING`` so the runtime may keep part of the weights
            on the host (``engine.weight_streaming_budget_v2``, a VRAM budget); TensorRT requires a strongly typed
            network for it, so ``strongly_typed`` None becomes True and False is refused.
    """

    builder_optimization_level: int | None = None
    workspace_bytes: int | None = None
    refittable: bool = False
    flags: tuple[str, ...] | None = None
    strongly_typed: bool | None = None
    static_profile: bool = True
    extra_profiles: tuple[ShapeProfile, ...] = field(default_factory=tuple)
    library: str = "tensorrt"
    compute_capabilities: tuple[str, ...] | None = None
    weight_streaming: bool = False

    def __post_init__(self) -> None:
        if self.weight_streaming:
            if self.strongly_typed is False:
                raise RuntimeInputError("weight_streaming=True needs a strongly typed network (TensorRT's rule for "
                                        "BuilderFlag.WEIGHT_STREAMING); drop strongly_typed=False")
            object.__setattr__(self, "strongly_typed", True)
        trt_compat.library(self.library)  # a backend that is not a TensorRT library fails here
        if self.refittable and self.library == Backend.TENSORRT_RTX:  # CompileConfig's refusal, for callers here
            raise RuntimeInputError(trt_compat.rtx_refit_refusal("library"))
        if self.compute_capabilities is not None:
            object.__setattr__(self, "compute_capabilities", tuple(str(c) for c in self.compute_capabilities))
        level = self.builder_optimization_level
        if level is not None and (isinstance(level, bool) or level not in OPTIMIZATION_LEVELS):
            raise RuntimeInputError(
                f"builder_optimization_level={level!r} is out of range; use 0..5 (TensorRT's default is 3)"
            )
        ws = self.workspace_bytes
        if ws is not None and (isinstance(ws, bool) or not isinstance(ws, int) or ws <= 0):
            raise RuntimeInputError(
                f"workspace_bytes={ws!r} must be a positive number of bytes, e.g. {4 << 30} for 4 GiB, or None "
                "for TensorRT's default"
            )
        if self.flags is not None:
            unknown = [f for f in self.flags if f not in KNOWN_FLAGS]
            if unknown:
                raise RuntimeInputError(
                    f"flags={list(self.flags)!r} has unknown flag(s) {unknown}; use some of {', '.join(KNOWN_FLAGS)}"
                )
            if self.strongly_typed and self.flags:
                raise RuntimeInputError(
                    f"flags={list(self.flags)!r} with strongly_typed=True: a strongly typed network takes its "
                    "types from the graph and TensorRT refuses precision flags; drop one of the two"
                )
        for p in self.extra_profiles:
            if not isinstance(p, ShapeProfile):
                raise RuntimeInputError(
                    f"extra_profiles holds {p!r}; each entry must be a ShapeProfile (batch/height/width ranges)"
                )

    def flags_for(self, precision: str) -> tuple[str, ...]:
        """The precision flags for ``precision`` (explicit :attr:`flags` win).

        Raises:
            RuntimeInputError: unknown precision (the message lists the known ones).
        """
        if self.flags is not None:
            return tuple(self.flags)
        if precision not in PRECISION_FLAGS:
            raise RuntimeInputError(
                f"precision={precision!r} has no TensorRT precision plan; use one of {', '.join(PRECISION_FLAGS)}"
            )
        return PRECISION_FLAGS[precision]

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["flags"] = list(self.flags) if self.flags is not None else None
        data["extra_profiles"] = [p.to_json() for p in self.extra_profiles]
        data["compute_capabilities"] = list(self.compute_capabilities) if self.compute_capabilities else None
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrtBuildConfig:
        """Inverse of :meth:`to_json`.

        Raises:
            RuntimeInputError: unknown keys or invalid values.
        """
        data = dict(data)
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise RuntimeInputError(f"TrtBuildConfig has no field(s) {unknown}; remove them")
        if data.get("flags") is not None:
            data["flags"] = tuple(data["flags"])
        data["extra_profiles"] = tuple(ShapeProfile.from_json(p) for p in data.get("extra_profiles") or ())
        if data.get("compute_capabilities") is not None:
            data["compute_capabilities"] = tuple(data["compute_capabilities"])
        return cls(**data)


# -- profiles -------------------------------------------------------------------------------------------

Shape = tuple[int, ...]


@dataclass(frozen=True)
class TrtProfile:
    """One optimization profile: min/opt/max shape per input.

    Attributes:
        kind: "dynamic" (the artifact's range), "static" (the opt-shape fast path) or "extra".
        shapes: input name -> (min, opt, max) concrete shapes.
    """

    kind: str
    shapes: Mapping[str, tuple[Shape, Shape, Shape]]

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "inputs": {n: {"min": list(a), "opt": list(b), "max": list(c)} for n, (a, b, c) in self.shapes.items()},
        }


def _entry_shapes(entry: Mapping[str, Any]) -> tuple[Shape, Shape, Shape]:
    try:
        shapes = tuple(tuple(int(d) for d in entry[k]) for k in ("min", "opt", "max"))
    except (KeyError, TypeError, ValueError):
        raise BuildError(
            f"manifest input entry {dict(entry)!r} lacks concrete min/opt/max shapes; build it with "
            "components.tensor_manifest"
        ) from None
    lo, opt, hi = shapes
    if not len(lo) == len(opt) == len(hi) or not all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True)):
        raise BuildError(f"input {entry.get('name')!r}: min {lo} <= opt {opt} <= max {hi} does not hold per dim")
    return lo, opt, hi


def profiles_from_inputs(inputs: Sequence[Mapping[str, Any]], build: TrtBuildConfig) -> list[TrtProfile]:
    """The optimization profiles for a component, from its manifest input entries.

    Order: the dynamic profile (the manifest's min/opt/max), then each extra range, then the static
    fast path at the opt shape (omitted when the dynamic profile is already static, or when disabled).

    Args:
        inputs: ``[{"name", "dtype", "shape", "min", "opt", "max"}, ...]`` as ``components.tensor_manifest``
            writes them: ``shape`` symbolic (``["B2", 4, "h", "w"]``), the others concrete.
        build: the build config (extra profiles, static fast path).

    Raises:
        BuildError: malformed entries, an extra profile that names a symbol the inputs do not use
            consistently, or one that leaves the artifact's range.
    """
    if not inputs:
        raise BuildError("a TensorRT engine needs at least one input entry to derive profiles from")
    base = {str(e["name"]): _entry_shapes(e) for e in inputs}
    profiles = [TrtProfile("dynamic", base)]
    for extra in build.extra_profiles:
        ranges = symbol_ranges(extra)
        shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
        for e in inputs:
            name = str(e["name"])
            dims: list[list[int]] = [[], [], []]
            for axis, d in enumerate(e["shape"]):
                for i in range(3):
                    if isinstance(d, int):
                        dims[i].append(d)
                    elif d in ranges:
                        dims[i].append(ranges[d][i])
                    else:  # a symbol the image-level profile does not define (e.g. text length): keep as is
                        dims[i].append(base[name][i][axis])
            lo, opt, hi = (tuple(x) for x in dims)
            blo, _, bhi = base[name]
            if any(a < b for a, b in zip(lo, blo, strict=True)) or any(a > b for a, b in zip(hi, bhi, strict=True)):
                raise BuildError(
                    f"extra profile {extra.to_json()} gives input {name!r} the range {lo}..{hi}, outside the "
                    f"artifact's {blo}..{bhi}; widen the compile profile (--min-*/--max-*) or narrow the extra one"
                )
            shapes[name] = (lo, opt, hi)
        profiles.append(TrtProfile("extra", shapes))
    if build.static_profile and any(lo != hi for lo, _, hi in base.values()):
        profiles.append(TrtProfile("static", {n: (opt, opt, opt) for n, (_, opt, _) in base.items()}))
    return profiles


# -- graph inspection -----------------------------------------------------------------------------------


def graph_ops(onnx_path: Path) -> Counter[tuple[str, str]]:
    """``(domain, op_type)`` -> count over the graph, its subgraphs and its model-local functions.

    Reads the graph without external weight files (``load_external_data=False``). The default domain is "".
    """
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    ops: Counter[tuple[str, str]] = Counter()

    def walk(nodes: Sequence[onnx.NodeProto]) -> None:
        for node in nodes:
            ops[("" if node.domain == "ai.onnx" else node.domain, node.op_type)] += 1
            for attr in node.attribute:
                for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    walk(g.node)

    walk(model.graph.node)
    for f in model.functions:
        walk(f.node)
    for f in model.functions:  # a call of a local function is not a foreign op: the parser expands it
        ops.pop((f.domain, f.name), None)
    return ops


def graph_has_qdq(onnx_path: Path) -> bool:
    """Whether the ONNX graph (or a subgraph, or a local function) has QuantizeLinear/DequantizeLinear nodes."""
    return any(domain == "" and op in QDQ_OPS for domain, op in graph_ops(onnx_path))


def check_parsable(onnx_path: Path, ops: Mapping[tuple[str, str], int]) -> None:
    """Refuse, before TensorRT's ONNX parser sees it, a graph with ops outside the default ONNX domain.

    The parser maps ai.onnx ops only; it refuses contrib ops as missing plugins, and TensorRT-RTX 1.7.1's parser
    crashes the process (SIGSEGV) on ``com.microsoft.MultiHeadAttention``, so the graph is checked first.

    Raises:
        BuildError: naming each foreign op with its count, and the fix.
    """
    foreign = {f"{d}.{op}": n for (d, op), n in sorted(ops.items()) if d}
    if foreign:
        listed = ", ".join(f"{op} x{n}" for op, n in foreign.items())
        raise BuildError(
            f"{onnx_path} has ops outside the default ONNX domain, which TensorRT's ONNX parser cannot map: {listed}; "
            "optimize it for the tensorrt target (`compile --backend tensorrt-rtx` or `optimize --target tensorrt` "
            "emit standard ops only), or build it for --backend ort"
        )


@dataclass(frozen=True)
class ParserErrorInfo:
    """One ONNX parser error: where (node index, name, op) and what.

    ``node`` is -1 when the error is not tied to a node (e.g. a malformed file).
    """

    node: int
    node_name: str
    op: str
    code: str
    desc: str

    @classmethod
    def from_trt(cls, err: Any) -> ParserErrorInfo:
        """From a ``tensorrt.ParserError`` (``node_name``/``node_operator`` exist from TensorRT 8.6)."""

        def call(name: str, default: Any) -> Any:
            fn = getattr(err, name, None)
            if fn is None:
                return default
            try:
                return fn()
            except Exception:  # noqa: BLE001 - an older binding without the accessor's backing data
                return default

        code = call("code", "")
        return cls(
            node=int(call("node", -1)),
            node_name=str(call("node_name", "") or ""),
            op=str(call("node_operator", "") or ""),
            code=getattr(code, "name", str(code)),
            desc=str(call("desc", "")),
        )


def format_parser_errors(path: Path, errors: Sequence[ParserErrorInfo]) -> str:
    """One line per error: ``node 12 'Attention_3' (MultiHeadAttention): UNSUPPORTED_NODE: ...``."""
    lines = []
    for e in errors:
        where = f"node {e.node} {e.node_name!r} ({e.op or '?'})" if e.node >= 0 else "graph"
        lines.append(f"{where}: {e.code}: {e.desc}")
    body = "\n  ".join(lines) or "(the parser reported failure but no error)"
    return (
        f"TensorRT's ONNX parser rejected {path} ({len(errors)} error(s)):\n  {body}\n"
        "fix: run the tensorrt pass pipeline (it emits TensorRT-parsable ops), or check the op/opset against "
        "the TensorRT ONNX operator support list"
    )


def check_network_inputs(onnx_path: Path, network: Mapping[str, str], inputs: Sequence[Mapping[str, Any]]) -> None:
    """The parsed network's inputs must be the manifest's: same names and dtypes.

    Args:
        network: input name -> manifest dtype name of the network's input ("float32"...).
        inputs: the manifest input entries.

    Raises:
        BuildError: naming both sides. A dtype mismatch typically means the manifest promises fp16 I/O for an
            fp32 graph built with the FP16 flag (TensorRT keeps the graph's I/O types).
    """
    wanted = {str(e["name"]): str(e["dtype"]) for e in inputs}
    if sorted(network) != sorted(wanted):
        raise BuildError(
            f"{onnx_path}: the network's inputs {sorted(network)} differ from the manifest's {sorted(wanted)}; "
            "the ONNX file and the component spec disagree: re-export the component"
        )
    wrong = {n: (network[n], d) for n, d in wanted.items() if network[n] != d}
    if wrong:
        detail = ", ".join(f"{n}: network {a}, manifest {b}" for n, (a, b) in wrong.items())
        raise BuildError(
            f"{onnx_path}: input dtypes differ ({detail}); TensorRT keeps the graph's I/O types, so the manifest "
            "entries must describe the graph as exported (e.g. tensor_manifest(t, 'fp32', profile) for an fp32 "
            "graph built with the FP16 flag)"
        )


# -- timing cache ---------------------------------------------------------------------------------------


def read_timing_cache(cache_dir: Path, key: trt_compat.TimingCacheKey) -> tuple[bytes | None, dict[str, Any]]:
    """Load ``cache_dir / key.filename`` if present and made for ``key``.

    Returns:
        ``(payload or None, facts)``; facts = ``{"file", "loaded", "ignored"}`` (``ignored`` is the reason
        a present file was not used; logged as a warning).
    """
    path = cache_dir / key.filename
    facts: dict[str, Any] = {"file": key.filename, "loaded": False, "ignored": None}
    try:  # bounded, no link followed, no FIFO or device read (trt_compat.read_cache_file)
        data = trt_compat.read_cache_file(path, trt_compat.MAX_TIMING_CACHE_BYTES)
    except FileNotFoundError:
        return None, facts
    except OSError as e:
        reason = str(e.strerror or e)
        logger.warning("timing cache %s ignored: %s; building with a fresh cache", path, reason)
        facts["ignored"] = reason
        return None, facts
    payload, reason = trt_compat.unpack_timing_cache(data, key)
    if payload is None:
        logger.warning("timing cache %s ignored: %s; building with a fresh cache", path, reason)
        facts["ignored"] = reason
    return payload, facts


# -- the stage ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildTarget:
    """What a build is for: the library and the GPU(s), resolved once by :func:`build_target`.

    Attributes:
        library: the TensorRT library (:data:`~diffusion_trt.trt_compat.LIBRARIES`).
        compute_capabilities: TensorRT-RTX: the targets ("8.6", ...); full TensorRT: the build GPU's one.
        gpu: the build GPU's name; "" when the build runs without one (TensorRT-RTX).
        host_compute_capability: the build GPU's compute capability, ``None`` without a GPU.
    """

    library: trt_compat.TrtLibrary
    compute_capabilities: tuple[str, ...]
    gpu: str = ""
    host_compute_capability: str | None = None

    @property
    def plan_compute_capability(self) -> str | None:
        """The one compute capability a full TensorRT plan runs on; ``None`` for TensorRT-RTX (it has targets)."""
        return None if self.library.compute_capability_targets else self.compute_capabilities[0]


def build_target(precision: str, build: TrtBuildConfig) -> BuildTarget:
    """Resolve and check where a build's plans will run, before any work.

    Full TensorRT builds on the GPU it runs on (torch must see one). TensorRT-RTX builds on any machine for
    ``build.compute_capabilities`` (default: its portable set; "current" = this GPU). Precision rules (fp8 >= 8.9,
    bf16 >= 8.0) are checked against every target.

    Raises:
        BuildError: no CUDA GPU for full TensorRT (or for "current"), a precision a target lacks.
        RuntimeInputError: a target TensorRT-RTX cannot build for.
    """
    lib = trt_compat.library(build.library)
    host = trt_compat.gpu_facts()
    if lib.compute_capability_targets:
        wants_current = any(str(c).lower() == "current" for c in build.compute_capabilities or ())
        if wants_current and host is None:
            raise BuildError(
                "--compute-capability current needs a CUDA GPU and torch sees none here; name the targets instead "
                "(e.g. --compute-capability 8.6,8.9,12.0) or leave it out for TensorRT-RTX's portable set"
            )
        targets = trt_compat.resolve_rtx_targets(build.compute_capabilities,
                                                 host.compute_capability if host else None)
    elif host is None:
        raise BuildError(
            "TensorRT engines are built on the GPU they will run on, and torch sees no CUDA device here; "
            "compile on the GPU host, use --backend tensorrt-rtx (builds without a GPU), or use --backend ort"
        )
    else:
        targets = (host.compute_capability,)
    flags = _precision_needs(precision, build)
    for cc in targets:
        trt_compat.check_precision_supported(flags, cc)
    return BuildTarget(lib, targets, host.gpu if host else "", host.compute_capability if host else None)


def _precision_needs(precision: str, build: TrtBuildConfig) -> tuple[str, ...]:
    """The precisions whose hardware minimum applies (:data:`trt_compat.PRECISION_MIN_COMPUTE_CAPABILITY`)."""
    if build.flags is not None:
        return tuple(build.flags)
    return PRECISION_FLAGS.get(precision, ())


def preflight(precision: str, build: TrtBuildConfig) -> BuildTarget:
    """Fail before any export work when this machine cannot build: :func:`build_target`, then the imports (the
    library and Polygraphy, bound to it).

    Raises:
        BuildError: as :func:`engine_from_onnx` would, minutes later.
    """
    target = build_target(precision, build)
    polygraphy_for(target.library)
    return target


# -- Polygraphy's loaders, bound to one TensorRT library ------------------------------------------------

#: The import name Polygraphy gives TensorRT-RTX (``polygraphy.mod.trt_importer``: ``tensorrt_rtx>=1.0``); the
#: ``tensorrt-rtx-cu13-bindings`` wheel installs the same bindings as ``tensorrt_rtx_bindings``.
POLYGRAPHY_RTX_MODULE = "tensorrt_rtx"
_POLYGRAPHY_INSTALL = "`pip install 'polygraphy>=0.53.6'` (the rtx and gpu extras have it)"


def polygraphy_for(lib: trt_compat.TrtLibrary) -> tuple[Any, Any]:
    """``(trt, polygraphy.backend.trt)``: the library's module and Polygraphy's TensorRT loaders bound to it.

    Polygraphy picks its TensorRT module once per process, when its modules are first imported: ``tensorrt``, or
    ``tensorrt_rtx`` when ``polygraphy.config.USE_TENSORRT_RTX`` is set (the ``POLYGRAPHY_USE_TENSORRT_RTX``
    variable). So the flag is set from ``lib`` before that import, ``tensorrt_rtx_bindings`` is registered under
    the name Polygraphy imports, Polygraphy's TensorRT logger is the library's one (:func:`~diffusion_trt.trt_compat.
    make_trt_logger`: one per library, errors kept for messages) and its own messages go to Python logging
    (logger "Polygraphy") instead of stdout.

    Raises:
        BuildError: the library or Polygraphy cannot be imported (naming the install), or Polygraphy is already bound
            to the other library in this process (one process builds with one library: run the other build in a
            second process).
    """
    rtx = lib.module != "tensorrt"
    try:
        from polygraphy import config as polygraphy_config
    except ImportError as e:
        raise BuildError(f"`import polygraphy` failed ({type(e).__name__}: {e}); the {lib.display} build runs "
                         f"through Polygraphy's loaders: {_POLYGRAPHY_INSTALL}") from e
    if "polygraphy.util" not in sys.modules:  # no Polygraphy module has picked its TensorRT module yet
        polygraphy_config.USE_TENSORRT_RTX = rtx
    if polygraphy_config.USE_TENSORRT_RTX != rtx:
        other = "TensorRT-RTX" if polygraphy_config.USE_TENSORRT_RTX else "TensorRT"
        raise BuildError(f"Polygraphy is bound to {other} in this process (it picks one TensorRT library per "
                         f"process); build with {lib.display} in another process")
    trt = lib.import_module()
    if rtx and sys.modules.setdefault(POLYGRAPHY_RTX_MODULE, trt) is not trt:
        raise BuildError(f"`import {POLYGRAPHY_RTX_MODULE}` is another module than {lib.module}; uninstall one of "
                         "the two TensorRT-RTX Python packages")
    from polygraphy.logger import G_LOGGER

    G_LOGGER.use_python_logging_system, G_LOGGER.colors, G_LOGGER.letter = True, False, False
    import polygraphy.backend.trt as polygraphy_trt
    from polygraphy.backend.trt import util as polygraphy_trt_util

    polygraphy_trt_util.TRT_LOGGER = trt_compat.make_trt_logger(trt)  # get_trt_logger() returns it
    return trt, polygraphy_trt


def _library_of(trt: Any) -> trt_compat.TrtLibrary:
    """The :class:`~diffusion_trt.trt_compat.TrtLibrary` whose module ``trt`` is."""
    name = str(trt.__name__).split(".")[0]
    for lib in trt_compat.LIBRARIES.values():
        if lib.module == name:
            return lib
    raise BuildError(f"{name!r} is not a TensorRT library module; use one of "
                     f"{', '.join(lib.module for lib in trt_compat.LIBRARIES.values())}")


def network_from_onnx(trt: Any, onnx_path: Path, strongly_typed: bool) -> tuple[Any, Any, Any]:
    """Parse an ONNX file into a network with Polygraphy's ``NetworkFromOnnxPath``: ``(builder, network, parser)``
    (keep all three alive together).

    Parsed from its path so external data (``model.onnx.data``) beside it is found.

    Raises:
        BuildError: parser errors, one line per node (index, name, op, message).
    """
    from polygraphy.exception import PolygraphyException

    _, polygraphy_trt = polygraphy_for(_library_of(trt))
    try:
        return polygraphy_trt.NetworkFromOnnxPath(str(onnx_path), strongly_typed=strongly_typed)()
    except PolygraphyException as e:
        errors = parser_errors(trt, polygraphy_trt, onnx_path, strongly_typed)
        if not errors:
            raise BuildError(f"Polygraphy could not parse {onnx_path}: {e}") from None
        raise BuildError(format_parser_errors(onnx_path, errors)) from None


def parser_errors(trt: Any, polygraphy_trt: Any, onnx_path: Path, strongly_typed: bool) -> list[ParserErrorInfo]:
    """The ONNX parser's errors on ``onnx_path``, one per node, from a second parse: ``NetworkFromOnnxPath`` logs
    them as text and raises, and a message names each node's index, name and op. Empty when no network could be
    made (Polygraphy's own message says why)."""
    from polygraphy.exception import PolygraphyException

    try:
        builder, network = polygraphy_trt.CreateNetwork(strongly_typed=strongly_typed)()
    except PolygraphyException:
        return []
    parser = trt.OnnxParser(network, trt_compat.make_trt_logger(trt))
    parser.parse_from_file(str(onnx_path))
    errors = [ParserErrorInfo.from_trt(parser.get_error(i)) for i in range(parser.num_errors)]
    del parser, network, builder
    return errors


def network_inputs(trt: Any, network: Any) -> dict[str, str]:
    """The network's inputs: name -> manifest dtype name ("float32"...)."""
    out = {}
    for i in range(network.num_inputs):
        t = network.get_input(i)
        out[t.name] = trt_compat.TRT_DTYPES.get(t.dtype.name, t.dtype.name)
    return out


def config_for(trt: Any, builder: Any, network: Any, target: BuildTarget, build: TrtBuildConfig, precision: str,
               strongly_typed: bool, profiles: Sequence[TrtProfile]) -> tuple[Any, list[str]]:
    """The ``IBuilderConfig`` from Polygraphy's ``CreateConfig`` (full TensorRT: precision flags for a weakly typed
    network) or ``CreateConfigRTX`` (TensorRT-RTX: ``compute_capabilities``): refit, weight streaming, memory pool,
    optimization level, one optimization profile each. TF32 and the profiling verbosity keep TensorRT's defaults
    (Polygraphy's would clear TF32 and record DETAILED layer information in the plan).

    Returns:
        ``(config, flags set on it)``.

    Raises:
        BuildError: TensorRT rejected a profile.
    """
    _, polygraphy_trt = polygraphy_for(target.library)
    applied = _precision_flags(trt, target.library, build.flags_for(precision), strongly_typed)
    common: dict[str, Any] = {
        "profiles": [_polygraphy_profile(polygraphy_trt, p) for p in profiles], "refittable": build.refittable,
        "weight_streaming": build.weight_streaming, "builder_optimization_level": build.builder_optimization_level,
        "memory_pool_limits": ({trt.MemoryPoolType.WORKSPACE: build.workspace_bytes}
                               if build.workspace_bytes is not None else None),
        "profiling_verbosity": trt.ProfilingVerbosity.LAYER_NAMES_ONLY,
    }
    if target.library.compute_capability_targets:
        from polygraphy.backend.tensorrt_rtx import CreateConfigRTX

        ccs = [trt_compat.parse_compute_capability(cc) for cc in target.compute_capabilities]
        loader = CreateConfigRTX(compute_capabilities=ccs, **common)
    else:
        precision_flags = {"tf32": hasattr(trt.BuilderFlag, "TF32"), **dict.fromkeys(applied, True)}
        loader = polygraphy_trt.CreateConfig(**precision_flags, **common)
    config = loader(builder, network)
    if config.num_optimization_profiles != len(profiles):
        raise BuildError(f"TensorRT rejected {len(profiles) - config.num_optimization_profiles} of the optimization "
                         f"profiles {[(p.kind, p.to_json()['inputs']) for p in profiles]}")
    return config, applied


def _polygraphy_profile(polygraphy_trt: Any, profile: TrtProfile) -> Any:
    out = polygraphy_trt.Profile()
    for name, (lo, opt, hi) in profile.shapes.items():
        out.add(name, lo, opt, hi)
    return out


def _precision_flags(trt: Any, lib: trt_compat.TrtLibrary, flags: Sequence[str], strongly_typed: bool) -> list[str]:
    """The builder precision flags a weakly typed full-TensorRT network takes (those this TensorRT has)."""
    if not flags:
        return []
    if strongly_typed or not lib.precision_flags:
        logger.info("strongly typed network: precision flags %s not set (types come from the graph)", list(flags))
        return []
    applied = []
    for f in flags:
        if not hasattr(trt.BuilderFlag, f.upper()):
            logger.warning("TensorRT %s has no BuilderFlag.%s (networks are always strongly typed from TensorRT 11): "
                           "precision comes from the graph's own types", trt.__version__, f.upper())
            continue
        applied.append(f)
    return applied


def attach_timing_cache(config: Any, target: BuildTarget, version: str,
                        cache_dir: Path | None) -> tuple[trt_compat.TimingCacheKey | None, dict[str, Any]]:
    """Load this (version, compute capability)'s timing cache into ``config``, replacing the empty one Polygraphy's
    ``CreateConfig`` set (Polygraphy's ``load_timing_cache`` reads an unframed file and does not say whether
    TensorRT took it; the facts here do).

    TensorRT-RTX builds ahead of time without timing kernels (they are specialised on the user's GPU at first
    load, kept in the runtime cache), so no timing cache is used for it.

    Returns:
        ``(key or None, facts)``; facts = ``{"file", "loaded", "saved", "ignored"}``.
    """
    facts: dict[str, Any] = {"file": None, "loaded": False, "saved": False, "ignored": None}
    if not target.library.precision_flags and target.library.compute_capability_targets:
        facts["ignored"] = "TensorRT-RTX builds without kernel timing (see the runtime cache)"
        return None, facts
    key = trt_compat.TimingCacheKey(version, target.compute_capabilities[0])
    payload: bytes | None = None
    if cache_dir is not None:
        payload, facts = read_timing_cache(Path(cache_dir), key)
        facts["saved"] = False
    if not payload:
        return key, facts
    cache = None
    try:
        cache = config.create_timing_cache(payload)
    except Exception as e:  # noqa: BLE001 - the bindings raise various types on a corrupt blob
        logger.debug("create_timing_cache failed: %s", e)
    if cache is None:
        facts["ignored"] = "TensorRT could not deserialize it"
    elif not config.set_timing_cache(cache, False):  # ignore_mismatch=False
        facts["ignored"] = "TensorRT reports it was made on another device or version"
        config.set_timing_cache(config.create_timing_cache(b""), False)
    else:
        facts["loaded"] = True
    if not facts["loaded"]:  # a framing mismatch was already reported by read_timing_cache
        logger.warning("timing cache %s ignored: %s; building with a fresh cache", facts["file"], facts["ignored"])
    return key, facts


def engine_from_network(trt: Any, builder: Any, network: Any, config: Any, where: str) -> memoryview:
    """Polygraphy's ``EngineBytesFromNetwork`` (``build_serialized_network``); the serialized plan as a memoryview.

    Raises:
        BuildError: the build failed, quoting the library's last errors.
    """
    from polygraphy.exception import PolygraphyException

    lib = _library_of(trt)
    _, polygraphy_trt = polygraphy_for(lib)
    trt_logger = trt_compat.make_trt_logger(trt)
    mark = trt_logger.mark()  # quote this build's errors only
    try:
        plan = polygraphy_trt.EngineBytesFromNetwork((builder, network), config)()
    except PolygraphyException:
        errors = trt_logger.errors_since(mark)
        last = "\n  ".join(errors[-5:]) or f"(no error logged; rerun with DEBUG logging of {trt_logger.name!r})"
        raise BuildError(
            f"{lib.display} failed to build {where}; its last errors:\n  {last}\nfix: raise workspace_bytes, lower "
            "builder_optimization_level, or compile with --precision fp32 to isolate a precision problem"
        ) from None
    return memoryview(plan)


def engine_from_onnx(
    onnx_path: Path,
    plan_path: Path,
    inputs: list[dict[str, Any]],
    *,
    precision: str,
    build: TrtBuildConfig,
    timing_cache_dir: Path | None,
) -> dict[str, Any]:
    """Build a TensorRT (or TensorRT-RTX) plan from an optimized ONNX file and write it to ``plan_path``.

    ``network_from_onnx`` -> ``config_for`` -> ``attach_timing_cache`` -> ``engine_from_network``: Polygraphy's
    ``NetworkFromOnnxPath``, ``CreateConfig``/``CreateConfigRTX`` and ``EngineBytesFromNetwork``, with our checks.

    Args:
        onnx_path: the optimized ``model.onnx``; parsed from its path so ``model.onnx.data`` beside it is found.
        plan_path: where the serialized plan goes (written atomically).
        inputs: the component's manifest input entries (name, dtype, symbolic shape, concrete min/opt/max).
        precision: "fp32", "fp16", "bf16", "int8" or "fp8" (see :data:`PRECISION_FLAGS`).
        build: how to build (``build.library`` picks full TensorRT or TensorRT-RTX).
        timing_cache_dir: folder of timing caches shared across builds (one file per TensorRT version and
            compute capability); ``None`` = no persistent cache. Not used by TensorRT-RTX.

    Returns:
        The manifest's ``build`` facts, :meth:`BuildFacts.to_json <diffusion_trt.artifact.facts.BuildFacts.to_json>`
        (the library and its version, the build GPU and the targets, precision and flags, profiles in TensorRT
        order, the plan's name, sha256 and size, the timing / runtime cache, the config).

    Raises:
        BuildError: no GPU where one is needed, no library or no Polygraphy, a precision a target lacks (checked
            first, before any work), parser errors (one line per node: index, name, op, message), graph inputs that
            differ from the manifest, or a failed build (quoting TensorRT's last errors).
        RuntimeInputError: unknown precision or compute capability.
    """
    t_start = time.perf_counter()
    build.flags_for(precision)  # unknown precision: refused before any work
    target = build_target(precision, build)
    profiles = profiles_from_inputs(inputs, build)
    ops = graph_ops(onnx_path)
    check_parsable(onnx_path, ops)  # before the parser: it may crash the process on a contrib op
    trt, _ = polygraphy_for(target.library)
    has_qdq = any(domain == "" and op in QDQ_OPS for domain, op in ops)
    strongly_typed = is_strongly_typed(build, target, has_qdq)
    builder, network, _parser = network_from_onnx(trt, onnx_path, strongly_typed and target.library.precision_flags)
    check_network_inputs(onnx_path, network_inputs(trt, network), inputs)
    config, applied = config_for(trt, builder, network, target, build, precision, strongly_typed, profiles)
    cache_key, cache_facts = attach_timing_cache(config, target, str(trt.__version__), timing_cache_dir)
    logger.info("building %s: %s %s for compute capability %s, flags %s, strongly_typed=%s, %d profile(s)",
                onnx_path, target.library.display, trt.__version__, ",".join(target.compute_capabilities), applied,
                strongly_typed, len(profiles))
    t_build = time.perf_counter()
    view = engine_from_network(trt, builder, network, config,
                               f"{onnx_path} (flags {applied}, profiles {[p.kind for p in profiles]})")
    build_seconds = time.perf_counter() - t_build
    artifacts.write_bytes_atomic(plan_path, view)
    if cache_key is not None and timing_cache_dir is not None:
        cache_facts["saved"] = save_timing_cache(config, Path(timing_cache_dir), cache_key)
    facts = BuildFacts(
        engine=target.library.backend, library=target.library.backend, tensorrt=str(trt.__version__),
        gpu=target.gpu or None, compute_capability=target.plan_compute_capability,
        compute_capabilities=target.compute_capabilities, precision=precision, flags=tuple(applied),
        strongly_typed=strongly_typed, has_qdq=has_qdq, builder_optimization_level=config.builder_optimization_level,
        workspace_bytes=build.workspace_bytes, refittable=build.refittable,
        profiles=tuple(p.to_json() for p in profiles), num_layers=int(network.num_layers),
        build_seconds=round(build_seconds, 3), plan=plan_path.name, plan_sha256=hashlib.sha256(view).hexdigest(),
        plan_bytes=len(view), timing_cache=cache_facts,
        runtime_cache=f"{plan_path.parent.name}.runtime-cache" if target.library.runtime_config else None,
        config=build.to_json(),
    )
    logger.info("built %s -> %s (%.1f MB, %d layers) in %.1f s", onnx_path.name, plan_path, len(view) / 1e6,
                facts.num_layers, time.perf_counter() - t_start)
    return facts.to_json()


def is_strongly_typed(build: TrtBuildConfig, target: BuildTarget, has_qdq: bool) -> bool:
    """Whether the network is built strongly typed: as the config says (``None`` = when the graph has Q/DQ nodes),
    and always for a library without precision flags (TensorRT-RTX)."""
    return (has_qdq if build.strongly_typed is None else build.strongly_typed) or not target.library.precision_flags


def save_timing_cache(config: Any, cache_dir: Path, key: trt_compat.TimingCacheKey) -> bool:
    """Write the config's timing cache (framed for ``key``) into ``cache_dir``, atomically; ``True`` once written."""
    serialized = config.get_timing_cache().serialize()
    artifacts.write_bytes_atomic(cache_dir / key.filename,
                                 trt_compat.pack_timing_cache(key, bytes(memoryview(serialized))))
    return True

"""TensorRT implementation of the :class:`~diffusion_trt.runtime.engines.engine.Engine` protocol.

One engine = one serialized plan (``unet/model.plan``) with several optimization profiles (see
``compiler/build_trt.py``: the artifact's dynamic range, extra ranges, a static fast path at the opt shape).

What happens, in order:

1. **Before deserialising** (``__enter__``): the manifest's TensorRT version and compute capability are
   compared with this machine's (:func:`~diffusion_trt.trt_compat.check_plan_compat`), and optionally the
   plan's sha256 (:func:`verify_plan`); a mismatch is an :class:`ArtifactError` naming both sides, instead
   of TensorRT's opaque version-tag assertion.
2. **One execution context per profile**, each created *without device memory*
   (``ExecutionContextAllocationStrategy.USER_MANAGED``). Their activation memory is one allocation,
   :class:`SharedActivationMemory`, sized by the largest need and shared by every engine of a pipeline.
   **Sharing is only safe because the engines run one after another on one stream.**
3. ``run``: inputs validated against the manifest (:meth:`EngineSpec.validate`) and the narrowest
   profile that holds their shapes is chosen (:func:`select_profile`); ``set_input_shape`` when the shape
   changes; ``set_tensor_address`` on engine-owned torch CUDA buffers, allocated once per (tensor, shape);
   ``execute_async_v3`` on the runtime's stream.
4. **CUDA graphs**: the first call at a (profile, shape) runs eagerly (the warm-up TensorRT needs to flush
   deferred updates); the second captures the enqueue into a CUDA graph; later calls copy the inputs into
   the owned input buffers and replay. A profile's graph is dropped when its shape changes, when the
   shared activation memory moves, and on :meth:`TrtEngine.refit`.

5. **Two libraries, one code path**: the engine takes its :class:`~diffusion_trt.trt_compat.TrtLibrary` from the
   manifest's backend ("tensorrt" or "tensorrt-rtx", :func:`~diffusion_trt.trt_compat.library`) and branches on its
   fields only. Where ``library.runtime_config`` (TensorRT-RTX), each context is created from an
   ``IRuntimeConfig`` (after NVIDIA's TensorRT-RTX samples):

   * CUDA graphs are TensorRT-RTX's own: ``CudaGraphStrategy.WHOLE_GRAPH_CAPTURE`` on static profiles (one shape;
     inputs are copied into engine-owned buffers so the addresses it captured stay valid), ``DISABLED`` on dynamic
     ones (:func:`rtx_cuda_graph_strategy`). Our torch capture of item 4 is off for these engines: with dynamic
     shapes TensorRT-RTX swaps a fallback kernel for a shape-specialised one once compiled, which a graph captured
     from outside would never see. When the shared activation memory moves, the context gets the new address
     (``set_device_memory``); that TensorRT-RTX then captures again rather than replaying the old address has not
     been observed yet: no GPU it supports has run this code (issue 27).
   * ``DynamicShapesKernelSpecializationStrategy.LAZY`` (TensorRT-RTX's default, set explicitly): a new shape of a
     dynamic profile runs a generic fallback kernel at once while the specialised one compiles in the background
     and is used from a later call on. EAGER would stall the call at every new image size for the compilation;
     NONE would never specialise.
   * one ``IRuntimeCache`` per engine, shared by its contexts, loaded from and saved (atomically, on
     :meth:`TrtEngine.close`) to the file ``runtime_cache`` names (:mod:`~diffusion_trt.runtime.engines.runtime_cache`):
     the first load compiles the kernels for this GPU, later loads read them. A corrupt, foreign, oversized or
     not-regular file is ignored with a warning; so is a ``create_runtime_cache`` that returns ``None`` (then
     kernels are not cached).
   * activation memory stays USER_MANAGED and shared (``set_execution_context_allocation_strategy``).

   The compute-capability refusal comes first, from manifest facts alone
   (:func:`~diffusion_trt.trt_compat.check_host`): on a GPU TensorRT-RTX does not support (the H200's 9.0) no plan
   byte is read.

6. **Every call's verdict is read**: a ``False`` from ``set_tensor_address``, ``set_input_shape``,
   ``set_optimization_profile_async``, ``execute_async_v3`` or the refitter, a ``None`` engine, context or runtime
   config, and a refused ``cuda_graph_strategy`` or ``weight_streaming_budget_v2`` (whose setters' ``bool`` never
   reaches Python: :func:`~diffusion_trt.trt_compat.assign` reads the library's logged errors and the value back)
   are errors naming the tensor, setting or profile.
   The library has one logger per process (:func:`~diffusion_trt.trt_compat.make_trt_logger`, shared with the
   build); a message quotes only the errors it logged during this open, run or refit.

**The tensors ``run`` returns ARE the engine's output buffers: the next ``run`` at the same shape
overwrites them. ``.clone()`` anything that must outlive the next call.**

``tensorrt`` / ``tensorrt_rtx_bindings`` are imported only inside this module's methods; the pure parts (profile
selection, I/O checks, plan verification, the shared allocation, the CUDA-graph strategy, the refusal of an
unsupported GPU) are tested on machines without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import trt_compat
from ...artifact.facts import BuildFacts
from ...artifact.folder import verify_files
from ...errors import ArtifactError, DiffusionTrtError, RuntimeInputError
from . import runtime_cache
from .engine import EngineBase, EngineSpec

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

#: TensorRT wants activation memory aligned to 256 bytes (``IExecutionContext.device_memory`` docs);
#: torch's CUDA caching allocator returns 512-byte aligned blocks. Never allocate less than this.
_MIN_ACTIVATION_BYTES = 512


def _fmt(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


# -- shared activation memory ---------------------------------------------------------------------------


class SharedActivationMemory:
    """One device allocation used as TensorRT activation ("device") memory by several engines.

    Every :class:`TrtEngine` of a pipeline calls :meth:`reserve` with its largest per-profile need when it
    opens; the allocation grows to the maximum, so a text encoder + UNet + VAE pipeline holds the UNet's (or
    the VAE's) activation memory once instead of three times.

    **Only engines that never run concurrently may share one** (the pipeline runs them in sequence on one
    stream). :attr:`generation` changes whenever the allocation moves, so engines re-point their contexts and
    drop CUDA graphs captured against the old address.

    Args:
        device: where to allocate (a CUDA device; CPU is accepted for tests).
    """

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None
        self.generation = 0

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else int(self._buf.numel())

    @property
    def ptr(self) -> int:
        """Device address of the allocation (0 when nothing is reserved)."""
        return 0 if self._buf is None else int(self._buf.data_ptr())

    def reserve(self, nbytes: int) -> bool:
        """Grow to at least ``nbytes`` (never shrinks). Returns whether the allocation moved.

        Growing waits for the device first: kernels queued by any sharing engine may still use the old block.
        """
        nbytes = max(int(nbytes), _MIN_ACTIVATION_BYTES)
        if nbytes <= self.nbytes:
            return False
        if self._buf is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._buf = None
        self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.generation += 1
        logger.debug(
            "shared activation memory: %.1f MB on %s (generation %d)", nbytes / 1e6, self.device, self.generation
        )
        return True

    def release(self) -> None:
        """Free the allocation (engines using it must be closed)."""
        self._buf = None
        self.generation += 1

    def __repr__(self) -> str:
        return f"SharedActivationMemory({self.nbytes} bytes on {self.device}, generation {self.generation})"


# -- profiles -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RuntimeProfile:
    """One optimization profile of a plan: its index and min/opt/max per input.

    Attributes:
        index: TensorRT profile index.
        kind: "dynamic", "static", "extra" (from the manifest; "" when unknown).
        shapes: input name -> (min, opt, max).
    """

    index: int
    kind: str
    shapes: Mapping[str, tuple[Shape, Shape, Shape]]

    def violation(self, shapes: Mapping[str, Shape]) -> str | None:
        """``None`` when every input shape lies in this profile, else the first offence in words."""
        for name, (lo, _, hi) in self.shapes.items():
            s = tuple(shapes[name])
            if len(s) != len(lo) or any(not a <= d <= b for d, a, b in zip(s, lo, hi, strict=True)):
                return f"input {name!r} {_fmt(s)} not in {_fmt(lo)}..{_fmt(hi)}"
        return None

    @property
    def volume(self) -> int:
        """Sum over inputs of the max shape's element count: smaller = narrower (better-fitted kernels)."""
        return sum(int(np.prod(hi)) for _, _, hi in self.shapes.values())


def profiles_from_build(build: Mapping[str, Any]) -> list[RuntimeProfile]:
    """The profiles a manifest's ``build`` facts record (``build_trt.engine_from_onnx`` writes them).

    Raises:
        ArtifactError: missing or malformed ``profiles``.
    """
    try:
        return [
            RuntimeProfile(
                index=i,
                kind=str(p.get("kind", "")),
                shapes={n: (tuple(s["min"]), tuple(s["opt"]), tuple(s["max"])) for n, s in p["inputs"].items()},
            )
            for i, p in enumerate(build["profiles"])
        ]
    except (KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(
            f"the manifest's build facts have no readable 'profiles' ({e}); recompile the artifact"
        ) from None


def select_profile(profiles: Sequence[RuntimeProfile], shapes: Mapping[str, Shape], engine: str) -> int:
    """Index of the narrowest profile (smallest :attr:`RuntimeProfile.volume`) holding every input shape.

    A static fast-path profile at exactly these shapes wins over the dynamic one.

    Raises:
        RuntimeInputError: no profile holds the shapes; the message names, per profile, the input, its shape
            and the allowed range.
    """
    fits = [p for p in profiles if p.violation(shapes) is None]
    if fits:
        return min(fits, key=lambda p: (p.volume, p.index)).index
    why = "; ".join(f"profile {p.index}{f' ({p.kind})' if p.kind else ''}: {p.violation(shapes)}" for p in profiles)
    raise RuntimeInputError(
        f"engine {engine!r}: no optimization profile holds the input shapes "
        f"{ {n: _fmt(s) for n, s in shapes.items()} } ({why}); use sizes inside the compiled profile or recompile "
        "with a wider one"
    )


def check_engine_io(engine: str, io: Mapping[str, tuple[str, str]], spec: EngineSpec) -> None:
    """The plan's I/O tensors must be the manifest's: same names, directions and element types.

    Args:
        engine: component name for messages.
        io: tensor name -> (``TensorIOMode`` name "INPUT"/"OUTPUT", ``DataType`` name "FLOAT"/"HALF"...).
        spec: the manifest's I/O.

    Raises:
        ArtifactError: naming both sides.
    """
    for mode, infos in (("INPUT", spec.inputs), ("OUTPUT", spec.outputs)):
        plan = {n: trt_compat.TRT_DTYPES.get(dt, dt) for n, (m, dt) in io.items() if m == mode}
        manifest = {t.name: t.dtype for t in infos}
        if plan != manifest:
            raise ArtifactError(
                f"engine {engine!r}: the plan's {mode.lower()}s {plan} differ from the manifest's {manifest}; the "
                "artifact is inconsistent: recompile it"
            )


def verify_plan(path: Path, build: Mapping[str, Any], engine: str) -> None:
    """Check the plan file's size and sha256 against the manifest's build facts (through ``verify_files``).

    Raises:
        ArtifactError: missing facts, or the file differs; the message gives found vs expected.
    """
    if "plan_sha256" not in build or "plan_bytes" not in build:
        raise ArtifactError(
            f"engine {engine!r}: the manifest records no plan_sha256/plan_bytes; recompile the artifact"
        )
    entry = {"sha256": str(build["plan_sha256"]), "size": int(build["plan_bytes"])}
    problems = verify_files(path.parent, {"files": {path.name: entry}})
    if problems:
        raise ArtifactError(f"engine {engine!r}: plan {path} failed verification: " + "; ".join(problems))


def check_plan_bytes(blob: bytes, build: Mapping[str, Any], where: str) -> None:
    """:func:`verify_plan` on bytes already read (the bytes then deserialised).

    Raises:
        ArtifactError: missing facts, or the bytes differ from ``plan_bytes``/``plan_sha256``.
    """
    if "plan_sha256" not in build or "plan_bytes" not in build:
        raise ArtifactError(f"{where}: the manifest records no plan_sha256/plan_bytes; recompile the artifact")
    digest = hashlib.sha256(blob).hexdigest()
    if len(blob) != int(build["plan_bytes"]) or digest != str(build["plan_sha256"]):
        raise ArtifactError(
            f"{where}: plan of {len(blob)} bytes, sha256 {digest[:12]}… != {build['plan_bytes']} bytes, "
            f"{str(build['plan_sha256'])[:12]}… in the manifest; the file was altered: recompile it"
        )


# -- the engine -----------------------------------------------------------------------------------------


@dataclass
class _ContextState:
    """Per-profile execution state: the shape key set on the context, its CUDA graph, the memory generation."""

    context: Any
    shape_key: tuple[Shape, ...] | None = None
    warm: bool = False
    graph: Any = None
    generation: int = -1
    native_graph: bool = False  # TensorRT-RTX captures this context itself (WHOLE_GRAPH_CAPTURE)


def rtx_cuda_graph_strategy(profile: RuntimeProfile, cuda_graphs: bool = True) -> str:
    """The ``CudaGraphStrategy`` member name for a profile's context on a library with a runtime config.

    ``"WHOLE_GRAPH_CAPTURE"`` when ``cuda_graphs`` and the profile is static (min == max for every input: one shape,
    captured once by TensorRT-RTX and replayed); ``"DISABLED"`` for dynamic profiles (each new shape would be
    captured and kept) and when CUDA graphs are off.
    """
    static = all(lo == hi for lo, _, hi in profile.shapes.values())
    return "WHOLE_GRAPH_CAPTURE" if cuda_graphs and static else "DISABLED"


def _profile_shapes(engine: Any, names: Sequence[str], index: int) -> dict[str, tuple[Shape, Shape, Shape]]:
    """Input name -> (min, opt, max) of profile ``index``, read from the deserialised engine."""
    shapes = {}
    for n in names:
        lo, opt, hi = engine.get_tensor_profile_shape(n, index)
        shapes[n] = (tuple(lo), tuple(opt), tuple(hi))
    return shapes


class TrtEngine(EngineBase):
    """One TensorRT plan run on torch CUDA tensors.

    Args:
        path: the component's plan (``unet/model.plan``).
        spec: the manifest's component entry (with ``inputs``, ``outputs`` and ``build``) or a parsed
            :class:`EngineSpec` (then pass ``build``).
        name: component name for messages; default the spec's name or the folder name.
        build: the build facts (:class:`~diffusion_trt.artifact.facts.BuildFacts`, or its JSON: ``tensorrt``,
            ``compute_capability``, ``plan_sha256``...); default ``spec["build"]``.
        device_id: CUDA device ordinal.
        stream: the ``torch.cuda.Stream`` to enqueue on; ``None`` = a stream of the engine's own (never the
            legacy default stream: TensorRT would synchronise around it and CUDA graphs cannot capture it).
        shared_memory: activation memory shared with the pipeline's other engines; ``None`` = a private one.
        cuda_graphs: capture and replay CUDA graphs (see the module docstring).
        verify: check the plan's sha256 before deserialising (the pipeline passes ``False`` when it already
            verified the whole artifact).
        derived: output symbols no input binds; see :meth:`EngineSpec.from_manifest`.
        backend: the manifest's backend, "tensorrt" or "tensorrt-rtx": which library loads the plan
            (:func:`~diffusion_trt.trt_compat.library`).
        runtime_cache: TensorRT-RTX: the runtime-cache file to load on enter and save on close
            (:func:`~diffusion_trt.runtime.engines.runtime_cache.runtime_cache_path`); ``None`` = kernels kept in memory
            only.
            Ignored for full TensorRT.
        weight_streaming_budget: bytes of streamable weights to keep on the device
            (``engine.weight_streaming_budget_v2``; plans built with weight streaming only); ``None`` = all.

    Nothing is loaded until ``__enter__``.

    Raises:
        ArtifactError: on enter: no CUDA, a GPU the library does not support or the plan was not built for (raised
            before the library is imported or the plan read), the library missing or of another release, a
            weight-streaming budget for a plan built without it, a missing or altered plan, a plan TensorRT cannot
            load, or I/O that differ from the manifest.

    **Outputs are the engine's own buffers, overwritten by the next ``run`` at the same shape.**
    Not thread-safe: use one engine per thread.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        spec: Mapping[str, Any] | EngineSpec,
        *,
        name: str | None = None,
        build: BuildFacts | Mapping[str, Any] | None = None,
        device_id: int = 0,
        stream: torch.cuda.Stream | None = None,
        shared_memory: SharedActivationMemory | None = None,
        cuda_graphs: bool = True,
        verify: bool = True,
        derived: Mapping[str, tuple[str, int]] | None = None,
        source: Callable[[], bytes] | None = None,
        backend: str = "tensorrt",
        runtime_cache: str | os.PathLike[str] | None = None,
        weight_streaming_budget: int | None = None,
    ) -> None:
        self.path = Path(path)
        self._source = source  # the plan's bytes (e.g. ArtifactReader.read, checked there); None = read path
        try:
            self._library = trt_compat.library(backend)
        except DiffusionTrtError as e:
            raise ArtifactError(str(e)) from None
        self._cache_path = Path(runtime_cache) if runtime_cache is not None else None
        self._name_and_spec(self.path, spec, name, derived)
        if build is None:
            build = {} if isinstance(spec, EngineSpec) else spec.get("build", {})
        self._build = build.to_json() if isinstance(build, BuildFacts) else dict(build)  # the manifest's JSON form
        self._device = torch.device("cuda", device_id)
        self._device_id = device_id
        self._user_stream = stream
        self._shared_arg = shared_memory
        self._cuda_graphs = cuda_graphs
        self._verify = verify

        self._trt: Any = None
        self._logger: Any = None
        self._mark = 0  # the logger's mark at the start of the current open/run/refit: its errors are quoted
        self._runtime: Any = None
        self._engine: Any = None
        self._stream: Any = None
        self._memory: SharedActivationMemory | None = None
        self._profiles: list[RuntimeProfile] = []
        self._states: list[_ContextState] = []
        self._buffers: dict[tuple[str, Shape], torch.Tensor] = {}
        self._live_inputs: dict[str, torch.Tensor] = {}
        self._graphs_failed = False
        self._depth = 0
        self._runtime_configs: list[Any] = []  # TensorRT-RTX: one per context, kept as long as the contexts
        self._runtime_cache: Any = None
        self._cache_failed = False  # create_runtime_cache returned None: not asked again for this open
        self._cache_key: runtime_cache.RuntimeCacheKey | None = None
        self._cache_loaded: bytes | None = None
        self._weight_streaming_budget = weight_streaming_budget
        #: memory facts read at load (see runtime/engines/trt_memory.py); ``{}`` until opened
        self.memory_facts: dict[str, Any] = {}

    # -- Engine protocol -------------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._engine is not None

    @property
    def profiles(self) -> list[RuntimeProfile]:
        """The plan's optimization profiles (read from the engine; empty while closed)."""
        return list(self._profiles)

    def close(self) -> None:
        """Save the runtime cache (TensorRT-RTX), free contexts, graphs, buffers and the engine (idempotent).

        The shared memory stays with its owner. A runtime cache that cannot be written is a warning.
        """
        if self._engine is not None and self._stream is not None:
            self._stream.synchronize()  # queued work may still use our buffers
        if self._engine is not None:
            self._save_runtime_cache()
        self._states = []  # contexts first, then their runtime configs and cache, then the engine
        self._runtime_configs = []
        self._runtime_cache = None
        self._cache_failed = False
        self._cache_loaded = None
        self._buffers = {}
        self._live_inputs = {}
        self._engine = None
        self._runtime = None
        self._profiles = []
        if self._memory is not None and self._memory is not self._shared_arg:
            self._memory.release()
        self._memory = None
        self._depth = 0

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the component on the engine's stream (ordered after the caller's stream, and it after us).

        Args:
            feeds: every input by name, CUDA tensors on :attr:`device` with the manifest's dtypes and shapes.

        Returns:
            Output name -> tensor. **These are the engine's buffers: the next run at this shape overwrites them.**

        Raises:
            RuntimeInputError: inputs that fail :meth:`validate` or fit no profile.
            RuntimeError: the engine is not open, or TensorRT refused a tensor's address (the tensor named) or failed
                to enqueue (the errors it logged during this call quoted).
        """
        if self._engine is None:
            raise RuntimeError(f"engine {self._name!r} is not open; use `with engine:` or call it inside the pipeline")
        self._mark = self._logger.mark()
        symbols = self.validate(feeds)
        out_shapes = self._spec.output_shapes(symbols)
        in_shapes = {n: tuple(int(d) for d in feeds[n].shape) for n in self.input_names}
        index = select_profile(self._profiles, in_shapes, self._name)
        state = self._states[index]
        ctx = state.context
        stream = self._stream
        caller = torch.cuda.current_stream(self._device)
        if caller != stream:
            stream.wait_stream(caller)  # inputs made on the caller's stream come first (no host sync)

        key = tuple(in_shapes[n] for n in self.input_names)
        if state.shape_key != key:
            state.shape_key, state.warm, state.graph = None, False, None  # a graph is valid for one shape only
            for n in self.input_names:
                if not ctx.set_input_shape(n, in_shapes[n]):
                    raise RuntimeInputError(
                        f"engine {self._name!r}: TensorRT refused input {n!r} shape {_fmt(in_shapes[n])} for profile "
                        f"{index} ({self._profiles[index].shapes[n][0]}..{self._profiles[index].shapes[n][2]})"
                    )
            state.shape_key = key
        if state.generation != self._memory.generation:
            self._set_device_memory(ctx)
            state.generation, state.warm, state.graph = self._memory.generation, False, None

        outputs = {n: self._buffer(n, out_shapes[n]) for n in self.output_names}
        # our torch capture: full TensorRT only (TensorRT-RTX captures its static contexts itself)
        use_graph = self._cuda_graphs and not self._graphs_failed and not self._library.runtime_config
        with torch.cuda.stream(stream):
            if use_graph or state.native_graph:  # graphs replay fixed addresses: inputs go to owned buffers
                bound = {n: self._buffer(f"input:{n}", in_shapes[n]) for n in self.input_names}
                for n, buf in bound.items():
                    src = feeds[n]
                    if src.data_ptr() != buf.data_ptr():
                        buf.copy_(src, non_blocking=True)
            else:
                bound = {n: feeds[n].detach().contiguous() for n in self.input_names}
            if use_graph and state.graph is not None:
                state.graph.replay()
            else:
                self._bind(ctx, {**bound, **outputs}, index)
                if use_graph and state.warm:
                    self._capture(state)
                else:
                    self._enqueue(ctx)
                    state.warm = True
        if caller != stream:
            caller.wait_stream(stream)  # the caller's later work (and frees) come after this run
        self._live_inputs = dict(feeds)  # eager runs read the caller's tensors asynchronously: keep them alive
        return outputs

    def refit(
        self,
        weights: Mapping[str, np.ndarray | torch.Tensor],
        fill_missing: Callable[[list[str]], Mapping[str, np.ndarray]] | None = None,
    ) -> None:
        """Replace named weights (ONNX initializer names) in a plan built with ``refittable=True``.

        Waits for queued work, refits synchronously, and drops every CUDA graph.

        Args:
            weights: initializer name -> new value (the initializer's dtype and shape).
            fill_missing: called with the names ``Refitter.get_missing_weights`` still wants (weights TensorRT
                fused with the ones given); returns their values (e.g. the unchanged ONNX initializers).

        Raises:
            ArtifactError: the plan is not refittable, or TensorRT's refit failed.
            RuntimeInputError: an unknown weight name, shape or dtype (also one TensorRT has no host type for:
                float64, a torch bfloat16 tensor, which numpy cannot hold), a value that is not an array, or weights
                TensorRT still needs (``get_missing_weights``).
        """
        if self._engine is None:
            raise RuntimeError(f"engine {self._name!r} is not open; use `with engine:`")
        self._mark = self._logger.mark()
        trt = self._trt
        if not self._engine.refittable:
            raise ArtifactError(
                f"engine {self._name!r} was built without refit support; recompile with TrtBuildConfig(refittable=True)"
            )
        self._stream.synchronize()
        refitter = trt.Refitter(self._engine, self._logger)
        keep: list[np.ndarray] = []  # TensorRT reads the host arrays during refit_cuda_engine
        for wname, value in weights.items():
            arr, host = self._refit_weights(wname, value)
            keep.append(arr)
            if not refitter.set_named_weights(wname, host):
                raise RuntimeInputError(
                    f"engine {self._name!r}: weight {wname!r} {arr.shape} {arr.dtype} was refused (unknown name or "
                    "wrong shape/dtype); names are the ONNX initializer names"
                )
        missing = list(refitter.get_missing_weights())
        if missing and fill_missing is not None:
            for wname, value in fill_missing(missing).items():
                arr, host = self._refit_weights(wname, value)
                keep.append(arr)
                if not refitter.set_named_weights(wname, host):
                    raise RuntimeInputError(f"engine {self._name!r}: weight {wname!r} was refused while filling in")
            missing = list(refitter.get_missing_weights())
        if missing:
            raise RuntimeInputError(
                f"engine {self._name!r}: refit also needs the weight(s) {missing[:8]}"
                f"{' and more' if len(missing) > 8 else ''}; pass them too"
            )
        if not refitter.refit_cuda_engine():
            raise ArtifactError(f"engine {self._name!r}: TensorRT refit failed: {self._last_errors()}")
        for state in self._states:
            state.graph, state.warm = None, False
        logger.info("%s: refit %d weight(s); CUDA graphs dropped", self._name, len(keep))

    # -- internals ------------------------------------------------------------------------------------

    def _last_errors(self) -> str:
        """The errors the library logged since the current open, run or refit began (never an earlier one's)."""
        return trt_compat.quote_errors(self._logger, self._mark)

    def _refit_weights(self, wname: str, value: Any) -> tuple[np.ndarray, Any]:
        """``(host array, trt.Weights)`` of one refit value (the array must stay alive until the refit is done).

        Raises:
            RuntimeInputError: a value numpy cannot hold (a torch bfloat16 tensor), that is not an array, or of a
                dtype TensorRT has no weights type for (float64, strings, objects); naming the weight.
        """
        what = f"engine {self._name!r}: weight {wname!r}"
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.bfloat16:
                raise RuntimeInputError(
                    f"{what} is a torch.bfloat16 tensor, which refit cannot hand to TensorRT (numpy, its host type, "
                    "has no bfloat16); give it in its ONNX initializer's dtype (e.g. .to(torch.float16) for an fp16 "
                    "artifact)"
                )
            try:
                arr = value.detach().cpu().contiguous().numpy()
            except (TypeError, RuntimeError) as e:
                raise RuntimeInputError(f"{what}: a {value.dtype} tensor cannot be read as a numpy array ({e}); "
                                        "give it in its ONNX initializer's dtype") from None
        else:
            try:
                arr = np.ascontiguousarray(value)
            except (TypeError, ValueError) as e:
                raise RuntimeInputError(f"{what} is a {type(value).__name__}, not an array ({e}); give a numpy "
                                        "array or torch tensor in its ONNX initializer's dtype and shape") from None
        try:
            return arr, self._trt.Weights(arr)
        except (TypeError, ValueError) as e:
            raise RuntimeInputError(
                f"{what} {arr.shape} {arr.dtype}: {self._library.display} has no weights type for {arr.dtype} "
                f"({e}); give it in its ONNX initializer's dtype (float32 or float16)"
            ) from None

    def _bind(self, ctx: Any, tensors: Mapping[str, torch.Tensor], index: int) -> None:
        """``set_tensor_address`` for every tensor; a refusal (``False``) is an error naming the tensor.

        Raises:
            RuntimeError: naming the tensor, its shape, dtype and address, the profile, and the library's errors.
        """
        for n, t in tensors.items():
            if ctx.set_tensor_address(n, t.data_ptr()) is False:
                raise RuntimeError(
                    f"engine {self._name!r}: {self._library.display} refused the address 0x{t.data_ptr():x} of tensor "
                    f"{n!r} ({t.dtype} {_fmt(t.shape)}) on profile {index}: {self._last_errors()}"
                )

    def _buffer(self, key: str, shape: Shape) -> torch.Tensor:
        """The engine-owned buffer for ``key`` (an output name, or ``input:<name>``) at ``shape``.

        Kept until close: a captured CUDA graph holds its address, so a buffer is never freed or reused for
        another shape while its graph may replay.
        """
        buf = self._buffers.get((key, shape))
        if buf is None:
            name = key.removeprefix("input:")
            info = self._spec.input(name) if key.startswith("input:") else self._spec.output(name)
            buf = torch.empty(shape, dtype=info.torch_dtype, device=self._device)
            self._buffers[(key, shape)] = buf
            logger.debug("%s: allocated %s %s", self._name, key, shape)
        return buf

    def _enqueue(self, ctx: Any) -> None:
        if not ctx.execute_async_v3(self._stream.cuda_stream):
            raise RuntimeError(f"engine {self._name!r}: execute_async_v3 failed: {self._last_errors()}")

    def _capture(self, state: _ContextState) -> None:
        """Capture this (profile, shape)'s enqueue into a CUDA graph and replay it; on failure run eagerly."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                ok = state.context.execute_async_v3(self._stream.cuda_stream)
            if not ok:
                raise RuntimeError(self._last_errors())
        except RuntimeError as e:
            logger.warning("%s: CUDA graph capture failed (%s); running without CUDA graphs", self._name, e)
            self._graphs_failed = True
            self._enqueue(state.context)
            return
        state.graph = graph
        graph.replay()  # capture records only: this call's work runs now
        logger.debug("%s: captured a CUDA graph for shapes %s", self._name, state.shape_key)

    def _set_device_memory(self, ctx: Any) -> None:
        mem = self._memory
        if hasattr(ctx, "set_device_memory"):  # TensorRT >= 10.1
            ctx.set_device_memory(mem.ptr, mem.nbytes)
        else:
            ctx.device_memory = mem.ptr

    @staticmethod
    def _memory_size(engine: Any, index: int) -> int:
        """Activation bytes profile ``index`` needs: the per-profile getter, else the engine's size; the ``_v2`` name
        first (RTX 1.7.1 has only the ``_v2`` names), each looked up only when the one before is absent.

        Raises:
            ArtifactError: the engine has none of these attributes.
        """
        for attr in ("get_device_memory_size_for_profile_v2", "get_device_memory_size_for_profile"):
            fn = getattr(engine, attr, None)
            if fn is not None:
                return int(fn(index))
        for attr in ("device_memory_size_v2", "device_memory_size"):
            value = getattr(engine, attr, None)
            if value is not None:
                return int(value)
        raise ArtifactError(
            f"this {type(engine).__name__} tells no activation-memory size (no get_device_memory_size_for_profile_v2, "
            "device_memory_size_v2 or device_memory_size); use a TensorRT release this diffusion-trt supports"
        )

    def _open(self) -> None:
        try:
            self._load()
        except BaseException:
            self.close()  # a failed open keeps nothing: no runtime, configs, cache or memory of its own
            raise

    def _load(self) -> None:
        lib = self._library
        where = f"engine {self._name!r} ({self.path})"
        facts = trt_compat.gpu_facts(self._device_id)
        if facts is None:
            raise ArtifactError(
                f"{where}: {lib.display} engines run on CUDA and torch sees no CUDA device "
                f"(torch {torch.__version__}); run on the GPU host with a CUDA build of torch, or use an ORT artifact"
            )
        # 1. before anything else: a GPU the library (or the plan's targets) does not cover, from manifest facts alone
        if lib.compute_capability_targets:
            targets = self._build.get("compute_capabilities")
            lib.check_runs_on(facts.compute_capability, targets if isinstance(targets, list) else None, facts.gpu,
                              where)
        trt = lib.import_module(ArtifactError)
        host = dataclasses.replace(facts, tensorrt=str(trt.__version__))
        trt_compat.check_host(lib, self._build, host, where)  # the release (and, for full TensorRT, the GPU)
        if self._source is None and not self.path.is_file():
            raise ArtifactError(f"{where}: the plan file is missing; recompile the artifact")
        blob = self._source() if self._source is not None else self.path.read_bytes()  # read once: hashed = loaded
        if self._verify:
            check_plan_bytes(blob, self._build, where)
        self._trt = trt
        self._logger = trt_compat.make_trt_logger(trt)  # the library's one logger, shared with its builders
        self._mark = self._logger.mark()  # this open quotes its own errors only
        self._runtime = trt.Runtime(self._logger)  # must outlive the engine
        with torch.cuda.device(self._device):
            self._check_validity(blob, where)
            engine = self._runtime.deserialize_cuda_engine(blob)
        del blob
        if engine is None:
            raise ArtifactError(
                f"{where}: {lib.display} could not deserialize the plan: {self._last_errors()}; recompile it"
            )
        io: dict[str, tuple[str, str]] = {}
        for i in range(engine.num_io_tensors):
            t = engine.get_tensor_name(i)
            io[t] = (engine.get_tensor_mode(t).name, engine.get_tensor_dtype(t).name)
        check_engine_io(self._name, io, self._spec)
        from .trt_memory import apply_weight_streaming, engine_memory_facts

        apply_weight_streaming(engine, self._weight_streaming_budget, where, self._logger,  # before any context
                               lib.display)
        self.memory_facts = engine_memory_facts(engine)
        is_shape_io = getattr(engine, "is_shape_inference_io", None)
        host_inputs = [n for n in self.input_names if is_shape_io is not None and is_shape_io(n)]
        if host_inputs:
            raise ArtifactError(
                f"{where}: input(s) {host_inputs} are shape tensors (read on the host), which this engine does not "
                "bind; re-export the component so that they are execution tensors"
            )

        kinds = [p.get("kind", "") for p in self._build.get("profiles", [])]
        self._profiles = [
            RuntimeProfile(p, kinds[p] if p < len(kinds) else "", _profile_shapes(engine, self.input_names, p))
            for p in range(engine.num_optimization_profiles)
        ]

        self._stream = self._user_stream
        if self._stream is None or int(self._stream.cuda_stream) == 0:
            self._stream = torch.cuda.Stream(device=self._device)
        self._memory = self._shared_arg or SharedActivationMemory(self._device)
        self._memory.reserve(max(self._memory_size(engine, p) for p in range(engine.num_optimization_profiles)))
        self._states = []
        with torch.cuda.device(self._device):  # runtime-cache deserialisation and JIT need a current CUDA context
            if lib.runtime_config:
                self._cache_key = runtime_cache.RuntimeCacheKey(lib.backend, str(trt.__version__),
                                                                facts.compute_capability, facts.gpu)
            for profile in self._profiles:
                ctx, native = self._create_context(engine, profile, where)
                if ctx is None:
                    raise ArtifactError(
                        f"{where}: {lib.display} could not create an execution context: {self._last_errors()}"
                    )
                if not ctx.set_optimization_profile_async(profile.index, self._stream.cuda_stream):
                    raise ArtifactError(
                        f"{where}: {lib.display} refused optimization profile {profile.index}: {self._last_errors()}"
                    )
                self._states.append(_ContextState(ctx, native_graph=native))
        self._engine = engine
        self._graphs_failed = False
        logger.debug(
            "opened %s: %d profile(s), activation memory %.1f MB (shared %s), library CUDA graphs on profiles %s",
            where,
            len(self._profiles),
            self._memory.nbytes / 1e6,
            self._memory is self._shared_arg,
            [i for i, state in enumerate(self._states) if state.native_graph],
        )

    def _check_validity(self, plan: bytes, where: str) -> None:
        """``Runtime.get_engine_validity`` where the library has it (TensorRT-RTX, as NVIDIA's samples do): the
        library's own verdict on this GPU, driver and release, with its diagnostics named, before deserialising."""
        trt = self._trt
        check = getattr(self._runtime, "get_engine_validity", None)
        validity_enum = getattr(trt, "EngineValidity", None)
        if check is None or validity_enum is None:
            return
        validity, diagnostics = check(plan)
        if validity == validity_enum.VALID:
            return
        flags = getattr(trt, "EngineInvalidityDiagnostics", None)
        reasons = [
            name for name, member in (flags.__members__.items() if flags is not None else ())
            if int(diagnostics) & int(member.value)
        ]
        said = ", ".join(reasons) or "no diagnostics"
        if validity == validity_enum.INVALID:
            raise ArtifactError(
                f"{where}: {self._library.display} says the plan cannot run here ({said}; {self._last_errors()}); "
                "OLD_CUDA_DRIVER: update the NVIDIA driver; VERSION_MISMATCH or MALFORMED_ENGINE: recompile the "
                "artifact; UNSUPPORTED_CC: run on a supported GPU or compile with --backend ort --device cuda"
            )
        logger.warning("%s: %s loads the plan but calls it %s (%s)", where, self._library.display,
                       getattr(validity, "name", validity), said)

    def _create_context(self, engine: Any, profile: RuntimeProfile, where: str) -> tuple[Any, bool]:
        """One execution context without device memory (USER_MANAGED) for ``profile``.

        Returns:
            ``(context, native_graph)``: ``native_graph`` when TensorRT-RTX captures its CUDA graph itself.
        """
        trt = self._trt
        strategy = getattr(trt, "ExecutionContextAllocationStrategy", None)
        if not self._library.runtime_config:
            if strategy is not None:
                return engine.create_execution_context(strategy.USER_MANAGED), False
            return engine.create_execution_context_without_device_memory(), False  # TensorRT < 10
        config = engine.create_runtime_config()
        if config is None:
            raise ArtifactError(f"{where}: {self._library.display} could not create a runtime config")
        config.set_execution_context_allocation_strategy(strategy.USER_MANAGED)
        # LAZY (the library's default, stated): a new shape runs a fallback kernel while its specialised one compiles
        config.dynamic_shapes_kernel_specialization_strategy = trt.DynamicShapesKernelSpecializationStrategy.LAZY
        graph = rtx_cuda_graph_strategy(profile, self._cuda_graphs)
        refused = trt_compat.assign(config, "cuda_graph_strategy", getattr(trt.CudaGraphStrategy, graph), self._logger)
        if refused is not None:
            raise ArtifactError(
                f"{where}: {self._library.display} refused CudaGraphStrategy.{graph} for optimization profile "
                f"{profile.index}{f' ({profile.kind})' if profile.kind else ''} ({refused})"
                + ("; load it without CUDA graphs (cuda_graph=False, --no-cuda-graph)" if graph != "DISABLED" else "")
            )
        if self._runtime_cache is None and not self._cache_failed:
            cache = config.create_runtime_cache()
            if cache is None:  # documented to return a fresh cache; the binding may still hand back None
                self._cache_failed = True
                logger.warning("%s: %s created no runtime cache (%s); kernels are compiled for this GPU at every load",
                               where, self._library.display, self._last_errors())
            else:
                self._runtime_cache = cache
                self._load_runtime_cache(where)
        if self._runtime_cache is not None and not config.set_runtime_cache(self._runtime_cache):
            logger.warning("%s: %s did not take the runtime cache; kernels are not cached", where,
                           self._library.display)
        self._runtime_configs.append(config)
        return engine.create_execution_context(config), graph != "DISABLED"

    def _load_runtime_cache(self, where: str) -> None:
        """Fill the new runtime cache from its file (a missing, bad or refused file: compiled again, a warning)."""
        payload = runtime_cache.load_runtime_cache(self._cache_path, self._cache_key, where)
        if payload is None:
            return
        if self._runtime_cache.deserialize(payload):
            self._cache_loaded = payload
            logger.info("%s: runtime cache loaded from %s (%d bytes)", where, self._cache_path, len(payload))
        else:
            logger.warning(
                "%s: %s refused the runtime cache %s (written by another driver, GPU or release?); kernels "
                "are compiled again and the file is replaced on close", where, self._library.display,
                self._cache_path,
            )

    def _save_runtime_cache(self) -> None:
        """Serialise the runtime cache to its file when it holds anything new (never raises: a warning at most)."""
        if self._runtime_cache is None or self._cache_path is None or self._cache_key is None:
            return
        where = f"engine {self._name!r}"
        try:
            with torch.cuda.device(self._device):
                blob = self._runtime_cache.serialize()
            if blob is None:
                logger.warning("%s: %s serialised no runtime cache; the file is left as it was", where,
                               self._library.display)
                return
            payload = bytes(memoryview(blob))
        except Exception as e:  # noqa: BLE001 - a cache must never fail a close
            logger.warning("%s: could not serialise the runtime cache (%s: %s)", where, type(e).__name__, e)
            return
        if payload and payload != self._cache_loaded:
            runtime_cache.save_runtime_cache(self._cache_path, self._cache_key, payload, where)

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return f"TrtEngine({self._name!r}, {str(self.path)!r}, device={self._device}, {state})"

"""Size buckets: a dynamic-profile ONNX Runtime artifact run at static speed for the sizes a user actually runs.

Why: on an H200 the SD-1.5 UNet of a dynamic artifact (256..1024, batch 1..4) took 14.9 ms per step against
6.8 ms for a static 512x512 one (issue 19): its shape arithmetic runs on the CPU (ORT adds 75 Memcpy nodes) and
no CUDA graph can be captured.

How: for the UNet and the VAE decoder, the first call at a new shape (batch, latent height, latent width) inside
the profile opens a second ONNX Runtime session of the *same* ``model.onnx`` with every symbolic dimension fixed
(``SessionOptions.add_free_dimension_override_by_name("h", 64)``...). With static input shapes ORT's own graph
optimiser folds every Shape -> Gather -> Concat chain into constants (on the tiny UNet: 100 Shape nodes -> 0,
1725 -> 1213 nodes), so no shape op runs on the host and the session can be replayed as a CUDA graph. The call
at that shape, and every later one, runs on the specialised session; shapes outside the buckets, or beyond
:attr:`SizeBuckets.max_shapes`, run on the dynamic session, which is opened on first need.

Why this and not the alternatives: ORT's optimiser knows the shape functions of its contrib ops
(MultiHeadAttention, GroupNorm, BiasSplitGelu...) that onnx's shape inference cannot see through, so it can
specialise the already-optimised graph of the artifact, which ``passes/specialize_shapes`` (run before those
fusions at compile time) could not; nothing is written to the artifact or beside it (no second copy of the weights
on disk, the manifest's hashes stay valid), and an artifact compiled yesterday gets the fast path without a
recompile. What it costs: each specialised session holds its own copy of the weights in device memory (about 2.2 GB per
size for the SD-1.5 UNet on the H200, 2026-12-03, ``benchmarks/shared_initializers.py``: onnxruntime 1.31.1's
Python ``SessionOptions.add_initializer`` takes only a buffer the caller owns, and the Python API has no device
OrtValue over a caller's buffer, so it refuses one on the GPU; the NHWC layout transform would copy the Conv weights
per session anyway) and session creation is paid once per shape; list the sizes (``--size-buckets 512x512,768x768``)
to create those sessions while the artifact loads instead of on the first call.

Background specialisation (the default, :attr:`SizeBuckets.background`): creating a specialised UNet session takes
seconds (ORT's graph optimiser over the whole graph, then the weights' upload), and on the H200 a dynamic artifact
paid 7.7-10.8 s on the first call at each new size (2026-12-02, ``--size-buckets auto``, cuDNN HEURISTIC:
benchmarks/results/README.md, "tenth session"). So the dynamic session is opened while the artifact loads, and a
call at a new shape runs on it at once (about 2x slower per step, with no session to create) while a worker thread
creates that shape's static session; the first call after it is ready adopts it (its first runs warm up and
capture the CUDA graph on the caller's thread, since ORT's CUDA state is per thread). Outputs agree up to float
rounding (the same graph with fixed dimensions, but other kernels: 7.5e-7 apart on an image in [0, 1] on the CPU, fp32,
tiny arch), so ``deterministic=True`` turns background specialisation off: every call at a shape then runs on one
session. The cost: the dynamic session's copy of the
weights stays on the device. Measured on the H200 (same benchmark): 4.19 / 6.68 / 4.75 s over warm at 512x512 /
768x768 / 640x384, from 8.08 / 10.82 / 7.65 s; the static sessions were ready within that first call. With the VAE's
fused Conv bias gone and its new sessions primed (:data:`PRIMED_COMPONENTS`), 3.18 / 1.07 / 1.14 s (2026-12-03).

The runtime never imports ``passes/``: this module uses only onnxruntime through :class:`OrtEngine`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext as _nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ...artifact.manifest import Manifest
from ...config import ShapeProfile
from ...errors import RuntimeInputError, names_arguments
from ..geometry import LatentGeometry
from ..loading import wants_graph
from .engine import EngineBase, EngineSpec, TensorInfo

logger = logging.getLogger(__name__)

#: Components that get specialised sessions. The UNet and the VAE decoder follow the image size; the text encoder's
#: only symbol is the batch (1 or 2 rows: the negative prompt is usually cached), so it is specialised per batch
#: whatever the sizes listed (on the H200 its dynamic session took 2.7 ms against 1.8 ms static).
BUCKET_COMPONENTS: frozenset[str] = frozenset({"text_encoder", "unet", "vae_decoder"})
#: Components whose specialised sessions are primed off the caller's thread (:meth:`OrtEngine.prime`, see
#: :attr:`BucketTimings.prime_s`). The VAE decoder: it runs once per image, on the session asked for at the call's
#: start (:meth:`BucketedEngine.expect`), so its first run is on the call's path; primed, that run took 0.03-0.07 s
#: against 0.39-1.24 s (H200, SD-1.5 fp16, dynamic artifact at 768x768 / 640x384, cuDNN HEURISTIC, 2026-12-03,
#: ``h200-2026-12-03-s14-bench-dyn-sizes*.json``). Not the UNet: its first static run stayed 0.85-0.89 s primed
#: (0.90-0.93 s not), and priming it beside the first call's dynamic runs took that call from 3.2 to 7.0 s over warm.
PRIMED_COMPONENTS: frozenset[str] = frozenset({"vae_decoder"})
#: Specialised sessions per component when no size list is given (``"auto"``): each holds a copy of the weights.
AUTO_MAX_SHAPES = 4
_SIZE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True)
class SizeBuckets:
    """Which shapes get a static (specialised) session.

    Attributes:
        sizes: image sizes ``(height, width)`` in pixels; ``None`` = any size inside the profile ("auto").
        max_shapes: specialised sessions per component at most (a shape is size x batch); later new shapes run on
            the dynamic session. ``None`` = :data:`AUTO_MAX_SHAPES` for "auto", two per listed size otherwise.
        preload: open the listed sizes' sessions (at the profile's opt batch) while the artifact loads, so the
            first call at those sizes pays no session creation; ignored for "auto".
        background: specialise in the background (see :class:`BucketedEngine`): the dynamic session opens while
            the artifact loads, a call at a new shape runs on it at once while that shape's static session is
            created on a worker thread, and later calls use the static session once it is ready. ``False``: the
            first call at a new shape waits for its static session (one fewer copy of the weights on the device);
            from_artifacts sets it under a VRAM budget and in deterministic mode.
    """

    sizes: tuple[tuple[int, int], ...] | None = None
    max_shapes: int | None = None
    preload: bool = True
    background: bool = True

    @property
    def limit(self) -> int:
        if self.max_shapes is not None:
            return self.max_shapes
        return AUTO_MAX_SHAPES if self.sizes is None else 2 * len(self.sizes)

    def describe(self) -> str:
        return "auto" if self.sizes is None else ",".join(f"{h}x{w}" for h, w in self.sizes)

    def check(self, profile: ShapeProfile, alignment: int = 8) -> None:
        """Every listed size must be a multiple of ``alignment`` inside the profile.

        Raises:
            RuntimeInputError: naming the size, the profile's range and the fix.
        """
        if self.max_shapes is not None and self.max_shapes < 1:
            raise RuntimeInputError(f"size buckets: max_shapes={self.max_shapes} must be >= 1")
        for h, w in self.sizes or ():
            for name, value, rng in (("height", h, profile.height), ("width", w, profile.width)):
                # one cause at a time: "256 is not a multiple of 8 inside 32..128" read as if 256 were no multiple
                why = (f"is outside the artifact's profile {rng.min}..{rng.max}" if not rng.min <= value <= rng.max
                       else f"is not a multiple of {alignment}" if value % alignment else None)
                if why is not None:
                    raise RuntimeInputError(
                        f"size bucket {h}x{w}: {name} {value} {why}; list sizes HxW that are multiples of {alignment} "
                        f"inside the profile ({rng.min}..{rng.max}), e.g. {profile.height.opt}x{profile.width.opt}"
                    )


def parse_sizes(text: str, option: str = "--sizes") -> tuple[tuple[int, int], ...]:
    """``"512x512,768x768"`` -> ``((512, 512), (768, 768))`` (duplicates dropped, order kept).

    Raises:
        RuntimeInputError: an empty ``text``; an item that is not HEIGHTxWIDTH with positive sides, naming it,
            ``option`` and the form.
    """
    if not str(text).strip():  # else "'' in ''": the one item named is the whole, empty, value
        raise RuntimeInputError(f"{option} {text!r} is empty; give sizes HEIGHTxWIDTH, e.g. {option} 512x512,768x768")
    sizes: list[tuple[int, int]] = []
    for part in str(text).split(","):
        m = _SIZE.match(part)
        if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise RuntimeInputError(
                f"{option}: {part.strip()!r} in {text!r} is not HEIGHTxWIDTH with positive sides; use e.g. "
                f"{option} 512x512,768x768,640x384"
            )
        if (pair := (int(m.group(1)), int(m.group(2)))) not in sizes:
            sizes.append(pair)
    return tuple(sizes)


@names_arguments("size_buckets")
def parse_size_buckets(value: str | Iterable[tuple[int, int]] | SizeBuckets | None) -> SizeBuckets | None:
    """``"auto"``, ``"512x512,768x768"``, a list of ``(height, width)`` or a :class:`SizeBuckets`; ``None``, "off"
    or "none" = no buckets.

    Raises:
        RuntimeInputError: a malformed or non-positive size, naming it and the expected form; an empty string (a
            value typed empty by mistake, e.g. an unset shell variable, is not taken for "off").
    """
    if value is None or isinstance(value, SizeBuckets):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if not text:
            raise RuntimeInputError(f"size_buckets={value!r} is empty; give 'auto', sizes HxW[,HxW...] such as "
                                    "512x512,768x768, or 'off' for no buckets")
        if text in ("off", "none"):
            return None
        if text == "auto":
            return SizeBuckets()
        items = parse_sizes(text, "--size-buckets")
        pairs: Iterable[Any] = items
    elif isinstance(value, Iterable):
        pairs = value
    else:
        raise RuntimeInputError(f"size_buckets={value!r} is not 'auto', 'HxW,...' or a list of (height, width) "
                                "pairs; use e.g. 'auto' or [(512, 512), (768, 768)]")
    sizes: list[tuple[int, int]] = []
    for pair in pairs:
        try:
            h, w = (int(v) for v in pair)
        except (TypeError, ValueError):
            raise RuntimeInputError(f"size bucket {pair!r} is not a (height, width) pair of integers") from None
        if h < 1 or w < 1:
            raise RuntimeInputError(f"size bucket {h}x{w} must have positive sides, e.g. 512x512")
        if (h, w) not in sizes:
            sizes.append((h, w))
    if not sizes:
        raise RuntimeInputError("size buckets: the list is empty; give sizes like 512x512,768x768 or 'auto'")
    return SizeBuckets(sizes=tuple(sizes))


def static_spec(spec: EngineSpec, symbols: Mapping[str, int]) -> EngineSpec:
    """``spec`` with every tensor's profile pinned to the shape ``symbols`` give (min == max)."""
    out_shapes = spec.output_shapes(symbols)

    def pin(info: TensorInfo, shape: tuple[int, ...]) -> TensorInfo:
        return dataclasses.replace(info, min=shape, max=shape)

    inputs = tuple(
        pin(t, tuple(d if isinstance(d, int) else int(symbols[d]) for d in t.shape)) for t in spec.inputs
    )
    outputs = tuple(pin(t, out_shapes[t.name]) for t in spec.outputs)
    return dataclasses.replace(spec, inputs=inputs, outputs=outputs)


def _key(symbols: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((k, int(v)) for k, v in symbols.items()))


def _describe(key: tuple[tuple[str, int], ...]) -> str:
    """``B2=2, h=8, w=8``: a shape key for log lines."""
    return ", ".join(f"{k}={v}" for k, v in key)


@dataclass
class BucketTimings:
    """Where a bucketed engine's seconds went (host wall clock, ``time.perf_counter``), for ``bench`` to break a
    first call at a new shape into its parts (issue 28). Runs on CUDA may return before the device finishes; a run's
    seconds then land in whichever later part synchronises, so the parts are host-side figures, not kernel time.

    Attributes:
        session_s: seconds to create and open each session, ``"dynamic"`` or the shape (``"B2=2, h=64, w=64"``);
            on the worker thread in background mode, so they overlap the caller's runs.
        dynamic_wait_s: seconds the caller waited for the dynamic session to finish opening.
        dynamic_runs / dynamic_run_s: runs served by the dynamic session and their seconds.
        first_static_run_s: each specialised session's first run (its warm-up runs and CUDA-graph capture), by shape.
        prime_s: each specialised session's priming run (:meth:`OrtEngine.prime`: cuDNN's algorithm choice and the
            arena's allocations, outside CUDA-graph mode) by shape; made on the worker thread in background mode and
            for the preloaded sizes while loading, so the first run on the caller's thread is left the capture.
    """

    session_s: dict[str, float] = dataclasses.field(default_factory=dict)
    dynamic_wait_s: float = 0.0
    dynamic_runs: int = 0
    dynamic_run_s: float = 0.0
    first_static_run_s: dict[str, float] = dataclasses.field(default_factory=dict)
    prime_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def copy(self) -> BucketTimings:
        """A copy that later runs leave as it is (its dicts its own): the ``before`` of :meth:`since`."""
        return dataclasses.replace(self, session_s=dict(self.session_s),
                                   first_static_run_s=dict(self.first_static_run_s), prime_s=dict(self.prime_s))

    def since(self, before: BucketTimings) -> BucketTimings:
        """What these timings gained since ``before`` (a :meth:`copy` of them taken earlier): the sessions opened and
        the static first runs whose shapes ``before`` lacks, and the dynamic waits, runs and seconds added."""
        return BucketTimings(
            session_s={k: v for k, v in self.session_s.items() if k not in before.session_s},
            dynamic_wait_s=self.dynamic_wait_s - before.dynamic_wait_s,
            dynamic_runs=self.dynamic_runs - before.dynamic_runs,
            dynamic_run_s=self.dynamic_run_s - before.dynamic_run_s,
            first_static_run_s={k: v for k, v in self.first_static_run_s.items() if k not in before.first_static_run_s},
            prime_s={k: v for k, v in self.prime_s.items() if k not in before.prime_s},
        )

    def snapshot(self) -> dict[str, Any]:
        """A copy as plain JSON values (seconds rounded to the microsecond)."""
        return {"session_s": {k: round(v, 6) for k, v in self.session_s.items()},
                "dynamic_wait_s": round(self.dynamic_wait_s, 6), "dynamic_runs": self.dynamic_runs,
                "dynamic_run_s": round(self.dynamic_run_s, 6),
                "first_static_run_s": {k: round(v, 6) for k, v in self.first_static_run_s.items()},
                "prime_s": {k: round(v, 6) for k, v in self.prime_s.items()}}


class BucketedEngine(EngineBase):
    """One component served by a dynamic engine plus static engines specialised per shape (see the module docstring).

    Args:
        spec: the component's (dynamic) spec.
        make_engine: ``make_engine(spec, free_dimensions)`` returns an unopened engine: the dynamic one for
            ``free_dimensions=None``, else one whose symbolic dims are fixed to those values (its spec static).
        device: where the engines run.
        buckets: which shapes get specialised, and whether in the background (:attr:`SizeBuckets.background`).
        latent_sizes: the listed sizes as latent ``(h, w)`` (pixels / the VAE scale factor); ``None`` = any.
        preload: symbol values to specialise while entering (e.g. ``{"B2": 2, "h": 64, "w": 64}``).
        prime: prime each specialised session made while entering or on the worker thread (see
            :data:`PRIMED_COMPONENTS`).

    **Outputs alias the running engine's buffers (as OrtEngine's): overwritten by that engine's next run.**
    """

    def __init__(
        self,
        spec: EngineSpec,
        make_engine: Callable[[EngineSpec, Mapping[str, int] | None], Any],
        *,
        device: torch.device,
        buckets: SizeBuckets,
        latent_sizes: frozenset[tuple[int, int]] | None,
        preload: Iterable[Mapping[str, int]] = (),
        prime: bool = False,
    ) -> None:
        self._name = spec.name
        self._spec = spec
        self._device = device
        self._depth = 0
        self._make = make_engine
        self._buckets = buckets
        self._latent_sizes = latent_sizes
        self._preload = [dict(p) for p in preload]
        self._prime = bool(prime)
        self._dynamic: Any = None
        self._static: dict[tuple[tuple[str, int], ...], Any] = {}
        #: background mode: the worker thread, the sessions it is opening (None: the dynamic one), the shapes it failed
        self._worker: ThreadPoolExecutor | None = None
        self._pending: dict[tuple[tuple[str, int], ...] | None, Future[Any]] = {}
        self._failed: set[tuple[tuple[str, int], ...]] = set()
        #: "static" or "dynamic": which engine served the last run (for tests and bench notes)
        self.last_path: str | None = None
        #: where the seconds went (see :class:`BucketTimings`); ``bench`` reports it per first call
        self.timings = BucketTimings()
        self._unrun: set[tuple[tuple[str, int], ...]] = set()  # specialised sessions not run yet

    # -- what is open ------------------------------------------------------------------------------------------

    @property
    def specialised_shapes(self) -> list[dict[str, int]]:
        """The symbol values of every open specialised engine, in creation order."""
        return [dict(k) for k in self._static]

    @property
    def buckets(self) -> SizeBuckets:
        """The shapes this engine specialises and whether in the background (as from_artifacts settled them)."""
        return self._buckets

    @property
    def dynamic_open(self) -> bool:
        return self._dynamic is not None

    @property
    def pending_shapes(self) -> list[dict[str, int]]:
        """The symbol values of the specialised engines being created in the background."""
        return [dict(k) for k in self._pending if k is not None]

    @property
    def cuda_graph(self) -> bool:
        """Whether any specialised engine replays a CUDA graph."""
        return any(getattr(e, "cuda_graph", False) for e in self._static.values())

    @property
    def providers(self) -> list[str]:
        engine = next(iter(self._static.values()), None) or self._dynamic
        return list(getattr(engine, "providers", []))

    def wants(self, symbols: Mapping[str, int]) -> bool:
        """Whether a call with these symbol values is (or would be) served by a specialised engine."""
        return self._wants(_key(symbols))

    def _wants(self, key: tuple[tuple[str, int], ...]) -> bool:
        """:meth:`wants` of the shape key ``key`` (:func:`_key`)."""
        if key in self._static or key in self._pending:
            return True
        if key in self._failed or len(self._static) + len(self.pending_shapes) >= self._buckets.limit:
            return False
        symbols = dict(key)
        if self._latent_sizes is None or "h" not in symbols:
            return True  # "auto", or a component whose shape does not follow the image size (the text encoder)
        return (symbols.get("h"), symbols.get("w")) in self._latent_sizes

    def expect(self, shapes: Mapping[str, tuple[int, ...]]) -> bool:
        """A run with inputs of these ``shapes`` (input name -> shape; every input with a symbolic dim) is coming: in
        background mode, start making its specialised session now, so that the run finds it ready.

        Why: the VAE decoder runs once per image, after the whole UNet loop; on the H200 (2026-12-02, SD-1.5 fp16,
        benchmarks/results/README.md "twelfth session") its first run at a new size on the dynamic session took
        2.4 / 5.1 / 5.1 s at 512x512 / 768x768 / 640x384, while its specialised session took 0.2 s to make and its
        first run 1.4..1.8 s; started at the call's start, the session is ready long before the decode.

        Returns:
            Whether a session is (now) being made or is open for these shapes; False outside background mode, when
            closed, for shapes no bucket takes, or when ``shapes`` leaves a symbol unknown.
        """
        if not self._buckets.background or self._depth == 0:
            return False
        symbols: dict[str, int] = {}
        for info in self._spec.inputs:
            shape = shapes.get(info.name)
            if shape is not None and len(shape) == len(info.shape):
                symbols.update({d: int(v) for d, v in zip(info.shape, shape, strict=True) if isinstance(d, str)})
        bound = {d for info in self._spec.inputs for d in info.shape if isinstance(d, str)}
        key = _key(symbols)
        if set(symbols) != bound or not self._wants(key):
            return False
        self._adopt()
        self._static_engine(key)
        return True

    # -- lifecycle -------------------------------------------------------------------------------------------

    def _open(self) -> None:
        for key in map(_key, self._preload):
            if self._wants(key):
                self._specialise(key, prime=self._prime)  # while loading: off the first call
        if self._buckets.background and self._dynamic is None:
            self._submit(None, lambda: self._timed_open(None))

    def close(self) -> None:
        """Wait for the background work, then close every engine (idempotent)."""
        pending, self._pending = list(self._pending.values()), {}
        late = []
        for future in pending:
            if not future.cancel() and future.exception() is None:  # a failure opened nothing to close
                late.append(future.result())
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        engines = [*self._static.values(), *([self._dynamic] if self._dynamic is not None else []), *late]
        self._static = {}
        self._dynamic = None
        for engine in engines:
            engine.__exit__(None, None, None)

    def settle(self) -> float:
        """Wait until every background session is ready and adopt them; returns the seconds waited."""
        t0 = time.perf_counter()
        for future in list(self._pending.values()):
            future.exception()  # waits; a failure is logged (once) by _adopt
        self._adopt(wait_all=True)
        return time.perf_counter() - t0

    # -- specialised and dynamic engines ------------------------------------------------------------------------

    def _opened(self, engine: Any) -> Any:
        with torch.cuda.device(self._device) if self._device.type == "cuda" else _nullcontext():
            engine.__enter__()
        return engine

    def _timed_open(self, key: tuple[tuple[str, int], ...] | None, prime: bool = False) -> Any:
        """Make and open the dynamic engine (``key`` None) or the one specialised to ``key``, timed; with ``prime``
        a specialised one is primed too (see :attr:`BucketTimings.prime_s`)."""
        t0 = time.perf_counter()
        if key is None:
            engine = self._opened(self._make(self._spec, None))
        else:
            engine = self._opened(self._make(static_spec(self._spec, dict(key)), dict(key)))
        self.timings.session_s["dynamic" if key is None else _describe(key)] = time.perf_counter() - t0
        if key is not None and prime and hasattr(engine, "prime"):
            t0 = time.perf_counter()
            with torch.cuda.device(self._device) if self._device.type == "cuda" else _nullcontext():
                if engine.prime():
                    self.timings.prime_s[_describe(key)] = time.perf_counter() - t0
        return engine

    def _submit(self, key: tuple[tuple[str, int], ...] | None, job: Callable[[], Any]) -> None:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"diffusion-trt-{self._name}-buckets")
        self._pending[key] = self._worker.submit(job)

    def _adopt(self, wait_all: bool = False) -> None:
        """Move finished background sessions in; a static one only once the worker is idle (its first runs, on
        this thread, capture a CUDA graph under the capture lock, which a session being created holds)."""
        if not self._pending or (not wait_all and not all(f.done() for f in self._pending.values())):
            return
        for key, future in list(self._pending.items()):
            del self._pending[key]
            try:
                engine = future.result()
            except Exception as e:  # a failed session: the dynamic engine keeps serving that shape
                if key is None:
                    raise
                self._failed.add(key)
                logger.warning("%s: the specialised session for %s failed (%s); the dynamic session serves it",
                               self._name, _describe(key), e)
                continue
            if key is None:
                self._dynamic = engine
            else:
                self._static[key] = engine
                self._unrun.add(key)
                logger.info("%s: specialised session for %s ready (%d of %d)", self._name,
                            _describe(key), len(self._static), self._buckets.limit)

    def _specialise(self, key: tuple[tuple[str, int], ...], prime: bool = False) -> Any:
        """Make and open the engine specialised to the shape key ``key`` now, on this thread."""
        engine = self._timed_open(key, prime)
        self._static[key] = engine
        self._unrun.add(key)
        logger.info("%s: specialised session for %s (%d of %d)", self._name,
                    _describe(key), len(self._static), self._buckets.limit)
        return engine

    def _dynamic_engine(self) -> Any:
        if self._dynamic is None and None in self._pending:
            t0 = time.perf_counter()
            self._dynamic = self._pending.pop(None).result()  # opened while loading; wait for it
            self.timings.dynamic_wait_s += time.perf_counter() - t0
        if self._dynamic is None:
            self._dynamic = self._timed_open(None)
        return self._dynamic

    def _static_engine(self, key: tuple[tuple[str, int], ...]) -> Any:
        """The specialised engine for the shape key ``key``: open, made now, or (background mode) ``None`` while it
        is made."""
        if key in self._static:
            return self._static[key]
        if not self._buckets.background:
            return self._specialise(key)
        if key not in self._pending:
            self._submit(key, lambda: self._timed_open(key, prime=self._prime))
            logger.info("%s: new shape %s runs on the dynamic session while its static one is made",
                        self._name, _describe(key))
        return None

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run on the specialised engine for this shape or the dynamic one (see the class and module docstrings).

        Raises:
            RuntimeInputError: ``feeds`` do not match the manifest.
            RuntimeError: the engine is not open.
        """
        if self._depth == 0:
            raise RuntimeError(f"engine {self._name!r} is not open; use `with engine:` or call it inside the pipeline")
        key = _key(self.validate(feeds))  # once per run: every lookup below takes it
        self._adopt()
        engine = self._static_engine(key) if self._wants(key) else None
        if engine is None:
            self.last_path = "dynamic"
            dynamic = self._dynamic_engine()
            t0 = time.perf_counter()
            out = dynamic.run(feeds)
            self.timings.dynamic_runs += 1
            self.timings.dynamic_run_s += time.perf_counter() - t0
            return out
        self.last_path = "static"
        if key not in self._unrun:
            return engine.run(feeds)
        t0 = time.perf_counter()
        out = engine.run(feeds)
        self._unrun.discard(key)
        self.timings.first_static_run_s[_describe(key)] = time.perf_counter() - t0
        return out

    def __repr__(self) -> str:
        return (f"BucketedEngine({self._name!r}, buckets={self._buckets.describe()}, "
                f"specialised={len(self._static)}, pending={len(self.pending_shapes)}, "
                f"dynamic_open={self.dynamic_open})")


def preload_symbols(component: str, spec: EngineSpec, buckets: SizeBuckets, profile: ShapeProfile,
                    vae_scale_factor: int) -> list[dict[str, int]]:
    """The shapes to specialise while loading: each listed size at the profile's opt batch (the UNet at the CFG
    batch, ``2 x opt``, when its batch symbol is the CFG one), and the UNet's context ``S`` at 77 (one chunk: longer
    prompts get their own session on first use). Empty for "auto" or ``preload=False``."""
    if buckets.sizes is None or not buckets.preload:
        return []
    batch_symbols = {d for t in spec.inputs for d in t.shape[:1] if isinstance(d, str)}
    out: list[dict[str, int]] = []
    for h, w in buckets.sizes:
        symbols: dict[str, int] = {"h": h // vae_scale_factor, "w": w // vae_scale_factor}
        for sym in batch_symbols:
            symbols[sym] = 2 * profile.batch.opt if sym == "B2" else profile.batch.opt
        for t in spec.inputs:  # the UNet's context length "S" (long prompts): one-chunk prompts, its min (77)
            symbols.update({d: t.min[axis] for axis, d in enumerate(t.shape) if d == "S"})
        bound = {d for t in spec.inputs for d in t.shape if isinstance(d, str)}
        if set(symbols) >= bound:
            if (pinned := {k: v for k, v in symbols.items() if k in bound}) not in out:
                out.append(pinned)
        else:
            logger.debug("%s: no preload for %dx%d (symbols %s not all known)", component, h, w, sorted(bound))
    return out


def bucket_engines(
    engines: Mapping[str, Any],
    buckets: SizeBuckets | None,
    manifest: Manifest,
    device: str,
    cuda_graph: bool | None,
) -> dict[str, Any]:
    """Wrap the :data:`BUCKET_COMPONENTS` of a dynamic-profile ORT artifact in :class:`BucketedEngine`.

    Each engine must offer ``variant(spec, free_dimensions=..., cuda_graph=...)`` (:class:`OrtEngine` does). The
    specialised engines replay CUDA graphs on CUDA unless ``cuda_graph`` is ``False`` (with ``None``, all but
    the once-per-image components: :func:`~diffusion_trt.runtime.loading.wants_graph`).

    Raises:
        RuntimeInputError: a listed size outside the profile or not a multiple of the VAE scale factor.
    """
    out = dict(engines)
    if buckets is None:
        return out
    profile = ShapeProfile.from_json(manifest.profile_json)
    scale = LatentGeometry.from_manifest(manifest).scale_factor
    buckets.check(profile, scale)
    if profile.is_static():
        logger.warning("size buckets %s: the artifact's profile is static already; nothing to specialise",
                       buckets.describe())
        return out
    latent = None if buckets.sizes is None else frozenset((h // scale, w // scale) for h, w in buckets.sizes)
    graphs = device == "cuda" if cuda_graph is None else bool(cuda_graph)
    for name, engine in engines.items():
        if name not in BUCKET_COMPONENTS or not hasattr(engine, "variant"):
            continue

        def make(spec: EngineSpec, free: Mapping[str, int] | None, base: Any = engine,
                 graph: bool = graphs and wants_graph(name, cuda_graph)) -> Any:
            if free is None:
                return base  # the dynamic engine as built (unopened until a call needs it)
            return base.variant(spec, free_dimensions=free, cuda_graph=graph)

        if not buckets.background and (close := getattr(engine, "close", None)) is not None:
            close()  # the dynamic engine opens only if a call needs it: a read started ahead of it goes meanwhile
        out[name] = BucketedEngine(
            engine.spec, make, device=engine.device, buckets=buckets, latent_sizes=latent,
            preload=preload_symbols(name, engine.spec, buckets, profile, scale), prime=name in PRIMED_COMPONENTS,
        )
    return out

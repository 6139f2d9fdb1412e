"""Open a pipeline's engines side by side, and run each static CUDA engine once while the others still load.

Why (issue 28): opened one after another, the SD-1.5 engines cost the sum of their parts before the first image
(on the H200: UNet read + hash 2.47 s, session 3.0 s, first run 3.9 s; text encoder 0.75 + 1.09 s; VAE decoder
0.10 + 0.64 s). The parts overlap well: hashing (``hashlib``), reading, and ONNX Runtime's session creation release
the GIL, and a first run (cuDNN's algorithm choice, cuBLAS handles, lazily loaded kernels) of the small engines fits
in the time the UNet still loads. So :class:`OpenTogether` enters every engine on a thread of its own and, on CUDA,
runs each engine whose profile is static once on zeros (:func:`warm_up`); the caller keeps working meanwhile
(tokenizers, the scheduler) and :meth:`OpenTogether.wait` joins them.

With ``enable_cuda_graph`` the graphs are captured in ``from_artifacts`` too, on the caller's thread (ONNX Runtime's
CUDA provider keeps a graph per thread: only the thread that will call can capture the graph it replays), as each
engine comes warm from its loader thread, while diffusers is imported on a thread of its own
(:meth:`OpenTogether.wait` with ``capture``); the first image then replays from its first step. The UNet is not
primed on its loader thread then: the caller's capture makes its first run (:data:`CALLER_FIRST_RUN`). ONNX Runtime
captures in ``cudaStreamCaptureModeGlobal``: a ``cudaMalloc`` or copy from any other thread during the capture breaks it
("operation not permitted when stream is capturing", seen on the H200 when the warm-ups ran unguarded). So every CUDA
session creation and uncaptured warm-up holds :data:`~.engines.capture_lock.CAPTURE_LOCK` shared, side by side, and
only the graph-mode runs before the replays (the capture and the regular run before it) hold it exclusive.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from .engines.engine import Engine

if TYPE_CHECKING:
    from ..artifact.reader import OnnxBytes
    from .engines.ort_engine import PrivateRead

logger = logging.getLogger(__name__)


#: In CUDA-graph mode, the components whose first run the caller's capture at load makes (:meth:`OpenTogether.wait`
#: with ``capture``), instead of a prime on their loader thread. A prime settles only what a session shares across
#: threads; the thread that replays still pays a first run of its own in graph mode (ONNX Runtime's per-thread CUDA
#: context: its cuDNN / cuBLAS handles and what hangs on them). For the UNet, the last engine to open and the critical
#: path of the load, that made two first runs in a row: a prime (0.77-1.0 s alone, ``benchmarks/cold_start.py``
#: phases) and 0.5 s of the caller's graph-mode runs after it (H100, ``h100-2026-12-05-s17-cold-start.json``,
#: profile of the first call), against a capture run of 8 ms. The smaller engines open earlier and keep their prime
#: on their own threads, so the caller's thread is free when the UNet arrives. Measured once so far (H100,
#: ``h100-2026-12-07-s20-cold-start.json``, EXHAUSTIVE): the first call 0.37 s after such a load, 1.06-1.12 s after
#: the load of 581819c (no capture at load).
CALLER_FIRST_RUN = frozenset({"unet", "unet_controlnet"})


#: ONNX Runtime components that run without a CUDA graph by default (``cuda_graph=None``; ``True`` graphs them too;
#: :func:`wants_graph`): those that run once per image, where a replay saves about a millisecond, while their captures
#: at load (on the caller's thread, holding the capture lock alone) stood on the path to the first image. H100, SD-1.5
#: static 512 b1, ``from_artifacts`` + a first 30-step image, 2026-12-07 (``benchmarks/gpu_cold_start.sh diag2``,
#: ``h100-2026-12-07-s22-cold-start-variants.json``): 4.16 / 4.44 / 4.50 s with every engine graphed, 3.77 / 3.90 s
#: with the text encoder and VAE decoder eager (the second call 0.233-0.255 s either way). Those eager rows were
#: ``--set`` variants, which then imported ``runtime.pipeline`` before the timed load while the graphed rows imported
#: it inside (0.18 s on the 2-core CPU machine; fixed in ``cold_start.py`` since): part of that gap is the benchmark's.
EAGER_COMPONENTS = frozenset({"text_encoder", "text_encoder_2", "vae_decoder", "vae_encoder"})


def wants_graph(name: str, cuda_graph: bool | None) -> bool:
    """Whether component ``name`` replays a CUDA graph where graphs can run, given the load's ``cuda_graph`` option:
    ``True`` every component, ``False`` none, ``None`` all but :data:`EAGER_COMPONENTS`."""
    if cuda_graph is None:
        return name not in EAGER_COMPONENTS
    return bool(cuda_graph)


#: Modules every loader thread of an ONNX Runtime load imports (``onnx`` to list a model's external-data files,
#: ``onnxruntime`` for the session), imported by :func:`start_imports` on a thread of their own from the load's start,
#: while the caller still checks the artifact and initialises CUDA. Imported by the loaders themselves, the second and
#: third loader each waited 0.27 s on the first one's import of ``onnx`` before reading a byte (H100, 2026-12-07,
#: ``benchmarks/cold_start.py --sample``: ``importlib._bootstrap acquire <- reader.onnx``). Imported in sorted order.
PREIMPORT = frozenset({"onnx", "onnxruntime"})

def start_imports(names: Collection[str]) -> threading.Thread | None:
    """Import ``names`` (e.g. :data:`PREIMPORT`; those not yet imported, in sorted order) on a thread of its own,
    started now; ``None`` when there is nothing to import. An import that fails is left to the code that needs the
    module (it raises its own, clearer error there). Not a daemon thread: an exit right after (a load refused early)
    waits for the import to end (under a second) rather than cutting it short in interpreter shutdown."""
    missing = sorted(n for n in names if n not in sys.modules)
    if not missing:
        return None

    def run() -> None:
        for name in missing:
            try:
                importlib.import_module(name)
            except Exception as e:  # noqa: BLE001 - e.g. no onnxruntime: the engine that needs it says so
                logger.debug("pre-import of %s failed: %s", name, e)

    thread = threading.Thread(target=run, name="diffusion-trt-preimport")
    thread.start()
    return thread


#: Whether ``from_artifacts`` on CUDA runs the torch work of a call around its engines once on its own thread while
#: the engines open (:func:`~.denoise.warm_loop_kernels`): the first call then loads none of those kernels. H100,
#: SD-1.5 static 512 b1, 30 steps, 2026-12-07 (``gpu_cold_start.sh anatomy``,
#: ``h100-2026-12-07-s23-cold-start-variants.json``): the first call 0.24 s (0.01 s over a warm one) against 0.36-0.37 s
#: without it; the load 0.03-0.07 s longer (the warm-up itself, 0.5-0.7 s of first kernel launches, runs while the UNet
#: still opens); ``from_artifacts`` + first image 2.25-2.32 s against 2.31-2.36 s. A switch for
#: ``benchmarks/cold_start.py`` (``--set``).
WARM_LOOP = True

#: Whether ``from_artifacts`` starts reading (and hashing) the engines it opens together from its start, on threads of
#: their own (:func:`start_reads`), while it checks the artifact, starts CUDA and builds the engines; each engine's open
#: then waits for its bytes instead of reading them (``OrtEngine(read_ahead=...)``). Same H100 rows as
#: :data:`WARM_LOOP`: the UNet's session ready 1.02-1.07 s after the engines' start against 1.11 s without (its read,
#: started 0.2-0.3 s earlier, takes longer beside CUDA's start and the imports: 0.80-0.94 s against 0.57-0.58 s);
#: first image 2.25-2.32 s against 2.27 / 2.46 s; on the 2-core CPU machine no change (tiny artifact, 0.79-0.84 s
#: against 0.77-0.87 s). A switch for ``benchmarks/cold_start.py`` (``--set``).
READ_AHEAD = True


def start_reads(sources: Mapping[str, Callable[..., OnnxBytes]]) -> dict[str, Future[PrivateRead]]:
    """Start reading each named model through its source (``ArtifactReader.onnx``'s partial) into a private folder
    (:func:`~.engines.ort_engine.read_private`), one thread each, now; returns name -> its read. Hand each to its
    engine (``read_ahead=``); a read no engine takes goes to :func:`~.engines.ort_engine.discard_read`."""
    from .engines.ort_engine import read_private

    if not sources:
        return {}
    pool = ThreadPoolExecutor(len(sources), thread_name_prefix="diffusion-trt-read")
    reads = {name: pool.submit(read_private, source, name) for name, source in sources.items()}
    pool.shutdown(wait=False)  # its threads end with their reads
    return reads


def warm_up(engine: Engine) -> bool:
    """Run an open CUDA ``engine`` once on zeros at its (static) input shapes and wait for the GPU.

    Returns:
        Whether it ran: only CUDA engines with a static profile are warmed (a dynamic one would be warmed at a shape
        the calls may never use).
    """
    if engine.device.type != "cuda" or not engine.spec.is_static:
        return False
    prime = getattr(engine, "prime", None)
    if prime is not None:  # ONNX Runtime: outside graph mode, so the caller's thread captures under the lock
        return bool(prime())
    from .engines.capture_lock import CAPTURE_LOCK

    with CAPTURE_LOCK.exclusive():  # a run that may capture (TensorRT): the feeds' allocation too
        feeds = engine.spec.zero_feeds(engine.device)
        engine.run(feeds)
        torch.cuda.current_stream(engine.device).synchronize()
    return True


class OpenTogether:
    """Enter ``engines`` at once, one thread each (and :func:`warm_up` each when ``warm``); a context manager.

    ``with OpenTogether(engines, warm=True) as opening: ...; opening.wait()``: the engines open while the block
    runs; :meth:`wait` returns when all are open (raising the first failure, in ``engines`` order). The opener holds
    one enter of each engine until the block ends, so a caller that must keep them open enters them itself inside the
    block (``EngineBase`` counts enters); leaving the block (also on an error) waits for the threads and exits what
    they opened.

    Args:
        engines: name -> unopened engine.
        warm: warm each static CUDA engine after it opens.
        caller_first_run: names of engines whose first run the caller makes in :meth:`wait` with ``capture``
            (e.g. :data:`CALLER_FIRST_RUN`): not warmed on their loader thread when they are in CUDA-graph mode; only
            for a caller that waits with ``capture``.
        caller_warm: names of engines outside CUDA-graph mode (e.g. :data:`EAGER_COMPONENTS`) that, once warmed on
            their loader thread, run once more on the caller's thread in :meth:`wait` with ``capture`` (their
            ``prime``, holding the capture lock shared only), so that the first call does not pay that thread's own
            first run of them (ONNX Runtime's per-thread CUDA handles).
    """

    def __init__(self, engines: Mapping[str, Engine], *, warm: bool, caller_first_run: Collection[str] = (),
                 caller_warm: Collection[str] = ()) -> None:
        self._engines = dict(engines)
        self._warm = warm
        self._caller_first_run = frozenset(caller_first_run)
        self._caller_warm = frozenset(caller_warm)
        self._pool = ThreadPoolExecutor(max(1, len(self._engines)), thread_name_prefix="diffusion-trt-open")
        self._futures: dict[str, Future[bool]] = {}
        self._lock = threading.Lock()
        #: name -> {"opened_s", "warmed_s"}: seconds from the block's start to each engine's open and warm-up end;
        #: "caller" -> {"wait_from_s", "wait_to_s"}: when :meth:`wait` was called and returned; what the caller adds
        #: (:meth:`add_marks`). Logged at DEBUG when the block ends; benchmarks/cold_start.py reads them there.
        self.timeline: dict[str, dict[str, float]] = {}
        self._t0 = 0.0

    def __enter__(self) -> OpenTogether:
        self._t0 = time.perf_counter()
        for name, engine in self._engines.items():
            self._futures[name] = self._pool.submit(self._open, name, engine)
        return self

    def _open(self, name: str, engine: Engine) -> bool:
        engine.__enter__()
        marks = {"opened_s": time.perf_counter() - self._t0}
        try:
            by_caller = self._first_run_by_caller(name)
            if self._warm and not by_caller and warm_up(engine):
                marks["warmed_s"] = time.perf_counter() - self._t0
            # ORT: its private folder's removal, during the warm-up; during the caller's first run (:meth:`wait`)
            # when the caller makes it, so that it is ready for the caller at once
            if not by_caller and (removal := getattr(engine, "wait_removal", None)) is not None:
                removal()
        except BaseException:
            engine.__exit__(None, None, None)
            raise
        marks.update(getattr(engine, "open_parts", None) or {})  # ORT: how long its read, session and clean-up took
        with self._lock:
            self.timeline[name] = marks
        return True

    def _first_run_by_caller(self, name: str) -> bool:
        """Whether the caller's capture makes ``name``'s first run (see ``caller_first_run``): an open engine in
        CUDA-graph mode."""
        return name in self._caller_first_run and bool(getattr(self._engines[name], "cuda_graph", False))

    def wait(self, *, capture: bool = False) -> None:
        """Block until every engine is open (and warmed).

        Args:
            capture: as each engine is warmed, capture its CUDA graph on the calling thread (the engine's
                ``capture()``: ONNX Runtime engines in CUDA-graph mode), so that this thread's first call replays
                from its first run. Graphs live per thread in ONNX Runtime's CUDA provider, so only the thread that
                will call the pipeline can capture them; the other engines keep loading meanwhile. Captured engines
                get ``capture_from_s`` (the capture's start, before it waits for the lock) and ``captured_s`` marks
                in :attr:`timeline`.

        Raises:
            The first failure of an engine, in ``engines`` order (e.g. ``ArtifactError`` for an altered file).
        """
        start = time.perf_counter() - self._t0  # what the caller's own work took (the critical path if nothing waits)
        names = {future: name for name, future in self._futures.items()}
        failed = False
        for future in as_completed(names):  # all done before any is raised: the block's exit then closes the others
            failed = failed or future.exception() is not None
            if capture and not failed:
                self._capture(names[future])
        for name, future in self._futures.items():  # the private folders the caller's first runs left to remove
            if future.exception() is None and (removal := getattr(self._engines[name], "wait_removal", None)):
                removal()
                if cleanup := getattr(self._engines[name], "open_parts", {}).get("cleanup_s"):
                    with self._lock:
                        self.timeline[name]["cleanup_s"] = cleanup
        with self._lock:
            self.timeline["caller"] = {"wait_from_s": start, "wait_to_s": time.perf_counter() - self._t0}
        for future in self._futures.values():
            future.result()

    def add_marks(self, name: str, **at: float | None) -> None:
        """Put ``name``'s marks in :attr:`timeline`: each a ``time.perf_counter()`` value (``None``: left out), kept
        as seconds from the block's start (e.g. the scheduler import's start and end)."""
        with self._lock:
            self.timeline.setdefault(name, {}).update({k: v - self._t0 for k, v in at.items() if v is not None})

    def _capture(self, name: str) -> None:
        """Capture ``name``'s graph on this thread, if it was warmed and can (see :meth:`wait`), or run it once here
        if it is one of ``caller_warm``."""
        marks = self.timeline.get(name, {})
        engine = self._engines[name]
        capture = getattr(engine, "capture", None)
        if not ("warmed_s" in marks or self._first_run_by_caller(name)) or capture is None:
            return
        start = time.perf_counter() - self._t0  # before the capture lock: the wait for other loads is in it
        if getattr(engine, "cuda_graph", False):
            done = capture() and "captured_s"
        elif name in self._caller_warm:
            done = engine.prime() and "caller_warmed_s"
        else:
            return
        if done:
            with self._lock:
                marks.update(capture_from_s=start, **{done: time.perf_counter() - self._t0})

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._pool.shutdown(wait=True)
        for name, future in self._futures.items():
            if future.exception() is None:
                self._engines[name].__exit__(None, None, None)
        if warmed := [name for name, marks in self.timeline.items() if "warmed_s" in marks]:
            logger.debug("warmed up %s at load", ", ".join(warmed))
        for name, marks in self.timeline.items():
            logger.debug("load timeline %s: %s", name, ", ".join(f"{k} {v:.3f}" for k, v in marks.items()),
                         extra={"engine": name, "marks": dict(marks)})

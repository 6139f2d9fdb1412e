"""ONNX Runtime implementation of the :class:`~diffusion_trt.runtime.engines.engine.Engine` protocol.

Two execution paths:

* **plain run** (default on CPU): ``session.run`` on numpy views of the CPU torch tensors; the outputs
  are fresh arrays wrapped with ``torch.from_numpy`` (no copy).
* **IO binding** (always on CUDA, optional on CPU): inputs are bound by pointer (``data_ptr``), outputs are
  preallocated torch tensors, one set per output shape, reused across calls, so a denoising loop does no
  allocation and no host round trip.

  **With IO binding the tensors returned by ``run`` ARE the engine's output buffers: the next ``run``
  overwrites them in place. ``.clone()`` anything that must outlive the next call.**

CUDA streams: with ``stream=`` (a ``torch.cuda.Stream``), ONNX Runtime enqueues its kernels on that same
stream (provider option ``user_compute_stream``) and ``run`` returns without waiting for the GPU
(run option ``disable_synchronize_execution_providers``): torch work enqueued afterwards on that stream is
ordered after it, so a whole denoising loop runs without a host sync. Called from another torch stream,
``run`` orders itself after that stream's pending work and that stream after the run (events, no host
sync). Without a stream, ONNX Runtime uses its own: ``run`` first waits for torch's current stream (the
inputs must be complete) and ONNX Runtime waits for its own work before returning, which is correct on any
stream but serialises host and GPU.

CUDA graphs (``cuda_graph=True``, static-shape artifacts only): the session is created with the CUDA provider
option ``enable_cuda_graph=1``. ONNX Runtime runs the first call normally (its arena allocates), captures the
second into a CUDA graph, and from then on *replays* it, ignoring what is bound: the graph reads and writes
the addresses of the capture. So in this mode the engine owns one device buffer per input, bound once;
``run`` copies the feeds into them (``copy_`` on the engine's stream, no host sync) and replays. Whenever a
graph cannot be used the engine runs eagerly instead, after ONE warning naming the cause: a dynamic profile,
a CPU device, ONNX Runtime refusing the session (e.g. nodes placed on the CPU provider) or failing the
capture (the session is then rebuilt without graphs). ORT captures in ``cudaStreamCaptureModeGlobal``: while
one engine captures, no other thread may allocate CUDA memory, so the capture runs hold a process-wide lock
and multi-GPU callers warm every device up one after another (see ``runtime/parallel.py``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import numpy as np
import torch

from ...artifact.reader import OnnxBytes
from ...errors import ArtifactError, RuntimeInputError
from .capture_lock import CAPTURE_LOCK, exclusive_if, shared_if
from .engine import EngineBase, EngineSpec, _fmt_shape

logger = logging.getLogger(__name__)

#: Calls before ORT replays a graph: one regular run (arena allocations), then the capturing run. Counted per
#: thread: the CUDA provider keeps its graph in a per-thread context (``CUDAExecutionProvider::PerThreadContext``,
#: onnxruntime ``core/providers/cuda/cuda_execution_provider.h``), so a thread that has not run the engine yet
#: captures a graph of its own.
_GRAPH_CAPTURE_RUNS = 2

#: ``graph_optimization_level`` names -> ONNX Runtime's GraphOptimizationLevel member names. Our passes already made
#: the fusions ORT's extended level looks for; what "all" adds on CUDA is the NHWC layout transformation
#: (``prefer_nhwc``). See benchmarks/cold_start.py for the session-creation cost of each level.
OPTIMIZATION_LEVELS: dict[str, str] = {"disable": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC",
                                       "extended": "ORT_ENABLE_EXTENDED", "all": "ORT_ENABLE_ALL"}

#: ``intra_op_num_threads`` of CUDA sessions when the caller gives none; 0 = ONNX Runtime's default (a pool of one
#: thread per core per session). A switch for ``benchmarks/cold_start.py`` (``--set``): whether the pools' threads
#: slow the load, where three sessions are made side by side beside the weights' reading threads.
CUDA_INTRA_OP_THREADS = 0

ConvAlgoSearch = Literal["AUTO", "EXHAUSTIVE", "HEURISTIC", "DEFAULT"]
CONV_ALGO_SEARCH: tuple[str, ...] = ("AUTO", "EXHAUSTIVE", "HEURISTIC", "DEFAULT")


def resolve_conv_algo_search(requested: str, spec: EngineSpec) -> str:
    """The cuDNN algorithm search a session gets: ``requested``, or for "AUTO" (the default) EXHAUSTIVE when every
    input of ``spec`` is static (min == max) and HEURISTIC when any is dynamic.

    Why (issue 19; H200, SD-1.5 UNet fp16, ``benchmarks/results/h200-2026-12-01-s4-bench_*.json``): on the static
    512x512 artifact EXHAUSTIVE's step is 2 % faster (6.97 vs 7.11 ms) for a 1.0 s longer first call; on a dynamic
    256..1024 artifact it buys nothing (UNet 14.86 vs 12.06 ms plain, 8.23 vs 8.20 ms with size buckets at 512x512)
    and costs 1.3-2.1 s more on each first call at a new size. Size-bucket sessions are variants of the dynamic
    engine and keep its choice.
    """
    if requested != "AUTO":
        return requested
    return "EXHAUSTIVE" if spec.is_static else "HEURISTIC"

#: ONNX Runtime type strings (``NodeArg.type``) -> manifest dtype names.
_ORT_TYPES: dict[str, str] = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(bool)": "bool",
}


#: torch dtypes of weight inputs -> the numpy type ``IOBinding.bind_input`` takes.
_NUMPY_DTYPES: dict[torch.dtype, Any] = {torch.float32: np.float32, torch.float16: np.float16}


def cuda_graph_refusal(spec: EngineSpec, device: str) -> str | None:
    """Why ONNX Runtime's CUDA graph cannot serve this engine, or ``None`` when it can.

    Args:
        spec: the engine's I/O contract; every input's profile must be static (min == max).
        device: "cpu" or "cuda".

    Returns:
        A one-line reason naming the offending input / device and the fix, or ``None``.
    """
    if device != "cuda":  # first: on the CPU, "compile a static artifact" would not be the fix
        return f"device={device!r}: ONNX Runtime's CUDA graphs need the CUDA execution provider (device='cuda')"
    for info in spec.inputs:
        if not info.is_static:
            return (
                f"input {info.name!r} has a dynamic profile {_fmt_shape(info.min)}..{_fmt_shape(info.max)} and a "
                "CUDA graph replays one shape; compile a static artifact (min == opt == max) to use CUDA graphs"
            )
    return None


class OrtEngine(EngineBase):
    """One ONNX component run by ONNX Runtime on torch tensors.

    Args:
        path: the component's ``model.onnx`` (external ``.data`` beside it is found automatically); with ``source``,
            for messages only.
        spec: the manifest's component entry (``{"inputs": [...], "outputs": [...], ...}``) or a parsed
            :class:`EngineSpec`.
        name: component name for messages; default the spec's name or the folder name.
        device: "cpu" (CPUExecutionProvider) or "cuda" (CUDAExecutionProvider, then CPU for the few ops it
            lacks).
        device_id: CUDA device ordinal.
        stream: CUDA only: the ``torch.cuda.Stream`` to run on (see the module docstring); ``None`` = ONNX
            Runtime's own stream with a synchronisation around each ``run``.
        cudnn_conv_algo_search: CUDA only: "EXHAUSTIVE" (benchmark every algorithm once per shape: slow first
            call, fastest after), "HEURISTIC", "DEFAULT", or "AUTO" (EXHAUSTIVE for a static ``spec``, HEURISTIC
            for a dynamic one: see :func:`resolve_conv_algo_search`).
        io_binding: bind inputs/outputs by pointer and reuse output buffers; forced on for CUDA, default off
            for CPU (on CPU it saves an output allocation per call).
        intra_op_num_threads: CPU threads per operator; ``None`` = ONNX Runtime's default (all cores).
        provider_options: extra CUDA provider options, merged over the ones above.
        session_options: a prepared ``onnxruntime.SessionOptions`` to use instead of the defaults
            (ORT_ENABLE_ALL, warnings and up).
        derived: output symbols no input binds; see :meth:`EngineSpec.from_manifest`.
        cuda_graph: run through ONNX Runtime's CUDA graph (see the module docstring); falls back to eager runs
            with one WARNING when the engine is not static-shaped, not on CUDA, or ORT refuses.
            :attr:`cuda_graph` says whether it is in use, :attr:`cuda_graph_reason` why not.
        source: called on each session creation for the model's bytes and its external-data files
            (:class:`~diffusion_trt.artifact.reader.OnnxBytes`, e.g. ``ArtifactReader.onnx``): ONNX Runtime then
            builds the session from those bytes and opens no file of the artifact by name, so what was hashed is
            what runs. Called as ``source(spill=FOLDER)`` (``ArtifactReader.onnx``'s argument): a model with
            external data is read into files of that private folder and the session opens them there (see
            :func:`private_folder`); otherwise from memory (``add_external_initializers_from_files_in_memory``).
            ``None`` = ONNX Runtime opens ``path`` itself.
        read_ahead: the first open's bytes, already being read from ``source`` (:func:`read_private` on another
            thread, started before this engine existed: ``from_artifacts`` starts it before CUDA initialises); that
            open waits for it instead of reading (and raises its error, e.g. an altered file), later opens read
            again. Dropped, its folder removed, when the engine closes without having used it.
        free_dimensions: fix symbolic dims of the graph (``{"B2": 2, "h": 64, "w": 64}``) through
            ``SessionOptions.add_free_dimension_override_by_name``: ORT's optimiser then folds the shape arithmetic
            (see :mod:`~diffusion_trt.runtime.engines.buckets`); ``spec`` should then be static at those values.
        deterministic: ``SessionOptions.use_deterministic_compute`` (ORT's kernels that have a deterministic
            variant use it; see :mod:`~diffusion_trt.runtime.determinism` for what stays non-deterministic).
        graph_optimization_level: ONNX Runtime's optimisation at session creation, one of
            :data:`OPTIMIZATION_LEVELS` ("all" by default); ignored when ``session_options`` are given.
        weight_inputs: graph inputs that are weights (an ORT ``--refittable`` artifact,
            :mod:`~diffusion_trt.runtime.lora_slots`): name -> tensor on :attr:`device`, read at every run and bound
            by pointer (fed as numpy views on the plain CPU path). The mapping is live: whoever owns it may change
            the tensors' values in place between runs (a CUDA graph replays the addresses bound at capture), never
            while a run is queued.

    Both are applied to ``session_options`` too when one is given.

    Nothing is loaded until ``__enter__``.

    Raises:
        ArtifactError: unknown device or ``cudnn_conv_algo_search``; on enter, a missing model file, the CUDA
            provider unavailable, or a graph whose inputs/outputs disagree with the manifest.

    **Outputs alias internal buffers with IO binding (always on CUDA): overwritten by the next ``run``.**
    Not thread-safe: use one engine per thread.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        spec: Mapping[str, Any] | EngineSpec,
        *,
        name: str | None = None,
        device: str = "cpu",
        device_id: int = 0,
        stream: torch.cuda.Stream | None = None,
        cudnn_conv_algo_search: str = "AUTO",
        io_binding: bool | None = None,
        intra_op_num_threads: int | None = None,
        provider_options: Mapping[str, Any] | None = None,
        session_options: Any = None,
        derived: Mapping[str, tuple[str, int]] | None = None,
        cuda_graph: bool = False,
        source: Callable[..., OnnxBytes] | None = None,
        read_ahead: Future[PrivateRead] | None = None,
        free_dimensions: Mapping[str, int] | None = None,
        deterministic: bool = False,
        graph_optimization_level: str = "all",
        weight_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.path = Path(path)
        self._weights: Mapping[str, torch.Tensor] = weight_inputs if weight_inputs is not None else {}
        self._source = source
        self._read_ahead = read_ahead
        self._name_and_spec(self.path, spec, name, derived)
        if device not in ("cpu", "cuda"):
            raise ArtifactError(f"device={device!r} is not supported by the ONNX Runtime engine; use 'cpu' or 'cuda'")
        if cudnn_conv_algo_search not in CONV_ALGO_SEARCH:
            raise ArtifactError(
                f"cudnn_conv_algo_search={cudnn_conv_algo_search!r} is unknown; "
                f"use one of {', '.join(CONV_ALGO_SEARCH)}"
            )
        if graph_optimization_level not in OPTIMIZATION_LEVELS:
            raise RuntimeInputError(f"graph_optimization_level={graph_optimization_level!r} is unknown; use one of "
                                    f"{', '.join(OPTIMIZATION_LEVELS)}")
        self._optimization_level = graph_optimization_level
        if device == "cuda" and io_binding is False:
            logger.warning("%s: io_binding=False is ignored on CUDA (inputs are bound by pointer)", self._name)
        self._kind = device
        self._device = torch.device("cuda", device_id) if device == "cuda" else torch.device("cpu")
        self._device_id = device_id
        self._stream = stream if device == "cuda" else None
        self._io_binding = True if device == "cuda" else bool(io_binding)
        self._conv_algo = resolve_conv_algo_search(cudnn_conv_algo_search, self._spec)
        self._threads = intra_op_num_threads
        self._extra_provider_options = dict(provider_options or {})
        self._session_options = session_options
        self._free_dimensions = {str(k): int(v) for k, v in (free_dimensions or {}).items()}
        self._deterministic = bool(deterministic)

        self._session: Any = None
        #: seconds the last open's parts took: "read_s" (read + hash, into the private folder's files),
        #: "session_s" (ONNX Runtime's session), "cleanup_s" (the private folder's removal); the load timeline
        self.open_parts: dict[str, float] = {}
        self._removing: threading.Thread | None = None  # the private folder's removal (_remove_later)
        self._binding: Any = None
        self._run_options: Any = None
        self._async = False
        self._outputs: dict[str, torch.Tensor] = {}
        self._live_inputs: dict[str, torch.Tensor] = {}
        self._depth = 0
        self._graph_requested = bool(cuda_graph)
        self._graph = False  # in use (decided on open)
        self._graph_reason: str | None = None
        self._graph_runs: dict[int, int] = {}  # thread ident -> its graph-mode runs (see _GRAPH_CAPTURE_RUNS)
        self._graph_bound = False
        self._static_inputs: dict[str, torch.Tensor] = {}

    def variant(
        self, spec: EngineSpec, *, free_dimensions: Mapping[str, int] | None = None, cuda_graph: bool | None = None
    ) -> OrtEngine:
        """A new, unopened engine of the same file and settings with another ``spec`` (and ``free_dimensions``,
        ``cuda_graph``: ``None`` keeps this engine's request); used by :mod:`~diffusion_trt.runtime.engines.buckets`."""
        return OrtEngine(
            self.path,
            spec,
            name=self._name,
            device=self._kind,
            device_id=self._device_id,
            stream=self._stream,
            cudnn_conv_algo_search=self._conv_algo,
            io_binding=self._io_binding if self._kind == "cpu" else None,
            intra_op_num_threads=self._threads,
            provider_options=self._extra_provider_options,
            session_options=self._session_options,
            cuda_graph=self._graph_requested if cuda_graph is None else cuda_graph,
            source=self._source,
            free_dimensions=free_dimensions,
            deterministic=self._deterministic,
            graph_optimization_level=self._optimization_level,
            weight_inputs=self._weights,
        )

    # -- Engine protocol -------------------------------------------------------------------------------

    @property
    def providers(self) -> list[str]:
        """Execution providers of the open session (empty when closed)."""
        return list(self._session.get_providers()) if self._session is not None else []

    @property
    def is_open(self) -> bool:
        return self._session is not None

    @property
    def cuda_graph(self) -> bool:
        """Whether runs go through ONNX Runtime's CUDA graph (decided on open; may turn off on a failed capture)."""
        return self._graph

    @property
    def cuda_graph_reason(self) -> str | None:
        """Why a requested CUDA graph is not used (``None`` when in use or not requested)."""
        return self._graph_reason

    def close(self) -> None:
        """Free the session and every buffer (idempotent); remove the folder of a read-ahead no open used."""
        self.wait_removal()
        if self._read_ahead is not None:
            discard_read(self._read_ahead)
            self._read_ahead = None
        if self._session is not None and self._async:
            # queued kernels may still read the inputs we keep alive / write our buffers
            self._current_torch_stream().synchronize()
        self._binding = None
        self._session = None
        self._run_options = None
        self._outputs = {}
        self._live_inputs = {}
        self._static_inputs = {}
        self._graph_runs = {}
        self._graph_bound = False
        self._depth = 0

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run the component.

        Args:
            feeds: every input by name, on :attr:`device`, dtypes and shapes as the manifest says
                (e.g. unet: ``sample`` float [B2,4,h,w], ``timestep`` float32 [B2],
                ``encoder_hidden_states`` float [B2,77,D]).

        Returns:
            Output name -> tensor on :attr:`device`. **With IO binding (always on CUDA) these are the
            engine's own buffers, overwritten by the next ``run``.**

        Raises:
            RuntimeInputError: ``feeds`` do not match the manifest (see :meth:`validate`).
            ArtifactError: the graph produced a shape the manifest does not predict.
            RuntimeError: the engine is not open (use ``with engine:``).
        """
        if self._session is None:
            raise RuntimeError(f"engine {self._name!r} is not open; use `with engine:` or call it inside the pipeline")
        symbols = self.validate(feeds)
        shapes = self._spec.output_shapes(symbols)
        if self._graph:
            # the capturing runs allocate their buffers under the lock too: no other thread's CUDA call may land
            # inside ORT's global-mode capture. The regular run before the capture too: with it shared (H100,
            # 2026-12-07) other engines' session creations failed with "operation not permitted when stream is
            # capturing" in 3 of 4 loads
            with exclusive_if(self._capturing()):
                return self._run_graph(feeds, shapes)
        if self._io_binding:
            return self._run_bound(feeds, shapes)
        return self._run_plain(feeds, shapes)

    def prime(self) -> bool:
        """Run once on zeros at the (static) input shapes, outside CUDA-graph mode, and wait for the device.

        What a session's first run settles is settled here, on any thread: cuDNN's algorithm choice per convolution
        (cached in the session's kernels), the arena's allocations and ORT's memory pattern. In CUDA-graph mode the run
        goes through its own IO binding with ORT's run option ``gpu_graph_id=-1`` (no capture, no replay, and ORT's
        count of runs before the capture left as it was; onnxruntime ``core/providers/cuda/cuda_graph.h``,
        ``kCudaGraphAnnotationSkip``), so the engine's own first runs, on the thread that replays, still run
        and capture holding :data:`~.capture_lock.CAPTURE_LOCK` exclusive. This run holds it shared: a regular run
        allocates, which would break another thread's capture in ``cudaStreamCaptureModeGlobal``, but it may overlap
        other engines' session creations and first runs.

        Returns:
            Whether it ran: only engines whose every input shape is fixed (a static spec).

        Raises:
            RuntimeError: the engine is not open.
        """
        if self._session is None:
            raise RuntimeError(f"engine {self._name!r} is not open; use `with engine:` first")
        if not self._spec.is_static:
            return False
        cuda = self._kind == "cuda"
        with shared_if(cuda):
            feeds = self._spec.zero_feeds(self._device)
            if not self._graph:
                self.run(feeds)
            else:
                self._run_uncaptured(feeds)
            if cuda:
                self._current_torch_stream().synchronize()
        return True

    def capture(self) -> bool:
        """Capture the CUDA graph on the calling thread now: the graph-mode runs on zeros (at the static input
        shapes) that a first call would make, holding :data:`~.capture_lock.CAPTURE_LOCK` exclusive, then wait for
        the device. The thread that later calls :meth:`run` replays from its first run, if it is this thread (ONNX
        Runtime keeps the graph per thread; another thread captures its own on its first runs, as before).

        Returns:
            Whether it captured: only engines in CUDA-graph mode, not yet captured on this thread. ``False`` also
            when the capture failed and the engine fell back to eager runs (after its one warning).

        Raises:
            RuntimeError: the engine is not open.
        """
        if self._session is None:
            raise RuntimeError(f"engine {self._name!r} is not open; use `with engine:` first")
        if not self._graph or not self._capturing():
            return False
        with CAPTURE_LOCK.exclusive():  # the zeros' allocation too (reentrant: run() takes it again)
            feeds = self._spec.zero_feeds(self._device)
            while self._graph and self._capturing():
                self.run(feeds)
            self._current_torch_stream().synchronize()
        return self._graph

    def _capturing(self) -> bool:
        """Whether this thread's next graph-mode run is one of ORT's runs before its replays (see
        :data:`_GRAPH_CAPTURE_RUNS`)."""
        return self._graph_runs.get(threading.get_ident(), 0) < _GRAPH_CAPTURE_RUNS

    def _run_uncaptured(self, feeds: Mapping[str, torch.Tensor]) -> None:
        """A graph-mode session's run on ``feeds`` through a binding of its own (fresh output buffers), with
        ``gpu_graph_id=-1`` and ORT's synchronisation at the end (see :meth:`prime`)."""
        import onnxruntime as ort

        torch.cuda.current_stream(self._device).synchronize()  # the zeros are made on this thread's stream
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", "-1")
        binding = self._session.io_binding()
        kind, dev = self._kind, self._device_id
        for info in self._spec.inputs:
            t = feeds[info.name]
            binding.bind_input(info.name, kind, dev, info.numpy_dtype.type, tuple(t.shape), t.data_ptr())
        self._bind_weights(binding)
        shapes = self._spec.output_shapes(self.validate(feeds))
        outputs = {}  # held until the (synchronised) run returns, then dropped: nothing reads them
        for info in self._spec.outputs:
            outputs[info.name] = buf = torch.empty(shapes[info.name], dtype=info.torch_dtype, device=self._device)
            binding.bind_output(info.name, kind, dev, info.numpy_dtype.type, tuple(buf.shape), buf.data_ptr())
        self._session.run_with_iobinding(binding, options)

    # -- internals ------------------------------------------------------------------------------------

    def _current_torch_stream(self) -> Any:
        return self._stream if self._stream is not None else torch.cuda.current_stream(self._device)

    def _providers(self) -> list[Any]:
        import onnxruntime as ort

        if self._kind == "cpu":
            return ["CPUExecutionProvider"]
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise ArtifactError(
                f"engine {self._name!r}: device='cuda' needs ONNX Runtime's CUDAExecutionProvider, but this "
                f"onnxruntime {ort.__version__} offers only {', '.join(available)}; install the GPU build "
                "(`pip uninstall onnxruntime && pip install onnxruntime-gpu`) or run with device='cpu'"
            )
        return [("CUDAExecutionProvider", self._provider_options()), "CPUExecutionProvider"]

    def _provider_options(self) -> dict[str, str]:
        """The CUDAExecutionProvider options of the next session: device, cuDNN search, stream, graph, extras."""
        options: dict[str, str] = {
            "device_id": str(self._device_id),
            "cudnn_conv_algo_search": self._conv_algo,
        }
        if self._stream is not None:
            handle = int(self._stream.cuda_stream)
            if handle == 0:
                # ONNX Runtime treats a null stream as "no user stream"; fall back to synchronised runs.
                logger.info("%s: the given CUDA stream is the default (null) stream; running synchronised", self._name)
                self._stream = None
            else:
                options["user_compute_stream"] = str(handle)
        options.update({k: str(v) for k, v in self._extra_provider_options.items()})
        if self._graph:
            options["enable_cuda_graph"] = "1"
        elif self._graph_requested:
            options.pop("enable_cuda_graph", None)  # refused: the caller's own option would fail the same way
        return options

    def _disable_graph(self, reason: str) -> None:
        """Turn CUDA-graph mode off with ONE warning naming the cause."""
        self._graph = False
        if self._graph_reason is None:
            logger.warning("%s: CUDA graph not used, running eagerly: %s", self._name, reason)
        self._graph_reason = reason

    def _open(self) -> None:
        import onnxruntime as ort

        if self._source is None and not self.path.is_file():
            raise ArtifactError(f"engine {self._name!r}: model file {self.path} is missing; recompile the artifact")
        if self._graph_requested and self._graph_reason is None:
            refusal = cuda_graph_refusal(self._spec, self._kind)
            if refusal is None:
                self._graph = True
            else:
                self._disable_graph(refusal)
        providers = self._providers()
        if self._kind == "cuda" and not torch.cuda.is_available():
            raise ArtifactError(
                f"engine {self._name!r}: device='cuda' but torch sees no CUDA device "
                f"(torch {torch.__version__}); install a CUDA build of torch or run with device='cpu'"
            )
        t0 = time.perf_counter()
        ahead, self._read_ahead = self._read_ahead, None
        # read (and hashed) before any session; with external data, into files of our own private folder
        read = ahead.result() if ahead is not None else read_private(self._source, self._name)
        folder, data, read_seconds = read.folder, read.data, read.seconds
        try:
            model: str | bytes = str(self.path) if data is None else (
                data.model if data.model_path is None else str(data.model_path))
            t1 = time.perf_counter()
            with shared_if(self._kind == "cuda"):  # side by side with other loads, never inside a capture
                session = self._create_session(ort, model, data, providers)
            del data, read
        except BaseException:
            if folder is not None:
                folder.cleanup()
            raise
        self.open_parts = {"read_s": t1 - t0, "session_s": time.perf_counter() - t1}
        if ahead is not None:  # the read's own time, and how long this open waited for it ("read_s")
            self.open_parts["read_ahead_s"] = read_seconds
        self._remove_later(folder)
        self._finish_open(ort, session)

    def _remove_later(self, folder: tempfile.TemporaryDirectory[str] | None) -> None:
        """Remove the private folder on a thread of its own (:meth:`wait_removal` waits for it): ONNX Runtime is done
        with its files once the session exists, and freeing the pages of a just-written 1.7 GB file (the SD-1.5 UNet's:
        0.11 s on the H100, ``h100-2026-12-07-s20-cold-start.json``) need not sit between the session and the first
        run. The thread is not a daemon, so the folder is gone before the interpreter exits."""
        if folder is None:
            return
        self.wait_removal()  # a previous open's removal (a rebuild without CUDA graphs)

        def remove() -> None:
            t = time.perf_counter()
            folder.cleanup()
            self.open_parts["cleanup_s"] = time.perf_counter() - t

        self._removing = threading.Thread(target=remove, name=f"diffusion-trt-remove-{self._name}")
        self._removing.start()

    def wait_removal(self) -> None:
        """Wait until the last open's private folder is removed (at once when there was none)."""
        if self._removing is not None:
            self._removing.join()
            self._removing = None

    def _create_session(self, ort: Any, model: str | bytes, data: OnnxBytes | None, providers: list[Any]) -> Any:
        """The InferenceSession (a refused CUDA graph: again without it, after one warning).

        Raises:
            ArtifactError: ONNX Runtime cannot load the model.
        """
        try:
            try:
                session = ort.InferenceSession(model, sess_options=self._make_session_options(data),
                                               providers=providers)
            except Exception as e:  # ORT refuses graph capture at session creation (nodes on the CPU EP...)
                if not self._graph:
                    raise
                self._disable_graph(f"ONNX Runtime refused enable_cuda_graph=1 for {self.path.name}: {e}")
                session = ort.InferenceSession(model, sess_options=self._make_session_options(data),
                                               providers=self._providers())
        except Exception as e:  # onnxruntime raises its own exception types (Fail, InvalidGraph, ...)
            raise ArtifactError(
                f"engine {self._name!r}: ONNX Runtime could not load {self.path}: {e}; "
                "check the file (`diffusion-trt verify`) or recompile the artifact"
            ) from e
        return session

    def _finish_open(self, ort: Any, session: Any) -> None:
        """Check the new session (CUDA provider in use, I/O as the manifest says) and keep it."""
        if self._kind == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
            raise ArtifactError(
                f"engine {self._name!r}: the CUDA execution provider failed to initialise (session providers: "
                f"{', '.join(session.get_providers())}); usually CUDA/cuDNN libraries are missing or mismatched: "
                "import torch before onnxruntime, call onnxruntime.preload_dlls(), or install the onnxruntime-gpu "
                "build matching your CUDA"
            )
        self._check_graph_io(session)
        self._session = session
        self._async = self._kind == "cuda" and self._stream is not None
        self._run_options = ort.RunOptions()
        if self._async:
            self._run_options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        if self._io_binding:
            self._binding = session.io_binding()
        logger.debug(
            "opened %s (%s, providers %s, io_binding=%s, async=%s, cuda_graph=%s)",
            self._name,
            self.path,
            ",".join(session.get_providers()),
            self._io_binding,
            self._async,
            self._graph,
        )

    def _make_session_options(self, data: OnnxBytes | None) -> Any:
        """Session options for one session creation: the caller's, or fresh ones (ORT_ENABLE_ALL, warnings and up);
        with ``data``, its external-data files handed over from memory, each once (ORT keeps pointers to them in the
        options, so these options serve this one creation while ``data`` is alive); with ``data`` in a folder, read as
        ONNX whatever the file's name.

        Raises:
            RuntimeInputError: the caller's own ``session_options`` with in-memory external data.
        """
        import onnxruntime as ort

        so = self._session_options
        if so is not None and data is not None and data.external:
            # ORT keeps pointers to in-memory files in the options object: reusing one across sessions would read
            # freed buffers, and adding twice is refused ("An entry for this name has already been added")
            raise RuntimeInputError(
                f"engine {self._name!r}: session_options cannot be combined with source= for a model with external "
                "data (ONNX Runtime keeps the in-memory files in the options); pass intra_op_num_threads= instead, "
                "or no source"
            )
        if so is None:
            so = ort.SessionOptions()
            so.graph_optimization_level = getattr(ort.GraphOptimizationLevel,
                                                  OPTIMIZATION_LEVELS[self._optimization_level])
            so.log_severity_level = 2  # warning
            threads = self._threads if self._threads is not None or self._kind != "cuda" else CUDA_INTRA_OP_THREADS
            if threads:
                so.intra_op_num_threads = threads
        for dim, value in self._free_dimensions.items():
            so.add_free_dimension_override_by_name(dim, value)
        if self._deterministic:
            so.use_deterministic_compute = True
        if data is not None and data.folder is not None:
            # the reader parsed the model as ONNX: a name ending ".ort" must not make ORT read it as its own format
            so.add_session_config_entry("session.load_model_format", "ONNX")
        if data is not None and data.external and data.folder is None:
            # one entry a file: ORT normalises the names ("./a.data" is "a.data") and refuses a second entry for one
            files = {PurePosixPath(n).as_posix(): b for n, b in data.external.items()}
            names = list(files)
            buffers = [files[n] for n in names]
            so.add_external_initializers_from_files_in_memory(names, buffers, [len(b) for b in buffers])
        return so

    def _check_graph_io(self, session: Any) -> None:
        """The graph's inputs/outputs must be the manifest's: same names and element types."""
        for kind, graph_args, infos in (
            ("inputs", session.get_inputs(), self._spec.inputs),
            ("outputs", session.get_outputs(), self._spec.outputs),
        ):
            graph = {a.name: _ORT_TYPES.get(a.type, a.type) for a in graph_args if a.name not in self._weights}
            manifest = {t.name: t.dtype for t in infos}
            if graph != manifest:
                raise ArtifactError(
                    f"engine {self._name!r}: the graph's {kind} {graph} differ from the manifest's {manifest}; "
                    "the artifact is inconsistent: recompile it"
                )

    def _run_plain(self, feeds: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        arrays = {n: t.detach().contiguous().numpy() for n, t in feeds.items()}
        arrays.update({n: t.numpy() for n, t in self._weights.items()})
        values = self._session.run(list(self.output_names), arrays, self._run_options)
        out: dict[str, torch.Tensor] = {}
        for name, value in zip(self.output_names, values, strict=True):
            if tuple(value.shape) != shapes[name]:
                raise ArtifactError(
                    f"engine {self._name!r} output {name!r} has shape {tuple(value.shape)} but the manifest "
                    f"predicts {shapes[name]}; the artifact is inconsistent: recompile it"
                )
            out[name] = torch.from_numpy(value)
        return out

    def _output_buffer(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, bool]:
        """The reusable buffer for ``name`` at ``shape``; (buffer, True) when newly allocated."""
        buf = self._outputs.get(name)
        if buf is not None and tuple(buf.shape) == shape:
            return buf, False
        buf = torch.empty(shape, dtype=self._spec.output(name).torch_dtype, device=self._device)
        self._outputs[name] = buf
        return buf, True

    def _run_bound(self, feeds: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        kind, dev = self._kind, self._device_id
        binding = self._binding
        caller = torch.cuda.current_stream(self._device) if self._kind == "cuda" else None
        if caller is not None:
            if not self._async:
                # ONNX Runtime's own stream does not wait for torch's: the inputs must be complete first.
                caller.synchronize()
            elif caller != self._stream:
                self._stream.wait_stream(caller)  # inputs made on the caller's stream come first (no host sync)
        live: dict[str, torch.Tensor] = {}
        for info in self._spec.inputs:
            t = feeds[info.name].detach().contiguous()
            live[info.name] = t
            binding.bind_input(info.name, kind, dev, info.numpy_dtype.type, tuple(t.shape), t.data_ptr())
        self._bind_weights(binding)
        for info in self._spec.outputs:
            buf, new = self._output_buffer(info.name, shapes[info.name])
            if new:
                logger.debug("%s: allocated output %s %s", self._name, info.name, tuple(buf.shape))
            # rebinding is cheap; binding every call keeps ORT's view in step with our buffers
            binding.bind_output(info.name, kind, dev, info.numpy_dtype.type, tuple(buf.shape), buf.data_ptr())
        self._session.run_with_iobinding(binding, self._run_options)
        if caller is not None and self._async and caller != self._stream:
            caller.wait_stream(self._stream)  # the caller's later work (and frees) come after this run
        # Keep the inputs alive until the next run: with async CUDA the kernels may still read them. (Memory
        # freed to torch's caching allocator is only reused in stream order anyway; this is belt and braces.)
        self._live_inputs = live
        return {info.name: self._outputs[info.name] for info in self._spec.outputs}

    def _bind_weights(self, binding: Any) -> None:
        """Bind every weight input by pointer (see ``weight_inputs``)."""
        for name, t in self._weights.items():
            binding.bind_input(name, self._kind, self._device_id, _NUMPY_DTYPES[t.dtype], tuple(t.shape), t.data_ptr())

    def _run_graph(self, feeds: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
        """CUDA-graph mode: copy feeds into the engine-owned input buffers (bound once), then run/capture/replay."""
        caller = torch.cuda.current_stream(self._device)
        stream = self._stream if self._async else caller
        if stream != caller:
            stream.wait_stream(caller)  # the feeds were made on the caller's stream
        with torch.cuda.stream(stream):
            for info in self._spec.inputs:
                src = feeds[info.name]
                buf = self._static_inputs.get(info.name)
                if buf is None:
                    buf = torch.empty(tuple(src.shape), dtype=info.torch_dtype, device=self._device)
                    self._static_inputs[info.name] = buf
                elif tuple(buf.shape) != tuple(src.shape):  # unreachable for a static spec; kept as a guard
                    return self._rebuild_eager(
                        f"input {info.name!r} changed shape {_fmt_shape(buf.shape)} -> {_fmt_shape(src.shape)} "
                        "after the graph was captured",
                        feeds,
                        shapes,
                    )
                if src.data_ptr() != buf.data_ptr():
                    buf.copy_(src, non_blocking=True)
        if not self._async:
            caller.synchronize()  # ORT's own stream does not wait for torch's: the copies must be complete
        binding = self._binding
        if not self._graph_bound:
            kind, dev = self._kind, self._device_id
            for info in self._spec.inputs:
                buf = self._static_inputs[info.name]
                binding.bind_input(info.name, kind, dev, info.numpy_dtype.type, tuple(buf.shape), buf.data_ptr())
            self._bind_weights(binding)
            for info in self._spec.outputs:
                buf, _ = self._output_buffer(info.name, shapes[info.name])
                binding.bind_output(info.name, kind, dev, info.numpy_dtype.type, tuple(buf.shape), buf.data_ptr())
            self._graph_bound = True
        capturing = self._capturing()
        try:
            with exclusive_if(capturing):
                self._session.run_with_iobinding(binding, self._run_options)
        except Exception as e:  # ORT's capture failures come as its own exception types
            if not capturing:
                raise
            return self._rebuild_eager(f"ONNX Runtime failed to capture the CUDA graph: {e}", feeds, shapes)
        thread = threading.get_ident()
        self._graph_runs[thread] = self._graph_runs.get(thread, 0) + 1
        if self._async and caller != self._stream:
            caller.wait_stream(self._stream)
        self._live_inputs = dict(feeds)  # the copies above may still read them
        return {info.name: self._outputs[info.name] for info in self._spec.outputs}

    def _rebuild_eager(
        self, reason: str, feeds: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, Any]:
        """Leave CUDA-graph mode for good: warn, rebuild the session without ``enable_cuda_graph``, run eagerly."""
        self._disable_graph(reason)
        if self._async:
            with contextlib.suppress(RuntimeError):  # a broken capture may leave the stream unusable
                self._current_torch_stream().synchronize()
        self._binding = None
        self._session = None
        self._static_inputs = {}
        self._graph_bound = False
        self._open()
        return self._run_bound(feeds, shapes)

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return f"OrtEngine({self._name!r}, {str(self.path)!r}, device={self._device}, {state})"


@dataclass
class PrivateRead:
    """A model's bytes, read (and hashed) for one session: :func:`read_private`.

    Attributes:
        folder: the private folder its files were written into (the session's to remove once made), or ``None``.
        data: the bytes (their files in ``folder`` when written there); ``None`` without a source (ONNX Runtime
            opens the model's path itself).
        seconds: how long the read took.
    """

    folder: tempfile.TemporaryDirectory[str] | None
    data: OnnxBytes | None
    seconds: float


def read_private(source: Callable[..., OnnxBytes] | None, name: str) -> PrivateRead:
    """Read a model through ``source`` (``ArtifactReader.onnx``'s partial; ``None``: nothing to read) into a new
    :func:`private_folder`, on the calling thread: what an :class:`OrtEngine` open reads before its session, and what
    ``read_ahead=`` hands it from another thread.

    Raises:
        ArtifactError: as ``source`` (an altered or missing file...); the folder is removed first.
    """
    t = time.perf_counter()
    if source is None:
        return PrivateRead(None, None, 0.0)
    folder = private_folder(name)
    try:
        data = source(spill=None if folder is None else Path(folder.name))
    except BaseException:
        if folder is not None:
            folder.cleanup()
        raise
    return PrivateRead(folder, data, time.perf_counter() - t)


def discard_read(read: Future[PrivateRead]) -> None:
    """Remove the folder of a read no session will use, once it ends (at once when it has; its error, if any, is
    dropped: nothing waits for these bytes)."""

    def remove(done: Future[PrivateRead]) -> None:
        if not done.cancelled() and done.exception() is None and (folder := done.result().folder) is not None:
            folder.cleanup()

    read.add_done_callback(remove)


def private_folder(name: str) -> tempfile.TemporaryDirectory[str] | None:
    """A new private folder (``tempfile``'s, mode 0700, under ``$TMPDIR``) for the source to write the model and
    its external data into while a session is made, removed right after (ONNX Runtime has copied the weights to
    the device, or maps the files, which outlive their names: :meth:`OrtEngine._remove_later`); ``None`` where
    there is none to be had (below). ``name``: the component, for the log line.

    Why: ONNX Runtime built the SD-1.5 UNet's session in 0.59-0.69 s from files against 2.8-3.3 s from the same
    bytes in memory (``add_external_initializers_from_files_in_memory``, or OrtValue initializers over them;
    H200, onnxruntime-gpu 1.31.1, ``benchmarks/results/h200-2026-12-04-s16-session-sources-*.json``). Only this
    process's user can reach the folder, so the bytes ORT reads are the bytes the reader hashed. ``$TMPDIR``
    picks where it is made; without room there (or without a writable one, one whose name is not UTF-8: ONNX
    Runtime takes a path only as UTF-8 text, or one where another user may rename entries: writable by group or
    others without the sticky bit, or owned by another user than us or root) the weights load from memory."""
    try:
        where = tempfile.gettempdir()  # $TMPDIR
        where.encode("utf-8")  # a name of other bytes (surrogate escapes) cannot reach ORT
        st = os.stat(where)
        if st.st_uid not in (0, os.getuid()) or (st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                                                  and not st.st_mode & stat.S_ISVTX):
            # another user could rename our folder away and put one of theirs in its place before ORT opens it
            raise PermissionError(f"{where} lets other users rename what is in it (no sticky bit, or not ours)")
        folder = tempfile.TemporaryDirectory(prefix="diffusion-trt-weights-", dir=where, ignore_cleanup_errors=True)
    except (OSError, UnicodeEncodeError) as e:  # no writable temporary folder: the bytes go to ORT from memory
        logger.info("%s: no private folder for the weights (%s); loading them from memory", name, e)
        return None
    return folder

"""``diffusion-trt serve``: one artifact behind a real Triton Inference Server, through NVIDIA PyTriton.

PyTriton starts ``tritonserver`` (shipped in its wheel) with KServe v2 HTTP and gRPC endpoints and forwards
each request of model ``pipeline`` (layout: :mod:`.triton_model`; the same :func:`parse_request` rules) to this
process, where one :class:`~diffusion_trt.runtime.EnginePipeline` runs.

Batching. PyTriton fails *every* request of a Triton batch when its callable raises, so one bad request
would take its batch-mates down. The Triton model is therefore unbatched with ``instances`` parallel
instances: each validates its own request (a bad one gets its own error naming the field) and hands a
valid one to :class:`MicroBatcher`, which merges requests that arrive within ``max_queue_delay_s`` and
share (height, width, steps, guidance) into one ``EnginePipeline`` call of up to ``max_batch_size`` images,
with one CPU generator per image: each image is the one its seed gives alone.

Bounds (a request cannot exhaust the server): prompt length (in characters here, and in bytes before the
request reaches this process), steps, guidance, height/width inside the engines' profile, images per engine
call, the number of requests waiting in Triton's queue (beyond it: 503 / UNAVAILABLE) and how long one may wait
there (then it is dropped unrun: 503 / UNAVAILABLE "Request timeout expired"); see :mod:`.pytriton_proxy`.

HTTP goes through our own front (:mod:`.http_front`) before Triton's parser: a body cap (413), the JSON request
checked for what Triton 2.51 would answer 500 to or silently wrap (400), a connection bound. gRPC goes through a
relay of ours (:mod:`.grpc_front`) with the same message bound (RESOURCE_EXHAUSTED); both run in a process of their
own (:mod:`.front_process`). Triton's own HTTP and gRPC endpoints listen on other ports of 127.0.0.1.

Statuses: a request the rules refuse gets 400 / INVALID_ARGUMENT with one line naming the field and the allowed
range; a full queue 503 / UNAVAILABLE; anything else 500 / INTERNAL "see the server log" (the traceback is
logged here, never sent). Listens on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sysconfig
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DiffusionTrtError, LoraError, MissingPackageError, RuntimeInputError
from ..runtime.controlnet import controlnet_names
from . import control, pytriton_proxy, triton_model
from .front_process import FrontProcess, FrontSettings, FrontStartError
from .http_front import FrontLimits, free_loopback_port
from .pytriton_proxy import StatusError
from .triton_model import RequestError, parse_request
from .triton_repo import request_facts

logger = logging.getLogger(__name__)

MODEL_NAME = "pipeline"


class ServeError(DiffusionTrtError):
    """The server cannot start (ports taken, tritonserver failing); PyTriton missing is a MissingPackageError."""


@dataclass(frozen=True)
class ServeConfig:
    """How ``serve`` runs.

    Attributes:
        host: address every endpoint binds to (HTTP, gRPC); 127.0.0.1 = this machine only.
        http_port, grpc_port: KServe v2 endpoints.
        max_batch_size: images per engine call (capped by the artifact's batch profile).
        max_queue_delay_s: how long the first request of a batch waits for batch-mates.
        max_queue: requests waiting in Triton's queue at most; more are refused with 503 / UNAVAILABLE.
        queue_timeout_s: a request that waited this long in that queue is dropped unrun (503 / UNAVAILABLE); a
            client's own ``timeout`` request parameter overrides it; 0 = no limit.
        instances: parallel Triton model instances (requests accepted at once).
        max_prompt_chars, max_steps, max_guidance: request bounds (see :data:`triton_model.DEFAULT_LIMITS`).
        device: "cpu"/"cuda"; ``None`` = the artifact's.
        scheduler: scheduler short name; ``None`` = the model's.
        vram_budget: device memory the pipeline may use ("8GB", bytes; see ``EnginePipeline.from_artifacts``),
            checked at load for the default size and ``max_batch_size`` images; ``None`` = no budget.
        max_connections: HTTP client connections at once (more get 503 at once; :mod:`.http_front`).
        lora_dir: the folder of LoRAs a request may name in its ``lora`` input (:mod:`.loras`; an artifact compiled
            with ``--refittable``); ``None`` = no ``lora`` input.
    """

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    max_batch_size: int = 4
    max_queue_delay_s: float = 0.01
    max_queue: int = 64
    queue_timeout_s: float = 60.0
    instances: int = 8
    max_prompt_chars: int = 2000
    max_steps: int = 100
    max_guidance: float = 50.0
    device: str | None = None
    scheduler: str | None = None
    vram_budget: str | int | None = None
    max_connections: int = 128
    lora_dir: str | None = None

    def limits(self) -> dict[str, float]:
        return {"max_prompt_chars": self.max_prompt_chars, "max_steps": self.max_steps,
                "max_guidance": self.max_guidance}

    def max_bytes(self) -> dict[str, int]:
        """The byte bound of each text input, checked before a request reaches this process (UTF-8: <= 4 bytes a
        character; a control image's base64: :data:`.control.MAX_IMAGE_BYTES`)."""
        return {**{name: 4 * self.max_prompt_chars for name in ("prompt", "negative_prompt")},
                control.IMAGE_FIELD: control.MAX_IMAGE_BYTES}

    def front_limits(self, control_images: bool = False) -> FrontLimits:
        """The HTTP front's bounds: a body of at most 64 KiB + 24 bytes per prompt character (two prompts, each
        character at most 12 bytes as JSON: a ``\\uXXXX`` surrogate pair), plus one control image's base64 when the
        artifact has ControlNets, the connection bound, and the longest a request may take in Triton (its queue
        timeout plus an hour to compute)."""
        extra = control.MAX_IMAGE_BYTES + 1024 if control_images else 0
        return FrontLimits(max_body_bytes=65536 + 24 * self.max_prompt_chars + extra,
                           max_connections=self.max_connections, upstream_timeout_s=self.queue_timeout_s + 3600.0)


@dataclass
class _Job:
    params: dict[str, Any]
    future: Future[np.ndarray]

    @property
    def key(self) -> tuple[Any, ...]:
        p = self.params
        cn = p.get("control")
        return (p["height"], p["width"], p["steps"], p["guidance_scale"], p.get("lora"), cn and cn.key)


class MicroBatcher:
    """One thread owning the pipeline: merges compatible requests into batched calls.

    Args:
        pipe: the :class:`EnginePipeline` (used from this thread only: it is not thread-safe).
        max_batch_size: images per call.
        max_delay_s: how long to wait for batch-mates after the first request.
        max_queue: pending requests at most; :meth:`submit` refuses more.
    """

    def __init__(self, pipe: Any, max_batch_size: int, max_delay_s: float, max_queue: int) -> None:
        self.pipe = pipe
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_s
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=max_queue)
        self._held: list[_Job] = []  # taken from the queue but not compatible with the batch being formed
        self._stop = threading.Event()
        self.batches: list[int] = []  # sizes of the calls made (for tests and logs)
        self._lora: tuple[str, float] | None = None  # the LoRA the pipeline has loaded (serve --lora-dir)
        self._thread = threading.Thread(target=self._run, name="diffusion-trt-batcher", daemon=True)
        self._thread.start()

    def submit(self, params: dict[str, Any]) -> Future[np.ndarray]:
        """Queue one validated request; its future gets the uint8 image [H, W, 3].

        Raises:
            StatusError: UNAVAILABLE, the queue is full.
        """
        job = _Job(params, Future())
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            busy = f"server busy: {self._queue.maxsize} requests are waiting for the pipeline; retry later"
            raise StatusError("UNAVAILABLE", busy) from None
        return job.future

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def _next(self, timeout: float) -> _Job | None:
        if self._held:
            return self._held.pop(0)
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            first = self._next(0.1)
            if first is None:
                continue
            batch = [first]
            deadline = time.monotonic() + self.max_delay_s
            held: list[_Job] = []
            while len(batch) < self.max_batch_size:
                left = deadline - time.monotonic()
                job = self._held.pop(0) if self._held else None
                if job is None:
                    if left <= 0:
                        break
                    try:
                        job = self._queue.get(timeout=left)
                    except queue.Empty:
                        break
                (batch if job.key == first.key else held).append(job)
            self._held = held + self._held
            self._call(batch)

    def _call(self, batch: list[_Job]) -> None:
        import torch

        p = batch[0].params
        try:
            self._use_lora(p.get("lora"))
            cn = control.stacked([j.params["control"] for j in batch]) if p.get("control") else {}
            out = self.pipe(
                prompt=[j.params["prompt"] for j in batch],
                negative_prompt=[j.params["negative_prompt"] for j in batch],
                num_inference_steps=p["steps"],
                guidance_scale=p["guidance_scale"],
                generator=[torch.Generator(device="cpu").manual_seed(j.params["seed"]) for j in batch],
                height=p["height"],
                width=p["width"],
                output_type="pil",
                progress=False,
                **cn,
            )
            self.batches.append(len(batch))
            logger.info("ran a batch of %d request(s) at %dx%d, %d steps", len(batch), p["height"], p["width"],
                        p["steps"])
            for job, image in zip(batch, out.images, strict=True):
                job.future.set_result(np.asarray(image, dtype=np.uint8))
        except Exception as e:  # every waiting request must hear about it
            if isinstance(e, (RuntimeInputError, LoraError)):  # the client's error (400, see _image): one line
                logger.warning("refused a batch of %d request(s): %s", len(batch), e)
            else:
                logger.exception("pipeline call of %d request(s) failed", len(batch))
            for job in batch:
                job.future.set_exception(e)


    def _use_lora(self, lora: tuple[str, float] | None) -> None:
        """Load the batch's LoRA (or go back to the base) when it is not the one loaded; a refused LoRA leaves the
        pipeline as it was (``load_lora`` checks everything first)."""
        if lora == self._lora:
            return
        if lora is None:
            self.pipe.unload_lora()
        else:
            self.pipe.load_lora([lora])
        self._lora = lora


def _python_backend_libpath() -> None:
    """Let tritonserver's Python-backend stub load *this* interpreter's libpython.

    The stub links ``libpython3.X.so`` by name; without a hint it may find the system one (Debian's 3.11.2)
    while the standard library comes from this interpreter (3.11.7 under pyenv), and fails inside
    ``multiprocessing`` ("'_thread.RLock' object has no attribute '_recursion_count'").
    """
    libdir, ldlib = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
    if libdir and ldlib and (Path(libdir) / ldlib).exists():
        current = os.environ.get("LD_LIBRARY_PATH", "")
        if libdir not in current.split(os.pathsep):
            os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, current) if p)


def bind_pipeline(triton: Any, pipe: Any, config: ServeConfig) -> MicroBatcher:
    """Bind model :data:`MODEL_NAME` to ``triton`` (a ``pytriton.triton.Triton``); returns the batcher."""
    from pytriton.model_config import ModelConfig, Tensor

    from .loras import FIELD, LoraLibrary

    facts = request_facts(pipe.manifest, config.limits())  # the artifact's defaults (SDXL: guidance 5.0)
    controlnets = control.ControlNets(controlnet_names(list(pipe.manifest.components)))
    library = LoraLibrary(config.lora_dir) if config.lora_dir is not None else None
    if library is not None and not any(e.refit_map for e in pipe.manifest.components.values()):
        raise LoraError("serve --lora-dir: this artifact was compiled without --refittable, so it cannot take a LoRA "
                        "per request; recompile with `diffusion-trt compile MODEL --refittable`")
    cap = int(pipe.profile.batch.max)
    # at most `instances` requests are in this process at once (the rest wait in Triton's bounded queue), so the
    # batcher's own queue never refuses one
    batcher = MicroBatcher(pipe, max(1, min(config.max_batch_size, cap)), config.max_queue_delay_s, config.instances)

    def infer(requests: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        futures = []
        for request in requests:  # unbatched model: one request per call
            try:
                data = {name: request.data.get(name) for name in request.data}
                lora = library.resolve(data.pop(FIELD, None)) if library is not None else None
                cn_inputs = {k: data.pop(k) for k in control.FIELDS if k in data} if controlnets.names else {}
                params = parse_request(data, facts)
                params.update(lora=lora, control=controlnets.resolve(cn_inputs, params["height"], params["width"]))
            except RequestError as e:  # 400 / INVALID_ARGUMENT, this line only (pytriton_proxy)
                raise StatusError("INVALID_ARG", str(e)) from None
            futures.append(batcher.submit(params))
        return [{"image": _image(f)} for f in futures]

    dtypes = {"BYTES": bytes, "INT64": np.int64, "INT32": np.int32, "FP32": np.float32}
    inputs = [Tensor(name=name, dtype=dtypes[t], shape=(1,), optional=True)
              for name, (_kinds, t) in triton_model.FIELDS.items()]
    if library is not None:
        inputs.append(Tensor(name=FIELD, dtype=bytes, shape=(1,), optional=True))
    if controlnets.names:
        inputs += [Tensor(name=name, dtype=bytes, shape=(1,), optional=True) for name in control.FIELDS]
    triton.bind(
        model_name=MODEL_NAME,
        infer_func=[infer] * config.instances,
        inputs=inputs,
        outputs=[Tensor(name="image", dtype=np.uint8, shape=(-1, -1, 3))],
        config=ModelConfig(batching=False),
        strict=True,
    )
    return batcher


def _image(future: Future[np.ndarray]) -> np.ndarray:
    """The future's image; a runtime check the request failed (RuntimeInputError) is the client's error (400)."""
    try:
        return future.result()
    except (RuntimeInputError, LoraError) as e:
        raise StatusError("INVALID_ARG", str(e)) from None


def _fronts(config: ServeConfig, http_upstream: int, grpc_upstream: int, control_images: bool = False
            ) -> FrontProcess:
    """The HTTP front on ``config.host:config.http_port`` and the gRPC relay on ``config.grpc_port``, forwarding to
    Triton's endpoints on ``127.0.0.1:http_upstream`` / ``grpc_upstream``, in their own process (see
    :mod:`.front_process`), started and listening; ``control_images``: bodies may carry one (an artifact with
    ControlNets).

    Raises:
        ServeError: a port cannot be bound, or the process did not start.
    """
    settings = FrontSettings.of(config.host, config.http_port, config.grpc_port, http_upstream, grpc_upstream,
                                config.front_limits(control_images))
    try:
        return FrontProcess(settings).__enter__()
    except FrontStartError as e:
        raise ServeError(str(e)) from None


def serve(artifact_dir: str | os.PathLike[str], config: ServeConfig | None = None,
          stop: threading.Event | None = None, on_ready: Callable[[], None] | None = None) -> None:
    """Serve an artifact until SIGINT/SIGTERM (or ``stop`` is set); ``on_ready()`` once the endpoints are up.

    Raises:
        MissingPackageError: PyTriton is not installed (exit 2).
        ServeError: the server cannot start.
        ArtifactError: the artifact fails verification.
    """
    config = config or ServeConfig()
    try:
        from pytriton.triton import Triton, TritonConfig
    except ImportError as e:
        raise MissingPackageError(
            f"serve needs NVIDIA PyTriton ({e}); pip install 'diffusion-trt[serve]' (Linux x86_64/aarch64, "
            "glibc >= 2.35)"
        ) from None
    from ..runtime import EnginePipeline

    _python_backend_libpath()
    stop = stop or threading.Event()
    with contextlib.ExitStack() as stack:
        stack.enter_context(pytriton_proxy.patched(MODEL_NAME, max_bytes=config.max_bytes(),
                                                   max_queue=config.max_queue, timeout_s=config.queue_timeout_s))
        budget = {} if config.vram_budget is None else {"vram_budget": config.vram_budget,
                                                        "vram_request": (None, None, config.max_batch_size)}
        pipe = stack.enter_context(EnginePipeline.from_artifacts(artifact_dir, device=config.device,
                                                                 scheduler=config.scheduler, **budget))
        # Triton's own endpoints, behind the fronts (loopback only); the fronts are bound now: a port in use fails
        # before Triton starts
        upstream_port, grpc_upstream = free_loopback_port(), free_loopback_port()
        has_control = bool(controlnet_names(list(pipe.manifest.components)))
        fronts = _fronts(config, upstream_port, grpc_upstream, has_control)
        stack.callback(fronts.close)
        triton_config = TritonConfig(
            http_address="127.0.0.1", http_port=upstream_port,
            grpc_address="127.0.0.1", grpc_port=grpc_upstream,
            allow_metrics=False, exit_on_error=True, exit_timeout_secs=5,
        )
        triton = stack.enter_context(Triton(config=triton_config))
        batcher = bind_pipeline(triton, pipe, config)
        stack.callback(batcher.close)
        try:
            triton.run()
        except Exception as e:  # PyTritonException and friends: say what failed, once
            where = f"127.0.0.1:{upstream_port} (HTTP) / {grpc_upstream} (gRPC)"
            raise ServeError(f"Triton could not start on {where}: {e}") from e
        stack.callback(fronts.close)  # closed first on the way out (again: idempotent)
        previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
        stack.callback(lambda: [signal.signal(s, h) for s, h in previous.items()])
        logger.info(
            "serving %s as model %r: HTTP %s:%d, gRPC %s:%d (max batch %d)", artifact_dir, MODEL_NAME, config.host,
            config.http_port, config.host, config.grpc_port, batcher.max_batch_size,
        )
        if on_ready is not None:
            on_ready()
        while not stop.wait(0.5):
            if not triton.is_alive():
                raise ServeError("tritonserver exited; see the log above")
            if not fronts.alive():
                raise ServeError("serve's front process exited; see the log above")
        logger.info("stopping")


__all__ = ["MODEL_NAME", "MicroBatcher", "ServeConfig", "ServeError", "bind_pipeline", "serve"]

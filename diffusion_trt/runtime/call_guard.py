"""One call at a time on an :class:`~.pipeline.EnginePipeline`: a second call while one runs is refused at once.

Why refuse rather than queue or run both: a pipeline's engines reuse their input and output buffers from run to run
(ORT io-binding, CUDA graphs, TensorRT contexts), the VAE encoder is opened by the first image call, and the
embedding cache and host buffers are shared; two calls at once on one pipeline read each other's tensors (wrong
images, no error) or find an engine half-opened (``engine 'vae_encoder' is not open``). diffusers' pipelines are not
thread-safe either, and their users share one between threads behind a lock of their own, or load one per thread.
So the second call gets one clear :class:`~diffusion_trt.errors.PipelineBusyError` naming the fix, before it
touches anything; the running call is not disturbed, and the pipeline takes calls again as soon as it returns. A
waiting lock inside the pipeline would hide minutes of queueing behind a plain call and deadlock a callback that
calls its own pipeline.

``diffusion-trt serve`` runs its pipeline from one thread (its micro-batcher), and
:class:`~.parallel.DataParallelPipeline` gives each device's pipeline a thread of its own: neither meets the refusal.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..errors import PipelineBusyError

F = TypeVar("F", bound=Callable[..., Any])


class CallGuard:
    """Who runs a call of one pipeline now; entering it while a call runs raises :class:`PipelineBusyError`.

    Thread-safe (one non-blocking lock); not re-entrant on purpose: a callback that calls its own pipeline is refused
    too, as it would run a second call on the engines of the first.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: tuple[int, str] | None = None  # (thread id, what) of the call in progress

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        """Run ``what`` ("a call", "load_lora()"...) as the only call in progress.

        Raises:
            PipelineBusyError: another call is in progress (its name and thread in the message).
        """
        if not self._lock.acquire(blocking=False):
            raise PipelineBusyError(busy_message(what, self._running))
        self._running = (threading.get_ident(), what)
        try:
            yield
        finally:
            self._running = None
            self._lock.release()

    @property
    def busy(self) -> bool:
        return self._lock.locked()


def busy_message(what: str, running: tuple[int, str] | None) -> str:
    """The refusal: what was refused, what runs and where, and the fix."""
    if running is None:  # the running call ended between our try and this read
        doing, where = "another call", "another thread"
    else:
        doing = running[1]
        where = ("this thread (the running call's callback called the pipeline)" if running[0] == threading.get_ident()
                 else "another thread")
    return (f"EnginePipeline refused {what}: {doing} is running in {where}; a pipeline runs one call at a time "
            "(like diffusers' pipelines, it is not thread-safe): put one threading.Lock around its calls to queue "
            "them, or give each thread its own EnginePipeline")


def one_call_at_a_time(what: str) -> Callable[[F], F]:
    """Decorate a method of a class whose instances keep a :class:`CallGuard` as ``_call_guard``: the method runs
    as ``what`` under it (an instance without one, half-built, runs unguarded)."""
    def decorate(method: F) -> F:
        @functools.wraps(method)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            guard = self.__dict__.get("_call_guard")
            if guard is None:
                return method(self, *args, **kwargs)
            with guard(what):
                return method(self, *args, **kwargs)

        return guarded  # type: ignore[return-value]

    return decorate


__all__ = ["CallGuard", "busy_message", "one_call_at_a_time"]

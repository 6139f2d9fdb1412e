"""The process-wide lock that keeps CUDA work of other threads out of a CUDA-graph capture: shared for work that
merely must not overlap a capture, exclusive for the capture itself.

Why (issue 28): ONNX Runtime captures in ``cudaStreamCaptureModeGlobal``, where a ``cudaMalloc`` or a synchronous copy
from any other thread breaks the capture ("operation not permitted when stream is capturing", seen on the H200). A
plain mutex around every session creation, warm-up run and capture kept captures safe but also made the loads take
turns: on the H200 the SD-1.5 engines' session creations and first runs (UNet 1.4 + 1.0 s, text encoder 0.4 + 0.3 s,
VAE decoder 0.1 + 0.2 s) then added up on the critical path of ``from_artifacts``, although none of them captures.
They may overlap each other; only a capture (milliseconds) must be alone. So session creation and uncaptured runs
hold the lock **shared** and the capturing runs hold it **exclusive**.

Reentrant per thread: a thread holding it exclusive may take it again either way; a thread holding it shared may
take it shared again even while a capture waits (a waiting capture blocks only new readers, so captures are not
starved). A thread that holds it shared and asks for it exclusive waits only for the other threads' shares.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class CaptureLock:
    """A readers-writer lock, reentrant per thread, preferring the writer (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._shares: dict[int, int] = {}  # thread id -> how many times it holds the lock shared
        self._owner: int | None = None  # the thread holding it exclusive
        self._depth = 0  # how many times the owner holds it exclusive
        self._writers_waiting = 0

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        """Hold the lock shared for the block: no capture runs meanwhile; other shared holders may."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me and me not in self._shares:
                self._cond.wait_for(lambda: self._owner is None and not self._writers_waiting)
            self._shares[me] = self._shares.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._shares[me] -= 1
                if not self._shares[me]:
                    del self._shares[me]
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the lock alone for the block: no other thread holds it in any way meanwhile."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                self._writers_waiting += 1
                try:
                    self._cond.wait_for(lambda: self._owner is None and set(self._shares) <= {me})
                finally:
                    self._writers_waiting -= 1
                self._owner = me
            self._depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                self._cond.notify_all()

    def held_by_others(self) -> bool:
        """Whether another thread holds the lock (for tests and assertions)."""
        me = threading.get_ident()
        with self._cond:
            return (self._owner not in (None, me)) or bool(set(self._shares) - {me})


#: The one lock of the process: CUDA session creation and uncaptured runs hold it shared, CUDA-graph captures (and
#: the runs before them, which allocate the graph's buffers) exclusive.
CAPTURE_LOCK = CaptureLock()


def shared_if(cuda: bool) -> contextlib.AbstractContextManager[None]:
    """:meth:`CaptureLock.shared` of :data:`CAPTURE_LOCK` on CUDA, else nothing."""
    return CAPTURE_LOCK.shared() if cuda else contextlib.nullcontext()


def exclusive_if(capturing: bool) -> contextlib.AbstractContextManager[None]:
    """:meth:`CaptureLock.exclusive` of :data:`CAPTURE_LOCK` when ``capturing``, else nothing."""
    return CAPTURE_LOCK.exclusive() if capturing else contextlib.nullcontext()

"""CaptureLock (runtime/engines/capture_lock.py): shared holders overlap, an exclusive holder is alone, both are
reentrant per thread, and a waiting capture is not starved by a stream of new shared holders."""

from __future__ import annotations

import threading
import time

from diffusion_trt.runtime.engines.capture_lock import CaptureLock

WAIT_S = 5.0


def test_shared_holders_overlap() -> None:
    lock = CaptureLock()
    inside = threading.Barrier(3, timeout=WAIT_S)  # all three inside at once, or the barrier breaks

    def hold() -> None:
        with lock.shared():
            inside.wait()

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    with lock.shared():
        inside.wait()
    for t in threads:
        t.join(WAIT_S)
    assert not inside.broken


def test_exclusive_waits_for_shared_and_blocks_new_shared() -> None:
    lock = CaptureLock()
    events: list[str] = []
    reader_in, release_reader = threading.Event(), threading.Event()

    def reader() -> None:
        with lock.shared():
            reader_in.set()
            release_reader.wait(WAIT_S)
            events.append("reader out")

    def writer() -> None:
        with lock.exclusive():
            events.append("writer in")
            time.sleep(0.05)
            events.append("writer out")

    def late_reader() -> None:
        with lock.shared():
            events.append("late reader in")

    r = threading.Thread(target=reader)
    r.start()
    assert reader_in.wait(WAIT_S)
    w = threading.Thread(target=writer)
    w.start()
    time.sleep(0.05)  # the writer now waits for the reader
    late = threading.Thread(target=late_reader)
    late.start()
    time.sleep(0.05)  # a waiting writer keeps new readers out
    assert events == []
    release_reader.set()
    for t in (r, w, late):
        t.join(WAIT_S)
    assert events == ["reader out", "writer in", "writer out", "late reader in"]


def test_reentrant_per_thread() -> None:
    lock = CaptureLock()
    with lock.exclusive(), lock.exclusive(), lock.shared():
        assert not lock.held_by_others()
    with lock.shared(), lock.shared():
        pass
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(lock.held_by_others()))
    with lock.shared():
        t.start()
        t.join(WAIT_S)
    assert seen == [True]
    with lock.exclusive():  # everything was released: a fresh exclusive hold does not wait
        pass


def test_a_reader_that_holds_it_passes_a_waiting_writer() -> None:
    """A thread already holding the lock shared takes it shared again while a capture waits (no deadlock)."""
    lock = CaptureLock()
    done = threading.Event()
    writer_waiting = threading.Event()

    def writer() -> None:
        writer_waiting.set()
        with lock.exclusive():
            pass

    with lock.shared():
        w = threading.Thread(target=writer)
        w.start()
        writer_waiting.wait(WAIT_S)
        time.sleep(0.05)
        with lock.shared():
            done.set()
    w.join(WAIT_S)
    assert done.is_set() and not w.is_alive()

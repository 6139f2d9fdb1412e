"""Clocks: median stage times from CUDA events (GPU time) on CUDA or ``perf_counter`` on the CPU; NVTX ranges."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .result import Run


class Clock:
    """Median timings: CUDA events on the current stream (GPU time) on CUDA, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        #: [min, median, max] of the last :meth:`stage_ms` call.
        self.last_spread: list[float] = []

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def stage_ms(self, fn: Callable[[], Any], iters: int, warmup: int) -> float:
        """Median milliseconds of ``fn()`` over ``iters`` calls after ``warmup`` calls."""
        for _ in range(warmup):
            fn()
        self.sync()
        times: list[float] = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(float(start.elapsed_time(end)))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        self.last_spread = spread(times)
        return statistics.median(times)

    def wall_s(self, fn: Callable[[], Any], iters: int, warmup: int) -> list[float]:
        """Wall-clock seconds of ``iters`` whole calls (device synchronised around each), after ``warmup``."""
        for _ in range(warmup):
            fn()
        out: list[float] = []
        for _ in range(iters):
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            out.append(time.perf_counter() - t0)
        return out


def spread(samples: Sequence[float]) -> list[float]:
    """[min, median, max] of ``samples``."""
    return [min(samples), statistics.median(samples), max(samples)]


def time_stage(run: Run, clock: Clock, stage: str, fn: Callable[[], Any], iters: int, warmup: int) -> None:
    """Median and spread of one stage into ``run``."""
    run.stages_ms[stage] = clock.stage_ms(fn, iters, warmup)
    run.stages_spread_ms[stage] = clock.last_spread



@contextlib.contextmanager
def nvtx(name: str, device: torch.device) -> Iterator[None]:
    """An NVTX range ``name`` (visible in Nsight Systems) on CUDA; nothing on the CPU."""
    from ..runtime.cuda import nvtx_range

    with nvtx_range(name, device):
        yield

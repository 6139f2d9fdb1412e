"""Peak device memory per pipeline stage, measured with the CUDA driver (what ONNX Runtime's arena holds too).

``torch.cuda.max_memory_allocated`` sees only torch's caching allocator, not ONNX Runtime's arena nor TensorRT's
weights, so the figures here come from the driver: ``torch.cuda.mem_get_info`` (``cudaMemGetInfo``: the device's
used memory, every process and allocator included), or NVML (``pynvml``, when installed: this process's own
usage). The meter is a hook of the stage context the loop enters (:class:`~.stages.StageHook`; no engine is
wrapped): figures are read

* when a stage is entered (after the other stages' engines were released: the end of the previous stage), after
  its engines open, and when the loop leaves it (ORT's arena keeps what a run allocated, TensorRT's activation
  buffer is persistent, torch caches what it freed: the used figure after the stage's last run is its runs' peak
  for these), and
* by a background thread every ``interval_s`` while the stage runs (transient allocations freed before a run
  returns; off with ``interval_s=None``).

Each figure is the peak in bytes of device memory in use during the stage. ``baseline`` is what was in use when
the meter started (the CUDA context, other processes); ``above_baseline`` subtracts it.
"""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

import torch

from .stages import Stages

logger = logging.getLogger(__name__)


def device_used(device: torch.device) -> int:
    """Bytes in use on ``device`` now (``total - free`` from ``cudaMemGetInfo``); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free)


class StageMemoryMeter:
    """Peak device bytes per stage ("load", "text", "unet", "vae") of the stages entered inside :meth:`watch`.

    Args:
        device: the CUDA device (off CUDA everything reads 0 and ``source`` says so).
        interval_s: background sampling period, seconds; ``None`` = only as stages are entered, opened and left.

    Attributes:
        peaks: stage -> peak bytes in use on the device; baseline: bytes in use at start.
        source: how the figures were read ("cudaMemGetInfo (torch.cuda.mem_get_info)", or "not measured (CPU)").
    """

    def __init__(self, device: torch.device, interval_s: float | None = 0.002) -> None:
        self.device = device
        self.interval_s = interval_s
        self.stage = "load"
        self.peaks: dict[str, int] = {}
        self.baseline = device_used(device)
        self.source = "cudaMemGetInfo (torch.cuda.mem_get_info)" if device.type == "cuda" else "not measured (CPU)"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def sample(self, stage: str | None = None) -> None:
        """Record the memory in use now against ``stage`` (default the current one)."""
        used = device_used(self.device)
        with self._lock:
            key = stage or self.stage
            self.peaks[key] = max(self.peaks.get(key, 0), used)

    def _loop(self) -> None:
        assert self.interval_s is not None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        while not self._stop.wait(self.interval_s):
            self.sample()

    def stage_entered(self, stage: str) -> None:
        """:class:`~.stages.StageHook`: switch to ``stage``, closing the previous one with a reading."""
        if self.stage != stage:
            self.sample()  # the end of the previous stage
            self.stage = stage

    def stage_opened(self, stage: str) -> None:
        """:class:`~.stages.StageHook`: the stage's engines are open."""
        self.sample()

    def stage_left(self, stage: str) -> None:
        """:class:`~.stages.StageHook`: the stage's last engine run returned."""
        self.sample()

    @contextlib.contextmanager
    def watch(self, stages: Stages) -> Iterator[StageMemoryMeter]:
        """Meter every stage the loop enters on ``stages`` (a pipeline's :attr:`~..pipeline.EnginePipeline.stages`)
        while the block runs: the meter is one of its hooks until the block ends."""
        stages.hooks.append(self)
        if self.interval_s is not None and self.device.type == "cuda":
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="stage-memory-meter", daemon=True)
            self._thread.start()
        try:
            yield self
        finally:
            if self._thread is not None:
                self._stop.set()
                self._thread.join()
                self._thread = None
            stages.hooks.remove(self)

    def peaks_mib(self, above_baseline: bool = False) -> dict[str, float | None]:
        """Peak MiB per stage ("text", "unet", "vae"); ``None`` off CUDA or for a stage that did not run."""
        if self.device.type != "cuda":
            return dict.fromkeys(("text", "unet", "vae"))
        base = self.baseline if above_baseline else 0
        return {s: ((self.peaks[s] - base) / 2**20 if s in self.peaks else None) for s in ("text", "unet", "vae")}

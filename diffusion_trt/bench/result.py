"""The rows of a bench result: :class:`Run` per (system, batch size, size), the first-call rows, and the speedups.

The JSON layout is ``diffusion_trt/data/bench_result.schema.json`` (:func:`~.schema.validate_result`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .clock import spread

SCHEMA = "diffusion-trt/bench/1"
SYSTEMS: tuple[str, ...] = ("ours", "ours_multi_gpu", "ours_vram_budget", "diffusers_eager", "diffusers_cuda_graph")
#: Stages of the per-stage peak memory (``stage_memory_mb``), see :mod:`diffusion_trt.runtime.memory.memory_meter`.
MEMORY_STAGES: tuple[str, ...] = ("text", "unet", "vae")
STAGES: tuple[str, ...] = ("text_encoder", "unet_step", "vae_decode", "scheduler_glue")


@dataclass
class Run:
    """One (system, batch size) row of the result; see the module docstring for the fields."""

    system: str
    batch_size: int
    height: int | None = None
    width: int | None = None
    status: str = "ok"
    reason: str | None = None
    stage_batch: int | None = None
    stages_ms: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(STAGES))
    e2e_s: float | None = None
    e2e_samples_s: list[float] = field(default_factory=list)
    s_per_image: float | None = None
    images_per_s: float | None = None
    memory_mb: dict[str, float | None] = field(
        default_factory=lambda: dict.fromkeys(("torch_peak_allocated", "torch_peak_reserved", "device_used"))
    )
    stages_spread_ms: dict[str, list[float] | None] = field(default_factory=lambda: dict.fromkeys(STAGES))
    e2e_spread_s: list[float] | None = None
    stage_sum_s: float | None = None
    stage_sum_ratio: float | None = None
    stage_memory_mb: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(MEMORY_STAGES))
    vram_plan: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)



def finish_e2e(run: Run, samples: list[float]) -> None:
    """The end-to-end figures of ``run`` from its wall-clock ``samples`` (seconds per call)."""
    run.e2e_samples_s = samples
    run.e2e_spread_s = spread(samples)
    run.e2e_s = statistics.median(samples)
    run.s_per_image = run.e2e_s / run.batch_size
    run.images_per_s = run.batch_size / run.e2e_s


def first_call_row(system: str, run: Run, cold: float, following: Sequence[float] = ()) -> dict[str, Any]:
    """A ``first_calls`` row: the cold call at ``run``'s shape next to its warm end to end; with ``following`` (the
    calls timed right after it, seconds), those too and ``overhead_total_s``: every one of these calls' time over the
    warm end to end, summed."""
    warm = run.e2e_s
    row = {"system": system, "batch_size": run.batch_size, "height": run.height, "width": run.width,
           "first_call_s": cold, "warm_e2e_s": warm, "overhead_s": (cold - warm) if warm is not None else None}
    if following:
        row["next_calls_s"] = list(following)
        row["overhead_total_s"] = (cold + sum(following) - warm * (1 + len(following))) if warm is not None else None
    return row


def ratios(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Speedups (baseline time / system time) of ``ours`` and ``ours_multi_gpu`` against every other ok run."""
    by_key = {(r.system, r.batch_size, r.height, r.width): r for r in runs if r.status == "ok"}
    pairs = [
        ("ours", "diffusers_eager"),
        ("ours", "diffusers_cuda_graph"),
        ("ours_multi_gpu", "ours"),
        ("ours_multi_gpu", "diffusers_eager"),
        ("ours_vram_budget", "ours"),
        ("diffusers_cuda_graph", "diffusers_eager"),
    ]
    out: list[dict[str, Any]] = []
    for batch, height, width in dict.fromkeys((r.batch_size, r.height, r.width) for r in runs):
        for system, baseline in pairs:
            mine, base = by_key.get((system, batch, height, width)), by_key.get((baseline, batch, height, width))
            if mine is None or base is None:
                continue
            stage = {}
            for s in STAGES:
                a, b = base.stages_ms.get(s), mine.stages_ms.get(s)
                stage[s] = (a / b) if a and b else None
            e2e = (base.e2e_s / mine.e2e_s) if base.e2e_s and mine.e2e_s else None
            out.append(
                {
                    "batch_size": batch,
                    "height": height,
                    "width": width,
                    "system": system,
                    "baseline": baseline,
                    "e2e_speedup": e2e,
                    "stage_speedup": stage,
                }
            )
    return out


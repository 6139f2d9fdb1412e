"""Our systems: ``ours`` (:class:`~diffusion_trt.runtime.pipeline.EnginePipeline`, stages and end to end),
``ours_vram_budget`` (the same under ``vram_budget=``) and ``ours_multi_gpu``
(:class:`~diffusion_trt.runtime.parallel.DataParallelPipeline`); the first call per size and the repeatability check.

Ours run each stage at the chunk size the pipeline uses (``stage_batch``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import RuntimeInputError
from .clock import Clock, nvtx, time_stage
from .config import BenchConfig, call_kwargs
from .glue import glue_ms
from .memory import free_memory, memory_read, memory_start
from .result import Run, finish_e2e

if TYPE_CHECKING:
    from ..runtime.engines.buckets import BucketTimings


def bench_ours(pipe: Any, cfg: BenchConfig, clock: Clock, batch: int, height: int, width: int) -> Run:
    """Stages and end to end of one :class:`EnginePipeline` at ``batch`` images per call."""
    from ..runtime import text_embeddings
    from ..runtime.batching import plan_chunks

    run = Run("ours", batch, height=height, width=width)
    device = pipe.device
    run.stage_batch = chunk = len(plan_chunks(batch, pipe.profile.batch.min, pipe.profile.batch.max)[0])
    te, unet, vae = pipe.engines["text_encoder"], pipe.engines["unet"], pipe.engines["vae_decoder"]
    text_dtype = unet.spec.input("encoder_hidden_states").torch_dtype
    feeds, z, noise = _stage_inputs(pipe, cfg.seed, chunk, height, width)
    n, warm = cfg.stage_iters, max(1, cfg.warmup)
    with nvtx(f"bench ours b={batch} stages", device):
        time_stage(run, clock, "text_encoder",
                   lambda: text_embeddings.encode_prompt(te, pipe.tokenizer, [cfg.prompt], [cfg.negative_prompt], 1,
                                                         text_dtype), n, warm)
        time_stage(run, clock, "unet_step", lambda: unet.run(feeds), n, warm)
        time_stage(run, clock, "vae_decode", lambda: vae.run({"latent_sample": z}), n, warm)
        run.stages_ms["scheduler_glue"] = glue_ms(
            clock, pipe.scheduler, feeds["sample"][:chunk], noise, cfg.guidance_scale, cfg.steps, True, 1,
            min(1, warm)
        )
    kwargs = call_kwargs(cfg, height, width, batch)
    with nvtx(f"bench ours b={batch} e2e", device):
        samples = clock.wall_s(
            lambda: pipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed), progress=False),
            cfg.iters,
            cfg.warmup,
        )
    finish_e2e(run, samples)
    return run


def _stage_inputs(pipe: Any, seed: int, chunk: int, height: int, width: int
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Seeded random inputs of the stage timings at ``chunk`` images: the UNet feeds (CFG batch 2 x chunk, timestep
    500, 77 tokens), VAE latents [chunk, C, h, w] and a noise prediction [2 x chunk, C, h, w], in the engines'
    dtypes on the pipeline's device."""
    unet, vae = pipe.engines["unet"], pipe.engines["vae_decoder"]
    device = pipe.device
    sample_dtype = unet.spec.input("sample").torch_dtype
    text_dtype = unet.spec.input("encoder_hidden_states").torch_dtype
    h, w = height // pipe.vae_scale_factor, width // pipe.vae_scale_factor
    c, hidden = pipe.num_channels_latents, int(unet.spec.input("encoder_hidden_states").shape[2])
    g = torch.Generator().manual_seed(seed)
    feeds = {
        "sample": torch.randn(2 * chunk, c, h, w, generator=g).to(device, sample_dtype),
        "timestep": torch.full((2 * chunk,), 500.0, device=device),
        "encoder_hidden_states": torch.randn(2 * chunk, 77, hidden, generator=g).to(device, text_dtype),
    }
    z = torch.randn(chunk, c, h, w, generator=g).to(device, vae.spec.input("latent_sample").torch_dtype)
    noise = torch.randn(2 * chunk, c, h, w, generator=g).to(device, sample_dtype)
    return feeds, z, noise


def stage_memory(pipe: Any, cfg: BenchConfig, batch: int, height: int, width: int) -> dict[str, float | None]:
    """Peak device MiB per stage of one untimed call
    (:class:`~diffusion_trt.runtime.memory.memory_meter.StageMemoryMeter`); ``None`` values off CUDA."""
    from ..runtime.memory.memory_meter import StageMemoryMeter

    meter = StageMemoryMeter(pipe.device)
    with meter.watch(pipe.stages):
        pipe(**call_kwargs(cfg, height, width, batch), generator=torch.Generator().manual_seed(cfg.seed),
             progress=False)
    return meter.peaks_mib()


def bench_budget(cfg: BenchConfig, clock: Clock, device_kind: str, device_id: int,
                 sizes: Sequence[tuple[int, int]], notes: list[str], say: Callable[[str], None]) -> list[Run]:
    """``ours_vram_budget`` at every size ``(height, width)`` and batch size: a pipeline loaded with ``vram_budget``
    planned for that shape; a budget refused for a shape is that row's ``error``, not an exception."""
    assert cfg.vram_budget is not None
    runs: list[Run] = []
    for height, width in sizes:
        for batch in cfg.batch_sizes:
            say(f"ours_vram_budget {cfg.vram_budget} {height}x{width} b={batch}")
            runs.append(_budget_row(cfg, clock, device_kind, device_id, (height, width, batch), notes))
    return runs


def _budget_row(cfg: BenchConfig, clock: Clock, device_kind: str, device_id: int, shape: tuple[int, int, int],
                notes: list[str]) -> Run:
    """One ``ours_vram_budget`` row at ``shape`` (height, width, batch): end to end, memory, the plan."""
    from ..runtime.batching import plan_chunks
    from ..runtime.pipeline import EnginePipeline

    height, width, batch = shape
    run = Run("ours_vram_budget", batch, height=height, width=width)
    free_memory()
    memory_start([clock.device])
    try:
        pipe = EnginePipeline.from_artifacts(
            cfg.artifact, device=device_kind, scheduler=cfg.scheduler, device_id=device_id,
            cuda_graph=cfg.cuda_graph, vram_budget=cfg.vram_budget, vram_request=shape,
        )
    except RuntimeInputError as e:
        return Run("ours_vram_budget", batch, height=height, width=width, status="error", reason=str(e))
    try:
        assert pipe.residency is not None
        run.vram_plan = pipe.residency.plan.describe()
        run.stage_batch = len(plan_chunks(batch, pipe.profile.batch.min, pipe.profile.batch.max)[0])
        kwargs = call_kwargs(cfg, height, width, batch)

        def call() -> None:
            pipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed), progress=False)

        with nvtx(f"bench ours_vram_budget b={batch} e2e", clock.device):
            samples = clock.wall_s(call, cfg.iters, cfg.warmup)
        finish_e2e(run, samples)
        run.memory_mb = memory_read([clock.device])
        run.stage_memory_mb = stage_memory(pipe, cfg, batch, height, width)
        opens = {n: s.opens for n, s in pipe.residency.staged.items()}
        notes.append(f"ours_vram_budget {height}x{width} b={batch}: {run.vram_plan}; engine opens over the run: "
                     f"{opens}")
    finally:
        pipe.close()
        free_memory()
    return run


def bench_multi(pipe: Any, cfg: BenchConfig, clock: Clock, batch: int, height: int, width: int) -> Run:
    """End to end of a :class:`DataParallelPipeline` (stages are the single-device ones)."""
    run = Run("ours_multi_gpu", batch, height=height, width=width)
    kwargs = call_kwargs(cfg, height, width, batch)
    kwargs["prompt"] = cfg.prompt

    def call() -> None:
        pipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed))
        for d in pipe.devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    with nvtx(f"bench ours_multi_gpu b={batch} e2e", clock.device):
        samples = clock.wall_s(call, cfg.iters, cfg.warmup)
    finish_e2e(run, samples)
    return run



def first_call_s(pipe: Any, cfg: BenchConfig, clock: Clock, batch: int, height: int, width: int) -> float:
    """Wall-clock seconds of one whole call (PIL out, device synchronised), meant as the first at this shape or one
    of the calls right after it (``run.NEXT_CALLS``)."""
    kwargs = call_kwargs(cfg, height, width, batch)
    clock.sync()
    t0 = time.perf_counter()
    pipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed), progress=False)
    clock.sync()
    return time.perf_counter() - t0


def bucket_timings(pipe: Any) -> dict[str, BucketTimings]:
    """A copy of each size-bucket engine's :class:`~diffusion_trt.runtime.engines.buckets.BucketTimings` so far."""
    return {n: e.timings.copy() for n, e in pipe.engines.items() if hasattr(e, "timings")}


def bucket_parts(before: Mapping[str, BucketTimings], after: Mapping[str, BucketTimings]) -> dict[str, dict[str, Any]]:
    """What each engine's timings gained between two :func:`bucket_timings` (:meth:`BucketTimings.since`), as JSON;
    engines that did nothing left out."""
    from ..runtime.engines.buckets import BucketTimings

    parts = {name: now.since(before.get(name, BucketTimings())).snapshot() for name, now in after.items()}
    return {name: row for name, row in parts.items() if any(row.values())}


def settle_s(pipe: Any) -> float | None:
    """Seconds spent waiting, after a first call, for the static sessions that size-bucket engines create in the
    background (``None`` when no engine has any): the warm figures that follow are then the static sessions'."""
    engines = [e for e in pipe.engines.values() if hasattr(e, "settle")]
    return sum(e.settle() for e in engines) if engines else None


def repeat_check(pipe: Any, cfg: BenchConfig, batch: int, height: int, width: int) -> dict[str, Any]:
    """Two identical calls (same seed, float images): their largest absolute difference."""
    kwargs = {**call_kwargs(cfg, height, width, batch), "output_type": "np"}
    a, b = (pipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed), progress=False).images
            for _ in range(2))
    diff = float(abs(a.astype("float64") - b.astype("float64")).max())
    return {"system": "ours", "batch_size": batch, "height": height, "width": width, "max_abs_diff": diff,
            "identical": diff == 0.0}


"""``diffusion-trt bench``: our engines next to diffusers, in one process, on the same weights, seed and scheduler.

Systems (each at every ``--batch-size``):

* ``ours``: :class:`~diffusion_trt.runtime.pipeline.EnginePipeline` on the artifact (one device);
* ``ours_multi_gpu``: :class:`~diffusion_trt.runtime.parallel.DataParallelPipeline` over ``--devices``
  (only with two or more devices), the batch split across them;
* ``ours_vram_budget``: ``EnginePipeline`` with ``vram_budget=`` (``--vram-budget``; only when given): its plan
  (``vram_plan``), end to end and per-stage peak memory, next to ``ours`` (the ratio ``ours_vram_budget`` vs
  ``ours`` is what the budget costs: < 1 = slower);
* ``diffusers_eager``: ``StableDiffusionPipeline`` from the source folder in the artifact's precision (fp16
  artifacts: fp16 on CUDA; always fp32 on the CPU), its default attention processor (SDPA);
* ``diffusers_cuda_graph``: the same with the UNet call captured once per input shape in a
  ``torch.cuda.CUDAGraph`` and replayed (CUDA only).

What is measured, per (system, batch size):

* stages, median of ``stage_iters`` after ``warmup`` calls, **GPU time from CUDA events** on CUDA, wall clock
  on the CPU: ``text_encoder`` = encoding the prompt and the negative prompt incl. tokenisation (ours without
  the embedding cache), ``unet_step`` = one UNet call on the CFG batch, ``vae_decode`` = one VAE decode,
  ``scheduler_glue`` = per step: CFG concat, ``scale_model_input``, CFG combine, ``scheduler.step`` (no UNet);
  ours run each stage at the chunk size the pipeline uses (``stage_batch``), diffusers at the full batch;
* end to end: median wall clock of ``iters`` whole calls (PIL images out, host synchronised), after ``warmup``;
  ``s_per_image`` and ``images_per_s`` from it;
* peak memory: ``torch.cuda.max_memory_allocated``/``max_memory_reserved`` (torch's allocator only: our IO
  buffers and latents, all of diffusers) and the device's used memory after the run from
  ``torch.cuda.mem_get_info`` (includes ONNX Runtime's arena, which torch cannot see, the CUDA context and
  anything else on the device; process-wide, so later systems include what earlier ones left cached);
* peak memory per stage (ours, ours_vram_budget): ``stage_memory_mb`` {"text", "unet", "vae"}: the device's used
  memory (``cudaMemGetInfo``) sampled after every engine open and run and every 2 ms in a thread during one extra,
  untimed call (:class:`~diffusion_trt.runtime.memory_meter.StageMemoryMeter`); whole device, CUDA context included.

NVTX ranges (``bench <system> b=<n> <what>``, and the runtime's own ``text_encoder``/``unet``/``scheduler``/
``vae_decode`` ranges) make every stage visible in Nsight Systems.

JSON schema (``schema`` = :data:`SCHEMA`; :func:`validate_result` checks it)::

    {
      "schema": "diffusion-trt/bench/1",
      "env":    {"device": "cuda"|"cpu", "gpu": str|null, "gpu_count": int, "timing": "cuda_events"|"wall_clock",
                 "torch": str, "onnxruntime": str, "diffusers": str, "python": str},
      "config": {"artifact": str, "model_dir": str|null, "backend": str, "precision": str, "profile": {...},
                 "steps": int, "height": int, "width": int, "guidance_scale": float, "seed": int,
                 "scheduler": str, "batch_sizes": [int], "devices": [int], "iters": int, "warmup": int,
                 "stage_iters": int, "baseline": "diffusers"|"none", "cuda_graph": bool|null},
      "runs":   [{"system": str, "batch_size": int, "status": "ok"|"skipped"|"error", "reason": str|null,
                  "stage_batch": int|null,
                  "stages_ms": {"text_encoder": float|null, "unet_step": float|null, "vae_decode": float|null,
                                "scheduler_glue": float|null},
                  "e2e_s": float|null, "e2e_samples_s": [float], "s_per_image": float|null,
                  "images_per_s": float|null,
                  "memory_mb": {"torch_peak_allocated": float|null, "torch_peak_reserved": float|null,
                                "device_used": float|null},
                  "stage_memory_mb": {"text": float|null, "unet": float|null, "vae": float|null},
                  "vram_plan": str|null}],
      "ratios": [{"batch_size": int, "system": str, "baseline": str, "e2e_speedup": float|null,
                  "stage_speedup": {stage: float|null}}],
      "notes":  [str]
    }

Optional keys (added with issue 19; results without them still validate): ``config.sizes`` ([[h, w]]: every
size measured, in order; rows then carry ``height``/``width``), ``config.cudnn_conv_algo_search``,
``config.deterministic``, ``config.size_buckets``; ``load_s`` (seconds to open our artifact); ``first_calls``
(``[{"system", "batch_size", "height", "width", "first_call_s", "warm_e2e_s", "overhead_s"}]``: the first call at
each size and batch, before any other work at that shape, timed on the wall clock: cuDNN's algorithm search, ORT's
per-shape set-up, a size bucket's session creation and CUDA-graph capture all land in it; the first size also pays
the process's lazy CUDA initialisation); ``repeatability`` (``[{"system", "batch_size", "height", "width",
"max_abs_diff", "identical"}]``: two identical calls, same seed, float images in [0, 1], at the first batch size).

Speedups are ``baseline time / system time`` (> 1: the system is faster); ``ours_multi_gpu`` is also compared
with ``ours`` (its ``e2e_speedup`` is then the multi-GPU scaling factor).

Trust checks (each run also carries, optionally in the schema, ``stages_spread_ms`` {stage: [min, median, max]},
``e2e_spread_s`` [min, median, max], ``stage_sum_s`` and ``stage_sum_ratio``):

* spread: a stage or end-to-end figure whose slowest sample is more than :data:`WIDE_SPREAD` (1.5x) its fastest is
  reported on a ``warning`` line and in ``notes`` (a busy machine: its medians are not to be trusted);
* stage sums: ``stage_sum_s`` = text encoder + chunks x (steps x (UNet step + glue) + VAE decode), what the stages
  predict for one call. More than :data:`STAGES_OVER_E2E` (1.25x) the measured end to end contradicts it (a stage
  figure is inflated, or the runs saw different machine loads): a warning. Under :data:`STAGES_UNDER_E2E` (0.5x) is
  a note (time outside the measured stages: tokenizer, image conversion, host copies, small-model overheads).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import ModelFolderError, RuntimeInputError

logger = logging.getLogger(__name__)

#: A figure whose slowest sample is more than this times its fastest is warned about (the median is unreliable).
WIDE_SPREAD = 1.5
#: Stage sums above this times the end-to-end figure contradict it (warned).
STAGES_OVER_E2E = 1.25
#: Stage sums below this times the end-to-end figure: a note (unmeasured overheads dominate).
STAGES_UNDER_E2E = 0.5

SCHEMA = "diffusion-trt/bench/1"
SYSTEMS: tuple[str, ...] = ("ours", "ours_multi_gpu", "ours_vram_budget", "diffusers_eager", "diffusers_cuda_graph")
#: Stages of the per-stage peak memory (``stage_memory_mb``), see :mod:`diffusion_trt.runtime.memory_meter`.
MEMORY_STAGES: tuple[str, ...] = ("text", "unet", "vae")
STAGES: tuple[str, ...] = ("text_encoder", "unet_step", "vae_decode", "scheduler_glue")
BASELINES: tuple[str, ...] = ("diffusers", "none")
DEFAULT_PROMPT = "an ink painting of mountains above a river, guohua style"


@dataclass(frozen=True)
class BenchConfig:
    """What ``diffusion-trt bench`` measures.

    Attributes:
        artifact: the compiled artifact folder.
        baseline: "diffusers" (eager and, on CUDA, with a CUDA-graphed UNet) or "none".
        model_dir: the diffusers folder for the baseline; ``None`` = the manifest's ``source.path``.
        device: "cpu" or "cuda"; ``None`` = the artifact's.
        devices: CUDA ordinals; ``ours`` runs on the first, ``ours_multi_gpu`` on all (when two or more).
        steps: denoising steps per image; batch_sizes: images per call, each measured.
        iters / warmup: end-to-end calls timed / run before timing; stage_iters: calls per stage timing.
        height, width: image size; ``None`` = the artifact's default.
        cuda_graph: passed to ``EnginePipeline.from_artifacts`` (``None``: on for static CUDA artifacts).
        runtime_cache_dir: passed to ``EnginePipeline.from_artifacts`` (TensorRT-RTX; ``None``: the user cache).
        vram_budget: also run ``ours_vram_budget`` under this budget ("4GB", bytes); ``None`` = not.
        sizes: image sizes ``(height, width)`` to measure, each with one cold call first; ``()`` = ``height``/``width``.
        cudnn_conv_algo_search, deterministic, size_buckets: passed to ``EnginePipeline.from_artifacts``.
    """

    artifact: Path
    baseline: str = "diffusers"
    model_dir: Path | None = None
    device: str | None = None
    devices: tuple[int, ...] = ()
    steps: int = 50
    batch_sizes: tuple[int, ...] = (1,)
    iters: int = 3
    warmup: int = 1
    stage_iters: int = 20
    height: int | None = None
    width: int | None = None
    prompt: str = DEFAULT_PROMPT
    negative_prompt: str = ""
    guidance_scale: float = 7.5
    seed: int = 0
    scheduler: str | None = None
    cuda_graph: bool | None = None
    runtime_cache_dir: Path | None = None
    vram_budget: str | None = None
    sizes: tuple[tuple[int, int], ...] = ()
    cudnn_conv_algo_search: str = "EXHAUSTIVE"
    deterministic: bool = False
    size_buckets: str | None = None

    def __post_init__(self) -> None:
        from .runtime.buckets import parse_size_buckets
        from .runtime.ort_engine import CONV_ALGO_SEARCH

        if self.cudnn_conv_algo_search not in CONV_ALGO_SEARCH:
            raise RuntimeInputError(
                f"cudnn_conv_algo_search={self.cudnn_conv_algo_search!r} is unknown; use one of "
                f"{', '.join(CONV_ALGO_SEARCH)}"
            )
        if any(h < 1 or w < 1 for h, w in self.sizes):
            raise RuntimeInputError(f"sizes {list(self.sizes)} must be positive (height, width) pairs, e.g. 512x512")
        parse_size_buckets(self.size_buckets)  # a malformed list fails before the artifact loads
        if self.baseline not in BASELINES:
            raise RuntimeInputError(f"baseline={self.baseline!r} is unknown; use one of {', '.join(BASELINES)}")
        for name in ("steps", "iters", "stage_iters"):
            if getattr(self, name) < 1:
                raise RuntimeInputError(f"{name}={getattr(self, name)} must be >= 1")
        if self.warmup < 0:
            raise RuntimeInputError(f"warmup={self.warmup} must be >= 0")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise RuntimeInputError(f"batch sizes {list(self.batch_sizes)} must be integers >= 1, e.g. 1,4")


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


# -- timing ------------------------------------------------------------------------------------------------


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


def trust_notes(run: Run, steps: int) -> list[str]:
    """Fill ``run``'s stage sum; one line per figure too noisy (:data:`WIDE_SPREAD`) or contradicting the end to end
    (:data:`STAGES_OVER_E2E`), prefixed "warning:", and a note when the stages explain little of it."""
    out = []
    label = f"{run.system} b={run.batch_size}"
    figures = {f"{k} ms": v for k, v in run.stages_spread_ms.items() if v}
    if run.e2e_spread_s:
        figures["end to end s"] = run.e2e_spread_s
    for name, (lo, med, hi) in figures.items():
        if lo > 0 and hi / lo > WIDE_SPREAD:
            out.append(f"warning: {label} {name.rsplit(' ', 1)[0]} varied {lo:.4g}..{hi:.4g} {name.rsplit(' ', 1)[1]} "
                       f"(median {med:.4g}; slowest/fastest x{hi / lo:.1f} > x{WIDE_SPREAD}): the machine is busy, "
                       "this figure is unreliable; rerun on an idle machine or with more --iters/--stage-iters")
    st = run.stages_ms
    if run.e2e_s and all(st.get(k) is not None for k in STAGES):
        chunks = -(-run.batch_size // (run.stage_batch or run.batch_size))
        total_ms = st["text_encoder"] + chunks * (steps * (st["unet_step"] + st["scheduler_glue"]) + st["vae_decode"])
        run.stage_sum_s = total_ms / 1e3
        run.stage_sum_ratio = run.stage_sum_s / run.e2e_s
        if run.stage_sum_ratio > STAGES_OVER_E2E:
            out.append(f"warning: {label}: the stages add up to {run.stage_sum_s:.3f} s, x{run.stage_sum_ratio:.2f} "
                       f"the measured end to end {run.e2e_s:.3f} s (> x{STAGES_OVER_E2E}): the figures contradict each "
                       "other (a busy machine between the two measurements?); rerun before quoting either")
        elif run.stage_sum_ratio < STAGES_UNDER_E2E:
            out.append(f"{label}: the stages explain {100 * run.stage_sum_ratio:.0f}% of the end to end "
                       f"{run.e2e_s:.3f} s (tokenizer, image conversion, host copies and call overheads are outside "
                       "them)")
    return out


@contextlib.contextmanager
def nvtx(name: str, device: torch.device) -> Iterator[None]:
    from .runtime.cuda import nvtx_range

    with nvtx_range(name, device):
        yield


def _memory_start(devices: Sequence[torch.device]) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.init()  # the allocator of a device is created lazily; resetting it before raises
            with torch.cuda.device(d):
                torch.empty(1, device=d)  # make sure this device's allocator exists
            torch.cuda.reset_peak_memory_stats(d)


def _memory_read(devices: Sequence[torch.device]) -> dict[str, float | None]:
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return {"torch_peak_allocated": None, "torch_peak_reserved": None, "device_used": None}
    mib = 1024.0**2
    used = 0.0
    for d in cuda:
        free, total = torch.cuda.mem_get_info(d)
        used += total - free
    return {
        "torch_peak_allocated": sum(torch.cuda.max_memory_allocated(d) for d in cuda) / mib,
        "torch_peak_reserved": sum(torch.cuda.max_memory_reserved(d) for d in cuda) / mib,
        "device_used": used / mib,
    }


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def glue_ms(
    clock: Clock,
    scheduler: Any,
    latents: torch.Tensor,
    noise_pred: torch.Tensor,
    guidance_scale: float,
    steps: int,
    host_timesteps: bool,
    iters: int,
    warmup: int,
) -> float:
    """Milliseconds per step of the loop without the UNet: CFG concat, scale_model_input, CFG combine, step.

    ``host_timesteps``: hand the scheduler CPU timesteps with a pinned begin index (our loop) or device
    timesteps (diffusers' loop).
    """
    from .runtime import denoise

    def loop() -> None:
        sched = denoise.fresh_scheduler(scheduler)
        sched.set_timesteps(steps, device=latents.device)
        timesteps = denoise.host_timesteps(sched) if host_timesteps else sched.timesteps
        if host_timesteps:
            denoise.pin_begin_index(sched, timesteps)
        x = latents
        for t in timesteps:
            model_in = sched.scale_model_input(torch.cat([x] * 2), t)
            del model_in
            uncond, text = noise_pred.chunk(2)
            x = sched.step(uncond + guidance_scale * (text - uncond), t, x, return_dict=False)[0]

    return clock.stage_ms(loop, iters, warmup) / steps


# -- systems -----------------------------------------------------------------------------------------------


def _call_kwargs(cfg: BenchConfig, height: int, width: int, batch: int) -> dict[str, Any]:
    return {
        "prompt": cfg.prompt,
        "negative_prompt": cfg.negative_prompt,
        "num_inference_steps": cfg.steps,
        "guidance_scale": cfg.guidance_scale,
        "num_images_per_prompt": batch,
        "height": height,
        "width": width,
        "output_type": "pil",
    }


def bench_ours(pipe: Any, cfg: BenchConfig, clock: Clock, batch: int, height: int, width: int) -> Run:
    """Stages and end to end of one :class:`EnginePipeline` at ``batch`` images per call."""
    from .runtime import denoise
    from .runtime.batching import plan_chunks

    run = Run("ours", batch, height=height, width=width)
    device = pipe.device
    b = pipe.profile.batch
    chunk = len(plan_chunks(batch, b.min, b.max)[0])
    run.stage_batch = chunk
    te, unet, vae = pipe.engines["text_encoder"], pipe.engines["unet"], pipe.engines["vae_decoder"]
    sample_dtype = unet.spec.input("sample").torch_dtype
    text_dtype = unet.spec.input("encoder_hidden_states").torch_dtype
    h, w = height // pipe.vae_scale_factor, width // pipe.vae_scale_factor
    g = torch.Generator().manual_seed(cfg.seed)
    c = pipe.num_channels_latents
    hidden = unet.spec.input("encoder_hidden_states").shape[2]
    sample = torch.randn(2 * chunk, c, h, w, generator=g).to(device, sample_dtype)
    feeds = {
        "sample": sample,
        "timestep": torch.full((2 * chunk,), 500.0, device=device),
        "encoder_hidden_states": torch.randn(2 * chunk, 77, int(hidden), generator=g).to(device, text_dtype),
    }
    z = torch.randn(chunk, c, h, w, generator=g).to(device, vae.spec.input("latent_sample").torch_dtype)
    n, warm = cfg.stage_iters, max(1, cfg.warmup)
    with nvtx(f"bench ours b={batch} stages", device):
        time_stage(run, clock, "text_encoder",
                   lambda: denoise.encode_prompt(te, pipe.tokenizer, [cfg.prompt], [cfg.negative_prompt], 1,
                                                 text_dtype), n, warm)
        time_stage(run, clock, "unet_step", lambda: unet.run(feeds), n, warm)
        time_stage(run, clock, "vae_decode", lambda: vae.run({"latent_sample": z}), n, warm)
        noise = torch.randn(2 * chunk, c, h, w, generator=g).to(device, sample_dtype)
        run.stages_ms["scheduler_glue"] = glue_ms(
            clock, pipe.scheduler, sample[:chunk], noise, cfg.guidance_scale, cfg.steps, True, 1, min(1, warm)
        )
    kwargs = _call_kwargs(cfg, height, width, batch)
    with nvtx(f"bench ours b={batch} e2e", device):
        samples = clock.wall_s(
            lambda: pipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed), progress=False),
            cfg.iters,
            cfg.warmup,
        )
    _finish_e2e(run, samples)
    return run


def stage_memory(pipe: Any, cfg: BenchConfig, batch: int, height: int, width: int) -> dict[str, float | None]:
    """Peak device MiB per stage of one untimed call (:class:`~diffusion_trt.runtime.memory_meter.StageMemoryMeter`);
    ``None`` values off CUDA."""
    from .runtime.memory_meter import StageMemoryMeter

    meter = StageMemoryMeter(pipe.device)
    with meter.watch(pipe.engines):
        pipe(**_call_kwargs(cfg, height, width, batch), generator=torch.Generator().manual_seed(cfg.seed),
             progress=False)
    return meter.peaks_mib()


def bench_budget(cfg: BenchConfig, clock: Clock, device_kind: str, device_id: int, height: int, width: int,
                 notes: list[str], say: Callable[[str], None]) -> list[Run]:
    """``ours_vram_budget`` at every batch size: a pipeline loaded with ``vram_budget``; a budget refused for a
    batch is that row's ``error``, not an exception."""
    from .runtime.batching import plan_chunks
    from .runtime.pipeline import EnginePipeline

    assert cfg.vram_budget is not None
    runs: list[Run] = []
    for batch in cfg.batch_sizes:
        say(f"ours_vram_budget {cfg.vram_budget} b={batch}")
        run = Run("ours_vram_budget", batch, height=height, width=width)
        _free_memory()
        _memory_start([clock.device])
        try:
            pipe = EnginePipeline.from_artifacts(
                cfg.artifact, device=device_kind, scheduler=cfg.scheduler, device_id=device_id,
                cuda_graph=cfg.cuda_graph, vram_budget=cfg.vram_budget, vram_request=(height, width, batch),
            )
        except RuntimeInputError as e:
            runs.append(Run("ours_vram_budget", batch, height=height, width=width, status="error", reason=str(e)))
            continue
        try:
            assert pipe.residency is not None
            run.vram_plan = pipe.residency.plan.describe()
            run.stage_batch = len(plan_chunks(batch, pipe.profile.batch.min, pipe.profile.batch.max)[0])
            kwargs = _call_kwargs(cfg, height, width, batch)

            def call(p: Any = pipe, kw: dict[str, Any] = kwargs) -> None:
                p(**kw, generator=torch.Generator().manual_seed(cfg.seed), progress=False)

            with nvtx(f"bench ours_vram_budget b={batch} e2e", clock.device):
                samples = clock.wall_s(call, cfg.iters, cfg.warmup)
            _finish_e2e(run, samples)
            run.memory_mb = _memory_read([clock.device])
            run.stage_memory_mb = stage_memory(pipe, cfg, batch, height, width)
            opens = {n: s.opens for n, s in pipe.residency.staged.items()}
            notes.append(f"ours_vram_budget b={batch}: {run.vram_plan}; engine opens over the run: {opens}")
        finally:
            pipe.close()
            _free_memory()
        runs.append(run)
    return runs


def bench_multi(pipe: Any, cfg: BenchConfig, clock: Clock, batch: int, height: int, width: int) -> Run:
    """End to end of a :class:`DataParallelPipeline` (stages are the single-device ones)."""
    run = Run("ours_multi_gpu", batch, height=height, width=width)
    kwargs = _call_kwargs(cfg, height, width, batch)
    kwargs["prompt"] = cfg.prompt

    def call() -> None:
        pipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed))
        for d in pipe.devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    with nvtx(f"bench ours_multi_gpu b={batch} e2e", clock.device):
        samples = clock.wall_s(call, cfg.iters, cfg.warmup)
    _finish_e2e(run, samples)
    return run


def _finish_e2e(run: Run, samples: list[float]) -> None:
    run.e2e_samples_s = samples
    run.e2e_spread_s = spread(samples)
    run.e2e_s = statistics.median(samples)
    run.s_per_image = run.e2e_s / run.batch_size
    run.images_per_s = run.batch_size / run.e2e_s


def first_call_s(pipe: Any, cfg: BenchConfig, clock: Clock, batch: int, height: int, width: int) -> float:
    """Wall-clock seconds of one whole call (PIL out, device synchronised), meant as the first at this shape."""
    kwargs = _call_kwargs(cfg, height, width, batch)
    clock.sync()
    t0 = time.perf_counter()
    pipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed), progress=False)
    clock.sync()
    return time.perf_counter() - t0


def _first_call_row(system: str, run: Run, cold: float) -> dict[str, Any]:
    warm = run.e2e_s
    return {"system": system, "batch_size": run.batch_size, "height": run.height, "width": run.width,
            "first_call_s": cold, "warm_e2e_s": warm, "overhead_s": (cold - warm) if warm is not None else None}


def repeat_check(pipe: Any, cfg: BenchConfig, batch: int, height: int, width: int) -> dict[str, Any]:
    """Two identical calls (same seed, float images): their largest absolute difference."""
    kwargs = {**_call_kwargs(cfg, height, width, batch), "output_type": "np"}
    a, b = (pipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed), progress=False).images
            for _ in range(2))
    diff = float(abs(a.astype("float64") - b.astype("float64")).max())
    return {"system": "ours", "batch_size": batch, "height": height, "width": width, "max_abs_diff": diff,
            "identical": diff == 0.0}


class GraphedUNet:
    """A diffusers UNet's ``forward`` replaced by CUDA-graph replays, one graph per input shape/dtype.

    Captured on first use of a shape (3 warm-up calls on a side stream, then ``torch.cuda.graph``), all graphs
    sharing one memory pool; calls with extra conditioning (``timestep_cond``, ``added_cond_kwargs``...) run
    eagerly. Returns a clone of the static output (schedulers may keep it). :meth:`remove` restores the UNet.
    """

    def __init__(self, unet: Any) -> None:
        self.unet = unet
        self._eager = unet.forward
        self._graphs: dict[tuple[Any, ...], tuple[Any, dict[str, torch.Tensor], torch.Tensor]] = {}
        self._pool: Any = None
        unet.forward = self  # an instance attribute: nn.Module.__call__ finds it before the class's forward

    def remove(self) -> None:
        if self.unet.__dict__.get("forward") is self:
            del self.unet.forward
        self._graphs.clear()

    def __call__(
        self,
        sample: torch.Tensor,
        timestep: Any,
        encoder_hidden_states: torch.Tensor,
        *args: Any,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        if args or any(v is not None for v in kwargs.values()) or not isinstance(timestep, torch.Tensor):
            return self._eager(sample, timestep, encoder_hidden_states, *args, return_dict=return_dict, **kwargs)
        key = (
            tuple(sample.shape),
            sample.dtype,
            tuple(timestep.shape),
            timestep.dtype,
            tuple(encoder_hidden_states.shape),
            encoder_hidden_states.dtype,
        )
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(key, sample, timestep, encoder_hidden_states)
        graph, static, out = entry
        static["sample"].copy_(sample)
        static["timestep"].copy_(timestep)
        static["encoder_hidden_states"].copy_(encoder_hidden_states)
        graph.replay()
        result = out.clone()
        if return_dict:
            from diffusers.models.unets.unet_2d_condition import UNet2DConditionOutput

            return UNet2DConditionOutput(sample=result)
        return (result,)

    def _capture(
        self, key: tuple[Any, ...], sample: torch.Tensor, timestep: torch.Tensor, ehs: torch.Tensor
    ) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
        static = {"sample": sample.clone(), "timestep": timestep.clone(), "encoder_hidden_states": ehs.clone()}

        def forward() -> torch.Tensor:
            return self._eager(
                static["sample"], static["timestep"], static["encoder_hidden_states"], return_dict=False
            )[0]

        side = torch.cuda.Stream(device=sample.device)
        side.wait_stream(torch.cuda.current_stream(sample.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                forward()
        torch.cuda.current_stream(sample.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward()
        self._pool = graph.pool()
        self._graphs[key] = (graph, static, out)
        logger.debug("captured a CUDA graph of the diffusers UNet for %s", key)
        return self._graphs[key]


def bench_diffusers(
    dpipe: Any, system: str, cfg: BenchConfig, clock: Clock, batch: int, height: int, width: int
) -> Run:
    """Stages and end to end of a diffusers ``StableDiffusionPipeline`` (eager or with a graphed UNet)."""
    run = Run(system, batch, height=height, width=width)
    run.stage_batch = batch
    device = clock.device
    dtype = dpipe.unet.dtype
    c = dpipe.unet.config.in_channels
    h, w = height // dpipe.vae_scale_factor, width // dpipe.vae_scale_factor
    g = torch.Generator().manual_seed(cfg.seed)
    sample = torch.randn(2 * batch, c, h, w, generator=g).to(device, dtype)
    hidden = dpipe.text_encoder.config.hidden_size
    ehs = torch.randn(2 * batch, 77, hidden, generator=g).to(device, dtype)
    dpipe.scheduler.set_timesteps(cfg.steps, device=device)
    t = dpipe.scheduler.timesteps[len(dpipe.scheduler.timesteps) // 2]
    z = torch.randn(batch, c, h, w, generator=g).to(device, dtype)
    n, warm = cfg.stage_iters, max(1, cfg.warmup)
    with torch.no_grad(), nvtx(f"bench {system} b={batch} stages", device):
        time_stage(run, clock, "text_encoder",
                   lambda: dpipe.encode_prompt(cfg.prompt, device, 1, True, cfg.negative_prompt), n, warm)
        time_stage(run, clock, "unet_step", lambda: dpipe.unet(sample, t, ehs, return_dict=False), n, warm)
        time_stage(run, clock, "vae_decode",
                   lambda: dpipe.vae.decode(z / dpipe.vae.config.scaling_factor, return_dict=False), n, warm)
        noise = torch.randn(2 * batch, c, h, w, generator=g).to(device, dtype)
        run.stages_ms["scheduler_glue"] = glue_ms(
            clock, dpipe.scheduler, sample[:batch], noise, cfg.guidance_scale, cfg.steps, False, 1, min(1, warm)
        )
    kwargs = _call_kwargs(cfg, height, width, batch)
    with nvtx(f"bench {system} b={batch} e2e", device):
        samples = clock.wall_s(
            lambda: dpipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed)), cfg.iters, cfg.warmup
        )
    _finish_e2e(run, samples)
    return run


# -- the whole bench ---------------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("onnxruntime", "diffusers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every system at every batch size; return the result dict (schema in the module docstring).

    A system that cannot run here (no CUDA for the graphed baseline, fewer than two devices for multi-GPU,
    a baseline error) is a row with ``status`` "skipped"/"error" and a ``reason``, not an exception.

    Raises:
        ArtifactError / RuntimeInputError: the artifact cannot be loaded or a batch size cannot be run by it.
        ModelFolderError: ``model_dir`` was given for the diffusers baseline but holds no model_index.json.
    """
    from .artifacts import is_inpainting, read_manifest
    from .runtime.pipeline import EnginePipeline

    say = progress or (lambda _msg: None)
    manifest = read_manifest(cfg.artifact)
    if manifest.get("model", {}).get("architecture", "sd") != "sd":
        raise RuntimeInputError(
            f"{cfg.artifact} is an {manifest['model']['architecture']} artifact; bench times SD 1.x/2.x artifacts "
            "(its per-stage timings run the SD prompt encoding): use benchmarks/sdxl_e2e.py for SDXL"
        )
    model = manifest.get("model", {})
    if is_inpainting(model):
        raise RuntimeInputError(
            f"{cfg.artifact} is an inpainting artifact (UNet with {model['unet_in_channels']} input channels); bench "
            "times text-to-image: bench the text-to-image checkpoint it was fine-tuned from"
        )
    device_kind = cfg.device or manifest.get("device", "cpu")
    if cfg.devices and device_kind != "cuda":
        raise RuntimeInputError(
            f"--devices needs device 'cuda', not {device_kind!r}; drop --devices or use --device cuda"
        )
    device_id = cfg.devices[0] if cfg.devices else 0
    device = torch.device("cuda", device_id) if device_kind == "cuda" else torch.device("cpu")
    clock = Clock(device)
    notes: list[str] = []
    runs: list[Run] = []
    source = manifest.get("source", {}).get("path")
    model_dir = cfg.model_dir or (Path(source) if source else None)
    if cfg.baseline == "diffusers" and cfg.model_dir is not None and not _is_pipeline_folder(cfg.model_dir):
        raise ModelFolderError(
            f"--model-dir {cfg.model_dir} has no model_index.json; pass the diffusers pipeline folder the artifact "
            "was compiled from, or --baseline none"
        )

    _free_memory()
    _memory_start([device])
    say(f"loading {cfg.artifact} on {device}")
    load_t0 = time.perf_counter()
    pipe = EnginePipeline.from_artifacts(
        cfg.artifact, device=device_kind, scheduler=cfg.scheduler, device_id=device_id, cuda_graph=cfg.cuda_graph,
        runtime_cache_dir=cfg.runtime_cache_dir,
        cudnn_conv_algo_search=cfg.cudnn_conv_algo_search, deterministic=cfg.deterministic,
        size_buckets=cfg.size_buckets,
    )
    clock.sync()
    load_s = time.perf_counter() - load_t0
    first_calls: list[dict[str, Any]] = []
    repeatability: list[dict[str, Any]] = []
    try:
        height = cfg.height or pipe.default_height
        width = cfg.width or pipe.default_width
        sizes = list(cfg.sizes) or [(height, width)]
        height, width = sizes[0]
        scheduler_template = pipe.scheduler
        for h, w in sizes:
            for batch in cfg.batch_sizes:
                say(f"ours {h}x{w} b={batch}: first call")
                cold = first_call_s(pipe, cfg, clock, batch, h, w)
                say(f"ours {h}x{w} b={batch}")
                _memory_start([device])
                run = bench_ours(pipe, cfg, clock, batch, h, w)
                run.memory_mb = _memory_read([device])
                run.stage_memory_mb = stage_memory(pipe, cfg, batch, h, w)
                runs.append(run)
                first_calls.append(_first_call_row("ours", run, cold))
            repeatability.append(repeat_check(pipe, cfg, cfg.batch_sizes[0], h, w))
        graph_engines = [n for n, e in pipe.engines.items() if getattr(e, "cuda_graph", False)]
        notes.append(f"ours: CUDA graphs for {', '.join(graph_engines) or 'no engine'}")
        buckets = {n: e.specialised_shapes for n, e in pipe.engines.items() if hasattr(e, "specialised_shapes")}
        if buckets:
            notes.append(f"ours: size-bucket sessions {buckets}")
        scheduler_name = pipe.scheduler_name
    finally:
        pipe.close()
        del pipe
        _free_memory()

    if cfg.vram_budget is not None:
        runs.extend(bench_budget(cfg, clock, device_kind, device_id, height, width, notes, say))

    if len(cfg.devices) >= 2:
        from .runtime.parallel import DataParallelPipeline

        devs = [torch.device("cuda", d) for d in cfg.devices]
        say(f"ours_multi_gpu on {', '.join(map(str, devs))}")
        multi = DataParallelPipeline.from_artifacts(
            cfg.artifact, cfg.devices, scheduler=cfg.scheduler, cuda_graph=cfg.cuda_graph, verify=False,
            runtime_cache_dir=cfg.runtime_cache_dir,
        )
        try:
            for h, w in sizes:
                for batch in cfg.batch_sizes:
                    _memory_start(devs)
                    try:
                        run = bench_multi(multi, cfg, clock, batch, h, w)
                        run.memory_mb = _memory_read(devs)
                    except RuntimeInputError as e:
                        run = Run("ours_multi_gpu", batch, h, w, status="error", reason=str(e))
                    runs.append(run)
        finally:
            multi.close()
            _free_memory()
    else:
        for h, w in sizes:
            for batch in cfg.batch_sizes:
                runs.append(Run("ours_multi_gpu", batch, h, w, status="skipped", reason="needs --devices with 2+ GPUs"))

    if cfg.baseline == "diffusers":
        runs.extend(_diffusers_runs(cfg, clock, model_dir, manifest, scheduler_template, sizes, notes, say))
    else:
        notes.append("baseline none: diffusers not measured")

    for run in runs:
        if run.status == "ok":
            for line in trust_notes(run, cfg.steps):
                notes.append(line)
                if line.startswith("warning: "):
                    logger.warning("bench: %s", line.removeprefix("warning: "))
                else:
                    logger.info("bench: %s", line)
    if device.type == "cpu":
        notes.append("CPU: wall-clock timings, no CUDA events; memory is not measured")
    else:
        notes.append(
            "memory: torch_* counts torch's allocator only (ORT's arena is invisible to it); device_used is the "
            "whole device after the run (ORT arena, CUDA context, cuDNN/cuBLAS workspaces, other processes)"
        )
    return {
        "schema": SCHEMA,
        "env": {
            "device": device.type,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "timing": "cuda_events" if device.type == "cuda" else "wall_clock",
            **_versions(),
        },
        "config": {
            "artifact": str(cfg.artifact),
            "model_dir": str(model_dir) if model_dir else None,
            "backend": str(manifest.get("backend")),
            "precision": str(manifest.get("precision")),
            "profile": manifest.get("profile", {}),
            "steps": cfg.steps,
            "height": int(height),
            "width": int(width),
            "guidance_scale": float(cfg.guidance_scale),
            "seed": cfg.seed,
            "scheduler": scheduler_name,
            "batch_sizes": list(cfg.batch_sizes),
            "devices": list(cfg.devices),
            "iters": cfg.iters,
            "warmup": cfg.warmup,
            "stage_iters": cfg.stage_iters,
            "baseline": cfg.baseline,
            "cuda_graph": cfg.cuda_graph,
            "vram_budget": cfg.vram_budget,
            "sizes": [list(hw) for hw in sizes],
            "cudnn_conv_algo_search": cfg.cudnn_conv_algo_search,
            "deterministic": cfg.deterministic,
            "size_buckets": cfg.size_buckets,
        },
        "load_s": load_s,
        "runs": [r.to_json() for r in runs],
        "ratios": ratios(runs),
        "first_calls": first_calls,
        "repeatability": repeatability,
        "notes": notes,
    }


def _is_pipeline_folder(path: str | Path) -> bool:
    return (Path(path) / "model_index.json").is_file()


def _baseline_mismatch(model_dir: Path, manifest: Mapping[str, Any]) -> str | None:
    """Why the diffusers baselines would not run the artifact's weights, or None: ``model_dir`` hashes differently
    from the manifest's ``source.sha256`` (another model, or the folder changed since compile), or LoRAs were merged
    into the artifact (the baseline runs the base weights)."""
    from .artifacts import folder_hash

    source = manifest.get("source", {})
    if source.get("sha256") and folder_hash(model_dir) != source["sha256"]:
        return (f"{model_dir} is not the folder the artifact was compiled from (its sha256 differs from the "
                f"manifest's source {source.get('path')}): the figures compare different weights")
    if manifest.get("loras"):
        return "the artifact has LoRAs merged in; the diffusers baselines run the base weights without them"
    return None


def _diffusers_runs(
    cfg: BenchConfig,
    clock: Clock,
    model_dir: Path | None,
    manifest: Mapping[str, Any],
    scheduler_template: Any,
    sizes: Sequence[tuple[int, int]],
    notes: list[str],
    say: Callable[[str], None],
) -> list[Run]:
    systems = ("diffusers_eager", "diffusers_cuda_graph")
    shapes = [(h, w, b) for h, w in sizes for b in cfg.batch_sizes]
    if model_dir is None or not _is_pipeline_folder(model_dir):
        reason = f"no diffusers pipeline folder (model_dir={model_dir}, no model_index.json); pass --model-dir"
        return [Run(s, b, h, w, status="skipped", reason=reason) for s in systems for h, w, b in shapes]
    mismatch = _baseline_mismatch(model_dir, manifest)
    if mismatch:
        logger.warning("bench: %s", mismatch)
        notes.append(f"diffusers baselines: {mismatch}")
    from diffusers import StableDiffusionPipeline

    cuda = clock.device.type == "cuda"
    # the artifact's precision (fp16 on CUDA for the SD figures); fp32 on the CPU, which has no fp16 kernels
    dtype = torch.float16 if cuda and manifest.get("precision") == "fp16" else torch.float32
    say(f"loading diffusers from {model_dir} ({dtype})")
    dpipe = StableDiffusionPipeline.from_pretrained(
        model_dir, torch_dtype=dtype, safety_checker=None, requires_safety_checker=False, local_files_only=True
    ).to(clock.device)
    dpipe.set_progress_bar_config(disable=True)
    dpipe.scheduler = type(scheduler_template).from_config(scheduler_template.config)
    processors = {type(p).__name__ for p in dpipe.unet.attn_processors.values()}
    notes.append(
        f"diffusers: {dtype}, attention {', '.join(sorted(processors))}, scheduler {type(dpipe.scheduler).__name__}"
    )
    runs: list[Run] = []
    try:
        for height, width, batch in shapes:
            say(f"diffusers_eager {height}x{width} b={batch}")
            _memory_start([clock.device])
            run = bench_diffusers(dpipe, "diffusers_eager", cfg, clock, batch, height, width)
            run.memory_mb = _memory_read([clock.device])
            runs.append(run)
        if not cuda:
            runs.extend(Run("diffusers_cuda_graph", b, h, w, status="skipped", reason="needs CUDA")
                        for h, w, b in shapes)
            return runs
        graphed = GraphedUNet(dpipe.unet)
        try:
            for height, width, batch in shapes:
                say(f"diffusers_cuda_graph {height}x{width} b={batch}")
                _memory_start([clock.device])
                try:
                    run = bench_diffusers(dpipe, "diffusers_cuda_graph", cfg, clock, batch, height, width)
                    run.memory_mb = _memory_read([clock.device])
                except RuntimeError as e:  # a capture torch refuses is a figure too
                    run = Run("diffusers_cuda_graph", batch, height, width, status="error",
                              reason=f"{type(e).__name__}: {e}"[:500])
                runs.append(run)
        finally:
            graphed.remove()
    finally:
        del dpipe
        _free_memory()
    return runs


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


# -- schema, table, plot -----------------------------------------------------------------------------------

_NUM = (int, float)
_OPT_NUM = (int, float, type(None))
_OPT_STR = (str, type(None))


def validate_result(data: Mapping[str, Any]) -> None:
    """Check a bench result against the schema in the module docstring.

    Raises:
        ValueError: naming the first key whose presence or type is wrong.
    """

    def check(obj: Mapping[str, Any], key: str, types: tuple[type, ...] | type, where: str) -> Any:
        if key not in obj:
            raise ValueError(f"{where}: missing key {key!r}")
        value = obj[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
            raise ValueError(f"{where}.{key} = {value!r} has type {type(value).__name__}; expected {types}")
        return value

    if check(data, "schema", str, "result") != SCHEMA:
        raise ValueError(f"result.schema = {data['schema']!r}; expected {SCHEMA!r}")
    env = check(data, "env", dict, "result")
    for key, types in (
        ("device", str),
        ("gpu", _OPT_STR),
        ("gpu_count", int),
        ("timing", str),
        ("torch", str),
        ("onnxruntime", str),
        ("diffusers", str),
        ("python", str),
    ):
        check(env, key, types, "env")
    config = check(data, "config", dict, "result")
    for key, types in (
        ("artifact", str),
        ("model_dir", _OPT_STR),
        ("backend", str),
        ("precision", str),
        ("profile", dict),
        ("steps", int),
        ("height", int),
        ("width", int),
        ("guidance_scale", float),
        ("seed", int),
        ("scheduler", str),
        ("batch_sizes", list),
        ("devices", list),
        ("iters", int),
        ("warmup", int),
        ("stage_iters", int),
        ("baseline", str),
        ("cuda_graph", (bool, type(None))),
    ):
        check(config, key, types, "config")
    for key, types in (("sizes", list), ("cudnn_conv_algo_search", str), ("deterministic", bool),
                       ("size_buckets", _OPT_STR)):
        if key in config:  # optional: results written before issue 19 lack them
            check(config, key, types, "config")
    if "load_s" in data:
        check(data, "load_s", _NUM, "result")
    for list_key, fields in (
        ("first_calls", (("system", str), ("batch_size", int), ("first_call_s", _NUM), ("warm_e2e_s", _OPT_NUM),
                         ("overhead_s", _OPT_NUM))),
        ("repeatability", (("system", str), ("batch_size", int), ("max_abs_diff", _NUM), ("identical", bool))),
    ):
        for i, row in enumerate(data.get(list_key, [])):
            for key, types in fields:
                check(row, key, types, f"{list_key}[{i}]")
    for i, run in enumerate(check(data, "runs", list, "result")):
        where = f"runs[{i}]"
        if check(run, "system", str, where) not in SYSTEMS:
            raise ValueError(f"{where}.system = {run['system']!r}; expected one of {SYSTEMS}")
        check(run, "batch_size", int, where)
        if check(run, "status", str, where) not in ("ok", "skipped", "error"):
            raise ValueError(f"{where}.status = {run['status']!r}")
        check(run, "reason", _OPT_STR, where)
        check(run, "stage_batch", (int, type(None)), where)
        stages = check(run, "stages_ms", dict, where)
        for s in STAGES:
            check(stages, s, _OPT_NUM, f"{where}.stages_ms")
        for key in ("e2e_s", "s_per_image", "images_per_s"):
            check(run, key, _OPT_NUM, where)
        for j, v in enumerate(check(run, "e2e_samples_s", list, where)):
            if not isinstance(v, _NUM):
                raise ValueError(f"{where}.e2e_samples_s[{j}] = {v!r} is not a number")
        memory = check(run, "memory_mb", dict, where)
        for key in ("torch_peak_allocated", "torch_peak_reserved", "device_used"):
            check(memory, key, _OPT_NUM, f"{where}.memory_mb")
        if run["status"] == "ok" and run["e2e_s"] is None:
            raise ValueError(f"{where}: status ok but e2e_s is null")
        for key in ("e2e_spread_s", *(f"stages_spread_ms.{s}" for s in STAGES)):  # optional: results before them
            parent, _, leaf = key.rpartition(".")
            value = (run.get(parent) or {}).get(leaf) if parent else run.get(leaf)
            if value is not None and (not isinstance(value, list) or len(value) != 3
                                      or not all(isinstance(v, _NUM) for v in value)):
                raise ValueError(f"{where}.{key} = {value!r}; expected [min, median, max]")
        for key in ("stage_sum_s", "stage_sum_ratio"):
            if key in run and not isinstance(run[key], _OPT_NUM):
                raise ValueError(f"{where}.{key} = {run[key]!r} is not a number")
    for i, ratio in enumerate(check(data, "ratios", list, "result")):
        where = f"ratios[{i}]"
        check(ratio, "batch_size", int, where)
        check(ratio, "system", str, where)
        check(ratio, "baseline", str, where)
        check(ratio, "e2e_speedup", _OPT_NUM, where)
        for s in STAGES:
            check(check(ratio, "stage_speedup", dict, where), s, _OPT_NUM, f"{where}.stage_speedup")
    for note in check(data, "notes", list, "result"):
        if not isinstance(note, str):
            raise ValueError(f"notes entry {note!r} is not a string")


def _as_tuple(types: tuple[type, ...] | type) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def format_table(result: Mapping[str, Any]) -> str:
    """A fixed-width text table of the runs (one line per system and batch size) and the speedups."""

    def num(v: Any, fmt: str) -> str:
        width = fmt.split(".")[0]
        return format(v, fmt) if isinstance(v, _NUM) else format("-", f">{width}" if width else "")

    head = (
        f"{'system':<22}{'size':>10}{'batch':>6}{'text ms':>9}{'unet ms':>9}{'unet min..max':>16}{'vae ms':>9}"
        f"{'glue ms':>9}"
        f"{'e2e s':>9}{'s/img':>8}{'img/s':>8}{'peak MiB':>10}  status"
    )
    lines = [head, "-" * len(head)]
    for r in result["runs"]:
        st = r["stages_ms"]
        mem = r["memory_mb"].get("device_used") or r["memory_mb"].get("torch_peak_allocated")
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}"
        unet_spread = (r.get("stages_spread_ms") or {}).get("unet_step")
        spread_text = f"{unet_spread[0]:.2f}..{unet_spread[2]:.2f}" if unet_spread else "-"
        size = f"{r['height']}x{r['width']}" if r.get("height") else "-"
        lines.append(
            f"{r['system']:<22}{size:>10}{r['batch_size']:>6}{num(st['text_encoder'], '9.2f')}"
            f"{num(st['unet_step'], '9.2f')}{spread_text:>16}"
            f"{num(st['vae_decode'], '9.2f')}{num(st['scheduler_glue'], '9.3f')}{num(r['e2e_s'], '9.3f')}"
            f"{num(r['s_per_image'], '8.3f')}{num(r['images_per_s'], '8.2f')}{num(mem, '10.0f')}  {status}"
        )
    mem_rows = [r for r in result["runs"] if any(v is not None for v in (r.get("stage_memory_mb") or {}).values())]
    if mem_rows:
        lines.append("")
        lines.append("peak device memory per stage, MiB (cudaMemGetInfo, whole device):")
        for r in mem_rows:
            m = r["stage_memory_mb"]
            lines.append(f"  {r['system']:<22} b={r['batch_size']:<3} text {num(m.get('text'), '.0f')}  unet "
                         f"{num(m.get('unet'), '.0f')}  vae {num(m.get('vae'), '.0f')}"
                         + (f"  [{r['vram_plan']}]" if r.get("vram_plan") else ""))
    by = {(r["system"], r["batch_size"]): r for r in result["runs"] if r["status"] == "ok"}
    for (system, batch), r in by.items():
        base = by.get(("ours", batch))
        if system == "ours_vram_budget" and base is not None and base["e2e_s"] and r["e2e_s"]:
            cost = r["e2e_s"] - base["e2e_s"]
            lines.append(f"  vram budget {result['config'].get('vram_budget')} costs b={batch}: e2e "
                         f"{base['e2e_s']:.3f} s -> {r['e2e_s']:.3f} s ({cost:+.3f} s per request)")
    if result["ratios"]:
        lines.append("")
        lines.append("speedups (baseline time / system time):")
        for q in result["ratios"]:
            unet = q["stage_speedup"].get("unet_step")
            size = f"{q['height']}x{q['width']} " if q.get("height") else ""
            lines.append(
                f"  {size}b={q['batch_size']:<3} {q['system']:<22} vs {q['baseline']:<22}"
                f" e2e x{num(q['e2e_speedup'], '.2f')}"
                f"  unet x{num(unet, '.2f')}"
            )
    if result.get("first_calls"):
        lines.append("")
        lines.append(f"first call per size (load {num(result.get('load_s'), '.2f')} s):")
        for f in result["first_calls"]:
            lines.append(
                f"  {f['system']:<6} {f['height']}x{f['width']} b={f['batch_size']:<3}"
                f" first {num(f['first_call_s'], '.3f')} s"
                f"  warm {num(f['warm_e2e_s'], '.3f')} s  overhead {num(f['overhead_s'], '.3f')} s"
            )
    for q in result.get("repeatability", []):
        lines.append(f"two identical calls at {q['height']}x{q['width']} b={q['batch_size']}: max abs difference "
                     f"{q['max_abs_diff']:.3g}{' (identical)' if q['identical'] else ''}")
    return "\n".join(lines)


def plot_result(result: Mapping[str, Any], path: str | Path) -> Path:
    """A bar chart PNG: seconds per image (end to end) and per-stage ms for each system, per batch size.

    Uses matplotlib when installed (``pip install diffusion-trt[plot]``), else draws with Pillow.
    """
    path = Path(path)
    rows = [r for r in result["runs"] if r["status"] == "ok"]
    title = (
        f"{result['config'].get('precision')} {result['config'].get('height')}x{result['config'].get('width')}, "
        f"{result['config'].get('steps')} steps, {result['env'].get('gpu') or result['env'].get('device')}"
    )
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError:
        return _plot_pillow(rows, title, path)
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    batches = sorted({r["batch_size"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / max(1, len(systems))
    for k, system in enumerate(systems):
        xs, ys = [], []
        for i, b in enumerate(batches):
            r = next((r for r in rows if r["system"] == system and r["batch_size"] == b), None)
            if r is not None:
                xs.append(i + k * width)
                ys.append(r["s_per_image"])
        axes[0].bar(xs, ys, width, label=system)
        first = next((r for r in rows if r["system"] == system), None)
        if first is not None:
            vals = [first["stages_ms"].get(s) or 0.0 for s in STAGES]
            axes[1].bar([i + k * width for i in range(len(STAGES))], vals, width, label=system)
    axes[0].set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(batches))], [f"b={b}" for b in batches])
    axes[0].set_ylabel("seconds per image (end to end)")
    axes[1].set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(STAGES))], list(STAGES))
    axes[1].set_ylabel(f"ms per call (b={batches[0] if batches else '?'})")
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_COLORS = [(66, 133, 244), (52, 168, 83), (234, 67, 53), (251, 188, 5)]


def _plot_pillow(rows: list[dict[str, Any]], title: str, path: Path) -> Path:
    from PIL import Image, ImageDraw

    systems = [s for s in SYSTEMS if any(r["system"] == s for r in rows)]
    batches = sorted({r["batch_size"] for r in rows})
    width, height, margin = 900, 420, 50
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((margin, 10), f"seconds per image (end to end): {title}", fill="black")
    values = [r["s_per_image"] for r in rows if isinstance(r["s_per_image"], _NUM)]
    top = max(values) if values else 1.0
    plot_h = height - 2 * margin - 30
    group_w = (width - 2 * margin) / max(1, len(batches))
    bar_w = group_w * 0.8 / max(1, len(systems))
    base_y = height - margin
    draw.line([(margin, base_y), (width - margin, base_y)], fill="black")
    for i, b in enumerate(batches):
        draw.text((margin + i * group_w + group_w * 0.35, base_y + 6), f"batch {b}", fill="black")
        for k, system in enumerate(systems):
            r = next((r for r in rows if r["system"] == system and r["batch_size"] == b), None)
            if r is None or not isinstance(r["s_per_image"], _NUM):
                continue
            x0 = margin + i * group_w + group_w * 0.1 + k * bar_w
            y0 = base_y - plot_h * r["s_per_image"] / top
            draw.rectangle([x0, y0, x0 + bar_w - 2, base_y], fill=_COLORS[k % len(_COLORS)])
            draw.text((x0, y0 - 12), f"{r['s_per_image']:.3g}", fill="black")
    for k, system in enumerate(systems):
        x = margin + k * 200
        draw.rectangle([x, 30, x + 12, 42], fill=_COLORS[k % len(_COLORS)])
        draw.text((x + 16, 30), system, fill="black")
    img.save(path, format="PNG")
    return path

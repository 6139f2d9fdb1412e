"""``diffusion-trt bench``: our engines next to diffusers, in one process, on the same weights, seed and scheduler.

Systems (each at every size of ``--sizes`` and every ``--batch-size``):

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
  untimed call (:class:`~diffusion_trt.runtime.memory.memory_meter.StageMemoryMeter`);
  whole device, CUDA context included.

NVTX ranges (``bench <system> b=<n> <what>``, and the runtime's own ``text_encoder``/``unet``/``scheduler``/
``vae_decode`` ranges) make every stage visible in Nsight Systems.

The result's JSON layout is the JSON Schema ``diffusion_trt/data/bench_result.schema.json`` (``schema`` =
:data:`SCHEMA`; :func:`validate_result` checks it): ``schema``, ``env`` (device, GPU, timing, tool versions),
``config`` (what was measured), ``runs`` (one row per system, size and batch size: ``stages_ms``, ``e2e_s``,
``memory_mb``, ``stage_memory_mb``...), ``ratios`` (speedups), ``notes``.

Optional keys (added with issue 19; results without them still validate): ``config.sizes`` ([[h, w]]: every
size measured, in order; rows then carry ``height``/``width``), ``config.cudnn_conv_algo_search``,
``config.deterministic``, ``config.size_buckets``; ``load_s`` (seconds to open our artifact); ``first_calls``
(``[{"system", "batch_size", "height", "width", "first_call_s", "warm_e2e_s", "overhead_s"}]``: the first call at
each size and batch, before any other work at that shape, timed on the wall clock: cuDNN's algorithm search, ORT's
per-shape set-up, a size bucket's session creation and CUDA-graph capture all land in it; the first size also pays
the process's lazy CUDA initialisation; ``next_calls_s``: the calls timed right after it (``run.NEXT_CALLS``, no
wait between: a size bucket's static session made in the background may be adopted and captured in one of them) and
``overhead_total_s``, all of them over the warm end to end, summed (what a new size costs a user calling back to
back); with size buckets made in the background, ``specialised_wait_s`` is the wait after those calls until their
static sessions were ready, so the warm figures are the static sessions');
``repeatability`` (``[{"system", "batch_size", "height", "width",
"max_abs_diff", "identical"}]``: two identical calls, same seed, float images in [0, 1], at the first batch size).

Speedups are ``baseline time / system time`` (> 1: the system is faster); ``ours_multi_gpu`` is also compared
with ``ours`` (its ``e2e_speedup`` is then the multi-GPU scaling factor).

Trust checks (each run also carries, optionally in the schema, ``stages_spread_ms`` {stage: [min, median, max]},
``e2e_spread_s`` [min, median, max], ``stage_sum_s`` and ``stage_sum_ratio``): see :mod:`.trust`.

The package, one job per module: :mod:`.config` (what is measured), :mod:`.clock` (timing, NVTX), :mod:`.memory`,
:mod:`.glue` (the scheduler glue, through the runtime's loop), :mod:`.ours` (our systems), :mod:`.baseline`
(diffusers), :mod:`.result` (rows, speedups), :mod:`.trust`, :mod:`.schema` (the JSON check), :mod:`.report`
(table, plot), :mod:`.run` (the whole bench).
"""

from __future__ import annotations

from .baseline import GraphedUNet, architecture_mismatch, baseline_mismatch, bench_diffusers
from .clock import Clock, spread, time_stage
from .config import BASELINES, DEFAULT_PROMPT, BenchConfig
from .glue import glue_ms
from .ours import bench_ours
from .report import format_table, plot_result
from .result import MEMORY_STAGES, SCHEMA, STAGES, SYSTEMS, Run, ratios
from .run import run_bench
from .schema import validate_result
from .trust import STAGES_OVER_E2E, STAGES_UNDER_E2E, WIDE_SPREAD, trust_notes

__all__ = [
    "BASELINES", "DEFAULT_PROMPT", "MEMORY_STAGES", "SCHEMA", "STAGES", "STAGES_OVER_E2E", "STAGES_UNDER_E2E",
    "SYSTEMS", "WIDE_SPREAD", "BenchConfig", "Clock", "GraphedUNet", "Run", "architecture_mismatch",
    "baseline_mismatch", "bench_diffusers", "bench_ours", "format_table", "glue_ms", "plot_result", "ratios",
    "run_bench", "spread", "time_stage", "trust_notes", "validate_result",
]

"""The whole bench: every system at every size and batch size, into one result dict (the JSON of ``--json``)."""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..artifact.manifest import Manifest
from ..config import check_image_size
from ..errors import ModelFolderError, RuntimeInputError, names_parameters
from .baseline import architecture_mismatch, diffusers_runs, is_pipeline_folder
from .clock import Clock
from .config import BenchConfig
from .memory import free_memory, memory_read, memory_start
from .ours import (
    bench_budget,
    bench_multi,
    bench_ours,
    bucket_parts,
    bucket_timings,
    first_call_s,
    repeat_check,
    settle_s,
    stage_memory,
)
from .result import SCHEMA, Run, first_call_row, ratios
from .trust import trust_notes

logger = logging.getLogger(__name__)


@dataclass
class _Ours:
    """What the ``ours`` pass measured and the later systems reuse."""

    sizes: list[tuple[int, int]]
    load_s: float
    scheduler_template: Any
    scheduler_name: str
    runs: list[Run] = field(default_factory=list)
    first_calls: list[dict[str, Any]] = field(default_factory=list)
    repeatability: list[dict[str, Any]] = field(default_factory=list)


@names_parameters  # its own: the pipeline arguments it passes per size are not the caller's
def run_bench(cfg: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every system at every batch size; return the result dict (``data/bench_result.schema.json``).

    A system that cannot run here (no CUDA for the graphed baseline, fewer than two devices for multi-GPU,
    a baseline error) is a row with ``status`` "skipped"/"error" and a ``reason``, not an exception.

    Raises:
        ArtifactError / RuntimeInputError: the artifact cannot be loaded or a batch size cannot be run by it.
        ModelFolderError: ``model_dir`` was given for the diffusers baseline but holds no model_index.json, or the
            baseline's folder is of another architecture than the artifact (before anything is timed).
    """
    say = progress or (lambda _msg: None)
    manifest = Manifest.read(cfg.artifact)
    device_kind, device = _check(cfg, manifest)
    clock = Clock(device)
    model_dir = _model_dir(cfg, manifest)
    notes: list[str] = []
    ours = _ours(cfg, clock, device_kind, notes, say)
    runs = list(ours.runs)
    if cfg.vram_budget is not None:
        runs.extend(bench_budget(cfg, clock, device_kind, device.index or 0, ours.sizes, notes, say))
    runs.extend(_multi(cfg, clock, ours.sizes, say))
    if cfg.baseline == "diffusers":
        runs.extend(diffusers_runs(cfg, clock, model_dir, manifest, ours.scheduler_template, ours.sizes, notes, say))
    else:
        notes.append("baseline none: diffusers not measured")
    notes.extend(_trust(runs, cfg.steps))
    notes.append(_memory_note(device))
    return {
        "schema": SCHEMA,
        "env": _env(device),
        "config": _config_json(cfg, manifest, model_dir, ours),
        "load_s": ours.load_s,
        "runs": [r.to_json() for r in runs],
        "ratios": ratios(runs),
        "first_calls": ours.first_calls,
        "repeatability": ours.repeatability,
        "notes": notes,
    }


def _check(cfg: BenchConfig, manifest: Manifest) -> tuple[str, torch.device]:
    """The device kind and device to bench on, after refusing what bench cannot time.

    Raises:
        RuntimeInputError: an SDXL or inpainting artifact; ``devices`` off CUDA; a ``--sizes`` size the artifact's
            profile does not take (before anything loads: it failed only when its turn came, after the sizes
            before it were timed).
    """
    model = manifest.model
    _check_sizes(cfg.sizes, manifest)
    if model.architecture != "sd":
        raise RuntimeInputError(
            f"{cfg.artifact} is an {model.architecture} artifact; bench times SD 1.x/2.x artifacts "
            "(its per-stage timings run the SD prompt encoding): use benchmarks/sdxl_e2e.py for SDXL"
        )
    if model.is_inpainting:
        raise RuntimeInputError(
            f"{cfg.artifact} is an inpainting artifact (UNet with {model.unet_in_channels} input channels); bench "
            "times text-to-image: bench the text-to-image checkpoint it was fine-tuned from"
        )
    device_kind = cfg.device or manifest.device
    if cfg.devices and device_kind != "cuda":
        raise RuntimeInputError(
            f"--devices needs device 'cuda', not {device_kind!r}; drop --devices or use --device cuda"
        )
    device_id = cfg.devices[0] if cfg.devices else 0
    return device_kind, torch.device("cuda", device_id) if device_kind == "cuda" else torch.device("cpu")


def _check_sizes(sizes: Sequence[tuple[int, int]], manifest: Manifest) -> None:
    """Raise :class:`RuntimeInputError` naming the first ``(height, width)`` (pixels) outside the artifact's profile
    or not a multiple of its VAE factor, as the run would."""
    profile = manifest.profile
    for h, w in sizes:
        for name, value, span in (("height", h, profile.height), ("width", w, profile.width)):
            try:
                check_image_size(name, value, span.min, span.max, multiple=manifest.model.vae_scale_factor)
            except RuntimeInputError as e:
                raise RuntimeInputError(f"--sizes {h}x{w}: {e}") from None


def _model_dir(cfg: BenchConfig, manifest: Manifest) -> Path | None:
    """The diffusers folder of the baseline: ``cfg.model_dir``, else the manifest's source.

    Raises:
        ModelFolderError: ``cfg.model_dir`` given for the diffusers baseline without a model_index.json; the folder
            (given or the manifest's) is of another architecture than the artifact (see :func:`_refuse_other_kind`).
    """
    source = manifest.source_path
    if cfg.baseline == "diffusers" and cfg.model_dir is not None and not is_pipeline_folder(cfg.model_dir):
        raise ModelFolderError(
            f"--model-dir {cfg.model_dir} has no model_index.json; pass the diffusers pipeline folder the artifact "
            "was compiled from, or --baseline none"
        )
    model_dir = cfg.model_dir or (Path(source) if source else None)
    if cfg.baseline == "diffusers" and model_dir is not None and is_pipeline_folder(model_dir):
        _refuse_other_kind(cfg, model_dir, manifest)
    return model_dir


def _refuse_other_kind(cfg: BenchConfig, model_dir: Path, manifest: Manifest) -> None:
    """Refuse, before any timing, a baseline folder diffusers' ``StableDiffusionPipeline`` cannot run next to the
    artifact (an SDXL or inpainting folder for an SD text-to-image artifact: it crashed after ours was measured).

    Raises:
        ModelFolderError: naming the folder's pipeline class and architecture, and the artifact's.
    """
    mismatch = architecture_mismatch(model_dir, manifest)
    if mismatch is None:
        return
    what = f"--model-dir {model_dir}" if cfg.model_dir is not None else f"the artifact's source folder {model_dir}"
    source = manifest.source_path
    raise ModelFolderError(
        f"{what} is {mismatch[0]}; the artifact {cfg.artifact} is {mismatch[1]}: the diffusers baseline cannot run "
        f"that folder next to it; pass the folder the artifact was compiled from ({source or 'its source'}) or "
        "--baseline none"
    )


def _ours(cfg: BenchConfig, clock: Clock, device_kind: str, notes: list[str], say: Callable[[str], None]) -> _Ours:
    """``ours`` at every size and batch (a cold first call each), the repeatability check per size; notes on the
    CUDA graphs and size buckets. The pipeline is closed before returning."""
    from ..runtime.pipeline import EnginePipeline

    device = clock.device
    free_memory()
    memory_start([device])
    say(f"loading {cfg.artifact} on {device}")
    load_t0 = time.perf_counter()
    pipe = EnginePipeline.from_artifacts(
        cfg.artifact, device=device_kind, scheduler=cfg.scheduler, device_id=device.index or 0,
        cuda_graph=cfg.cuda_graph, runtime_cache_dir=cfg.runtime_cache_dir,
        cudnn_conv_algo_search=cfg.cudnn_conv_algo_search, deterministic=cfg.deterministic,
        size_buckets=cfg.size_buckets,
    )
    clock.sync()
    load_s = time.perf_counter() - load_t0
    try:
        sizes = list(cfg.sizes) or [(cfg.height or pipe.default_height, cfg.width or pipe.default_width)]
        out = _Ours(sizes, load_s, pipe.scheduler, pipe.scheduler_name)
        for h, w in sizes:
            for batch in cfg.batch_sizes:
                _ours_row(pipe, cfg, clock, batch, h, w, out, say)
            out.repeatability.append(repeat_check(pipe, cfg, cfg.batch_sizes[0], h, w))
        graph_engines = [n for n, e in pipe.engines.items() if getattr(e, "cuda_graph", False)]
        notes.append(f"ours: CUDA graphs for {', '.join(graph_engines) or 'no engine'}")
        buckets = {n: e.specialised_shapes for n, e in pipe.engines.items() if hasattr(e, "specialised_shapes")}
        if buckets:
            notes.append(f"ours: size-bucket sessions {buckets}")
        return out
    finally:
        pipe.close()
        del pipe
        free_memory()


#: Calls timed right after the first at a new shape, with no wait between (``first_calls[].next_calls_s``). With size
#: buckets made in the background the first call may end on the dynamic session, and the static session's first run
#: (its warm-up and CUDA-graph capture) then lands in a later call: a user calling back to back pays it there, so the
#: new size's cost is ``overhead_total_s`` over these calls, not the first call's overhead alone.
NEXT_CALLS = 2


def _ours_row(pipe: Any, cfg: BenchConfig, clock: Clock, batch: int, h: int, w: int, out: _Ours,
              say: Callable[[str], None]) -> None:
    """One ``ours`` row (after its cold first call) and its ``first_calls`` row, into ``out``."""
    say(f"ours {h}x{w} b={batch}: first call")
    before = bucket_timings(pipe)
    cold = first_call_s(pipe, cfg, clock, batch, h, w)
    following = [first_call_s(pipe, cfg, clock, batch, h, w) for _ in range(NEXT_CALLS)]
    ready = settle_s(pipe)
    say(f"ours {h}x{w} b={batch}")
    memory_start([clock.device])
    run = bench_ours(pipe, cfg, clock, batch, h, w)
    parts = bucket_parts(before, bucket_timings(pipe))  # through the warm runs: a static session's first run is there
    run.memory_mb = memory_read([clock.device])
    run.stage_memory_mb = stage_memory(pipe, cfg, batch, h, w)
    out.runs.append(run)
    row = first_call_row("ours", run, cold, following)
    if ready is not None:  # size buckets made in the background: the wait for their static sessions
        row["specialised_wait_s"] = ready
    if parts:  # size buckets: where the first call's seconds went, per engine
        row["bucket_parts"] = parts
    out.first_calls.append(row)


def _multi(cfg: BenchConfig, clock: Clock, sizes: Sequence[tuple[int, int]], say: Callable[[str], None]) -> list[Run]:
    """``ours_multi_gpu`` rows: measured over ``cfg.devices`` (two or more), else "skipped"."""
    if len(cfg.devices) < 2:
        return [Run("ours_multi_gpu", batch, h, w, status="skipped", reason="needs --devices with 2+ GPUs")
                for h, w in sizes for batch in cfg.batch_sizes]
    from ..runtime.parallel import DataParallelPipeline

    devs = [torch.device("cuda", d) for d in cfg.devices]
    say(f"ours_multi_gpu on {', '.join(map(str, devs))}")
    multi = DataParallelPipeline.from_artifacts(
        cfg.artifact, cfg.devices, scheduler=cfg.scheduler, cuda_graph=cfg.cuda_graph, verify=False,
        runtime_cache_dir=cfg.runtime_cache_dir,
    )
    runs: list[Run] = []
    try:
        for h, w in sizes:
            for batch in cfg.batch_sizes:
                memory_start(devs)
                try:
                    run = bench_multi(multi, cfg, clock, batch, h, w)
                    run.memory_mb = memory_read(devs)
                except RuntimeInputError as e:
                    run = Run("ours_multi_gpu", batch, h, w, status="error", reason=str(e))
                runs.append(run)
    finally:
        multi.close()
        free_memory()
    return runs


def _trust(runs: Sequence[Run], steps: int) -> list[str]:
    """The trust notes of every ok run (:func:`~.trust.trust_notes`), each also logged (warnings as warnings)."""
    notes = []
    for run in runs:
        if run.status != "ok":
            continue
        for line in trust_notes(run, steps):
            notes.append(line)
            if line.startswith("warning: "):
                logger.warning("bench: %s", line.removeprefix("warning: "))
            else:
                logger.info("bench: %s", line)
    return notes


def _memory_note(device: torch.device) -> str:
    if device.type == "cpu":
        return "CPU: wall-clock timings, no CUDA events; memory is not measured"
    return ("memory: torch_* counts torch's allocator only (ORT's arena is invisible to it); device_used is the "
            "whole device after the run (ORT arena, CUDA context, cuDNN/cuBLAS workspaces, other processes)")


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("onnxruntime", "diffusers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def _env(device: torch.device) -> dict[str, Any]:
    """The result's ``env``: device, GPU name and count, the clock used, tool versions."""
    return {
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "timing": "cuda_events" if device.type == "cuda" else "wall_clock",
        **_versions(),
    }


def _config_json(cfg: BenchConfig, manifest: Manifest, model_dir: Path | None, ours: _Ours
                 ) -> dict[str, Any]:
    """The result's ``config``: the bench settings and what the artifact resolved them to."""
    height, width = ours.sizes[0]
    return {
        "artifact": str(cfg.artifact),
        "model_dir": str(model_dir) if model_dir else None,
        "backend": manifest.backend.value,
        "precision": manifest.precision,
        "profile": manifest.profile_json,
        "steps": cfg.steps,
        "height": int(height),
        "width": int(width),
        "guidance_scale": float(cfg.guidance_scale),
        "seed": cfg.seed,
        "scheduler": ours.scheduler_name,
        "batch_sizes": list(cfg.batch_sizes),
        "devices": list(cfg.devices),
        "iters": cfg.iters,
        "warmup": cfg.warmup,
        "stage_iters": cfg.stage_iters,
        "baseline": cfg.baseline,
        "cuda_graph": cfg.cuda_graph,
        "vram_budget": cfg.vram_budget,
        "sizes": [list(hw) for hw in ours.sizes],
        "cudnn_conv_algo_search": cfg.cudnn_conv_algo_search,
        "deterministic": cfg.deterministic,
        "size_buckets": cfg.size_buckets,
    }

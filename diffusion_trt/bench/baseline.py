"""The diffusers baselines: ``diffusers_eager`` (``StableDiffusionPipeline`` from the source folder in the
artifact's precision: fp16 on CUDA for fp16 artifacts, always fp32 on the CPU; its default attention processor,
SDPA) and ``diffusers_cuda_graph`` (the same with the UNet call captured once per input shape in a
``torch.cuda.CUDAGraph`` and replayed; CUDA only). Diffusers runs each stage at the full batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..artifact.manifest import Manifest
from .clock import Clock, nvtx, time_stage
from .config import BenchConfig, call_kwargs
from .glue import glue_ms
from .memory import free_memory, memory_read, memory_start
from .result import Run, finish_e2e

logger = logging.getLogger(__name__)


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
    kwargs = call_kwargs(cfg, height, width, batch)
    with nvtx(f"bench {system} b={batch} e2e", device):
        samples = clock.wall_s(
            lambda: dpipe(**kwargs, generator=torch.Generator().manual_seed(cfg.seed)), cfg.iters, cfg.warmup
        )
    finish_e2e(run, samples)
    return run



def is_pipeline_folder(path: str | Path) -> bool:
    """Whether ``path`` is a diffusers pipeline folder (has ``model_index.json``)."""
    return (Path(path) / "model_index.json").is_file()


def baseline_mismatch(model_dir: Path, manifest: Manifest) -> str | None:
    """Why the diffusers baselines would not run the artifact's weights, or None: ``model_dir`` hashes differently
    from the manifest's ``source.sha256`` (another model, or the folder changed since compile), or LoRAs were merged
    into the artifact (the baseline runs the base weights)."""
    from ..artifact.folder import folder_hash

    if manifest.source_sha256 and folder_hash(model_dir) != manifest.source_sha256:
        return (f"{model_dir} is not the folder the artifact was compiled from (its sha256 differs from the "
                f"manifest's source {manifest.source_path}): the figures compare different weights")
    if manifest.loras:
        return "the artifact has LoRAs merged in; the diffusers baselines run the base weights without them"
    return None


#: The model_index.json components ``StableDiffusionPipeline`` (the baseline) loads.
BASELINE_COMPONENTS: tuple[str, ...] = ("text_encoder", "tokenizer", "unet", "vae", "scheduler")


def folder_kind(model_dir: Path) -> dict[str, Any]:
    """What the baseline needs to know of a pipeline folder, from its model_index.json and unet/config.json:
    ``pipeline_class``, ``architecture`` ("sdxl" with a second text encoder, else "sd"), ``unet_in_channels``
    (``None`` without a unet/config.json) and ``missing`` (the :data:`BASELINE_COMPONENTS` it lacks).

    Raises:
        ModelFolderError: model_index.json or unet/config.json is not a JSON object (naming it).
    """
    from ..artifact.folder import read_json_object

    index = read_json_object(model_dir / "model_index.json")
    unet_config = model_dir / "unet" / "config.json"
    unet = read_json_object(unet_config) if unet_config.is_file() else {}
    cls = str(index.get("_class_name", "?"))
    return {
        "pipeline_class": cls,
        "architecture": "sdxl" if "text_encoder_2" in index or cls.startswith("StableDiffusionXL") else "sd",
        "unet_in_channels": unet.get("in_channels"),
        "missing": [c for c in BASELINE_COMPONENTS if not (isinstance(index.get(c), list) and any(index[c]))],
    }


def architecture_mismatch(model_dir: Path, manifest: Manifest) -> tuple[str, str] | None:
    """Why the diffusers baseline cannot run ``model_dir`` next to the artifact, or None: the folder is of another
    architecture (SDXL for an SD artifact), its UNet takes other inputs (an inpainting UNet's 9 channels) or it lacks
    a component the baseline loads. Else the two sides, e.g. ("a StableDiffusionXLPipeline folder (architecture
    sdxl, UNet in_channels 4)", "a StableDiffusionPipeline (architecture sd, UNet in_channels 4)").

    Raises:
        ModelFolderError: the folder's model_index.json or unet/config.json is not a JSON object.
    """
    folder = folder_kind(model_dir)
    model = manifest.model
    arch, channels = model.architecture, int(model.unet_in_channels or 4)
    theirs = folder["unet_in_channels"]
    if not folder["missing"] and folder["architecture"] == arch and theirs in (None, channels):
        return None
    lacks = f", no {', '.join(folder['missing'])}" if folder["missing"] else ""
    return (f"a {folder['pipeline_class']} folder (architecture {folder['architecture']}, UNet in_channels "
            f"{'unknown' if theirs is None else theirs}{lacks})",
            f"a {manifest.pipeline_class or 'pipeline'} (architecture {arch}, UNet in_channels {channels})")


def diffusers_runs(
    cfg: BenchConfig,
    clock: Clock,
    model_dir: Path | None,
    manifest: Manifest,
    scheduler_template: Any,
    sizes: Sequence[tuple[int, int]],
    notes: list[str],
    say: Callable[[str], None],
) -> list[Run]:
    """Both diffusers baselines at every size and batch; "skipped" rows without a pipeline folder (or, for the
    graphed one, without CUDA), an "error" row for a CUDA-graph capture torch refuses."""
    systems = ("diffusers_eager", "diffusers_cuda_graph")
    shapes = [(h, w, b) for h, w in sizes for b in cfg.batch_sizes]
    if model_dir is None or not is_pipeline_folder(model_dir):
        reason = f"no diffusers pipeline folder (model_dir={model_dir}, no model_index.json); pass --model-dir"
        return [Run(s, b, h, w, status="skipped", reason=reason) for s in systems for h, w, b in shapes]
    mismatch = baseline_mismatch(model_dir, manifest)
    if mismatch:
        logger.warning("bench: %s", mismatch)
        notes.append(f"diffusers baselines: {mismatch}")
    dpipe = _load_diffusers(model_dir, manifest, clock.device, scheduler_template, notes, say)
    try:
        runs = [_measured(dpipe, "diffusers_eager", cfg, clock, shape, say) for shape in shapes]
        if clock.device.type != "cuda":
            return runs + [Run("diffusers_cuda_graph", b, h, w, status="skipped", reason="needs CUDA")
                           for h, w, b in shapes]
        graphed = GraphedUNet(dpipe.unet)
        try:
            return runs + [_measured(dpipe, "diffusers_cuda_graph", cfg, clock, shape, say) for shape in shapes]
        finally:
            graphed.remove()
    finally:
        del dpipe
        free_memory()


def _load_diffusers(model_dir: Path, manifest: Manifest, device: torch.device, scheduler_template: Any,
                    notes: list[str], say: Callable[[str], None]) -> Any:
    """``StableDiffusionPipeline`` from ``model_dir`` in the artifact's precision, with our scheduler's class and
    config; a note names its dtype, attention processors and scheduler."""
    from diffusers import StableDiffusionPipeline

    # the artifact's precision (fp16 on CUDA for the SD figures); fp32 on the CPU, which has no fp16 kernels
    dtype = torch.float16 if device.type == "cuda" and manifest.precision == "fp16" else torch.float32
    say(f"loading diffusers from {model_dir} ({dtype})")
    dpipe = StableDiffusionPipeline.from_pretrained(
        model_dir, torch_dtype=dtype, safety_checker=None, requires_safety_checker=False, local_files_only=True
    ).to(device)
    dpipe.set_progress_bar_config(disable=True)
    dpipe.scheduler = type(scheduler_template).from_config(scheduler_template.config)
    processors = {type(p).__name__ for p in dpipe.unet.attn_processors.values()}
    notes.append(
        f"diffusers: {dtype}, attention {', '.join(sorted(processors))}, scheduler {type(dpipe.scheduler).__name__}"
    )
    return dpipe


def _measured(dpipe: Any, system: str, cfg: BenchConfig, clock: Clock, shape: tuple[int, int, int],
              say: Callable[[str], None]) -> Run:
    """One baseline row with its memory; for the graphed system a capture torch refuses is an "error" row."""
    height, width, batch = shape
    say(f"{system} {height}x{width} b={batch}")
    memory_start([clock.device])
    try:
        run = bench_diffusers(dpipe, system, cfg, clock, batch, height, width)
    except RuntimeError as e:  # a capture torch refuses is a figure too
        if system != "diffusers_cuda_graph":
            raise
        return Run(system, batch, height, width, status="error", reason=f"{type(e).__name__}: {e}"[:500])
    run.memory_mb = memory_read([clock.device])
    return run

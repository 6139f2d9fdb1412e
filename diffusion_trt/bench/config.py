"""What ``diffusion-trt bench`` measures: :class:`BenchConfig`, checked once, and the call it makes per size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RuntimeInputError, names_arguments

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
        cuda_graph: passed to ``EnginePipeline.from_artifacts`` (``None``: on for static CUDA artifacts, ONNX
            Runtime's text encoder and VAE eager; ``True``: every engine).
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
    cudnn_conv_algo_search: str = "AUTO"
    deterministic: bool = False
    size_buckets: str | None = None

    def __post_init__(self) -> None:
        with names_arguments(*(f.name for f in dataclasses.fields(self))):  # the CLI names these by its options
            self._check()

    def _check(self) -> None:
        from ..runtime.engines.buckets import parse_size_buckets
        from ..runtime.engines.ort_engine import CONV_ALGO_SEARCH

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



def call_kwargs(cfg: BenchConfig, height: int, width: int, batch: int) -> dict[str, Any]:
    """The keyword arguments of one whole pipeline call (ours and diffusers'): PIL images out."""
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

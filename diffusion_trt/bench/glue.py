"""The ``scheduler_glue`` stage: the runtime's own denoising loop timed with a UNet that costs nothing.

Per step that is: CFG concat, ``scale_model_input``, CFG combine, ``scheduler.step`` — the loop of
:mod:`diffusion_trt.runtime.denoise`, run through :func:`run_loop` (the one call into it) with
:class:`FixedNoiseUNet` in place of the UNet engine, so the figure is the loop the pipeline runs, without the UNet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .clock import Clock


@dataclass(frozen=True)
class _DtypeOnly:
    torch_dtype: torch.dtype


class _Spec:
    """The part of an :class:`~diffusion_trt.runtime.engines.engine.EngineSpec` the loop reads: the sample's dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._info = _DtypeOnly(dtype)

    def input(self, _name: str) -> _DtypeOnly:
        return self._info


class FixedNoiseUNet:
    """A UNet engine stand-in whose ``run`` returns one fixed ``noise_pred`` [B2, C, h, w] and computes nothing."""

    def __init__(self, noise_pred: torch.Tensor) -> None:
        self.device = noise_pred.device
        self.spec = _Spec(noise_pred.dtype)
        self._out = {"noise_pred": noise_pred}

    def run(self, _feeds: dict[str, Any]) -> dict[str, torch.Tensor]:
        return self._out


def run_loop(unet: Any, scheduler: Any, latents: torch.Tensor, timesteps: torch.Tensor,
             guidance_scale: float) -> torch.Tensor:
    """The runtime's denoising loop (:func:`diffusion_trt.runtime.denoise.denoise_latents`) over ``unet`` from
    ``latents`` [b, C, h, w]; the scheduler has had ``set_timesteps``. The only call bench makes into the loop.

    The prompt embeddings are a placeholder [2b, 0] with CFG (``guidance_scale`` > 1), else [b, 0] (the stand-in
    UNet ignores its feeds; the loop reads only their batch); no ``eta``/``generator`` step arguments.
    """
    from ..runtime import denoise

    unet_batch = latents.shape[0] * (2 if guidance_scale > 1.0 else 1)
    placeholder = latents.new_empty((unet_batch, 0))
    return denoise.denoise_latents(unet=unet, scheduler=scheduler, prompt_embeds=placeholder, latents=latents,
                                   timesteps=timesteps, guidance_scale=guidance_scale, extra={})


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

    Args:
        latents: [b, C, h, w] start latents; noise_pred: [2b, C, h, w], what the UNet "returns" every step.
        host_timesteps: hand the scheduler CPU timesteps (our loop) or device timesteps (diffusers' loop).

    Without CFG (``guidance_scale`` <= 1) the loop runs as the pipeline does: the UNet batch is b (the first b rows
    of ``noise_pred``), no concat or combine.
    """
    from ..runtime import denoise

    unet = FixedNoiseUNet(noise_pred if guidance_scale > 1.0 else noise_pred[: latents.shape[0]])

    def loop() -> None:
        sched = denoise.fresh_scheduler(scheduler)
        sched.set_timesteps(steps, device=latents.device)
        timesteps = denoise.host_timesteps(sched) if host_timesteps else sched.timesteps
        run_loop(unet, sched, latents, timesteps, guidance_scale)

    return clock.stage_ms(loop, iters, warmup) / steps

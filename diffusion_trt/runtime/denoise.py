"""The text-to-image denoising loop on compiled engines, step for step as diffusers' StableDiffusionPipeline.

Reproduces ``diffusers.StableDiffusionPipeline.__call__`` (diffusers 0.3x-0.4x) for the same seed,
scheduler and steps: CLIP tokenisation padded to 77, the negative prompt "" by default, prompt embeddings
repeated per image, classifier-free guidance (CFG) as ONE batch ``[negative; positive]`` when
``guidance_scale > 1``, latents from ``diffusers.utils.torch_utils.randn_tensor`` times
``scheduler.init_noise_sigma``, timesteps as diffusers' ``retrieve_timesteps`` sets them, the scheduler's own
``scale_model_input`` and ``step``, and decoding of ``latents / scaling_factor``.

Everything stays on the engines' device as torch tensors; the loop itself reads nothing back to the host
(no ``.item()``, no ``.cpu()``), so on CUDA with a shared stream it is enqueued without waiting. (Some
diffusers schedulers sync once on their first step when they look up the step index; that is theirs.)

Shapes: ``B`` images = prompts x images per prompt; ``B2`` = 2B with CFG, B without; latents
``[B, 4, H/8, W/8]``; text embeddings ``[B2, 77, D]``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from .engine import Engine

logger = logging.getLogger(__name__)

#: ``callback(step_index, timestep, latents)``: called after every scheduler step, with the timestep (0-d
#: tensor) and the latents [B, 4, h, w] on the engine device. Reading them on the host syncs the device.
StepCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
Generator = torch.Generator | list[torch.Generator] | None


def _run_rows(engine: Engine, input_name: str, x: torch.Tensor, output_name: str) -> torch.Tensor:
    """Run a row-independent engine on ``x`` [N, ...], padding or chunking N to the engine's batch range.

    Returns a fresh tensor (never an engine buffer).
    """
    info = engine.spec.input(input_name)
    lo, hi = info.min[0], info.max[0]
    n = x.shape[0]
    outs: list[torch.Tensor] = []
    for start in range(0, n, hi):
        chunk = x[start : start + hi]
        rows = chunk.shape[0]
        if rows < lo:  # e.g. one prompt without CFG on an engine built for batch >= 2
            chunk = torch.cat([chunk, chunk[-1:].expand(lo - rows, *chunk.shape[1:])])
        # clone: the engine overwrites its output buffer on the next chunk (and the next call)
        outs.append(engine.run({input_name: chunk})[output_name][:rows].clone())
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def tokenize(tokenizer: Any, texts: Sequence[str], device: torch.device) -> torch.Tensor:
    """CLIP token ids [N, model_max_length] int64, as diffusers: pad to max length, truncate, warn on truncation."""
    max_length = tokenizer.model_max_length
    ids = tokenizer(
        list(texts), padding="max_length", max_length=max_length, truncation=True, return_tensors="pt"
    ).input_ids
    untruncated = tokenizer(list(texts), padding="longest", return_tensors="pt").input_ids
    if untruncated.shape[-1] > ids.shape[-1]:
        removed = tokenizer.batch_decode(untruncated[:, max_length - 1 : -1])
        logger.warning(
            "The following part of your input was truncated because CLIP can only handle sequences up to %d tokens: %s",
            max_length,
            removed,
        )
    return ids.to(device=device, dtype=torch.int64)


def encode_prompt(
    text_encoder: Engine,
    tokenizer: Any,
    prompts: Sequence[str],
    negative_prompts: Sequence[str] | None,
    num_images_per_prompt: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Text embeddings for the UNet, diffusers' ``encode_prompt`` then the CFG concatenation.

    Args:
        prompts: P prompts.
        negative_prompts: P negative prompts, or ``None`` for no CFG.
        num_images_per_prompt: N; each prompt's embedding is repeated N times in a row.
        dtype: the UNet's ``encoder_hidden_states`` dtype.

    Returns:
        [2*P*N, 77, D] ``[negative; positive]`` with CFG, [P*N, 77, D] without; a fresh tensor.
    """
    device = text_encoder.device
    texts = list(prompts) if negative_prompts is None else [*negative_prompts, *prompts]
    ids = tokenize(tokenizer, texts, device)
    embeds = _run_rows(text_encoder, "input_ids", ids, "last_hidden_state").to(dtype)

    def per_image(e: torch.Tensor) -> torch.Tensor:
        # diffusers' "mps friendly" duplication: repeat along the sequence axis, then view
        bs, seq_len, _ = e.shape
        return e.repeat(1, num_images_per_prompt, 1).view(bs * num_images_per_prompt, seq_len, -1)

    if negative_prompts is None:
        return per_image(embeds)
    negative, positive = embeds.chunk(2)
    return torch.cat([per_image(negative), per_image(positive)])


def prepare_latents(
    scheduler: Any,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    generator: Generator,
    latents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Initial latents [B, C, h, w]: ``randn_tensor`` (seed-compatible with diffusers) times ``init_noise_sigma``."""
    from diffusers.utils.torch_utils import randn_tensor

    if latents is None:
        latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
    else:
        latents = latents.to(device=device, dtype=dtype)
    return latents * scheduler.init_noise_sigma


def step_kwargs(scheduler: Any, generator: Generator, eta: float) -> dict[str, Any]:
    """``eta`` and ``generator`` for schedulers whose ``step`` takes them (diffusers' prepare_extra_step_kwargs)."""
    params = set(inspect.signature(scheduler.step).parameters)
    kwargs: dict[str, Any] = {}
    if "eta" in params:
        kwargs["eta"] = eta
    if "generator" in params:
        kwargs["generator"] = generator
    return kwargs


def decode_latents(vae_decoder: Engine, latents: torch.Tensor, scaling_factor: float) -> torch.Tensor:
    """Images [B, 3, H, W] in about [-1, 1] from latents [B, 4, h, w].

    **Returns the engine's output buffer** (overwritten by its next run); :func:`postprocess` copies.
    """
    dtype = vae_decoder.spec.input("latent_sample").torch_dtype
    return vae_decoder.run({"latent_sample": (latents / scaling_factor).to(dtype)})["sample"]


def postprocess(image: torch.Tensor, output_type: str) -> list[Any] | np.ndarray | torch.Tensor:
    """diffusers' ``VaeImageProcessor.postprocess``: denormalise to [0, 1], then convert.

    Args:
        image: [B, 3, H, W] in about [-1, 1].
        output_type: "pt" -> float tensor [B, 3, H, W] in [0, 1] on the device; "np" -> float32 array
            [B, H, W, 3]; "pil" -> list of RGB ``PIL.Image`` (uint8 = round(x * 255)).
    """
    image = (image * 0.5 + 0.5).clamp(0, 1)
    if output_type == "pt":
        return image
    array = image.cpu().permute(0, 2, 3, 1).float().numpy()
    if output_type == "np":
        return array
    from PIL import Image

    return [Image.fromarray(a) for a in (array * 255).round().astype("uint8")]


def text_to_image(
    *,
    text_encoder: Engine,
    unet: Engine,
    vae_decoder: Engine | None,
    tokenizer: Any,
    scheduler: Any,
    prompts: Sequence[str],
    negative_prompts: Sequence[str],
    num_images_per_prompt: int,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float,
    generator: Generator,
    latents: torch.Tensor | None,
    eta: float,
    num_channels_latents: int,
    vae_scale_factor: int,
    vae_scaling_factor: float,
    progress: bool = True,
    callback: StepCallback | None = None,
) -> torch.Tensor:
    """Run the whole text-to-image loop; arguments are assumed validated (see ``EnginePipeline.__call__``).

    Args:
        prompts, negative_prompts: P strings each (negatives ignored when ``guidance_scale <= 1``).
        latents: optional initial noise [P*N, C, h, w] (before ``init_noise_sigma``).
        vae_decoder: ``None`` to return the final latents instead of images.

    Returns:
        Decoded images [P*N, 3, H, W] in about [-1, 1] (a VAE engine buffer: postprocess or clone it before
        the next call), or the final latents [P*N, C, h, w] when ``vae_decoder`` is None.
    """
    device = unet.device
    do_cfg = guidance_scale > 1.0
    batch = len(prompts) * num_images_per_prompt
    sample_dtype = unet.spec.input("sample").torch_dtype
    text_dtype = unet.spec.input("encoder_hidden_states").torch_dtype

    # 1. encode prompt: [negative; positive] in one batch with CFG
    prompt_embeds = encode_prompt(
        text_encoder, tokenizer, prompts, negative_prompts if do_cfg else None, num_images_per_prompt, text_dtype
    )

    # 2. prepare latents (timesteps first, like diffusers; neither draws random numbers before the latents)
    # what diffusers' retrieve_timesteps does without custom timesteps/sigmas (importing it would import the
    # whole StableDiffusionPipeline module, transformers' image processors included)
    scheduler.set_timesteps(num_inference_steps, device=device)
    timesteps = scheduler.timesteps
    num_inference_steps = len(timesteps)
    shape = (batch, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
    latents = prepare_latents(scheduler, shape, sample_dtype, device, generator, latents)
    extra = step_kwargs(scheduler, generator, eta)
    unet_batch = prompt_embeds.shape[0]
    # the UNet's float32 timestep input for every step, built once: row i is contiguous, no per-step allocation
    timestep_feeds = timesteps.to(device=device, dtype=torch.float32)[:, None].expand(-1, unet_batch).contiguous()

    # 3. denoise
    with tqdm(total=len(timesteps), disable=not progress, desc="denoise", unit="step") as bar:
        for i, t in enumerate(timesteps):
            latent_model_input = torch.cat([latents] * 2) if do_cfg else latents
            if hasattr(scheduler, "scale_model_input"):
                latent_model_input = scheduler.scale_model_input(latent_model_input, t)
            noise_pred = unet.run(
                {
                    "sample": latent_model_input.to(sample_dtype),
                    "timestep": timestep_feeds[i],
                    "encoder_hidden_states": prompt_embeds,
                }
            )["noise_pred"]
            if do_cfg:
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
            else:
                # the engine overwrites its output buffer next step; multistep schedulers keep past outputs
                noise_pred = noise_pred.clone()
            latents = scheduler.step(noise_pred, t, latents, **extra, return_dict=False)[0]
            if callback is not None:
                callback(i, t, latents)
            bar.update()

    # 4. decode
    if vae_decoder is None:
        return latents
    return decode_latents(vae_decoder, latents, vae_scaling_factor)

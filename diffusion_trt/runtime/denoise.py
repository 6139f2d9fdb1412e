"""The denoising loop on compiled engines, step for step as diffusers' pipelines: :func:`generate`.

One loop serves every mode: a checked :class:`~.request.Request` carries its :class:`~.conditioning.Conditioning`
(text-to-image, image-to-image, inpainting, SDXL), which decides the schedule's start, the initial latents, the
prompt encoding and what each step adds; the loop itself has no mode flags.

Text-to-image reproduces ``diffusers.StableDiffusionPipeline.__call__`` (diffusers 0.3x-0.4x) for the same seed,
scheduler and steps: CLIP tokenisation padded to 77, the negative prompt "" by default, prompt embeddings
repeated per image, classifier-free guidance (CFG) as ONE batch ``[negative; positive]`` when
``guidance_scale > 1``, latents from ``diffusers.utils.torch_utils.randn_tensor`` times
``scheduler.init_noise_sigma``, timesteps as diffusers' ``retrieve_timesteps`` sets them, the scheduler's own
``scale_model_input`` and ``step``, and decoding of ``latents / scaling_factor``. Image-to-image and inpainting run
the same loop from a later step with the image's latents (and, for inpainting, the mask): see
:mod:`.image_inputs`; SDXL encodes with two text encoders and adds UNet inputs: see :mod:`.sdxl`.

Beyond diffusers:

* the text encoder runs ONCE per request, over the distinct texts not already cached (negative prompts are
  cached per (text, engine) in a small LRU, :class:`~.text_embeddings.EmbeddingCache`);
* a request larger than the engines' batch profile runs in chunks (:mod:`.batching`): the latents of the
  whole request are drawn once and sliced, so the noise of an image does not depend on the chunking;
* images leave the GPU as uint8 (or float32 for "np") in one asynchronous copy per chunk into a pinned
  host buffer reused across calls (:mod:`.cuda`);
* each stage runs inside ``with engines.stages.stage(...)`` ("text", then "unet" and "vae" per chunk,
  :mod:`.memory.stages`): under a VRAM budget that is where engines open and others are released, and where the
  "vae" stage picks the whole or the tiled decode from the plan; the engines run unwrapped.

Host syncs. Everything stays on the engines' device; the loop reads nothing back (no ``.item()``, no
``.cpu()``) and hands the scheduler the timestep as a **CPU** tensor (taken once, before anything is queued),
so the scheduler's index arithmetic runs on the host. Audit of diffusers 0.42's ``step`` with CUDA latents:

* pndm / ddim / ddpm: index ``alphas_cumprod[t]`` and test ``prev_t >= 0``; with a CUDA ``t`` (what diffusers
  passes) that is 2 syncs per step, with our CPU ``t`` none.
* euler / euler_a / heun / lms / dpm++ (and other ``index_for_timestep`` schedulers): ``sigmas`` live on the
  CPU; only the first call looks its step index up with ``nonzero().item()`` (1 sync). We pin it with
  ``set_begin_index`` to the index diffusers' rule would find (computed on the host), so: no sync.
* schedulers that draw noise in ``step`` (euler_a, ddpm, dpm++_sde, dpm2_a) with a CPU generator draw on the
  CPU and copy to the device from pageable memory every step: the driver may synchronise there. That is the
  price of diffusers-identical seeds; a CUDA generator avoids it but gives other images.

The glue between engine calls (CFG combine, scheduler step, latent scaling) stays eager torch on the GPU: the
schedulers keep Python state (step index, past model outputs) that a CUDA graph capture would freeze. With
CUDA streams shared by ONNX Runtime and torch it is only enqueued, never waited for.

Shapes: ``B`` images = prompts x images per prompt; ``B2`` = 2b with CFG, b without, for a chunk of b images;
latents ``[B, 4, H/8, W/8]``; text embeddings ``[B2, 77, D]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..errors import RuntimeInputError
from .cuda import HostBuffers, HostImageSink, images_float, images_uint8, nvtx_range, to_pil
from .embeddings import EmbeddingTable
from .engines.engine import Engine, EngineSpec
from .image_inputs import strength_start
from .latents import Generator, StepCallback, StepEnd
from .memory.stages import Stages
from .prompt_encoding import PromptReader
from .schedulers import build_scheduler, check_step_count, short_name
from .text_embeddings import EmbeddingCache, encode_prompt_embeds

if TYPE_CHECKING:
    from .conditioning import ChunkConditioning
    from .controlnet import ChunkControl, ControlPlan
    from .memory.vae_tiling import TiledVaeDecoder
    from .request import Request

logger = logging.getLogger(__name__)

def step_kwargs(scheduler: Any, generator: Generator, eta: float) -> dict[str, Any]:
    """``eta`` and ``generator`` for schedulers whose ``step`` takes them (diffusers' prepare_extra_step_kwargs)."""
    params = set(inspect.signature(scheduler.step).parameters)
    kwargs: dict[str, Any] = {}
    if "eta" in params:
        kwargs["eta"] = eta
    if "generator" in params:
        kwargs["generator"] = generator
    return kwargs


def rescale_noise_cfg(noise_cfg: torch.Tensor, noise_pred_text: torch.Tensor, guidance_rescale: float
                      ) -> torch.Tensor:
    """diffusers' ``rescale_noise_cfg`` (Lin et al. 2023, "Common Diffusion Noise Schedules and Sample Steps are
    Flawed", 3.4): the CFG prediction [b, C, h, w] rescaled to the text prediction's per-image std, mixed back by
    ``guidance_rescale`` (0 = ``noise_cfg`` unchanged, 1 = fully rescaled)."""
    dims = list(range(1, noise_pred_text.ndim))
    rescaled = noise_cfg * (noise_pred_text.std(dim=dims, keepdim=True) / noise_cfg.std(dim=dims, keepdim=True))
    return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg


def decode_latents(vae_decoder: Engine, latents: torch.Tensor, scaling_factor: float,
                   tiled: TiledVaeDecoder | None = None) -> torch.Tensor:
    """Images [B, 3, H, W] in about [-1, 1] from latents [B, 4, h, w]; ``tiled``: decode tile by tile with it (the
    "vae" stage's choice, :class:`~.memory.stages.Stage`), ``None`` = whole.

    **May return the engine's output buffer** (overwritten by its next run); :func:`postprocess` copies.
    """
    dtype = vae_decoder.spec.input("latent_sample").torch_dtype
    decoder = tiled if tiled is not None else vae_decoder
    return decoder.run({"latent_sample": (latents / scaling_factor).to(dtype)})["sample"]


def _nonfinite_flag(x: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor:
    """``flag`` or-ed with "``x`` holds a NaN or Inf", kept on the device (no host sync)."""
    bad = ~torch.isfinite(x).all()
    return bad if flag is None else flag | bad


def warm_loop_kernels(unet: EngineSpec, vae_decoder: EngineSpec | None, device: torch.device,
                      scaling_factor: float) -> bool:
    """Run once, on zeros, the torch work of a text-to-image call around its engines (the CFG batch and its split,
    the casts, the NaN/Inf flag, the decode's scaling, both host-output conversions, a CPU generator's latents
    copied over), at the shapes of static ``unet`` / ``vae_decoder`` specs, on the current stream; waits for the
    device. So a process's first call does not load those CUDA kernels itself (each kernel is loaded on its first
    launch: CUDA's lazy loading): ``from_artifacts`` runs it on the calling thread while the engines still open (on
    the CPU it only costs time). The scheduler's own arithmetic is left out (diffusers may not be imported yet).
    Returns whether it ran: static specs only."""
    if not unet.is_static or (vae_decoder is not None and not vae_decoder.is_static):
        return False
    sample = unet.input("sample")
    batch, channels, h, w = sample.min
    latents = torch.randn((max(1, batch // 2), channels, h, w), generator=torch.Generator().manual_seed(0))
    latents = latents.to(device) * 1.0  # diffusers' randn_tensor with a CPU generator, then init_noise_sigma
    cfg = torch.cat([latents] * 2).to(sample.torch_dtype)
    uncond, text = cfg.chunk(2)
    noise = uncond + 7.5 * (text - uncond)
    flag = _nonfinite_flag(noise.float(), None)
    timesteps = torch.arange(4, dtype=torch.int64).to(device=device, dtype=torch.float32)
    timesteps[:, None].expand(-1, cfg.shape[0]).contiguous()
    if vae_decoder is not None:
        (latents / scaling_factor).to(vae_decoder.input("latent_sample").torch_dtype)
        out = vae_decoder.output("sample")
        image = torch.zeros(tuple(out.min), dtype=out.torch_dtype, device=device)
        flag = _nonfinite_flag(image, flag)
        images_uint8(image)
        images_float(image)
    bool(flag)  # the device flag read back: the first call's one sync
    return True


def _warn_nonfinite(flag: torch.Tensor | None) -> None:
    """One warning when any decoded image (or final latents) held NaN/Inf: they come out black or garbled, as in
    diffusers, but not silently. Reads the device flag once, after the loop."""
    if flag is not None and bool(flag):
        logger.warning("the generated images hold NaN/Inf values (they come out black): an fp16 overflow, a LoRA "
                       "scale, guidance scale or prompt weight such as (word:50) too large, or non-finite weights; "
                       "check the LoRA, guidance and prompt weights, or compile --precision fp32 to compare")


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


def host_timesteps(scheduler: Any) -> torch.Tensor:
    """The scheduler's timesteps as a CPU tensor (one device->host copy, taken before anything is queued)."""
    return scheduler.timesteps.detach().cpu()


def pin_begin_index(scheduler: Any, timesteps: torch.Tensor) -> None:
    """Give ``index_for_timestep`` schedulers their first step index up front (no ``nonzero().item()`` sync).

    The index is diffusers' own rule (``index_for_timestep`` of the first timestep: the second match when the
    timestep repeats, else the first), computed on the host copy ``timesteps``. Schedulers without
    ``set_begin_index`` (pndm, ddim, ddpm) are left alone.
    """
    if not hasattr(scheduler, "set_begin_index") or getattr(scheduler, "begin_index", 0) is not None:
        return
    if len(timesteps) == 0:
        return
    matches = (timesteps == timesteps[0]).nonzero()
    scheduler.set_begin_index(int(matches[1 if len(matches) > 1 else 0]))


def denoise_latents(
    *,
    unet: Engine,
    scheduler: Any,
    prompt_embeds: torch.Tensor,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    timestep_values: torch.Tensor | None = None,
    guidance_scale: float,
    extra: dict[str, Any],
    guidance_rescale: float = 0.0,
    bar: Any = None,
    callback: StepCallback | None = None,
    step_end: StepEnd | None = None,
    conditioning: ChunkConditioning | None = None,
    added_inputs: Mapping[str, torch.Tensor] | None = None,
    control: ChunkControl | None = None,
) -> torch.Tensor:
    """The denoising loop of one chunk; the scheduler has had ``set_timesteps``.

    Args:
        prompt_embeds: [B2, 77, D] (``[negative; positive]`` with CFG) in the UNet's dtype.
        latents: [b, C, h, w] initial latents (already times ``init_noise_sigma``).
        timesteps: the schedule as a CPU tensor (:func:`host_timesteps`).
        timestep_values: the same as float32 on the engine device (made once per request: a blocking
            host->device copy syncs the stream); ``None`` = copy here.
        guidance_scale: CFG scale; > 1 means CFG (B2 = 2b).
        extra: scheduler step kwargs (:func:`step_kwargs`).
        guidance_rescale: with CFG and > 0, :func:`rescale_noise_cfg` after the combine (diffusers').
        bar: a tqdm bar updated once per step, or ``None``.
        step_end: diffusers' ``callback_on_step_end`` (:class:`~.latents.StepEnd`): after each step, before
            ``callback``; the latents it returns go on; the steps after it set ``pipe._interrupt`` are skipped.
        conditioning: inpainting: a :class:`~.conditioning.ChunkConditioning` (the 9-channel UNet input, or the
            4-channel blend after each step); ``None`` for text-to-image and image-to-image.
        added_inputs: further UNet inputs, the same every step (SDXL: ``text_embeds`` [B2, E] and ``time_ids``
            [B2, 6], see :mod:`.sdxl`); ``None`` for SD 1.x/2.x.
        control: ControlNets: the residual inputs of each step (``unet`` is then ``unet_controlnet``, see
            :mod:`.controlnet`); ``None`` without.

    Returns:
        The final latents [b, C, h, w] (a fresh tensor, the scheduler's dtype).
    """
    device = unet.device
    do_cfg = guidance_scale > 1.0
    sample_dtype = unet.spec.input("sample").torch_dtype
    unet_batch = prompt_embeds.shape[0]
    if timestep_values is None:
        timestep_values = timesteps.to(device=device, dtype=torch.float32)
    # the UNet's float32 timestep input for every step, built once: row i is contiguous, no per-step allocation
    timestep_feeds = timestep_values[:, None].expand(-1, unet_batch).contiguous()
    pin_begin_index(scheduler, timesteps)
    for i, t in enumerate(timesteps):
        if step_end is not None and step_end.interrupted:  # diffusers' `if self.interrupt: continue`
            break
        with nvtx_range(f"step {i}", device):
            latent_model_input = torch.cat([latents] * 2) if do_cfg else latents
            if hasattr(scheduler, "scale_model_input"):
                latent_model_input = scheduler.scale_model_input(latent_model_input, t)
            residuals = {}
            if control is not None:  # ControlNets see the 4-channel input, as diffusers' ControlNet pipelines
                with nvtx_range("controlnet", device):
                    residuals = control.residuals(i, len(timesteps), latent_model_input, latents, scheduler, t,
                                                  timestep_feeds[i], prompt_embeds, added_inputs)
            if conditioning is not None:  # inpainting UNet: cat([latents, mask, masked_image_latents], dim=1)
                latent_model_input = conditioning.unet_sample(latent_model_input)
            with nvtx_range("unet", device):
                noise_pred = unet.run(
                    {
                        "sample": latent_model_input.to(sample_dtype),
                        "timestep": timestep_feeds[i],
                        "encoder_hidden_states": prompt_embeds,
                        **(added_inputs or {}),
                        **residuals,
                    }
                )["noise_pred"]
            with nvtx_range("scheduler", device):
                if do_cfg:
                    noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                    noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
                    if guidance_rescale > 0.0:
                        noise_pred = rescale_noise_cfg(noise_pred, noise_pred_text, guidance_rescale)
                else:
                    # the engine overwrites its output buffer next step; multistep schedulers keep past outputs
                    noise_pred = noise_pred.clone()
                latents = scheduler.step(noise_pred, t, latents, **extra, return_dict=False)[0]
                if conditioning is not None:  # 4-channel inpainting: the unmasked area follows the image
                    latents = conditioning.after_step(scheduler, latents, i, timesteps)
        if step_end is not None:
            latents = step_end(i, t, latents)
        if callback is not None:
            callback(i, t, latents)
        if bar is not None:
            bar.update()
    return latents


def fresh_scheduler(scheduler: Any) -> Any:
    """A new instance of ``scheduler``'s class and config (schedulers are stateful: one per chunk)."""
    return build_scheduler(type(scheduler), scheduler.config)


@dataclass(frozen=True)
class LoopEngines:
    """What the loop runs on: the engines of one pipeline, its tokenizer and its reusable state.

    Attributes:
        text_encoder, unet: the engines (SDXL's second text encoder rides in the request's conditioning).
        vae_decoder: the VAE decoder; ``None`` only for ``output_type="latent"``.
        tokenizer: the ``CLIPTokenizer`` of ``text_encoder``.
        scaling_factor: ``vae.config.scaling_factor``: latents are decoded as ``latents / scaling_factor``.
        embedding_cache: negative-prompt embeddings cache, or ``None``.
        embeddings: the textual-inversion embeddings loaded (:mod:`.embeddings`), or ``None``.
        host_buffers: where "pil"/"np" results land (pinned on CUDA, reused across calls); ``None`` = fresh.
        copy_stream: CUDA side stream for the device->host copies (overlap the next chunk); ``None`` = the
            current stream.
        stages: the stage context the loop enters around each stage's engine runs (:mod:`.memory.stages`; a VRAM
            budget's :class:`~.memory.residency.Residency` opens and releases engines there); default: all open.
    """

    text_encoder: Engine
    unet: Engine
    vae_decoder: Engine | None
    tokenizer: Any
    scaling_factor: float
    embedding_cache: EmbeddingCache | None = None
    embeddings: EmbeddingTable | None = None
    host_buffers: HostBuffers | None = None
    copy_stream: Any = None
    stages: Stages = field(default_factory=Stages)


def generate(request: Request, engines: LoopEngines, scheduler: Any, control: ControlPlan | None = None) -> Any:
    """Run a whole checked request (:meth:`~.request.Request.build`) in any mode: the loop written out once.

    Args:
        request: the checked call (prompts, sizes, steps, generator, chunks, mode's conditioning, output type).
        engines: the engines and state it runs on.
        scheduler: a fresh diffusers scheduler (its ``set_timesteps`` is called here).
        control: the call's ControlNets (:func:`~.controlnet.control_plan`): the loop runs on ``control.unet``;
            ``None`` = none.

    Returns:
        The images in ``request.output_type``: "pil" (list of B ``PIL.Image``), "np" (float32 [B, H, W, 3] in
        [0, 1]), "pt" (float [B, 3, H, W] in [0, 1] on the device) or "latent" (final latents [B, C, h, w] on the
        device); host results are copies the caller owns, "pt"/"latent" fresh device tensors; B = P x N images,
        prompt-major.

    Raises:
        RuntimeInputError: ``num_inference_steps`` the scheduler cannot run (:func:`set_schedule`).
    """
    unet = engines.unet if control is None else control.unet
    device = unet.device
    cond = request.conditioning
    sample_dtype = unet.spec.input("sample").torch_dtype
    text_dtype = unet.spec.input("encoder_hidden_states").torch_dtype
    # 0. timesteps (what diffusers' retrieve_timesteps does without custom timesteps/sigmas) and 1. latents
    # of the WHOLE request, drawn once (the generator stream of one diffusers call) and sliced per chunk. Both
    # copy host->device blockingly, so they come before any engine work is queued (neither encoding the
    # prompt nor setting timesteps draws random numbers: the order does not change the images).
    timesteps = set_schedule(scheduler, request.num_inference_steps, device, request.schedule,
                             getattr(cond, "strength", None))
    # with a custom schedule, diffusers' retrieve_timesteps makes num_inference_steps the schedule's length
    steps = request.num_inference_steps if request.schedule is None else len(timesteps)
    timesteps, begin_index = cond.start(scheduler, steps, timesteps)
    timestep_values = timesteps.to(device=device, dtype=torch.float32)
    if control is not None:
        control.warn_idle(len(timesteps))
    prepared = cond.prepare(scheduler, timesteps, request.latent_shape, sample_dtype, device, request.generator,
                            request.latents)
    _expect_decodes(request, engines, prepared.latents)
    # 2. encode prompt: one text-encoder run over the distinct texts, then one row per image
    n = request.num_images_per_prompt
    with engines.stages.stage("text") if encodes_text(request) else contextlib.nullcontext():
        positive, negative, added = encode(request, engines, text_dtype)
    positive = positive.repeat_interleave(n, dim=0)
    negative = negative.repeat_interleave(n, dim=0) if negative is not None else None
    added = added.repeat_interleave(n) if added is not None else None
    sink = _host_sink(request, engines, device)
    parts: list[torch.Tensor] = []
    nonfinite: torch.Tensor | None = None  # device flag: any image (or final latents) with NaN/Inf

    # 3. denoise, 4. decode: chunk after chunk
    with tqdm(total=len(timesteps) * len(request.chunks), disable=not request.progress, desc="denoise",
              unit="step") as bar:
        for k, rows in enumerate(request.chunks):
            sched = scheduler if k == 0 else _chunk_scheduler(scheduler, request, begin_index, device)
            embeds = positive[rows.start : rows.stop]
            if negative is not None:
                embeds = torch.cat([negative[rows.start : rows.stop], embeds])
            with nvtx_range(f"denoise chunk {k}", device), engines.stages.stage("unet", (unet.name,)):
                final = denoise_latents(
                    unet=unet, scheduler=sched, prompt_embeds=embeds, latents=prepared.latents[rows.start : rows.stop],
                    timesteps=timesteps, timestep_values=timestep_values, guidance_scale=request.guidance_scale,
                    extra=step_kwargs(sched, _chunk_generator(request, rows), request.eta),
                    guidance_rescale=request.guidance_rescale, bar=bar,
                    callback=request.callback, step_end=request.step_end,
                    conditioning=prepared.rows(rows, request.do_cfg),
                    added_inputs=None if added is None else added.unet_inputs(rows, unet),
                    control=None if control is None else control.rows(rows, request.batch, n, request.do_cfg),
                )
            nonfinite = _finish_chunk(final, rows, request.output_type, engines, sink, parts, nonfinite)
    _warn_nonfinite(nonfinite)
    if sink is None:
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    host = sink.finish().numpy()
    return to_pil(host) if request.output_type == "pil" else host.copy()  # the host buffer is reused by the next call


def encodes_text(request: Request) -> bool:
    """Whether step 2 runs a text encoder (so the loop enters the "text" stage): always for prompts; with given
    ``prompt_embeds`` only to encode the negative prompts of CFG (no ``negative_prompt_embeds``, and not SDXL's zero
    negatives)."""
    if request.prompt_embeds is None:
        return True
    zero_negative = bool(getattr(request.conditioning, "zero_negative", False))
    return request.do_cfg and request.negative_prompt_embeds is None and not zero_negative


def encode(request: Request, engines: LoopEngines, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """2. encode prompt, once per prompt: (positive [P, S, D], negative [P, S, D] or ``None``, the mode's added UNet
    inputs or ``None``) in ``dtype`` on the engines' device, from the prompts or the caller's embeddings."""
    cond = request.conditioning
    reader = prompt_reader(engines, request)
    negatives = request.negative_prompts if request.do_cfg else None
    if request.pooled_prompt_embeds is not None:  # SDXL's prompt_embeds
        return cond.encode_given(  # type: ignore[attr-defined,no-any-return]
            engines.text_encoder, reader, (request.prompt_embeds, request.pooled_prompt_embeds,
                                           request.negative_prompt_embeds, request.negative_pooled_prompt_embeds),
            negatives, dtype)
    if request.prompt_embeds is not None:
        positive, negative = given_embeddings(request, engines, reader, dtype)
        return positive, negative, None
    return cond.encode(engines.text_encoder, reader, request.prompts, negatives, dtype, engines.embedding_cache)


def prompt_reader(engines: LoopEngines, request: Request) -> PromptReader:
    """How the request's texts become token chunks: its syntax and clip skip, and as many 77-token chunks as the
    UNet's ``encoder_hidden_states`` profile allows (77 * ``compile --max-prompt-chunks``)."""
    length = int(engines.tokenizer.model_max_length)
    seq_max = engines.unet.spec.input("encoder_hidden_states").max[1]
    return PromptReader(engines.tokenizer, request.prompt_syntax, max(1, int(seq_max) // length), request.clip_skip,
                        engines.embeddings)


def given_embeddings(request: Request, engines: LoopEngines, reader: PromptReader, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The caller's ``prompt_embeds`` [P, S, D] (and ``negative_prompt_embeds``) in the UNet's dtype and device, as
    diffusers' ``encode_prompt`` takes them; with CFG and no negative embeddings, the negative prompts are encoded
    and cut or padded to S / 77 chunks (diffusers pads the negative tokens to ``prompt_embeds.shape[1]``)."""
    device = engines.unet.device
    positive = request.prompt_embeds.to(device=device, dtype=dtype)  # type: ignore[union-attr]
    if not request.do_cfg:
        return positive, None
    if request.negative_prompt_embeds is not None:
        return positive, request.negative_prompt_embeds.to(device=device, dtype=dtype)
    k = positive.shape[1] // reader.length
    negative, _ = encode_prompt_embeds(engines.text_encoder, dataclasses.replace(reader, max_chunks=k),
                                       request.negative_prompts, None, dtype, engines.embedding_cache, min_chunks=k)
    return positive, negative


def set_schedule(scheduler: Any, num_inference_steps: int, device: torch.device,
                 schedule: tuple[str, tuple[float, ...]] | None = None, strength: float | None = None
                 ) -> torch.Tensor:
    """``scheduler.set_timesteps(num_inference_steps)``, or with diffusers' custom ``timesteps`` / ``sigmas``
    (``schedule``: :func:`~.request.check_schedule`'s); returns the schedule as a CPU tensor
    (:func:`host_timesteps`). ``strength`` (img2img / inpainting): only the steps from diffusers' ``t_start`` on
    run, so only those are checked (1000 steps at strength 0.3 never step from timestep 1000: diffusers runs them).

    Raises:
        RuntimeInputError: more steps than the scheduler's training timesteps, steps it refuses, or a schedule it
            cannot step: past its last training timestep (PNDM/DDIM with ``steps_offset=1`` at 1000 steps), or one
            timestep repeated for every step (DPM++/UniPC/DEIS at 1000 steps: their step indexed past their sigmas,
            a traceback); the message names the most steps that work. A custom schedule the scheduler does not take
            (naming it), or values it refuses.
    """
    if schedule is not None:
        _set_custom_schedule(scheduler, schedule, device)
        return host_timesteps(scheduler)
    train = int(getattr(scheduler.config, "num_train_timesteps", 1000))
    check_step_count(num_inference_steps, type(scheduler).__name__, scheduler.config)
    try:
        scheduler.set_timesteps(num_inference_steps, device=device)
    except ValueError as e:  # e.g. DDIM: more steps than the training schedule has timesteps
        raise RuntimeInputError(
            f"num_inference_steps={num_inference_steps} is not valid for {type(scheduler).__name__} ({e}); "
            f"use at most {train}"
        ) from e
    timesteps = host_timesteps(scheduler)
    start = 0 if strength is None else strength_start(num_inference_steps, strength)  # diffusers' get_timesteps
    problem = _schedule_problem(timesteps[start * int(getattr(scheduler, "order", 1)):],
                                num_inference_steps - start, train)
    if problem is not None and _steps_through(scheduler):  # Euler/Heun/DPM2 at 1000 steps: t=1000, sigma clamped
        problem = None
    if problem is not None:
        offset = int(getattr(scheduler.config, "steps_offset", 0) or 0)
        most = _most_steps(scheduler, num_inference_steps, train, device)
        raise RuntimeInputError(
            f"num_inference_steps={num_inference_steps} makes {type(scheduler).__name__} (steps_offset={offset}) "
            f"{problem}; use at most {most}")
    return timesteps


#: The schedulers of :data:`~.schedulers.SCHEDULERS` whose ``set_timesteps`` takes a custom schedule (diffusers 0.42).
_TAKES_CUSTOM = {"timesteps": "ddpm, euler, heun, dpm++ and its variants", "sigmas": "euler"}


def _set_custom_schedule(scheduler: Any, schedule: tuple[str, tuple[float, ...]], device: torch.device) -> None:
    """diffusers' ``retrieve_timesteps`` with ``timesteps=`` / ``sigmas=``: refused by name where the scheduler's
    ``set_timesteps`` does not take it (as diffusers, but naming the schedulers that do)."""
    name, values = schedule
    cls = type(scheduler).__name__
    if name not in inspect.signature(scheduler.set_timesteps).parameters:
        raise RuntimeInputError(f"{name}= is not taken by {cls} (scheduler={short_name(cls)!r}); use a scheduler "
                                f"whose set_timesteps takes custom {name} ({_TAKES_CUSTOM[name]}), or "
                                "num_inference_steps= instead")
    try:
        scheduler.set_timesteps(**{name: list(values)}, device=device)
    except (ValueError, IndexError) as e:  # e.g. DDPM: timesteps not in descending order
        raise RuntimeInputError(f"{name}={list(values)!r} is refused by {cls}: {e}") from e


def _schedule_problem(timesteps: torch.Tensor, num_inference_steps: int, train: int) -> str | None:
    """Why a scheduler cannot step ``timesteps`` (its schedule for ``num_inference_steps``), or ``None``."""
    if len(timesteps) and float(timesteps.max()) >= train:  # PNDM/DDIM with steps_offset=1 at 1000 steps: t=1000
        return (f"step from timestep {int(timesteps.max())}, past its {train} training timesteps (its step would "
                "index out of range, or, LMS, divide by the zero gap between its first two sigmas)")
    if num_inference_steps > 1 and len(torch.unique(timesteps)) == 1:  # 'leading' spacing: 1000 // 1001 = 0 apart
        return (f"step {len(timesteps)} times at the one timestep {int(timesteps[0])} (its schedule spaces the "
                f"{train} training timesteps 0 apart; its step would index out of range)")
    return None


def _steps_through(scheduler: Any) -> bool:
    """Whether the scheduler steps its whole schedule: a dry run on a copy, one-element zero latents and model
    outputs. Asked only of a schedule :func:`_schedule_problem` doubts: one that reaches timestep 1000 indexes
    ``alphas_cumprod`` past its end in PNDM / DDIM / DDPM (IndexError) and past the sigmas in DPM++ / DEIS, but
    Euler, Euler a, Heun and DPM2 read their sigmas by ``np.interp``, which holds the last one there: diffusers runs
    those (diffusers 0.42.1, SD-1.5's scheduler config: ``leading`` spacing, ``steps_offset=1``, 1000 steps)."""
    import copy
    import warnings

    dry = copy.deepcopy(scheduler)
    sample = torch.zeros(1, 1, 1, 1)
    try:  # Euler a / DPM2 a draw noise from torch's global generator: forked, so a caller's seed is untouched
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            for t in dry.timesteps:
                sample = dry.step(torch.zeros_like(sample), t, dry.scale_model_input(sample, t)).prev_sample
    except (IndexError, ValueError, RuntimeError, AssertionError, ZeroDivisionError):
        return False
    return bool(torch.isfinite(sample).all())


def _most_steps(scheduler: Any, num_inference_steps: int, train: int, device: torch.device) -> int:
    """The most steps below ``num_inference_steps`` whose schedule the scheduler can step (it is left set to it); the
    schedule of each is tried, at most 64 of them."""
    for steps in range(num_inference_steps - 1, max(num_inference_steps - 65, 1), -1):
        scheduler.set_timesteps(steps, device=device)
        if _schedule_problem(host_timesteps(scheduler), steps, train) is None:
            return steps
    return 1


def _expect_decodes(request: Request, engines: LoopEngines, latents: torch.Tensor) -> None:
    """Tell a size-bucketed VAE decoder (:meth:`~.engines.buckets.BucketedEngine.expect`) the shapes it will decode
    at, one per chunk size, so that its specialised sessions are made while the UNet loop runs. Engines without
    ``expect`` (every other kind) are left alone."""
    expect = getattr(engines.vae_decoder, "expect", None)
    if expect is None or request.output_type == "latent":
        return
    for size in sorted({len(rows) for rows in request.chunks}):
        expect({"latent_sample": (size, *latents.shape[1:])})


def _chunk_scheduler(scheduler: Any, request: Request, begin_index: int | None, device: torch.device) -> Any:
    """A fresh scheduler for a chunk after the first, at the request's schedule (and strength's begin index)."""
    sched = fresh_scheduler(scheduler)
    set_schedule(sched, request.num_inference_steps, device, request.schedule,
                 getattr(request.conditioning, "strength", None))
    if begin_index is not None and hasattr(sched, "set_begin_index"):
        sched.set_begin_index(begin_index)
    return sched


def _chunk_generator(request: Request, rows: range) -> Generator:
    """The generator(s) the scheduler steps of images ``rows`` draw from: their own with one per image, else all."""
    generator, batch = request.generator, request.batch
    if isinstance(generator, list) and len(generator) == batch and batch > 1:
        return generator[rows.start : rows.stop]
    return generator


def _host_sink(request: Request, engines: LoopEngines, device: torch.device) -> HostImageSink | None:
    """Where "pil"/"np" images land on the host (``None`` for "pt"/"latent")."""
    if request.output_type not in ("pil", "np"):
        return None
    buffers = engines.host_buffers or HostBuffers(pin=device.type == "cuda")
    dtype = torch.uint8 if request.output_type == "pil" else torch.float32
    return HostImageSink((request.batch, request.height, request.width, 3), dtype, buffers, device,
                         engines.copy_stream)


def _finish_chunk(final: torch.Tensor, rows: range, output_type: str, engines: LoopEngines,
                  sink: HostImageSink | None, parts: list[torch.Tensor],
                  nonfinite: torch.Tensor | None) -> torch.Tensor:
    """4. decode the chunk's final latents [b, C, h, w] (unless "latent") into ``sink`` or ``parts``; returns the
    running NaN/Inf device flag."""
    device = engines.unet.device
    if output_type == "latent":
        parts.append(final)
        return _nonfinite_flag(final, nonfinite)
    assert engines.vae_decoder is not None
    with nvtx_range("vae_decode", device), engines.stages.stage("vae") as stage:  # the plan's choice: whole or tiled
        image = decode_latents(engines.vae_decoder, final, engines.scaling_factor, stage.tiled_vae)
        nonfinite = _nonfinite_flag(image, nonfinite)
    with nvtx_range("postprocess", device):
        if sink is None:  # "pt": a fresh tensor, the VAE buffer is overwritten by the next chunk
            parts.append((image * 0.5 + 0.5).clamp(0, 1))
        else:
            sink.write(rows.start, images_uint8(image) if output_type == "pil" else images_float(image))
    return nonfinite

"""What a generation mode adds to the one denoising loop: the small :class:`Conditioning` interface.

The loop (:func:`~.denoise.generate`) knows no mode. It asks the request's conditioning three things, in
diffusers' order (``retrieve_timesteps`` / ``get_timesteps`` -> ``prepare_latents`` -> ``encode_prompt``):

* :meth:`~Conditioning.start`: the timesteps that run (image-to-image skips the first ones by strength);
* :meth:`~Conditioning.prepare`: the initial latents of the whole request and what each chunk's steps add
  (:class:`PreparedLatents`, sliced per chunk into a :class:`ChunkConditioning`);
* :meth:`~Conditioning.encode`: the per-prompt text embeddings and any further UNet inputs (SDXL's).

One implementation per mode: :class:`TextToImage` (here), ``ImageToImage`` and ``Inpainting``
(:mod:`.image_inputs`), ``SdxlConditioning`` (:mod:`.sdxl`).

Shapes: B images, b in a chunk, B2 = 2b with CFG; latents [B, C, h, w]; embeddings [P, 77, D].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .engines.engine import Engine
from .latents import Generator, prepare_latents
from .text_embeddings import EmbeddingCache, encode_prompt_embeds


class AddedInputs(Protocol):
    """Further UNet inputs, the same every step (SDXL's ``text_embeds`` and ``time_ids``)."""

    def repeat_interleave(self, n: int) -> AddedInputs:
        """One row per image: each prompt's row ``n`` times in a row."""
        ...

    def unet_inputs(self, rows: range, unet: Engine) -> dict[str, torch.Tensor]:
        """The inputs of images ``rows`` (``[negative; positive]`` with CFG), in the UNet's dtypes."""
        ...


#: (positive [P, 77, D], negative [P, 77, D] or ``None`` without CFG, added UNet inputs or ``None``).
PromptEmbeddings = tuple[torch.Tensor, "torch.Tensor | None", "AddedInputs | None"]


@dataclass
class ChunkConditioning:
    """What the denoising loop of one chunk of b images adds to text-to-image.

    Attributes:
        unet_extra: inpainting UNet (9 channels): ``cat([mask, masked_image_latents], 1)`` [B2, 5, h, w] (CFG rows
            duplicated); ``None`` otherwise.
        mask, image_latents, noise: 4-channel inpainting: [b, 1, h, w], [b, 4, h, w], [b, 4, h, w] for the
            per-step blend; ``None`` otherwise.
    """

    unet_extra: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    image_latents: torch.Tensor | None = None
    noise: torch.Tensor | None = None

    def unet_sample(self, latent_model_input: torch.Tensor) -> torch.Tensor:
        """The UNet's ``sample`` after ``scale_model_input``: [B2, 9, h, w] for an inpainting UNet, else unchanged."""
        if self.unet_extra is None:
            return latent_model_input
        return torch.cat([latent_model_input, self.unet_extra.to(latent_model_input.dtype)], dim=1)

    def after_step(self, scheduler: Any, latents: torch.Tensor, i: int, timesteps: torch.Tensor) -> torch.Tensor:
        """4-channel inpainting: keep the unmasked area on the image's noise trajectory (diffusers' inpaint loop)."""
        if self.image_latents is None:
            return latents
        proper = self.image_latents
        if i < len(timesteps) - 1:
            proper = scheduler.add_noise(proper, self.noise, timesteps[i + 1 : i + 2])
        return (1 - self.mask) * proper + self.mask * latents


@dataclass
class PreparedLatents:
    """The initial latents of a request and, for inpainting, the tensors every step needs (B rows each).

    Attributes:
        latents: [B, 4, h, w] initial latents (noised image latents, or noise times ``init_noise_sigma``).
        mask: [B, 1, h, w] mask at latent size (inpainting), else ``None``.
        masked_image_latents: [B, 4, h, w] (inpainting UNet), else ``None``.
        image_latents, noise: [B, 4, h, w] (4-channel inpainting blend), else ``None``.
    """

    latents: torch.Tensor
    mask: torch.Tensor | None = None
    masked_image_latents: torch.Tensor | None = None
    image_latents: torch.Tensor | None = None
    noise: torch.Tensor | None = None

    def rows(self, rows: range, do_cfg: bool) -> ChunkConditioning | None:
        """The tensors of images ``rows`` (CFG doubles the UNet's extra input, negative rows first); ``None`` when
        the steps add nothing (text-to-image, image-to-image)."""
        if self.mask is None:
            return None
        sl = slice(rows.start, rows.stop)
        chunk = ChunkConditioning()
        if self.masked_image_latents is not None:
            extra = torch.cat([self.mask[sl], self.masked_image_latents[sl]], dim=1)
            chunk.unet_extra = torch.cat([extra] * 2) if do_cfg else extra
        if self.image_latents is not None and self.noise is not None:
            chunk.mask, chunk.image_latents, chunk.noise = self.mask[sl], self.image_latents[sl], self.noise[sl]
        return chunk


class Conditioning(Protocol):
    """What one mode adds to the loop (see the module docstring); built by :meth:`~.request.Request.build`."""

    @property
    def mode(self) -> str:
        """"txt2img", "img2img", "inpaint" or "sdxl"."""
        ...

    def start(self, scheduler: Any, num_inference_steps: int, timesteps: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  int | None]:
        """The timesteps that run (CPU) and the begin index fresh schedulers get (``None`` = from the start)."""
        ...

    def prepare(self, scheduler: Any, timesteps: torch.Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype,
                device: torch.device, generator: Generator, latents: torch.Tensor | None) -> PreparedLatents:
        """The initial latents [B, C, h, w] of the whole request (drawn in diffusers' order) and the step tensors."""
        ...

    def encode(self, text_encoder: Engine, tokenizer: Any, prompts: Sequence[str],
               negative_prompts: Sequence[str] | None, dtype: torch.dtype,
               cache: EmbeddingCache | None) -> PromptEmbeddings:
        """Per-prompt embeddings (``negative_prompts`` ``None`` = no CFG) and any added UNet inputs."""
        ...


class TextToImage:
    """Text-to-image, diffusers' ``StableDiffusionPipeline``: the full schedule, noise times ``init_noise_sigma``,
    one text encoder. The base of the other modes."""

    mode = "txt2img"

    def start(self, scheduler: Any, num_inference_steps: int, timesteps: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  int | None]:
        return timesteps, None

    def prepare(self, scheduler: Any, timesteps: torch.Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype,
                device: torch.device, generator: Generator, latents: torch.Tensor | None) -> PreparedLatents:
        return PreparedLatents(prepare_latents(scheduler, shape, dtype, device, generator, latents))

    def encode(self, text_encoder: Engine, tokenizer: Any, prompts: Sequence[str],
               negative_prompts: Sequence[str] | None, dtype: torch.dtype,
               cache: EmbeddingCache | None) -> PromptEmbeddings:
        positive, negative = encode_prompt_embeds(text_encoder, tokenizer, prompts, negative_prompts, dtype, cache)
        return positive, negative, None

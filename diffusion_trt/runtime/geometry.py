"""The latent geometry of an artifact: how its pixels map to latents, read once from the manifest.

The one place an image size is checked at run time (:meth:`LatentGeometry.check_size`) and the VAE factor is
known (``scale_factor``, the manifest's ``model.vae_scale_factor``): the request, the engines' derived output
dims, the size buckets and the VRAM planner all read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..artifact.manifest import Manifest
from ..config import IMAGE_ALIGNMENT, ShapeProfile, check_image_size
from ..errors import RuntimeInputError


@dataclass(frozen=True)
class LatentGeometry:
    """How pixels map to latents, read once from the manifest's ``model`` entry.

    Attributes:
        scale_factor: pixels per latent pixel (``vae_scale_factor``: SD's VAE downsamples by 8); image sizes are
            multiples of it, latents are ``size // scale_factor``.
        scaling_factor: ``vae.config.scaling_factor`` (latents are decoded as ``latents / scaling_factor``).
        channels: channels of the latents the scheduler denoises (the VAE's latent channels, 4).
        unet_in_channels: channels of the UNet's ``sample`` input: 4, or 9 for an inpainting UNet.
    """

    scale_factor: int = IMAGE_ALIGNMENT
    scaling_factor: float = 0.18215
    channels: int = 4
    unet_in_channels: int = 4

    @classmethod
    def from_manifest(cls, manifest: Manifest, unet_in_channels: int | None = None) -> LatentGeometry:
        """The geometry of an artifact; ``unet_in_channels`` (the UNet engine's ``sample`` channels) when the
        manifest does not record it."""
        model = manifest.model
        fallback = unet_in_channels if unet_in_channels is not None else 4
        unet = int(model.unet_in_channels if model.unet_in_channels is not None else fallback)
        return cls(
            scale_factor=int(model.vae_scale_factor),
            scaling_factor=float(model.vae_scaling_factor if model.vae_scaling_factor is not None else 0.18215),
            channels=int(model.latent_channels if model.latent_channels is not None else min(unet, 4)),
            unet_in_channels=unet,
        )

    @property
    def derived_dims(self) -> dict[str, tuple[str, int]]:
        """The engines' derived output symbols: image ``H``/``W`` = ``scale_factor`` x latent ``h``/``w``."""
        return {"H": ("h", self.scale_factor), "W": ("w", self.scale_factor)}

    def latent_shape(self, batch: int, height: int, width: int) -> tuple[int, int, int, int]:
        """Latents [B, C, H / f, W / f] of ``batch`` images of ``height`` x ``width`` pixels."""
        f = self.scale_factor
        return (batch, self.channels, height // f, width // f)

    def check_size(self, height: Any, width: Any, profile: ShapeProfile, image: str | None = None) -> tuple[int, int]:
        """The one check of an image size: integers, multiples of ``scale_factor``, inside the engine profile.

        Args:
            height, width: pixels.
            profile: the artifact's profile (its height/width ranges).
            image: ``None`` for a requested size; the argument's name ("image") for the size of a given image,
                which the messages then say how to resize (as ``image=``, which the CLI writes as ``--image``).

        Returns:
            (height, width) as ints.

        Raises:
            RuntimeInputError: naming the value, the nearest valid sizes and the profile's range.
        """
        for name, value, rng in (("height", height, profile.height), ("width", width, profile.width)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise RuntimeInputError(f"{name}={value!r} must be an integer number of pixels")
            if image is None:
                check_image_size(name, int(value), rng.min, rng.max, multiple=self.scale_factor)
            else:
                _check_image(image, name, int(value), self.scale_factor, rng.min, rng.max)
        return int(height), int(width)


def _check_image(image: str, name: str, value: int, f: int, lo: int, hi: int) -> None:
    if value % f:
        below = max(f, value // f * f)
        raise RuntimeInputError(
            f"{image}= {name} {value} is not a multiple of {f} (the VAE downsamples by {f}); resize or crop the image "
            f"to {below} or {below + f} (engine profile allows {lo}..{hi})"
        )
    if not lo <= value <= hi:
        raise RuntimeInputError(
            f"{image}= {name} {value} is outside the engine profile {lo}..{hi}; resize the image into that "
            f"range or recompile with --min-{name}/--max-{name}"
        )

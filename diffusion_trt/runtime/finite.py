"""Finiteness of the tensors a caller passes (embeddings, latents, images), shared by the modules that check them
(``request``, ``image_inputs``, ``controlnet``); a leaf module, so that none of them imports another for it. The
float32 range of caller-given numbers is :mod:`.float_range`'s.
"""

from __future__ import annotations

import torch

from ..errors import RuntimeInputError
from .float_range import FLOAT32_MAX


def check_finite(name: str, value: torch.Tensor) -> None:
    """Refuse a tensor the caller passed (``prompt_embeds``, ``latents``...) that holds NaN or Inf, or float64 values
    beyond float32's range (inf in the engines): the loop would only warn, after the run, that the images came out
    black.

    Raises:
        RuntimeInputError: naming the argument and how many values are not finite.
    """
    bad = int((~torch.isfinite(value)).sum())
    if bad:
        raise RuntimeInputError(f"{name} contains NaN/Inf values ({bad} of {value.numel()}); pass finite values; "
                                "check where they were computed (an fp16 overflow, a division by zero)")
    wide = int((value.abs() > FLOAT32_MAX).sum()) if value.dtype == torch.float64 else 0
    if wide:  # finite in float64, inf once the engines' float32 (or fp16) holds them: black images
        raise RuntimeInputError(f"{name} holds float64 values beyond float32's range ±{FLOAT32_MAX:.3g} ({wide} of "
                                f"{value.numel()}), inf in the engines; pass values within it")

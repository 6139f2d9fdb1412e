"""Finiteness of what a caller passes: the tensors (embeddings, latents, images) and the numbers that end up in
float32 tensors (scales, weights, guidance), shared by the modules that check them (``request``, ``image_inputs``,
``controlnet``, ``generation_args``, ``prompt_syntax``); a leaf module, so that none of them imports another for it.
"""

from __future__ import annotations

import math

import torch

from ..errors import RuntimeInputError

#: The largest finite float32 (``torch.finfo(torch.float32).max``): a number beyond it, finite as a Python float, is
#: inf once it is a float32 tensor's value on the engines' side.
FLOAT32_MAX = 3.4028234663852886e38


def finite_in_float32(value: float) -> bool:
    """Whether ``value`` is finite and within float32's range (a scale of 1e39 is finite, and overflows on the
    device)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def check_finite(name: str, value: torch.Tensor) -> None:
    """Refuse a tensor the caller passed (``prompt_embeds``, ``latents``...) that holds NaN or Inf: the loop would
    only warn, after the run, that the images came out black.

    Raises:
        RuntimeInputError: naming the argument and how many values are not finite.
    """
    bad = int((~torch.isfinite(value)).sum())
    if bad:
        raise RuntimeInputError(f"{name} contains NaN/Inf values ({bad} of {value.numel()}); pass finite values; "
                                "check where they were computed (an fp16 overflow, a division by zero)")

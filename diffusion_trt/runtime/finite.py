"""Finiteness of the tensors a caller passes (embeddings, latents, images), shared by the modules that check them
(``request``, ``image_inputs``, ``controlnet``); a leaf module, so that none of them imports another for it. The
float32 range of caller-given numbers is :mod:`.float_range`'s.
"""

from __future__ import annotations

import torch

from ..errors import RuntimeInputError


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

"""The initial latents of a request and the types the loop's callers pass for them: :func:`prepare_latents`,
:data:`Generator` (diffusers' ``generator=``) and :data:`StepCallback` (``callback=``, called with the latents after
every step).

Split from :mod:`.denoise` so that the modes (:mod:`.conditioning`, :mod:`.image_inputs`) and the request
(:mod:`.request`) need not import the loop that imports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: ``callback(step_index, timestep, latents)``: called after every scheduler step with the timestep (0-d CPU
#: tensor) and the latents [b, 4, h, w] of the running chunk on the engine device (called once per step of
#: every chunk). Reading the latents on the host syncs the device.
StepCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
Generator = torch.Generator | list[torch.Generator] | None


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

"""img2img / inpainting at 1000 steps: only the steps from diffusers' t_start on run, so only they are checked."""
from __future__ import annotations

import pytest
import torch

from diffusion_trt.compiler.dummy import SD15_SCHEDULER_CONFIG
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime.denoise import set_schedule
from diffusion_trt.runtime.schedulers import make_scheduler


@pytest.mark.parametrize("name", ["pndm", "ddim", "ddpm"])
def test_1000_steps_at_strength_0_3_run_as_in_diffusers(name: str) -> None:
    """diffusers' img2img at 1000 steps, strength 0.3, steps timesteps 299 .. 0 only: it runs (the t=1000 step that
    text-to-image would take is skipped); text-to-image at 1000 steps stays refused."""
    config = {"_class_name": "PNDMScheduler", **SD15_SCHEDULER_CONFIG}
    timesteps = set_schedule(make_scheduler(config, name), 1000, torch.device("cpu"), strength=0.3)
    assert len(timesteps) >= 1000  # the full schedule; the loop slices it
    with pytest.raises(RuntimeInputError, match="use at most 999"):
        set_schedule(make_scheduler(config, name), 1000, torch.device("cpu"))
    with pytest.raises(RuntimeInputError, match="use at most 999"):
        set_schedule(make_scheduler(config, name), 1000, torch.device("cpu"), strength=1.0)

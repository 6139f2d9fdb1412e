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


@pytest.mark.parametrize("name", ["euler_a", "dpm2_a"])
def test_the_1000_step_dry_run_leaves_torchs_global_generator_alone(name: str) -> None:
    """The dry run that lets Euler a / DPM2 a run 1000 steps steps a copy of the scheduler, whose ancestral noise
    comes from torch's global generator; a caller seeding with ``torch.manual_seed`` (no ``generator=``) must get
    the numbers it would have had without the check. The config as an artifact keeps it (PNDM's saved config:
    'leading' spacing, so 1000 steps reach timestep 1000 and the dry run happens)."""
    import diffusers

    config = dict(diffusers.PNDMScheduler.from_config(SD15_SCHEDULER_CONFIG).config)
    assert config["timestep_spacing"] == "leading"
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    set_schedule(make_scheduler(config, name), 1000, torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected)

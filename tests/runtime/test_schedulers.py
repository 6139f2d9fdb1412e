"""Scheduler short names -> diffusers classes, built from an SD scheduler config."""

from __future__ import annotations

import importlib.util

import diffusers
import pytest
import torch

from diffusion_trt.errors import ArtifactError, RuntimeInputError
from diffusion_trt.runtime.schedulers import SCHEDULERS, make_scheduler, scheduler_names, short_name
from tests.runtime.toy import SD15_SCHEDULER

HAS_SCIPY = importlib.util.find_spec("scipy") is not None

# Written out independently of the table under test: what each name must give.
EXPECTED: dict[str, tuple[type, dict[str, object]]] = {
    "pndm": (diffusers.PNDMScheduler, {}),
    "ddim": (diffusers.DDIMScheduler, {}),
    "ddpm": (diffusers.DDPMScheduler, {}),
    "euler": (diffusers.EulerDiscreteScheduler, {}),
    "euler_a": (diffusers.EulerAncestralDiscreteScheduler, {}),
    "heun": (diffusers.HeunDiscreteScheduler, {}),
    "dpm2": (diffusers.KDPM2DiscreteScheduler, {}),
    "dpm2_a": (diffusers.KDPM2AncestralDiscreteScheduler, {}),
    "dpm++": (diffusers.DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "use_karras_sigmas": False}),
    "dpm++_karras": (diffusers.DPMSolverMultistepScheduler, {"use_karras_sigmas": True}),
    "dpm++_sde": (diffusers.DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++"}),
    "dpm++_sde_karras": (
        diffusers.DPMSolverMultistepScheduler,
        {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True},
    ),
    "unipc": (diffusers.UniPCMultistepScheduler, {}),
    "deis": (diffusers.DEISMultistepScheduler, {}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_name_gives_class_and_config_and_steps(name: str) -> None:
    cls, config = EXPECTED[name]
    s = make_scheduler(SD15_SCHEDULER, name)
    assert type(s) is cls
    for key, value in config.items():
        assert s.config[key] == value
    assert s.config.beta_schedule == "scaled_linear" and s.config.beta_end == 0.012  # the model's betas kept
    s.set_timesteps(4)
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    t = s.timesteps[0]
    out = s.step(s.scale_model_input(x, t), t, x, return_dict=False)[0]
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_every_table_name_is_tested() -> None:
    assert set(scheduler_names()) == set(EXPECTED) | {"lms"}
    assert scheduler_names() == list(SCHEDULERS)


def test_names_are_case_and_space_insensitive() -> None:
    assert type(make_scheduler(SD15_SCHEDULER, " Euler_A ")) is diffusers.EulerAncestralDiscreteScheduler


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(RuntimeInputError) as e:
        make_scheduler(SD15_SCHEDULER, "euler-ancestral")
    msg = str(e.value)
    assert "scheduler='euler-ancestral' is unknown" in msg
    for name in SCHEDULERS:
        assert name in msg


@pytest.mark.skipif(HAS_SCIPY, reason="scipy is installed: lms works")
def test_lms_without_scipy_names_the_fix() -> None:
    with pytest.raises(RuntimeInputError, match=r"'lms'.*pip install scipy"):
        make_scheduler(SD15_SCHEDULER, "lms")


@pytest.mark.skipif(not HAS_SCIPY, reason="lms needs scipy")
def test_lms_with_scipy() -> None:
    assert type(make_scheduler(SD15_SCHEDULER, "lms")).__name__ == "LMSDiscreteScheduler"


def test_default_is_the_artifacts_class() -> None:
    assert type(make_scheduler(SD15_SCHEDULER)) is diffusers.PNDMScheduler
    ddim = make_scheduler(SD15_SCHEDULER, None, class_name="DDIMScheduler")
    assert type(ddim) is diffusers.DDIMScheduler
    with pytest.raises(ArtifactError, match="'NoSuchScheduler'"):
        make_scheduler(SD15_SCHEDULER, None, class_name="NoSuchScheduler")
    with pytest.raises(ArtifactError):
        make_scheduler(SD15_SCHEDULER, None, class_name="UNet2DConditionModel")  # a diffusers class, not a scheduler


def test_short_name() -> None:
    assert short_name("EulerAncestralDiscreteScheduler") == "euler_a"
    assert short_name("DPMSolverMultistepScheduler") == "dpm++"
    assert short_name("FancyScheduler") == "FancyScheduler"


def test_step_count_beyond_the_training_timesteps_is_refused_from_the_config_alone() -> None:
    """check_step_count (run's check before the load) and the loop's set_schedule refuse alike."""
    from diffusion_trt.runtime.denoise import set_schedule
    from diffusion_trt.runtime.schedulers import check_step_count

    message = ("num_inference_steps=1001 is more than the 1000 timesteps DDIMScheduler was trained with; use at most "
               "1000")
    with pytest.raises(RuntimeInputError, match=f"^{message}$"):
        check_step_count(1001, "DDIMScheduler", SD15_SCHEDULER)
    with pytest.raises(RuntimeInputError, match=f"^{message}$"):
        set_schedule(make_scheduler(SD15_SCHEDULER, "ddim"), 1001, torch.device("cpu"))
    check_step_count(1000, "DDIMScheduler", SD15_SCHEDULER)
    with pytest.raises(RuntimeInputError, match="more than the 50 timesteps"):
        check_step_count(51, "DDIMScheduler", {**SD15_SCHEDULER, "num_train_timesteps": 50})

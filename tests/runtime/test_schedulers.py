"""Scheduler short names -> diffusers classes, built from an SD scheduler config."""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys

import diffusers
import pytest
import torch

from diffusion_trt.errors import ArtifactError, RuntimeInputError
from diffusion_trt.runtime.schedulers import SCHEDULERS, build_scheduler, make_scheduler, scheduler_names, short_name
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


def _diffusers_way(name: str) -> object:
    cls_name, overrides = SCHEDULERS[name]
    clean = {k: v for k, v in SD15_SCHEDULER.items() if not k.startswith("_")}
    return getattr(diffusers, cls_name).from_config(clean, **overrides)


@pytest.mark.parametrize("name", [n for n in SCHEDULERS if n != "lms" or HAS_SCIPY])
def test_built_like_from_config(name: str) -> None:
    ours, theirs = make_scheduler(SD15_SCHEDULER, name), _diffusers_way(name)
    assert type(ours) is type(theirs)
    assert dict(ours.config) == dict(theirs.config)
    fresh = build_scheduler(type(ours), ours.config)
    assert dict(fresh.config) == dict(type(theirs).from_config(theirs.config).config)
    cls = type(ours)
    assert not getattr(cls, "_deprecated_kwargs", []) and not getattr(cls, "ignore_for_config", [])
    x = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    for s in (ours, theirs):
        s.set_timesteps(30)
    assert torch.equal(ours.timesteps, theirs.timesteps)
    noisy = "generator" in inspect.signature(cls.step).parameters  # ancestral / SDE steps draw noise
    for t in ours.timesteps[:3]:
        a, b = (s.step(s.scale_model_input(x, t), t, x, return_dict=False,
                       **({"generator": torch.Generator().manual_seed(1)} if noisy else {}))[0] for s in (ours, theirs))
        assert torch.equal(a, b)


def test_overrides_win_and_defaults_stay_defaults() -> None:
    config = {**SD15_SCHEDULER, "steps_offset": 0, "_use_default_values": ["steps_offset"], "not_a_key": 3}
    s = build_scheduler(diffusers.DDIMScheduler, config, {"clip_sample": True})
    t = diffusers.DDIMScheduler.from_config(config, clip_sample=True)
    assert s.config.clip_sample is True and dict(s.config) == dict(t.config)


def test_building_imports_no_other_scheduler_module() -> None:
    """diffusers' from_config imports every compatible class first (UniPC brings scipy.stats: seconds)."""
    code = ("import sys; from diffusion_trt.runtime.schedulers import make_scheduler; "
            f"s = make_scheduler({SD15_SCHEDULER!r}); make_scheduler({SD15_SCHEDULER!r}, 'euler'); "
            "print(sorted(m for m in sys.modules if m.startswith('diffusers.schedulers.scheduling_')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out.strip().splitlines()[-1]) == ["diffusers.schedulers.scheduling_euler_discrete",
                                                   "diffusers.schedulers.scheduling_pndm",
                                                   "diffusers.schedulers.scheduling_utils"]


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

"""EnginePipeline called the way diffusers' pipelines are: the keywords of ``StableDiffusionPipeline.__call__``
that the loop honours (``return_dict``, ``guidance_rescale``, ``callback_on_step_end``...) and the ones it refuses by
name, on the toy artifact (behaviour) and the tiny one (images against diffusers, CPU fp32)."""

from __future__ import annotations

import copy
import gc
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch

from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.pipeline import EnginePipelineOutput

FAST: dict[str, Any] = {"prompt": "a cat", "num_inference_steps": 2, "progress": False}


def test_output_has_diffusers_nsfw_field(toy_pipe: EnginePipeline) -> None:
    out = toy_pipe(**FAST, seed=0)
    assert out.nsfw_content_detected is None  # diffusers' value without a safety checker


def test_return_dict_false_gives_diffusers_tuple(toy_pipe: EnginePipeline) -> None:
    images, nsfw = toy_pipe(**FAST, seed=0, output_type="np", return_dict=False)
    assert nsfw is None
    np.testing.assert_array_equal(images, toy_pipe(**FAST, seed=0, output_type="np").images)
    assert EnginePipelineOutput(images=[1], seed=0).to_tuple("sdxl") == ([1],)  # StableDiffusionXLPipeline's


def test_return_dict_not_a_bool_is_refused(toy_pipe: EnginePipeline) -> None:
    with pytest.raises(RuntimeInputError, match="return_dict='no' must be True or False"):
        toy_pipe(**FAST, return_dict="no")


# --- images against diffusers (tiny-sd21: v-prediction, what guidance_rescale is for) ------------------------------


@pytest.fixture(scope="module")
def sd21_reference(tiny_sd21_dir: Path) -> diffusers.StableDiffusionPipeline:
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_sd21_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def sd21_pipe(tiny_sd21_artifact: Path) -> Iterator[EnginePipeline]:
    with EnginePipeline.from_artifacts(tiny_sd21_artifact) as pipe:
        yield pipe


def _diffusers_np(reference: Any, **kwargs: Any) -> np.ndarray:
    out = reference(**kwargs, generator=torch.Generator("cpu").manual_seed(7), output_type="np")
    return np.asarray(out.images)


CALL: dict[str, Any] = {"prompt": ["a fox", "a boat"], "num_inference_steps": 4, "guidance_scale": 6.0}


def test_guidance_rescale_matches_diffusers(sd21_reference: Any, sd21_pipe: EnginePipeline) -> None:
    want = _diffusers_np(sd21_reference, **CALL, guidance_rescale=0.7)
    got = sd21_pipe(**CALL, guidance_rescale=0.7, seed=7, output_type="np", progress=False)
    assert np.abs(got.images - want).max() < 1e-4
    assert np.abs(want - _diffusers_np(sd21_reference, **CALL)).max() > 1e-3  # it changes the image
    assert got.parameters["guidance_rescale"] == 0.7


def test_guidance_rescale_is_checked(toy_pipe: EnginePipeline) -> None:
    with pytest.raises(RuntimeInputError, match=r"guidance_rescale=-0\.5 must be a finite number >= 0"):
        toy_pipe(**FAST, guidance_rescale=-0.5)


def _damp_at_step_1(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"latents": kwargs["latents"] * 0.8} if step == 1 else kwargs


def test_callback_on_step_end_matches_diffusers(sd21_reference: Any, sd21_pipe: EnginePipeline) -> None:
    seen: dict[str, list[tuple[int, float]]] = {"ours": [], "diffusers": []}

    def record(who: str) -> Any:
        def fn(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
            seen[who].append((step, float(timestep)))
            return _damp_at_step_1(pipe, step, timestep, kwargs)
        return fn

    sd21_pipe.set_scheduler("heun")  # two UNet calls per step: diffusers calls it after each scheduler.step
    original = sd21_reference.scheduler
    sd21_reference.scheduler = diffusers.HeunDiscreteScheduler.from_config(original.config)
    try:
        want = _diffusers_np(sd21_reference, **CALL, callback_on_step_end=record("diffusers"))
    finally:
        sd21_reference.scheduler = original
    got = sd21_pipe(**CALL, callback_on_step_end=record("ours"), seed=7, output_type="np", progress=False).images
    sd21_pipe.set_scheduler(None)
    assert seen["ours"] == seen["diffusers"] and len(seen["ours"]) > CALL["num_inference_steps"]
    assert np.abs(got - want).max() < 1e-4


def test_callback_on_step_end_gets_the_pipeline_and_latents(toy_pipe: EnginePipeline) -> None:
    calls: list[tuple[Any, tuple[int, ...]]] = []
    toy_pipe(**FAST, seed=0, callback_on_step_end=lambda p, i, t, kw: calls.append((p, tuple(kw["latents"].shape))))
    assert calls and set(calls) == {(toy_pipe, (1, 4, 8, 8))}  # once per scheduler step; None changes nothing


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"callback_on_step_end": "no"}, "callback_on_step_end='no' is not callable"),
    ({"callback_on_step_end": _damp_at_step_1, "callback_on_step_end_tensor_inputs": ["latents", "prompt_embeds"]},
     r"callback_on_step_end_tensor_inputs has \['prompt_embeds'\]: only \['latents'\]"),
    ({"callback_on_step_end": lambda p, i, t, kw: {"latents": kw["latents"][:, :2]}},
     r"callback_on_step_end returned latents \(1, 2, 8, 8\)"),
    ({"callback_on_step_end": lambda p, i, t, kw: {"prompt_embeds": 0}},
     r"callback_on_step_end returned \['prompt_embeds'\]"),
])
def test_callback_on_step_end_refusals_name_it(toy_pipe: EnginePipeline, kwargs: dict[str, Any],
                                               message: str) -> None:
    with pytest.raises(RuntimeInputError, match=message):
        toy_pipe(**FAST, **kwargs)


@pytest.mark.parametrize(("scheduler", "cls", "schedule", "image"), [
    ("euler", diffusers.EulerDiscreteScheduler, {"timesteps": [999, 700, 400, 100]}, False),
    ("euler", diffusers.EulerDiscreteScheduler, {"sigmas": [14.6, 5.0, 1.5, 0.3]}, True),
    ("heun", diffusers.HeunDiscreteScheduler, {"timesteps": [999, 600, 200]}, True),
    ("dpm++", diffusers.DPMSolverMultistepScheduler, {"timesteps": [999, 700, 400, 100]}, False),
])
def test_custom_timesteps_and_sigmas_match_diffusers(sd21_reference: Any, sd21_pipe: EnginePipeline, scheduler: str,
                                                     cls: type, schedule: dict[str, list[float]], image: bool) -> None:
    extra: dict[str, Any] = {}
    reference = sd21_reference
    if image:  # image-to-image: diffusers' get_timesteps on the custom schedule's length
        reference = diffusers.StableDiffusionImg2ImgPipeline(**sd21_reference.components)
        reference.set_progress_bar_config(disable=True)
        extra = {"image": np.random.default_rng(0).random((2, 64, 64, 3), dtype=np.float32), "strength": 0.6}
    original = reference.scheduler
    reference.scheduler = cls.from_config(original.config)
    try:
        want = _diffusers_np(reference, **CALL, **schedule, **extra)
    finally:
        reference.scheduler = original
    sd21_pipe.set_scheduler(scheduler)
    try:
        out = sd21_pipe(**CALL, **schedule, **extra, seed=7, output_type="np", progress=False)
    finally:
        sd21_pipe.set_scheduler(None)
    assert np.abs(out.images - want).max() < 1e-4
    assert out.parameters[next(iter(schedule))] == next(iter(schedule.values()))


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"timesteps": [999, 500]}, r"timesteps= is not taken by PNDMScheduler \(scheduler='pndm'\)"),
    ({"sigmas": [3.0, 1.0]}, r"sigmas= is not taken by PNDMScheduler"),
    ({"timesteps": [999], "sigmas": [1.0]}, "pass either timesteps= or sigmas=, not both"),
    ({"timesteps": []}, r"timesteps=\[\] must be a non-empty list of integers >= 0"),
    ({"timesteps": [999.5]}, r"timesteps=\[999.5\] must be a non-empty list of integers"),
    ({"sigmas": [float("nan")]}, r"sigmas=\[nan\] must be a non-empty list of finite numbers >= 0"),
])
def test_custom_schedule_refusals_name_it(toy_pipe: EnginePipeline, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeInputError, match=message):
        toy_pipe(**FAST, **kwargs)


def test_custom_schedule_a_scheduler_refuses_is_named(toy_pipe: EnginePipeline) -> None:
    toy_pipe.set_scheduler("ddpm")
    try:
        with pytest.raises(RuntimeInputError, match=r"timesteps=\[100, 500\] is refused by DDPMScheduler: .*descend"):
            toy_pipe(**FAST, timesteps=[100, 500])
    finally:
        toy_pipe.set_scheduler(None)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"cross_attention_kwargs": {"scale": 0.5}}, r"cross_attention_kwargs=\{'scale': 0.5\} .*load_lora\(FILE, s\)"),
    ({"ip_adapter_image": "face.png"}, r"ip_adapter_image=.face.png. is a diffusers argument .* IP-Adapters"),
    ({"denoising_end": 0.8}, r"denoising_end=0.8 .*output_type='latent'"),
    ({"padding_mask_crop": 32}, "padding_mask_crop=32 .*crop the image and mask yourself"),
    ({"callback_steps": 5}, "callback_steps=5 .*callback_on_step_end"),
])
def test_diffusers_keywords_the_engines_cannot_honour_are_refused_by_name(toy_pipe: EnginePipeline,
                                                                           kwargs: dict[str, Any],
                                                                           message: str) -> None:
    with pytest.raises(RuntimeInputError, match=message):
        toy_pipe(**FAST, **kwargs)


def test_diffusers_keywords_that_ask_for_nothing_run(toy_pipe: EnginePipeline) -> None:
    neutral = {"cross_attention_kwargs": None, "ip_adapter_image": None, "denoising_end": None,
               "masked_image_latents": None, "callback_steps": 1}
    np.testing.assert_array_equal(toy_pipe(**FAST, seed=0, output_type="np", **neutral).images,
                                  toy_pipe(**FAST, seed=0, output_type="np").images)
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_inferense_steps'"):  # a typo stays one
        toy_pipe(**FAST, num_inferense_steps=3)


# --- lifecycle ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps])
def test_a_pipeline_is_not_copied_and_stays_usable(toy_artifact: Path, how: Any) -> None:
    with EnginePipeline.from_artifacts(toy_artifact) as pipe:
        with pytest.raises(TypeError, match=r"an EnginePipeline cannot be pickled or copied .*from_artifacts"):
            how(pipe)
        gc.collect()  # a shallow copy, once collected, closed the engines it shared with the original
        assert pipe(**FAST, seed=0).images


def test_interrupt_from_callback_on_step_end_matches_diffusers(sd21_reference: Any, sd21_pipe: EnginePipeline) -> None:
    def stop_after_1(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if step == 1:
            pipe._interrupt = True  # diffusers' documented way to stop the loop
        return kwargs

    call = {**CALL, "num_inference_steps": 5, "callback_on_step_end": stop_after_1}
    want = _diffusers_np(sd21_reference, **call)
    steps: list[int] = []
    got = sd21_pipe(**call, callback=lambda i, t, latents: steps.append(i), seed=7, output_type="np", progress=False)
    assert steps == [0, 1] and sd21_pipe.interrupt
    assert np.abs(got.images - want).max() < 1e-4
    sd21_pipe(**FAST, seed=7)
    assert not sd21_pipe.interrupt  # cleared by the next call


def test_data_parallel_takes_the_diffusers_keywords(toy_artifact: Path, toy_pipe: EnginePipeline) -> None:
    from diffusion_trt.runtime.parallel import DataParallelPipeline

    seen: list[Any] = []

    def damp(pipe: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        seen.append(pipe)
        return {"latents": kwargs["latents"] * 0.5}

    call = {"num_inference_steps": 2, "seed": 4, "output_type": "np", "guidance_rescale": 0.5,
            "callback_on_step_end": damp}
    pipes = [EnginePipeline.from_artifacts(toy_artifact, verify=False) for _ in range(2)]
    with DataParallelPipeline(pipes, warm_up=False) as multi:
        got, nsfw = multi(["a cat", "a dog"], **call, return_dict=False)
        assert seen and all(p is multi for p in seen) and nsfw is None
    want = toy_pipe(["a cat", "a dog"], progress=False, **call)
    np.testing.assert_array_equal(got, want.images)


def test_set_progress_bar_config_disable_as_diffusers(toy_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with EnginePipeline.from_artifacts(toy_artifact) as pipe:
        pipe.set_progress_bar_config(disable=True)
        pipe("a cat", num_inference_steps=2, seed=0)
        assert "denoise" not in capsys.readouterr().err
        pipe("a cat", num_inference_steps=2, seed=0, progress=True)  # the call's own choice wins
        assert "denoise" in capsys.readouterr().err
        with pytest.raises(RuntimeInputError, match=r"set_progress_bar_config takes disable= only \(got leave"):
            pipe.set_progress_bar_config(leave=False)


@pytest.mark.parametrize(("text", "embeds"), [("prompt_2", "prompt_embeds"),
                                              ("negative_prompt_2", "negative_prompt_embeds")])
def test_sdxl_second_text_beside_its_embeddings_is_refused(tiny_sdxl_artifact: Path, text: str, embeds: str) -> None:
    with EnginePipeline.from_artifacts(tiny_sdxl_artifact) as pipe:
        unet = pipe.engines["unet"].spec
        states = torch.zeros(1, 77, int(unet.input("encoder_hidden_states").shape[2]))
        pooled = torch.zeros(1, int(unet.input("text_embeds").shape[1]))
        given = {"prompt_embeds": states, "pooled_prompt_embeds": pooled, "negative_prompt_embeds": states,
                 "negative_pooled_prompt_embeds": pooled}
        with pytest.raises(RuntimeInputError, match=f"pass either {text}= or {embeds}=, not both"):
            pipe(**given, **{text: "ignored"}, num_inference_steps=2, progress=False)  # diffusers: ValueError


# --- schedulers swapped the diffusers way -------------------------------------------------------------------------


@pytest.mark.parametrize(("cls", "options", "name"), [
    (diffusers.EulerDiscreteScheduler, {"use_karras_sigmas": True, "timestep_spacing": "trailing"}, "euler"),
    (diffusers.DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True},
     "dpm++_sde_karras"),
    (diffusers.DDIMScheduler, {"timestep_spacing": "linspace", "rescale_betas_zero_snr": True}, "ddim"),
])
def test_assigning_a_scheduler_matches_diffusers(sd21_reference: Any, sd21_pipe: EnginePipeline, cls: type,
                                                 options: dict[str, Any], name: str) -> None:
    original = sd21_reference.scheduler
    sd21_reference.scheduler = cls.from_config(original.config, **options)
    try:
        want = _diffusers_np(sd21_reference, **CALL)
    finally:
        sd21_reference.scheduler = original
    sd21_pipe.scheduler = cls.from_config(sd21_pipe.scheduler.config, **options)  # diffusers' swap
    try:
        assert sd21_pipe.scheduler_name == name and type(sd21_pipe.scheduler) is cls
        got = sd21_pipe(**CALL, seed=7, output_type="np", progress=False).images
    finally:
        sd21_pipe.set_scheduler(None)
    assert np.abs(got - want).max() < 1e-4


def test_assigning_a_scheduler_the_runtime_does_not_run_is_refused(toy_pipe: EnginePipeline) -> None:
    with pytest.raises(RuntimeInputError, match=r"scheduler=LCMScheduler cannot run here: .*not one the runtime runs"):
        toy_pipe.scheduler = diffusers.LCMScheduler.from_config(toy_pipe.scheduler.config)
    with pytest.raises(RuntimeInputError, match="scheduler=str cannot run here: str is not a diffusers scheduler"):
        toy_pipe.scheduler = "euler"
    assert toy_pipe.scheduler_name == "pndm"  # unchanged

"""EnginePipeline called the way diffusers' pipelines are: the keywords of ``StableDiffusionPipeline.__call__``
that the loop honours (``return_dict``, ``guidance_rescale``, ``callback_on_step_end``...) and the ones it refuses by
name, on the toy artifact (behaviour) and the tiny one (images against diffusers, CPU fp32)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

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

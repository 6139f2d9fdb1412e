"""End-to-end parity: EnginePipeline on the compiled tiny artifact vs diffusers' StableDiffusionPipeline.

Same pipeline folder, seed, scheduler, steps and size: every pixel within 1/255 at fp32. The diffusers
side swaps schedulers the way its users do (``Class.from_config(pipe.scheduler.config)``), written here
independently of the runtime's name table.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch

from diffusion_trt.runtime import EnginePipeline

from .prompt_reference import reference_states

#: runtime name -> how a diffusers user builds that scheduler from the model's config
DIFFUSERS_SCHEDULERS: dict[str | None, tuple[type, dict[str, Any]]] = {
    None: (diffusers.PNDMScheduler, {}),
    "euler_a": (diffusers.EulerAncestralDiscreteScheduler, {}),  # draws noise from the generator every step
    "dpm++": (diffusers.DPMSolverMultistepScheduler, {}),  # multistep
    "ddim": (diffusers.DDIMScheduler, {}),
    "heun": (diffusers.HeunDiscreteScheduler, {}),  # two UNet calls per step
}


@pytest.fixture(scope="module")
def reference(tiny_pipeline_dir: Path) -> diffusers.StableDiffusionPipeline:
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_pipeline_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def engine_pipes(tiny_artifact: Path) -> Iterator[dict[bool, EnginePipeline]]:
    """The artifact loaded twice: plain ORT runs, and IO binding with reused output buffers (as on CUDA)."""
    with (
        EnginePipeline.from_artifacts(tiny_artifact) as plain,
        EnginePipeline.from_artifacts(tiny_artifact, verify=False, io_binding=True) as bound,
    ):
        yield {False: plain, True: bound}


CASES: list[tuple[str, str | None, dict[str, Any], bool]] = [
    # id, scheduler, call arguments, io_binding
    ("dpm++-cfg-batch", "dpm++", {"prompt": ["a red cube", "a blue sphere"], "num_images_per_prompt": 2}, False),
    ("euler_a-negative", "euler_a", {"prompt": "a cat", "negative_prompt": "blurry, low quality"}, False),
    # PNDM keeps the raw UNet outputs of past steps: catches a reused (aliased) engine output buffer
    ("pndm-no-cfg-bound", None, {"prompt": ["a cat", "a dog"], "guidance_scale": 1.0}, True),
    ("ddim-non-square-bound", "ddim", {"prompt": "a house", "height": 48, "width": 80, "guidance_scale": 3.0}, True),
    # 120 tokens: two 75-token chunks on the UNet's 77..231-token context (diffusers cuts at 77: it gets the chunks
    # as prompt_embeds, built independently by tests/runtime/prompt_reference.py)
    ("heun-long-prompt", "heun", {"prompt": "a very long prompt " * 30, "num_inference_steps": 4}, False),
]


def _long_prompt_as_embeds(reference: diffusers.StableDiffusionPipeline, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for diffusers: a single prompt over 75 tokens becomes its chunked prompt_embeds (and the empty
    negative prompt's, padded to as many chunks)."""
    prompt = kwargs.get("prompt")
    if not isinstance(prompt, str) or len(reference.tokenizer(prompt).input_ids) <= 77:
        return kwargs
    embeds = reference_states(reference.text_encoder, reference.tokenizer, [[(prompt, 1.0)]])
    chunks = embeds.shape[0] // 77
    negative = reference_states(reference.text_encoder, reference.tokenizer, [[]], chunks)
    rest = {k: v for k, v in kwargs.items() if k != "prompt"}
    return {**rest, "prompt_embeds": embeds[None], "negative_prompt_embeds": negative[None]}


@pytest.mark.parametrize(("scheduler", "kwargs", "io_binding"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_images_match_diffusers(
    reference: diffusers.StableDiffusionPipeline,
    engine_pipes: dict[bool, EnginePipeline],
    scheduler: str | None,
    kwargs: dict[str, Any],
    io_binding: bool,
) -> None:
    kwargs = {"num_inference_steps": 6, **kwargs}
    pipe = engine_pipes[io_binding]
    pipe.set_scheduler(scheduler)
    cls, overrides = DIFFUSERS_SCHEDULERS[scheduler]
    original = reference.scheduler
    reference.scheduler = cls.from_config(original.config, **overrides)
    ref_kwargs = _long_prompt_as_embeds(reference, kwargs)
    try:
        want = reference(**ref_kwargs, generator=torch.Generator("cpu").manual_seed(1234), output_type="np").images
    finally:
        reference.scheduler = original
    got = pipe(**kwargs, seed=1234, output_type="np", progress=False).images

    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4  # float images: ORT vs torch kernels only
    got8 = np.stack([np.asarray(i) for i in pipe(**kwargs, seed=1234, progress=False).images]).astype(int)
    want8 = (want * 255).round().astype(int)
    assert np.abs(got8 - want8).max() <= 1  # the stated contract: within 1/255 per pixel

"""The generation arguments declared once (runtime/generation_args.py), and every front taking its defaults from them:
the Python API (Request.build, EnginePipeline.__call__), the CLI's run, serving."""

from __future__ import annotations

import inspect

import pytest

from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import generation_args as ga
from diffusion_trt.runtime.generation_args import GENERATION_ARGS, MAX_SEED, check_arg


def test_defaults_per_pipeline_kind_and_front() -> None:
    assert ga.default_guidance_scale("sd") == 7.5 and ga.default_guidance_scale("sdxl") == 5.0  # diffusers' classes
    steps = GENERATION_ARGS["num_inference_steps"]
    assert (steps.default_for("sd"), steps.default_for("sdxl", front=True)) == (50, 30)
    assert ga.serve_defaults("sdxl") == {"negative_prompt": "", "seed": 0, "steps": 30, "guidance_scale": 5.0}
    assert ga.serve_defaults("sd")["guidance_scale"] == 7.5


@pytest.mark.parametrize(("name", "value", "message"), [
    ("num_inference_steps", 0, r"num_inference_steps=0 must be an integer >= 1; use e.g. 30 or 50"),
    ("num_images_per_prompt", True, r"num_images_per_prompt=True must be an integer >= 1"),
    ("guidance_scale", float("inf"), r"guidance_scale=inf must be a finite number >= 0"),
    ("eta", -0.5, r"eta=-0.5 must be a finite number >= 0"),
    ("seed", MAX_SEED + 1, rf"seed={MAX_SEED + 1} must be an integer in 0..{MAX_SEED}"),
])
def test_check_arg_refuses_with_the_value_and_the_fix(name: str, value: object, message: str) -> None:
    with pytest.raises(RuntimeInputError, match=message):
        check_arg(name, value)


def test_check_arg_returns_plain_numbers() -> None:
    import numpy as np

    assert check_arg("num_inference_steps", np.int64(3)) == 3 and type(check_arg("eta", 1)) is float


def test_the_api_signatures_take_the_table_defaults() -> None:
    from diffusion_trt.runtime.pipeline import EnginePipeline
    from diffusion_trt.runtime.request import Request

    for fn in (EnginePipeline.__call__, Request.build):
        params = inspect.signature(fn).parameters
        for name in ("num_inference_steps", "num_images_per_prompt", "eta"):
            assert params[name].default == GENERATION_ARGS[name].default, (fn, name)
        assert params["guidance_scale"].default is None  # per pipeline kind: RequestSpec.default_guidance_scale


def test_the_cli_run_options_take_the_table_front_defaults() -> None:
    from diffusion_trt.cli import main

    options = {p.name: p for p in main.commands["run"].params}
    for option, name in (("steps", "num_inference_steps"), ("seed", "seed"), ("batch_size", "num_images_per_prompt")):
        assert options[option].default == GENERATION_ARGS[name].default_for(front=True)
        assert f"--{option.replace('_', '-')}" == GENERATION_ARGS[name].cli
    assert options["guidance"].default is None and "5.0 for SDXL" in options["guidance"].help

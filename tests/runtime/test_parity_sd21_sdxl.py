"""End-to-end parity for SD-2.x and SDXL: EnginePipeline on the compiled tiny-sd21 / tiny-sdxl artifacts (ORT CPU,
fp32) vs diffusers' StableDiffusionPipeline (v-prediction) / StableDiffusionXLPipeline on the same folder, seed,
scheduler, steps and size: every pixel within 1/255, float images within 1e-4 (as test_parity.py for SD-1.5).

The tiny-sdxl artifact keeps every component's weights in external data (tests/conftest.py), the path the real
SDXL's > 2 GB UNet and text_encoder_2 take.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch

from diffusion_trt.artifact.folder import read_manifest
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline


def _compare(reference: Any, pipe: EnginePipeline, scheduler: type | None, name: str | None,
             kwargs: dict[str, Any]) -> None:
    kwargs = {"num_inference_steps": 5, **kwargs}
    pipe.set_scheduler(name)
    original = reference.scheduler
    if scheduler is not None:
        reference.scheduler = scheduler.from_config(original.config)
    try:
        want = reference(**kwargs, generator=torch.Generator("cpu").manual_seed(1234), output_type="np").images
    finally:
        reference.scheduler = original
    got = pipe(**kwargs, seed=1234, output_type="np", progress=False).images
    assert got.shape == want.shape
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 1e-4  # float images: ORT vs torch kernels only
    got8 = np.stack([np.asarray(i) for i in pipe(**kwargs, seed=1234, progress=False).images]).astype(int)
    want8 = (want * 255).round().astype(int)
    assert np.abs(got8 - want8).max() <= 1  # the stated contract: within 1/255 per pixel


# --- SD 2.x ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sd21_reference(tiny_sd21_dir: Path) -> diffusers.StableDiffusionPipeline:
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_sd21_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    return pipe


@pytest.fixture(scope="module")
def sd21_pipe(tiny_sd21_artifact: Path) -> Iterator[EnginePipeline]:
    with EnginePipeline.from_artifacts(tiny_sd21_artifact) as pipe:
        yield pipe


SD21_CASES: list[tuple[str, type | None, str | None, dict[str, Any]]] = [
    # id, diffusers scheduler class (None = the model's DDIM), runtime name, call arguments
    ("ddim-v-cfg", None, None, {"prompt": "a red cube"}),
    ("ddim-v-batch-negative", None, None,
     {"prompt": ["a red cube", "a blue sphere"], "negative_prompt": ["blurry", "dark"], "num_images_per_prompt": 2}),
    ("euler_a-v", diffusers.EulerAncestralDiscreteScheduler, "euler_a", {"prompt": "a cat", "height": 48, "width": 80}),
    ("dpm++-v-no-cfg", diffusers.DPMSolverMultistepScheduler, "dpm++", {"prompt": "a dog", "guidance_scale": 1.0}),
]


@pytest.mark.parametrize(("scheduler", "name", "kwargs"), [c[1:] for c in SD21_CASES], ids=[c[0] for c in SD21_CASES])
def test_sd21_v_prediction_matches_diffusers(sd21_reference: diffusers.StableDiffusionPipeline,
                                             sd21_pipe: EnginePipeline, scheduler: type | None, name: str | None,
                                             kwargs: dict[str, Any]) -> None:
    assert sd21_pipe.architecture == "sd"
    assert sd21_pipe.scheduler.config.prediction_type == "v_prediction"
    _compare(sd21_reference, sd21_pipe, scheduler, name, kwargs)


def test_sdxl_arguments_are_refused_by_an_sd_artifact(sd21_pipe: EnginePipeline) -> None:
    with pytest.raises(RuntimeInputError, match=r"prompt_2, original_size apply to SDXL artifacts only"):
        sd21_pipe("a cat", prompt_2="a dog", original_size=(512, 512), num_inference_steps=1, progress=False)


# --- SDXL -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdxl_reference(tiny_sdxl_dir: Path) -> diffusers.StableDiffusionXLPipeline:
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir, local_files_only=True,
                                                              add_watermarker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def sdxl_pipes(tiny_sdxl_artifact: Path) -> Iterator[dict[bool, EnginePipeline]]:
    """The artifact loaded twice: plain ORT runs, and IO binding with reused output buffers (as on CUDA)."""
    with (
        EnginePipeline.from_artifacts(tiny_sdxl_artifact) as plain,
        EnginePipeline.from_artifacts(tiny_sdxl_artifact, verify=False, io_binding=True) as bound,
    ):
        yield {False: plain, True: bound}


SDXL_CASES: list[tuple[str, type | None, str | None, dict[str, Any], bool]] = [
    # id, diffusers scheduler class (None = the model's Euler), runtime name, call arguments, io_binding
    # negative_prompt=None: force_zeros_for_empty_prompt gives zero negative embeddings; guidance default 5.0
    ("euler-zero-negative", None, None, {"prompt": "a red cube"}, False),
    ("euler-negative-batch-bound", None, None,
     {"prompt": ["a red cube", "a blue sphere"], "negative_prompt": ["blurry", "dark"], "num_images_per_prompt": 2},
     True),
    ("euler-no-cfg", None, None, {"prompt": "a dog", "guidance_scale": 1.0}, False),
    ("dpm++-micro-conditioning", diffusers.DPMSolverMultistepScheduler, "dpm++",
     {"prompt": "a house", "prompt_2": "in the snow", "negative_prompt": "x", "negative_prompt_2": "y",
      "height": 48, "width": 80, "guidance_scale": 7.0, "original_size": (512, 300), "crops_coords_top_left": (8, 16),
      "target_size": (48, 80), "negative_original_size": (128, 128), "negative_target_size": (48, 80)}, False),
    ("euler_a-full-chunk", diffusers.EulerAncestralDiscreteScheduler, "euler_a", {"prompt": "a long prompt " * 25},
     False),  # draws noise every step; 75 tokens: one full chunk (longer ones: tests/runtime/test_sdxl_prompts.py)
    # five images: above the profile's max batch 4, so the request runs in two chunks (a deterministic scheduler:
    # see runtime/batching.py for why chunked requests of noise-drawing schedulers differ from one diffusers call)
    ("euler-chunked", None, None, {"prompt": "a cat", "num_images_per_prompt": 5}, False),
]


@pytest.mark.parametrize(("scheduler", "name", "kwargs", "io_binding"), [c[1:] for c in SDXL_CASES],
                         ids=[c[0] for c in SDXL_CASES])
def test_sdxl_matches_diffusers(sdxl_reference: diffusers.StableDiffusionXLPipeline,
                                sdxl_pipes: dict[bool, EnginePipeline], scheduler: type | None, name: str | None,
                                kwargs: dict[str, Any], io_binding: bool) -> None:
    pipe = sdxl_pipes[io_binding]
    assert pipe.architecture == "sdxl"
    _compare(sdxl_reference, pipe, scheduler, name, kwargs)


def test_sdxl_artifact_is_external_data_everywhere(tiny_sdxl_artifact: Path) -> None:
    """The > 2 GB path: every component's graph with its weights in model.onnx.data beside it, hashed and sealed."""
    manifest = read_manifest(tiny_sdxl_artifact)
    assert list(manifest["components"]) == ["text_encoder", "text_encoder_2", "unet", "vae_decoder", "vae_encoder"]
    for name, entry in manifest["components"].items():
        assert entry["files"] == [f"{name}/model.onnx", f"{name}/model.onnx.data"], name
        assert f"{name}/model.onnx.data" in manifest["files"]


def test_sdxl_default_guidance_is_diffusers(sdxl_reference: diffusers.StableDiffusionXLPipeline,
                                            sdxl_pipes: dict[bool, EnginePipeline]) -> None:
    """guidance_scale=None is the pipeline class's default: 5.0 for SDXL (diffusers' StableDiffusionXLPipeline)."""
    out = sdxl_pipes[False]("a cat", num_inference_steps=1, seed=0, output_type="latent", progress=False)
    assert out.parameters["guidance_scale"] == 5.0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"original_size": (512,)}, r"original_size=\(512,\) must be a pair of integers >= 1"),
    ({"crops_coords_top_left": (-1, 0)}, r"crops_coords_top_left=\(-1, 0\) must be a pair of integers >= 0"),
    ({"target_size": "1024x1024"}, r"target_size='1024x1024' must be a pair of integers"),
    ({"prompt_2": ["a", "b"]}, r"prompt_2 has 2 entries but prompt has 1"),
    ({"image": np.zeros((64, 64, 3), np.float32)}, r"not supported for SDXL artifacts yet"),
])
def test_sdxl_bad_arguments(sdxl_pipes: dict[bool, EnginePipeline], kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeInputError, match=message):
        sdxl_pipes[False]("a cat", num_inference_steps=1, progress=False, **kwargs)


def test_cli_run_takes_each_architectures_default_guidance(tiny_sdxl_artifact: Path, tiny_sd21_artifact: Path,
                                                           tmp_path: Path) -> None:
    """`run` without --guidance: 5.0 for SDXL, 7.5 for SD (diffusers' defaults), recorded in the PNG."""
    from click.testing import CliRunner

    from diffusion_trt.cli import main
    from diffusion_trt.runtime.png import read_png_parameters

    for artifact, want in ((tiny_sdxl_artifact, 5.0), (tiny_sd21_artifact, 7.5)):
        out = tmp_path / f"{artifact.name}.png"
        result = CliRunner().invoke(main, ["run", str(artifact), "-p", "a cat", "--steps", "2", "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert read_png_parameters(out)["guidance_scale"] == want

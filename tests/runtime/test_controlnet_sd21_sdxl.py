"""ControlNet parity on the tiny SD-2.1 (v-prediction, linear projections) and SDXL (text_time added conditioning,
9 + 1 residuals) architectures vs diffusers' StableDiffusionControlNetPipeline / StableDiffusionXLControlNetPipeline.

CPU, fp32, same weights, seed, scheduler and steps: the float images within 1e-5.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_trt.compiler.dummy_controlnet import write_dummy_controlnet
from diffusion_trt.compiler.pipeline import compile_pipeline
from diffusion_trt.config import CompileConfig
from diffusion_trt.runtime import EnginePipeline

TOL = 1e-5
REFERENCE = {"tiny-sd21": diffusers.StableDiffusionControlNetPipeline,
             "tiny-sdxl": diffusers.StableDiffusionXLControlNetPipeline}


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8))


@pytest.fixture(scope="module", params=["tiny-sd21", "tiny-sdxl"])
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path, Path]:
    """(arch, pipeline folder, artifact compiled with one dummy ControlNet "a", the ControlNet folder)."""
    arch = request.param
    folder: Path = request.getfixturevalue("tiny_sd21_dir" if arch == "tiny-sd21" else "tiny_sdxl_dir")
    root = tmp_path_factory.mktemp(f"cn-{arch}")
    cn = write_dummy_controlnet(root / "cn", arch, seed=0)
    config = CompileConfig(components=("text_encoder", "unet", "vae_decoder"), controlnets=(("a", str(cn)),),
                           height=64, width=64)
    return arch, folder, compile_pipeline(folder, root / "art", config), cn


@pytest.mark.parametrize("kwargs", [{"controlnet_conditioning_scale": 0.9, "control_guidance_end": 0.75},
                                    {"guess_mode": True}], ids=["scale-window", "guess-mode"])
def test_matches_diffusers(built: tuple[str, Path, Path, Path], kwargs: dict[str, Any]) -> None:
    arch, folder, artifact, cn = built
    ref = REFERENCE[arch].from_pretrained(folder, controlnet=diffusers.ControlNetModel.from_pretrained(cn),
                                          local_files_only=True,
                                          **({"safety_checker": None, "requires_safety_checker": False}
                                             if arch == "tiny-sd21" else {}))
    ref.set_progress_bar_config(disable=True)
    common = {"prompt": "a cat", "num_inference_steps": 4, "height": 64, "width": 64, **kwargs}
    want = ref(image=_image(0), generator=torch.Generator("cpu").manual_seed(2), output_type="np", **common).images
    with EnginePipeline.from_artifacts(artifact) as pipe:
        got = pipe(control_image=_image(0), controlnet="a", seed=2, output_type="np", progress=False, **common).images
        plain = pipe(seed=2, output_type="np", progress=False,
                     **{k: v for k, v in common.items() if not k.startswith(("control", "guess"))}).images
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL
    assert np.abs(got - plain).max() > 1e-3  # the ControlNet changed the image

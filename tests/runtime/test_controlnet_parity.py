"""ControlNet parity: EnginePipeline on a tiny artifact compiled with two ControlNets vs diffusers'
StableDiffusionControlNetPipeline (one ControlNetModel, or a MultiControlNetModel of both) on the same weights.

CPU, fp32, same seed, scheduler and steps: the final latents and the float images within 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterator
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
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline

TOL = 1e-5


@pytest.fixture(scope="session")
def controlnet_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("controlnets")
    return {"a": write_dummy_controlnet(root / "a", "tiny", seed=0), "b": write_dummy_controlnet(root / "b", "tiny",
                                                                                                   seed=5)}


@pytest.fixture(scope="session")
def controlnet_artifact(tiny_pipeline_dir: Path, controlnet_dirs: dict[str, Path],
                        tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = CompileConfig(components=("text_encoder", "unet", "vae_decoder"),
                           controlnets=tuple((n, str(p)) for n, p in controlnet_dirs.items()))
    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("cn-artifact") / "tiny-cn", config)


@pytest.fixture(scope="module")
def pipe(controlnet_artifact: Path) -> Iterator[EnginePipeline]:
    with EnginePipeline.from_artifacts(controlnet_artifact) as p:
        yield p


def _reference(folder: Path, controlnets: dict[str, Path], names: list[str]) -> Any:
    models = [diffusers.ControlNetModel.from_pretrained(controlnets[n], local_files_only=True) for n in names]
    cn = models[0] if len(models) == 1 else diffusers.MultiControlNetModel(models)
    ref = diffusers.StableDiffusionControlNetPipeline.from_pretrained(folder, controlnet=cn, local_files_only=True,
                                                                    safety_checker=None, requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    return ref


def _image(seed: int, size: int = 64) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


CASES: list[tuple[str, list[str], dict[str, Any]]] = [
    ("one", ["a"], {"controlnet_conditioning_scale": 0.8}),
    ("one-window", ["a"], {"control_guidance_start": 0.25, "control_guidance_end": 0.6}),
    ("one-guess-mode", ["a"], {"guess_mode": True, "controlnet_conditioning_scale": 1.5}),
    ("two", ["a", "b"], {"controlnet_conditioning_scale": [0.7, 1.2]}),
    ("two-windows", ["b", "a"], {"control_guidance_start": [0.0, 0.5], "control_guidance_end": [0.5, 1.0]}),
    ("two-batch-no-cfg", ["a", "b"], {"guidance_scale": 1.0, "num_images_per_prompt": 2}),
]


@pytest.mark.parametrize(("names", "kwargs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_matches_diffusers_controlnet_pipeline(pipe: EnginePipeline, tiny_pipeline_dir: Path,
                                               controlnet_dirs: dict[str, Path], names: list[str],
                                               kwargs: dict[str, Any]) -> None:
    images = [_image(i) for i in range(len(names))]
    ref = _reference(tiny_pipeline_dir, controlnet_dirs, names)
    common = {"prompt": "an ink painting of a mountain", "num_inference_steps": 5, **kwargs}
    control = images[0] if len(names) == 1 else images
    want = ref(image=control, generator=torch.Generator("cpu").manual_seed(7), output_type="np", **common).images
    got = pipe(control_image=control, controlnet=names, seed=7, output_type="np", progress=False, **common).images
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL
    plain = pipe(seed=7, output_type="np", progress=False,
                 **{k: v for k, v in common.items() if not k.startswith(("control", "guess"))}).images
    assert np.abs(got - plain).max() > 1e-3  # the ControlNets changed the image


def test_scale_zero_equals_no_controlnet(pipe: EnginePipeline) -> None:
    common = {"prompt": "a cat", "num_inference_steps": 4, "seed": 3, "output_type": "np", "progress": False}
    plain = pipe(**common).images
    zero = pipe(control_image=[_image(1), _image(2)], controlnet=["a", "b"], controlnet_conditioning_scale=0.0,
                **common).images
    assert np.array_equal(plain, zero)


def test_image_is_the_control_image_as_in_diffusers(pipe: EnginePipeline) -> None:
    common = {"prompt": "a cat", "num_inference_steps": 3, "seed": 3, "output_type": "np", "progress": False}
    a = pipe(image=_image(1), controlnet="a", **common).images
    b = pipe(control_image=_image(1), controlnet="a", **common).images
    assert np.array_equal(a, b)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"control_image": _image(0, 48), "controlnet": "a"}, "is 48x48 (WxH) but the output is 64x64"),
    ({"control_image": _image(0), "controlnet": "a", "controlnet_conditioning_scale": float("nan")}, "not a finite"),
    ({"control_image": _image(0), "controlnet": "a", "controlnet_conditioning_scale": float("inf")}, "not a finite"),
    ({"control_image": [_image(0), _image(1), _image(2)], "controlnet": ["a", "b"]},
     "3 control images for 2 ControlNet(s)"),
    ({"control_image": _image(0)}, "this artifact has 2 ControlNets (a, b)"),
    ({"control_image": _image(0), "controlnet": "c"}, "ControlNet 'c' is not in this artifact; it has a, b"),
    ({"control_image": _image(0), "controlnet": "a", "control_guidance_start": 0.7, "control_guidance_end": 0.2},
     "need 0 <= start < end <= 1"),
])
def test_bad_control_arguments(pipe: EnginePipeline, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeInputError) as e:
        pipe(prompt="a cat", num_inference_steps=2, seed=0, progress=False, **kwargs)
    assert message in str(e.value)

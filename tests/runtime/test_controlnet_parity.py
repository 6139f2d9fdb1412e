"""ControlNet parity: EnginePipeline on a tiny artifact compiled with two ControlNets vs diffusers'
StableDiffusionControlNetPipeline (one ControlNetModel, or a MultiControlNetModel of both) on the same weights.

CPU, fp32, same seed, scheduler and steps: the final latents and the float images within 1e-5.
"""

from __future__ import annotations

import json
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
    config = CompileConfig(components=("text_encoder", "unet", "vae_decoder", "vae_encoder"),
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


def test_img2img_matches_diffusers_controlnet_img2img(pipe: EnginePipeline, tiny_pipeline_dir: Path,
                                                      controlnet_dirs: dict[str, Path]) -> None:
    cn = diffusers.ControlNetModel.from_pretrained(controlnet_dirs["a"], local_files_only=True)
    ref = diffusers.StableDiffusionControlNetImg2ImgPipeline.from_pretrained(
        tiny_pipeline_dir, controlnet=cn, local_files_only=True, safety_checker=None, requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    common = {"prompt": "a lake", "num_inference_steps": 6, "strength": 0.6, "image": _image(8),
              "control_image": _image(9), "control_guidance_start": 0.2}
    want = ref(generator=torch.Generator("cpu").manual_seed(4), output_type="np", **common).images
    got = pipe(controlnet="a", seed=4, output_type="np", progress=False, **common).images
    assert np.abs(got - want).max() <= TOL


def _mask(size: int = 64) -> Image.Image:
    m = np.zeros((size, size), np.uint8)
    m[size // 4: 3 * size // 4, size // 8: 5 * size // 8] = 255
    return Image.fromarray(m)


def _inpaint_reference(folder: Path, controlnet: Path) -> Any:
    cn = diffusers.ControlNetModel.from_pretrained(controlnet, local_files_only=True)
    ref = diffusers.StableDiffusionControlNetInpaintPipeline.from_pretrained(
        folder, controlnet=cn, local_files_only=True, safety_checker=None, requires_safety_checker=False)
    ref.set_progress_bar_config(disable=True)
    return ref


@pytest.mark.parametrize("kwargs", [{"strength": 1.0}, {"strength": 0.7, "controlnet_conditioning_scale": 1.3,
                                                         "control_guidance_end": 0.8}], ids=["full", "partial"])
def test_inpaint_matches_diffusers_controlnet_inpaint(pipe: EnginePipeline, tiny_pipeline_dir: Path,
                                                      controlnet_dirs: dict[str, Path], kwargs: dict[str, Any]) -> None:
    """A 4-channel UNet with a mask (diffusers blends the image's noised latents back after every step); the
    default scale is the inpainting pipeline's 0.5."""
    ref = _inpaint_reference(tiny_pipeline_dir, controlnet_dirs["a"])
    common = {"prompt": "a lake", "num_inference_steps": 5, "image": _image(8), "mask_image": _mask(),
              "control_image": _image(9), **kwargs}
    want = ref(generator=torch.Generator("cpu").manual_seed(4), height=64, width=64, output_type="np",
               **common).images
    got = pipe(controlnet="a", seed=4, output_type="np", progress=False, **common).images
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL
    plain = pipe(seed=4, output_type="np", progress=False,
                 **{k: v for k, v in common.items() if not k.startswith("control")}).images
    assert np.abs(got - plain).max() > 1e-3  # the ControlNet changed the image


@pytest.fixture(scope="module")
def inpaint_unet_case(controlnet_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny 9-channel inpainting pipeline folder, its artifact with the 4-channel ControlNet "a")."""
    from diffusion_trt.compiler.dummy import write_dummy_pipeline

    root = tmp_path_factory.mktemp("cn-inpaint")
    folder = write_dummy_pipeline(root / "model", arch="tiny-sd15-inpaint", seed=0)
    config = CompileConfig(components=("text_encoder", "unet", "vae_decoder", "vae_encoder"),
                           controlnets=(("a", str(controlnet_dirs["a"])),))
    return folder, compile_pipeline(folder, root / "art", config)


def test_inpaint_unet_matches_diffusers_controlnet_inpaint(inpaint_unet_case: tuple[Path, Path],
                                                           controlnet_dirs: dict[str, Path]) -> None:
    """A 9-channel inpainting UNet: the ControlNet sees the 4-channel latents, the UNet cat([latents, mask,
    masked-image latents])."""
    folder, artifact = inpaint_unet_case
    ref = _inpaint_reference(folder, controlnet_dirs["a"])
    common = {"prompt": "a lake", "num_inference_steps": 5, "image": _image(8), "mask_image": _mask(),
              "control_image": _image(9), "controlnet_conditioning_scale": 0.9}
    want = ref(generator=torch.Generator("cpu").manual_seed(5), height=64, width=64, output_type="np",
               **common).images
    with EnginePipeline.from_artifacts(artifact) as p:
        assert p.unet_in_channels == 9
        got = p(controlnet="a", seed=5, output_type="np", progress=False, **common).images
        plain = p(seed=5, output_type="np", progress=False,
                  **{k: v for k, v in common.items() if not k.startswith("control")}).images
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= TOL
    assert np.abs(got - plain).max() > 1e-3


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
    # finite in float64, beyond float32: it overflowed on the device (a traceback) before
    ({"control_image": _image(0), "controlnet": "a", "controlnet_conditioning_scale": 1e39}, "not a finite"),
    # NaN/Inf in an array or tensor control image gave a black image and a warning after the run
    ({"control_image": np.full((64, 64, 3), np.nan, np.float32), "controlnet": "a"},
     "control_image (ControlNet 'a') contains NaN/Inf values (12288 of 12288); pass finite values"),
    ({"control_image": [_image(0), torch.zeros(1, 3, 64, 64).index_fill(2, torch.tensor([0]), float("inf"))],
      "controlnet": ["a", "b"]}, "control_image (ControlNet 'b') contains NaN/Inf values (192 of 12288)"),
    ({"control_image": [_image(0), _image(1), _image(2)], "controlnet": ["a", "b"]},
     "3 control images for 2 ControlNet(s)"),
    ({"control_image": _image(0)}, "this artifact has 2 ControlNets (a, b)"),
    ({"control_image": _image(0), "controlnet": "c"}, "ControlNet 'c' is not in this artifact; it has a, b"),
    ({"control_image": _image(0), "controlnet": "a", "control_guidance_start": 0.7, "control_guidance_end": 0.2},
     "need 0 <= start < end <= 1"),
    # ControlNet arguments without a control image would be ignored (diffusers' txt2img pipeline has none of them)
    ({"guess_mode": True}, "guess_mode= was given without control_image=, so no ControlNet would run"),
    ({"controlnet": "a"}, "controlnet= was given without control_image="),
    ({"controlnet_conditioning_scale": 0.5}, "controlnet_conditioning_scale= was given without control_image="),
    ({"control_guidance_start": 0.2}, "control_guidance_start= was given without control_image="),
    ({"control_guidance_end": [0.5, 0.5]}, "control_guidance_end= was given without control_image="),
])
def test_bad_control_arguments(pipe: EnginePipeline, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeInputError) as e:
        pipe(prompt="a cat", num_inference_steps=2, seed=0, progress=False, **kwargs)
    assert message in str(e.value)


# --- the command line --------------------------------------------------------------------------------------------


def _run(artifact: Path, tmp_path: Path, *args: str) -> Any:
    from click.testing import CliRunner

    from diffusion_trt.cli import main

    return CliRunner().invoke(main, ["run", str(artifact), "-p", "a cat", "--steps", "2", "-o",
                                     str(tmp_path / "out.png"), *args])


def _control_png(tmp_path: Path, name: str, size: int = 64) -> str:
    path = tmp_path / name
    _image(3, size).save(path)
    return str(path)


def test_run_with_two_controlnets_writes_the_image_and_parameters(controlnet_artifact: Path, tmp_path: Path) -> None:
    result = _run(controlnet_artifact, tmp_path, "--controlnet", "a:0.5", "--control-image",
                  _control_png(tmp_path, "a.png"), "--controlnet", "b", "--control-image",
                  _control_png(tmp_path, "b.png"), "--control-guidance-end", "0.5")
    assert result.exit_code == 0, result.output
    assert f"image: {tmp_path / 'out.png'}" in result.output
    params = json.loads(Image.open(tmp_path / "out.png").text["parameters"])
    assert params["controlnet"] == ["a", "b"] and params["controlnet_conditioning_scale"] == [0.5, 1.0]


@pytest.mark.parametrize(("args", "message"), [
    (["--controlnet", "a"], "0 --control-image for 1 --controlnet"),
    (["--controlnet", "a:nan", "--control-image", "{a}"], "the scale 'nan' is not a finite number"),
    (["--controlnet", "a:x", "--control-image", "{a}"], "the scale 'x' is not a finite number"),
    (["--controlnet", "a:-1e39", "--control-image", "{a}"], "the scale '-1e39' is not a finite number"),
    (["--controlnet", "a", "--control-image", "{small}"], "is 48x48 (WxH) but the output is 64x64"),
    (["--controlnet", "z", "--control-image", "{a}"], "ControlNet 'z' is not in this artifact; it has a, b"),
    (["--controlnet", "a", "--control-image", "{a}", "--control-guidance-start", "0.9", "--control-guidance-end",
      "0.1"], "control_guidance_start=0.9 and control_guidance_end=0.1: need 0 <= start < end <= 1"),
])
def test_run_bad_control_input_is_one_error_line_exit_2(controlnet_artifact: Path, tmp_path: Path, args: list[str],
                                                        message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused from the manifest before any engine loads (an unknown name, a control image of another size and a
    bad guidance window were refused after the load: 15-18 s for SD)."""
    monkeypatch.setattr(EnginePipeline, "from_artifacts", lambda *a, **k: pytest.fail("loaded"))
    files = {"a": _control_png(tmp_path, "a.png"), "small": _control_png(tmp_path, "s.png", 48)}
    result = _run(controlnet_artifact, tmp_path, *(a.format(**files) for a in args))
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert not (tmp_path / "out.png").exists()


def test_canny_preprocess_gives_edges(tmp_path: Path) -> None:
    pytest.importorskip("cv2", reason="opencv-python-headless (the control extra) is not installed")
    from diffusion_trt.runtime.control_preprocess import canny

    im = Image.new("RGB", (64, 64), "black")
    im.paste((255, 255, 255), (16, 16, 48, 48))
    edges = np.asarray(canny(im))
    assert edges.shape == (64, 64, 3) and set(np.unique(edges)) == {0, 255}
    assert edges[32, 16].all() and not edges[32, 32].any()  # the square's border, not its inside


# --- add-controlnet: add or swap without rebuilding the UNet -----------------------------------------------------


def test_add_controlnet_adds_and_swaps_without_rebuilding_the_unet(controlnet_artifact: Path, tiny_pipeline_dir: Path,
                                                                   tmp_path: Path) -> None:
    import shutil

    from click.testing import CliRunner

    from diffusion_trt.cli import main

    art = tmp_path / "art"
    shutil.copytree(controlnet_artifact, art)
    before = json.loads((art / "manifest.json").read_text())
    new = write_dummy_controlnet(tmp_path / "c", "tiny", seed=9)
    result = CliRunner().invoke(main, ["add-controlnet", str(art), str(tiny_pipeline_dir), f"c={new}",
                                       f"a={new}", "--replace"])
    assert result.exit_code == 0, result.output
    after = json.loads((art / "manifest.json").read_text())
    assert list(after["components"]) == [*before["components"], "controlnet_c"]
    for name in ("unet", "unet_controlnet", "controlnet_b"):  # untouched
        assert after["components"][name] == before["components"][name]
    onnx_a = after["components"]["controlnet_a"]["onnx"]
    assert after["files"][onnx_a]["sha256"] != before["files"][onnx_a]["sha256"]  # swapped
    assert [c[0] for c in after["config"]["controlnets"]] == ["b", "c", "a"]  # a given again: last
    assert CliRunner().invoke(main, ["verify", str(art)]).exit_code == 0
    with EnginePipeline.from_artifacts(art) as p:
        a = p(prompt="a cat", num_inference_steps=2, seed=1, control_image=_image(0), controlnet="a",
              output_type="np", progress=False).images
        c = p(prompt="a cat", num_inference_steps=2, seed=1, control_image=_image(0), controlnet="c",
              output_type="np", progress=False).images
    assert np.array_equal(a, c)  # a was replaced by the same weights as c


def test_add_controlnet_bad_input(controlnet_artifact: Path, tiny_artifact: Path, tiny_pipeline_dir: Path,
                                  controlnet_dirs: dict[str, Path], tmp_path: Path) -> None:
    from click.testing import CliRunner

    from diffusion_trt.cli import main

    for args, message in (
        ([str(tiny_artifact), str(tiny_pipeline_dir), f"x={controlnet_dirs['a']}"], "has no unet_controlnet"),
        ([str(controlnet_artifact), str(tiny_pipeline_dir), f"a={controlnet_dirs['a']}"],
         "has the ControlNet(s) a already; pass --replace"),
        ([str(controlnet_artifact), str(controlnet_dirs["a"]), f"x={controlnet_dirs['a']}"],
         "is not the model"),
    ):
        result = CliRunner().invoke(main, ["add-controlnet", *args])
        errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and message in errors[0], result.output


# --- the benchmark script, on the tiny arch on the CPU -------------------------------------------------------------


def test_controlnet_benchmark_runs_on_the_tiny_arch(controlnet_artifact: Path, tiny_pipeline_dir: Path,
                                                    controlnet_dirs: dict[str, Path], tmp_path: Path) -> None:
    import argparse
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "controlnet_step.py"
    spec = importlib.util.spec_from_file_location("controlnet_step", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = argparse.Namespace(model_dir=tiny_pipeline_dir, artifact_dir=controlnet_artifact,
                              controlnet_dirs=[controlnet_dirs["a"], controlnet_dirs["b"]], json=tmp_path / "r.json",
                              device="cpu", steps=2, height=64, width=64, counts="0,1,2", step_iters=1, e2e_iters=1,
                              warmup=0)
    out = module.run(args)
    assert json.loads((tmp_path / "r.json").read_text()) == out
    measured = {(r["system"], r["controlnets"]): r for r in out["results"] if "step_ms" in r}
    assert set(measured) == {(s, n) for s in ("ours", "diffusers_eager") for n in (0, 1, 2)}
    assert all(r["step_ms"] > 0 and r["e2e_ms"] > 0 for r in measured.values())
    assert measured[("ours", 0)]["step_cost_vs_0"] == 1.0 and "e2e_speedup_vs_diffusers_eager" in measured[("ours", 2)]
    skipped = [r for r in out["results"] if r.get("status") == "skipped"]
    assert {r["system"] for r in skipped} == {"diffusers_cuda_graph"}
    parity = {r["controlnets"]: r["max_abs_vs_diffusers_eager"] for r in out["results"] if r["system"] == "parity"}
    assert set(parity) == {0, 1, 2} and max(parity.values()) <= 1e-5  # CPU fp32: the parity tests' bound


def test_controlnet_flops_counts_the_down_and_mid_blocks_share_of_the_unet() -> None:
    """benchmarks/controlnet_flops.py on the meta device (no arithmetic): a ControlNet of the SD-1.5 architecture is
    35.3 % of its UNet's step (the down and mid blocks and the condition embedding, 5.2 % of it), the share issue 25's
    35 % goal is set against."""
    import importlib.util

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "controlnet_flops.py"
    spec = importlib.util.spec_from_file_location("controlnet_flops", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    row = module.count("sd15", 2)
    assert row["latent"] == [64, 64]
    assert round(row["unet_tflop"], 3) == 1.607 and round(row["controlnet_share_of_unet"], 3) == 0.353
    assert round(row["cond_embedding_share_of_controlnet"], 3) == 0.052

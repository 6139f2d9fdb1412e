"""EnginePipeline on the toy artifact: loading, argument validation, outputs, seeds, callback, progress."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.errors import ArtifactError, RuntimeInputError
from diffusion_trt.runtime import EnginePipeline, save_png
from diffusion_trt.runtime.png import read_png_parameters
from tests.runtime.toy import write_toy_artifact

FAST: dict[str, Any] = {"num_inference_steps": 2, "progress": False}


def _errors(pipe: EnginePipeline, **kwargs: Any) -> str:
    with pytest.raises(RuntimeInputError) as e:
        pipe(**{"prompt": "a cat", **FAST, **kwargs})
    return str(e.value)


# --- loading -----------------------------------------------------------------------------------------


def test_loads_with_defaults_from_the_manifest(toy_pipe: EnginePipeline, toy_artifact: Path) -> None:
    assert toy_pipe.scheduler_name == "pndm"
    assert toy_pipe.device == torch.device("cpu")
    assert (toy_pipe.default_height, toy_pipe.default_width) == (64, 64)
    assert set(toy_pipe.engines) == {"text_encoder", "unet", "vae_decoder"}
    assert str(toy_artifact) in repr(toy_pipe)
    assert toy_pipe.scheduler is not toy_pipe.scheduler  # a fresh (stateful) scheduler per call


def test_unknown_scheduler_name(toy_artifact: Path) -> None:
    with pytest.raises(RuntimeInputError, match=r"scheduler='fastest' is unknown; use one of pndm, ddim"):
        EnginePipeline.from_artifacts(toy_artifact, scheduler="fastest")


def test_scheduler_that_is_not_a_string(toy_artifact: Path, toy_pipe: EnginePipeline) -> None:
    """It was AttributeError: 'int' object has no attribute 'strip'."""
    with pytest.raises(RuntimeInputError, match=r"^scheduler=5 is unknown; use one of pndm, ddim"):
        EnginePipeline.from_artifacts(toy_artifact, scheduler=5)
    with pytest.raises(RuntimeInputError, match=r"^scheduler=\['euler'\] is unknown; use one of pndm, ddim"):
        toy_pipe.set_scheduler(["euler"])


@pytest.mark.parametrize(("options", "message"), [
    ({"cudnn_conv_algo_search": "FASTEST"},
     "cudnn_conv_algo_search='FASTEST' is unknown; use one of AUTO, EXHAUSTIVE, HEURISTIC, DEFAULT"),
    ({"cudnn_conv_algo_search": None},
     "cudnn_conv_algo_search=None is unknown; use one of AUTO, EXHAUSTIVE, HEURISTIC, DEFAULT"),
    ({"intra_op_num_threads": "2"},
     "intra_op_num_threads='2' must be an integer >= 0 (0: ONNX Runtime's default) or None"),
    ({"intra_op_num_threads": -3},
     "intra_op_num_threads=-3 must be an integer >= 0 (0: ONNX Runtime's default) or None"),
    ({"deterministic": "no"}, "deterministic='no' must be True or False"),
    ({"size_buckets": 5},
     "size_buckets=5 is not 'auto', 'HxW,...' or a list of (height, width) pairs; use e.g. 'auto' or "
     "[(512, 512), (768, 768)]"),
])
def test_bad_load_options(toy_artifact: Path, options: dict[str, Any], message: str) -> None:
    """Usage errors, not a damaged artifact (ArtifactError), a raw TypeError, or "no" taken as True."""
    with pytest.raises(RuntimeInputError) as e:
        EnginePipeline.from_artifacts(toy_artifact, **options)
    assert str(e.value) == message


def test_conv_algo_search_any_case_and_no_effect_on_cpu(toy_artifact: Path, caplog: pytest.LogCaptureFixture) -> None:
    with EnginePipeline.from_artifacts(toy_artifact, cudnn_conv_algo_search="exhaustive") as pipe:
        assert pipe.engines["unet"]._conv_algo == "EXHAUSTIVE"  # as the CLI, which takes any case
    assert "cudnn_conv_algo_search='EXHAUSTIVE': no effect on a 'ort' artifact on cpu" in caplog.text


def _copy(toy_artifact: Path, tmp_path: Path, **manifest_changes: Any) -> Path:
    dest = tmp_path / "art"
    shutil.copytree(toy_artifact, dest)
    if manifest_changes:
        manifest = json.loads((dest / "manifest.json").read_text())
        manifest.update(manifest_changes)
        artifacts.write_manifest(dest, manifest)  # re-sealed, as a compiler would write it
    return dest


def test_verify_catches_an_altered_file(toy_artifact: Path, tmp_path: Path) -> None:
    art = _copy(toy_artifact, tmp_path)
    data = bytearray((art / "unet" / "model.onnx").read_bytes())
    data[-1] ^= 0xFF
    (art / "unet" / "model.onnx").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"unet/model.onnx: sha256"):
        EnginePipeline.from_artifacts(art)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"precision": "fp16"}, r"fp16, which ONNX Runtime cannot run on CPU; use device='cuda'"),
        # a TensorRT manifest without plans is refused by the schema (test_trt_engine has the runtime's refusal)
        ({"backend": "tensorrt"}, r"components\.unet: 'plan' is a required property"),
    ],
)
def test_incompatible_artifacts(toy_artifact: Path, tmp_path: Path, changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ArtifactError, match=match):
        EnginePipeline.from_artifacts(_copy(toy_artifact, tmp_path, **changes), verify=False)


def test_tokenizer_must_match_manifest(toy_artifact: Path, tmp_path: Path) -> None:
    manifest = json.loads((toy_artifact / "manifest.json").read_text())
    art = _copy(toy_artifact, tmp_path, model={**manifest["model"], "text_max_length": 64})
    with pytest.raises(ArtifactError, match="model_max_length=77 but the manifest says text_max_length=64"):
        EnginePipeline.from_artifacts(art, verify=False)


def test_closed_pipeline_refuses_calls(toy_artifact: Path) -> None:
    pipe = EnginePipeline.from_artifacts(toy_artifact)
    pipe.close()
    pipe.close()  # idempotent
    assert not pipe.engines["unet"].is_open  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="closed"):
        pipe("a cat", **FAST)


# --- argument validation ------------------------------------------------------------------------------


def test_size_not_multiple_of_8_gives_nearest_sizes(toy_pipe: EnginePipeline) -> None:
    msg = _errors(toy_pipe, height=60)
    assert "height=60 is not a positive multiple of 8; use 56 or 64" in msg and "32..128" in msg
    assert "width=101" in _errors(toy_pipe, width=101)


@pytest.mark.parametrize(("kw", "value"), [("height", 136), ("height", 24), ("width", 256)])
def test_size_outside_profile(toy_pipe: EnginePipeline, kw: str, value: int) -> None:
    msg = _errors(toy_pipe, **{kw: value})
    assert f"{kw}={value} is outside the engine profile 32..128" in msg and f"--max-{kw}" in msg


@pytest.mark.parametrize(
    ("kwargs", "piece"),
    [
        ({"height": "64"}, "height='64' must be an integer"),
        ({"height": 0}, "height=0 must be a positive multiple of 8"),
        ({"num_inference_steps": 0}, "num_inference_steps=0 must be an integer >= 1"),
        ({"num_inference_steps": 2.5}, "num_inference_steps=2.5"),
        ({"guidance_scale": -1.0}, "guidance_scale=-1.0 must be a finite number >= 0"),
        ({"guidance_scale": float("nan")}, "guidance_scale=nan"),
        ({"guidance_scale": 1e39}, "guidance_scale=1e+39 is beyond float32 (at most 3.403e+38): on the engines' "
                                   "tensors it is inf; use e.g. 7.5"),
        ({"eta": 10**40}, "eta=10000000000000000000000000000000000000000 is beyond float32"),
        ({"num_images_per_prompt": 0}, "num_images_per_prompt=0 must be an integer >= 1"),
        ({"eta": -0.5}, "eta=-0.5"),
        ({"output_type": "jpg"}, "output_type='jpg' is unknown; use one of pil, np, pt, latent"),
        ({"prompt": []}, "prompt=[] must be a string or a non-empty list of strings"),
        ({"prompt": None}, "prompt=None"),
        ({"prompt": ["a", 3]}, "prompt=['a', 3]"),
        ({"prompt": ["a", "b"], "negative_prompt": ["x"]}, "negative_prompt has 1 entries but prompt has 2"),
        ({"seed": 1, "generator": torch.Generator()}, "either seed= or generator="),
        ({"seed": -1}, "seed=-1 must be an integer in 0.."),
        ({"generator": "42"}, "generator must be a torch.Generator"),
        ({"num_images_per_prompt": 2, "generator": [torch.Generator()] * 3}, "list of 3 but the batch is 2"),
        ({"latents": torch.zeros(1, 4, 64, 64)}, "latents have shape (1, 4, 64, 64); for batch 1 at 64x64"),
        ({"latents": torch.zeros(1, 4, 8, 8, dtype=torch.int64)},
         "latents is a torch.int64 tensor; pass a float one of shape (1, 4, 8, 8) (e.g. latents.float())"),
        ({"latents": torch.zeros(1, 4, 8, 8).index_fill(3, torch.tensor([2]), float("inf"))},
         "latents contains NaN/Inf values (32 of 256); pass finite values"),
        ({"latents": torch.full((1, 4, 8, 8), float("nan"), dtype=torch.float16)},
         "latents contains NaN/Inf values (256 of 256)"),
        ({"latents": np.zeros((1, 4, 8, 8), np.float32)},
         "latents must be a float torch.Tensor of shape (1, 4, 8, 8), got ndarray"),
        ({"progress": "no"}, "progress='no' must be True or False"),
        # lone surrogates: bytes that were not UTF-8 (a command line's $'\xff\xfe'); the tokenizer raised TypeError
        ({"prompt": "\udcff\udcfe"}, "prompt is not valid UTF-8 text: the bytes b'\\xff\\xfe' at character 0"),
        ({"prompt": ["a", "b\udcff"]}, "prompt[1] is not valid UTF-8 text"),
        ({"negative_prompt": "\ud800"}, "negative_prompt is not valid UTF-8 text: '\\ud800' at character 0"),
    ],
)
def test_invalid_arguments(toy_pipe: EnginePipeline, kwargs: dict[str, Any], piece: str) -> None:
    assert piece in _errors(toy_pipe, **kwargs)


def test_batch_above_profile_runs_in_chunks(toy_pipe: EnginePipeline) -> None:
    # 6 images on a max-batch-4 profile: chunks of 3 + 3 (tests/runtime/test_batching.py checks the images)
    out = toy_pipe(prompt=["a", "b", "c"], num_images_per_prompt=2, output_type="np", **FAST)
    assert out.images.shape == (6, 64, 64, 3)


def test_batch_below_profile(toy_artifact: Path, tmp_path: Path, tokenizer_cache: Path) -> None:
    art = write_toy_artifact(tmp_path / "b2", batch=(2, 2, 4), tokenizer_cache=tokenizer_cache)
    with EnginePipeline.from_artifacts(art) as pipe:
        assert "below the engine profile's min batch 2" in _errors(pipe)
        # one prompt without CFG: the text encoder sees 1 row < its min 2, padded internally
        out = pipe("a cat", num_images_per_prompt=2, guidance_scale=1.0, output_type="np", **FAST)
        assert out.images.shape == (2, 64, 64, 3)


# --- outputs ------------------------------------------------------------------------------------------


def test_output_types(toy_pipe: EnginePipeline) -> None:
    common = {"prompt": ["a cat", "a dog"], "num_images_per_prompt": 2, "seed": 0, **FAST}
    pil = toy_pipe(**common).images
    assert len(pil) == 4 and all(isinstance(i, Image.Image) and i.size == (64, 64) and i.mode == "RGB" for i in pil)
    np_images = toy_pipe(**common, output_type="np").images
    assert np_images.shape == (4, 64, 64, 3) and np_images.dtype == np.float32
    assert 0.0 <= np_images.min() and np_images.max() <= 1.0
    assert np.array_equal(np.stack([np.asarray(i) for i in pil]), (np_images * 255).round().astype(np.uint8))
    pt = toy_pipe(**common, output_type="pt").images
    assert pt.shape == (4, 3, 64, 64) and pt.device.type == "cpu"
    np.testing.assert_array_equal(pt.permute(0, 2, 3, 1).numpy(), np_images)
    latents = toy_pipe(**common, output_type="latent").images
    assert latents.shape == (4, 4, 8, 8)


def test_non_square_size(toy_pipe: EnginePipeline) -> None:
    out = toy_pipe("a cat", height=32, width=128, seed=1, **FAST)
    assert out.images[0].size == (128, 32)
    assert (out.parameters["height"], out.parameters["width"]) == (32, 128)


def test_seed_reproducibility(toy_pipe: EnginePipeline) -> None:
    def run(**kw: Any) -> np.ndarray:
        return toy_pipe("a cat", output_type="np", **FAST, **kw).images

    a = run(seed=7)
    np.testing.assert_array_equal(a, run(seed=7))
    np.testing.assert_array_equal(a, run(generator=torch.Generator("cpu").manual_seed(7)))
    assert not np.array_equal(a, run(seed=8))
    drawn = toy_pipe("a cat", **FAST)
    assert isinstance(drawn.seed, int) and drawn.parameters["seed"] == drawn.seed
    np.testing.assert_array_equal(
        np.asarray(drawn.images[0]), np.asarray(toy_pipe("a cat", seed=drawn.seed, **FAST).images[0])
    )
    assert toy_pipe("a cat", generator=torch.Generator().manual_seed(0), **FAST).seed is None


def test_latents_argument_replaces_the_draw(toy_pipe: EnginePipeline) -> None:
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))
    a = toy_pipe("a cat", latents=noise, output_type="np", **FAST).images
    b = toy_pipe("a cat", latents=noise.double(), seed=99, output_type="np", **FAST).images
    np.testing.assert_array_equal(a, b)


def test_prompt_and_negative_prompt_change_the_image(toy_pipe: EnginePipeline) -> None:
    def run(prompt: str, **kw: Any) -> np.ndarray:
        return toy_pipe(prompt, seed=1, output_type="np", **FAST, **kw).images

    base = run("a cat")
    assert not np.array_equal(base, run("a dog"))
    assert not np.array_equal(base, run("a cat", negative_prompt="blurry"))
    np.testing.assert_array_equal(base, run("a cat", negative_prompt=""))  # None means ""
    # without CFG the negative prompt is ignored
    np.testing.assert_array_equal(
        run("a cat", guidance_scale=1.0), run("a cat", guidance_scale=1.0, negative_prompt="blurry")
    )


def test_callback_and_progress(toy_pipe: EnginePipeline, capsys: pytest.CaptureFixture[str]) -> None:
    toy_pipe.set_scheduler("euler")
    try:
        seen: list[tuple[int, float, tuple[int, ...]]] = []
        toy_pipe(
            ["a", "b"],
            num_inference_steps=3,
            seed=0,
            progress=False,
            callback=lambda i, t, latents: seen.append((i, float(t), tuple(latents.shape))),
        )
        assert [s[0] for s in seen] == [0, 1, 2]
        assert seen[0][1] > seen[1][1] > seen[2][1]
        assert {s[2] for s in seen} == {(2, 4, 8, 8)}
        assert "denoise" not in capsys.readouterr().err
        toy_pipe("a", num_inference_steps=3, seed=0, progress=True)
        assert "denoise" in capsys.readouterr().err
    finally:
        toy_pipe.set_scheduler(None)
    assert toy_pipe.scheduler_name == "pndm"


def test_parameters_feed_save_png(toy_pipe: EnginePipeline, tmp_path: Path) -> None:
    out = toy_pipe(["a cat", "a dog"], negative_prompt="blurry", seed=3, guidance_scale=5, **FAST)
    p = out.parameters
    assert p["prompt"] == ["a cat", "a dog"] and p["negative_prompt"] == "blurry"
    assert (p["seed"], p["guidance_scale"], p["num_inference_steps"], p["scheduler"]) == (3, 5.0, 2, "pndm")
    path = save_png(out.images[1], tmp_path / "dog.png", {**p, "index": 1})
    assert read_png_parameters(path) == json.loads(json.dumps({**p, "index": 1}))


def test_non_finite_images_are_warned_about(toy_pipe: EnginePipeline, caplog: pytest.LogCaptureFixture) -> None:
    """Latents that turn NaN in the loop decode to black images, as in diffusers, but with one warning (read once,
    after the loop). (NaN latents passed in are refused up front: test_invalid_arguments.)"""
    with caplog.at_level("WARNING", logger="diffusion_trt.runtime.denoise"):
        toy_pipe("a cat", callback=lambda i, t, latents: latents.fill_(float("nan")), seed=0, **FAST)
    assert "hold NaN/Inf values" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="diffusion_trt.runtime.denoise"):
        toy_pipe("a cat", seed=0, **FAST)
    assert "NaN" not in caplog.text

"""SDXL textual inversion (runtime/embeddings.py, both text encoders' ``embedding_vectors`` input): an A1111/diffusers
SDXL file's ``clip_l`` vectors for text_encoder, ``clip_g`` for text_encoder_2, in parity with diffusers'
``load_textual_inversion`` called once per encoder; bad files refused with one ``error:`` line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from diffusion_trt.cli import main
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.prompt_encoding import PromptReader
from diffusion_trt.runtime.sdxl import sdxl_conditioning

WIDTHS = {"clip_l": 32, "clip_g": 48}  # the tiny-sdxl encoders' hidden sizes (real SDXL: 768, 1280)


def _sdxl_file(path: Path, n: int, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    save_file({k: torch.randn(n, d, generator=g) for k, d in WIDTHS.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A one-vector style embedding and a 4-vector negative one, in the two-encoder form."""
    d = tmp_path_factory.mktemp("sdxl-embeddings")
    return {"xlstyle": _sdxl_file(d / "xlstyle.safetensors", 1, 1), "xlneg": _sdxl_file(d / "xlneg.safetensors", 4, 2)}


@pytest.fixture(scope="module")
def pipe(tiny_sdxl_artifact: Path) -> Iterator[EnginePipeline]:
    with EnginePipeline.from_artifacts(tiny_sdxl_artifact) as p:
        yield p


def _diffusers(folder: Path, files: dict[str, Path], names: list[str]) -> diffusers.StableDiffusionXLPipeline:
    """diffusers' SDXL pipeline with each file loaded as its docs say: once per encoder with its own tensor.

    The tiny text_encoder_2 config has transformers' legacy ``eos_token_id=2`` (as SDXL's own), with which
    CLIPTextModel pools at ``input_ids.argmax()``: on diffusers' added token ids (>= the vocabulary) instead of the
    EOS (transformers: "can't work correctly with extra new tokens added"). The reference pools at the EOS as the
    engines do (their embedding ids are negative), so it sets the tokenizer's EOS id."""
    ref = diffusers.StableDiffusionXLPipeline.from_pretrained(folder, local_files_only=True, add_watermarker=False)
    ref.set_progress_bar_config(disable=True)
    for name in names:
        state = load_file(str(files[name]))
        ref.load_textual_inversion(state["clip_l"], token=name, text_encoder=ref.text_encoder,
                                   tokenizer=ref.tokenizer)
        ref.load_textual_inversion(state["clip_g"], token=name, text_encoder=ref.text_encoder_2,
                                   tokenizer=ref.tokenizer_2)
    getattr(ref.text_encoder_2, "text_model", ref.text_encoder_2).eos_token_id = ref.tokenizer_2.eos_token_id
    return ref


def _encode(pipe: EnginePipeline, prompts: list[str], negatives: list[str]):
    engines = pipe.loop_engines()
    cond = sdxl_conditioning(prompts, negatives, negatives, 64, 64, pipe.engine("text_encoder_2"), pipe.tokenizer_2,
                             zero_negative=False, embeddings_2=pipe.embeddings_2)
    reader = PromptReader(engines.tokenizer, "a1111", 1, 0, engines.embeddings)
    return cond.encode(engines.text_encoder, reader, prompts, negatives, torch.float32)


@pytest.mark.parametrize("name", ["xlstyle", "xlneg"])  # 1 and 4 vectors
def test_embeds_match_diffusers_load_textual_inversion(pipe: EnginePipeline, tiny_sdxl_dir: Path,
                                                       files: dict[str, Path], name: str) -> None:
    ref = _diffusers(tiny_sdxl_dir, files, [name])
    prompts, negatives = [f"a {name} fox, ink", "a fox"], [f"{name}, lowres", "blurry"]
    with torch.no_grad():
        want = ref.encode_prompt(prompts, do_classifier_free_guidance=True, negative_prompt=negatives)
    assert pipe.load_textual_inversion(files[name]) == [name]
    try:
        pos, neg, added = _encode(pipe, prompts, negatives)
    finally:
        pipe.unload_textual_inversion()
    for got, expected in ((pos, want[0]), (neg, want[1]), (added.pooled, want[2]), (added.pooled_negative, want[3])):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    plain, _, _ = _encode(pipe, prompts, negatives)
    assert (plain[0] - want[0][0]).abs().max() > 1e-2  # unloaded: the name is plain text again


def test_image_matches_diffusers_with_a_negative_embedding(pipe: EnginePipeline, tiny_sdxl_dir: Path,
                                                           files: dict[str, Path]) -> None:
    ref = _diffusers(tiny_sdxl_dir, files, ["xlneg", "xlstyle"])
    kwargs = {"prompt": "a xlstyle cat on a hill", "negative_prompt": "xlneg, lowres", "num_inference_steps": 3}
    want = ref(**kwargs, generator=torch.Generator("cpu").manual_seed(3), output_type="np").images
    pipe.load_textual_inversion([files["xlneg"], files["xlstyle"]])
    try:
        got = pipe(**kwargs, seed=3, output_type="np", progress=False).images
    finally:
        pipe.unload_textual_inversion()
    assert np.abs(got - want).max() < 1e-4
    plain = pipe(**kwargs, seed=3, output_type="np", progress=False).images
    assert np.abs(plain - got).max() > 1e-3


def test_run_with_an_sdxl_embedding(tiny_sdxl_artifact: Path, files: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "e.png"
    result = CliRunner().invoke(main, ["run", str(tiny_sdxl_artifact), "-p", "a xlstyle fox", "-n", "xlneg",
                                       "--embedding", str(files["xlstyle"]), "--embedding", str(files["xlneg"]),
                                       "--steps", "2", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file()


def _bad_files(d: Path) -> dict[str, Path]:
    save_file({"emb_params": torch.zeros(2, WIDTHS["clip_l"])}, str(d / "sd15.safetensors"))
    save_file({"clip_l": torch.zeros(1, WIDTHS["clip_l"])}, str(d / "halfxl.safetensors"))
    clip_l = torch.zeros(1, WIDTHS["clip_l"])
    save_file({"clip_l": clip_l, "clip_g": torch.zeros(1, 1280)}, str(d / "realxl.safetensors"))  # a real SDXL's
    save_file({"clip_l": clip_l, "clip_g": torch.zeros(1, 2, 48)}, str(d / "cube.safetensors"))
    save_file({"clip_l": torch.zeros(4, WIDTHS["clip_l"]), "clip_g": torch.zeros(3, WIDTHS["clip_g"])},
              str(d / "counts.safetensors"))
    save_file({"clip_l": torch.full((1, WIDTHS["clip_l"]), float("nan")), "clip_g": torch.zeros(1, WIDTHS["clip_g"])},
              str(d / "nan.safetensors"))
    return {p.stem: p for p in d.iterdir()}


@pytest.mark.parametrize(("case", "message"), [
    ("sd15", "is a one-encoder (SD 1.x/2.x) embedding; an SDXL artifact takes the two-encoder form"),
    ("halfxl", "has clip_l but no clip_g"),
    ("realxl", "has vectors of size 1280; this artifact's text_encoder_2 (clip_g) takes 48"),
    ("cube", "clip_g are (1, 2, 48); expected [D] or [n, D]"),
    ("counts", "clip_l has 4 vector(s) but clip_g has 3; an SDXL embedding has one count for both"),
    ("nan", "clip_l hold NaN/Inf values"),
])
def test_bad_sdxl_embedding_is_one_error_line(tiny_sdxl_artifact: Path, files: dict[str, Path], tmp_path: Path,
                                              case: str, message: str) -> None:
    bad = _bad_files(tmp_path)[case]
    result = CliRunner().invoke(main, ["run", str(tiny_sdxl_artifact), "-p", "xlstyle", "--steps", "1",
                                       "--embedding", str(files["xlstyle"]), "--embedding", str(bad),
                                       "-o", str(tmp_path / "x.png")])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert not (tmp_path / "x.png").exists()


def test_loading_is_all_or_nothing_on_both_encoders(pipe: EnginePipeline, files: dict[str, Path],
                                                    tmp_path: Path) -> None:
    bad = _bad_files(tmp_path)["realxl"]  # clip_l fits, clip_g does not
    with pytest.raises(RuntimeInputError, match=r"text_encoder_2 \(clip_g\) takes 48"):
        pipe.load_textual_inversion([files["xlstyle"], bad])
    assert pipe.embeddings is None and pipe.embeddings_2 is None


def test_sd_artifact_refuses_an_sdxl_embedding(tiny_artifact: Path, files: dict[str, Path], tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "xlstyle", "--steps", "1", "--embedding",
                                       str(files["xlstyle"]), "-o", str(tmp_path / "x.png")])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "is an SDXL embedding (clip_l/clip_g); an SD 1.x/2.x artifact takes one-encoder" in errors[0]


def test_artifact_of_before_refuses_embeddings_naming_the_recompile(old_sdxl_artifact: Path, files: dict[str, Path],
                                                                    tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["run", str(old_sdxl_artifact), "-p", "xlstyle", "--steps", "1",
                                       "--embedding", str(files["xlstyle"]), "-o", str(tmp_path / "x.png")])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "text encoders take no embedding vectors (compiled before SDXL textual inversion" in errors[0]
    assert "recompile it (compile --max-embedding-vectors 128)" in errors[0]

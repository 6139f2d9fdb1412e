"""Clip skip from the one text-encoder engine (its ``clip_skip_states`` output) against diffusers' semantics: the
reference is transformers' CLIPTextModel hidden state ``-(c + 1)`` through its final layer norm, given to diffusers
as prompt_embeds (diffusers 0.42's own clip_skip path needs ``.text_model``, which transformers 5 dropped)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import CLIPTextModel, CLIPTokenizer

from diffusion_trt.cli import main
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.prompt_encoding import PromptReader
from diffusion_trt.runtime.text_embeddings import encode_prompt_embeds


@pytest.fixture(scope="module")
def pipe(tiny_artifact: Path) -> Iterator[EnginePipeline]:
    with EnginePipeline.from_artifacts(tiny_artifact) as p:
        yield p


@torch.no_grad()
def _reference(folder: Path, texts: list[str], clip_skip: int) -> torch.Tensor:
    model = CLIPTextModel.from_pretrained(folder / "text_encoder", local_files_only=True).eval()
    tok = CLIPTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True)
    ids = tok(texts, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    hidden = model(ids, output_hidden_states=True).hidden_states[-(clip_skip + 1)]
    norm = getattr(model, "text_model", model).final_layer_norm
    return norm(hidden)


def test_manifest_has_the_extra_output(tiny_artifact: Path, pipe: EnginePipeline) -> None:
    outputs = {t.name: t for t in pipe.loop_engines().text_encoder.spec.outputs}
    assert list(outputs) == ["last_hidden_state", "clip_skip_states"]
    assert outputs["clip_skip_states"].max[1:] == (1, 77, 32)  # the tiny encoder has 2 layers: clip skip 1 at most


def test_states_match_the_reference(pipe: EnginePipeline, tiny_pipeline_dir: Path) -> None:
    engines = pipe.loop_engines()
    reader = PromptReader(engines.tokenizer, "a1111", 3, clip_skip=1)
    pos, neg = encode_prompt_embeds(engines.text_encoder, reader, ["a guohua landscape"], ["blurry"], torch.float32)
    want = _reference(tiny_pipeline_dir, ["a guohua landscape", "blurry"], 1)
    assert (pos[0] - want[0]).abs().max() <= 1e-5 and (neg[0] - want[1]).abs().max() <= 1e-5
    last, _ = encode_prompt_embeds(engines.text_encoder, engines.tokenizer, ["a guohua landscape"], None,
                                   torch.float32)
    assert (last[0] - want[0]).abs().max() > 1e-2  # the skipped layer changes the states


def test_image_matches_diffusers_given_the_reference(pipe: EnginePipeline, tiny_pipeline_dir: Path) -> None:
    ref = diffusers.StableDiffusionPipeline.from_pretrained(tiny_pipeline_dir, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    states = _reference(tiny_pipeline_dir, ["a guohua landscape", ""], 1)
    want = ref(prompt_embeds=states[:1], negative_prompt_embeds=states[1:], num_inference_steps=3,
               generator=torch.Generator("cpu").manual_seed(3), output_type="np").images
    got = pipe("a guohua landscape", clip_skip=1, num_inference_steps=3, seed=3, output_type="np",
               progress=False).images
    assert np.abs(got - want).max() < 1e-4
    plain = pipe("a guohua landscape", clip_skip=0, num_inference_steps=3, seed=3, output_type="np",
                 progress=False).images
    assert np.abs(plain - got).max() > 1e-3


@pytest.mark.parametrize(("value", "message"), [
    (2, "clip_skip=2 is more than this artifact's text encoder serves (up to 1"),
    (-1, "clip_skip=-1 must be None or an integer >= 0"),
    (1.5, "clip_skip=1.5 must be None or an integer >= 0"),
    (True, "clip_skip=True must be None or an integer >= 0"),
])
def test_bad_clip_skip_is_refused(pipe: EnginePipeline, value: object, message: str) -> None:
    with pytest.raises(RuntimeInputError) as info:
        pipe("x", clip_skip=value, num_inference_steps=1, progress=False)
    assert message in str(info.value)


def test_cli_clip_skip(tiny_artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.png"
    ok = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "a guohua landscape", "--clip-skip", "1",
                                   "--steps", "2", "-o", str(out)])
    assert ok.exit_code == 0, ok.output
    assert out.is_file()
    bad = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "x", "--clip-skip", "5", "--steps", "2",
                                    "-o", str(tmp_path / "b.png")])
    assert bad.exit_code == 2 and "error: --clip-skip 5 is more than" in bad.output


def test_compile_refuses_a_bad_max_clip_skip(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"),
                                       "--max-clip-skip", "12"])
    assert result.exit_code == 2 and "error: --max-clip-skip 12 must be in 0..11" in result.output

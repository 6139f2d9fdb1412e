"""Long, weighted and BREAK prompts (runtime/prompt_encoding.py) on the compiled tiny artifact, against an independent
reference built from transformers' CLIP on hand-made chunks (tests/runtime/prompt_reference.py), and end to end
against diffusers given the reference as prompt_embeds."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import CLIPTextModel, CLIPTokenizer

from diffusion_trt.cli import main
from diffusion_trt.compiler.components import component_specs
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.prompt_encoding import PromptReader
from diffusion_trt.runtime.text_embeddings import encode_prompt_embeds

from .prompt_reference import reference_states

LONG = "a red fox in the deep snow under pine trees, " * 9  # about 100 tokens: two chunks
A = 1.1


@pytest.fixture(scope="module")
def biased_dir(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline with a random bias in the text encoder's final layer norm: the tiny model's states
    average to ~0 per chunk (layer norm without bias), where A1111's rescale to the mean is degenerate; SD's
    trained encoders have a bias."""
    folder = tmp_path_factory.mktemp("models") / "tiny-biased"
    shutil.copytree(tiny_pipeline_dir, folder)
    model = CLIPTextModel.from_pretrained(folder / "text_encoder", local_files_only=True)
    with torch.no_grad():
        ln = model.text_model.final_layer_norm if hasattr(model, "text_model") else model.final_layer_norm
        ln.bias.copy_(torch.randn(ln.bias.shape, generator=torch.Generator().manual_seed(3)))
    model.save_pretrained(folder / "text_encoder")
    return folder


@pytest.fixture(scope="module")
def clip(biased_dir: Path) -> tuple[CLIPTextModel, CLIPTokenizer]:
    model = CLIPTextModel.from_pretrained(biased_dir / "text_encoder", local_files_only=True).eval()
    return model, CLIPTokenizer.from_pretrained(biased_dir / "tokenizer", local_files_only=True)


@pytest.fixture(scope="module")
def pipe(biased_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EnginePipeline]:
    from diffusion_trt.compiler.pipeline import compile_pipeline

    artifact = compile_pipeline(biased_dir, tmp_path_factory.mktemp("artifacts") / "tiny-biased")
    with EnginePipeline.from_artifacts(artifact) as p:
        yield p


def _encode(pipe: EnginePipeline, prompt: str, negative: str, syntax: str = "a1111", max_chunks: int = 3
            ) -> tuple[torch.Tensor, torch.Tensor]:
    engines = pipe.loop_engines()
    reader = PromptReader(engines.tokenizer, syntax, max_chunks)
    pos, neg = encode_prompt_embeds(engines.text_encoder, reader, [prompt], [negative], torch.float32)
    return pos[0], neg[0]


#: id, prompt, negative, syntax, the prompt's parts as the reference builds them, the negative's, chunks
CASES = [
    ("long-vs-empty", LONG, "", "a1111", [[(LONG, 1.0)]], [[]], 2),
    ("weighted", "a (red:1.5) fox, ((snow)), [fog]", "", "a1111",
     [[("a ", 1.0), ("red", 1.5), (" fox, ", 1.0), ("snow", A * A), (", ", 1.0), ("fog", 1 / A)]], [[]], 1),
    ("break-vs-weighted-negative", "a fox BREAK snow", "(blurry)", "a1111",
     [[("a fox ", 1.0)], [(" snow", 1.0)]], [[("blurry", A)]], 2),
    ("long-weighted-negative", "(ink wash:1.3) mountains", LONG, "a1111",
     [[("ink wash", 1.3), (" mountains", 1.0)]], [[(LONG, 1.0)]], 2),
    ("plain-syntax", "a (red:1.5) fox BREAK snow", "", "plain", [[("a (red:1.5) fox BREAK snow", 1.0)]], [[]], 1),
    ("unbalanced-as-text", "a (fox", "", "a1111", [[("a (fox", 1.0)]], [[]], 1),
]


@pytest.mark.parametrize(("prompt", "negative", "syntax", "parts", "neg_parts", "chunks"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_embeddings_match_the_reference(pipe: EnginePipeline, clip: tuple[CLIPTextModel, CLIPTokenizer], prompt: str,
                                        negative: str, syntax: str, parts: list, neg_parts: list, chunks: int) -> None:
    model, tok = clip
    pos, neg = _encode(pipe, prompt, negative, syntax)
    want_pos = reference_states(model, tok, parts, chunks)
    want_neg = reference_states(model, tok, neg_parts, chunks)
    assert pos.shape == want_pos.shape == (77 * chunks, model.config.hidden_size)
    assert neg.shape == want_neg.shape
    assert (pos - want_pos).abs().max() <= 1e-5
    assert (neg - want_neg).abs().max() <= 1e-5


def test_weights_keep_the_chunk_mean(pipe: EnginePipeline) -> None:
    weighted, _ = _encode(pipe, "a (red:1.8) fox", "")
    plain, _ = _encode(pipe, "a red fox", "")
    assert torch.allclose(weighted.mean(), plain.mean(), atol=1e-6)  # A1111's rescale to the original mean
    assert (weighted - plain).abs().max() > 1e-2  # and the weight changed the states


def test_cached_negatives_of_different_lengths(pipe: EnginePipeline) -> None:
    """Negatives from the cache, of 1 and 2 chunks, padded again without a text-encoder run of their own."""
    from diffusion_trt.runtime.text_embeddings import EmbeddingCache

    engines, cache = pipe.loop_engines(), EmbeddingCache()
    reader = PromptReader(engines.tokenizer, "a1111", 3)
    args = (engines.text_encoder, reader, ["a fox", "a cat"], [LONG, "(blurry)"], torch.float32)
    first = encode_prompt_embeds(*args, cache)
    second = encode_prompt_embeds(*args, cache)
    assert cache.hits == 2 and len(cache) == 2
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert first[1].shape == (2, 154, 32)


def test_degenerate_mean_is_not_rescaled() -> None:
    from diffusion_trt.runtime.prompt_encoding import apply_weights

    z = torch.randn(1, 77, 8)
    z = z - z.mean(dim=(1, 2), keepdim=True)  # mean exactly ~0: the ratio would be inf or NaN
    w = torch.ones(1, 77)
    w[0, 3] = 1.5
    out = apply_weights(z, w)
    assert torch.isfinite(out).all() and torch.equal(out, z * w[..., None])


def test_prompt_beyond_the_limit_is_truncated_with_a_warning(pipe: EnginePipeline,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="diffusion_trt"):
        pos, _ = _encode(pipe, LONG * 3, "", max_chunks=3)  # about 300 tokens: four chunks
    assert pos.shape[0] == 3 * 77
    assert any(r.getMessage().startswith("prompt truncated to 3 chunk(s) of 75 CLIP tokens") for r in caplog.records)


def test_unbalanced_bracket_is_a_warning_not_an_error(pipe: EnginePipeline, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="diffusion_trt"):
        images = pipe("a (fox", num_inference_steps=2, seed=0, output_type="np", progress=False).images
    assert images.shape[0] == 1 and np.isfinite(images).all()
    assert "prompt: '(' at character 2 is never closed; kept as text" in caplog.text


def test_long_weighted_image_matches_diffusers_given_the_reference(
        pipe: EnginePipeline, clip: tuple[CLIPTextModel, CLIPTokenizer], biased_dir: Path) -> None:
    model, tok = clip
    prompt, negative = LONG + " BREAK (sunset:1.2)", "[blurry]"
    ref = diffusers.StableDiffusionPipeline.from_pretrained(biased_dir, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    embeds = reference_states(model, tok, [[(LONG + " ", 1.0)], [(" ", 1.0), ("sunset", 1.2)]], 3)[None]
    negative_embeds = reference_states(model, tok, [[("blurry", 1 / A)]], 3)[None]
    want = ref(prompt_embeds=embeds, negative_prompt_embeds=negative_embeds, num_inference_steps=4,
               generator=torch.Generator("cpu").manual_seed(7), output_type="np").images
    got = pipe(prompt, negative_prompt=negative, num_inference_steps=4, seed=7, output_type="np",
               progress=False).images
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4


def test_one_chunk_unet_table_is_the_table_of_before() -> None:
    sizes = {"text_hidden": 32, "text_len": 77, "unet_in": 4, "unet_out": 4, "latent": 4}
    one = component_specs(**sizes, prompt_chunks=1)["unet"]
    assert one.inputs[2].shape == ("B2", 77, 32) and one.symbols == ()
    three = component_specs(**sizes, prompt_chunks=3)["unet"]
    assert three.inputs[2].shape == ("B2", "S", 32) and dict(three.symbols) == {"S": (77, 77, 231)}
    assert component_specs(**sizes, prompt_chunks=3)["text_encoder"] == component_specs(**sizes)["text_encoder"]


def test_artifact_unet_takes_77_to_231_tokens(pipe: EnginePipeline) -> None:
    info = pipe.loop_engines().unet.spec.input("encoder_hidden_states")
    assert (info.min[1], info.max[1]) == (77, 231)


@pytest.mark.parametrize("value", ["0", "9", "x"])
def test_compile_refuses_a_bad_max_prompt_chunks(tiny_pipeline_dir: Path, tmp_path: Path, value: str) -> None:
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"),
                                       "--max-prompt-chunks", value])
    assert result.exit_code == 2
    assert f"error: --max-prompt-chunks {value} must be in 1..8" in result.output or \
        "'x' is not a valid integer" in result.output
    assert not (tmp_path / "a").exists()


def test_run_refuses_an_unknown_prompt_syntax(tiny_artifact: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["run", str(tiny_artifact), "-p", "x", "--prompt-syntax", "compel",
                                       "-o", str(tmp_path / "o.png")])
    assert result.exit_code == 2 and "'compel' is not one of 'a1111', 'plain'" in result.output


def test_api_refuses_an_unknown_prompt_syntax(pipe: EnginePipeline) -> None:
    from diffusion_trt.errors import RuntimeInputError

    with pytest.raises(RuntimeInputError, match="prompt_syntax='compel' is unknown; use one of a1111, plain"):
        pipe("x", prompt_syntax="compel")


def test_a_trailing_break_adds_no_chunk(pipe: EnginePipeline) -> None:
    """``"a fox BREAK"`` was two chunks (the second empty: 77 more context tokens, another image than ``"a fox"``);
    A1111 keeps the last chunk only when it has tokens (``if chunk.tokens or not chunks``), so one. A BREAK between
    two others still makes an empty chunk, and ``"BREAK"`` alone is the one empty chunk, as there."""
    reader = PromptReader(pipe.loop_engines().tokenizer, "a1111", 3)
    assert torch.equal(reader.chunks("a fox BREAK ").ids, reader.chunks("a fox").ids)
    assert reader.chunks("a BREAK BREAK").chunks == 2 and reader.chunks("BREAK a").chunks == 2
    assert torch.equal(reader.chunks("BREAK").ids, reader.chunks("").ids)
    assert not reader.chunks("fox " * 225 + "BREAK").truncated  # three full chunks: no "truncated" warning

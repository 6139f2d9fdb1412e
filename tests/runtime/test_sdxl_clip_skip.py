"""SDXL clip skip from one engine per text encoder (their ``clip_skip_states`` output), with diffusers' SDXL semantics
(``StableDiffusionXLPipeline.encode_prompt``: ``hidden_states[-(clip_skip + 2)]`` of each encoder, no final layer
norm, pooled embeddings unchanged): against diffusers' own clip_skip path and transformers' hidden states of the
tiny-sdxl folder; an artifact compiled before refuses it, naming the recompile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from diffusion_trt.cli import main
from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.prompt_encoding import PromptReader
from diffusion_trt.runtime.sdxl import sdxl_conditioning
from diffusion_trt.runtime.text_embeddings import EmbeddingCache

LONG = "a red fox in the deep snow under pine trees, " * 9  # about 100 tokens: two chunks


@pytest.fixture(scope="module")
def pipe(tiny_sdxl_artifact: Path) -> Iterator[EnginePipeline]:
    with EnginePipeline.from_artifacts(tiny_sdxl_artifact) as p:
        yield p


@pytest.fixture(scope="module")
def ref(tiny_sdxl_dir: Path) -> diffusers.StableDiffusionXLPipeline:
    p = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir, local_files_only=True,
                                                           add_watermarker=False)
    p.set_progress_bar_config(disable=True)
    return p


@torch.no_grad()
def _reference(folder: Path, texts: list[str], clip_skip: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per text [77 k, D1+D2], and pooled [T, E], from transformers' models: each 77-token chunk's
    hidden_states[-(c + 2)] per encoder (chunk i of a text: its tokens 75 i..75 i + 74 between BOS and EOS),
    concatenated on the last axis; pooled text_embeds of the first chunk."""
    models = (CLIPTextModel.from_pretrained(folder / "text_encoder", local_files_only=True).eval(),
              CLIPTextModelWithProjection.from_pretrained(folder / "text_encoder_2", local_files_only=True).eval())
    toks = (CLIPTokenizer.from_pretrained(folder / "tokenizer", local_files_only=True),
            CLIPTokenizer.from_pretrained(folder / "tokenizer_2", local_files_only=True))
    states: list[list[torch.Tensor]] = [[] for _ in texts]
    pooled = []
    for model, tok in zip(models, toks, strict=True):
        for row, text in zip(states, texts, strict=True):
            body = tok(text, add_special_tokens=False, verbose=False).input_ids
            chunks = [body[i:i + 75] for i in range(0, len(body), 75)] or [[]]
            ids = torch.tensor([[tok.bos_token_id, *c, tok.eos_token_id] + [tok.pad_token_id] * (75 - len(c))
                                for c in chunks])
            out = model(ids, output_hidden_states=True)
            row.append(out.hidden_states[-(clip_skip + 2)].reshape(-1, out.hidden_states[0].shape[-1]))
            if hasattr(out, "text_embeds"):
                pooled.append(out.text_embeds[0])
    return [torch.cat(row, dim=-1) for row in states], torch.stack(pooled)


def _encode(pipe: EnginePipeline, prompts: list[str], negatives: list[str], clip_skip: int,
            cache: EmbeddingCache | None = None):
    engines = pipe.loop_engines()
    cond = sdxl_conditioning(prompts, negatives, negatives, 64, 64, pipe.engine("text_encoder_2"), pipe.tokenizer_2,
                             zero_negative=False)
    reader = PromptReader(engines.tokenizer, "a1111", 3, clip_skip)
    return cond.encode(engines.text_encoder, reader, prompts, negatives, torch.float32, cache)


def test_one_engine_per_encoder_has_the_extra_output(pipe: EnginePipeline) -> None:
    for name, width in (("text_encoder", 32), ("text_encoder_2", 48)):
        outputs = {t.name: t for t in pipe.engines[name].spec.outputs}
        assert outputs["clip_skip_states"].max[1:] == (1, 77, width)  # tiny encoders of 2 and 3 layers: skip 1


def test_prompt_states_are_diffusers_own_clip_skip(pipe: EnginePipeline, ref) -> None:
    """diffusers' own SDXL clip_skip path (it indexes hidden_states only, so it runs on transformers 5): the prompt's
    states and pooled embeddings; its negative prompt keeps hidden_states[-2] (see the next test)."""
    want = ref.encode_prompt("a red cube", do_classifier_free_guidance=True, negative_prompt="blurry", clip_skip=1)
    pos, _, added = _encode(pipe, ["a red cube"], ["blurry"], 1)
    torch.testing.assert_close(pos, want[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(added.pooled, want[2], atol=1e-5, rtol=0)
    plain = ref.encode_prompt("a red cube", do_classifier_free_guidance=False)[0]
    assert (pos - plain).abs().max() > 1e-2  # the skipped layer changes the states


@pytest.mark.parametrize("prompt", ["a guohua landscape", LONG], ids=["one-chunk", "two-chunks"])
def test_states_match_the_reference(pipe: EnginePipeline, tiny_sdxl_dir: Path, prompt: str) -> None:
    pos, neg, added = _encode(pipe, [prompt], ["blurry"], 1)
    (want, want_neg, empty), pooled = _reference(tiny_sdxl_dir, [prompt, "blurry", ""], 1)
    want_neg = torch.cat([want_neg, *[empty] * (want.shape[0] // 77 - 1)])  # the negative padded with empty chunks
    torch.testing.assert_close(pos[0], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(neg[0], want_neg, atol=1e-5, rtol=0)  # negatives take the skipped layer too
    torch.testing.assert_close(added.pooled, pooled[:1], atol=1e-5, rtol=0)  # pooled: the last layer, as ever
    torch.testing.assert_close(added.pooled_negative, pooled[1:2], atol=1e-5, rtol=0)


def test_image_matches_diffusers_own_clip_skip(pipe: EnginePipeline, ref) -> None:
    """negative_prompt=None: zero negatives in both (force_zeros_for_empty_prompt), so diffusers' own path is the
    whole reference."""
    want = ref("a guohua landscape", clip_skip=1, num_inference_steps=3, output_type="np",
               generator=torch.Generator("cpu").manual_seed(3)).images
    got = pipe("a guohua landscape", clip_skip=1, num_inference_steps=3, seed=3, output_type="np",
               progress=False).images
    assert np.abs(got - want).max() < 1e-4
    plain = pipe("a guohua landscape", num_inference_steps=3, seed=3, output_type="np", progress=False).images
    assert np.abs(plain - got).max() > 1e-3


def test_image_with_a_negative_matches_diffusers_given_the_reference(pipe: EnginePipeline, ref,
                                                                    tiny_sdxl_dir: Path) -> None:
    want, pooled = _reference(tiny_sdxl_dir, ["a guohua landscape", "blurry"], 1)
    expected = ref(prompt_embeds=want[0][None], pooled_prompt_embeds=pooled[:1], negative_prompt_embeds=want[1][None],
                   negative_pooled_prompt_embeds=pooled[1:], num_inference_steps=3, output_type="np",
                   generator=torch.Generator("cpu").manual_seed(4)).images
    got = pipe("a guohua landscape", negative_prompt="blurry", clip_skip=1, num_inference_steps=3, seed=4,
               output_type="np", progress=False).images
    assert np.abs(got - expected).max() < 1e-4


def test_cached_negatives_are_kept_per_clip_skip(pipe: EnginePipeline) -> None:
    cache = EmbeddingCache()
    _, skipped, _ = _encode(pipe, ["a cat"], ["blurry"], 1, cache)
    _, last, _ = _encode(pipe, ["a cat"], ["blurry"], 0, cache)
    _, fresh, _ = _encode(pipe, ["a cat"], ["blurry"], 0)
    assert torch.equal(last, fresh) and (last - skipped).abs().max() > 1e-2


@pytest.mark.parametrize(("value", "message"), [
    (2, "clip_skip=2 is more than this artifact's text encoder serves (up to 1"),
    (-1, "clip_skip=-1 must be None or an integer >= 0"),
])
def test_bad_clip_skip_is_refused(pipe: EnginePipeline, value: object, message: str) -> None:
    with pytest.raises(RuntimeInputError) as info:
        pipe("x", clip_skip=value, num_inference_steps=1, progress=False)
    assert message in str(info.value)


def test_artifact_of_before_refuses_clip_skip_naming_the_recompile(old_sdxl_artifact: Path, tmp_path: Path) -> None:
    with EnginePipeline.from_artifacts(old_sdxl_artifact) as old:
        assert [t.name for t in old.engines["text_encoder_2"].spec.outputs] == ["text_embeds",
                                                                                "penultimate_hidden_state"]
        with pytest.raises(RuntimeInputError, match=r"recompile it \(compile --max-clip-skip 2\)"):
            old("x", clip_skip=1, num_inference_steps=1, progress=False)
    bad = CliRunner().invoke(main, ["run", str(old_sdxl_artifact), "-p", "x", "--clip-skip", "1", "--steps", "1",
                                    "-o", str(tmp_path / "b.png")])
    errors = [line for line in bad.output.splitlines() if line.startswith("error:")]
    assert bad.exit_code == 2 and len(errors) == 1 and "compiled before SDXL clip skip" in errors[0], bad.output


def test_cli_clip_skip(tiny_sdxl_artifact: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.png"
    ok = CliRunner().invoke(main, ["run", str(tiny_sdxl_artifact), "-p", "a guohua landscape", "--clip-skip", "1",
                                   "--steps", "2", "-o", str(out)])
    assert ok.exit_code == 0, ok.output
    assert out.is_file()

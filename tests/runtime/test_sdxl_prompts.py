"""SDXL's long and weighted prompts (runtime/sdxl.py): both encoders per 77-token chunk, concatenated on the feature
axis, pooled embeddings from text_encoder_2's first chunk; against an independent reference from transformers' CLIP
models of the tiny-sdxl folder (the arithmetic of tests/runtime/prompt_reference.py on penultimate states), and end
to end against diffusers' StableDiffusionXLPipeline given that reference as prompt_embeds/pooled_prompt_embeds."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.embeddings import engine_feed
from diffusion_trt.runtime.engines.engine import run_rows_outputs
from diffusion_trt.runtime.prompt_encoding import PromptReader
from diffusion_trt.runtime.sdxl import HIDDEN_OUTPUT, POOLED_OUTPUT, sdxl_conditioning
from diffusion_trt.runtime.text_embeddings import tokenize

from .prompt_reference import chunk_rows

LONG = "a red fox in the deep snow under pine trees, " * 9  # about 100 tokens: two chunks
Parts = Sequence[Sequence[tuple[str, float]]]


@pytest.fixture(scope="module")
def clips(tiny_sdxl_dir: Path) -> tuple[tuple[object, CLIPTokenizer], tuple[object, CLIPTokenizer]]:
    one = CLIPTextModel.from_pretrained(tiny_sdxl_dir / "text_encoder", local_files_only=True).eval()
    two = CLIPTextModelWithProjection.from_pretrained(tiny_sdxl_dir / "text_encoder_2", local_files_only=True).eval()
    return ((one, CLIPTokenizer.from_pretrained(tiny_sdxl_dir / "tokenizer", local_files_only=True)),
            (two, CLIPTokenizer.from_pretrained(tiny_sdxl_dir / "tokenizer_2", local_files_only=True)))


@pytest.fixture(scope="module")
def pipe(tiny_sdxl_artifact: Path) -> Iterator[EnginePipeline]:
    with EnginePipeline.from_artifacts(tiny_sdxl_artifact) as p:
        yield p


@torch.no_grad()
def _reference(clips, parts: Parts, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[77 chunks, D1+D2] and pooled [E]: per encoder, each chunk's hidden_states[-2], weighted and rescaled to its
    mean, padded with the empty chunk; concatenated on the last axis; pooled text_embeds of text_encoder_2's first
    chunk."""
    states, pooled = [], None
    for model, tokenizer in clips:
        ids, w = chunk_rows(tokenizer, parts)
        empty_ids, _ = chunk_rows(tokenizer, [[]])
        ids = torch.cat([ids, empty_ids.expand(chunks - ids.shape[0], -1)])
        w = torch.cat([w, torch.ones(chunks - w.shape[0], w.shape[1])])
        out = model(ids, output_hidden_states=True)
        z = out.hidden_states[-2].float()
        weighted = z * w[..., None]
        rescaled = weighted * (z.mean(dim=(1, 2), keepdim=True) / weighted.mean(dim=(1, 2), keepdim=True))
        states.append(torch.where((w == 1).all(dim=1)[:, None, None], z, rescaled))
        pooled = getattr(out, "text_embeds", None)
    return torch.cat(states, dim=-1).reshape(77 * chunks, -1), pooled[0]


def _encode(pipe: EnginePipeline, prompt: str, negative: str, max_chunks: int = 3):
    engines = pipe.loop_engines()
    cond = sdxl_conditioning([prompt], [negative], negative, 64, 64, pipe.engine("text_encoder_2"),
                             pipe.tokenizer_2, zero_negative=False)
    reader = PromptReader(engines.tokenizer, "a1111", max_chunks)
    return cond.encode(engines.text_encoder, reader, [prompt], [negative], torch.float32)


#: id, prompt, negative, the prompt's parts as the reference builds them, the negative's, chunks
CASES = [
    ("long", LONG, "", [[(LONG, 1.0)]], [[]], 2),
    ("weighted", "a (red:1.3) fox in [snow]", "blurry", [[("a ", 1.0), ("red", 1.3), (" fox in ", 1.0),
                                                           ("snow", 1 / 1.1)]], [[("blurry", 1.0)]], 1),
    ("break-negative-longer", "a cat", "blurry BREAK ((dark))", [[("a cat", 1.0)]],
     [[("blurry", 1.0)], [("dark", 1.21)]], 2),
]


@pytest.mark.parametrize(("prompt", "negative", "parts", "neg_parts", "chunks"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_sdxl_embeddings_match_the_reference(pipe, clips, prompt, negative, parts, neg_parts, chunks) -> None:
    pos, neg, added = _encode(pipe, prompt, negative)
    want, want_pooled = _reference(clips, parts, chunks)
    want_neg, want_neg_pooled = _reference(clips, neg_parts, chunks)
    assert pos.shape[:2] == neg.shape[:2] == (1, 77 * chunks)
    torch.testing.assert_close(pos[0], want, atol=1e-5, rtol=0)
    torch.testing.assert_close(neg[0], want_neg, atol=1e-5, rtol=0)
    torch.testing.assert_close(added.pooled[0], want_pooled, atol=1e-5, rtol=0)
    torch.testing.assert_close(added.pooled_negative[0], want_neg_pooled, atol=1e-5, rtol=0)


def test_one_chunk_unweighted_is_diffusers_encode_prompt(pipe, tiny_sdxl_dir: Path) -> None:
    """One plain chunk per text: the same values as diffusers' own encode_prompt (no weights, no padding)."""
    ref = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir, local_files_only=True,
                                                             add_watermarker=False)
    want = ref.encode_prompt("a red cube", do_classifier_free_guidance=True, negative_prompt="blurry")
    pos, neg, added = _encode(pipe, "a red cube", "blurry")
    for got, expected in ((pos, want[0]), (neg, want[1]), (added.pooled, want[2]),
                          (added.pooled_negative, want[3])):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_long_weighted_image_matches_diffusers_given_the_reference(pipe, clips, tiny_sdxl_dir: Path) -> None:
    prompt, negative = LONG + "BREAK (ink wash:1.3)", "blurry"
    parts = [[(LONG, 1.0)], [("ink wash", 1.3)]]
    want, pooled = _reference(clips, parts, 3)
    want_neg, neg_pooled = _reference(clips, [[("blurry", 1.0)]], 3)
    ref = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir, local_files_only=True,
                                                             add_watermarker=False)
    ref.set_progress_bar_config(disable=True)
    expected = ref(prompt_embeds=want[None], pooled_prompt_embeds=pooled[None], negative_prompt_embeds=want_neg[None],
                   negative_pooled_prompt_embeds=neg_pooled[None], num_inference_steps=4, output_type="np",
                   generator=torch.Generator("cpu").manual_seed(7)).images
    got = pipe(prompt, negative_prompt=negative, num_inference_steps=4, seed=7, output_type="np",
               progress=False).images
    assert np.abs(got - expected).max() < 1e-4


def test_too_long_prompt_is_truncated_with_a_warning(pipe, clips, caplog: pytest.LogCaptureFixture) -> None:
    text = LONG * 3  # about 300 tokens: more than the default artifact's 3 chunks
    with caplog.at_level(logging.WARNING, logger="diffusion_trt"):
        pos, _, _ = _encode(pipe, text, "")
    assert pos.shape[1] == 77 * 3
    assert caplog.text.count("prompt truncated to 3 chunk(s)") == 1  # one line, not one per encoder


def test_one_chunk_unweighted_is_bit_equal_to_one_run_per_encoder(pipe) -> None:
    """One plain chunk per text: exactly what one run of each encoder over the diffusers-tokenized distinct texts
    gives (the encoding before long prompts), bit for bit."""
    prompts, negatives = ["a red cube", "a blue sphere"], ["blurry", "blurry"]
    pos, neg, added = _encode_many(pipe, prompts, negatives)
    engines = pipe.loop_engines()
    texts = ["blurry", "a red cube", "a blue sphere"]  # the distinct texts, negatives first, as encoded
    two = pipe.engine("text_encoder_2")  # both take embedding_vectors: zeros without embeddings (ids >= 0 only)
    h1 = run_rows_outputs(engines.text_encoder, "input_ids", tokenize(engines.tokenizer, texts, torch.device("cpu")),
                          (HIDDEN_OUTPUT,), engine_feed(engines.text_encoder, None))[HIDDEN_OUTPUT]
    out2 = run_rows_outputs(two, "input_ids", tokenize(pipe.tokenizer_2, texts, torch.device("cpu")),
                            (POOLED_OUTPUT, HIDDEN_OUTPUT), engine_feed(two, None))
    want = torch.cat([h1, out2[HIDDEN_OUTPUT]], dim=-1)
    assert torch.equal(pos, want[1:]) and torch.equal(neg, want[[0, 0]])
    assert torch.equal(added.pooled, out2[POOLED_OUTPUT][1:])
    assert torch.equal(added.pooled_negative, out2[POOLED_OUTPUT][[0, 0]])


def _encode_many(pipe: EnginePipeline, prompts: list[str], negatives: list[str]):
    engines = pipe.loop_engines()
    cond = sdxl_conditioning(prompts, negatives, negatives, 64, 64, pipe.engine("text_encoder_2"), pipe.tokenizer_2,
                             zero_negative=False)
    return cond.encode(engines.text_encoder, PromptReader(engines.tokenizer, "a1111", 3), prompts, negatives,
                       torch.float32)


# --- prompt_embeds / pooled_prompt_embeds on SDXL (diffusers' StableDiffusionXLPipeline semantics) -----------------


@pytest.mark.parametrize("negative", ["embeds", "zeros"])
def test_prompt_embeds_match_diffusers(pipe, clips, tiny_sdxl_dir: Path, negative: str) -> None:
    """The caller's (reference) embeddings of two chunks, with negative embeddings or negative_prompt=None (zeros by
    force_zeros_for_empty_prompt in both pipelines)."""
    want, pooled = _reference(clips, [[(LONG, 1.0)]], 2)
    want_neg, neg_pooled = _reference(clips, [[("blurry", 1.0)]], 2)
    given = {"prompt_embeds": want[None], "pooled_prompt_embeds": pooled[None]}
    if negative == "embeds":
        given |= {"negative_prompt_embeds": want_neg[None], "negative_pooled_prompt_embeds": neg_pooled[None]}
    ref = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir, local_files_only=True,
                                                             add_watermarker=False)
    ref.set_progress_bar_config(disable=True)
    expected = ref(**given, num_inference_steps=3, output_type="np",
                   generator=torch.Generator("cpu").manual_seed(5)).images
    got = pipe(**given, num_inference_steps=3, seed=5, output_type="np", progress=False).images
    assert np.abs(got - expected).max() < 1e-4


def test_prompt_embeds_encode_the_negative_prompt_to_their_chunks(pipe, clips) -> None:
    """prompt_embeds of 2 chunks with a negative prompt as text: the negative is encoded and padded to 2 chunks,
    as the same prompt given as text."""
    want, pooled = _reference(clips, [[(LONG, 1.0)]], 2)
    kwargs = {"negative_prompt": "blurry", "num_inference_steps": 2, "seed": 3, "output_type": "np",
              "progress": False}
    got = pipe(prompt_embeds=want[None], pooled_prompt_embeds=pooled[None], **kwargs).images
    as_text = pipe(LONG, **kwargs).images
    assert np.abs(got - as_text).max() < 1e-4


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"prompt_embeds": torch.zeros(1, 77, 64)}, r"prompt_embeds= needs pooled_prompt_embeds= too on SDXL"),
    ({"pooled_prompt_embeds": torch.zeros(1, 32)}, r"pooled_prompt_embeds= needs prompt_embeds="),
    ({"prompt_embeds": torch.zeros(1, 77, 64), "pooled_prompt_embeds": torch.zeros(2, 32)},
     r"pooled_prompt_embeds must be a float torch.Tensor \[1, \d+\]"),
    ({"prompt_embeds": torch.zeros(1, 77, 64), "pooled_prompt_embeds": torch.zeros(1, 32),
      "negative_prompt_embeds": torch.zeros(1, 77, 64)},
     r"negative_prompt_embeds= needs negative_pooled_prompt_embeds="),
])
def test_bad_sdxl_prompt_embeds(pipe, kwargs: dict, message: str) -> None:
    from diffusion_trt.errors import RuntimeInputError

    unet = pipe.engine("unet").spec  # the cases' last dims 64 / 32 stand for the UNet's D1+D2 / E
    width = {64: unet.input("encoder_hidden_states").shape[2], 32: unet.input("text_embeds").shape[1]}
    kwargs = {k: torch.zeros(*v.shape[:-1], width[v.shape[-1]]) for k, v in kwargs.items()}
    with pytest.raises(RuntimeInputError, match=message):
        pipe(**({} if "prompt_embeds" in kwargs else {"prompt": "a cat"}), **kwargs, num_inference_steps=1,
             progress=False)


@pytest.mark.parametrize("name", ["pooled_prompt_embeds", "negative_pooled_prompt_embeds"])
def test_sdxl_pooled_embeds_holding_nan_are_refused(pipe, name: str) -> None:
    """NaN/Inf in a pooled embedding gave a black image and a warning after the run: refused, naming it."""
    from diffusion_trt.errors import RuntimeInputError

    unet = pipe.engine("unet").spec
    e = torch.zeros(1, 77, unet.input("encoder_hidden_states").shape[2])
    pooled = torch.zeros(1, unet.input("text_embeds").shape[1])
    kwargs = {"prompt_embeds": e, "pooled_prompt_embeds": pooled, "negative_prompt_embeds": e,
              "negative_pooled_prompt_embeds": pooled, name: pooled.index_fill(1, torch.tensor([0]), float("nan"))}
    with pytest.raises(RuntimeInputError, match=rf"^{name} contains NaN/Inf values \(1 of \d+\); pass finite"):
        pipe(**kwargs, num_inference_steps=1, progress=False)


@pytest.mark.parametrize(("name", "pair"), [("original_size", (10**40, 1024)), ("target_size", (64, 2**24 + 1)),
                                           ("negative_crops_coords_top_left", (0, 10**400))])
def test_sdxl_sizes_beyond_float32_are_refused(pipe, name: str, pair: tuple[int, int]) -> None:
    """time_ids are float32: 10**40 became inf (a black image, a warning after the run), 10**400 an OverflowError."""
    from diffusion_trt.errors import RuntimeInputError

    extra = {"negative_original_size": (64, 64), "negative_target_size": (64, 64)} if "negative" in name else {}
    with pytest.raises(RuntimeInputError) as info:
        pipe("a cat", **{name: pair}, **extra, num_inference_steps=1, progress=False)
    least = 0 if "crops" in name else 1
    assert str(info.value) == (f"{name}={pair!r} must be a pair of integers >= {least} and <= 16777216 (pixels, "
                               "(height, width) or (top, left)), e.g. (1024, 1024) or (0, 0)")


def test_pooled_prompt_embeds_are_sdxl_only(tiny_artifact: Path) -> None:
    from diffusion_trt.errors import RuntimeInputError

    with EnginePipeline.from_artifacts(tiny_artifact) as sd, pytest.raises(RuntimeInputError,
                                                                          match="SDXL artifacts only"):
        sd("a cat", pooled_prompt_embeds=torch.zeros(1, 32), num_inference_steps=1, progress=False)


def test_data_parallel_splits_the_pooled_prompt_embeds(tiny_sdxl_artifact: Path, clips) -> None:
    """Each device's share gets its images' rows of prompt_embeds and pooled_prompt_embeds alike."""
    from diffusion_trt.runtime.parallel import DataParallelPipeline

    rows = [_reference(clips, [[(text, 1.0)]], 1) for text in ("a cat", "a dog")]
    embeds = {"prompt_embeds": torch.stack([r[0] for r in rows]),
              "pooled_prompt_embeds": torch.stack([r[1] for r in rows])}
    pipes = [EnginePipeline.from_artifacts(tiny_sdxl_artifact, verify=False) for _ in range(3)]
    one = pipes.pop()
    with one, DataParallelPipeline(pipes, warm_up=False) as multi:
        call = {"num_inference_steps": 2, "num_images_per_prompt": 2, "seed": 3, "output_type": "np", **embeds}
        got = multi(None, **call)
        want = one(None, progress=False, **call)
    assert got.parameters["device_shares"] == [2, 2]
    np.testing.assert_array_equal(got.images, want.images)

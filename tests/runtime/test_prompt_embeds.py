"""prompt_embeds / negative_prompt_embeds in EnginePipeline.__call__, as diffusers' StableDiffusionPipeline takes
them: images against diffusers on the same embeddings, and every malformed call refused with its message."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch

from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline

from .prompt_reference import reference_states

D = 32  # the tiny arch's cross-attention width


@pytest.fixture(scope="module")
def reference(tiny_pipeline_dir: Path) -> diffusers.StableDiffusionPipeline:
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(tiny_pipeline_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(tiny_artifact: Path) -> Iterator[EnginePipeline]:
    with EnginePipeline.from_artifacts(tiny_artifact) as p:
        yield p


def _embeds(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _both(reference: diffusers.StableDiffusionPipeline, pipe: EnginePipeline, ref_kwargs: dict[str, Any],
          kwargs: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    common = {"num_inference_steps": 3, "output_type": "np"}
    want = reference(**ref_kwargs, **common, generator=torch.Generator("cpu").manual_seed(5)).images
    got = pipe(**kwargs, **common, seed=5, progress=False).images
    return got, want


@pytest.mark.parametrize("chunks", [1, 2])
def test_both_embeds_match_diffusers(reference: diffusers.StableDiffusionPipeline, pipe: EnginePipeline,
                                     chunks: int) -> None:
    e, n = _embeds(2, 77 * chunks, D, seed=1), _embeds(2, 77 * chunks, D, seed=2)
    args = {"prompt_embeds": e, "negative_prompt_embeds": n, "num_images_per_prompt": 2}
    got, want = _both(reference, pipe, args, args)
    assert got.shape == want.shape == (4, 64, 64, 3)
    assert np.abs(got - want).max() < 1e-4


def test_prompt_embeds_with_a_negative_prompt_matches_diffusers(reference: diffusers.StableDiffusionPipeline,
                                                                pipe: EnginePipeline) -> None:
    e = _embeds(1, 77, D, seed=3)
    args = {"prompt_embeds": e, "negative_prompt": "blurry, low quality"}
    got, want = _both(reference, pipe, args, args)
    assert np.abs(got - want).max() < 1e-4


def test_long_prompt_embeds_pad_the_negative_prompt(reference: diffusers.StableDiffusionPipeline,
                                                    pipe: EnginePipeline) -> None:
    """Two chunks of prompt_embeds, negative_prompt as text: encoded as two chunks (the second empty)."""
    e = _embeds(1, 154, D, seed=4)
    negative = reference_states(reference.text_encoder, reference.tokenizer, [[("blurry", 1.0)]], 2)[None]
    got, want = _both(reference, pipe, {"prompt_embeds": e, "negative_prompt_embeds": negative},
                      {"prompt_embeds": e, "negative_prompt": "blurry"})
    assert np.abs(got - want).max() < 1e-4


def test_prompt_embeds_without_cfg(reference: diffusers.StableDiffusionPipeline, pipe: EnginePipeline) -> None:
    args = {"prompt_embeds": _embeds(1, 77, D, seed=6).half(), "guidance_scale": 1.0}  # any float dtype
    got, want = _both(reference, pipe, {**args, "prompt_embeds": args["prompt_embeds"].float()}, args)
    assert np.abs(got - want).max() < 1e-4


E77 = torch.zeros(1, 77, D)
#: id, call arguments, a fragment of the message
BAD = [
    ("both", {"prompt": "x", "prompt_embeds": E77}, "pass either prompt= or prompt_embeds=, not both"),
    ("neither", {}, "prompt=None: pass a string, a non-empty list of strings, or prompt_embeds="),
    ("both-negative", {"prompt_embeds": E77, "negative_prompt": "x", "negative_prompt_embeds": E77},
     "pass either negative_prompt= or negative_prompt_embeds=, not both"),
    ("negative-alone", {"prompt": "x", "negative_prompt_embeds": E77}, "negative_prompt_embeds= needs prompt_embeds="),
    ("shapes-differ", {"prompt_embeds": E77, "negative_prompt_embeds": torch.zeros(1, 154, D)},
     "negative_prompt_embeds has shape (1, 154, 32) but prompt_embeds (1, 77, 32); they must match"),
    ("width", {"prompt_embeds": torch.zeros(1, 77, 16)}, "prompt_embeds has shape (1, 77, 16); this artifact takes"),
    ("not-77k", {"prompt_embeds": torch.zeros(1, 100, D)}, "prompt_embeds has shape (1, 100, 32)"),
    ("too-long", {"prompt_embeds": torch.zeros(1, 308, D)}, "with 77 * k in 77..231"),
    ("rank", {"prompt_embeds": torch.zeros(77, D)}, "prompt_embeds has shape (77, 32)"),
    ("int", {"prompt_embeds": torch.zeros(1, 77, D, dtype=torch.int64)}, "got Tensor of torch.int64"),
    ("list", {"prompt_embeds": [[0.0]]}, "prompt_embeds must be a float torch.Tensor [prompts, 77 * k, 32]"),
    ("nan", {"prompt_embeds": torch.full((1, 77, D), float("nan"))},
     "prompt_embeds contains NaN/Inf values (2464 of 2464); pass finite values"),
    ("inf-negative", {"prompt_embeds": E77, "negative_prompt_embeds": E77.index_fill(1, torch.tensor([5]), -math.inf)},
     "negative_prompt_embeds contains NaN/Inf values (32 of 2464); pass finite values"),
    # float64 1e39: finite there, inf in the engines (a black image with the loop's NaN warning only)
    ("beyond-float32", {"prompt_embeds": E77.double().index_fill(1, torch.tensor([3]), 1e39)},
     "prompt_embeds holds float64 values beyond float32's range ±3.4e+38 (32 of 2464), inf in the engines"),
]


@pytest.mark.parametrize(("kwargs", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_malformed_embeds_are_refused(pipe: EnginePipeline, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeInputError) as info:
        pipe(**kwargs, num_inference_steps=1, progress=False)
    assert message in str(info.value)

"""Chunking a request into engine-sized batches: the plan, and that chunked images equal unchunked ones."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.batching import even_groups, per_image, plan_chunks, split_across
from tests.runtime.toy import write_toy_artifact


def sizes(ranges: list[range]) -> list[int]:
    return [len(r) for r in ranges]


@pytest.mark.parametrize(
    ("total", "lo", "hi", "want"),
    [(1, 1, 4, [1]), (4, 1, 4, [4]), (5, 1, 4, [3, 2]), (10, 1, 4, [4, 3, 3]), (5, 2, 4, [3, 2]), (8, 4, 4, [4, 4])],
)
def test_plan_chunks(total: int, lo: int, hi: int, want: list[int]) -> None:
    plan = plan_chunks(total, lo, hi)
    assert sizes(plan) == want
    assert [i for r in plan for i in r] == list(range(total))  # contiguous, in order


def test_plan_chunks_errors_name_the_sizes_and_the_fix() -> None:
    with pytest.raises(
        RuntimeInputError, match=r"batch of 5 images cannot be split into chunks of 4..4.*multiple of 4"
    ):
        plan_chunks(5, 4, 4)
    with pytest.raises(RuntimeInputError, match=r"below the engine profile's min batch 2.*--min-batch-size 1"):
        plan_chunks(1, 2, 4)


@pytest.mark.parametrize(
    ("total", "parts", "lo", "hi", "want"),
    [
        (8, 2, 1, 4, [4, 4]),
        (5, 2, 1, 4, [3, 2]),
        (1, 2, 1, 4, [1]),  # fewer images than devices: one device works
        (8, 2, 4, 4, [4, 4]),
        (12, 2, 4, 4, [8, 4]),  # static batch 4: whole chunks per device
        (4, 2, 4, 4, [4]),
    ],
)
def test_split_across_devices(total: int, parts: int, lo: int, hi: int, want: list[int]) -> None:
    shares = split_across(total, parts, lo, hi)
    assert sizes(shares) == want
    assert [i for r in shares for i in r] == list(range(total))
    for share in shares:
        plan_chunks(len(share), lo, hi)  # every share is runnable


def test_even_groups_and_per_image() -> None:
    assert sizes(even_groups(5, 3)) == [2, 2, 1]
    assert per_image(["a", "b"], 3) == ["a", "a", "a", "b", "b", "b"]


# --- chunked == unchunked, on the toy artifact ------------------------------------------------------------


@pytest.fixture(scope="module")
def small_and_big(tmp_path_factory: pytest.TempPathFactory, tokenizer_cache: Path) -> Iterator[tuple[Any, Any]]:
    """The same toy model with max batch 2 (chunks) and max batch 8 (one call)."""
    root = tmp_path_factory.mktemp("chunks")
    small = write_toy_artifact(root / "small", batch=(1, 1, 2), tokenizer_cache=tokenizer_cache)
    big = write_toy_artifact(root / "big", batch=(1, 1, 8), tokenizer_cache=tokenizer_cache)
    with EnginePipeline.from_artifacts(small) as a, EnginePipeline.from_artifacts(big) as b:
        yield a, b


CALL: dict[str, Any] = {
    "prompt": ["a cat", "a dog", "a fox"],
    "num_images_per_prompt": 2,
    "num_inference_steps": 3,
    "progress": False,
}


@pytest.mark.parametrize("output_type", ["np", "pil", "pt", "latent"])
def test_chunked_images_equal_one_call(small_and_big: tuple[Any, Any], output_type: str) -> None:
    small, big = small_and_big
    a = small(**CALL, seed=5, output_type=output_type).images
    b = big(**CALL, seed=5, output_type=output_type).images
    if output_type == "pil":
        a, b = np.stack([np.asarray(i) for i in a]), np.stack([np.asarray(i) for i in b])
    assert len(a) == 6
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_chunks_with_a_noise_drawing_scheduler_and_per_image_generators(small_and_big: tuple[Any, Any]) -> None:
    small, big = small_and_big
    for pipe in small_and_big:
        pipe.set_scheduler("euler_a")
    try:

        def gens() -> list[torch.Generator]:
            return [torch.Generator().manual_seed(100 + i) for i in range(6)]

        a = small(**CALL, generator=gens(), output_type="np").images
        b = big(**CALL, generator=gens(), output_type="np").images
        np.testing.assert_array_equal(a, b)  # one generator per image: chunk-independent
        # one generator: deterministic, but the chunks consume its stream in turn (documented in batching.py)
        c = small(**CALL, seed=1, output_type="np").images
        np.testing.assert_array_equal(c, small(**CALL, seed=1, output_type="np").images)
    finally:
        for pipe in small_and_big:
            pipe.set_scheduler(None)


def test_static_profile_refuses_a_batch_it_cannot_chunk(tmp_path: Path, tokenizer_cache: Path) -> None:
    art = write_toy_artifact(tmp_path / "static", batch=(2, 2, 2), tokenizer_cache=tokenizer_cache)
    with EnginePipeline.from_artifacts(art) as pipe:
        out = pipe(["a", "b"], num_images_per_prompt=2, num_inference_steps=2, progress=False, output_type="np")
        assert out.images.shape[0] == 4  # 2 chunks of 2
        with pytest.raises(RuntimeInputError, match=r"batch of 3 images cannot be split into chunks of 2..2"):
            pipe(["a", "b", "c"], num_inference_steps=2, progress=False)

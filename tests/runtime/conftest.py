"""Runtime fixtures: the toy artifact (hand-built graphs, milliseconds) and a loaded pipeline on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime.toy import write_toy_artifact


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder the real CLIP tokenizer is written to once and copied from."""
    return tmp_path_factory.mktemp("clip_tokenizer")


@pytest.fixture(scope="session")
def toy_artifact(tmp_path_factory: pytest.TempPathFactory, tokenizer_cache: Path) -> Path:
    """Toy artifact: batch 1..4, height and width 32..128 (default 64)."""
    return write_toy_artifact(tmp_path_factory.mktemp("toy") / "art", tokenizer_cache=tokenizer_cache)


@pytest.fixture(scope="module")
def toy_pipe(toy_artifact: Path) -> Iterator[object]:
    from diffusion_trt.runtime import EnginePipeline

    with EnginePipeline.from_artifacts(toy_artifact) as pipe:
        yield pipe

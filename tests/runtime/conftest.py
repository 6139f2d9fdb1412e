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


@pytest.fixture(scope="session")
def old_sdxl_artifact(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sdxl compiled with the text encoders of before SDXL clip skip and textual inversion (no
    ``clip_skip_states`` output, no ``embedding_vectors`` input)."""
    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig

    return compile_pipeline(tiny_sdxl_dir, tmp_path_factory.mktemp("old-sdxl") / "tiny-sdxl",
                            CompileConfig(max_clip_skip=0, max_embedding_vectors=0))

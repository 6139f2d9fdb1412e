"""CPU-testable parts of the fast paths: CUDA-graph fallback, negative-prompt cache, host buffers, uint8 images."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.cuda import HostBuffers, images_float, images_uint8
from diffusion_trt.runtime.engines.engine import EngineSpec
from diffusion_trt.runtime.engines.ort_engine import OrtEngine, cuda_graph_refusal
from diffusion_trt.runtime.text_embeddings import EmbeddingCache
from tests.runtime.test_engine import ADD_SPEC, _tensor, add_model, expected, feeds

#: ADD_SPEC pinned to one shape: what a static artifact's manifest says
STATIC_SPEC: dict[str, Any] = {
    "inputs": [
        _tensor("x", "float32", ["B2", 4, "h", "w"], [2, 4, 8, 8], [2, 4, 8, 8]),
        _tensor("t", "float32", ["B2"], [2], [2]),
    ],
    "outputs": [_tensor("y", "float32", ["B2", 4, "h", "w"], [2, 4, 8, 8], [2, 4, 8, 8])],
}
FAST: dict[str, Any] = {"num_inference_steps": 2, "progress": False}


@pytest.fixture(scope="module")
def add_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("graph") / "model.onnx"
    onnx.save_model(add_model(), str(path))
    return path


def _graph_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "CUDA graph" in r.getMessage()]


# --- CUDA graph mode falls back to eager runs, with one warning naming the cause -------------------------


def test_refusal_reasons() -> None:
    assert cuda_graph_refusal(EngineSpec.from_manifest("unet", STATIC_SPEC), "cuda") is None
    dynamic = cuda_graph_refusal(EngineSpec.from_manifest("unet", ADD_SPEC), "cuda")
    assert dynamic is not None and "input 'x' has a dynamic profile (1, 4, 4, 4)..(4, 4, 16, 16)" in dynamic
    assert "compile a static artifact" in dynamic
    cpu = cuda_graph_refusal(EngineSpec.from_manifest("unet", STATIC_SPEC), "cpu")
    assert cpu is not None and "device='cpu'" in cpu
    # a dynamic artifact on the CPU: the device is the cause ("compile a static artifact" was the advice, which a
    # CPU run cannot take: run --cuda-graph on a CPU artifact said so for every engine)
    assert cuda_graph_refusal(EngineSpec.from_manifest("unet", ADD_SPEC), "cpu") == cpu


@pytest.mark.parametrize(
    ("spec", "cause"), [(STATIC_SPEC, "need the CUDA execution provider"),
                        (ADD_SPEC, "need the CUDA execution provider")]  # on the CPU: the device first
)
def test_cuda_graph_mode_runs_eagerly_with_one_warning(
    add_path: Path, spec: dict[str, Any], cause: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="diffusion_trt")
    with OrtEngine(add_path, spec, name="unet", cuda_graph=True) as engine:
        for seed in range(3):
            f = feeds(b=2, h=8, w=8, seed=seed)
            torch.testing.assert_close(engine.run(f)["y"], expected(f))
        assert not engine.cuda_graph
        assert engine.cuda_graph_reason is not None and cause in engine.cuda_graph_reason
    warnings = _graph_warnings(caplog)
    assert len(warnings) == 1 and cause in warnings[0] and warnings[0].startswith("unet: CUDA graph not used")


def test_pipeline_cuda_graph_on_cpu_falls_back(toy_artifact: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="diffusion_trt")
    with EnginePipeline.from_artifacts(toy_artifact, cuda_graph=True) as pipe:
        got = pipe("a cat", seed=2, output_type="np", **FAST).images
        assert not any(getattr(e, "cuda_graph", False) for e in pipe.engines.values())
    with EnginePipeline.from_artifacts(toy_artifact) as pipe:  # default: off on CPU, silently
        want = pipe("a cat", seed=2, output_type="np", **FAST).images
    np.testing.assert_array_equal(got, want)
    warnings = _graph_warnings(caplog)
    assert len(warnings) == 3  # one per engine, each naming its cause: the CPU (the toy artifact is dynamic too,
    assert all("device='cpu'" in w for w in warnings)  # but "compile a static artifact" would not help on the CPU)


# --- negative-prompt cache ---------------------------------------------------------------------------------


def test_negative_prompt_embedding_is_cached(toy_artifact: Path) -> None:
    with EnginePipeline.from_artifacts(toy_artifact) as pipe:
        cache = pipe.embedding_cache
        first = pipe(["a cat", "a dog"], seed=1, output_type="np", **FAST).images
        assert (cache.hits, cache.misses, len(cache)) == (0, 1, 1)  # "" once for both prompts
        second = pipe(["a cat", "a dog"], seed=1, output_type="np", **FAST).images
        assert (cache.hits, cache.misses) == (1, 1)
        np.testing.assert_array_equal(first, second)
        pipe("a cat", negative_prompt="blurry", **FAST)
        assert (cache.hits, cache.misses, len(cache)) == (1, 2, 2)
        pipe("a cat", guidance_scale=1.0, **FAST)  # no CFG: no negative prompt, no lookup
        assert (cache.hits, cache.misses) == (1, 2)
    assert len(cache) == 0  # cleared on close
    with EnginePipeline.from_artifacts(toy_artifact) as pipe:
        pipe.embedding_cache = EmbeddingCache(maxsize=0)  # disabled: same images
        np.testing.assert_array_equal(first, pipe(["a cat", "a dog"], seed=1, output_type="np", **FAST).images)


def test_embedding_cache_is_lru() -> None:
    cache = EmbeddingCache(maxsize=2)
    for k in "abc":
        cache.put(k, torch.zeros(1))
    assert cache.get("a") is None and cache.get("c") is not None and len(cache) == 2


# --- host buffers and the uint8 conversion ------------------------------------------------------------------


def test_host_buffers_are_reused_and_results_do_not_alias(toy_artifact: Path) -> None:
    with EnginePipeline.from_artifacts(toy_artifact) as pipe:
        buffers = pipe._host_buffers
        a = pipe("a cat", seed=1, output_type="np", **FAST).images
        a_copy = a.copy()
        b = pipe("a dog", seed=2, output_type="np", **FAST).images
        assert buffers.allocations == 1  # one float32 buffer, reused
        np.testing.assert_array_equal(a, a_copy)  # the second call did not overwrite the first result
        assert not np.shares_memory(a, b)
        pil = pipe("a cat", seed=1, **FAST).images
        pipe("a dog", seed=2, **FAST)
        assert buffers.allocations == 2  # plus one uint8 buffer
        np.testing.assert_array_equal(np.asarray(pil[0]), (a_copy[0] * 255).round().astype(np.uint8))


def test_host_buffers_lru() -> None:
    buffers = HostBuffers(pin=False, max_entries=1)
    x = buffers.get((2, 3), torch.uint8)
    assert buffers.get((2, 3), torch.uint8) is x and buffers.allocations == 1
    buffers.get((4,), torch.float32)
    assert buffers.get((2, 3), torch.uint8) is not x and buffers.allocations == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_uint8_conversion_matches_diffusers_postprocess(dtype: torch.dtype) -> None:
    from diffusers.image_processor import VaeImageProcessor

    image = (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 0.7).to(dtype)
    image[0, 0, 0, :4] = torch.tensor([-2.0, 2.0, 0.0, 0.5 / 255 * 2 - 1])  # clamped ends and a rounding tie
    processor = VaeImageProcessor(vae_scale_factor=8)
    want = np.stack([np.asarray(p) for p in processor.postprocess(image, output_type="pil")])
    np.testing.assert_array_equal(images_uint8(image).numpy(), want)
    np.testing.assert_array_equal(images_float(image).numpy(), processor.postprocess(image, output_type="np"))

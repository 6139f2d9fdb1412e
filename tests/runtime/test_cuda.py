"""The CUDA path (IO binding on device tensors, shared stream, no host syncs): needs a GPU and onnxruntime-gpu.

Run on a GPU host with ``pytest -m gpu tests/runtime``. Compared against the CPU path on the same artifact
(fp32, TF32 off so both sides compute in full fp32).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.engines.ort_engine import OrtEngine
from tests.runtime.test_engine import ADD_SPEC, add_model, expected, feeds

pytestmark = pytest.mark.gpu

NO_TF32 = {"use_tf32": 0}
CALL: dict[str, Any] = {"prompt": ["a cat", "a dog"], "num_inference_steps": 5, "seed": 3, "progress": False}


@pytest.fixture(scope="module")
def add_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import onnx

    path = tmp_path_factory.mktemp("add_cuda") / "model.onnx"
    onnx.save_model(add_model(), str(path))
    return path


@pytest.mark.parametrize("own_stream", [False, True])
def test_engine_on_device_tensors(add_path: Path, own_stream: bool) -> None:
    stream = torch.cuda.Stream() if own_stream else None
    with OrtEngine(add_path, ADD_SPEC, device="cuda", stream=stream) as engine:
        assert engine.providers[0] == "CUDAExecutionProvider"
        for seed in range(3):  # called from the default stream, also when the engine has its own
            f = feeds(b=3, h=8, w=16, seed=seed)
            out = engine.run({k: v.cuda() for k, v in f.items()})["y"]
            assert out.device.type == "cuda"
            torch.testing.assert_close(out.cpu(), expected(f))
        if stream is not None:
            with torch.cuda.stream(stream):
                f = feeds(b=2, seed=9)
                out = engine.run({k: v.cuda() for k, v in f.items()})["y"].clone()
            stream.synchronize()
            torch.testing.assert_close(out.cpu(), expected(f))


@pytest.fixture(scope="module")
def cpu_and_cuda(tiny_artifact: Path) -> Iterator[tuple[EnginePipeline, EnginePipeline]]:
    with (
        EnginePipeline.from_artifacts(tiny_artifact, device="cpu") as cpu,
        EnginePipeline.from_artifacts(tiny_artifact, device="cuda", verify=False, provider_options=NO_TF32) as gpu,
    ):
        yield cpu, gpu


@pytest.mark.parametrize("scheduler", [None, "euler_a", "dpm++"])
@pytest.mark.parametrize("guidance_scale", [1.0, 7.5])
def test_cuda_pipeline_matches_cpu(
    cpu_and_cuda: tuple[EnginePipeline, EnginePipeline], scheduler: str | None, guidance_scale: float
) -> None:
    cpu, gpu = cpu_and_cuda
    for pipe in (cpu, gpu):
        pipe.set_scheduler(scheduler)
    want = cpu(**CALL, guidance_scale=guidance_scale, output_type="np").images
    got = gpu(**CALL, guidance_scale=guidance_scale, output_type="np").images
    assert np.abs(got - want).max() < 1 / 255


def test_cuda_pt_output_is_usable_on_the_callers_stream(cpu_and_cuda: tuple[EnginePipeline, EnginePipeline]) -> None:
    cpu, gpu = cpu_and_cuda
    cpu.set_scheduler(None)
    gpu.set_scheduler(None)
    pt = gpu(**CALL, output_type="pt").images
    assert pt.device.type == "cuda" and pt.shape == (2, 3, 64, 64)
    total = (pt * 2).sum()  # enqueued on the default stream, after the pipeline's stream
    want = cpu(**CALL, output_type="pt").images
    assert abs(float(total) - float((want * 2).sum())) < 1e-2 * want.numel() / 255
    latents = torch.randn(2, 4, 8, 8, device="cuda")
    np.testing.assert_allclose(
        gpu(**CALL, latents=latents, output_type="np").images,
        cpu(**CALL, latents=latents.cpu(), output_type="np").images,
        atol=1 / 255,
    )

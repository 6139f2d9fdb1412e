"""The CUDA fast paths on a GPU: ORT CUDA-graph mode, a sync-free denoising loop, pinned outputs, two GPUs.

Run on a GPU host with onnxruntime-gpu: ``pytest -m gpu tests/runtime/test_cuda_graph.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch

from diffusion_trt.runtime import EnginePipeline, denoise
from diffusion_trt.runtime.engines.ort_engine import OrtEngine
from tests.runtime.test_engine import add_model, expected, feeds
from tests.runtime.test_runtime_fast_paths import STATIC_SPEC

pytestmark = pytest.mark.gpu

NO_TF32 = {"use_tf32": 0}
CALL: dict[str, Any] = {"prompt": "a cat", "num_inference_steps": 4, "seed": 3, "progress": False}


@pytest.fixture(scope="module")
def add_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("add_graph") / "model.onnx"
    onnx.save_model(add_model(), str(path))
    return path


@pytest.mark.parametrize("own_stream", [False, True])
def test_ort_cuda_graph_replays_new_inputs(add_path: Path, own_stream: bool) -> None:
    stream = torch.cuda.Stream() if own_stream else None
    with OrtEngine(add_path, STATIC_SPEC, name="unet", device="cuda", stream=stream, cuda_graph=True) as engine:
        for seed in range(5):  # run 1 regular, run 2 captured, runs 3.. replayed: each must see its own inputs
            f = feeds(b=2, h=8, w=8, seed=seed)
            out = engine.run({k: v.cuda() for k, v in f.items()})["y"].clone()
            torch.testing.assert_close(out.cpu(), expected(f))
        assert engine.cuda_graph, engine.cuda_graph_reason


@pytest.mark.parametrize("own_stream", [False, True])
def test_prime_leaves_the_capture_to_the_engines_own_runs(add_path: Path, own_stream: bool) -> None:
    """OrtEngine.prime in CUDA-graph mode runs outside the graph (gpu_graph_id=-1): the engine's own runs after it
    still run, capture and replay their own inputs, on this thread or after a prime on another one."""
    import threading

    stream = torch.cuda.Stream() if own_stream else None
    with OrtEngine(add_path, STATIC_SPEC, name="unet", device="cuda", stream=stream, cuda_graph=True) as engine:
        worker = threading.Thread(target=engine.prime)  # as the size buckets' worker thread primes a new session
        worker.start()
        worker.join()
        assert engine.prime() is True
        for seed in range(4):
            f = feeds(b=2, h=8, w=8, seed=seed)
            out = engine.run({k: v.cuda() for k, v in f.items()})["y"].clone()
            torch.testing.assert_close(out.cpu(), expected(f))
        assert engine.cuda_graph, engine.cuda_graph_reason


@pytest.fixture(scope="module")
def static_artifact(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline compiled for CUDA fp32 with a static profile: 64x64, batch 2 (CFG batch 4)."""
    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig

    config = CompileConfig(
        device="cuda",
        height=64,
        width=64,
        min_height=64,
        max_height=64,
        min_width=64,
        max_width=64,
        batch_size=2,
        min_batch_size=2,
        max_batch_size=2,
    )
    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("static") / "tiny", config)


@pytest.fixture(scope="module")
def graph_and_eager(static_artifact: Path) -> Iterator[tuple[EnginePipeline, EnginePipeline]]:
    with (
        EnginePipeline.from_artifacts(static_artifact, provider_options=NO_TF32, cuda_graph=True) as graph,
        EnginePipeline.from_artifacts(static_artifact, provider_options=NO_TF32, cuda_graph=False) as eager,
    ):
        yield graph, eager


@pytest.mark.parametrize("scheduler", [None, "euler_a", "dpm++"])
def test_pipeline_with_cuda_graphs_matches_eager(
    graph_and_eager: tuple[EnginePipeline, EnginePipeline], scheduler: str | None
) -> None:
    graph, eager = graph_and_eager
    reasons = {n: e.cuda_graph_reason for n, e in graph.engines.items()}  # type: ignore[attr-defined]
    assert all(e.cuda_graph for e in graph.engines.values()), reasons  # type: ignore[attr-defined]
    for pipe in (graph, eager):
        pipe.set_scheduler(scheduler)
    # 4 images = 2 chunks of 2: the graphs replay for the second chunk and the second call
    for _ in range(2):
        got = graph(**CALL, num_images_per_prompt=4, output_type="np").images
        want = eager(**CALL, num_images_per_prompt=4, output_type="np").images
        assert np.abs(got - want).max() < 1 / 255
    assert graph._host_buffers.pin and all(b.is_pinned() for b in graph._host_buffers._buffers.values())


@pytest.mark.parametrize("scheduler", [None, "euler", "dpm++"])
def test_denoising_loop_never_syncs_the_host(
    graph_and_eager: tuple[EnginePipeline, EnginePipeline], scheduler: str | None
) -> None:
    graph, _ = graph_and_eager
    graph.set_scheduler(scheduler)
    sched = graph.scheduler
    sched.set_timesteps(10, device=graph.device)
    timesteps = denoise.host_timesteps(sched)
    values = timesteps.to(graph.device, torch.float32)
    unet = graph.engines["unet"]
    embeds = torch.randn(4, 77, unet.spec.input("encoder_hidden_states").shape[2], device=graph.device)
    latents = torch.randn(2, 4, 8, 8, device=graph.device) * sched.init_noise_sigma
    torch.cuda.synchronize()
    with torch.cuda.stream(graph._stream):
        torch.cuda.set_sync_debug_mode("error")  # any synchronising torch call inside raises
        try:
            out = denoise.denoise_latents(
                unet=unet,
                scheduler=sched,
                prompt_embeds=embeds,
                latents=latents,
                timesteps=timesteps,
                timestep_values=values,
                guidance_scale=7.5,
                extra={},
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out).all()
    graph.set_scheduler(None)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpus_equal_one(static_artifact: Path, graph_and_eager: tuple[EnginePipeline, EnginePipeline]) -> None:
    from diffusion_trt.runtime.parallel import DataParallelPipeline

    graph, _ = graph_and_eager
    with DataParallelPipeline.from_artifacts(static_artifact, [0, 1], provider_options=NO_TF32) as multi:
        got = multi(**CALL, num_images_per_prompt=4, output_type="np")
        want = graph(**CALL, num_images_per_prompt=4, output_type="np")
        assert got.parameters["device_shares"] == [2, 2]
        assert np.abs(got.images - want.images).max() < 1 / 255


def test_engines_opened_side_by_side_warm_and_capture_without_a_race(static_artifact: Path) -> None:
    """runtime/loading.py opens the engines on threads and warms each static one (ORT's first run captures its
    graph): session creations and uncaptured runs hold CAPTURE_LOCK shared, side by side, and captures hold it
    exclusive, so five loads in a row neither fail ("operation not permitted when stream is capturing", seen on the
    H200 before the lock) nor change the image beyond the kernels' own noise."""
    images = []
    for _ in range(5):  # cuda_graph=True: every engine captured at load (the default leaves text encoder and VAE eager)
        with EnginePipeline.from_artifacts(static_artifact, cuda_graph=True) as pipe:
            assert all(pipe.engines[n].cuda_graph for n in ("text_encoder", "unet", "vae_decoder"))
            images.append(np.asarray(pipe(**CALL, num_images_per_prompt=2, output_type="np").images))
    for image in images[1:]:  # separate loads may pick other cuDNN/cuBLAS kernels: 0.0018 max abs seen on the H200
        np.testing.assert_allclose(image, images[0], atol=5e-3, rtol=0)


@pytest.mark.parametrize("own_stream", [False, True])
def test_capture_on_one_thread_replays_there_and_another_thread_captures_its_own(add_path: Path,
                                                                                 own_stream: bool) -> None:
    """OrtEngine.capture: the graph-mode runs on zeros now, so this thread's first run replays; ONNX Runtime keeps
    graphs per thread, so a thread that has not run the engine takes its own capture runs (under the lock)."""
    import threading

    stream = torch.cuda.Stream() if own_stream else None
    with OrtEngine(add_path, STATIC_SPEC, name="unet", device="cuda", stream=stream, cuda_graph=True) as engine:
        assert engine.prime() is True
        assert engine.capture() is True
        assert engine.capture() is False  # captured on this thread already
        assert not engine._capturing()
        results: list[Any] = []

        def other() -> None:
            assert engine._capturing()
            for seed in range(3):
                f = feeds(b=2, h=8, w=8, seed=seed)
                results.append((engine.run({k: v.cuda() for k, v in f.items()})["y"].cpu(), expected(f)))

        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        for seed in range(3, 6):
            f = feeds(b=2, h=8, w=8, seed=seed)
            results.append((engine.run({k: v.cuda() for k, v in f.items()})["y"].cpu(), expected(f)))
        assert len(results) == 6
        for got, want in results:
            torch.testing.assert_close(got, want)
        assert engine.cuda_graph, engine.cuda_graph_reason


def test_from_artifacts_captures_the_graphs_on_the_callers_thread(static_artifact: Path) -> None:
    """from_artifacts captures each static engine's graph on its own thread while diffusers is imported on
    another, so the caller's first call replays from its first step; the image equals an eager pipeline's.
    cuda_graph=True: every engine graphed (the default leaves the text encoder and VAE eager)."""
    with (
        EnginePipeline.from_artifacts(static_artifact, provider_options=NO_TF32, cuda_graph=True) as pipe,
        EnginePipeline.from_artifacts(static_artifact, provider_options=NO_TF32, cuda_graph=False) as eager,
    ):
        for name in ("text_encoder", "unet", "vae_decoder"):
            assert pipe.engines[name].cuda_graph, pipe.engines[name].cuda_graph_reason
            assert not pipe.engines[name]._capturing(), name  # captured here already
        got = pipe(**CALL, num_images_per_prompt=2, output_type="np").images  # the profile's batch (2..2)
        want = eager(**CALL, num_images_per_prompt=2, output_type="np").images
        np.testing.assert_allclose(got, want, atol=2e-3, rtol=0)


def test_by_default_the_unet_replays_a_graph_and_the_once_per_image_engines_run_eager(static_artifact: Path) -> None:
    """loading.EAGER_COMPONENTS: with cuda_graph=None the text encoder and VAE decoder run eager (their captures at
    load cost more of the first image than their replays save), each run once on this thread at load."""
    with EnginePipeline.from_artifacts(static_artifact) as pipe:
        assert pipe.engines["unet"].cuda_graph
        assert not pipe.engines["text_encoder"].cuda_graph and not pipe.engines["vae_decoder"].cuda_graph
        out = pipe(**CALL, num_images_per_prompt=2, output_type="np").images  # the profile's batch (2..2)
    assert np.isfinite(out).all()

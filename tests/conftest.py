"""Shared fixtures: a tiny random-weight SD pipeline folder and its compiled CPU artifact (session-scoped)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _package_logs_reach_caplog() -> Iterator[None]:
    """Undo what an in-process CLI call leaves on the package's loggers: ``cli._setup_logging`` turns propagation off
    and adds a handler on that call's (since closed) stderr, and ``optimize`` quiets ``diffusion_trt.passes.base`` to
    WARNING; either hid later tests' INFO records from ``caplog``, depending on the order the tests ran in."""
    yield
    root = logging.getLogger("diffusion_trt")
    root.propagate = True
    root.handlers[:] = []
    root.setLevel(logging.NOTSET)
    logging.getLogger("diffusion_trt.passes.base").setLevel(logging.NOTSET)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` / `tensorrt` / `rtx_builder` / `tensorrt_rtx_gpu` tests with a reason where the hardware or library
    is absent."""
    has_trt = importlib.util.find_spec("tensorrt") is not None
    if has_trt:
        try:
            import tensorrt  # noqa: F401
        except Exception:  # noqa: BLE001 - the PyPI stubs raise on import
            has_trt = False
    try:
        import tensorrt_rtx_bindings  # noqa: F401

        has_rtx = True
    except Exception:  # noqa: BLE001 - a missing or broken wheel
        has_rtx = False
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_gpu = False
    rtx_gpu = False  # a GPU TensorRT-RTX engines run on (the lent H200, 9.0, is not one)
    if has_gpu and has_rtx:
        from diffusion_trt.trt_compat import LIBRARIES

        rtx_gpu = tuple(torch.cuda.get_device_capability(0)) in (LIBRARIES["tensorrt-rtx"].supported or ())
    for item in items:
        if "tensorrt_rtx_gpu" in item.keywords and not rtx_gpu:
            item.add_marker(pytest.mark.skip(
                reason="needs a GPU TensorRT-RTX supports (compute capability 7.5/8.0/8.6/8.9/12.x); none is lent here"
            ))
        if "tensorrt" in item.keywords and not has_trt:
            item.add_marker(pytest.mark.skip(reason="`import tensorrt` fails here: no TensorRT on this machine"))
        if "rtx_builder" in item.keywords and not has_rtx:
            item.add_marker(pytest.mark.skip(reason="tensorrt_rtx_bindings is not importable: pip install -e '.[rtx]'"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="no CUDA GPU on this machine"))


@pytest.fixture(autouse=True)
def _compile_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """`diffusion-trt compile` caches under a fresh folder per test: never ~/.cache, never a hit left by another test
    (tests/compiler/test_cache.py tests the hits)."""
    monkeypatch.setenv("DIFFUSION_TRT_CACHE", str(tmp_path_factory.mktemp("compile-cache")))


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `StableDiffusionPipeline` folder, tiny arch, seed 0 (a few MB)."""
    from diffusion_trt.compiler.dummy import write_dummy_pipeline

    return write_dummy_pipeline(tmp_path_factory.mktemp("models") / "tiny", arch="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_artifact(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline compiled for ONNX Runtime CPU, fp32, default profile (64x64, batch 1..4)."""
    from diffusion_trt.compiler.pipeline import compile_pipeline

    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("artifacts") / "tiny")


@pytest.fixture(scope="session")
def tiny_sd21_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `StableDiffusionPipeline` folder, tiny-sd21 arch (SD-2.1 structure: v-prediction DDIM, upcast attention)."""
    from diffusion_trt.compiler.dummy import write_dummy_pipeline

    return write_dummy_pipeline(tmp_path_factory.mktemp("models") / "tiny-sd21", arch="tiny-sd21", seed=0)


@pytest.fixture(scope="session")
def tiny_sdxl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `StableDiffusionXLPipeline` folder, tiny-sdxl arch (two text encoders, text_time conditioning)."""
    from diffusion_trt.compiler.dummy import write_dummy_pipeline

    return write_dummy_pipeline(tmp_path_factory.mktemp("models") / "tiny-sdxl", arch="tiny-sdxl", seed=0)


@pytest.fixture(scope="session")
def tiny_sd21_artifact(tiny_sd21_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sd21 compiled for ONNX Runtime CPU, fp32, default profile (64x64, batch 1..4)."""
    from diffusion_trt.compiler.pipeline import compile_pipeline

    return compile_pipeline(tiny_sd21_dir, tmp_path_factory.mktemp("artifacts") / "tiny-sd21")


@pytest.fixture(scope="session")
def tiny_sdxl_artifact(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-sdxl compiled for ONNX Runtime CPU, fp32, default profile (64x64, batch 1..4), every component's weights
    in external data (the > 2 GB path of the real SDXL's UNet and text_encoder_2, forced by a 1-byte threshold)."""
    from unittest import mock

    from diffusion_trt.compiler import build_ort
    from diffusion_trt.compiler.pipeline import compile_pipeline

    with mock.patch.object(build_ort, "EXTERNAL_DATA_THRESHOLD_BYTES", 1):
        return compile_pipeline(tiny_sdxl_dir, tmp_path_factory.mktemp("artifacts") / "tiny-sdxl")

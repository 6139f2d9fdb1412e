"""On a GPU TensorRT-RTX does not support (the lent H200, compute capability 9.0): a tensorrt-rtx plan is refused by
our one-line message, naming the compute capability and ``--backend ort --device cuda``, before the plan is
deserialised (no ``Runtime`` is even created).

Needs only torch, numpy and this package (and ``tensorrt_rtx_bindings`` for the ``real`` case, whose plan is built
here with the TensorRT-RTX builder for 8.9 through its network API: no onnx, no ONNX Runtime, no diffusers). Skips
without a CUDA GPU, and on a GPU TensorRT-RTX supports (there the refusal does not apply).

    pytest -p no:cacheprovider tests/test_trt_rtx_gpu.py -v
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from diffusion_trt import trt_compat
from diffusion_trt.errors import ArtifactError
from diffusion_trt.runtime.engines.trt_engine import TrtEngine

#: y[B,4] = x + x; the manifest entry of a component with that I/O
ENTRY: dict[str, Any] = {
    "inputs": [{"name": "x", "dtype": "float32", "shape": ["B", 4], "min": [1, 4], "opt": [2, 4], "max": [4, 4]}],
    "outputs": [{"name": "y", "dtype": "float32", "shape": ["B", 4], "min": [1, 4], "opt": [2, 4], "max": [4, 4]}],
}


def _real_plan(path: Path) -> str:
    """A real TensorRT-RTX plan for compute capability 8.9; returns the library's version."""
    trt = pytest.importorskip("tensorrt_rtx_bindings")
    logger = trt_compat.make_trt_logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    x = network.add_input("x", trt.float32, (-1, 4))
    y = network.add_elementwise(x, x, trt.ElementWiseOperation.SUM).get_output(0)
    y.name = "y"
    network.mark_output(y)
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 4), (2, 4), (4, 4))
    config.add_optimization_profile(profile)
    config.num_compute_capabilities = 1
    config.set_compute_capability(trt.ComputeCapability.SM89, 0)
    plan = builder.build_serialized_network(network, config)
    assert plan is not None, logger.errors
    path.write_bytes(bytes(memoryview(plan)))
    return str(trt.__version__)


@pytest.mark.gpu
@pytest.mark.parametrize("plan_kind", ["garbage", "real"])
def test_tensorrt_rtx_plan_is_refused_on_an_unsupported_gpu_before_deserialising(
    tmp_path: Path, plan_kind: str
) -> None:
    cc = torch.cuda.get_device_capability(0)
    rtx = trt_compat.library("tensorrt-rtx")
    if cc in (rtx.supported or ()):
        pytest.skip(f"this GPU (compute capability {cc[0]}.{cc[1]}) is one TensorRT-RTX supports")
    plan = tmp_path / "unet" / "model.plan"
    plan.parent.mkdir()
    if plan_kind == "real":
        version = _real_plan(plan)
    else:
        version = "1.7.1.116"
        plan.write_bytes(b"garbage, not a plan: deserialising it would fail with TensorRT's own message")
    build = {"engine": "tensorrt-rtx", "library": "tensorrt-rtx", "tensorrt": version,
             "compute_capabilities": ["8.9"], "compute_capability": None, "gpu": None,
             "profiles": [{"kind": "dynamic", "inputs": {"x": {"min": [1, 4], "opt": [2, 4], "max": [4, 4]}}}],
             "runtime_cache": "unet.runtime-cache"}
    engine = TrtEngine(plan, {**ENTRY, "build": build}, name="unet", backend="tensorrt-rtx",
                       runtime_cache=tmp_path / "rc" / "unet.runtime-cache")
    with pytest.raises(ArtifactError) as e:
        engine.__enter__()
    msg = str(e.value)
    name = torch.cuda.get_device_name(0)
    assert msg.startswith(f"engine 'unet' ({plan}) needs TensorRT-RTX, which does not support this GPU of compute "
                          f"capability {cc[0]}.{cc[1]} ({name})"), msg
    assert "--backend ort --device cuda" in msg and "\n" not in msg
    assert engine._runtime is None and not engine.is_open  # no Runtime created: nothing was deserialised
    assert not (tmp_path / "rc").exists()
    if plan_kind == "real":  # and the library agrees that its plan cannot run on this GPU
        import tensorrt_rtx_bindings as trt

        runtime = trt.Runtime(trt_compat.make_trt_logger(trt))
        validity, _ = runtime.get_engine_validity(plan.read_bytes())
        assert validity != trt.EngineValidity.VALID

"""TrtEngine: compatibility checks, plan verification, profile selection, shared activation memory.

Above the ``tensorrt`` marker: pure parts, run on any machine (the runtime's rules over manifest facts, bytes
and shapes). Below it: real engines built with TensorRT and compared with the ONNX Runtime CPU engine; they
skip where ``import tensorrt`` fails or there is no GPU.
"""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import helper

from diffusion_trt import trt_compat
from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.folder import sha256_file
from diffusion_trt.compiler.build_trt import TrtBuildConfig, profiles_from_inputs
from diffusion_trt.compiler.components import component_specs, tensor_manifest
from diffusion_trt.config import Range, ShapeProfile
from diffusion_trt.errors import ArtifactError, RuntimeInputError
from diffusion_trt.runtime.engines.engine import Engine, EngineSpec
from diffusion_trt.runtime.engines.trt_engine import (
    RuntimeProfile,
    SharedActivationMemory,
    TrtEngine,
    check_engine_io,
    profiles_from_build,
    select_profile,
    verify_plan,
)
from diffusion_trt.trt_compat import TrtHost, check_plan_compat
from tests.graphs import const, make_model, tensor_info

SPECS = component_specs(text_hidden=32, text_len=77, unet_in=4, unet_out=4, latent=4)
PROFILE = ShapeProfile(batch=Range(1, 1, 4), height=Range(32, 64, 128), width=Range(32, 64, 128))
UNET_ENTRY: dict[str, Any] = {
    "inputs": [tensor_manifest(t, "fp32", PROFILE) for t in SPECS["unet"].inputs],
    "outputs": [tensor_manifest(t, "fp32", PROFILE) for t in SPECS["unet"].outputs],
}
BUILD: dict[str, Any] = {
    "tensorrt": "10.8.0.43",
    "compute_capability": "9.0",
    "gpu": "NVIDIA H100 80GB HBM3",
    "profiles": [p.to_json() for p in profiles_from_inputs(UNET_ENTRY["inputs"], TrtBuildConfig())],
}
WHERE = "engine 'unet' (unet/model.plan)"


def unet_shapes(b: int, h: int, w: int) -> dict[str, tuple[int, ...]]:
    return {"sample": (b, 4, h, w), "timestep": (b,), "encoder_hidden_states": (b, 77, 32)}


# --- compatibility before deserialising -----------------------------------------------------------------


def test_same_release_and_architecture_loads() -> None:
    assert check_plan_compat(BUILD, TrtHost("10.8.0.43", "9.0", "NVIDIA H100 80GB HBM3"), WHERE) == []


def test_wrong_tensorrt_version_names_both() -> None:
    with pytest.raises(ArtifactError) as e:
        check_plan_compat(BUILD, TrtHost("10.9.0.34", "9.0", "NVIDIA H100 80GB HBM3"), WHERE)
    msg = str(e.value)
    assert WHERE in msg and "TensorRT 10.8.0.43" in msg and "TensorRT 10.9.0.34" in msg
    assert "tensorrt==10.8.0.43" in msg and "recompile" in msg


def test_wrong_compute_capability_names_both() -> None:
    with pytest.raises(ArtifactError) as e:
        check_plan_compat(BUILD, TrtHost("10.8.0.43", "8.9", "NVIDIA L40S"), WHERE)
    msg = str(e.value)
    assert "compute capability 9.0 (NVIDIA H100 80GB HBM3)" in msg and "8.9 (NVIDIA L40S)" in msg
    assert "recompile the artifact on this GPU" in msg


def test_other_build_number_or_gpu_model_only_warns(caplog: pytest.LogCaptureFixture) -> None:
    warnings = check_plan_compat(BUILD, TrtHost("10.8.0.40", "9.0", "NVIDIA H200"), WHERE)
    assert len(warnings) == 2
    assert "10.8.0.40" in warnings[0] and "same release" in warnings[0]
    assert "NVIDIA H100 80GB HBM3" in warnings[1] and "NVIDIA H200" in warnings[1]
    assert "NVIDIA H200" in caplog.text


def test_missing_build_facts_are_an_artifact_error() -> None:
    with pytest.raises(ArtifactError, match=r"lack 'tensorrt' or 'compute_capability'.*recompile"):
        check_plan_compat({"gpu": "x"}, TrtHost("10.8.0.43", "9.0"), WHERE)


def test_tampered_plan_fails_verification_with_expected_and_found(tmp_path: Path) -> None:
    plan = tmp_path / "model.plan"
    plan.write_bytes(bytes(range(256)) * 4)
    build = {"plan_sha256": sha256_file(plan), "plan_bytes": plan.stat().st_size}
    verify_plan(plan, build, "unet")
    data = bytearray(plan.read_bytes())
    data[100] ^= 0xFF
    plan.write_bytes(bytes(data))
    with pytest.raises(ArtifactError) as e:
        verify_plan(plan, build, "unet")
    msg = str(e.value)
    assert "engine 'unet'" in msg and "model.plan: sha256" in msg
    assert f"{sha256_file(plan)[:12]}… != {build['plan_sha256'][:12]}…" in msg  # found != expected
    with pytest.raises(ArtifactError, match="records no plan_sha256"):
        verify_plan(plan, {}, "unet")


def test_plan_io_must_match_the_manifest() -> None:
    spec = EngineSpec.from_manifest("unet", UNET_ENTRY)
    io = {
        "sample": ("INPUT", "FLOAT"),
        "timestep": ("INPUT", "FLOAT"),
        "encoder_hidden_states": ("INPUT", "FLOAT"),
        "noise_pred": ("OUTPUT", "FLOAT"),
    }
    check_engine_io("unet", io, spec)
    with pytest.raises(ArtifactError, match=r"the plan's outputs \{'noise_pred': 'float16'\}.*'float32'"):
        check_engine_io("unet", {**io, "noise_pred": ("OUTPUT", "HALF")}, spec)
    with pytest.raises(ArtifactError, match="the plan's inputs"):
        check_engine_io("unet", {k: v for k, v in io.items() if k != "timestep"}, spec)


# --- profiles ------------------------------------------------------------------------------------------


def test_manifest_profiles_parse_in_build_order() -> None:
    dynamic, static = profiles_from_build(BUILD)
    assert (dynamic.index, dynamic.kind, static.index, static.kind) == (0, "dynamic", 1, "static")
    assert dynamic.shapes["sample"] == ((1, 4, 4, 4), (2, 4, 8, 8), (8, 4, 16, 16))
    with pytest.raises(ArtifactError, match="no readable 'profiles'"):
        profiles_from_build({})


def test_the_static_fast_path_wins_at_the_opt_shape() -> None:
    profiles = profiles_from_build(BUILD)
    assert select_profile(profiles, unet_shapes(2, 8, 8), "unet") == 1  # CFG batch of one 64x64 image
    assert select_profile(profiles, unet_shapes(1, 8, 8), "unet") == 0  # no CFG: the dynamic profile
    assert select_profile(profiles, unet_shapes(8, 16, 12), "unet") == 0


def test_narrowest_profile_is_chosen_whatever_the_order() -> None:
    wide = RuntimeProfile(0, "dynamic", {"x": ((1, 4), (2, 4), (64, 4))})
    narrow = RuntimeProfile(1, "extra", {"x": ((1, 4), (2, 4), (8, 4))})
    assert select_profile([wide, narrow], {"x": (4, 4)}, "e") == 1
    assert select_profile([wide, narrow], {"x": (9, 4)}, "e") == 0


def test_shapes_outside_every_profile_name_tensor_shape_and_ranges() -> None:
    with pytest.raises(RuntimeInputError) as e:
        select_profile(profiles_from_build(BUILD), unet_shapes(2, 20, 8), "unet")
    msg = str(e.value)
    assert "engine 'unet'" in msg and "'sample': '(2, 4, 20, 8)'" in msg
    assert "profile 0 (dynamic): input 'sample' (2, 4, 20, 8) not in (1, 4, 4, 4)..(8, 4, 16, 16)" in msg
    assert "profile 1 (static): input 'sample' (2, 4, 20, 8) not in (2, 4, 8, 8)..(2, 4, 8, 8)" in msg
    assert "recompile with a wider one" in msg


# --- shared activation memory ---------------------------------------------------------------------------


def test_shared_memory_grows_to_the_largest_and_never_shrinks() -> None:
    mem = SharedActivationMemory("cpu")
    assert (mem.nbytes, mem.ptr, mem.generation) == (0, 0, 0)
    assert mem.reserve(10) is True and mem.nbytes == 512  # never less than TensorRT's alignment block
    assert mem.reserve(4096) is True and (mem.nbytes, mem.generation) == (4096, 2)
    ptr = mem.ptr
    assert mem.reserve(1000) is False and (mem.nbytes, mem.ptr, mem.generation) == (4096, ptr, 2)
    mem.release()
    assert (mem.nbytes, mem.generation) == (0, 3)


# --- the engine object without TensorRT -----------------------------------------------------------------


def test_engine_is_cheap_to_construct_and_follows_the_protocol(tmp_path: Path) -> None:
    engine = TrtEngine(tmp_path / "unet" / "model.plan", {**UNET_ENTRY, "build": BUILD})
    assert isinstance(engine, Engine)
    assert (engine.name, engine.device, engine.is_open) == ("unet", torch.device("cuda", 0), False)
    assert engine.input_names == ("sample", "timestep", "encoder_hidden_states")
    with pytest.raises(RuntimeError, match="not open"):
        engine.run({})


def test_inputs_are_validated_against_the_manifest_before_any_gpu_work(tmp_path: Path) -> None:
    engine = TrtEngine(tmp_path / "model.plan", UNET_ENTRY, name="unet", build=BUILD)
    feeds = {
        "sample": torch.zeros(2, 4, 8, 8),
        "timestep": torch.zeros(2),
        "encoder_hidden_states": torch.zeros(2, 77, 32),
    }
    with pytest.raises(RuntimeInputError, match="'sample' is on cpu; the engine runs on cuda:0"):
        engine.validate(feeds)


def test_opening_without_cuda_says_so(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(ArtifactError, match="run on CUDA and torch sees no CUDA device"):
        TrtEngine(tmp_path / "model.plan", UNET_ENTRY, name="unet", build=BUILD).__enter__()


def test_pipeline_refuses_a_tensorrt_artifact_on_cpu(toy_artifact: Path, tmp_path: Path) -> None:
    from diffusion_trt.runtime import EnginePipeline

    art = tmp_path / "art"
    shutil.copytree(toy_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest.update(backend="tensorrt", device="cuda")
    for name, entry in manifest["components"].items():
        entry["plan"], entry["build"] = f"{name}/model.plan", BUILD
        (art / entry["plan"]).write_bytes(b"not a plan: never deserialised here")
        manifest["files"][entry["plan"]] = artifacts.file_entry(art, entry["plan"])
    artifacts.write_manifest(art, manifest)
    with pytest.raises(ArtifactError, match="backend='tensorrt', whose engines run on CUDA only"):
        EnginePipeline.from_artifacts(art, device="cpu", verify=False)
    if not torch.cuda.is_available():
        with pytest.raises(ArtifactError, match="torch sees no CUDA device"):
            EnginePipeline.from_artifacts(art, verify=False)


# --- with TensorRT and a GPU ----------------------------------------------------------------------------

#: unet-shaped toy: x [B2,4,h,w], t [B2] -> y = x * 2 + t
ADD_ENTRY: dict[str, Any] = {
    "inputs": [
        {
            "name": "x",
            "dtype": "float32",
            "shape": ["B2", 4, "h", "w"],
            "min": [1, 4, 4, 4],
            "opt": [2, 4, 8, 8],
            "max": [4, 4, 16, 16],
        },
        {"name": "t", "dtype": "float32", "shape": ["B2"], "min": [1], "opt": [2], "max": [4]},
    ],
    "outputs": [
        {
            "name": "y",
            "dtype": "float32",
            "shape": ["B2", 4, "h", "w"],
            "min": [1, 4, 4, 4],
            "opt": [2, 4, 8, 8],
            "max": [4, 4, 16, 16],
        },
    ],
}


def _add_model() -> onnx.ModelProto:
    return make_model(
        [
            helper.make_node("Mul", ["x", "two"], ["x2"]),
            helper.make_node("Reshape", ["t", "shape4"], ["t4"]),
            helper.make_node("Add", ["x2", "t4"], ["y"]),
        ],
        [tensor_info("x", ["B2", 4, "h", "w"]), tensor_info("t", ["B2"])],
        [tensor_info("y", ["B2", 4, "h", "w"])],
        [const("two", 2.0), const("shape4", [-1, 1, 1, 1], np.int64)],
    )


@pytest.fixture(scope="module")
def add_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The toy graph as ONNX and as a TensorRT plan; returns (folder, manifest entry with build facts)."""
    from diffusion_trt.compiler.build_trt import engine_from_onnx

    root = tmp_path_factory.mktemp("trt_add")
    onnx.save_model(_add_model(), str(root / "model.onnx"))
    build = engine_from_onnx(
        root / "model.onnx",
        root / "model.plan",
        ADD_ENTRY["inputs"],
        precision="fp32",
        build=TrtBuildConfig(),
        timing_cache_dir=None,
    )
    return root, {**ADD_ENTRY, "build": build}


def _feeds(b: int, h: int, w: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(b, 4, h, w, generator=g).to(device), "t": torch.arange(b, dtype=torch.float32).to(device)}


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_parity_with_the_ort_cpu_engine_through_warmup_capture_replay_and_shape_change(
    add_plan: tuple[Path, dict[str, Any]],
) -> None:
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine

    root, entry = add_plan
    with (
        OrtEngine(root / "model.onnx", entry, name="unet") as ort_engine,
        TrtEngine(root / "model.plan", entry, name="unet") as trt_engine,
    ):
        assert [p.kind for p in trt_engine.profiles] == ["dynamic", "static"]
        # (2,8,8) = the static profile: warm-up, capture, replay; then other shapes on the dynamic profile
        for seed, (b, h, w) in enumerate([(2, 8, 8), (2, 8, 8), (2, 8, 8), (3, 8, 12), (3, 8, 12), (2, 8, 8)]):
            cpu = _feeds(b, h, w, "cpu", seed)
            want = ort_engine.run(cpu)["y"]
            got = trt_engine.run({k: v.cuda() for k, v in cpu.items()})["y"]
            torch.cuda.synchronize()
            np.testing.assert_allclose(got.cpu().numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_inputs_outside_the_profile_are_refused(add_plan: tuple[Path, dict[str, Any]]) -> None:
    root, entry = add_plan
    with TrtEngine(root / "model.plan", entry, name="unet") as engine:
        with pytest.raises(RuntimeInputError, match=r"input 'x' has shape \(2, 4, 32, 8\).*4\.\.16"):
            engine.run(_feeds(2, 32, 8, "cuda"))


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_engines_share_one_activation_allocation(add_plan: tuple[Path, dict[str, Any]]) -> None:
    root, entry = add_plan
    shared = SharedActivationMemory(torch.device("cuda", 0))
    with (
        TrtEngine(root / "model.plan", entry, name="a", shared_memory=shared) as a,
        TrtEngine(root / "model.plan", entry, name="b", shared_memory=shared) as b,
    ):
        assert shared.nbytes >= 512
        f = _feeds(2, 8, 8, "cuda")
        ya = a.run(f)["y"].clone()
        yb = b.run(f)["y"]
        torch.cuda.synchronize()
        assert torch.equal(ya, yb)


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_wrong_version_in_the_manifest_fails_before_deserialising(
    add_plan: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    root, entry = add_plan
    bad = {**entry, "build": {**entry["build"], "tensorrt": "9.0.0.1"}}
    with pytest.raises(ArtifactError, match=r"TensorRT 9\.0\.0\.1 but this machine has TensorRT"):
        TrtEngine(root / "model.plan", bad, name="unet").__enter__()
    tampered = tmp_path / "model.plan"
    data = bytearray((root / "model.plan").read_bytes())
    data[len(data) // 2] ^= 0xFF
    tampered.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="failed verification"):
        TrtEngine(tampered, entry, name="unet").__enter__()


@pytest.mark.gpu
@pytest.mark.tensorrt
@pytest.mark.slow
def test_tiny_pipeline_on_tensorrt_matches_ort_cpu(
    tiny_pipeline_dir: Path, tiny_artifact: Path, tmp_path: Path
) -> None:
    """Whole pipeline: compile with --backend tensorrt, generate, compare with the ORT CPU artifact."""
    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig
    from diffusion_trt.runtime import EnginePipeline

    trt_art = compile_pipeline(tiny_pipeline_dir, tmp_path / "trt", CompileConfig(backend="tensorrt", device="cuda"))
    manifest = json.loads((trt_art / "manifest.json").read_text())
    assert manifest["backend"] == "tensorrt"
    for entry in manifest["components"].values():
        assert entry["build"]["compute_capability"] == ".".join(map(str, torch.cuda.get_device_capability()))
    kwargs = {"num_inference_steps": 4, "seed": 0, "output_type": "np", "progress": False}
    with EnginePipeline.from_artifacts(tiny_artifact, device="cpu") as ort_pipe:
        want = ort_pipe("a photo of a cat", **kwargs).images
    with EnginePipeline.from_artifacts(trt_art) as trt_pipe:
        got = trt_pipe("a photo of a cat", **kwargs).images
        again = trt_pipe("a photo of a cat", **kwargs).images  # CUDA graphs replayed
    # TensorRT runs fp32 convolutions/matmuls in TF32 by default (10-bit mantissa): close, not equal
    diff = np.abs(got - want)
    assert diff.max() < 2e-2 and diff.mean() < 2e-3, (diff.max(), diff.mean())
    np.testing.assert_array_equal(got, again)


def _imports(tree: ast.AST) -> set[str]:
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def test_trt_compat_imports_neither_tensorrt_nor_the_compiler() -> None:
    tree = ast.parse(Path(trt_compat.__file__).read_text(encoding="utf-8"))
    assert not any(m.split(".")[0] == "tensorrt" or "compiler" in m for m in _imports(tree))


def test_tensorrt_is_imported_lazily() -> None:
    """Only when a build or engine needs it (through ``trt_compat.TrtLibrary.import_module``): importing the modules
    works on machines without TensorRT and loads neither library."""
    import subprocess
    import sys

    import diffusion_trt.compiler.build_trt as build_trt
    import diffusion_trt.runtime.engines.trt_engine as trt_engine

    for module in (build_trt, trt_engine, trt_compat):
        tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
        top = {m for stmt in tree.body if isinstance(stmt, ast.Import | ast.ImportFrom) for m in _imports(stmt)}
        assert not any(m.split(".")[0] in ("tensorrt", "tensorrt_rtx_bindings") for m in top), module.__name__
    code = ("import sys, diffusion_trt.compiler.build_trt, diffusion_trt.runtime.engines.trt_engine; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'tensorrt_rtx_bindings')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"

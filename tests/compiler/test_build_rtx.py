"""The TensorRT-RTX build stage with NVIDIA's real builder (``tensorrt_rtx_bindings``), on a machine without a GPU.

Every test marked ``rtx_builder`` parses and (where it says so) builds real plans: TensorRT-RTX compiles ahead of
time for named compute capabilities, so no GPU is needed. Executing a plan needs a GPU TensorRT-RTX supports
(7.5/8.0/8.6/8.9/12.x); none is lent here, so nothing in this file runs one.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from diffusion_trt import trt_compat
from diffusion_trt.artifact.facts import BuildFacts
from diffusion_trt.artifact.folder import sha256_file
from diffusion_trt.cli import main
from diffusion_trt.compiler import build_trt
from diffusion_trt.compiler.build_trt import TrtBuildConfig
from diffusion_trt.config import CompileConfig
from diffusion_trt.errors import BuildError, RuntimeInputError
from tests.graphs import make_model, tensor_info

pytestmark = pytest.mark.rtx_builder

RTX = "tensorrt-rtx"


def _entry(name: str, shape: list[Any], lo: list[int], opt: list[int], hi: list[int]) -> dict[str, Any]:
    return {"name": name, "dtype": "float32", "shape": shape, "min": lo, "opt": opt, "max": hi}


def _relu_model(path: Path) -> list[dict[str, Any]]:
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", ["B", 4])],
                       [tensor_info("y", ["B", 4])])
    onnx.save_model(model, str(path))
    return [_entry("x", ["B", 4], [1, 4], [2, 4], [8, 4])]


def _build(tmp_path: Path, inputs: list[dict[str, Any]], **config: Any) -> dict[str, Any]:
    return build_trt.engine_from_onnx(tmp_path / "model.onnx", tmp_path / "unet" / "model.plan", inputs,
                                      precision=config.pop("precision", "fp32"),
                                      build=TrtBuildConfig(library=RTX, **config), timing_cache_dir=tmp_path / "tc")


def test_builds_a_plan_without_a_gpu_for_the_named_targets(tmp_path: Path) -> None:
    facts = _build(tmp_path, _relu_model(tmp_path / "model.onnx"), compute_capabilities=("8.6", "8.9"))
    import tensorrt_rtx_bindings as trt

    plan = tmp_path / "unet" / "model.plan"
    assert facts["engine"] == facts["library"] == RTX and facts["tensorrt"] == trt.__version__
    assert facts["compute_capabilities"] == ["8.6", "8.9"] and facts["compute_capability"] is None
    assert facts["strongly_typed"] is True and facts["flags"] == []
    assert facts["plan_sha256"] == sha256_file(plan) and facts["plan_bytes"] == plan.stat().st_size > 0
    assert [p["kind"] for p in facts["profiles"]] == ["dynamic", "static"]
    assert facts["runtime_cache"] == "unet.runtime-cache" and facts["num_layers"] >= 1
    assert facts["timing_cache"]["file"] is None and not (tmp_path / "tc").exists()  # RTX times no kernels
    json.dumps(facts)  # goes into manifest.json as is
    assert BuildFacts.from_json(facts).to_json() == facts  # the typed facts, key for key


def test_default_targets_are_the_portable_set(tmp_path: Path) -> None:
    facts = _build(tmp_path, _relu_model(tmp_path / "model.onnx"))
    assert facts["compute_capabilities"] == ["8.0", "8.6", "8.9", "12.0"]


def test_parser_errors_name_the_node_and_op(tmp_path: Path) -> None:
    """A standard-domain op the parser refuses (TopK's k must be a constant initializer or shape input here: a
    graph input is refused by TensorRT's parser) comes back as one line per node."""
    model = make_model(
        [helper.make_node("Relu", ["x"], ["r"], name="ok_relu"),
         helper.make_node("Upsample", ["r", "scales"], ["y"], name="the_bad_node", mode="bogus")],
        [tensor_info("x", [1, 4]), tensor_info("scales", [2])], [tensor_info("y", [1, 4], TensorProto.FLOAT)],
        opset=9, check=False,
    )
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    with pytest.raises(BuildError) as e:
        _build(tmp_path, [_entry("x", [1, 4], [1, 4], [1, 4], [1, 4]), _entry("scales", [2], [2], [2], [2])])
    assert "node 1 'the_bad_node' (Upsample)" in str(e.value)
    assert "run the tensorrt pass pipeline" in str(e.value)
    assert not (tmp_path / "unet" / "model.plan").exists()


@pytest.mark.parametrize("op", ["QuickGelu", "MultiHeadAttention"])
def test_contrib_ops_are_refused_before_the_parser_sees_them(tmp_path: Path, op: str) -> None:
    """TensorRT's ONNX parser maps no com.microsoft op, and RTX 1.7.1's crashes the process on MultiHeadAttention:
    the build stage refuses such a graph itself, naming the op."""
    model = make_model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node(op, ["r"], ["y"], domain="com.microsoft")],
        [tensor_info("x", [1, 4])], [tensor_info("y", [1, 4], TensorProto.FLOAT)],
        extra_opsets=[("com.microsoft", 1)], check=False,
    )
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    refused = rf"outside the default ONNX domain.*com\.microsoft\.{op} x1.*--target tensorrt"
    with pytest.raises(BuildError, match=refused):
        _build(tmp_path, [_entry("x", [1, 4], [1, 4], [1, 4], [1, 4])])
    assert not (tmp_path / "unet" / "model.plan").exists()


def test_profile_min_above_max_is_refused_before_parsing(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"min \(4, 4\) <= opt \(2, 4\) <= max \(8, 4\) does not hold"):
        _build(tmp_path, [_entry("x", ["B", 4], [4, 4], [2, 4], [8, 4])])  # model.onnx never written: not read


def test_a_compute_capability_tensorrt_rtx_lacks_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeInputError, match=r"--compute-capability 9\.0: TensorRT-RTX cannot build for it"):
        _build(tmp_path, [], compute_capabilities=("9.0",))


def test_fp8_for_an_ampere_target_is_refused_before_parsing(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"fp8 needs a GPU of compute capability >= 8\.9 .* 8\.6"):
        _build(tmp_path, [], precision="fp8", compute_capabilities=("8.6",))


def test_current_without_a_gpu_names_the_fix() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: 'current' resolves")
    with pytest.raises(BuildError, match=r"current needs a CUDA GPU .* --compute-capability 8\.6,8\.9,12\.0"):
        build_trt.build_target("fp16", TrtBuildConfig(library=RTX, compute_capabilities=("current",)))


def test_one_library_table_decides_the_differences() -> None:
    full, rtx = trt_compat.library("tensorrt"), trt_compat.library(RTX)
    assert (full.precision_flags, rtx.precision_flags) == (True, False)
    assert (full.compute_capability_targets, rtx.compute_capability_targets) == (False, True)
    assert (full.runtime_config, rtx.runtime_config) == (False, True)
    assert rtx.import_module().__name__ == "tensorrt_rtx_bindings"


# --- through Polygraphy's loaders -------------------------------------------------------------------------


def test_the_build_runs_through_polygraphy_bound_to_tensorrt_rtx(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                                 capfd: pytest.CaptureFixture[str]) -> None:
    """Polygraphy's CreateConfigRTX names the targets and its EngineBytesFromNetwork builds; its TensorRT logger is
    the library's one, and it writes nothing to stdout (its messages go to Python logging)."""
    import tensorrt_rtx_bindings as trt

    with caplog.at_level(logging.INFO, logger="Polygraphy"):
        facts = _build(tmp_path, _relu_model(tmp_path / "model.onnx"), compute_capabilities=("8.6", "8.9"))
    from polygraphy import config as polygraphy_config  # imported after the build stage bound it
    from polygraphy.backend.trt import util as polygraphy_trt_util

    said = [r.getMessage() for r in caplog.records if r.name == "Polygraphy"]
    assert any("Setting 2 target compute capabilities: [(8, 6), (8, 9)]" in m for m in said), said
    assert any(m.startswith("Building engine with configuration") for m in said), said
    assert facts["plan_bytes"] > 0 and capfd.readouterr().out == ""
    assert polygraphy_config.USE_TENSORRT_RTX is True and sys.modules["tensorrt_rtx"] is trt
    assert polygraphy_trt_util.get_trt_logger() is trt_compat.make_trt_logger(trt)


def test_polygraphy_config_keeps_our_settings_and_tensorrts_defaults(tmp_path: Path) -> None:
    """config_for hands the workspace, optimization level, targets and profiles to CreateConfigRTX; the profiling
    verbosity stays TensorRT's (Polygraphy's own default would be DETAILED)."""
    build = TrtBuildConfig(library=RTX, compute_capabilities=("8.0", "12.0"), workspace_bytes=1 << 28,
                           builder_optimization_level=2)
    target = build_trt.build_target("fp32", build)
    trt, _ = build_trt.polygraphy_for(target.library)
    inputs = _relu_model(tmp_path / "model.onnx")
    builder, network, _parser = build_trt.network_from_onnx(trt, tmp_path / "model.onnx", strongly_typed=False)
    profiles = build_trt.profiles_from_inputs(inputs, build)
    config, flags = build_trt.config_for(trt, builder, network, target, build, "fp16", True, profiles)
    assert flags == [] and config.num_optimization_profiles == len(profiles) == 2
    assert config.get_memory_pool_limit(trt.MemoryPoolType.WORKSPACE) == 1 << 28
    assert config.builder_optimization_level == 2
    assert config.profiling_verbosity == trt.ProfilingVerbosity.LAYER_NAMES_ONLY
    assert [config.get_compute_capability(i) for i in range(config.num_compute_capabilities)] == [
        trt.ComputeCapability.SM80, trt.ComputeCapability.SM120]


def test_polygraphy_bound_to_tensorrt_rtx_refuses_full_tensorrt_in_the_same_process() -> None:
    build_trt.polygraphy_for(trt_compat.library(RTX))
    with pytest.raises(BuildError, match=r"Polygraphy is bound to TensorRT-RTX in this process .* another process"):
        build_trt.polygraphy_for(trt_compat.library("tensorrt"))


def test_without_polygraphy_the_build_names_the_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "polygraphy", None)  # `import polygraphy` raises ImportError
    with pytest.raises(BuildError, match=r"`import polygraphy` failed .*pip install 'polygraphy>=0\.53\.6'"):
        _build(tmp_path, _relu_model(tmp_path / "model.onnx"), compute_capabilities=("8.9",))
    assert not (tmp_path / "unet" / "model.plan").exists()


# --- compile, end to end on the tiny pipeline -----------------------------------------------------------


def _compile(*args: Any) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["compile", *map(str, args)])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def rtx_artifact(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline compiled for TensorRT-RTX, fp16, static 64x64 batch 1, for SM 8.9 (small and quick)."""
    out = tmp_path_factory.mktemp("rtx") / "tiny-rtx"
    code, text = _compile(tiny_pipeline_dir, "-o", out, "--backend", RTX, "--precision", "fp16",
                          "--compute-capability", "8.9", "--min-height", 64, "--max-height", 64, "--min-width", 64,
                          "--max-width", 64, "--max-batch-size", 1)
    assert code == 0, text
    return out


def test_compile_writes_one_plan_per_component_and_the_manifest_records_the_targets(rtx_artifact: Path) -> None:
    manifest = json.loads((rtx_artifact / "manifest.json").read_text())
    assert manifest["backend"] == RTX and manifest["device"] == "cuda"
    assert set(manifest["components"]) == {"text_encoder", "unet", "vae_decoder", "vae_encoder"}
    for name, entry in manifest["components"].items():
        build = entry["build"]
        assert entry["plan"] == f"{name}/model.plan" and (rtx_artifact / entry["plan"]).stat().st_size > 0
        assert build["library"] == RTX and build["compute_capabilities"] == ["8.9"]
        assert build["runtime_cache"] == f"{name}.runtime-cache" and build["num_layers"] > 0
        assert [p["kind"] for p in build["profiles"]] == ["dynamic"]  # a static compile profile: one profile
        plan = entry["compile_plan"]
        assert plan["engine"] == RTX and plan["passes"] == {"backend": "tensorrt", "precision": "fp16"}
        assert plan["strongly_typed"] is True and plan["export_dtype"] == "fp32"
        graph = onnx.load(str(rtx_artifact / entry["onnx"]), load_external_data=False).graph
        assert {n.domain for n in graph.node} <= {"", "ai.onnx"}, name  # only ops TensorRT's parser maps
    assert manifest["tools"]["tensorrt-rtx-cu13-bindings"] == manifest["components"]["unet"]["build"]["tensorrt"]


def test_verify_and_inspect_read_an_rtx_artifact(rtx_artifact: Path) -> None:
    result = CliRunner().invoke(main, ["inspect", str(rtx_artifact)])
    assert result.exit_code == 0 and "tensorrt-rtx on cuda, fp16" in result.output
    assert "compute_capabilities=['8.9']" in result.output


@pytest.mark.parametrize(
    ("args", "pieces"),
    [
        (["--compute-capability", "9.0"], ["--compute-capability 9.0: TensorRT-RTX cannot build for it",
                                           "--backend ort --device cuda"]),
        (["--compute-capability", "sm_8x"], ["'sm_8x' is not a compute capability", "write e.g. 8.9"]),
        (["--precision", "fp8", "--compute-capability", "8.6,8.9"], ["--precision fp8 needs every target", "8.6",
                                                                     "--compute-capability 8.9,12.0"]),
        (["--precision", "int8"], ["--precision int8 with --backend tensorrt-rtx", "--precision fp8"]),
        (["--min-height", "128", "--max-height", "64"], ["--min-height 128 is larger than --max-height 64",
                                                         "swap them"]),
        (["--refittable"], ["--refittable with --backend tensorrt-rtx", "--lora FILE[:SCALE]"]),
    ],
    ids=["cc-unsupported", "cc-malformed", "fp8-on-ampere", "int8", "min-above-max", "refittable"],
)
def test_bad_input_is_one_error_line_exit_2_and_nothing_written(tiny_pipeline_dir: Path, tmp_path: Path,
                                                                 args: list[str], pieces: list[str]) -> None:
    code, out = _compile(tiny_pipeline_dir, "-o", tmp_path / "art", "--backend", RTX, *args)
    assert code == 2, out
    assert [line for line in out.splitlines() if line.startswith("error:")] == [out.strip().splitlines()[-1]]
    for piece in pieces:
        assert piece in out
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.staging*"))


def test_compute_capability_with_another_backend_is_refused(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    code, out = _compile(tiny_pipeline_dir, "-o", tmp_path / "art", "--compute-capability", "8.9")
    assert code == 2 and "--compute-capability 8.9 are TensorRT-RTX build targets, but --backend ort" in out
    assert "use --backend tensorrt-rtx, or no --compute-capability" in out


def test_a_graph_the_parser_cannot_map_fails_the_build_stage_and_leaves_no_artifact(
        tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """The ORT-CUDA passes emit com.microsoft ops (the ORT target's QuickGelu...): the RTX parser refuses them, the
    compile fails at the build stage naming the node and op (exit 1), and no half-written artifact stays."""
    from diffusion_trt.compiler.pipeline import compile_pipeline

    config = CompileConfig(backend=RTX, device="cuda", precision="fp32", components=("text_encoder",),
                           compute_capabilities=("8.9",), height=64, min_height=64, max_height=64, width=64,
                           min_width=64, max_width=64, max_batch_size=1)
    import diffusion_trt.compiler.plan as plan_module

    real = plan_module.plan_components

    def ort_passes(*a: Any, **k: Any) -> Any:  # the ORT-CUDA pass pipeline in front of the RTX builder
        import dataclasses

        return {n: dataclasses.replace(p, pass_backend="ort") for n, p in real(*a, **k).items()}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("diffusion_trt.compiler.pipeline.plan_components", ort_passes)
        with pytest.raises(BuildError) as e:
            compile_pipeline(tiny_pipeline_dir, tmp_path / "art", config)
    text = str(e.value)
    assert "compile failed at build of text_encoder" in text and "com.microsoft.QuickGelu x" in text
    assert not (tmp_path / "art").exists() and not list(tmp_path.glob(".art.staging*"))


def test_unknown_component_is_bad_input(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    code, out = _compile(tiny_pipeline_dir, "-o", tmp_path / "art", "--components", "unet,vea_decoder")
    assert code == 2 and "--components: unknown component(s) ['vea_decoder']; choose from text_encoder, unet" in out


def test_empty_components_is_bad_input(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """``--components ''`` read 'unknown component(s) none given'."""
    code, out = _compile(tiny_pipeline_dir, "-o", tmp_path / "art", "--components", "")
    assert code == 2 and "--components: no component given; choose from text_encoder, unet" in out, out


def test_a_partial_artifact_is_valid_but_refused_by_the_runtime(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    from diffusion_trt.errors import ArtifactError
    from diffusion_trt.runtime import EnginePipeline

    code, out = _compile(tiny_pipeline_dir, "-o", tmp_path / "art", "--components", "vae_decoder")
    assert code == 0, out
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["partial"] is True and list(manifest["components"]) == ["vae_decoder"]
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "art")]).exit_code == 0
    with pytest.raises(ArtifactError, match=r"lacks \['text_encoder', 'unet'\].*recompile without --components"):
        EnginePipeline.from_artifacts(tmp_path / "art", device="cpu")


@pytest.mark.slow
def test_sd15_unet_over_2gb_with_external_data_builds(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The fp32 SD-1.5 UNet (3.4 GB of weights) keeps them in model.onnx.data; the RTX parser reads them from beside
    the file and the builder writes a plan. Real size: minutes and ~15 GB of RAM on the 2-core machine."""
    from diffusion_trt.compiler.dummy import write_dummy_pipeline

    model = write_dummy_pipeline(tmp_path_factory.mktemp("models") / "sd15", arch="sd15", seed=0)
    out = tmp_path_factory.mktemp("rtx-sd15") / "unet-fp32"
    code, text = _compile(model, "-o", out, "--backend", RTX, "--precision", "fp32", "--components", "unet",
                          "--compute-capability", "8.9", "--min-height", 512, "--max-height", 512, "--min-width",
                          512, "--max-width", 512, "--height", 512, "--width", 512, "--max-batch-size", 1)
    assert code == 0, text
    entry = json.loads((out / "manifest.json").read_text())["components"]["unet"]
    assert (out / "unet" / "model.onnx.data").stat().st_size > 2**31
    assert entry["build"]["plan_bytes"] > 2**31 and entry["build"]["num_layers"] > 1000


def test_fp8_unet_for_ada_passes_the_builder(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """fp8: the calibrated QDQ UNet (onnxruntime.quantization, E4M3) is parsed and built strongly typed for 8.9."""
    out = tmp_path / "fp8"
    code, text = _compile(tiny_pipeline_dir, "-o", out, "--backend", RTX, "--precision", "fp8", "--components",
                          "unet", "--compute-capability", "8.9", "--calibration-size", 1, "--calibration-steps", 1,
                          "--min-height", 64, "--max-height", 64, "--min-width", 64, "--max-width", 64,
                          "--max-batch-size", 1)
    assert code == 0, text
    entry = json.loads((out / "manifest.json").read_text())["components"]["unet"]
    assert entry["precision"] == "fp8" and entry["compile_plan"]["quantized"] is True
    assert entry["build"]["has_qdq"] is True and entry["build"]["strongly_typed"] is True
    assert entry["build"]["compute_capabilities"] == ["8.9"] and entry["build"]["plan_bytes"] > 0
    graph = onnx.load(str(out / entry["onnx"]), load_external_data=False).graph
    fp8 = [n for n in graph.node if n.op_type == "QuantizeLinear"]
    assert fp8 and entry["quality"]["passed"] is True

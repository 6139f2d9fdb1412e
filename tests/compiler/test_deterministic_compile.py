"""compile --deterministic (issue 19): ORT CUDA artifacts keep GroupNorm unfused, and the runtime says when an
artifact lacks it. Checked here on the CPU (the graphs and the manifest); that the unfused norms are run-to-run
identical on a GPU was measured on an H200 (benchmarks/norm_probe.py, benchmarks/gpu_determinism.sh)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from diffusion_trt.artifact.manifest import Manifest
from diffusion_trt.cli import main
from diffusion_trt.compiler.pipeline import compile_pipeline, deterministic_pass_options
from diffusion_trt.config import CompileConfig
from diffusion_trt.runtime.determinism import compile_time_note


def _ops(artifact: Path, component: str) -> Counter[str]:
    manifest = json.loads((artifact / "manifest.json").read_text())
    model = onnx.load(str(artifact / manifest["components"][component]["onnx"]), load_external_data=False)
    return Counter(n.op_type for n in model.graph.node)


def _norm_counts(artifact: Path, component: str) -> dict[str, int]:
    entry = json.loads((artifact / "manifest.json").read_text())["components"][component]
    return next(p for p in entry["passes"] if p["name"] == "fuse_group_norm")["counts"]


def test_ort_cuda_artifact_keeps_group_norm_unfused(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    config = {"device": "cuda", "precision": "fp16", "components": ("vae_decoder",)}
    fused = compile_pipeline(tiny_pipeline_dir, tmp_path / "fused", CompileConfig(**config))
    plain = compile_pipeline(tiny_pipeline_dir, tmp_path / "det", CompileConfig(**config, deterministic=True))
    assert _ops(fused, "vae_decoder")["GroupNorm"] + _ops(fused, "vae_decoder")["SkipGroupNorm"] > 0
    ops = _ops(plain, "vae_decoder")
    assert ops["GroupNorm"] == ops["SkipGroupNorm"] == 0 and ops["InstanceNormalization"] > 0
    counts = _norm_counts(plain, "vae_decoder")
    assert counts["GroupNorm"] == 0
    assert counts["skipped_for_target"] + counts["rejected"] == ops["InstanceNormalization"]
    assert counts["skipped_for_target"] == _norm_counts(fused, "vae_decoder")["GroupNorm"]  # each site it fuses
    manifest = json.loads((plain / "manifest.json").read_text())
    assert manifest["config"]["deterministic"] is True
    assert compile_time_note(Manifest.from_json(manifest), "cuda") is None
    note = compile_time_note(Manifest.from_json(json.loads((fused / "manifest.json").read_text())), "cuda")
    assert note is not None and "recompile with `diffusion-trt compile ... --deterministic`" in note


def test_other_targets_are_unchanged_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="diffusion_trt.compiler.pipeline"):
        assert deterministic_pass_options(CompileConfig(deterministic=True)) == {}
    assert "--deterministic: no effect with --backend ort --device cpu" in caplog.text
    assert deterministic_pass_options(CompileConfig(device="cuda", precision="fp16", deterministic=True)) == {
        "fuse_group_norm_deterministic": True}
    assert deterministic_pass_options(CompileConfig(device="cuda")) == {}
    # the CPU provider's kernels are not the ones at stake, nor a TensorRT engine's: no warning for them
    assert compile_time_note(Manifest.from_json({"backend": "ort", "config": {}}), "cpu") is None
    assert compile_time_note(Manifest.from_json({"backend": "tensorrt-rtx", "config": {}}), "cuda") is None
    # no fused GroupNorm to warn about: compiled for the CPU (run on CUDA), or unfused through the pass option
    assert compile_time_note(Manifest.from_json({"backend": "ort", "device": "cpu", "config": {}}), "cuda") is None
    unfused = {"pass_options": {"fuse_group_norm_deterministic": True}}
    by_option = {"backend": "ort", "device": "cuda", "config": unfused}
    assert compile_time_note(Manifest.from_json(by_option), "cuda") is None
    assert compile_time_note(Manifest.from_json({"backend": "ort", "device": "cuda", "config": {}}), "cuda") is not None


def test_cli_flag_reaches_the_manifest(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "a"
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(out), "--no-cache",
                                       "--device", "cuda", "--precision", "fp16", "--components", "vae_decoder",
                                       "--deterministic"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["config"]["deterministic"] is True
    assert _ops(out, "vae_decoder")["GroupNorm"] == 0
    inspect = CliRunner().invoke(main, ["inspect", str(out)])
    assert "backend    ort on cuda, fp16 (--deterministic: GroupNorm unfused); compiled in" in inspect.output
    assert json.loads(CliRunner().invoke(main, ["inspect", str(out), "--json"]).output)["deterministic"] is True


def test_no_effect_warning_is_one_line_per_compile(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """A CPU compile with --deterministic warns once (not once per component), and a compile cache hit warns too."""
    args = ["compile", str(tiny_pipeline_dir), "--deterministic", "--components", "text_encoder,vae_decoder",
            "--cache-dir", str(tmp_path / "cache")]
    warning = "warning: --deterministic: no effect with --backend ort --device cpu"
    for out in ("a", "b"):  # b: from the compile cache
        result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
        assert result.output.count(warning) == 1, result.output
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["cache"]["hit"] is True


def test_contradicting_pass_option_is_refused(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), "--no-cache",
                                       "--device", "cuda", "--precision", "fp16", "--deterministic",
                                       "--pass-option", "fuse_group_norm_deterministic=false"])
    assert result.exit_code == 2
    assert result.output.strip() == ("error: --deterministic with --pass-option fuse_group_norm_deterministic=false "
                                     "contradict each other; drop one")
    assert not (tmp_path / "a").exists()


def test_help_says_where_the_options_act() -> None:
    def help_of(command: str) -> str:
        return " ".join(CliRunner().invoke(main, [command, "--help"]).output.split())

    assert "run with --deterministic too. Elsewhere no effect (a warning says so)" in help_of("compile")
    run = help_of("run")
    assert "an ORT CUDA artifact also needs compile --deterministic" in run
    assert "ORT CUDA only (elsewhere a warning says it has no effect)" in run and "HEURISTIC: cuDNN's heuristics" in run

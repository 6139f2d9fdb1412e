"""compile runs the fp16 range check on its own components: an SDXL-VAE-style overflow is found and kept fp32.

The mechanism is the real SDXL VAE's: activations of the decoder's last up block that the GroupNorm after them
normalizes away, so the fp32 output does not show them (the fp16-fix VAE scales those weights down). Random
weights do not overflow; scaling one conv that only a GroupNorm reads (``up_blocks.3.resnets.0.conv1``, read by
``norm2``) by 1e6 reproduces it without changing the fp32 output. benchmarks/sdxl_vae_fp16_check.py does the
same on the real SDXL VAE config scaled down.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from safetensors.numpy import load_file, save_file

from diffusion_trt.cli import main
from diffusion_trt.compiler.pipeline import compile_pipeline
from diffusion_trt.config import CompileConfig

CONV = "decoder.up_blocks.3.resnets.0.conv1"


def _scaled_vae(src: Path, dst: Path, factor: float) -> Path:
    folder = Path(shutil.copytree(src, dst))
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    for key in (f"{CONV}.weight", f"{CONV}.bias"):
        tensors[key] = tensors[key] * factor
    save_file(tensors, weights)
    return folder


def test_compile_finds_the_vae_overflow(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    folder = _scaled_vae(tiny_sdxl_dir, tmp_path / "m", 1e6)
    out = compile_pipeline(folder, tmp_path / "a", CompileConfig(
        device="cuda", precision="fp16", components=("vae_decoder",), fp16_safe_vae=True))
    entry = json.loads((out / "manifest.json").read_text())["components"]["vae_decoder"]
    check = entry["fp16_check"]
    assert any("up_blocks.3/resnets.0/conv1" in name for name in check["hot"]), check
    assert "/decoder/up_blocks.3/resnets.0/conv1/Conv" in check["islands"]
    convert = next(p for p in entry["passes"] if p["name"] == "convert_fp16")
    assert convert["counts"]["fp32_range_islands"] == len(check["islands"]) >= 2
    # ort-cuda's fused graph (com.microsoft.GroupNorm) runs only on CUDA: on a CPU machine the graph the passes
    # got is calibrated and the fp16 graph is not re-run, which the check says
    if check["calibrated"] == "input":
        assert check["finite"] is None and "not checked" in check["note"]


def test_a_batch_profile_calibrates_the_export_on_one_sample(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    """Issue 28 (compile memory): where the fused graph cannot run (ort-cuda on this CPU machine) the export is
    calibrated on the batch's first sample, which for the VAE decoder is the batch-1 profile's feed: the same hot
    tensors and islands as a batch-1 compile, at a quarter of a batch-4 run's activations."""
    folder = _scaled_vae(tiny_sdxl_dir, tmp_path / "m", 1e6)
    checks = {}
    for batch in (1, 3):
        out = compile_pipeline(folder, tmp_path / f"a{batch}", CompileConfig(
            device="cuda", precision="fp16", components=("vae_decoder",), fp16_safe_vae=True, batch_size=batch,
            min_batch_size=batch, max_batch_size=batch))
        checks[batch] = json.loads((out / "manifest.json").read_text())["components"]["vae_decoder"]["fp16_check"]
    one, three = checks[1], checks[3]
    if three["calibrated"] == "optimized":  # a machine where the fused graph runs: the whole batch, as before
        assert three["rows"] == 3
        return
    assert three["calibrated"] == "input" and one["rows"] == three["rows"] == 1
    assert three["hot"] == one["hot"] and three["islands"] == one["islands"] != []


def test_an_unscaled_vae_gets_no_islands(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    out = compile_pipeline(tiny_sdxl_dir, tmp_path / "a", CompileConfig(
        device="cuda", precision="fp16", components=("vae_decoder",), fp16_safe_vae=True))
    check = json.loads((out / "manifest.json").read_text())["components"]["vae_decoder"]["fp16_check"]
    assert check["hot"] == {} and check["islands"] == []


def test_compile_applies_the_fp16_verdict_to_each_component(tiny_pipeline_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24 item 13: each fp16 component's outputs are compared with fp32 on the calibration inputs
    (``fp16_check.parity`` in the manifest), and a component that fails the verdict fails the compile with one
    line. ``--deterministic`` leaves ORT CUDA's GroupNorm unfused, so the fp16 graph runs on this CPU machine."""
    from diffusion_trt.passes import convert_fp16 as convert_fp16_module
    from diffusion_trt.passes.parity import MIN_COSINE

    args = ["compile", str(tiny_pipeline_dir), "--device", "cuda", "--precision", "fp16", "--components",
            "vae_decoder", "--deterministic", "--no-cache"]
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "ok")])
    assert result.exit_code == 0, result.output
    check = json.loads((tmp_path / "ok" / "manifest.json").read_text())["components"]["vae_decoder"]["fp16_check"]
    (parity,) = check["parity"]
    assert parity["name"] == "sample" and parity["cosine"] >= MIN_COSINE, check

    real = convert_fp16_module._converted_constant

    def wrong_sign(tensor: Any, want: Any, counts: Any, in_place: bool) -> Any:  # a conversion silently wrong
        out = real(tensor, want, counts, in_place)
        if out.values.dtype == np.float16 and out.values.ndim == 4:
            out.values = -out.values
        return out

    monkeypatch.setattr(convert_fp16_module, "_converted_constant", wrong_sign)
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "bad")])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "vae_decoder: the fp16 graph does not match fp32" in errors[0], result.output
    assert "output 'sample': cosine" in errors[0] and "Traceback" not in result.output
    assert not (tmp_path / "bad").exists()

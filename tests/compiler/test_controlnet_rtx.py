"""The ControlNet (its conditioning embedding and its steps) and the residual-input UNet through NVIDIA's real
TensorRT-RTX builder, on a machine without a GPU
(as tests/compiler/test_build_rtx.py: plans are compiled ahead of time for a named compute capability; none runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from diffusion_trt.cli import main
from diffusion_trt.compiler.dummy_controlnet import write_dummy_controlnet

pytestmark = pytest.mark.rtx_builder


def test_controlnet_and_residual_unet_build_for_tensorrt_rtx(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    cn = write_dummy_controlnet(tmp_path / "cn", "tiny", seed=0)
    out = tmp_path / "rtx-cn"
    result = CliRunner().invoke(main, [
        "compile", str(tiny_pipeline_dir), "-o", str(out), "--backend", "tensorrt-rtx", "--precision", "fp16",
        "--compute-capability", "8.9", "--components", "unet", "--controlnet", f"canny={cn}", "--no-cache",
        "--min-height", "64", "--max-height", "64", "--min-width", "64", "--max-width", "64", "--max-batch-size", "1"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert list(manifest["components"]) == ["unet", "unet_controlnet", "cond_embed_canny", "controlnet_canny"]
    for name in ("unet_controlnet", "cond_embed_canny", "controlnet_canny"):
        entry = manifest["components"][name]
        assert entry["build"]["library"] == "tensorrt-rtx" and entry["build"]["num_layers"] > 0
        assert (out / entry["plan"]).stat().st_size > 0
    residuals = [t for t in manifest["components"]["unet_controlnet"]["inputs"] if "residual" in t["name"]]
    assert len(residuals) == 13 and residuals[-1]["shape"] == ["B2", 32, "h/8", "w/8"]
    assert [t["name"] for t in manifest["components"]["controlnet_canny"]["outputs"]] == \
        [t["name"] for t in residuals]
    embed = manifest["components"]["cond_embed_canny"]  # the control image's embedding, once per call (issue 25)
    assert [(t["name"], t["shape"], t["dtype"]) for t in embed["inputs"]] == [
        ("controlnet_cond", ["B2", 3, "H", "W"], "float16")]
    assert [(t["name"], t["shape"]) for t in embed["outputs"]] == [("controlnet_cond_embedding", ["B2", 16, "h", "w"])]
    cn_inputs = {t["name"]: t for t in manifest["components"]["controlnet_canny"]["inputs"]}
    for key in ("min", "opt", "max"):  # the ControlNet's profile: its CFG batch, the image of its latent
        b2, h, w = (cn_inputs["sample"][key][i] for i in (0, 2, 3))
        assert embed["inputs"][0][key] == [b2, 3, 8 * h, 8 * w], key
        assert cn_inputs["controlnet_cond_embedding"][key] == [b2, 16, h, w], key
    assert "controlnet_cond" not in cn_inputs
    assert CliRunner().invoke(main, ["verify", "--no-host", str(out)]).exit_code == 0

"""The compiler side of ControlNets: dummy ControlNets, the residual layout, the base-architecture check, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from diffusion_trt.cli import main
from diffusion_trt.compiler import controlnet
from diffusion_trt.compiler.dummy import arch_config
from diffusion_trt.compiler.dummy_controlnet import write_dummy_controlnet
from diffusion_trt.config import CompileConfig
from diffusion_trt.errors import ModelFolderError, RuntimeInputError


@pytest.fixture(scope="module")
def tiny_cn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_controlnet(tmp_path_factory.mktemp("cn") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def sd21_cn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_controlnet(tmp_path_factory.mktemp("cn") / "sd21", "tiny-sd21", seed=0)


def test_dummy_controlnet_is_seeded_and_not_zero(tiny_cn: Path, tmp_path: Path) -> None:
    again = write_dummy_controlnet(tmp_path / "again", "tiny", seed=0)
    other = write_dummy_controlnet(tmp_path / "other", "tiny", seed=1)
    a, b, c = (load_file(p / "diffusion_pytorch_model.safetensors") for p in (tiny_cn, again, other))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["conv_in.weight"], c["conv_in.weight"])
    # from_unet zero-initialises the residual projections; the dummy draws them so the ControlNet changes images
    assert all(a[k].abs().max() > 0 for k in a if k.startswith(("controlnet_down_blocks", "controlnet_mid_block")))


def test_dummy_controlnet_starts_from_the_dummy_pipelines_unet(tiny_cn: Path, tiny_pipeline_dir: Path) -> None:
    cn = load_file(tiny_cn / "diffusion_pytorch_model.safetensors")
    unet = load_file(tiny_pipeline_dir / "unet" / "diffusion_pytorch_model.safetensors")
    assert torch.equal(cn["conv_in.weight"], unet["conv_in.weight"])


def test_dummy_controlnet_refuses_inpainting_and_non_empty(tmp_path: Path, tiny_cn: Path) -> None:
    with pytest.raises(ModelFolderError, match="has no ControlNet; use one of tiny"):
        write_dummy_controlnet(tmp_path / "x", "tiny-sd15-inpaint")
    with pytest.raises(ModelFolderError, match="exists and is not empty"):
        write_dummy_controlnet(tiny_cn, "tiny")


@pytest.mark.parametrize(("arch", "down"), [("sd15", 12), ("sd21", 12), ("sdxl", 9), ("tiny", 12), ("tiny-sdxl", 9)])
def test_residual_layout_counts(arch: str, down: int) -> None:
    layout = controlnet.residual_layout(arch_config(arch)["unet"])
    assert len(layout) == down + 1


def test_residual_layout_matches_the_controlnet_outputs(tiny_cn: Path) -> None:
    from diffusers import ControlNetModel

    model = ControlNetModel.from_pretrained(tiny_cn).eval()
    h = 5  # odd: the residual sizes are ceil(h / k)
    with torch.no_grad():
        down, mid = model(torch.randn(1, 4, h, h), torch.tensor([10.0]), torch.randn(1, 77, 32),
                          controlnet_cond=torch.rand(1, 3, 8 * h, 8 * h), return_dict=False)
    got = [tuple(r.shape[1:]) for r in (*down, mid)]
    want = [(c, -(-h // k), -(-h // k)) for c, k in controlnet.residual_layout(model.config)]
    assert got == want


def test_another_base_architecture_is_refused_naming_both(sd21_cn: Path, tiny_pipeline_dir: Path) -> None:
    unet = json.loads((tiny_pipeline_dir / "unet" / "config.json").read_text())
    with pytest.raises(ModelFolderError) as e:
        controlnet.check_controlnet("x", sd21_cn, unet, tiny_pipeline_dir)
    msg = str(e.value)
    assert "is for an SD 2.x (cross_attention_dim 32" in msg and "is an SD 1.x (cross_attention_dim 32" in msg


def test_compile_cli_refuses_a_controlnet_of_another_base(sd21_cn: Path, tiny_pipeline_dir: Path,
                                                          tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), "--no-cache",
                                       "--controlnet", f"depth={sd21_cn}"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "SD 2.x" in lines[0] and "SD 1.x" in lines[0]
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize(("value", "message"), [
    ("Bad Name=x", "must be lower-case letters"), ("cn=", "names no folder")])
def test_parse_controlnet_arg_errors(value: str, message: str) -> None:
    with pytest.raises(RuntimeInputError, match=message):
        controlnet.parse_controlnet_arg(value)


def test_parse_controlnet_arg_names() -> None:
    assert controlnet.parse_controlnet_arg("models/SD15-Canny") == ("sd15_canny", "models/SD15-Canny")
    assert controlnet.parse_controlnet_arg("depth=models/x") == ("depth", "models/x")


def test_twice_the_same_name_is_refused(tiny_cn: Path, tiny_pipeline_dir: Path) -> None:
    unet = json.loads((tiny_pipeline_dir / "unet" / "config.json").read_text())
    with pytest.raises(RuntimeInputError, match=r"the name\(s\) a are given twice"):
        controlnet.check_controlnets([("a", str(tiny_cn)), ("a", str(tiny_cn))], unet, tiny_pipeline_dir)


def test_not_a_controlnet_folder(tmp_path: Path, tiny_pipeline_dir: Path) -> None:
    unet = json.loads((tiny_pipeline_dir / "unet" / "config.json").read_text())
    with pytest.raises(ModelFolderError, match="holds a UNet2DConditionModel model, not a ControlNetModel"):
        controlnet.check_controlnet("u", tiny_pipeline_dir / "unet", unet, tiny_pipeline_dir)
    with pytest.raises(ModelFolderError, match=r"no config\.json there"):
        controlnet.check_controlnet("u", tmp_path, unet, tiny_pipeline_dir)


def test_without_controlnets_the_config_and_artifact_are_todays(tiny_artifact: Path) -> None:
    assert "controlnets" not in CompileConfig().to_json()
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    assert not [c for c in manifest["components"] if "controlnet" in c]
    assert "controlnets" not in manifest["config"]
    cfg = CompileConfig(controlnets=(("a", "x"),))
    assert CompileConfig.from_json(cfg.to_json()) == cfg


def test_dummy_controlnet_cli(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["dummy-controlnet", "--arch", "tiny-sdxl", str(tmp_path / "x")])
    assert result.exit_code == 0, result.output
    cfg = json.loads((tmp_path / "x" / "config.json").read_text())
    assert cfg["_class_name"] == "ControlNetModel" and cfg["addition_embed_type"] == "text_time"


def test_compile_cli_names_a_controlnet_path_that_does_not_exist(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent" / "path"
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), "--no-cache",
                                       "--controlnet", f"x={missing}"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and f"--controlnet x={missing}: {missing} does not exist" in lines[0], result.output
    assert "config.json" not in lines[0] and not (tmp_path / "a").exists()

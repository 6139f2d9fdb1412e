"""Single-file ControlNets (``--controlnet NAME=FILE.safetensors``): loaded by diffusers' ``from_single_file``.

diffusers has no writer of the original LDM ControlNet layout, so :func:`ldm_state_dict` writes one here from the
layout of lllyasviel's ``cldm/cldm.py`` ``ControlNet`` (``time_embed``, ``input_blocks``, ``zero_convs``,
``middle_block``, ``middle_block_out``, ``input_hint_block``; ResBlock ``in_layers``/``emb_layers``/``out_layers``/
``skip_connection``; SpatialTransformer keys as diffusers'), keys prefixed ``control_model.`` as A1111 files are. What
this proves: a file in that layout, read by diffusers' converter (not ours), gives back every tensor of the diffusers
folder, and the compiled artifact's images equal the folder form's. It does not prove that the layout written here is
byte-for-byte a published file's (no real ControlNet file is available offline); a wrong key would fail both tests.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import load_file, save_file

from diffusion_trt.cli import main
from diffusion_trt.compiler import controlnet_file
from diffusion_trt.compiler.dummy_controlnet import write_dummy_controlnet
from diffusion_trt.compiler.pipeline import compile_pipeline
from diffusion_trt.config import CompileConfig
from diffusion_trt.errors import ModelFolderError
from diffusion_trt.runtime import EnginePipeline

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "norm2": "out_layers.0",
           "conv2": "out_layers.3", "conv_shortcut": "skip_connection"}


def _ldm_key(key: str, layers_per_block: int, hint_blocks: int) -> str:
    """The cldm.py name of one diffusers ControlNetModel key."""
    parts = key.split(".")
    head, rest = parts[0], parts[1:]
    if head == "time_embedding":
        return f"time_embed.{ {'linear_1': 0, 'linear_2': 2}[rest[0]] }." + ".".join(rest[1:])
    if head == "conv_in":
        return "input_blocks.0.0." + ".".join(rest)
    if head == "controlnet_cond_embedding":
        index = {"conv_in": 0, "conv_out": 2 * (hint_blocks + 1)}.get(rest[0])
        if index is None:  # blocks.{j}
            return f"input_hint_block.{2 * (int(rest[1]) + 1)}." + ".".join(rest[2:])
        return f"input_hint_block.{index}." + ".".join(rest[1:])
    if head == "controlnet_down_blocks":
        return f"zero_convs.{rest[0]}.0." + ".".join(rest[1:])
    if head == "controlnet_mid_block":
        return "middle_block_out.0." + ".".join(rest)
    if head == "down_blocks":
        block, kind, layer, tail = int(rest[0]), rest[1], int(rest[2]), rest[3:]
        first = 1 + block * (layers_per_block + 1)
        if kind == "downsamplers":
            return f"input_blocks.{first + layers_per_block}.0.op." + ".".join(tail[1:])
        if kind == "resnets":
            return f"input_blocks.{first + layer}.0.{_RESNET[tail[0]]}." + ".".join(tail[1:])
        return f"input_blocks.{first + layer}.1." + ".".join(tail)
    if head == "mid_block":
        kind, layer, tail = rest[0], int(rest[1]), rest[2:]
        if kind == "resnets":
            return f"middle_block.{2 * layer}.{_RESNET[tail[0]]}." + ".".join(tail[1:])
        return "middle_block.1." + ".".join(tail)
    raise KeyError(key)


def ldm_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The diffusers ControlNet folder's weights under A1111's single-file names (``control_model.`` + cldm.py)."""
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "diffusion_pytorch_model.safetensors")
    hint_blocks = 2 * (len(config["conditioning_embedding_out_channels"]) - 1)
    return {"control_model." + _ldm_key(k, config["layers_per_block"], hint_blocks): v.contiguous()
            for k, v in weights.items()}


@pytest.fixture(scope="module")
def cn_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dummy_controlnet(tmp_path_factory.mktemp("cn") / "tiny", "tiny", seed=3)


@pytest.fixture(scope="module")
def cn_file(cn_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder's ControlNet as one LDM-layout file, with its config.json beside it (diffusers' ``config=``: the
    tiny arch's 8 GroupNorm groups cannot be said in an LDM yaml, whose cldm.py always uses 32)."""
    root = tmp_path_factory.mktemp("single")
    save_file(ldm_state_dict(cn_folder), root / "control_tiny_canny.safetensors")
    shutil.copy(cn_folder / "config.json", root / "config.json")
    return root / "control_tiny_canny.safetensors"


def test_the_file_is_in_the_ldm_layout_and_diffusers_reads_back_every_tensor(cn_folder: Path, cn_file: Path) -> None:
    keys = load_file(cn_file).keys()
    assert all(k.startswith("control_model.") for k in keys)
    assert not [k for k in keys if any(w in k for w in ("down_blocks", "resnets", "controlnet_", "time_embedding"))]
    want = load_file(cn_folder / "diffusion_pytorch_model.safetensors")
    got = controlnet_file.load_single_file(cn_file).state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_config_route_prefers_the_yaml_then_a_controlnet_config_json(tmp_path: Path, cn_folder: Path) -> None:
    file = tmp_path / "cn.safetensors"
    assert controlnet_file.config_route(file) == {}
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    assert controlnet_file.config_route(file) == {}
    shutil.copy(cn_folder / "config.json", tmp_path / "config.json")
    assert controlnet_file.config_route(file) == {"config": str(tmp_path)}
    (tmp_path / "cn.yaml").write_text("model: {}\n")
    assert controlnet_file.config_route(file) == {"original_config": str(tmp_path / "cn.yaml")}


@pytest.fixture(scope="module")
def artifact(tiny_pipeline_dir: Path, cn_folder: Path, cn_file: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = CompileConfig(components=("text_encoder", "unet", "vae_decoder"),
                           controlnets=(("folder", str(cn_folder)), ("single", str(cn_file))))
    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("art") / "tiny-cn", config)


def test_single_file_compiles_to_the_images_of_the_folder_form(artifact: Path) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert {"controlnet_folder", "controlnet_single"} <= manifest["components"].keys()
    control = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    common = {"prompt": "an ink painting", "num_inference_steps": 4, "seed": 2, "output_type": "np",
              "progress": False}
    with EnginePipeline.from_artifacts(artifact) as pipe:
        folder = pipe(controlnet="folder", control_image=control, **common).images
        single = pipe(controlnet="single", control_image=control, **common).images
        plain = pipe(**common).images
    assert np.abs(single - folder).max() <= 1e-5
    assert np.abs(single - plain).max() > 1e-3  # the ControlNet acts


def test_add_controlnet_takes_a_single_file(artifact: Path, tiny_pipeline_dir: Path, cn_file: Path,
                                            tmp_path: Path) -> None:
    copy = tmp_path / "art"
    shutil.copytree(artifact, copy)
    result = CliRunner().invoke(main, ["add-controlnet", str(copy), str(tiny_pipeline_dir), f"again={cn_file}"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((copy / "manifest.json").read_text())
    assert "controlnet_again" in manifest["components"]
    assert ["again", str(cn_file)] in manifest["config"]["controlnets"]


class _Touch:
    """Unpickling this creates ``path``: the proof that a refused file was never unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return Path.touch, (self.path,)


@pytest.mark.parametrize("suffix", [".pth", ".ckpt", ".pt"])
def test_a_pickled_controlnet_is_refused_without_unpickling(tiny_pipeline_dir: Path, tmp_path: Path,
                                                           suffix: str) -> None:
    marker = tmp_path / "unpickled"
    (tmp_path / f"cn{suffix}").write_bytes(pickle.dumps(_Touch(marker)))
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), "--no-cache",
                                       "--controlnet", f"cn={tmp_path / f'cn{suffix}'}"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "is a pickled checkpoint" in lines[0] and ".safetensors" in lines[0]
    assert not marker.exists() and not (tmp_path / "a").exists()


def test_a_single_file_without_a_config_is_refused_naming_the_fix(cn_file: Path, tiny_pipeline_dir: Path,
                                                                   tmp_path: Path) -> None:
    lonely = tmp_path / "lonely.safetensors"
    shutil.copy(cn_file, lonely)  # no yaml, no config.json: diffusers' inference needs the Hub repo's config
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), "--no-cache",
                                       "--controlnet", f"cn={lonely}"], env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "could not load the single-file ControlNet" in lines[0]
    assert "lonely.yaml" in lines[0] and "config.json" in lines[0]


def test_a_file_that_is_no_controlnet_is_refused_naming_what_it_is(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """A LoRA given to --controlnet reached diffusers' config inference: a huggingface_hub UserWarning over two lines,
    then an error about a Hub repo's config.json missing from the cache."""
    lora = tmp_path / "ink.safetensors"
    save_file({"unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.zeros(4, 16),
               "unet.down_blocks.0.attentions.0.proj_in.lora_B.weight": torch.zeros(16, 4)}, lora)
    other = tmp_path / "other.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4)}, other)
    for path, message in ((lora, "it holds LoRA layers: pass it with --lora"), (other, "it is not a ControlNet")):
        result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), "--no-cache",
                                           "--controlnet", f"cn={path}"])
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1 and result.output.startswith("error: "), result.output
        assert f"--controlnet {path} holds no ControlNet weights (keys like " in result.output
        assert message in result.output


def test_a_single_file_of_another_base_is_refused_naming_both(tmp_path: Path, tiny_pipeline_dir: Path) -> None:
    sd21 = write_dummy_controlnet(tmp_path / "sd21", "tiny-sd21", seed=0)
    (tmp_path / "file").mkdir()
    shutil.copy(sd21 / "config.json", tmp_path / "file" / "config.json")
    save_file(ldm_state_dict(sd21), tmp_path / "file" / "cn.safetensors")
    unet = json.loads((tiny_pipeline_dir / "unet" / "config.json").read_text())
    from diffusion_trt.compiler.controlnet import check_controlnet

    with pytest.raises(ModelFolderError) as e:
        check_controlnet("x", tmp_path / "file" / "cn.safetensors", unet, tiny_pipeline_dir)
    assert "is for an SD 2.x" in str(e.value) and "is an SD 1.x" in str(e.value)


def test_a_files_default_name_drops_its_suffix() -> None:
    from diffusion_trt.compiler.controlnet import parse_controlnet_arg

    path = "models/control_v11p_sd15_canny.safetensors"
    assert parse_controlnet_arg(path) == ("control_v11p_sd15_canny", path)

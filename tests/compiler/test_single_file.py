"""Single-file checkpoints: made from the dummy pipelines (tests/compiler/ldm_layout.py writes the A1111 layout),
identified from shapes alone (the tiny architectures too), converted offline back into the same weights, compiled to
the same image as the folder they came from; what cannot be identified is refused with the reason (exit 2)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.cli import main
from diffusion_trt.compiler.dummy import write_dummy_pipeline
from diffusion_trt.compiler.single_file import folder_from_single_file, inspect_checkpoint
from diffusion_trt.errors import ModelFolderError

from .ldm_layout import write_single_file


def _invoke(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def _same_weights(a: Path, b: Path) -> None:
    for sub in ("unet", "vae", "text_encoder", "text_encoder_2"):
        files_a = sorted((a / sub).glob("*.safetensors"))
        if not files_a:
            continue
        sa, sb = load_file(files_a[0]), load_file(sorted((b / sub).glob("*.safetensors"))[0])
        assert sa.keys() == sb.keys(), sub
        assert all(torch.equal(sa[k], sb[k]) for k in sa), sub


@pytest.mark.parametrize(
    ("arch", "family", "expected_arch", "channels", "prediction"),
    [
        ("tiny", "sd1", "tiny", 4, "epsilon"),
        ("tiny-sd21", "sd2", "tiny-sd21", 4, "v_prediction"),
        ("tiny-sdxl", "sdxl", "tiny-sdxl", 4, "epsilon"),
        ("tiny-sd15-inpaint", "sd1", "tiny", 9, "epsilon"),
    ],
)
def test_identified_from_shapes_and_converted_to_the_same_weights(tmp_path: Path, arch: str, family: str,
                                                                  expected_arch: str, channels: int,
                                                                  prediction: str) -> None:
    folder = write_dummy_pipeline(tmp_path / arch, arch=arch, seed=3)
    file = write_single_file(folder, tmp_path / f"{arch}.safetensors")
    info = inspect_checkpoint(file)
    assert (info.family, info.architecture, info.in_channels, info.prediction_type) == (
        family, expected_arch, channels, prediction)
    converted = folder_from_single_file(file, info, tmp_path / "converted")
    _same_weights(folder, converted)
    index = json.loads((converted / "model_index.json").read_text())
    assert index["_class_name"] == json.loads((folder / "model_index.json").read_text())["_class_name"]
    sched = json.loads((converted / "scheduler" / "scheduler_config.json").read_text())
    assert sched["prediction_type"] == prediction


def test_sd2_prediction_type_default_is_said_and_can_be_overridden(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    folder = write_dummy_pipeline(tmp_path / "sd21", arch="tiny-sd21")
    file = write_single_file(folder, tmp_path / "sd21.safetensors")
    with caplog.at_level(logging.WARNING, logger="diffusion_trt"):
        assert inspect_checkpoint(file).prediction_type == "v_prediction"
    assert "prediction type assumed v_prediction" in caplog.text and "--prediction-type epsilon" in caplog.text
    assert inspect_checkpoint(file, "epsilon").prediction_type == "epsilon"


def test_single_file_compiles_to_the_same_image(tiny_pipeline_dir: Path, tiny_artifact: Path, tmp_path: Path) -> None:
    from diffusion_trt.runtime import EnginePipeline

    file = write_single_file(tiny_pipeline_dir, tmp_path / "style.safetensors")
    code, out = _invoke("compile", file, "-o", tmp_path / "style")
    assert code == 0, out
    manifest = artifacts.read_manifest(tmp_path / "style")
    assert manifest["source"]["single_file"]["architecture"] == "tiny"
    assert manifest["source"]["single_file"]["sha256"] == artifacts.sha256_file(file)
    assert manifest["source"]["path"] == str(file.resolve())
    images = []
    for art in (tiny_artifact, tmp_path / "style"):
        with EnginePipeline.from_artifacts(art, device="cpu") as pipe:
            images.append(np.asarray(pipe("a red fox", num_inference_steps=2, seed=7, progress=False).images[0]))
    assert np.array_equal(images[0], images[1])
    code, out = _invoke("verify", tmp_path / "style", "--no-host", "--source", file)
    assert code == 0, out
    code, out = _invoke("compile", file, "-o", tmp_path / "again")
    assert code == 0 and "compile cache hit" in out  # no conversion the second time


def _tiny_state(tmp_path: Path) -> dict[str, torch.Tensor]:
    folder = write_dummy_pipeline(tmp_path / "tiny", arch="tiny")
    return load_file(write_single_file(folder, tmp_path / "tiny.safetensors"))


def test_unknown_files_are_refused_with_the_reason(tmp_path: Path) -> None:
    state = _tiny_state(tmp_path)
    cases = {
        "lora": ({"lora_unet_down_blocks_0.lora_down.weight": torch.zeros(4, 4)}, "it is a LoRA (lora_* keys)"),
        "other": ({"encoder.layer.0.weight": torch.zeros(2)}, "has no UNet weights (model.diffusion_model.*)"),
        "unet-only": ({k: v for k, v in state.items() if k.startswith("model.")}, "has no VAE weights"),
        "no-text": ({k: v for k, v in state.items() if not k.startswith("cond_stage")}, "no text encoder of a known"),
        "wider": ({**state, "model.diffusion_model.input_blocks.0.0.weight": torch.zeros(24, 4, 3, 3)},
                  "shapes match none of the shipped SD 1.x architectures (sd15 expects unet_width 320"),
        "channels": ({**state, "model.diffusion_model.input_blocks.0.0.weight": torch.zeros(16, 8, 3, 3)},
                     "the UNet takes 8 input channels; only 4 (text-to-image) and 9 (inpainting)"),
    }
    for name, (tensors, message) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path))
        with pytest.raises(ModelFolderError, match=None) as e:
            inspect_checkpoint(path)
        assert message in str(e.value), (name, str(e.value))
        assert str(path) in str(e.value)


def test_cli_refuses_an_unknown_file_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "mystery.safetensors"
    save_file({"encoder.layer.0.weight": torch.zeros(2)}, str(path))
    code, out = _invoke("compile", path, "-o", tmp_path / "a")
    assert code == 2 and out.startswith(f"error: {path} has no UNet weights") and not (tmp_path / "a").exists()
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"\x80\x02}q\x00.")
    code, out = _invoke("compile", ckpt, "-o", tmp_path / "a")
    assert code == 2 and "is a file, not a folder, and not a .safetensors checkpoint" in out
    assert "convert it to .safetensors" in out
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    code, out = _invoke("compile", broken, "-o", tmp_path / "a")
    assert code == 2 and "is not a valid safetensors file" in out


@pytest.mark.slow
def test_sd15_single_file_compiles_to_the_same_image(tmp_path: Path) -> None:
    """The true SD-1.5 architecture: ~4 GB of weights, minutes and >10 GB RAM per compile on a CPU."""
    from diffusion_trt.compiler.frontend import compile_model
    from diffusion_trt.config import CompileConfig
    from diffusion_trt.runtime import EnginePipeline

    folder = write_dummy_pipeline(tmp_path / "sd15", arch="sd15")
    file = write_single_file(folder, tmp_path / "sd15.safetensors")
    info = inspect_checkpoint(file)
    assert (info.family, info.architecture, info.in_channels) == ("sd1", "sd15", 4)
    config = CompileConfig(components=("text_encoder", "unet", "vae_decoder"), height=256, width=256,
                           min_height=256, max_height=256, min_width=256, max_width=256, max_batch_size=1)
    images = []
    for source, out in ((folder, tmp_path / "from-folder"), (file, tmp_path / "from-file")):
        compile_model(source, out, config, cache=None)
        with EnginePipeline.from_artifacts(out, device="cpu") as pipe:
            images.append(np.asarray(pipe("a red fox", num_inference_steps=2, seed=7, progress=False).images[0]))
    assert np.array_equal(images[0], images[1])


def _header_file(path: Path, header: bytes) -> Path:
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    return path


def _sd1_header(**extra: dict[str, object]) -> bytes:
    entries: dict[str, object] = {
        "model.diffusion_model.input_blocks.0.0.weight": {"dtype": "F32", "shape": [32, 4, 3, 3],
                                                          "data_offsets": [0, 0]},
        "first_stage_model.encoder.conv_in.weight": {"dtype": "F32", "shape": [32, 3, 3, 3], "data_offsets": [0, 0]},
        "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight": {
            "dtype": "F32", "shape": [1000, 32], "data_offsets": [0, 0]},
        **extra,
    }
    return json.dumps(entries).encode()


@pytest.mark.parametrize(("header", "message"), [
    (b"[" * 100_000 + b"]" * 100_000, r"nests (objects/arrays )?deeper than"),
    (_sd1_header(**{"model.diffusion_model.out.0.weight": {"dtype": "F32", "shape": 5, "data_offsets": [0, 0]}}),
     r"tensor 'model\.diffusion_model\.out\.0\.weight' has shape 5 in its header, not a list of non-negative"),
    (_sd1_header(**{"model.diffusion_model.out.0.weight": {"dtype": "F32", "shape": "abcd", "data_offsets": [0, 0]}}),
     r"has shape 'abcd' in its header"),
    (_sd1_header(**{"model.diffusion_model.out.0.weight": {"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 0]}}),
     r"has shape \[2, -1\] in its header"),
    (_sd1_header(**{"model.diffusion_model.input_blocks.\u00b2.0.weight": {"dtype": "F32", "shape": [4],
                                                                           "data_offsets": [0, 0]}}),
     r"match none of the shipped SD 1\.x architectures"),
    (b'{"model.diffusion_model.x": {"shape": [1]}, "\\ud800": {}}', r"lone surrogate|not valid"),
], ids=["100000-deep", "shape-5", "shape-abcd", "shape-negative", "unicode-digit-block", "lone-surrogate"])
def test_a_bad_single_file_header_is_one_error_line_exit_2(tmp_path: Path, header: bytes, message: str) -> None:
    file = _header_file(tmp_path / "bad.safetensors", header)
    with pytest.raises(ModelFolderError, match=message):
        inspect_checkpoint(file)
    result = CliRunner().invoke(main, ["compile", str(file), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert [line for line in result.output.splitlines() if line.startswith("error:")] == result.output.splitlines()[-1:]
    assert "Traceback" not in result.output


def test_a_truncated_single_file_is_named_with_the_fix(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """Half a download: refused from its header before any conversion, exit 2 (was: diffusers' "Unable to load weights
    from checkpoint file" after the conversion began, as an OSError: "...; check the path and its permissions")."""
    whole = write_single_file(tiny_pipeline_dir, tmp_path / "whole.safetensors")
    half = tmp_path / "half.safetensors"
    half.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ModelFolderError, match=r"half\.safetensors is truncated: its header places tensor data up "
                                               r"to byte [\d,]+, but the file has [\d,]+ bytes; re-download"):
        inspect_checkpoint(half)
    code, out = _invoke("compile", half, "-o", tmp_path / "out")
    assert code == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is truncated" in errors[0] and "permissions" not in out, out
    assert "converted" not in out and not (tmp_path / "out").exists()


def test_a_single_file_whose_header_does_not_match_its_data_is_named_damaged(tiny_pipeline_dir: Path,
                                                                             tmp_path: Path) -> None:
    """One tensor's dtype F32 -> F16 in the header (sizes no longer match the offsets): diffusers' OSError "Unable to
    load weights" became "...; check the path and its permissions" (exit 2, the wrong fix)."""
    whole = write_single_file(tiny_pipeline_dir, tmp_path / "whole.safetensors")
    data = whole.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = data[8:8 + size].replace(b'"F32"', b'"F16"', 1)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data[:8] + header + data[8 + size:])
    code, out = _invoke("compile", bad, "-o", tmp_path / "out")
    assert code == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {bad}: its tensors cannot be read (SafetensorError: Error while deserializing header: "
                      "invalid shape, data type, or offset for tensor); the file is damaged: re-download or re-save "
                      "it"], out
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("args", "message"), [
    (("--height", "1004"), "--height 1004"),
    (("--height", "512", "--min-height", "640"), "--min-height"),
    (("--precision", "int8"), "not supported for inpainting models"),
    (("--lora", "missing.safetensors"), "missing.safetensors"),
], ids=["height-not-aligned", "height-below-min", "int8-inpainting", "missing-lora"])
def test_a_wrong_option_fails_before_the_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    args: tuple[str, ...], message: str) -> None:
    """What the checkpoint's header already tells (architecture, default size, inpainting) is checked against the
    options before the conversion (minutes for a real checkpoint), with the error line the folder would get."""
    from diffusion_trt.compiler import frontend

    folder = write_dummy_pipeline(tmp_path / "inpaint", arch="tiny-sd15-inpaint", seed=3)
    file = write_single_file(folder, tmp_path / "inpaint.safetensors")
    converted = []
    monkeypatch.setattr("diffusion_trt.compiler.single_file.folder_from_single_file",
                        lambda *a, **k: converted.append(a) or pytest.fail("converted before the check"))
    assert frontend is not None
    code, out = _invoke("compile", file, "-o", tmp_path / "out", "--no-cache", *args)
    assert code == 2, out
    assert converted == [] and message in out.splitlines()[-1] and out.splitlines()[-1].startswith("error:")


def test_the_default_size_read_from_the_header_is_the_converted_folders(tmp_path: Path) -> None:
    from diffusion_trt.compiler.export import check_model_folder
    from diffusion_trt.compiler.pipeline import model_facts

    for arch in ("tiny", "tiny-sd21", "tiny-sdxl"):
        folder = write_dummy_pipeline(tmp_path / arch, arch=arch, seed=3)
        file = write_single_file(folder, tmp_path / f"{arch}.safetensors")
        for prediction in ("auto", "epsilon"):
            info = inspect_checkpoint(file, prediction)
            converted = folder_from_single_file(file, info, tmp_path / f"c-{arch}-{prediction}")
            facts = model_facts(check_model_folder(converted))
            assert {k: facts[k] for k in info.facts} == info.facts, (arch, prediction)


@pytest.mark.parametrize("args", [
    ("--lora", "missing.safetensors"),
    ("--height", "64", "--min-height", "72"),
    ("--min-height", "200"),
    ("--precision", "int8"),
    ("--precision", "int8", "--pass-option", "nosuch=1"),
], ids=["missing-lora", "height-below-min", "min-above-default-max", "int8-sdxl", "int8-and-bad-pass-option"])
def test_the_header_check_gives_the_converted_folders_error_line(tmp_path: Path, args: tuple[str, ...]) -> None:
    """The check before the conversion fails with the very line compiling the folder gives (stage prefix included),
    and checks what needs no model (pass options, the fp8 / TensorRT target) first, as the folder's compile does."""
    folder = write_dummy_pipeline(tmp_path / "xl", arch="tiny-sdxl", seed=3)
    file = write_single_file(folder, tmp_path / "xl.safetensors")
    code_file, out_file = _invoke("compile", file, "-o", tmp_path / "out1", "--no-cache", *args)
    code_dir, out_dir = _invoke("compile", folder, "-o", tmp_path / "out2", "--no-cache", *args)
    assert (code_file, out_file.splitlines()[-1]) == (code_dir, out_dir.splitlines()[-1])

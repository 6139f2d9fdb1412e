"""The typed manifest (``artifact/manifest.py``): parsed once after the schema check, every fact under one name, the
backend an enum that reads as its JSON string."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from diffusion_trt.artifact.manifest import Backend, Manifest
from diffusion_trt.artifact.reader import ArtifactReader


def test_the_reader_parses_the_manifest_once_into_typed_facts(tiny_artifact: Path) -> None:
    data = json.loads((tiny_artifact / "manifest.json").read_text())
    with ArtifactReader.open(tiny_artifact, check_hashes=False) as reader:
        m = reader.manifest
    assert isinstance(m, Manifest) and m == Manifest.read(tiny_artifact)
    assert m.backend is Backend.ORT and m.device == data["device"] and m.precision == data["precision"]
    assert m.profile.to_json() == data["profile"] and m.profile_json == data["profile"]
    assert m.profile.opt_size == (data["profile"]["height"][1], data["profile"]["width"][1])
    assert m.profile.is_static is False and m.profile.batch.max == data["profile"]["batch"][2]
    assert m.model.vae_scale_factor == data["model"]["vae_scale_factor"]
    assert m.model.default_height == data["model"]["default_height"] and m.model.architecture == "sd"
    assert list(m.components) == list(data["components"])
    unet = m.components["unet"]
    assert unet.onnx == data["components"]["unet"]["onnx"] and unet.plan is None
    assert unet.spec["inputs"] == data["components"]["unet"]["inputs"]
    assert m.files[unet.onnx].sha256 == data["files"][unet.onnx]["sha256"]
    assert m.file_size(unet.onnx) == data["files"][unet.onnx]["size"] and m.file_size("absent") == 0
    assert m.seal == data["manifest_sha256"] and m.tokenizer == data["tokenizer"]
    assert m.scheduler_config == data["scheduler"]["config"] and m.to_json() == data


def test_the_manifest_is_frozen_and_its_json_a_private_copy(tiny_artifact: Path) -> None:
    m = Manifest.read(tiny_artifact)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.backend = Backend.TENSORRT  # type: ignore[misc]
    with pytest.raises(TypeError):
        m.components["unet"] = m.components["text_encoder"]  # type: ignore[index]
    copy = m.to_json()
    copy["profile"]["height"][1] = 1
    assert m.to_json()["profile"]["height"][1] != 1


def test_backend_reads_as_its_json_value() -> None:
    for value in ("ort", "tensorrt", "tensorrt-rtx"):
        b = Backend(value)
        assert b.value == value and str(b) == f"{b}" == value and repr(b) == repr(value)
        assert b == value and {value: 1}[b] == 1 and json.dumps(b) == json.dumps(value)
    assert not Backend.ORT.is_tensorrt and Backend.TENSORRT.is_tensorrt and Backend.TENSORRT_RTX.is_tensorrt
    with pytest.raises(ValueError):
        Backend("onnx")


def test_optional_facts_get_the_documented_defaults() -> None:
    m = Manifest.from_json({"backend": "tensorrt-rtx", "profile": {"batch": [1, 1, 1], "height": [64, 64, 64],
                                                                   "width": [64, 64, 64]}, "model": {}})
    assert m.profile.is_static and m.model.architecture == "sd" and m.model.force_zeros_for_empty_prompt is True
    assert m.model.unet_in_channels is None and not m.model.is_inpainting and not m.model.is_sdxl
    assert (m.tokenizer, m.tokenizer_2) == ("tokenizer", "tokenizer_2") and m.scheduler_class is None
    assert m.loras == () and m.source_path is None and m.seal is None and not m.deterministic
    inpaint = Manifest.from_json({"model": {"unet_in_channels": 9, "latent_channels": 4, "architecture": "sdxl"},
                                  "config": {"pass_options": {"fuse_group_norm_deterministic": True}},
                                  "loras": [{"file": "a.safetensors", "sha256": "0" * 64, "scale": 0.5}]})
    assert inpaint.model.is_inpainting and inpaint.model.is_sdxl and inpaint.deterministic
    assert inpaint.loras[0].file == "a.safetensors" and inpaint.loras[0].scale == 0.5


def test_spatial_conv_inputs_reads_its_key_else_all_convs_for_an_older_refittable_artifact() -> None:
    """ORT --refittable: the key as written; an artifact with weight_inputs from before the key had every Conv weight
    an input (so it must run NCHW): True; a component without weight inputs: False."""
    def unet(**entry: object) -> bool:
        return Manifest.from_json({"components": {"unet": entry}}).components["unet"].spatial_conv_inputs

    base = {"weight_inputs": "unet/lora_base.safetensors"}
    assert unet(**base, spatial_conv_inputs=False) is False and unet(**base, spatial_conv_inputs=True) is True
    assert unet(**base) is True and unet() is False

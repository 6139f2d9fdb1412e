"""A toy SD artifact made of hand-built ONNX graphs: the real layout, manifest and tokenizer, toy maths.

It runs the whole runtime (tokenizer, engines, scheduler, loop, decode) in milliseconds, independent of the
compiler's exporter, so the runtime's own tests do not wait for (or break with) a model export.

Graphs (D = 8 hidden size, symbols as in ``compiler/components.py``):
    text_encoder: last_hidden_state[B2,77,D] = sin(float(input_ids)[..., None] * w[D] / 1000)
    unet:         noise_pred = 0.5 * sample + mean(encoder_hidden_states, axes 1,2) + timestep / 1000
    vae_decoder:  sample[B,3,H,W] = tanh(nearest_upsample_8(latent_sample)[:, :3])
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.compiler.components import component_specs, tensor_manifest
from diffusion_trt.compiler.dummy import SD15_SCHEDULER_CONFIG
from diffusion_trt.config import Range, ShapeProfile
from tests.graphs import const, make_model, tensor_info

HIDDEN = 8
TEXT_LEN = 77
#: SD 1.5's scheduler_config.json (PNDM): the dummy pipeline's, with the keys save_pretrained adds.
SD15_SCHEDULER: dict[str, Any] = {
    "_class_name": "PNDMScheduler", "_diffusers_version": "0.42.1", **SD15_SCHEDULER_CONFIG
}


def text_encoder_model() -> onnx.ModelProto:
    w = np.linspace(0.1, 1.0, HIDDEN).astype(np.float32)
    return make_model(
        [
            helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["ids_f", "axis_last"], ["ids_u"]),
            helper.make_node("Mul", ["ids_u", "w"], ["scaled"]),
            helper.make_node("Sin", ["scaled"], ["last_hidden_state"]),
        ],
        [tensor_info("input_ids", ["B2", TEXT_LEN], TensorProto.INT64)],
        [tensor_info("last_hidden_state", ["B2", TEXT_LEN, HIDDEN])],
        [const("w", w / 1000), const("axis_last", [-1], np.int64)],
    )


def unet_model() -> onnx.ModelProto:
    return make_model(
        [
            helper.make_node("Mul", ["sample", "half"], ["s"]),
            helper.make_node("ReduceMean", ["encoder_hidden_states"], ["m"], axes=[1, 2], keepdims=0),
            helper.make_node("Div", ["timestep", "thousand"], ["tt"]),
            helper.make_node("Add", ["m", "tt"], ["bias"]),
            helper.make_node("Reshape", ["bias", "b_shape"], ["bias4"]),
            helper.make_node("Add", ["s", "bias4"], ["noise_pred"]),
        ],
        [
            tensor_info("sample", ["B2", 4, "h", "w"]),
            tensor_info("timestep", ["B2"]),
            tensor_info("encoder_hidden_states", ["B2", TEXT_LEN, HIDDEN]),
        ],
        [tensor_info("noise_pred", ["B2", 4, "h", "w"])],
        [const("half", 0.5), const("thousand", 1000.0), const("b_shape", [-1, 1, 1, 1], np.int64)],
    )


def vae_decoder_model() -> onnx.ModelProto:
    return make_model(
        [
            helper.make_node("Resize", ["latent_sample", "", "scales"], ["up"], mode="nearest"),
            helper.make_node("Slice", ["up", "starts", "ends", "axes"], ["rgb"]),
            helper.make_node("Tanh", ["rgb"], ["sample"]),
        ],
        [tensor_info("latent_sample", ["B", 4, "h", "w"])],
        [tensor_info("sample", ["B", 3, "H", "W"])],
        [
            const("scales", [1.0, 1.0, 8.0, 8.0]),
            const("starts", [0], np.int64),
            const("ends", [3], np.int64),
            const("axes", [1], np.int64),
        ],
    )


def write_tokenizer(dest: Path, cache: Path | None = None) -> None:
    """Copy (or first write into ``cache``) the real CLIP tokenizer the compiler ships."""
    from diffusion_trt.compiler.dummy import write_clip_tokenizer

    if cache is None:
        write_clip_tokenizer(dest)
        return
    if not (cache / "tokenizer_config.json").is_file():
        write_clip_tokenizer(cache)
    shutil.copytree(cache, dest)


def write_toy_artifact(
    root: Path,
    *,
    batch: tuple[int, int, int] = (1, 1, 4),
    height: tuple[int, int, int] = (32, 64, 128),
    width: tuple[int, int, int] = (32, 64, 128),
    tokenizer_cache: Path | None = None,
    manifest_overrides: dict[str, Any] | None = None,
) -> Path:
    """Write a complete, verifiable toy artifact at ``root``; return ``root``."""
    profile = ShapeProfile(Range(*batch), Range(*height), Range(*width))
    specs = component_specs(text_hidden=HIDDEN, text_len=TEXT_LEN, unet_in=4, unet_out=4, latent=4)
    root.mkdir(parents=True)
    write_tokenizer(root / "tokenizer", tokenizer_cache)
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(SD15_SCHEDULER, indent=2))
    components: dict[str, Any] = {}
    for name, model in (
        ("text_encoder", text_encoder_model()),
        ("unet", unet_model()),
        ("vae_decoder", vae_decoder_model()),
    ):
        (root / name).mkdir()
        onnx.save_model(model, str(root / name / "model.onnx"))
        spec = specs[name]
        components[name] = {
            "onnx": f"{name}/model.onnx",
            "precision": "fp32",
            "inputs": [tensor_manifest(t, "fp32", profile) for t in spec.inputs],
            "outputs": [tensor_manifest(t, "fp32", profile) for t in spec.outputs],
            "passes": [],
        }
    files = {
        p.relative_to(root).as_posix(): artifacts.file_entry(root, p.relative_to(root).as_posix())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    manifest: dict[str, Any] = {
        "schema_version": artifacts.SCHEMA_VERSION,
        "name": root.name,
        "created_utc": "2026-01-01T00:00:00+00:00",
        "tools": {},
        "backend": "ort",
        "device": "cpu",
        "precision": "fp32",
        "profile": profile.to_json(),
        "model": {
            "vae_scale_factor": 8,
            "vae_scaling_factor": 0.18215,
            "unet_in_channels": 4,
            "unet_out_channels": 4,
            "latent_channels": 4,
            "text_max_length": TEXT_LEN,
            "text_hidden_size": HIDDEN,
            "default_height": height[1],
            "default_width": width[1],
        },
        "scheduler": {"class_name": "PNDMScheduler", "config": "scheduler/scheduler_config.json"},
        "tokenizer": "tokenizer",
        "components": components,
        "files": files,
    }
    manifest.update(manifest_overrides or {})
    artifacts.write_manifest(root, manifest)
    return root

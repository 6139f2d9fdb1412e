"""The dynamic ort-cuda graphs of a ControlNet artifact fuse as the plain UNet does (issue 25).

unet_controlnet is the UNet plus 13 residual Adds; with its residual inputs [B2, C, h/2, w/2] named apart from the
down path's dims, it fused 5 of the UNet's 45 SkipGroupNorms; controlnet_a (control image H = 8*h) fused none.
Since the conditioning embedding is a component of its own (cond_embed_a), controlnet_a takes the embedding
[B2, C0, h, w] in the latent's own dims: no dims are left to merge, and its ops are the unsplit graph's less the
embedding's (8 Conv, 7 SiLU = Sigmoid + Mul), which cond_embed_a holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diffusion_trt.compiler import controlnet, export
from diffusion_trt.compiler.components import component_specs
from diffusion_trt.compiler.dummy_controlnet import write_dummy_controlnet
from scripts import pass_goldens

#: The passes whose matches need both sides of an Add to have one shape.
SHAPE_FUSIONS = ("fuse_skip_layer_norm", "fuse_skip_group_norm", "merge_conv_biases", "cancel_transposes")


@pytest.fixture(scope="module")
def dynamic_counts(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Pass and op counts of unet, unet_controlnet, cond_embed_a and controlnet_a through the dynamic ort-cuda fp16
    pipeline."""
    work = tmp_path_factory.mktemp("cn_fusions")
    cn = write_dummy_controlnet(work / "cn", "tiny", seed=0)
    folder = export.check_model_folder(tiny_pipeline_dir)
    unet_config = folder.config("unet")
    sources = controlnet.check_controlnets((("a", str(cn)),), unet_config, folder.path)
    specs = dict(component_specs(text_hidden=32, text_len=77, unet_in=4, unet_out=4, latent=4))
    specs.update(controlnet.controlnet_specs(specs["unet"], unet_config, sources))
    profile = pass_goldens.profiles_for(64)["dynamic"]
    models = export.load_models(folder, "fp32", "cpu")
    models.update(controlnet.load_controlnets(sources, "cpu"))
    counts = {}
    for name in ("unet", controlnet.UNET_CONTROLNET, "cond_embed_a", "controlnet_a"):
        path = work / name / "model.onnx"
        export.onnx_from_component(name, models, specs[name], path, precision="fp32",
                                   profile_ranges=export.export_ranges(profile), opset=17, device="cpu")
        counts[name] = pass_goldens.component_counts(path, name, "ort", "cuda", "fp16", specs[name], profile)
    return counts


def test_unet_controlnet_fuses_every_site_the_unet_fuses(dynamic_counts: dict[str, dict[str, Any]]) -> None:
    unet, residual = dynamic_counts["unet"], dynamic_counts[controlnet.UNET_CONTROLNET]
    for name in SHAPE_FUSIONS:
        assert residual["passes"][name] == unet["passes"][name], name
    assert residual["passes"]["infer_symbolic_shapes"]["dims_merged"] == 6  # h/2, h/4, h/8 and w's
    ops = dict(unet["ops"])
    ops["Add"] = ops.get("Add", 0) + 13  # the residual Adds, nothing else
    assert residual["ops"] == ops


def test_a_controlnet_rejects_no_skip_fusion(dynamic_counts: dict[str, dict[str, Any]]) -> None:
    passes = dynamic_counts["controlnet_a"]["passes"]
    # 0: the embedding comes in as [B2, C0, h, w]; unsplit, the image embedding's dims (from H) were merged with h, w
    assert passes["infer_symbolic_shapes"]["dims_merged"] == 0
    assert passes["fuse_skip_layer_norm"]["rejected"] == passes["fuse_skip_group_norm"]["rejected"] == 0
    assert passes["fuse_skip_layer_norm"]["SkipLayerNormalization"] == 14  # 7 transformer blocks x 2
    assert passes["fuse_skip_group_norm"]["SkipGroupNorm"] == 24


def test_the_embedding_is_its_own_graph(dynamic_counts: dict[str, dict[str, Any]]) -> None:
    """cond_embed_a is the tiny ControlNet's conditioning embedding, conv_in + 3 x (conv, strided conv) + conv_out,
    SiLU after all but conv_out; controlnet_a keeps none of it (the unsplit controlnet_a had Conv 49, Sigmoid 9)."""
    assert dynamic_counts["cond_embed_a"]["ops"] == {"Conv": 8, "Mul": 7, "Sigmoid": 7}
    ops = dynamic_counts["controlnet_a"]["ops"]
    assert ops["Conv"] == 41 and ops["Sigmoid"] == 2

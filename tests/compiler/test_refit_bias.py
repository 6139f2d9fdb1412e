"""``compile --refittable`` on ONNX Runtime CUDA: the bias of each 1x1 Conv rewritten as a MatMul over a weight input
(pointwise_convs_as_matmul) costs no Add of its own where ORT has a kernel to take it (fuse_bias's channels-last
form: proj_out's bias and the residual in one BiasAdd; issue 26). Counted on the graphs (no GPU needed): the tiny
UNet (widths 16/32, which the BiasAdd kernel refuses) and a one-block UNet of SD's width 320."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest

from diffusion_trt.passes.fuse_bias import BIAS_ADD_CHANNELS
from tests import graphs

#: The fp16 range check off: it cannot run the CUDA graph here (no CUDA provider) and took 16 s per wide compile.
CUDA_FP16: dict[str, Any] = {"device": "cuda", "precision": "fp16", "components": ("unet",),
                             "pass_options": {"convert_fp16_range_check": False}}

#: A UNet2DConditionModel of SD-1.5's shape at SD's narrowest width, one block each way (a CPU export of ~20 M
#: parameters): its proj_out sites have the 320 channels the BiasAdd kernel takes.
WIDE_UNET: dict[str, Any] = {"block_out_channels": [320], "down_block_types": ["CrossAttnDownBlock2D"],
                             "up_block_types": ["CrossAttnUpBlock2D"], "layers_per_block": 1, "norm_num_groups": 32,
                             "attention_head_dim": 8}


def _compile(model_dir: Path, out: Path, refittable: bool) -> tuple[onnx.GraphProto, dict[str, Any]]:
    import json

    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig

    art = compile_pipeline(model_dir, out, CompileConfig(refittable=refittable, **CUDA_FP16))
    manifest = json.loads((art / "manifest.json").read_text())
    return onnx.load(str(art / "unet" / "model.onnx"), load_external_data=False).graph, manifest


def _unets(model_dir: Path, tmp: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, refittable in (("refittable", True), ("plain", False)):
        out[kind], out[f"{kind}-manifest"] = _compile(model_dir, tmp.mktemp(kind) / "art", refittable)
    return out


@pytest.fixture(scope="module")
def tiny_cuda_unets(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny UNet compiled for ORT CUDA fp16 (dynamic profile), refittable and plain."""
    return _unets(tiny_pipeline_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def wide_cuda_unets(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny pipeline with :data:`WIDE_UNET` in place of its UNet, compiled as :func:`tiny_cuda_unets`."""
    import json

    import torch
    from diffusers import UNet2DConditionModel

    model_dir = tmp_path_factory.mktemp("models") / "wide"
    shutil.copytree(tiny_pipeline_dir, model_dir)
    config = json.loads((model_dir / "unet" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")} | WIDE_UNET
    shutil.rmtree(model_dir / "unet")
    torch.manual_seed(0)
    UNet2DConditionModel(**config).save_pretrained(model_dir / "unet")
    return _unets(model_dir, tmp_path_factory)


def _proj_out_bias_adds(graph: onnx.GraphProto) -> list[int]:
    """The widths of the bias Adds after a MatMul over a weight input (a graph input) whose sum goes through a
    Transpose into another Add: a rewritten 1x1 Conv's bias beside the residual (fuse_bias's channels-last sites)."""
    inputs = {i.name for i in graph.input}
    inits = {t.name: list(t.dims) for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    widths = []
    for node in graph.node:
        matmul = producers.get(node.input[0]) if node.op_type == "Add" else None
        if matmul is None or matmul.op_type != "MatMul" or matmul.input[1] not in inputs or node.input[1] not in inits:
            continue
        after = readers.get(node.output[0], [])
        if [n.op_type for n in after] == ["Transpose"] and [n.op_type for n in readers[after[0].output[0]]] == ["Add"]:
            widths.append(inits[node.input[1]][-1])
    return widths


def _passes(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return manifest["components"]["unet"]["passes"]


def test_tiny_refittable_unet_has_the_plain_adds_plus_only_biases_the_bias_add_kernel_refuses(
    tiny_cuda_unets: dict[str, Any]
) -> None:
    """Every Add the refittable graph has beyond the plain one's is a proj_out bias whose width (16 or 32) ORT's
    BiasAdd kernel refuses; fuse_bias ran after the rewrite and turned each down for that."""
    refit, plain = (graphs.op_counts(onnx.ModelProto(graph=tiny_cuda_unets[k])) for k in ("refittable", "plain"))
    widths = _proj_out_bias_adds(tiny_cuda_unets["refittable"])
    assert widths and not set(widths) & BIAS_ADD_CHANNELS, widths
    assert refit["Add"] == plain["Add"] + len(widths)
    assert refit.get("BiasAdd", 0) == plain.get("BiasAdd", 0)
    names = [r["name"] for r in _passes(tiny_cuda_unets["refittable-manifest"])]
    assert names[-2:] == ["pointwise_convs_as_matmul", "fuse_bias"]
    record = _passes(tiny_cuda_unets["refittable-manifest"])[-1]
    assert record["counts"]["BiasAdd"] == 0
    assert sum(n for why, n in record["rejections"].items() if "BiasAdd CUDA kernel takes" in why) >= len(widths)


def test_wide_refittable_unet_has_no_more_adds_than_the_plain_one(wide_cuda_unets: dict[str, Any]) -> None:
    """At width 320 each proj_out bias and the residual after it are one BiasAdd: no proj_out bias Add is left, the
    refittable graph has fewer Adds than the plain one (whose proj_out is a Conv + the residual Add), and its weight
    inputs are still read by MatMuls (Gemms: the time embedding's) alone, where a LoRA bound there counts."""
    graph = wide_cuda_unets["refittable"]
    refit, plain = (graphs.op_counts(onnx.ModelProto(graph=wide_cuda_unets[k])) for k in ("refittable", "plain"))
    record = _passes(wide_cuda_unets["refittable-manifest"])[-1]
    sites = record["counts"]["BiasAdd"]
    assert record["name"] == "fuse_bias" and sites > 0 and record["counts"]["rejected"] == 0
    assert _proj_out_bias_adds(graph) == []
    assert refit["BiasAdd"] == plain["BiasAdd"] + sites
    assert refit["Add"] == plain["Add"] - sites  # the residual Adds went into the BiasAdds too
    weights = {i.name for i in graph.input if len(i.type.tensor_type.shape.dim) == 2}
    readers = {(n.op_type, list(n.input).index(name)) for n in graph.node for name in n.input if name in weights}
    assert weights and readers <= {("MatMul", 1), ("Gemm", 1)}, readers

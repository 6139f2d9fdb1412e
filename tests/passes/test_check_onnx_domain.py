"""check_onnx_domain: a TensorRT graph holds ai.onnx ops only; a contrib op anywhere (subgraphs too) is refused."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from diffusion_trt.errors import PassError
from diffusion_trt.passes import PassContext, optimize_model, pipeline_for
from diffusion_trt.passes.check_onnx_domain import check_onnx_domain
from tests import graphs
from tests.passes.test_fuse_gelu import erf_gelu_model, quick_gelu_model
from tests.passes.test_fuse_group_norm import group_norm_model

SHAPE = [2, 8]


def _check(model: onnx.ModelProto, backend: str = "tensorrt-rtx") -> tuple[onnx.ModelProto, dict[str, int]]:
    ctx = PassContext(component="unet", backend=backend, device="cuda", precision="fp32")
    out, records = optimize_model(model, [check_onnx_domain], ctx)
    return out, records[0].counts


def _contrib_model(op: str = "QuickGelu", count: int = 1) -> onnx.ModelProto:
    nodes = [helper.make_node("Relu", ["x"], ["r"])]
    last = "r"
    for i in range(count):
        nodes.append(helper.make_node(op, [last], [f"q{i}"], name=f"{op}_{i}", domain="com.microsoft"))
        last = f"q{i}"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    return graphs.make_model(nodes, [graphs.tensor_info("x", SHAPE)], [graphs.tensor_info("y", SHAPE)],
                             extra_opsets=[("com.microsoft", 1)], check=False)


def test_standard_graph_passes_unchanged() -> None:
    model = graphs.mlp_model()
    out, counts = _check(model)
    assert counts == {"nodes": len(model.graph.node), "foreign": 0}
    assert graphs.op_counts(out) == graphs.op_counts(model)
    graphs.assert_same_outputs(model, out)


@pytest.mark.parametrize("op", ["QuickGelu", "MultiHeadAttention", "SkipLayerNormalization", "GroupNorm"])
def test_contrib_op_is_refused_with_its_name_and_count(op: str) -> None:
    with pytest.raises(PassError, match=rf"pass check_onnx_domain failed .*2 node\(s\) outside the default ONNX "
                                        rf"domain.*com\.microsoft\.{op} x2 \(e\.g\. '{op}_0'\).*--backend ort"):
        _check(_contrib_model(op, count=2))


def test_contrib_op_inside_a_subgraph_is_refused() -> None:
    then = helper.make_graph([helper.make_node("QuickGelu", ["x"], ["t"], domain="com.microsoft")], "then", [],
                             [graphs.tensor_info("t", SHAPE)])
    other = helper.make_graph([helper.make_node("Relu", ["x"], ["e"])], "else", [], [graphs.tensor_info("e", SHAPE)])
    model = graphs.make_model(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)],
        [graphs.tensor_info("x", SHAPE), graphs.tensor_info("cond", [], onnx.TensorProto.BOOL)],
        [graphs.tensor_info("y", SHAPE)], extra_opsets=[("com.microsoft", 1)], check=False)
    with pytest.raises(PassError, match=r"com\.microsoft\.QuickGelu x1"):
        _check(model)


@pytest.mark.parametrize("name", ["group_norm", "erf_gelu", "quick_gelu", "attention"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tensorrt_rtx_pipeline_emits_what_tensorrt_does_and_only_ai_onnx(name: str, precision: str) -> None:
    """The whole TensorRT pipeline, ending in the check, for tensorrt and tensorrt-rtx: the same graph, no
    foreign domain; and the ORT CUDA pipeline on the same graph does emit contrib ops (so the check can fire)."""
    model = {"group_norm": lambda: group_norm_model(silu=True), "erf_gelu": erf_gelu_model,
             "quick_gelu": quick_gelu_model, "attention": lambda: graphs.attention_model(mask=True)}[name]()
    outs = {}
    for backend in ("tensorrt", "tensorrt-rtx", "ort"):
        ctx = PassContext(component="unet", backend=backend, device="cuda", precision=precision)
        outs[backend], records = optimize_model(model, pipeline_for(backend, "cuda", precision, "unet"), ctx)
        if backend != "ort":
            assert records[-1].name == "check_onnx_domain"
            assert records[-1].counts["foreign"] == 0
    assert graphs.op_counts(outs["tensorrt-rtx"]) == graphs.op_counts(outs["tensorrt"])
    assert {n.domain for n in outs["tensorrt-rtx"].graph.node} <= {""}
    assert any(n.domain == "com.microsoft" for n in outs["ort"].graph.node)
    if precision == "fp32":
        graphs.assert_same_outputs(model, outs["tensorrt-rtx"])


def test_ort_attention_asked_for_on_tensorrt_is_refused_before_the_parser() -> None:
    """``--pass-option fuse_attention_emit=mha`` on a TensorRT build: the pipeline's last pass names the op (the
    TensorRT-RTX 1.7.1 parser would crash the process on it)."""
    model = graphs.attention_model()
    ctx = PassContext(component="unet", backend="tensorrt-rtx", device="cuda", precision="fp16",
                      options={"fuse_attention_emit": "mha"})
    with pytest.raises(PassError, match=r"check_onnx_domain.*com\.microsoft\.MultiHeadAttention x1"):
        optimize_model(model, pipeline_for("tensorrt-rtx", "cuda", "fp16", "unet"), ctx)

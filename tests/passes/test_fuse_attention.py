"""fuse_attention: synthetic SDPA / eager attention graphs and the real tiny UNet and CLIP exports."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import helper

from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes.fuse_attention import fuse_attention
from tests import graphs


def ctx(backend: str = "ort", device: str = "cpu", **options: object) -> PassContext:
    return PassContext(component="unet", backend=backend, device=device, precision="fp32", options=dict(options))


def fused(model: onnx.ModelProto, context: PassContext) -> tuple[onnx.ModelProto, dict[str, int]]:
    out, records = optimize_model(model, [fuse_attention], context)
    return out, records[0].counts


@pytest.mark.parametrize("kwargs", [{}, {"static": False}, {"cross": True}, {"static": False, "cross": True},
                                    {"post_scale": True, "mask": True}, {"static": False, "batch": "B"}],
                         ids=["static", "dynamic", "cross", "dynamic-cross", "eager-masked", "symbolic-batch"])
def test_fuses_to_multi_head_attention(kwargs: dict) -> None:
    model = graphs.attention_model(**kwargs)
    out, counts = fused(model, ctx())
    assert counts["Attention"] == 1 and counts["rejected"] == 0
    assert counts["cross" if kwargs.get("cross") else "self"] == 1
    assert counts["masked"] == int(bool(kwargs.get("mask")))
    ops = graphs.op_counts(out)
    assert ops.get("MultiHeadAttention") == 1 and "Softmax" not in ops and "Transpose" not in ops
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in mha.attribute}
    assert mha.domain == "com.microsoft" and attrs["num_heads"] == 2
    assert attrs["scale"] == pytest.approx(0.5)  # 1/sqrt(head_dim=4)
    graphs.assert_same_outputs(model, out, graphs.random_feeds(model, dims={"B": 3}))


@pytest.mark.parametrize("kwargs", [{}, {"static": False}, {"post_scale": True, "mask": True}],
                         ids=["static", "dynamic", "eager-masked"])
def test_tensorrt_form_has_one_constant_scale_on_q(kwargs: dict) -> None:
    model = graphs.attention_model(**kwargs)
    out, counts = fused(model, ctx("tensorrt", "cuda"))
    assert counts["Attention"] == 1
    ops = graphs.op_counts(out)
    assert "Sqrt" not in ops and ops["Softmax"] == 1 and ops["Mul"] == 1  # the Shape-computed scale is gone
    graph = gs.import_onnx(out)
    qk = next(n for n in graph.nodes if n.op == "MatMul" and n.outputs[0].outputs[0].op in ("Softmax", "Add"))
    scale = qk.inputs[0].inputs[0]
    assert scale.op == "Mul" and float(scale.inputs[1].values) == pytest.approx(0.5)
    assert qk.inputs[1].inputs[0].op == "Transpose"
    graphs.assert_same_outputs(model, out)


def test_emit_none_only_counts() -> None:
    model = graphs.attention_model()
    out, counts = fused(model, ctx(fuse_attention_emit="none"))
    assert counts["matched"] == 1 and counts["Attention"] == 0
    assert graphs.op_counts(out) == graphs.op_counts(model)


def test_probabilities_with_a_second_reader_are_rejected(caplog: pytest.LogCaptureFixture) -> None:
    model = graphs.attention_model()
    model.graph.output.append(graphs.tensor_info("p", None))  # the attention map is also a graph output
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.fuse_attention"):
        out, counts = fused(model, ctx())
    assert counts["Attention"] == 0 and counts["rejected"] == 1
    assert "'p' has 2 consumers" in caplog.text or "'p' is a graph output" in caplog.text
    assert "MultiHeadAttention" not in graphs.op_counts(out)


def test_softmax_over_another_axis_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    model = graphs.attention_model()
    next(n for n in model.graph.node if n.op_type == "Softmax").attribute[0].i = 2
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.fuse_attention"):
        _, counts = fused(model, ctx())
    assert counts == {"Attention": 0, "self": 0, "cross": 0, "masked": 0, "rejected": 1}
    assert "Softmax axis 2 is not the last" in caplog.text


def test_unknown_hidden_size_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    model = graphs.attention_model()
    del model.graph.value_info[:]  # no inferred shapes: head split cannot be proven
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.fuse_attention"):
        _, counts = fused(model, ctx())
    assert counts["Attention"] == 0 and counts["rejected"] == 1
    assert "is not rank 3" in caplog.text or "unknown" in caplog.text


def test_unknown_emit_option_is_an_error() -> None:
    with pytest.raises(Exception, match="fuse_attention_emit='flash' is unknown"):
        fused(graphs.attention_model(), ctx(fuse_attention_emit="flash"))


# --- real exports: same counts on static and dynamic exports ------------------------------------------------


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_tiny_unet_has_32_sites(tiny_onnx: Callable[[str, bool], onnx.ModelProto], static: bool) -> None:
    model = tiny_onnx("unet", static)
    out, counts = fused(model, ctx())
    assert counts == {"Attention": 32, "self": 16, "cross": 16, "masked": 0, "rejected": 0}
    assert graphs.op_counts(out)["MultiHeadAttention"] == 32 and "Softmax" not in graphs.op_counts(out)
    feeds = graphs.random_feeds(model, dims={"B2": 2, "h": 9, "w": 7})
    graphs.assert_same_outputs(model, out, feeds)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_tiny_unet_tensorrt_form(tiny_onnx: Callable[[str, bool], onnx.ModelProto], static: bool) -> None:
    model = tiny_onnx("unet", static)
    out, counts = fused(model, ctx("tensorrt", "cuda"))
    assert counts["Attention"] == 32
    graphs.assert_same_outputs(model, out, graphs.random_feeds(model, dims={"B2": 2, "h": 9, "w": 7}))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_tiny_clip_causal_attention(tiny_onnx: Callable[[str, bool], onnx.ModelProto], static: bool) -> None:
    model = tiny_onnx("text_encoder", static)
    out, counts = fused(model, ctx())
    assert counts == {"Attention": 2, "self": 2, "cross": 0, "masked": 2, "rejected": 0}
    feeds = {"input_ids": np.random.default_rng(0).integers(0, 49408, (2, 77))}
    graphs.assert_same_outputs(model, out, feeds)

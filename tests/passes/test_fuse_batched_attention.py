"""fuse_batched_attention: rank-3 heads-in-batch attention (guided-diffusion form) -> MultiHeadAttention(1 head)."""

from __future__ import annotations

import numpy as np
from onnx import helper

from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes.fuse_batched_attention import fuse_batched_attention
from diffusion_trt.passes.infer_shapes import infer_shapes
from diffusion_trt.passes.lower_einsum import lower_einsum
from tests import graphs
from tests.passes.fusion_helpers import domains


def _run(model, backend: str = "ort", device: str = "cpu"):
    ctx = PassContext(component="unet", backend=backend, device=device, precision="fp32")
    out, records = optimize_model(model, [infer_shapes, lower_einsum, fuse_batched_attention], ctx)
    return out, records[-1]


def matmul_attention_model(bh: int = 4, t: int = 6, s: int = 5, d: int = 8, scale: float = 0.35):
    """q[BH,T,d] @ k^T[BH,d,S] * scale -> Softmax -> @ v[BH,S,d]: the row-major form."""
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["w"]), helper.make_node("Mul", ["w", "sc"], ["ws"]),
             helper.make_node("Softmax", ["ws"], ["p"], axis=-1), helper.make_node("MatMul", ["p", "v"], ["out"])]
    return graphs.make_model(nodes, [graphs.tensor_info("q", [bh, t, d]), graphs.tensor_info("kt", [bh, d, s]),
                                     graphs.tensor_info("v", [bh, s, d])],
                             [graphs.tensor_info("out", [bh, t, d])], [graphs.const("sc", scale)])


def test_fires_on_the_guided_diffusion_form() -> None:
    model = graphs.einsum_attention_model()
    out, record = _run(model)
    assert record.counts["Attention"] == 1 and record.counts["Transpose"] == 3
    assert domains(out).get("com.microsoft") == 1
    assert "Softmax" not in graphs.op_counts(out)
    graphs.assert_same_outputs(model, out)


def test_fires_on_the_row_major_form() -> None:
    model = matmul_attention_model()
    out, record = _run(model)
    assert record.counts["Attention"] == 1 and record.counts["Transpose"] == 1  # K only
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    attrs = {a.name: helper.get_attribute_value(a) for a in mha.attribute}
    assert attrs["num_heads"] == 1 and np.isclose(attrs["scale"], 0.35)
    graphs.assert_same_outputs(model, out)


def test_tensorrt_leaves_it_and_says_so() -> None:
    out, record = _run(graphs.einsum_attention_model(), backend="tensorrt", device="cuda")
    assert record.counts["Attention"] == 0 and record.counts["skipped_for_target"] == 1
    assert "Softmax" in graphs.op_counts(out)


def test_must_not_fire_when_the_scores_are_read_elsewhere() -> None:
    model = matmul_attention_model()
    model.graph.output.append(helper.make_tensor_value_info("w", 1, None))  # the raw scores are an output too
    out, record = _run(model)
    assert record.counts["Attention"] == 0 and record.counts["rejected"] == 1
    assert any("graph output" in reason for reason in record.rejections)
    graphs.assert_same_outputs(model, out)

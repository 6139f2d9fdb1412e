"""convert_fp16 with ``convert_fp16_fp32_attention`` (SD 2.x ``upcast_attention``): attention scores stay fp32.

The failure it prevents: Q.K^T past 65504 becomes inf in fp16, the Softmax gives NaN, the image is black.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes.convert_fp16 import convert_fp16
from diffusion_trt.passes.fuse_attention import fuse_attention
from tests import graphs


def ctx(**options: object) -> PassContext:
    return PassContext(component="unet", backend="ort", device="cuda", precision="fp16", options=dict(options))


def dtypes(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every typed tensor of the main graph (inputs, outputs, value_info)."""
    model = onnx.shape_inference.infer_shapes(model)
    return {v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output,
                                                           *model.graph.value_info)}


def producer_types(model: onnx.ModelProto, op: str) -> list[int]:
    """The dtype of the first output of every node of type ``op``."""
    types = dtypes(model)
    return [types[n.output[0]] for n in model.graph.node if n.op_type == op]


F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


def test_unfused_scores_stay_fp32_and_the_overflow_is_gone() -> None:
    """CLIP-eager form with a mask: MatMul(Q, K^T) -> Mul(scale) -> Add(mask) -> Softmax kept fp32, the rest fp16."""
    model = graphs.attention_model(post_scale=True, mask=True)
    out, records = optimize_model(model, (convert_fp16,), ctx(convert_fp16_fp32_attention=True))
    assert records[0].counts["fp32_attention"] == 1
    onnx.checker.check_model(out, full_check=True)
    types = dtypes(out)
    assert types["qk0"] == types["qk"] == types["qkb"] == types["p"] == F32  # the scores path and the Softmax
    assert types["a"] == F16  # probabilities x V: fp16 again
    assert types["q3"] == F16 and types["y"] == F16

    # inputs where Q.K^T passes 65504: the plain conversion types those scores fp16 (a GPU kernel writes inf there,
    # the Softmax then NaN). ORT's CPU provider computes fp16 MatMuls in fp32 (its inserted Casts), so the overflow
    # itself only shows on a GPU: here the types are checked, and the island's outputs against fp32.
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_tensor_value_info("qk0", F32, None))
    feeds = {"x": graphs.random_feeds(model)["x"] * 200.0}
    want, scores = graphs.run(probe, feeds)
    assert np.abs(scores).max() > np.finfo(np.float16).max and np.isfinite(want).all()
    plain, _ = optimize_model(model, (convert_fp16,), ctx())
    assert dtypes(plain)["qk0"] == F16
    got = graphs.run(out, {"x": feeds["x"].astype(np.float16)})[0].astype(np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_not_asked_nothing_kept() -> None:
    model = graphs.attention_model(post_scale=True, mask=True)
    out, records = optimize_model(model, (convert_fp16,), ctx())
    assert "fp32_attention" not in records[0].counts  # the count exists only with the option (goldens unchanged)
    assert producer_types(out, "Softmax") == [F16]


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_sdpa_form_scaled_on_q_and_k(static: bool) -> None:
    """The SDPA export (sqrt-scale on Q and on K^T before the MatMul): the island starts at the MatMul."""
    model = graphs.attention_model(static=static)
    out, records = optimize_model(model, (convert_fp16,), ctx(convert_fp16_fp32_attention=True))
    assert records[0].counts["fp32_attention"] == 1
    types = dtypes(out)
    assert types["qk"] == types["p"] == F32 and types["a"] == F16
    feeds = graphs.random_feeds(model, dims={"B": 2})
    np.testing.assert_allclose(graphs.run(out, {"x": feeds["x"].astype(np.float16)})[0].astype(np.float32),
                               graphs.run(model, feeds)[0], rtol=2e-2, atol=2e-2)


def test_fused_attention_runs_whole_in_fp32() -> None:
    """After fuse_attention (ORT: com.microsoft MultiHeadAttention) the scores live in the kernel: the op is fp32."""
    model = graphs.attention_model(cross=True)
    fused, records = optimize_model(model, (fuse_attention, convert_fp16), ctx(convert_fp16_fp32_attention=True))
    assert records[0].counts["Attention"] == 1 and records[1].counts["fp32_attention"] == 1
    mha = [n for n in fused.graph.node if n.op_type == "MultiHeadAttention"]
    types = dtypes(fused)
    assert len(mha) == 1 and all(types[t] == F32 for t in (*mha[0].input[:3], mha[0].output[0]) if t)
    assert types["y"] == F16  # the projections around it stay fp16
    feeds = graphs.random_feeds(model)
    got = graphs.run(fused, {k: v.astype(np.float16) for k, v in feeds.items()})[0].astype(np.float32)
    np.testing.assert_allclose(got, graphs.run(model, feeds)[0], rtol=2e-2, atol=2e-2)

"""pack_qkv: the packed Q/K/V projections ORT CUDA's MultiHeadAttention reads, on the synthetic attention graphs.

ORT's CPU provider has no packed MultiHeadAttention, so the CPU checks run the packed projection alone (the
attention node cut off) and compare its [B, S, N, J, d] view with the separate projections; the CUDA parity
test (marked ``gpu``) runs the whole packed graph.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import helper

from diffusion_trt.passes.fuse_attention import fuse_attention
from diffusion_trt.passes.pack_qkv import pack_qkv, pack_weights
from tests import graphs
from tests.passes.fusion_helpers import assert_cuda_parity, fuse, reasons

HEADS, HEAD_DIM = 2, 4


def attention(**kwargs: object) -> onnx.ModelProto:
    """The fused (MultiHeadAttention) form of graphs.attention_model, for ORT CUDA."""
    model, counts = fuse(graphs.attention_model(heads=HEADS, head_dim=HEAD_DIM, **kwargs), fuse_attention,
                         device="cuda")
    assert counts["Attention"] == 1
    return model


def packed_view(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` cut before its MultiHeadAttention: the attention's packed input is the one graph output."""
    graph = gs.import_onnx(model)
    mha = next(n for n in graph.nodes if n.op == "MultiHeadAttention")
    packed = mha.inputs[0] if not mha.inputs[1].name else mha.inputs[1]
    packed.dtype = np.float32
    graph.outputs = [packed]
    return gs.export_onnx(graph.cleanup())


def projections(**kwargs: object) -> dict[str, np.ndarray]:
    """q3, k3, v3 of the unfused graph on the default random feeds."""
    model = graphs.attention_model(heads=HEADS, head_dim=HEAD_DIM, **kwargs)
    del model.graph.output[:]
    for name in ("q3", "k3", "v3"):
        model.graph.output.append(graphs.tensor_info(name, None))
    return dict(zip(("q", "k", "v"), graphs.run(model, graphs.random_feeds(model)), strict=True))


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_packs_the_projections_into_one_matmul(cross: bool) -> None:
    model = attention(cross=cross)
    out, counts = fuse(model, pack_qkv, device="cuda", pack_qkv=True)
    assert counts == {"packed_qkv": int(not cross), "packed_kv": int(cross), "rejected": 0, "skipped_for_target": 0}
    before, after = graphs.op_counts(model), graphs.op_counts(out)
    assert after["MatMul"] == before["MatMul"] - (1 if cross else 2)
    mha = next(n for n in out.graph.node if n.op_type == "MultiHeadAttention")
    if cross:
        assert mha.input[0] == "q3" and mha.input[1] and not mha.input[2]
    else:
        assert mha.input[0] and not mha.input[1] and not mha.input[2]
    onnx.checker.check_model(out, full_check=True)


@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_the_packed_layout_holds_each_heads_q_k_v(cross: bool) -> None:
    """[B, S, N, J, d][..., n, j, :] == projection_j[..., n*d:(n+1)*d]: ORT's QKV_BSN3H / Q_KV_BSNH_BSN2H."""
    out, _ = fuse(attention(cross=cross), pack_qkv, device="cuda", pack_qkv=True)
    cut = packed_view(out)
    feeds = graphs.random_feeds(graphs.attention_model(heads=HEADS, head_dim=HEAD_DIM, cross=cross))
    (view,) = graphs.run(cut, {k: v for k, v in feeds.items() if k in {i.name for i in cut.graph.input}})
    want = projections(cross=cross)
    roles = ("k", "v") if cross else ("q", "k", "v")
    assert view.shape[2:] == (HEADS, len(roles), HEAD_DIM)
    for j, role in enumerate(roles):
        ref = want[role].reshape(*want[role].shape[:2], HEADS, HEAD_DIM)
        np.testing.assert_allclose(view[:, :, :, j, :], ref, rtol=1e-5, atol=1e-5)


def test_pack_weights_interleaves_per_head() -> None:
    wq, wk = np.arange(12.0).reshape(2, 6), -np.arange(12.0).reshape(2, 6)  # D=2, N=3 heads of d=2
    packed = pack_weights([wq, wk], heads=3)
    assert packed.shape == (2, 12)
    np.testing.assert_array_equal(packed[:, 0:2], wq[:, 0:2])  # head 0: q, then k
    np.testing.assert_array_equal(packed[:, 2:4], wk[:, 0:2])
    np.testing.assert_array_equal(packed[:, 4:6], wq[:, 2:4])  # head 1
    np.testing.assert_array_equal(packed[:, 10:12], wk[:, 4:6])  # head 2's k


@pytest.mark.parametrize(("backend", "device"), [("ort", "cpu"), ("tensorrt", "cuda")])
def test_other_targets_are_left_alone(backend: str, device: str) -> None:
    model = attention()
    out, counts = fuse(model, pack_qkv, backend=backend, device=device)
    assert counts["skipped_for_target"] == 1 and counts["packed_qkv"] == 0
    assert graphs.op_counts(out) == graphs.op_counts(model)


def test_off_by_default() -> None:
    model = attention()
    out, counts = fuse(model, pack_qkv, device="cuda")
    assert counts["disabled"] == 1 and counts["packed_qkv"] == 0
    assert graphs.op_counts(out) == graphs.op_counts(model)


def test_a_masked_attention_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    model = attention(post_scale=True, mask=True)  # CLIP's eager form: attention_bias input
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.pack_qkv"):
        out, counts = fuse(model, pack_qkv, device="cuda", pack_qkv=True)
    assert counts["rejected"] == 1 and counts["packed_qkv"] == 0
    assert any("bias, mask or attention_bias" in r for r in reasons(caplog, "pack_qkv"))
    assert graphs.op_counts(out) == graphs.op_counts(model)


def test_a_projection_read_twice_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    model = attention()
    model.graph.output.append(graphs.tensor_info("k3", None))  # K's projection is also a graph output
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.pack_qkv"):
        _, counts = fuse(model, pack_qkv, device="cuda", pack_qkv=True)
    assert counts["rejected"] == 1
    assert any("'k3'" in r and "also read" in r for r in reasons(caplog, "pack_qkv"))


def test_a_biased_projection_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    model = attention()
    mm = next(n for n in model.graph.node if n.op_type == "MatMul" and n.output[0] == "v3")
    mm.output[0] = "v3_raw"
    index = list(model.graph.node).index(mm)
    model.graph.node.insert(index + 1, helper.make_node("Add", ["v3_raw", "bv"], ["v3"]))
    model.graph.initializer.append(graphs.const("bv", np.ones(HEADS * HEAD_DIM)))
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.pack_qkv"):
        _, counts = fuse(model, pack_qkv, device="cuda", pack_qkv=True)
    assert counts["rejected"] == 1
    assert any("is not a MatMul output" in r for r in reasons(caplog, "pack_qkv"))


@pytest.mark.gpu
@pytest.mark.parametrize("cross", [False, True], ids=["self", "cross"])
def test_packed_attention_cuda_parity(cross: bool) -> None:
    """The packed graph on ORT CUDA gives the unfused graph's outputs (fp32, TF32 off)."""
    reference = graphs.attention_model(heads=HEADS, head_dim=HEAD_DIM, cross=cross)
    out, counts = fuse(attention(cross=cross), pack_qkv, device="cuda", pack_qkv=True)
    assert counts["packed_kv" if cross else "packed_qkv"] == 1
    assert_cuda_parity(reference, out)

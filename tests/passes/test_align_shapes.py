"""align_shapes: channel counts padded to multiples of 8 with zero weights, outputs sliced back, numerics unchanged."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.passes.align_shapes import align_shapes, padded
from tests import graphs
from tests.passes.fusion_helpers import fuse, reasons

N, H, W = 2, 5, 7


def _conv(name: str, x: str, y: str, cin: int, cout: int, k: int, rng: np.random.Generator, bias: bool = True,
          group: int = 1) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    inits = [graphs.const(f"{name}.w", rng.standard_normal((cout, cin // group, k, k)) * 0.3)]
    inputs = [x, f"{name}.w"]
    if bias:
        inits.append(graphs.const(f"{name}.b", rng.standard_normal(cout)))
        inputs.append(f"{name}.b")
    node = helper.make_node("Conv", inputs, [y], name=name, kernel_shape=[k, k], pads=[k // 2] * 4, group=group)
    return node, inits


def unet_like(bias: bool = True) -> onnx.ModelProto:
    """sample[N,4,H,W] -> conv_in 4->16 -> SiLU-ish Relu -> conv_out 16->4 -> noise_pred (a graph output)."""
    rng = np.random.default_rng(0)
    conv_in, i1 = _conv("conv_in", "sample", "h", 4, 16, 3, rng)
    conv_out, i2 = _conv("conv_out", "r", "noise_pred", 16, 4, 3, rng, bias=bias)
    model = graphs.make_model([conv_in, helper.make_node("Relu", ["h"], ["r"]), conv_out],
                              [graphs.tensor_info("sample", [N, 4, H, W])],
                              [graphs.tensor_info("noise_pred", [N, 4, H, W])], i1 + i2)
    return onnx.shape_inference.infer_shapes(model)


def vae_like() -> onnx.ModelProto:
    """latent[N,4,H,W] -> post_quant_conv 1x1 4->4 -> conv_in 4->16 -> conv_out 16->3 (RGB)."""
    rng = np.random.default_rng(1)
    pq, i1 = _conv("post_quant_conv", "latent", "z", 4, 4, 1, rng)
    ci, i2 = _conv("conv_in", "z", "h", 4, 16, 3, rng)
    co, i3 = _conv("conv_out", "h", "image", 16, 3, 3, rng)
    model = graphs.make_model([pq, ci, co], [graphs.tensor_info("latent", [N, 4, H, W])],
                              [graphs.tensor_info("image", [N, 3, H, W])], i1 + i2 + i3)
    return onnx.shape_inference.infer_shapes(model)


def _weights(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


def _conv_weight_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    weights = _weights(model)
    return {node.name: weights[node.input[1]].shape for node in model.graph.node if node.op_type == "Conv"}


def test_padded() -> None:
    assert [padded(c) for c in (3, 4, 8, 9, 320)] == [8, 8, 8, 16, 320]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_unet_conv_in_and_conv_out_are_padded(bias: bool) -> None:
    model = unet_like(bias)
    out, counts = fuse(model, align_shapes, "ort", "cuda")
    onnx.checker.check_model(out, full_check=True)
    assert counts == {"inputs_padded": 1, "outputs_padded": 1, "Pad": 1, "Slice": 1, "rejected": 0}
    assert _conv_weight_shapes(out) == {"conv_in": (16, 8, 3, 3), "conv_out": (8, 16, 3, 3)}
    assert graphs.op_counts(out) == {"Pad": 1, "Conv": 2, "Relu": 1, "Slice": 1}
    assert [o.name for o in out.graph.output] == ["noise_pred"] and [i.name for i in out.graph.input] == ["sample"]
    graphs.assert_same_outputs(model, out)  # float32: 1e-5


def test_vae_chain_skips_the_slice_pad_round_trip() -> None:
    model = vae_like()
    out, counts = fuse(model, align_shapes, "tensorrt", "cuda")
    onnx.checker.check_model(out, full_check=True)
    # post_quant_conv: in 4->8 (Pad), out 4->8; conv_in reads its 8 zero-padded channels directly; conv_out 3->8
    assert _conv_weight_shapes(out) == {"post_quant_conv": (8, 8, 1, 1), "conv_in": (16, 8, 3, 3),
                                        "conv_out": (8, 16, 3, 3)}
    assert counts == {"inputs_padded": 2, "outputs_padded": 2, "Pad": 1, "Slice": 1, "rejected": 0}
    assert graphs.op_counts(out) == {"Pad": 1, "Conv": 3, "Slice": 1}
    graphs.assert_same_outputs(model, out)


def test_an_rgb_graph_input_is_not_padded_but_the_conv_output_still_is() -> None:
    """A ControlNet's conditioning embedding / the VAE encoder's conv_in: image[N,3,H,W] -> Conv 3->12 -> Conv
    12->16. The image keeps its 3 channels (no Pad at pixel resolution on every call); the 12 output channels of
    the first Conv are padded to 16 and read by the second Conv without a Slice/Pad round trip."""
    rng = np.random.default_rng(3)
    first, i1 = _conv("cond_in", "image", "h", 3, 12, 3, rng)
    second, i2 = _conv("cond_1", "h", "y", 12, 16, 3, rng)
    model = onnx.shape_inference.infer_shapes(graphs.make_model(
        [first, second], [graphs.tensor_info("image", [N, 3, H, W])], [graphs.tensor_info("y", [N, 16, H, W])],
        i1 + i2))
    out, counts = fuse(model, align_shapes, "ort", "cuda")
    onnx.checker.check_model(out, full_check=True)
    assert counts == {"inputs_padded": 1, "outputs_padded": 1, "Pad": 0, "Slice": 0, "image_inputs_kept": 1,
                      "rejected": 0}
    assert _conv_weight_shapes(out) == {"cond_in": (16, 3, 3, 3), "cond_1": (16, 16, 3, 3)}
    assert graphs.op_counts(out) == {"Conv": 2}
    graphs.assert_same_outputs(model, out)


def test_aligned_convs_are_left_and_grouped_ones_rejected(caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(2)
    aligned, i1 = _conv("aligned", "x", "h", 8, 16, 3, rng)
    grouped, i2 = _conv("grouped", "h", "y", 16, 12, 1, rng, group=4)
    model = onnx.shape_inference.infer_shapes(graphs.make_model(
        [aligned, grouped], [graphs.tensor_info("x", [N, 8, H, W])], [graphs.tensor_info("y", [N, 12, H, W])],
        i1 + i2))
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.align_shapes"):
        out, counts = fuse(model, align_shapes, "ort", "cuda")
    assert counts["rejected"] == 1 and counts["outputs_padded"] == 0 and not out.graph.node[0].op_type == "Pad"
    assert any("group=4" in r for r in reasons(caplog, "align_shapes"))
    graphs.assert_same_outputs(model, out)


def test_non_constant_weight_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    model = onnx.shape_inference.infer_shapes(graphs.make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[1, 1])],
        [graphs.tensor_info("x", [N, 4, H, W]), graphs.tensor_info("w", [4, 4, 1, 1])],
        [graphs.tensor_info("y", [N, 4, H, W])]))
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.align_shapes"):
        out, counts = fuse(model, align_shapes, "ort", "cuda")
    assert counts["rejected"] == 1 and graphs.op_counts(out) == {"Conv": 1}
    assert any("not constant" in r for r in reasons(caplog, "align_shapes"))


def test_option_turns_it_off() -> None:
    out, counts = fuse(unet_like(), align_shapes, "ort", "cuda", align_shapes_channels=1)
    assert counts["inputs_padded"] == counts["outputs_padded"] == 0 and graphs.op_counts(out)["Conv"] == 2

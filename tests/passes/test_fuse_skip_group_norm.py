"""fuse_skip_group_norm: a ResNet's Conv -> (+ residual | + time embedding) -> GroupNorm as fuse_group_norm emits it
for ort-cuda -> com.microsoft.SkipGroupNorm with the Conv's bias inside."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes.fuse_group_norm import fuse_group_norm
from diffusion_trt.passes.fuse_skip_group_norm import fuse_skip_group_norm
from tests import graphs
from tests.passes.fusion_helpers import CUDA_FP32, assert_cuda_parity, reasons

N, C, H, W, G = 2, 8, 4, 6, 4


def resnet_tail(*, skip: str = "residual", sum_read_again: bool = True, conv_bias: bool = True,
                skip_is_const: bool = False) -> onnx.ModelProto:
    """``h = Conv(x) [+ bias]; s = h + skip; y = SiLU(GroupNorm(s))`` [``z = s * 2``]; skip [N, C, H, W] or
    [N, C, 1, 1] ("temb"), everything static, as after specialize_shapes + infer_shapes."""
    rng = np.random.default_rng(9)
    conv_inputs = ["x", "cw", "cb"] if conv_bias else ["x", "cw"]
    nodes = [
        helper.make_node("Conv", conv_inputs, ["h"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["h", "skip"], ["s"]),
        helper.make_node("Reshape", ["s", "target"], ["r"]),
        helper.make_node("InstanceNormalization", ["r", "in_s", "in_b"], ["n"], epsilon=1e-5),
        helper.make_node("Reshape", ["n", "shape_x"], ["rb"]),
        helper.make_node("Mul", ["rb", "gamma"], ["m"]),
        helper.make_node("Add", ["m", "beta"], ["a"]),
        helper.make_node("Sigmoid", ["a"], ["sig"]),
        helper.make_node("Mul", ["a", "sig"], ["y"]),
    ]
    skip_shape = [N, C, H, W] if skip == "residual" else [N, C, 1, 1]
    inits = [graphs.const("cw", rng.standard_normal((C, C, 3, 3)) / 8), graphs.const("cb", rng.standard_normal(C)),
             graphs.const("target", [0, G, -1], np.int64), graphs.const("in_s", np.ones(G)),
             graphs.const("in_b", np.zeros(G)), graphs.const("shape_x", [N, C, H, W], np.int64),
             graphs.const("gamma", rng.uniform(0.5, 1.5, (C, 1, 1))),
             graphs.const("beta", rng.standard_normal((C, 1, 1))), graphs.const("two", 2.0)]
    inputs = [graphs.tensor_info("x", [N, C, H, W])]
    if skip_is_const:
        inits.append(graphs.const("skip", rng.standard_normal(skip_shape)))
    else:
        inputs.append(graphs.tensor_info("skip", skip_shape))
    outputs = [graphs.tensor_info("y", [N, C, H, W])]
    if sum_read_again:
        nodes.append(helper.make_node("Mul", ["s", "two"], ["z"]))
        outputs.append(graphs.tensor_info("z", [N, C, H, W]))
    return onnx.shape_inference.infer_shapes(graphs.make_model(nodes, inputs, outputs, inits))


def fused(model: onnx.ModelProto, backend: str = "ort", device: str = "cuda") -> tuple[onnx.ModelProto, list]:
    ctx = PassContext(component="vae_decoder", backend=backend, device=device, precision="fp32")
    return optimize_model(model, [fuse_group_norm, fuse_skip_group_norm], ctx)


@pytest.mark.parametrize("skip", ["residual", "temb"])
def test_emits_skip_group_norm_with_the_conv_bias(skip: str) -> None:
    model = resnet_tail(skip=skip)
    out, records = fused(model)
    assert records[1].counts == {"SkipGroupNorm": 1, "with_bias": 1, "broadcast_skip": int(skip == "temb"),
                                 "rejected": 0, "skipped_for_target": 0}
    ops = graphs.op_counts(out)
    assert ops.get("Add", 0) == 0 and ops.get("GroupNorm", 0) == 0 and ops["SkipGroupNorm"] == 1
    conv = next(n for n in out.graph.node if n.op_type == "Conv")
    assert list(conv.input) == ["x", "cw"]  # the bias moved into the norm
    node = next(n for n in out.graph.node if n.op_type == "SkipGroupNorm")
    assert node.domain == "com.microsoft" and len(node.input) == 5 and len(node.output) == 2
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["groups"] == G and attrs["activation"] == 1 and attrs["channels_last"] == 1
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    conv_bias = next(onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.name == "cb")
    np.testing.assert_array_equal(weights[node.input[4]], conv_bias)
    # the sum's other reader gets it back in NCHW through one Transpose
    mul = next(n for n in out.graph.node if n.op_type == "Mul" and "two" in n.input)
    back = next(n for n in out.graph.node if n.output and n.output[0] == mul.input[0])
    assert back.op_type == "Transpose" and back.input[0] == node.output[1]
    onnx.checker.check_model(out)


def test_sum_without_other_readers_gives_one_output() -> None:
    out, records = fused(resnet_tail(sum_read_again=False, conv_bias=False))
    assert records[1].counts["SkipGroupNorm"] == 1 and records[1].counts["with_bias"] == 0
    node = next(n for n in out.graph.node if n.op_type == "SkipGroupNorm")
    assert len(node.output) == 1 and len(node.input) == 4


def test_constant_skip_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    out, records = fused(resnet_tail(skip_is_const=True))
    assert records[1].counts["SkipGroupNorm"] == 0 and records[1].counts["rejected"] == 1
    assert any("adds a constant" in m for m in reasons(caplog, "fuse_skip_group_norm"))
    assert graphs.op_counts(out)["GroupNorm"] == 1


@pytest.mark.parametrize(("backend", "device"), [("ort", "cpu"), ("tensorrt", "cuda")])
def test_other_targets_have_nothing_to_fuse(backend: str, device: str) -> None:
    out, records = fused(resnet_tail(), backend, device)
    assert records[1].counts["SkipGroupNorm"] == 0 and records[1].counts["rejected"] == 0
    graphs.assert_same_outputs(resnet_tail(), out)


@pytest.mark.gpu
@pytest.mark.parametrize("skip", ["residual", "temb"])
def test_cuda_parity(skip: str) -> None:
    model = resnet_tail(skip=skip)
    out, _ = fused(model)
    assert_cuda_parity(model, out, (CUDA_FP32, {**CUDA_FP32, "prefer_nhwc": 1}))

"""merge_conv_biases: ``Conv(x, A, a) + Conv(y, B, b)`` -> ``Conv(x, A) + Conv(y, B, a + b)`` (a ResNet with a
conv_shortcut whose sum feeds no GroupNorm), and a conv_shortcut's bias moved into the SkipGroupNorm that
fuse_skip_group_norm made of the sum, on small static graphs. SkipGroupNorm is CUDA-only in ONNX Runtime: that
case is checked structurally here and numerically by the ``gpu`` test."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes.fuse_group_norm import fuse_group_norm
from diffusion_trt.passes.fuse_skip_group_norm import fuse_skip_group_norm
from diffusion_trt.passes.merge_conv_biases import merge_conv_biases
from tests import graphs
from tests.passes.fusion_helpers import CUDA_FP32, assert_cuda_parity, fuse, reasons
from tests.passes.test_fuse_skip_group_norm import resnet_tail

N, C, H, W = 2, 8, 4, 6


def resnet_sum(*, second_bias: bool = True, read_again: bool = False, skip_hw: int = H) -> onnx.ModelProto:
    """``s = Conv3x3(x, A, a) + Conv1x1(y, B, b)``; ``z = s * 2`` [``w = h * 2`` reads the first Conv again]."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Conv", ["x", "A", "a"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["y", "B", "b"] if second_bias else ["y", "B"], ["k"]),
             helper.make_node("Add", ["h", "k"], ["s"]),
             helper.make_node("Mul", ["s", "two"], ["z"])]
    inits = [graphs.const("A", rng.standard_normal((C, C, 3, 3)) / 8), graphs.const("a", rng.standard_normal(C)),
             graphs.const("B", rng.standard_normal((C, 4, 1, 1)) / 2), graphs.const("b", rng.standard_normal(C)),
             graphs.const("two", 2.0)]
    outputs = [graphs.tensor_info("z", [N, C, H, W])]
    if read_again:
        nodes.append(helper.make_node("Mul", ["h", "two"], ["w"]))
        outputs.append(graphs.tensor_info("w", [N, C, H, W]))
    inputs = [graphs.tensor_info("x", [N, C, H, W]), graphs.tensor_info("y", [N, 4, skip_hw, W])]
    return onnx.shape_inference.infer_shapes(graphs.make_model(nodes, inputs, outputs, inits))


def test_one_bias_holds_both() -> None:
    model = resnet_sum()
    out, counts = fuse(model, merge_conv_biases, device="cuda")
    assert counts == {"merged": 1, "into_skip_group_norm": 0, "rejected": 0, "skipped_for_target": 0}
    convs = [n for n in out.graph.node if n.op_type == "Conv"]
    assert sorted(len(n.input) for n in convs) == [2, 3]
    graphs.assert_same_outputs(model, out)  # the CPU provider runs the rewritten graph: same sum
    onnx.checker.check_model(out, full_check=True)


@pytest.mark.parametrize(("backend", "device"), [("ort", "cpu"), ("tensorrt", "cuda")])
def test_other_targets_are_left_alone(backend: str, device: str) -> None:
    model = resnet_sum()
    out, counts = fuse(model, merge_conv_biases, backend=backend, device=device)
    assert counts == {"merged": 0, "into_skip_group_norm": 0, "rejected": 0, "skipped_for_target": 1}
    assert graphs.op_counts(out) == graphs.op_counts(model)


def test_a_conv_without_bias_is_not_a_candidate() -> None:
    _, counts = fuse(resnet_sum(second_bias=False), merge_conv_biases, device="cuda")
    assert counts == {"merged": 0, "into_skip_group_norm": 0, "rejected": 0, "skipped_for_target": 0}


def test_a_conv_output_read_twice_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    model = resnet_sum(read_again=True)
    out, counts = fuse(model, merge_conv_biases, device="cuda")
    assert counts["merged"] == 0 and counts["rejected"] == 1
    assert any("'h' is also read outside the Add" in r for r in reasons(caplog, "merge_conv_biases"))
    graphs.assert_same_outputs(model, out)


def test_broadcasting_sum_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    _, counts = fuse(resnet_sum(skip_hw=1), merge_conv_biases, device="cuda")
    assert counts["rejected"] == 1
    assert any("may differ" in r for r in reasons(caplog, "merge_conv_biases"))


def test_off_by_option() -> None:
    model = resnet_sum()
    out, counts = fuse(model, merge_conv_biases, device="cuda", merge_conv_biases=False)
    assert counts["disabled"] == 1 and counts["merged"] == 0
    assert graphs.op_counts(out) == graphs.op_counts(model)


def shortcut_tail(skip: str = "shortcut") -> onnx.ModelProto:
    """resnet_tail (Conv -> + skip -> GroupNorm) whose skip is a biased 1x1 Conv of a second input ``x2``."""
    model = resnet_tail(skip="temb" if skip == "temb" else "residual")
    if skip != "temb":
        rng = np.random.default_rng(4)
        shape = [d.dim_value for d in model.graph.input[1].type.tensor_type.shape.dim]
        model.graph.input[1].name = "x2"
        model.graph.node.insert(0, helper.make_node("Conv", ["x2", "sw", "sb"], ["skip"]))
        model.graph.initializer.extend([graphs.const("sw", rng.standard_normal((shape[1], shape[1], 1, 1)) / 3),
                                        graphs.const("sb", rng.standard_normal(shape[1]))])
    return onnx.shape_inference.infer_shapes(model)


def skip_group_norm_passes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    ctx = PassContext(component="unet", backend="ort", device="cuda", precision="fp32")
    out, records = optimize_model(model, [fuse_group_norm, fuse_skip_group_norm, merge_conv_biases], ctx)
    assert records[1].counts["SkipGroupNorm"] == 1 and records[1].counts["with_bias"] == 1
    return out, records[2].counts


def test_the_shortcut_bias_moves_into_skip_group_norm() -> None:
    model = shortcut_tail()
    out, counts = skip_group_norm_passes(model)
    assert counts == {"merged": 0, "into_skip_group_norm": 1, "rejected": 0, "skipped_for_target": 0}
    assert all(len(n.input) == 2 for n in out.graph.node if n.op_type == "Conv")  # both biases left the Convs
    norm = next(n for n in out.graph.node if n.op_type == "SkipGroupNorm")
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    given = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    np.testing.assert_allclose(weights[norm.input[4]], given["cb"] + given["sb"], rtol=1e-6)
    onnx.checker.check_model(out)


def test_a_broadcast_time_embedding_skip_is_left_alone() -> None:
    _, counts = skip_group_norm_passes(shortcut_tail("temb"))
    assert counts["into_skip_group_norm"] == 0


@pytest.mark.gpu
def test_skip_group_norm_cuda_parity() -> None:
    model = shortcut_tail()
    out, counts = skip_group_norm_passes(model)
    assert counts["into_skip_group_norm"] == 1
    assert_cuda_parity(model, out, (CUDA_FP32, {**CUDA_FP32, "prefer_nhwc": 1}))

"""cancel_transposes: Transpose pairs that cancel, through elementwise ops, joins and 1x1 convolutions.

The NHWC com.microsoft GroupNorm has no CPU kernel, so the graphs here put plain ops between the Transposes
(the structure fuse_group_norm leaves) and compare outputs with ONNX Runtime CPU.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.passes.cancel_transposes import cancel_transposes, compose
from tests import graphs
from tests.passes.fusion_helpers import fuse, reasons

N, C, H, W = 2, 8, 3, 5
NHWC = [N, H, W, C]
NCHW = [N, C, H, W]


def _model(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto], outputs: list[tuple[str, list[int]]],
           inputs: tuple[tuple[str, list[int]], ...] = (("x", NHWC),)) -> onnx.ModelProto:
    model = graphs.make_model(nodes, [graphs.tensor_info(n, s) for n, s in inputs],
                              [graphs.tensor_info(n, s) for n, s in outputs], inits)
    return onnx.shape_inference.infer_shapes(model)


def _t(src: str, dst: str, perm: list[int]) -> onnx.NodeProto:
    return helper.make_node("Transpose", [src], [dst], perm=perm)


def _run(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    out, counts = fuse(model, cancel_transposes, "ort", "cuda")
    onnx.checker.check_model(out, full_check=True)
    graphs.assert_same_outputs(model, out)
    return out, counts


def test_compose() -> None:
    assert compose((0, 3, 1, 2), (0, 2, 3, 1)) == (0, 1, 2, 3)
    assert compose((0, 2, 1), (1, 0, 2)) == (2, 0, 1)


def test_adjacent_pair_cancels() -> None:
    model = _model([_t("x", "a", [0, 3, 1, 2]), _t("a", "b", [0, 2, 3, 1]), helper.make_node("Relu", ["b"], ["y"])],
                   [], [("y", NHWC)])
    out, counts = _run(model)
    assert graphs.op_counts(out) == {"Relu": 1}
    assert counts["Transpose_removed"] == 2 and counts["cancelled"] == 1


def test_pair_that_does_not_cancel_merges() -> None:
    model = _model([_t("x", "a", [0, 3, 1, 2]), _t("a", "y", [0, 1, 3, 2])], [], [("y", [N, C, W, H])])
    out, counts = _run(model)
    assert graphs.op_counts(out) == {"Transpose": 1} and counts["merged"] == 1
    assert list(out.graph.node[0].attribute[0].ints) == [0, 3, 2, 1]


def test_cancel_through_elementwise_ops_with_broadcast_constants() -> None:
    """GroupNorm-like NHWC tensor -> NCHW -> *gamma[C,1,1] + beta[C] ... -> Sigmoid -> back to NHWC."""
    rng = np.random.default_rng(0)
    model = _model(
        [_t("x", "a", [0, 3, 1, 2]),
         helper.make_node("Mul", ["a", "gamma"], ["m"]),
         helper.make_node("Add", ["bias_w", "m"], ["s"]),  # constant first: operand order kept
         helper.make_node("Sigmoid", ["s"], ["g"]),
         helper.make_node("Mul", ["g", "half"], ["h"]),
         _t("h", "y", [0, 2, 3, 1])],
        [graphs.const("gamma", rng.standard_normal((C, 1, 1))), graphs.const("bias_w", rng.standard_normal(W)),
         graphs.const("half", 0.5)],
        [("y", NHWC)])
    out, counts = _run(model)
    assert "Transpose" not in graphs.op_counts(out)
    assert counts["Transpose_removed"] == 2 and counts["cancelled"] == 1


def test_residual_add_of_two_transposes_joins_then_cancels() -> None:
    """Two NHWC branches both transposed to NCHW, added, transposed back: 3 Transposes -> 0."""
    model = _model(
        [_t("x", "a", [0, 3, 1, 2]), helper.make_node("Relu", ["x2"], ["r"]), _t("r", "b", [0, 3, 1, 2]),
         helper.make_node("Add", ["a", "b"], ["s"]), _t("s", "y", [0, 2, 3, 1])],
        [], [("y", NHWC)], inputs=(("x", NHWC), ("x2", NHWC)))
    out, counts = _run(model)
    assert graphs.op_counts(out) == {"Relu": 1, "Add": 1, "Identity": 1}  # the Identity keeps the output's name
    assert counts["joined"] == 1 and counts["Transpose_removed"] == 3


def test_join_without_a_cancel_still_saves_one() -> None:
    model = _model(
        [_t("x", "a", [0, 3, 1, 2]), _t("x2", "b", [0, 3, 1, 2]), helper.make_node("Add", ["a", "b"], ["y"])],
        [], [("y", NCHW)], inputs=(("x", NHWC), ("x2", NHWC)))
    out, counts = _run(model)
    assert graphs.op_counts(out) == {"Add": 1, "Transpose": 1} and counts["joined"] == 1


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_1x1_conv_between_transposes_becomes_matmul(bias: bool) -> None:
    """The transformer's proj_in after an NHWC GroupNorm: Transpose -> Conv 1x1 -> permute(0,2,3,1)."""
    rng = np.random.default_rng(1)
    conv_in = ["a", "w", "b"] if bias else ["a", "w"]
    model = _model(
        [_t("x", "a", [0, 3, 1, 2]), helper.make_node("Conv", conv_in, ["c"], kernel_shape=[1, 1], pads=[0, 0, 0, 0]),
         _t("c", "t", [0, 2, 3, 1]), helper.make_node("Reshape", ["t", "flat"], ["y"])],
        [graphs.const("w", rng.standard_normal((6, C, 1, 1))), graphs.const("b", rng.standard_normal(6)),
         graphs.const("flat", [N, H * W, 6], np.int64)],
        [("y", [N, H * W, 6])])
    out, counts = _run(model)
    assert graphs.op_counts(out) == {"MatMul": 1, "Reshape": 1, **({"Add": 1} if bias else {})}
    assert counts["Conv_to_MatMul"] == 1 and counts["Transpose_removed"] == 2


def test_3x3_conv_and_other_perms_are_left(caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(2)
    model = _model(
        [_t("x", "a", [0, 3, 1, 2]), helper.make_node("Conv", ["a", "w"], ["c"], kernel_shape=[3, 3],
                                                      pads=[1, 1, 1, 1]),
         _t("c", "y", [0, 2, 3, 1])],
        [graphs.const("w", rng.standard_normal((C, C, 3, 3)))], [("y", NHWC)])
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.cancel_transposes"):
        out, counts = _run(model)
    assert graphs.op_counts(out) == {"Transpose": 2, "Conv": 1}
    assert counts["Transpose_removed"] == 0 and counts["rejected"] == 1
    assert any("is not 1x1" in r for r in reasons(caplog, "cancel_transposes"))


@pytest.mark.parametrize("case", ["second-consumer", "graph-output", "other-perm", "non-constant-operand"])
def test_must_not_fire(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """A moved Transpose must never change what another reader or a graph output sees (other-perm: it may merge)."""
    nodes = [_t("x", "a", [0, 3, 1, 2]), helper.make_node("Relu", ["a"], ["r"]), _t("r", "y", [0, 2, 3, 1])]
    outputs: list[tuple[str, list[int]]] = [("y", NHWC)]
    inputs: tuple[tuple[str, list[int]], ...] = (("x", NHWC),)
    if case == "second-consumer":
        nodes.append(helper.make_node("Sigmoid", ["r"], ["z"]))
        outputs.append(("z", NCHW))
    elif case == "graph-output":
        outputs.append(("r", NCHW))
    elif case == "other-perm":
        nodes[0] = _t("x", "a", [0, 3, 2, 1])
        outputs = [("y", [N, W, H, C])]
    else:
        nodes[1] = helper.make_node("Add", ["a", "x2"], ["r"])
        inputs = (("x", NHWC), ("x2", NCHW))
    model = _model(nodes, [], outputs, inputs=inputs)
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.cancel_transposes"):
        out, counts = _run(model)
    if case == "other-perm":  # no cancel, but the two meet below the Relu and merge into one
        assert counts["Transpose_removed"] == 1 and counts["merged"] == 1 and graphs.op_counts(out)["Transpose"] == 1
        return
    assert counts["Transpose_removed"] == 0 and counts["rejected"] >= 1
    assert graphs.op_counts(out)["Transpose"] == 2
    assert reasons(caplog, "cancel_transposes")


def test_pair_cancel_keeps_a_graph_output_name() -> None:
    model = _model([_t("x", "a", [0, 3, 1, 2]), _t("a", "y", [0, 2, 3, 1])], [], [("y", NHWC)])
    out, counts = _run(model)
    assert graphs.op_counts(out) == {"Identity": 1} and out.graph.output[0].name == "y"
    assert counts["cancelled"] == 1


def test_shape_readers_of_a_dynamic_graph_do_not_stop_a_cancel() -> None:
    """``batch, _, h, w = t.shape`` beside the pair (a dynamic graph keeps these Shape reads): the Shapes read
    ``Gather(Shape(x), perm)`` instead and the pair still cancels; the gathered dims are the same values."""
    nodes = [_t("x", "t", [0, 3, 1, 2]), _t("t", "y", [0, 2, 3, 1]), helper.make_node("Relu", ["y"], ["out"]),
             helper.make_node("Shape", ["t"], ["s"]),
             helper.make_node("Gather", ["s", "two"], ["h"], axis=0)]
    outputs = [graphs.tensor_info("out", ["B", "h", "w", C]), graphs.tensor_info("h", [], onnx.TensorProto.INT64)]
    model = onnx.shape_inference.infer_shapes(graphs.make_model(
        nodes, [graphs.tensor_info("x", ["B", "h", "w", C])], outputs, [graphs.const("two", 2, np.int64)]))
    out, counts = fuse(model, cancel_transposes, "ort", "cuda")
    onnx.checker.check_model(out, full_check=True)
    assert counts["cancelled"] == 1 and counts["Transpose_removed"] == 2
    assert graphs.op_counts(out).get("Transpose", 0) == 0
    graphs.assert_same_outputs(model, out, graphs.random_feeds(model, dims={"B": 2, "h": 3, "w": 5}))


def test_a_shape_reader_beside_a_non_transpose_is_left() -> None:
    """The other reader is a Conv-free Relu (no pair): nothing to gain, the Shape keeps reading the Transpose."""
    nodes = [_t("x", "t", [0, 3, 1, 2]), helper.make_node("Relu", ["t"], ["out"]),
             helper.make_node("Shape", ["t"], ["s"])]
    outputs = [graphs.tensor_info("out", ["B", C, "h", "w"]), graphs.tensor_info("s", [4], onnx.TensorProto.INT64)]
    model = graphs.make_model(nodes, [graphs.tensor_info("x", ["B", "h", "w", C])], outputs)
    out, counts = fuse(model, cancel_transposes, "ort", "cuda")
    assert counts["Transpose_removed"] == 0 and graphs.op_counts(out) == graphs.op_counts(model)

"""Safety helpers of passes/_match.py."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx.numpy_helper
import onnx_graphsurgeon as gs
import pytest
from onnx import helper

from diffusion_trt.passes._match import (
    Rejection,
    collect_rejections,
    const_value,
    find_each,
    fuse_each,
    internal_edge_problem,
    is_const,
    is_graph_output,
    reject,
    single_consumer,
)
from diffusion_trt.passes.base import PassResult
from tests import graphs


def test_single_consumer_of_a_chain() -> None:
    graph = gs.import_onnx(graphs.mlp_model())
    tensors = graph.tensors()
    consumer = single_consumer(tensors["h"])
    assert consumer is not None and consumer.op == "Add"
    assert internal_edge_problem(graph, tensors["h"]) is None
    assert single_consumer(tensors["y"]) is None  # graph output, read by nobody


def test_fusion_candidate_with_a_second_consumer_is_rejected() -> None:
    # x * s -> Relu looks like a fusable chain, but h is also read by Sigmoid and is a graph output (via y2)
    graph = gs.import_onnx(graphs.diamond_model())
    h = graph.tensors()["h"]
    assert single_consumer(h) is None
    problem = internal_edge_problem(graph, h)
    assert problem == "'h' has 3 consumers (Relu, Sigmoid, Identity)"
    # drop the other readers: now h is fusable
    graph.outputs = [graph.tensors()["y1"]]
    sigmoid = next(node for node in graph.nodes if node.op == "Sigmoid")
    sigmoid.inputs[0] = graph.tensors()["x"]
    graph.cleanup()
    assert single_consumer(h) is not None and internal_edge_problem(graph, h) is None


def test_node_reading_a_tensor_twice_is_one_consumer() -> None:
    x = gs.Variable("x", np.float32, [2])
    y = gs.Variable("y", np.float32, [2])
    node = gs.Node("Mul", inputs=[x, x], outputs=[y])
    assert single_consumer(x) is node


def test_graph_output_is_not_an_internal_edge() -> None:
    graph = gs.import_onnx(graphs.diamond_model())
    tensors = graph.tensors()
    assert is_graph_output(graph, tensors["y2"]) and not is_graph_output(graph, tensors["h"])
    graph.outputs.append(tensors["r"])
    assert internal_edge_problem(graph, tensors["r"]) == "'r' is a graph output"


def test_constant_value_of_initializers_and_constant_nodes() -> None:
    graph = gs.import_onnx(graphs.constant_subgraph_model())
    tensors = graph.tensors()
    expected_b = onnx.numpy_helper.to_array(graphs.constant_subgraph_model().graph.initializer[1])
    np.testing.assert_array_equal(const_value(tensors["b"]), expected_b)
    assert const_value(tensors["W"]).shape == (4, 5)
    two = const_value(tensors["two"])  # output of Constant(value_float=2.0)
    assert two is not None and two.dtype == np.float32 and float(two) == 2.0
    assert is_const(tensors["two"]) and is_const(tensors["W"])
    for name in ("x", "W2", "y"):  # computed from constants is not constant until folded
        assert const_value(tensors[name]) is None and not is_const(tensors[name])


@pytest.mark.parametrize(
    ("attr", "value", "expected"),
    [
        ("value", helper.make_tensor("v", 7, [2], [3, 4]), np.array([3, 4], np.int64)),
        ("value_ints", [1, 2], np.array([1, 2], np.int64)),
        ("value_int", 5, np.array(5, np.int64)),
        ("value_floats", [0.5], np.array([0.5], np.float32)),
    ],
)
def test_constant_node_attributes(attr: str, value: object, expected: np.ndarray) -> None:
    model = graphs.make_model(
        [helper.make_node("Constant", [], ["c"], **{attr: value}), helper.make_node("Identity", ["c"], ["y"])],
        [], [graphs.tensor_info("y", expected.shape, helper.np_dtype_to_tensor_dtype(expected.dtype))],
    )
    c = gs.import_onnx(model).tensors()["c"]
    got = const_value(c)
    assert got is not None and got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
    assert is_const(c)


def test_string_constant_is_not_a_value() -> None:
    model = graphs.make_model(
        [helper.make_node("Constant", [], ["c"], value_string="hi"), helper.make_node("Identity", ["c"], ["y"])],
        [], [graphs.tensor_info("y", [], 8)],
    )
    c = gs.import_onnx(model).tensors()["c"]
    assert const_value(c) is None and not is_const(c)


def test_constant_value_does_not_cache_lazy_weights() -> None:
    w = gs.import_onnx(graphs.mlp_model()).tensors()["W1"]
    assert isinstance(w, gs.Constant)
    kind = type(w._values)
    const_value(w)
    assert type(w._values) is kind


def test_reject_logs_under_the_pass_logger_and_returns_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    node = gs.Node("Erf", name="Erf_12")
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.fuse_gelu"):
        rejection = reject("fuse_gelu", node, "'h' has 2 consumers (Add, Mul)")
    assert rejection == Rejection("fuse_gelu", "Erf", "Erf_12", "'h' has 2 consumers (Add, Mul)")
    assert caplog.records[0].name == "diffusion_trt.passes.fuse_gelu"
    assert caplog.records[0].getMessage() == "fuse_gelu: rejected Erf 'Erf_12': 'h' has 2 consumers (Add, Mul)"


def test_const_value_looks_through_identity() -> None:
    """One is_const / const_value: an Identity chain over a constant (TorchScript's shared weights) is constant."""
    model = graphs.make_model(
        [helper.make_node("Identity", ["w"], ["w1"]), helper.make_node("Identity", ["w1"], ["w2"]),
         helper.make_node("Add", ["x", "w2"], ["y"])],
        [graphs.tensor_info("x", [2])], [graphs.tensor_info("y", [2])], [graphs.const("w", [1.0, 2.0])],
    )
    tensors = gs.import_onnx(model).tensors()
    assert is_const(tensors["w2"]) and not is_const(tensors["x"])
    np.testing.assert_array_equal(const_value(tensors["w2"]), np.array([1.0, 2.0], np.float32))
    assert const_value(tensors["y"]) is None


def _relu_chain(count: int) -> gs.Graph:
    """x -> Relu -> Relu ... (``count`` of them) -> y: nodes r0, r1, ..."""
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"r{i}") for i in range(count)]
    nodes.append(helper.make_node("Identity", [f"t{count}"], ["y"], name="out"))
    model = graphs.make_model(nodes, [graphs.tensor_info("t0", [2])], [graphs.tensor_info("y", [2])])
    return gs.import_onnx(model)


def test_fuse_each_owns_iteration_rejections_and_counts(caplog: pytest.LogCaptureFixture) -> None:
    """match: None (no candidate), a reason (rejected) or a match; check: a reason (rejected); rewrite: counts or
    None (skipped); every rejection logged and collected under the pass's name."""
    graph = _relu_chain(5)

    def match(node: gs.Node) -> gs.Node | str | None:
        if node.op != "Relu":
            return None
        return "r1 is not wanted" if node.name == "r1" else node

    def check(node: gs.Node) -> str | None:
        return "r2 fails its check" if node.name == "r2" else None

    def rewrite(node: gs.Node) -> str | dict[str, int] | None:
        return {"r3": None, "r4": {"Relu": 1, "extra": 2}}.get(node.name, "Relu")  # type: ignore[return-value]

    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes"), collect_rejections() as rejected:
        tally = fuse_each(graph, "fuse_test", match=match, check=check, rewrite=rewrite)
    assert dict(tally.counts) == {"Relu": 2, "extra": 2} and tally.rejected == 2 and tally.skipped == 1
    assert [(r.pass_name, r.node, r.reason) for r in rejected] == [
        ("fuse_test", "r1", "r1 is not wanted"), ("fuse_test", "r2", "r2 fails its check")]
    assert "fuse_test: rejected Relu 'r2': r2 fails its check" in caplog.text
    assert tally.record("Relu", "Gelu") == {"Relu": 2, "Gelu": 0, "rejected": 2, "skipped_for_target": 1}
    assert tally.record("Relu", skipped=False) == {"Relu": 2, "rejected": 2}
    result = PassResult.of(tally, "Gelu")
    assert not result.modified and result.counts == {"Gelu": 0, "rejected": 2, "skipped_for_target": 1}
    assert PassResult.of(tally, "Gelu", "Relu").modified


def test_fuse_each_visits_the_nodes_there_at_the_start() -> None:
    """Nodes a rewrite adds are not matched in the same run (the rule would otherwise see its own output)."""
    graph = _relu_chain(2)
    seen: list[str] = []

    def rewrite(node: gs.Node) -> str:
        graph.nodes.append(gs.Node("Relu", name=f"{node.name}_new"))
        return "Relu"

    tally = fuse_each(graph, "fuse_test", match=lambda n: seen.append(n.name) or (n if n.op == "Relu" else None),
                      rewrite=rewrite)
    assert seen == ["r0", "r1", "out"] and tally.counts["Relu"] == 2


def test_find_each_collects_matches_in_graph_order() -> None:
    graph = _relu_chain(4)
    found = find_each(graph, "fuse_test", match=lambda n: None if n.op != "Relu" else n.name,
                      check=None)
    # a str from match is a rejection reason, so a rule's matches are never plain strings
    assert found.matches == [] and found.rejected == 4
    found = find_each(graph, "fuse_test", match=lambda n: None if n.op != "Relu" else n,
                      check=lambda n: "odd" if n.name in ("r1", "r3") else None)
    assert [n.name for n in found.matches] == ["r0", "r2"] and found.rejected == 2
    assert len(graph.nodes) == 5  # nothing rewritten


def test_rejection_reasons_merge_names_but_keep_apostrophes() -> None:
    """Quoted names are merged into one reason; the apostrophe of a word ("input's") opens no quote."""
    from diffusion_trt.passes._match import rejection_reasons

    reasons = [Rejection("fuse_skip_group_norm", "GroupNorm", f"n{i}",
                         f"the skip ['{a}', 16] is neither the input's ['{b}', 16] nor [N, C, 1, 1]")
               for i, (a, b) in enumerate((("x", "y"), ("p.1", "q.2")))]
    assert rejection_reasons(reasons) == {
        "GroupNorm: the skip ['…', 16] is neither the input's ['…', 16] nor [N, C, 1, 1]": 2}

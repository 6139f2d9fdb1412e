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
    constant_value,
    internal_edge_problem,
    is_constant,
    is_graph_output,
    reject,
    single_consumer,
)
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
    np.testing.assert_array_equal(constant_value(tensors["b"]), expected_b)
    assert constant_value(tensors["W"]).shape == (4, 5)
    two = constant_value(tensors["two"])  # output of Constant(value_float=2.0)
    assert two is not None and two.dtype == np.float32 and float(two) == 2.0
    assert is_constant(tensors["two"]) and is_constant(tensors["W"])
    for name in ("x", "W2", "y"):  # computed from constants is not constant until folded
        assert constant_value(tensors[name]) is None and not is_constant(tensors[name])


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
    got = constant_value(c)
    assert got is not None and got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
    assert is_constant(c)


def test_string_constant_is_not_a_value() -> None:
    model = graphs.make_model(
        [helper.make_node("Constant", [], ["c"], value_string="hi"), helper.make_node("Identity", ["c"], ["y"])],
        [], [graphs.tensor_info("y", [], 8)],
    )
    c = gs.import_onnx(model).tensors()["c"]
    assert constant_value(c) is None and not is_constant(c)


def test_constant_value_does_not_cache_lazy_weights() -> None:
    w = gs.import_onnx(graphs.mlp_model()).tensors()["W1"]
    assert isinstance(w, gs.Constant)
    kind = type(w._values)
    constant_value(w)
    assert type(w._values) is kind


def test_reject_logs_under_the_pass_logger_and_returns_the_reason(caplog: pytest.LogCaptureFixture) -> None:
    node = gs.Node("Erf", name="Erf_12")
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.fuse_gelu"):
        rejection = reject("fuse_gelu", node, "'h' has 2 consumers (Add, Mul)")
    assert rejection == Rejection("fuse_gelu", "Erf", "Erf_12", "'h' has 2 consumers (Add, Mul)")
    assert caplog.records[0].name == "diffusion_trt.passes.fuse_gelu"
    assert caplog.records[0].getMessage() == "fuse_gelu: rejected Erf 'Erf_12': 'h' has 2 consumers (Add, Mul)"

"""Tiny ONNX graphs for tests, and ONNX Runtime helpers to compare a model before and after a rewrite.

Every builder returns a checked ``onnx.ModelProto`` (opset 17, IR 9 unless told) small enough to build and
run in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9

#: Tolerances for before/after comparisons, one row per dtype: (rtol, atol).
TOLERANCE: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float16": (1e-3, 1e-3),
}


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    *,
    opset: int = OPSET,
    ir_version: int = IR_VERSION,
    value_info: Sequence[onnx.ValueInfoProto] = (),
    extra_opsets: Sequence[tuple[str, int]] = (),
    check: bool = True,
) -> onnx.ModelProto:
    """A model from its parts; ``extra_opsets`` adds (domain, version) imports for custom-domain nodes."""
    graph = helper.make_graph(list(nodes), "test", list(inputs), list(outputs), list(initializers),
                              value_info=list(value_info))
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version, producer_name="tests")
    if check:
        onnx.checker.check_model(model)
    return model


def tensor_info(
    name: str, shape: Sequence[int | str | None] | None, dtype: int = TensorProto.FLOAT
) -> onnx.ValueInfoProto:
    """A graph input/output description; ``shape=None`` means unknown rank (the checker refuses that on graph
    inputs and outputs: build with ``check=False``)."""
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name: str, values: np.ndarray | Sequence[float] | float, dtype: type = np.float32) -> onnx.TensorProto:
    """An initializer."""
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def random_feeds(model: onnx.ModelProto, seed: int = 0, dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Random float32 inputs for ``model``; symbolic dims are taken from ``dims`` (default 2)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else (dims or {}).get(d.dim_param, 2)
                 for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``model`` (a ModelProto or a path) with ONNX Runtime CPU, all graph optimizations off."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto | str,
                        feeds: dict[str, np.ndarray] | None = None) -> None:
    """Both models give the same outputs on the same inputs, within :data:`TOLERANCE` for their dtype."""
    feeds = feeds if feeds is not None else random_feeds(before)
    expected, actual = run(before, feeds), run(after, feeds)
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual, strict=True):
        assert want.dtype == got.dtype and want.shape == got.shape
        rtol, atol = TOLERANCE.get(want.dtype.name, (0.0, 0.0))
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes of each op type the main graph has."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


# --- builders ---------------------------------------------------------------------------------------------


def dead_branch_model() -> onnx.ModelProto:
    """y = Relu(x) + 1; a dead branch Sigmoid(x) -> Neg that reaches no output."""
    return make_model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Add", ["r", "one"], ["y"]),
            helper.make_node("Sigmoid", ["x"], ["dead1"]),
            helper.make_node("Neg", ["dead1"], ["dead2"]),
        ],
        [tensor_info("x", [2, 3])],
        [tensor_info("y", [2, 3])],
        [const("one", 1.0)],
    )


def duplicate_constants_model() -> onnx.ModelProto:
    """y = ((x * s1) * s2) + b; s1 and s2 are equal 8-element initializers; b has the same bytes as neither."""
    scale = np.linspace(0.5, 2.0, 8)
    return make_model(
        [
            helper.make_node("Mul", ["x", "s1"], ["a"]),
            helper.make_node("Mul", ["a", "s2"], ["c"]),
            helper.make_node("Add", ["c", "b"], ["y"]),
        ],
        [tensor_info("x", [2, 8])],
        [tensor_info("y", [2, 8])],
        [const("s1", scale), const("s2", scale), const("b", scale[::-1])],
    )


def constant_subgraph_model() -> onnx.ModelProto:
    """y = x @ (W * 2 + b): the weight expression is foldable; a Constant node feeds it."""
    rng = np.random.default_rng(1)
    return make_model(
        [
            helper.make_node("Constant", [], ["two"], value_float=2.0),
            helper.make_node("Mul", ["W", "two"], ["W2"]),
            helper.make_node("Add", ["W2", "b"], ["Wb"]),
            helper.make_node("MatMul", ["x", "Wb"], ["y"]),
        ],
        [tensor_info("x", [3, 4])],
        [tensor_info("y", [3, 5])],
        [const("W", rng.standard_normal((4, 5))), const("b", rng.standard_normal(5))],
    )


def shape_chain_model(batch: int | str = 2) -> onnx.ModelProto:
    """y = Reshape(x, concat(shape(x)[0], [12])): flattens x:[batch, 3, 4] to [batch, 12].

    With a static batch the Shape -> Gather -> Concat chain folds to a constant; with a symbolic one it cannot.
    """
    return make_model(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
            helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
            helper.make_node("Concat", ["n1", "twelve"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ],
        [tensor_info("x", [batch, 3, 4])],
        [tensor_info("y", [batch, 12])],
        [const("zero", 0, np.int64), const("axes0", [0], np.int64), const("twelve", [12], np.int64)],
    )


def mlp_model(hidden: int = 16) -> onnx.ModelProto:
    """y = Relu(x @ W1 + b1) @ W2, x:[N, 8] (N symbolic); intermediate tensors carry no shapes."""
    rng = np.random.default_rng(2)
    return make_model(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"]),
            helper.make_node("Add", ["h", "b1"], ["hb"]),
            helper.make_node("Relu", ["hb"], ["hr"]),
            helper.make_node("MatMul", ["hr", "W2"], ["y"]),
        ],
        [tensor_info("x", ["N", 8])],
        [tensor_info("y", ["N", 4])],
        [const("W1", rng.standard_normal((8, hidden))), const("b1", rng.standard_normal(hidden)),
         const("W2", rng.standard_normal((hidden, 4)))],
    )


def diamond_model() -> onnx.ModelProto:
    """h = x * s is read by two nodes (Relu and Sigmoid) and is also y2: a fusion must not swallow it.

    y1 = Relu(h) + Sigmoid(h),  y2 = h.
    """
    return make_model(
        [
            helper.make_node("Mul", ["x", "s"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Sigmoid", ["h"], ["g"]),
            helper.make_node("Add", ["r", "g"], ["y1"]),
            helper.make_node("Identity", ["h"], ["y2"]),
        ],
        [tensor_info("x", [2, 3])],
        [tensor_info("y1", [2, 3]), tensor_info("y2", [2, 3])],
        [const("s", 3.0)],
    )

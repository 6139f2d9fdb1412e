"""fold_constants: constant subgraphs and static shapes."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
from onnx import helper

from diffusion_trt.errors import PassError
from diffusion_trt.passes import PassContext
from diffusion_trt.passes.fold_constants import fold_constants
from tests import graphs


def ctx(**options: object) -> PassContext:
    return PassContext(component="unet", backend="tensorrt", device="cuda", precision="fp16", options=dict(options))


def test_folds_constant_subgraph() -> None:
    model = graphs.constant_subgraph_model()
    graph = gs.import_onnx(model)
    result = fold_constants(graph, ctx())
    # Constant(value_float) must fold as float32: gs alone makes it float64 and ORT refuses Mul(float, double)
    assert result.modified and result.counts == {"nodes_folded": 3}  # Constant, Mul, Add
    assert [node.op for node in graph.nodes] == ["MatMul"]
    assert isinstance(graph.nodes[0].inputs[1], gs.Constant)
    graphs.assert_same_outputs(model, gs.export_onnx(graph))


def test_folds_static_shape_chain() -> None:
    model = graphs.shape_chain_model(batch=2)
    graph = gs.import_onnx(model)
    result = fold_constants(graph, ctx())
    assert result.counts == {"nodes_folded": 4}
    assert [node.op for node in graph.nodes] == ["Reshape"]
    np.testing.assert_array_equal(graph.nodes[0].inputs[1].values, [2, 12])
    graphs.assert_same_outputs(model, gs.export_onnx(graph))


def test_no_change_when_nothing_is_constant() -> None:
    model = graphs.shape_chain_model(batch="B")  # symbolic batch: the shape is not known
    graph = gs.import_onnx(model)
    result = fold_constants(graph, ctx())
    assert not result.modified and result.counts == {"nodes_folded": 0}
    assert len(graph.nodes) == 5
    graphs.assert_same_outputs(model, gs.export_onnx(graph), graphs.random_feeds(model, dims={"B": 3}))


def test_size_threshold_option_keeps_large_results() -> None:
    graph = gs.import_onnx(graphs.constant_subgraph_model())
    result = fold_constants(graph, ctx(fold_constants_size_threshold_bytes=16))  # W*2+b is 80 bytes
    assert [node.op for node in graph.nodes if node.op != "Constant"] == ["Mul", "Add", "MatMul"]
    assert result.counts["nodes_folded"] == 1  # only the Constant node became an initializer


def test_custom_domain_nodes_are_not_evaluated() -> None:
    model = graphs.make_model(
        [
            helper.make_node("MyPlugin", ["c"], ["p"], domain="trt.plugins"),
            helper.make_node("Add", ["x", "p"], ["y"]),
        ],
        [graphs.tensor_info("x", [2])],
        [graphs.tensor_info("y", [2])],
        [graphs.const("c", [1.0, 2.0])],
        extra_opsets=[("trt.plugins", 1)],
        check=False,
    )
    graph = gs.import_onnx(model)
    result = fold_constants(graph, ctx())
    assert not result.modified and [node.op for node in graph.nodes] == ["MyPlugin", "Add"]


def unevaluable_model() -> object:
    """Reshape of a constant [6] to [4]: foldable, but ONNX Runtime cannot evaluate it."""
    return graphs.make_model(
        [
            helper.make_node("Reshape", ["c", "shape"], ["r"]),
            helper.make_node("Add", ["x", "r"], ["y"]),
        ],
        [graphs.tensor_info("x", [4])],
        [graphs.tensor_info("y", [4])],
        [graphs.const("c", np.arange(6)), graphs.const("shape", [4], np.int64)],
    )


def test_evaluation_error_fails_the_pass_with_the_fix() -> None:
    graph = gs.import_onnx(unevaluable_model())
    with pytest.raises(PassError, match=r"fold_constants_error_ok"):
        fold_constants(graph, ctx())


def test_evaluation_error_tolerated_when_asked() -> None:
    graph = gs.import_onnx(unevaluable_model())
    result = fold_constants(graph, ctx(fold_constants_error_ok=True))
    assert not result.modified and [node.op for node in graph.nodes] == ["Reshape", "Add"]


def test_nested_if_with_a_constant_condition_stays_runnable() -> None:
    """silero-vad's form: an If whose branch holds an If with a constant condition. On silero_vad.onnx (package
    silero-vad 6.2.3) gs's inlining of such Ifs left a branch out of topological order, which ONNX Runtime
    refuses; this smaller graph did not reproduce that order, so the test pins the fix: the inner If stays."""
    from onnx import TensorProto, helper

    from diffusion_trt.passes import PassContext, optimize_model

    def branch(name: str, nodes: list, out: str) -> object:
        return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])

    inner_then = branch("inner_then", [helper.make_node("Add", ["x", "x"], ["t1"]),
                                       helper.make_node("Mul", ["t1", "x"], ["t2"])], "t2")
    inner_else = branch("inner_else", [helper.make_node("Neg", ["x"], ["e1"])], "e1")
    outer_else = branch("outer_else", [
        helper.make_node("Constant", [], ["k"], value=helper.make_tensor("k", TensorProto.BOOL, [], [True])),
        helper.make_node("If", ["k"], ["inner"], then_branch=inner_then, else_branch=inner_else),
        # reads ``inner`` only from inside its branches (an implicit outer-scope input)
        helper.make_node("If", ["c"], ["o2"],
                         then_branch=branch("t", [helper.make_node("Relu", ["inner"], ["r"])], "r"),
                         else_branch=branch("e", [helper.make_node("Neg", ["inner"], ["n"])], "n")),
    ], "o2")
    outer_then = branch("outer_then", [helper.make_node("Sigmoid", ["x"], ["o1"])], "o1")
    model = graphs.make_model(
        [helper.make_node("If", ["c"], ["y"], then_branch=outer_then, else_branch=outer_else)],
        [graphs.tensor_info("x", [2, 3]), graphs.tensor_info("c", [], TensorProto.BOOL)],
        [graphs.tensor_info("y", None)], check=False)
    ctx = PassContext(component="vad", backend="ort", device="cpu", precision="fp32")
    out, _ = optimize_model(model, [fold_constants], ctx)
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "c": np.array(False)}
    np.testing.assert_allclose(graphs.run(out, feeds)[0], graphs.run(model, feeds)[0])
    (else_branch,) = [a.g for a in out.graph.node[0].attribute if a.name == "else_branch"]
    inner = [n for n in else_branch.node if n.op_type == "If"]
    assert len(inner) == 2, "the If with a constant condition was inlined (flatten_subgraphs)"

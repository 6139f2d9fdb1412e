"""eliminate_dead_nodes: dead nodes and duplicate initializers."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from diffusion_trt.passes import PassContext
from diffusion_trt.passes.eliminate_dead_nodes import eliminate_dead_nodes
from tests import graphs

CTX = PassContext(component="unet", backend="ort", device="cpu", precision="fp32")


def run_pass(model: object) -> tuple[gs.Graph, object]:
    graph = gs.import_onnx(model)
    result = eliminate_dead_nodes(graph, CTX)
    return graph, result


def test_removes_dead_branch() -> None:
    model = graphs.dead_branch_model()
    graph, result = run_pass(model)
    assert result.modified and result.counts == {"nodes_removed": 2, "constants_deduped": 0}
    assert sorted(node.op for node in graph.nodes) == ["Add", "Relu"]
    graphs.assert_same_outputs(model, gs.export_onnx(graph))


def test_merges_identical_initializers_only() -> None:
    model = graphs.duplicate_constants_model()
    graph, result = run_pass(model)
    assert result.modified and result.counts == {"nodes_removed": 0, "constants_deduped": 1}
    muls = [node for node in graph.nodes if node.op == "Mul"]
    assert muls[0].inputs[1] is muls[1].inputs[1]  # both read s1 now
    out = gs.export_onnx(graph.cleanup())
    assert sorted(t.name for t in out.graph.initializer) == ["b", "s1"]
    graphs.assert_same_outputs(model, out)


def test_no_change_on_a_clean_graph() -> None:
    graph, result = run_pass(graphs.mlp_model())
    assert not result.modified and result.counts == {"nodes_removed": 0, "constants_deduped": 0}
    assert len(graph.nodes) == 4


def test_same_bytes_other_dtype_or_shape_or_graph_output_not_merged() -> None:
    ones_f = graphs.const("ones_f", np.ones(4))
    ones_2x2 = graphs.const("ones_2x2", np.ones((2, 2)))
    ones_i = graphs.const("ones_i", np.full(4, 0x3F800000), np.int32)  # the bytes of float32 1.0
    model = graphs.make_model(
        [
            helper.make_node("Add", ["x", "ones_f"], ["a"]),
            helper.make_node("Reshape", ["a", "shape"], ["a2"]),
            helper.make_node("Add", ["a2", "ones_2x2"], ["y"]),
            helper.make_node("Cast", ["ones_i"], ["i_f"], to=1),
            helper.make_node("Add", ["x", "i_f"], ["z"]),
        ],
        [graphs.tensor_info("x", [4])],
        [graphs.tensor_info("y", [2, 2]), graphs.tensor_info("z", [4])],
        [ones_f, ones_2x2, ones_i, graphs.const("shape", [2, 2], np.int64)],
    )
    graph, result = run_pass(model)
    assert result.counts["constants_deduped"] == 0 and not result.modified
    graphs.assert_same_outputs(model, gs.export_onnx(graph))


def test_constant_graph_output_is_not_merged_away() -> None:
    # c2 equals c1 but is also a graph output (ORT accepts an initializer as an output): its name must stay
    model = graphs.make_model(
        [helper.make_node("Add", ["x", "c1"], ["y"]), helper.make_node("Add", ["x", "c2"], ["z"])],
        [graphs.tensor_info("x", [3])],
        [graphs.tensor_info("y", [3]), graphs.tensor_info("z", [3]), graphs.tensor_info("c2", [3])],
        [graphs.const("c1", [1.0, 2.0, 3.0]), graphs.const("c2", [1.0, 2.0, 3.0])],
    )
    graph, result = run_pass(model)
    assert result.counts["constants_deduped"] == 0
    out = gs.export_onnx(graph)
    assert [o.name for o in out.graph.output] == ["y", "z", "c2"]
    graphs.assert_same_outputs(model, out)


def test_merges_identical_constant_nodes_and_initializers() -> None:
    # what the TorchScript exporter emits: the same axes / epsilon as many Constant nodes
    model = graphs.make_model(
        [
            helper.make_node("Constant", [], ["axes_a"], value=helper.make_tensor("v", 7, [1], [0])),
            helper.make_node("Constant", [], ["axes_b"], value_ints=[0]),
            helper.make_node("Constant", [], ["eps_a"], value_float=1e-5),
            helper.make_node("Constant", [], ["eps_b"], value=helper.make_tensor("v", 1, [], [1e-5])),
            helper.make_node("Unsqueeze", ["x", "axes_a"], ["u1"]),
            helper.make_node("Unsqueeze", ["x", "axes_b"], ["u2"]),
            helper.make_node("Unsqueeze", ["x", "axes_init"], ["u3"]),
            helper.make_node("Add", ["u1", "u2"], ["s"]),
            helper.make_node("Add", ["s", "u3"], ["s2"]),
            helper.make_node("Add", ["s2", "eps_a"], ["s3"]),
            helper.make_node("Add", ["s3", "eps_b"], ["y"]),
        ],
        [graphs.tensor_info("x", [3])],
        [graphs.tensor_info("y", [1, 3])],
        [graphs.const("axes_init", [0], np.int64)],
    )
    graph, result = run_pass(model)
    assert result.counts == {"nodes_removed": 2, "constants_deduped": 3}
    unsqueezes = [node for node in graph.nodes if node.op == "Unsqueeze"]
    assert len({id(node.inputs[1]) for node in unsqueezes}) == 1
    graphs.assert_same_outputs(model, gs.export_onnx(graph))

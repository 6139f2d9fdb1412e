"""fold_constants: constant subgraphs and static shapes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

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


def _generator_model(elements: int, adds: int) -> onnx.ModelProto:
    """ConstantOfShape([elements]) -> ``adds`` x Add(c, k_i) -> Mul(x, .): ``adds`` foldable results of
    ``elements`` float32 each, from a graph of a few hundred bytes."""
    nodes = [helper.make_node("Constant", [], ["s"], value=helper.make_tensor("s", TensorProto.INT64, [1],
                                                                                [elements])),
             helper.make_node("ConstantOfShape", ["s"], ["c"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0]))]
    outputs = []
    for i in range(adds):
        nodes.append(helper.make_node("Constant", [], [f"k{i}"], value_float=float(i)))
        nodes.append(helper.make_node("Add", ["c", f"k{i}"], [f"a{i}"]))
        nodes.append(helper.make_node("Mul", ["x", f"a{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [elements]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])], outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_folding_beyond_the_total_cap_fails_with_one_line_naming_the_option() -> None:
    graph = gs.import_onnx(_generator_model(1 << 18, 4))  # 4 results of 1 MiB from a ~400-byte graph
    with pytest.raises(PassError, match=r"add \d+ MiB of constants.*--pass-option fold_constants_max_total_bytes="):
        fold_constants(graph, ctx(fold_constants_max_total_bytes=2 << 20))
    graph = gs.import_onnx(_generator_model(1 << 18, 4))
    assert fold_constants(graph, ctx(fold_constants_max_total_bytes=8 << 20)).modified  # raised: it folds
    assert [node.op for node in graph.nodes] == ["Mul"] * 4


def test_the_total_cap_defaults_to_one_gib_and_is_a_user_option() -> None:
    from diffusion_trt.passes.fold_constants import DEFAULT_MAX_TOTAL_BYTES, FoldConstantsOptions
    from diffusion_trt.passes.options import check_pass_options

    assert DEFAULT_MAX_TOTAL_BYTES == 1 << 30
    assert ctx().options_for(FoldConstantsOptions).max_total_bytes == 1 << 30
    check_pass_options({"fold_constants_max_total_bytes": 4 << 30})
    with pytest.raises(ValueError, match=r"fold_constants_max_total_bytes='x'.*expects a positive integer"):
        check_pass_options({"fold_constants_max_total_bytes": "x"})


def test_a_generator_over_the_threshold_is_never_evaluated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ConstantOfShape of 256 MiB (the per-result threshold is 64 MiB) stays in the graph and ONNX Runtime is
    never asked to make it: before, it was materialised and then dropped (a 10 GB one hit the memory limit)."""
    import onnxruntime as ort

    made: list[int] = []
    real_run = ort.InferenceSession.run

    def run(self: ort.InferenceSession, *args: object, **kwargs: object) -> list[np.ndarray]:
        outputs = real_run(self, *args, **kwargs)
        made.extend(np.asarray(o).nbytes for o in outputs)
        return outputs

    monkeypatch.setattr(ort.InferenceSession, "run", run)
    graph = gs.import_onnx(_generator_model(1 << 26, 1))
    fold_constants(graph, ctx())
    assert "ConstantOfShape" in [node.op for node in graph.nodes]
    assert max(made, default=0) <= 64 << 20, made


def test_optimize_refuses_a_constant_bomb_with_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from diffusion_trt.cli import main

    path = tmp_path / "bomb.onnx"
    path.write_bytes(_generator_model(1 << 18, 4).SerializeToString())
    assert path.stat().st_size < 1000
    result = CliRunner().invoke(main, ["optimize", str(path), "-o", str(tmp_path / "out.onnx"), "--target", "ort-cpu",
                                       "--pass-option", "fold_constants_max_total_bytes=2097152"])
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "fold_constants_max_total_bytes=2097152" in errors[0], result.output
    assert "Traceback" not in result.output and not (tmp_path / "out.onnx").exists()


def _sequence_model() -> onnx.ModelProto:
    """ONNX's own test_sequence_model1: a sequence built from SequenceEmpty (no inputs: "constant"), read back."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 3])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("SequenceEmpty", [], ["empty"], dtype=TensorProto.FLOAT),
        helper.make_node("SequenceInsert", ["empty", "X"], ["s1"]),
        helper.make_node("SequenceInsert", ["s1", "Y"], ["s2"]),
        helper.make_node("SequenceAt", ["s2", "at"], ["out"]),
    ]
    at = helper.make_tensor("at", TensorProto.INT64, [], [1])
    graph = helper.make_graph(nodes, "sequence", [x, y], [out], [at])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_constant_sequence_is_left_unfolded() -> None:
    model = _sequence_model()
    graph = gs.import_onnx(model)
    result = fold_constants(graph, ctx())  # was: PassError "AttributeError: 'list' object has no attribute 'nbytes'"
    assert not result.modified
    assert [node.op for node in graph.nodes] == ["SequenceEmpty", "SequenceInsert", "SequenceInsert", "SequenceAt"]
    graphs.assert_same_outputs(model, gs.export_onnx(graph))


def test_optimize_takes_a_graph_with_a_constant_sequence(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from diffusion_trt.cli import main

    path = tmp_path / "sequence.onnx"
    onnx.save(_sequence_model(), path)
    result = CliRunner().invoke(main, ["optimize", str(path), "-o", str(tmp_path / "out.onnx"), "--target", "ort-cpu",
                                       "--check"])
    assert result.exit_code == 0, result.output
    assert "max_abs=0 " in result.output and (tmp_path / "out.onnx").exists()

"""PassManager, PassRecord, PassContext and optimize_model."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from diffusion_trt.errors import PassError
from diffusion_trt.passes import PassContext, PassManager, PassRecord, PassResult, optimize_model
from tests import graphs


def ctx(**kwargs: object) -> PassContext:
    values: dict[str, object] = {"component": "unet", "backend": "ort", "device": "cpu", "precision": "fp32"}
    values.update(kwargs)
    return PassContext(**values)  # type: ignore[arg-type]


def add_dead_relu(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Adds a node nobody reads: the manager's cleanup must remove it."""
    x = graph.inputs[0]
    graph.layer(op="Relu", inputs=[x], outputs=["unused"])
    return PassResult(modified=True, counts={"Relu": 1})


def no_op(graph: gs.Graph, ctx: PassContext) -> PassResult:
    return PassResult(modified=False)


def explode(graph: gs.Graph, ctx: PassContext) -> PassResult:
    raise ValueError("boom")


def returns_none(graph: gs.Graph, ctx: PassContext) -> PassResult:
    return None  # type: ignore[return-value]


def test_manager_runs_in_order_cleans_up_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    graph = gs.import_onnx(graphs.dead_branch_model())
    with caplog.at_level(logging.INFO, logger="diffusion_trt.passes"):
        records = PassManager([no_op, add_dead_relu]).run(graph, ctx())
    assert [r.name for r in records] == ["no_op", "add_dead_relu"]
    assert not any(node.op == "Relu" and node.outputs[0].name == "unused" for node in graph.nodes)
    # the dead branch of the model went too: cleanup runs after any modifying pass
    assert "Sigmoid" not in {node.op for node in graph.nodes}
    lines = [rec.getMessage() for rec in caplog.records]
    component = ctx().component
    assert lines[0].startswith(f"{component} no_op: no change (") and lines[0].endswith(" s)")
    assert lines[1].startswith(f"{component} add_dead_relu: Relu=1 (")


def test_error_names_pass_component_and_prior_passes() -> None:
    graph = gs.import_onnx(graphs.dead_branch_model())
    with pytest.raises(PassError) as info:
        PassManager([no_op, add_dead_relu, explode, no_op]).run(graph, ctx(component="vae_decoder"))
    message = str(info.value)
    assert "pass explode failed" in message and "vae_decoder" in message
    assert "[no_op, add_dead_relu]" in message and "ValueError: boom" in message
    assert "dump_dir" in message  # the fix
    assert isinstance(info.value.__cause__, ValueError)


def test_error_when_pass_returns_no_result() -> None:
    graph = gs.import_onnx(graphs.dead_branch_model())
    with pytest.raises(PassError, match=r"returns_none failed .*passes run before it: \[none\].*expected PassResult"):
        PassManager([returns_none]).run(graph, ctx())


def test_dump_dir_writes_loadable_graphs_and_weights_once(tmp_path: Path) -> None:
    model = graphs.mlp_model(hidden=64)  # W1 and W2 are 2 KiB each: above the 1 KiB external threshold
    graph = gs.import_onnx(model)
    PassManager([no_op, add_dead_relu, no_op]).run(graph, ctx(dump_dir=tmp_path))
    folder = tmp_path / "unet"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["00_input.onnx", "01_no_op.onnx", "02_add_dead_relu.onnx", "03_no_op.onnx", "weights.bin"]
    weight_bytes = (8 * 64 + 64 * 4) * 4  # W1 and W2; b1 (256 B) stays inline
    assert weight_bytes <= (folder / "weights.bin").stat().st_size < weight_bytes + 2 * 64  # stored once
    dumped = onnx.load_model(folder / "03_no_op.onnx", load_external_data=False)
    assert {t.name for t in dumped.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL} == {"W1", "W2"}
    graphs.assert_same_outputs(model, str(folder / "03_no_op.onnx"), graphs.random_feeds(model))


def test_dump_of_a_changed_weight_appends_it(tmp_path: Path) -> None:
    def scale_w1(graph: gs.Graph, ctx: PassContext) -> PassResult:
        w1 = graph.tensors()["W1"]
        assert isinstance(w1, gs.Constant)
        w1.values = w1.values * 2
        return PassResult(modified=True, counts={"scaled": 1})

    graph = gs.import_onnx(graphs.mlp_model(hidden=64))
    PassManager([no_op, scale_w1]).run(graph, ctx(dump_dir=tmp_path))
    size = (tmp_path / "unet" / "weights.bin").stat().st_size
    assert size >= (8 * 64 * 2 + 64 * 4) * 4  # W1 twice (before and after), W2 once


def test_record_json_and_context_description() -> None:
    record = PassRecord("fuse_group_norm", True, {"GroupNormalization": 61}, 0.8123)
    assert record.to_json() == {"name": "fuse_group_norm", "modified": True,
                                "counts": {"GroupNormalization": 61}, "seconds": 0.812}
    assert record.summary() == "fuse_group_norm: GroupNormalization=61 (0.8 s)"
    assert ctx().describe() == "unet (backend=ort, device=cpu, precision=fp32, opset=17)"
    assert ctx().options == {} and ctx().options is not ctx().options


def test_optimize_model_keeps_opsets_ir_version_and_metadata() -> None:
    model = graphs.make_model(graphs.dead_branch_model().graph.node, graphs.dead_branch_model().graph.input,
                              graphs.dead_branch_model().graph.output, graphs.dead_branch_model().graph.initializer,
                              opset=18, ir_version=8, extra_opsets=[("com.microsoft", 1)])
    model.metadata_props.add(key="source", value="tiny")
    seen: list[int] = []

    def record_opset(graph: gs.Graph, context: PassContext) -> PassResult:
        seen.append(context.opset)
        return PassResult(modified=False)

    context = ctx()
    out, records = optimize_model(model, [record_opset], context)
    assert seen == [18] and context.opset == 17  # passes see the model's opset; the caller's ctx is untouched
    assert out.ir_version == 8
    assert {(o.domain, o.version) for o in out.opset_import} == {("", 18), ("com.microsoft", 1)}
    assert [(p.key, p.value) for p in out.metadata_props] == [("source", "tiny")]
    assert [r.name for r in records] == ["record_opset"]
    graphs.assert_same_outputs(model, out)


def test_optimize_model_refuses_old_opset() -> None:
    model = graphs.make_model([onnx.helper.make_node("Relu", ["x"], ["y"])], [graphs.tensor_info("x", [2])],
                              [graphs.tensor_info("y", [2])], opset=13)
    with pytest.raises(PassError) as info:
        optimize_model(model, [], ctx(component="text_encoder"))
    message = str(info.value)
    assert "text_encoder" in message and "opset 13" in message
    assert f"17..{onnx.defs.onnx_opset_version()}" in message and "opset_version=17" in message


def test_optimize_model_refuses_opset_newer_than_onnx() -> None:
    model = graphs.make_model([onnx.helper.make_node("Relu", ["x"], ["y"])], [graphs.tensor_info("x", [2])],
                              [graphs.tensor_info("y", [2])], check=False)
    model.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    with pytest.raises(PassError, match="upgrade the onnx package"):
        optimize_model(model, [], ctx())


def test_optimize_model_wraps_pass_errors() -> None:
    with pytest.raises(PassError, match="pass explode failed"):
        optimize_model(graphs.dead_branch_model(), [explode], ctx())


def test_outputs_unchanged_by_manager_chores() -> None:
    model = graphs.dead_branch_model()
    out, _ = optimize_model(model, [add_dead_relu], ctx())
    assert graphs.op_counts(out) == {"Relu": 1, "Add": 1}
    graphs.assert_same_outputs(model, out, {"x": np.arange(6, dtype=np.float32).reshape(2, 3) - 3})


def test_error_with_dump_dir_points_at_the_graph_the_pass_got(tmp_path: Path) -> None:
    graph = gs.import_onnx(graphs.dead_branch_model())
    with pytest.raises(PassError, match=r"last file in .*unet") as info:
        PassManager([no_op, explode]).run(graph, ctx(dump_dir=str(tmp_path)))  # str accepted too
    assert "[no_op]" in str(info.value)
    assert sorted(p.name for p in (tmp_path / "unet").glob("*.onnx")) == ["00_input.onnx", "01_no_op.onnx"]


def test_options_for_reads_a_pass_options_by_key_typed_and_frozen() -> None:
    """``ctx.options`` keys go into each pass's frozen options dataclass, converted; keys not given keep defaults."""
    import dataclasses

    from diffusion_trt.passes.convert_fp16 import ConvertFp16Options
    from diffusion_trt.passes.fuse_gelu import FuseGeluOptions
    from diffusion_trt.passes.specialize_shapes import SpecializeShapesOptions

    c = ctx(options={"convert_fp16_fp32_ops": ["Softmax"], "convert_fp16_range_max": 1000,
                     "convert_fp16_range_check_max_bytes": None, "fuse_gelu_raise_opset": False,
                     "static_shapes": {"x": [2, "4"]}})
    fp16 = c.options_for(ConvertFp16Options)
    assert fp16.fp32_ops == ("Softmax",) and fp16.fp32_nodes == () and fp16.range_check is True
    assert fp16.range_max == 1000.0 and isinstance(fp16.range_max, float)
    assert fp16.range_check_max_bytes is None  # None given: the default
    assert c.options_for(FuseGeluOptions) == FuseGeluOptions(raise_opset=False)
    assert ctx().options_for(FuseGeluOptions).raise_opset is True
    assert c.options_for(SpecializeShapesOptions).static_shapes == {"x": (2, 4)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        fp16.keep_io_types = True  # type: ignore[misc]


def test_every_options_dataclass_is_listed_and_its_keys_name_its_pass() -> None:
    """passes/options.py lists every pass's options dataclass (the table --pass-option checks is derived from
    them), and each key is prefixed by the pass that owns it (static_shapes: compile's own key)."""
    import dataclasses
    import importlib
    import pkgutil

    import diffusion_trt.passes as package
    from diffusion_trt.passes.options import OPTIONS

    declared = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        declared |= {obj for name, obj in vars(module).items() if name.endswith("Options")
                     and dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__}
    assert declared == set(OPTIONS.values())
    for pass_name, cls in OPTIONS.items():
        assert cls.__dataclass_params__.frozen, cls
        for spec in dataclasses.fields(cls):
            assert spec.metadata["key"].startswith(pass_name) or spec.metadata["key"] == "static_shapes", spec

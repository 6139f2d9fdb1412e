"""convert_fp16: schema-checked fp16 graphs with fp32 islands, valid for the full checker and ONNX Runtime."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper

from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes.convert_fp16 import convert_fp16, find_fp16_overflow
from diffusion_trt.passes.fuse_attention import fuse_attention
from diffusion_trt.passes.specialize_shapes import specialize_shapes
from tests import graphs


def ctx(**options: object) -> PassContext:
    return PassContext(component="unet", backend="ort", device="cuda", precision="fp16", options=dict(options))


def mixed_model() -> onnx.ModelProto:
    """x -> Conv -> Sin -> Resize(scales) -> Cast(FLOAT) -> LayerNormalization -> Where(m, ., -3.4e38) -> y."""
    rng = np.random.default_rng(4)
    return graphs.make_model(
        [
            helper.make_node("Conv", ["x", "W"], ["c"], name="conv"),
            helper.make_node("Sin", ["c"], ["s"], name="sin"),
            helper.make_node("Resize", ["s", "", "scales"], ["r"], name="resize", mode="nearest"),
            helper.make_node("Cast", ["r"], ["rc"], name="cast", to=TensorProto.FLOAT),
            helper.make_node("LayerNormalization", ["rc", "gamma", "beta"], ["ln"], name="ln", axis=-1),
            helper.make_node("Where", ["m", "ln", "neg"], ["y"], name="where"),
        ],
        [graphs.tensor_info("x", [1, 2, 4, 4])],
        [graphs.tensor_info("y", [1, 2, 8, 8])],
        [graphs.const("W", rng.standard_normal((2, 2, 1, 1))), graphs.const("scales", [1, 1, 2, 2]),
         graphs.const("gamma", np.ones(8)), graphs.const("beta", np.zeros(8)),
         graphs.const("m", np.tril(np.ones((8, 8))), np.bool_), graphs.const("neg", -3.4e38)],
    )


def as_fp16(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}


def assert_close_to_fp32(model: onnx.ModelProto, out: onnx.ModelProto, feeds: dict[str, np.ndarray],
                         fp16_inputs: bool = True) -> None:
    onnx.checker.check_model(out, full_check=True)
    want = graphs.run(model, feeds)
    got = graphs.run(out, as_fp16(feeds) if fp16_inputs else feeds)
    rtol, atol = graphs.FP16_VS_FP32_TOLERANCE
    for w, g in zip(want, got, strict=True):
        finite = np.isfinite(w) & (np.abs(w) < 1e30)  # -3.4e38 becomes -65504: compare the rest
        np.testing.assert_allclose(g.astype(np.float32)[finite], w[finite], rtol=rtol, atol=atol)


def by_name(model: onnx.ModelProto) -> dict[str, onnx.NodeProto]:
    return {n.name: n for n in model.graph.node}


def test_converts_with_schema_checked_slots_and_islands() -> None:
    model = mixed_model()
    out, records = optimize_model(model, [convert_fp16], ctx())
    counts = records[0].counts
    assert counts["clipped"] == 1 and counts["Cast_removed"] == 1  # -3.4e38 clipped; the no-op Cast(FLOAT) gone
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    inits = {t.name: t for t in out.graph.initializer}
    assert inits["scales"].data_type == TensorProto.FLOAT  # Resize scales: tensor(float) only
    assert inits["W"].data_type == TensorProto.FLOAT16
    nodes = by_name(out)
    assert "cast" not in nodes
    # Sin is a default fp32 op: exactly one Cast in front of it and one after
    casts = [n for n in out.graph.node if n.op_type == "Cast"]
    assert sorted(helper.get_attribute_value(n.attribute[0]) for n in casts) == [TensorProto.FLOAT,
                                                                              TensorProto.FLOAT16]
    assert nodes["sin"].input[0] != "c" and nodes["resize"].input[0] != "s"
    assert_close_to_fp32(model, out, graphs.random_feeds(model))


def test_keep_io_types_casts_only_at_the_boundaries() -> None:
    model = mixed_model()
    out, records = optimize_model(model, [convert_fp16], ctx(convert_fp16_keep_io_types=True))
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert out.graph.output[0].name == "y"
    assert records[0].counts["Cast_inserted"] == 4  # x in, y out, around Sin
    assert_close_to_fp32(model, out, graphs.random_feeds(model), fp16_inputs=False)


@pytest.mark.parametrize("options", [{"convert_fp16_fp32_nodes": ["ln"]},
                                     {"convert_fp16_fp32_ops": ["LayerNormalization"]}], ids=["by-name", "by-op"])
def test_fp32_islands(options: dict) -> None:
    model = mixed_model()
    out, records = optimize_model(model, [convert_fp16], ctx(**options))
    assert records[0].counts["fp32_nodes"] == 2  # sin (default) + ln
    inits = {t.name: t for t in out.graph.initializer}
    assert inits["gamma"].data_type == TensorProto.FLOAT and inits["beta"].data_type == TensorProto.FLOAT
    assert by_name(out)["ln"].input[0].endswith("to_float32")
    assert_close_to_fp32(model, out, graphs.random_feeds(model))


def test_does_not_fire_without_float_tensors() -> None:
    model = graphs.make_model([helper.make_node("Add", ["a", "b"], ["c"])],
                              [graphs.tensor_info("a", [3], TensorProto.INT64)],
                              [graphs.tensor_info("c", [3], TensorProto.INT64)],
                              [graphs.const("b", [1, 2, 3], np.int64)])
    out, records = optimize_model(model, [convert_fp16], ctx())
    assert not records[0].modified and records[0].counts["fp16_nodes"] == 0
    assert graphs.op_counts(out) == {"Add": 1}


def test_constant_read_in_both_precisions_is_duplicated() -> None:
    model = graphs.make_model(
        [helper.make_node("Mul", ["x", "k"], ["a"], name="mul"), helper.make_node("Sin", ["k"], ["b"], name="sin"),
         helper.make_node("Add", ["a", "b"], ["y"], name="add")],
        [graphs.tensor_info("x", [4])], [graphs.tensor_info("y", [4])], [graphs.const("k", [0.1, 0.2, 0.3, 0.4])])
    out, _ = optimize_model(model, [convert_fp16], ctx())
    types = {t.name: t.data_type for t in out.graph.initializer}
    assert types == {"k": TensorProto.FLOAT, "k/float16": TensorProto.FLOAT16}
    assert_close_to_fp32(model, out, graphs.random_feeds(model))


def overflow_model() -> onnx.ModelProto:
    """y = ((x * 1000) * 1000) * 1e-6: the middle activation overflows fp16, the result does not."""
    return graphs.make_model(
        [helper.make_node("Mul", ["x", "k"], ["a"], name="up1"), helper.make_node("Mul", ["a", "k"], ["b"], name="up2"),
         helper.make_node("Mul", ["b", "d"], ["y"], name="down")],
        [graphs.tensor_info("x", [8])], [graphs.tensor_info("y", [8])],
        [graphs.const("k", 1000.0), graphs.const("d", 1e-6)])


def test_find_fp16_overflow_keeps_the_hot_nodes_in_fp32() -> None:
    model = overflow_model()
    feeds = {"x": np.linspace(-1, 1, 8).astype(np.float32)}
    hot = find_fp16_overflow(model, feeds)
    assert hot == ["down", "up2"]
    # ORT CPU has no fp16 Mul: its InsertCastTransformer runs fp16 nodes in fp32, so an fp16 overflow cannot be
    # reproduced here; check the island instead: up2 and down compute in fp32 between two Casts.
    safe, records = optimize_model(model, [convert_fp16], ctx(convert_fp16_fp32_nodes=hot))
    assert records[0].counts["fp32_nodes"] == 2 and records[0].counts["Cast_inserted"] == 2
    nodes = by_name(safe)
    assert nodes["up2"].input[0] == "a/to_float32" and nodes["up1"].output[0] == "a"
    assert {t.name: t.data_type for t in safe.graph.initializer} == {
        "k": TensorProto.FLOAT, "k/float16": TensorProto.FLOAT16, "d": TensorProto.FLOAT}
    assert_close_to_fp32(model, safe, feeds)


# --- real exports ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_tiny_unet_fp16(tiny_onnx: Callable[[str, bool], onnx.ModelProto], static: bool) -> None:
    """The ORT-CUDA order: (specialize_shapes) -> fuse_attention -> convert_fp16; MHA runs in fp16 on ORT CPU."""
    model = tiny_onnx("unet", static)
    out, records = optimize_model(model, [fuse_attention, convert_fp16], ctx())
    assert records[0].counts["Attention"] == 32
    ops = graphs.op_counts(out)
    assert ops["Resize"] == 3 and ops.get("Cast", 0) <= 4  # exporter's float Casts folded away; Sin/Cos island
    feeds = graphs.random_feeds(model, dims={"B2": 2, "h": 9, "w": 7})
    feeds["timestep"] = np.array([981.0, 1.0], dtype=np.float32)
    assert_close_to_fp32(model, out, feeds)


def test_tiny_unet_fp16_after_specialization(tiny_onnx: Callable[[str, bool], onnx.ModelProto]) -> None:
    model = tiny_onnx("unet", False)
    shapes = {"sample": [2, 4, 9, 7], "timestep": [2], "encoder_hidden_states": [2, 77, 32]}
    context = ctx(static_shapes=shapes, convert_fp16_keep_io_types=True)
    out, _ = optimize_model(model, [specialize_shapes, fuse_attention, convert_fp16], context)
    assert "Shape" not in graphs.op_counts(out)
    rng = np.random.default_rng(1)
    feeds = {name: rng.standard_normal(dims).astype(np.float32) for name, dims in shapes.items()}
    assert_close_to_fp32(model, out, feeds, fp16_inputs=False)


def test_tiny_vae_decoder_fp16(tiny_onnx: Callable[[str, bool], onnx.ModelProto]) -> None:
    model = tiny_onnx("vae_decoder", False)
    out, _ = optimize_model(model, [fuse_attention, convert_fp16], ctx())
    assert graphs.op_counts(out)["MultiHeadAttention"] == 1
    graph = gs.import_onnx(out)
    for node in graph.nodes:  # the peer's bug: a float16 constant feeding Resize's scales
        if node.op == "Resize" and len(node.inputs) > 2 and node.inputs[2].name:
            assert np.dtype(node.inputs[2].dtype) == np.float32
    assert_close_to_fp32(model, out, graphs.random_feeds(model, dims={"B": 1, "h": 9, "w": 7}))


def test_contrib_group_norm_keeps_float32_gamma_beta() -> None:
    """ORT's CUDA GroupNorm refuses fp16 gamma/beta at run time: they stay float32 initializers."""
    x = gs.Variable("x", dtype=np.float32, shape=[1, 4, 4, 8])
    y = gs.Variable("y", dtype=np.float32, shape=[1, 4, 4, 8])
    gamma = gs.Constant("gamma", np.ones(8, np.float32))
    beta = gs.Constant("beta", np.zeros(8, np.float32))
    node = gs.Node("GroupNorm", "gn", attrs={"epsilon": 1e-5, "groups": 2, "activation": 0, "channels_last": 1},
                    inputs=[x, gamma, beta], outputs=[y], domain="com.microsoft")
    graph = gs.Graph(nodes=[node], inputs=[x], outputs=[y], opset=17)
    convert_fp16(graph, PassContext(component="unet", backend="ort", device="cuda", precision="fp16"))
    (gn,) = [n for n in graph.nodes if n.op == "GroupNorm"]
    assert gn.inputs[0].dtype == np.float16
    assert gn.inputs[1].values.dtype == np.float32 and gn.inputs[2].values.dtype == np.float32
    assert graph.outputs[0].dtype == np.float16

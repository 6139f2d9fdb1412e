"""infer_symbolic_shapes: a dynamic graph's equal dims get one name, so the residual fusions match at every size."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import helper

from diffusion_trt.passes import PassContext, optimize_model, pipeline_for
from diffusion_trt.passes.fuse_skip_layer_norm import fuse_skip_layer_norm
from diffusion_trt.passes.infer_shapes import infer_shapes
from diffusion_trt.passes.infer_symbolic_shapes import fold_static_dims, infer_symbolic_shapes, refine
from diffusion_trt.passes.merge_conv_biases import merge_conv_biases
from tests import graphs

C = 8


def _conv(name: str, x: str, out: str, rng: np.random.Generator, *, stride: int = 1) -> tuple[onnx.NodeProto, list]:
    node = helper.make_node("Conv", [x, f"{name}_W", f"{name}_b"], [out], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                            strides=[stride, stride])
    return node, [graphs.const(f"{name}_W", rng.standard_normal((C, C, 3, 3)) / 8),
                  graphs.const(f"{name}_b", rng.standard_normal(C))]


def conv_sum_model(second_input: str = "x") -> onnx.ModelProto:
    """``s = Conv_a(x) + Conv_b(second_input)`` (3x3, pad 1, biased), x: [B, 8, h, w]; ``y`` [B, 8, g, w] when
    given (so the sum may broadcast when g is 1)."""
    rng = np.random.default_rng(3)
    conv_a, inits_a = _conv("a", "x", "ya", rng)
    conv_b, inits_b = _conv("b", second_input, "yb", rng)
    nodes = [conv_a, conv_b, helper.make_node("Add", ["ya", "yb"], ["s"]), helper.make_node("Relu", ["s"], ["out"])]
    inputs = [graphs.tensor_info("x", ["B", C, "h", "w"])]
    if second_input != "x":
        inputs.append(graphs.tensor_info(second_input, ["B", C, "g", "w"]))
    out = graphs.tensor_info("out", ["B", C, None, "w"])
    return graphs.make_model(nodes, inputs, [out], [*inits_a, *inits_b])


def tokens_residual_model() -> onnx.ModelProto:
    """A transformer block's residual over a feature map: ``t = reshape(x, [0, 8, -1]) ^T`` ([B, h*w, 8]);
    ``LayerNorm(t @ W + b + t)``; ONNX inference names the token dim of each Reshape output apart."""
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["xf"]),
             helper.make_node("Transpose", ["xf"], ["t"], perm=[0, 2, 1]),
             helper.make_node("Reshape", ["x", "flat"], ["xf2"]),
             helper.make_node("Transpose", ["xf2"], ["t2"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "W"], ["mm"]),
             helper.make_node("Add", ["mm", "bias"], ["p"]),
             helper.make_node("Add", ["p", "t2"], ["s"]),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5)]
    inits = [graphs.const("flat", [0, C, -1], np.int64), graphs.const("W", rng.standard_normal((C, C)) / 3),
             graphs.const("bias", rng.standard_normal(C)), graphs.const("gamma", rng.standard_normal(C)),
             graphs.const("beta", rng.standard_normal(C))]
    model = graphs.make_model(nodes, [graphs.tensor_info("x", ["B", C, "h", "w"])],
                              [graphs.tensor_info("y", ["B", None, C])], inits)
    return model


def _run(model: onnx.ModelProto, passes: list) -> tuple[onnx.ModelProto, dict[str, dict[str, int]]]:
    ctx = PassContext(component="unet", backend="ort", device="cuda", precision="fp32")
    out, records = optimize_model(model, passes, ctx)
    return out, {r.name: r.counts for r in records}


def test_equal_conv_outputs_get_one_name_and_their_biases_merge() -> None:
    model = conv_sum_model()
    _, before = _run(model, [infer_shapes, merge_conv_biases])
    assert before["merge_conv_biases"]["merged"] == 0 and before["merge_conv_biases"]["rejected"] == 1
    out, after = _run(model, [infer_shapes, infer_symbolic_shapes, merge_conv_biases])
    assert after["infer_symbolic_shapes"]["failed"] == 0 and after["infer_symbolic_shapes"]["dims_refined"] >= 4
    assert after["merge_conv_biases"] == {"merged": 1, "into_skip_group_norm": 0, "rejected": 0,
                                          "skipped_for_target": 0}
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in out.graph.value_info}
    assert shapes["ya"] == shapes["yb"] == ["B", C, "h", "w"]
    for dims in ({"B": 1, "h": 5, "w": 7}, {"B": 3, "h": 4, "w": 2}):  # Conv + Add are standard ops: CPU runs them
        graphs.assert_same_outputs(model, out, graphs.random_feeds(model, dims=dims))


def test_dims_that_may_differ_keep_the_sum_unmerged() -> None:
    """``Conv(x) + Conv(y)`` with x's h and y's g: g may be 1 (a broadcast), so the names must stay apart."""
    model = conv_sum_model(second_input="y")
    out, counts = _run(model, [infer_shapes, infer_symbolic_shapes, merge_conv_biases])
    assert counts["merge_conv_biases"]["merged"] == 0 and counts["merge_conv_biases"]["rejected"] == 1
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in out.graph.value_info}
    assert shapes["ya"][2] == "h" and shapes["yb"][2] == "g"


def test_token_dims_of_two_reshapes_match_and_the_skip_layer_norm_fuses() -> None:
    model = tokens_residual_model()
    _, before = _run(model, [infer_shapes, fuse_skip_layer_norm])
    assert before["fuse_skip_layer_norm"]["SkipLayerNormalization"] == 0
    assert before["fuse_skip_layer_norm"]["rejected"] == 1
    out, after = _run(model, [infer_shapes, infer_symbolic_shapes, fuse_skip_layer_norm])
    assert after["fuse_skip_layer_norm"]["SkipLayerNormalization"] == 1
    assert after["fuse_skip_layer_norm"]["with_bias"] == 1
    assert graphs.op_counts(out).get("SkipLayerNormalization") == 1


def test_static_graph_is_left_alone() -> None:
    model = graphs.mlp_model()
    out, counts = _run(model, [infer_shapes, infer_symbolic_shapes])
    assert counts["infer_symbolic_shapes"] == {"shapes_refined": 0, "dims_refined": 0, "static_dims_folded": 0,
                                               "failed": 0, "dims_merged": 0}
    assert out.graph.node == model.graph.node


@pytest.mark.parametrize(("old", "new", "want"), [
    (["B", 8, "unk__3"], ["B", 8, "h*w"], ["B", 8, "h*w"]),
    (["B", 8, None], ["B", 8, None], None),  # nothing known: no change
    (["B", 8, "h"], ["B", 16, "h"], None),  # contradicts an int: keep the old shape
    (["B", 8], ["B", 8, "h"], None),  # another rank
])
def test_refine_keeps_ints_and_takes_names(old: list, new: list, want: list | None) -> None:
    assert refine(old, new) == want


def test_shape_gathers_of_static_dims_fold() -> None:
    """``Shape(x)[1]`` (static 8) becomes a constant; ``Shape(x)[2]`` (h) stays a Gather."""
    x = gs.Variable("x", dtype=np.float32, shape=["B", C, "h", "w"])
    shape = gs.Variable("shape", dtype=np.int64, shape=[4])
    channels, height = gs.Variable("c", dtype=np.int64, shape=[]), gs.Variable("hh", dtype=np.int64, shape=[])
    nodes = [gs.Node("Shape", inputs=[x], outputs=[shape]),
             gs.Node("Gather", inputs=[shape, gs.Constant("i1", np.array(1, dtype=np.int64))], outputs=[channels]),
             gs.Node("Gather", inputs=[shape, gs.Constant("i2", np.array(2, dtype=np.int64))], outputs=[height])]
    graph = gs.Graph(nodes=nodes, inputs=[x], outputs=[channels, height])
    assert fold_static_dims(graph) == 1
    assert isinstance(channels, gs.Constant) and int(channels.values) == C and channels.values.shape == ()
    assert not isinstance(height, gs.Constant)


def test_only_dynamic_ort_cuda_pipelines_run_it() -> None:
    def names(*key: str, static: bool) -> list[str]:
        return [p.__name__ for p in pipeline_for(*key, "unet", static=static)]

    dynamic = names("ort", "cuda", "fp16", static=False)
    assert dynamic.index("infer_symbolic_shapes") == dynamic.index("infer_shapes") + 1
    assert "infer_symbolic_shapes" not in names("ort", "cuda", "fp16", static=True)
    assert "infer_symbolic_shapes" not in names("ort", "cpu", "fp32", static=False)
    assert "infer_symbolic_shapes" not in names("tensorrt", "cuda", "fp16", static=False)


def derived_input_model(residual_dims: tuple[str, str] = ("h/2", "w/2"), *, control: bool = False) -> onnx.ModelProto:
    """A UNet down step with a ControlNet residual: ``s = Conv_a(x, stride 2) + r`` (r: [B, 8, h/2, w/2]);
    ``out = Relu(Conv_b(s) + Conv_c(r))``, whose biases merge when the two Conv outputs have one shape.
    ``control``: a ControlNet's entry instead: ``s = Conv_a(x) + E(c)``, E three stride-2 Convs of the control
    image c: [B, 8, H, W] (H = 8*h); ``out = Relu(Conv_b(s) + Conv_c(x))``."""
    rng = np.random.default_rng(7)
    nodes, inits = [], []
    for name, src, out, stride in ([("a", "x", "ya", 1), ("e1", "c", "c1", 2), ("e2", "c1", "c2", 2),
                                    ("e3", "c2", "yr", 2)] if control else [("a", "x", "ya", 2)]):
        node, init = _conv(name, src, out, rng, stride=stride)
        nodes.append(node)
        inits += init
    conv_b, inits_b = _conv("b", "s", "yb", rng)
    conv_c, inits_c = _conv("c", "x" if control else "r", "yc", rng)
    nodes += [helper.make_node("Add", ["ya", "yr" if control else "r"], ["s"]), conv_b, conv_c,
              helper.make_node("Add", ["yb", "yc"], ["t"]), helper.make_node("Relu", ["t"], ["out"])]
    second = (graphs.tensor_info("c", ["B", C, "H", "W"]) if control
              else graphs.tensor_info("r", ["B", C, *residual_dims]))
    inputs = [graphs.tensor_info("x", ["B", C, "h", "w"]), second]
    return graphs.make_model(nodes, inputs, [graphs.tensor_info("out", ["B", C, None, None])],
                             [*inits, *inits_b, *inits_c])


def _run_with(model: onnx.ModelProto, passes: list, options: dict) -> tuple[onnx.ModelProto, dict[str, dict]]:
    ctx = PassContext(component="unet_controlnet", backend="ort", device="cuda", precision="fp32", options=options)
    out, records = optimize_model(model, passes, ctx)
    return out, {r.name: r.counts for r in records}


def _shapes(model: onnx.ModelProto) -> dict[str, list]:
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.value_info}


def test_a_residual_input_named_h_over_2_is_the_stride_2_convs_output() -> None:
    """Conv(x, stride 2) gives floor(h/2 - 1/2) + 1 = ceil(h/2): the residual input's ``h/2`` (issue #25: the
    unet_controlnet graph fused 5 of the UNet's 45 SkipGroupNorms, a ControlNet none)."""
    model = derived_input_model()
    out, counts = _run_with(model, [infer_shapes, infer_symbolic_shapes, merge_conv_biases], {})
    assert counts["infer_symbolic_shapes"]["dims_merged"] == 2 and counts["infer_symbolic_shapes"]["failed"] == 0
    shapes = _shapes(out)
    assert shapes["s"] == ["B", C, "h/2", "w/2"]
    assert counts["merge_conv_biases"]["merged"] == 1
    for dims in ({"B": 1, "h": 5, "w": 7, "h/2": 3, "w/2": 4}, {"B": 2, "h": 4, "w": 2, "h/2": 2, "w/2": 1}):
        graphs.assert_same_outputs(model, out, graphs.random_feeds(model, dims=dims))


def test_a_residual_of_another_size_stays_apart() -> None:
    """``h/4`` after one stride-2 Conv: equal at no size but a few, so the Add keeps its unknown dims."""
    model = derived_input_model(("h/4", "w/4"))
    out, counts = _run_with(model, [infer_shapes, infer_symbolic_shapes, merge_conv_biases], {})
    assert counts["infer_symbolic_shapes"]["dims_merged"] == 0
    assert counts["merge_conv_biases"]["merged"] == 0
    assert "h/4" not in _shapes(out)["s"]


def test_a_controlnets_image_embedding_is_the_latents_size_given_h_is_8_h() -> None:
    model = derived_input_model(control=True)
    relations = {"infer_symbolic_shapes_dim_relations": {"H": "8*h", "W": "8*w"}}
    _, without = _run_with(model, [infer_shapes, infer_symbolic_shapes, merge_conv_biases], {})
    assert without["merge_conv_biases"]["merged"] == 0  # H is a symbol of its own: the Add's dims stay unknown
    out, counts = _run_with(model, [infer_shapes, infer_symbolic_shapes, merge_conv_biases], relations)
    assert counts["infer_symbolic_shapes"]["dims_merged"] == 2
    assert _shapes(out)["s"] == ["B", C, "h", "w"] and counts["merge_conv_biases"]["merged"] == 2  # both Adds
    for dims in ({"B": 1, "h": 3, "w": 5, "H": 24, "W": 40}, {"B": 2, "h": 2, "w": 1, "H": 16, "W": 8}):
        graphs.assert_same_outputs(model, out, graphs.random_feeds(model, dims=dims))

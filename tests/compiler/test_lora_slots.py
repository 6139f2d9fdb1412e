"""compile --refittable for ONNX Runtime: which weights become graph inputs, and the 1x1 Convs reading them as
MatMuls (compiler/lora_slots.py)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from diffusion_trt.compiler.lora_slots import expose_weights, spatial_conv_weights
from diffusion_trt.runtime.refit import array_key

RMAP = {"weights": {"proj.weight": {"initializer": "pw"}, "conv3.weight": {"initializer": "k3"},
                    "down.weight": {"initializer": "s1"}, "lin.weight": {"initializer": "lw"}}}


def _graph(bias: bool) -> onnx.ModelProto:
    """x -> Conv 1x1 (pw) -> Conv 3x3 (k3) -> Conv 1x1 stride 2 (s1) -> MatMul (lw) -> y."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 4, 1, 1)).astype(np.float32), "pw"),
             numpy_helper.from_array(rng.standard_normal((6, 6, 3, 3)).astype(np.float32), "k3"),
             numpy_helper.from_array(rng.standard_normal((6, 6, 1, 1)).astype(np.float32), "s1"),
             numpy_helper.from_array(rng.standard_normal((3, 5)).astype(np.float32), "lw"),
             *([numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "pb")] if bias else [])]
    nodes = [helper.make_node("Conv", ["x", "pw", *(["pb"] if bias else [])], ["h"], name="proj", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["h", "k3"], ["h3"], name="conv3", pads=[1, 1, 1, 1]),
             helper.make_node("Conv", ["h3", "s1"], ["hs"], name="down", strides=[2, 2]),
             helper.make_node("MatMul", ["hs", "lw"], ["y"], name="lin")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6, 3, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], feeds)[0]


def test_spatial_conv_weights_are_those_no_matmul_can_replace() -> None:
    assert spatial_conv_weights(_graph(bias=True)) == {"k3", "s1"}  # 3x3, and a strided 1x1


@pytest.mark.parametrize("refit_convs", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_a_pointwise_conv_reading_a_weight_input_becomes_a_matmul_with_the_same_output(
    bias: bool, refit_convs: bool
) -> None:
    model = _graph(bias)
    x = np.random.default_rng(1).standard_normal((2, 4, 6, 6)).astype(np.float32)
    expected = _run(model, {"x": x})
    conv_weight = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "pw"))
    rmap = copy.deepcopy(RMAP)
    model, values = expose_weights(model, rmap, refit_convs=refit_convs)
    onnx.checker.check_model(model, full_check=True)
    inputs = {i.name for i in model.graph.input}
    # by default the spatial Convs keep constant weights (NHWC-safe); --refit-convs makes them inputs too
    assert set(values) == ({"pw", "lw", "k3", "s1"} if refit_convs else {"pw", "lw"})
    assert set(values) <= inputs and not set(values) & {i.name for i in model.graph.initializer}
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert [n.input[1] for n in convs] == ["k3", "s1"]  # the 1x1 stride-1 Conv is gone
    assert all((n.input[1] in inputs) == refit_convs for n in convs)
    assert any(n.op_type == "MatMul" and n.input[1] == "pw" for n in model.graph.node)  # the input itself
    assert not {"Shape", "Slice", "Concat", "Reshape"} & {n.op_type for n in model.graph.node}
    # the bound tensor is the MatMul's [C, O] matrix, and the refit map says so (the runtime transposes deltas)
    np.testing.assert_array_equal(values["pw"], conv_weight[:, :, 0, 0].T)
    assert rmap["weights"]["proj.weight"] == {"initializer": "pw", "transpose": True, "pointwise": True,
                                              "sha256": array_key(values["pw"])}
    assert rmap["weights"]["lin.weight"] == RMAP["weights"]["lin.weight"]  # the others unchanged
    got = _run(model, {"x": x, **values})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    other = {**values, "pw": values["pw"] * 2}  # a LoRA'd weight bound later reaches the MatMul
    assert not np.allclose(_run(model, {"x": x, **other}), expected)


def test_a_graph_with_no_pointwise_conv_input_is_left_as_it_was() -> None:
    """Only the Linear weight is mapped: no rewrite runs, the model is the one given (no copy of its weights)."""
    model = _graph(bias=True)
    rmap = {"weights": {"lin.weight": {"initializer": "lw", "transpose": False}}}
    out, values = expose_weights(model, rmap)
    assert out is model and set(values) == {"lw"} and values["lw"].shape == (3, 5)
    assert [n.op_type for n in out.graph.node].count("Conv") == 3


# -- unet_controlnet's weight inputs named as unet's (write_weight_inputs(share_with=...)) --------------------------


def test_rename_tensors_moves_a_clashing_tensor_aside_and_keeps_the_outputs() -> None:
    """The exporter numbers tensors anew per graph: the name a weight input takes (unet's) can be another tensor's
    in unet_controlnet's graph. That tensor moves aside, a swap of two names renames both, the graph computes the
    same, and a graph input or output is never taken."""
    from diffusion_trt.compiler.lora_slots import rename_tensors

    model, values = expose_weights(_graph(bias=False), copy.deepcopy(RMAP))  # pw, lw inputs; h, h3, hs tensors
    x = np.random.default_rng(1).standard_normal((2, 4, 6, 6)).astype(np.float32)
    want = _run(model, {"x": x, **values})
    renamed = copy.deepcopy(model)
    rename_tensors(renamed, {"pw": "lw", "lw": "h3"})  # a swap, and a name the 3x3 Conv's output holds
    inputs = [i.name for i in renamed.graph.input]
    assert "pw" not in inputs and {"lw", "h3", "x"} <= set(inputs)
    assert "h3__0" in {o for n in renamed.graph.node for o in n.output}  # the Conv's output, moved aside
    np.testing.assert_array_equal(_run(renamed, {"x": x, "lw": values["pw"], "h3": values["lw"]}), want)
    for bad, message in [({"pw": "x"}, "'x' is a graph input or output"), ({"pw": "y"}, "'y' is a graph input"),
                         ({"pw": "a", "lw": "a"}, "two tensors would get one name")]:
        untouched = copy.deepcopy(model)
        with pytest.raises(ValueError, match=message):
            rename_tensors(untouched, bad)
        assert untouched == model

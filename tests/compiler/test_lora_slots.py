"""compile --refittable for ONNX Runtime: weights as graph inputs, and the 1x1 Convs reading them as MatMuls."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from diffusion_trt.compiler.lora_slots import expose_weights


def _graph(bias: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 4, 1, 1)).astype(np.float32), "pw"),
             numpy_helper.from_array(rng.standard_normal((6, 6, 3, 3)).astype(np.float32), "k3"),
             *([numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "pb")] if bias else [])]
    nodes = [helper.make_node("Conv", ["x", "pw", *(["pb"] if bias else [])], ["h"], name="proj", kernel_shape=[1, 1]),
             helper.make_node("Conv", ["h", "k3"], ["y"], name="conv3", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4, "h", "w"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 6, "h", "w"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(["y"], feeds)[0]


@pytest.mark.parametrize("bias", [True, False])
def test_a_pointwise_conv_reading_a_weight_input_becomes_a_matmul_with_the_same_output(bias: bool) -> None:
    model = _graph(bias)
    x = np.random.default_rng(1).standard_normal((2, 4, 3, 5)).astype(np.float32)
    expected = _run(model, {"x": x})
    rmap = {"weights": {"proj.weight": {"initializer": "pw"}, "conv3.weight": {"initializer": "k3"}}}
    values = expose_weights(model, rmap)
    onnx.checker.check_model(model, full_check=True)
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert [n.input[1] for n in convs] == ["k3"]  # the 3x3 Conv keeps its (input) weight; the 1x1 one is gone
    assert any(n.op_type == "MatMul" and n.input[0] == "proj_pointwise_w" for n in model.graph.node)
    assert "pb" not in {i.name for i in model.graph.initializer}  # the bias now lives reshaped, not twice
    assert values["pw"].shape == (6, 4, 1, 1)  # the bound tensor keeps the Conv layout: the runtime is unchanged
    got = _run(model, {"x": x, **values})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    other = {**values, "pw": values["pw"] * 2}  # a LoRA'd weight bound later reaches the MatMul
    assert not np.allclose(_run(model, {"x": x, **other}), expected)

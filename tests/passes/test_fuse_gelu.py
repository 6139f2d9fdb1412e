"""fuse_gelu: erf-GELU, tanh-GELU and quick_gelu -> the target's GELU op."""

from __future__ import annotations

import logging
import math
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.passes.fuse_gelu import fuse_gelu
from tests import graphs
from tests.passes.fusion_helpers import domains, fuse, reasons

SHAPE = ["N", 6]


def erf_gelu_model(form: str = "a", scale: str = "div", half: float = 0.5, opset: int = 17,
                   erf_is_output: bool = False) -> onnx.ModelProto:
    """y = 0.5 * x * (1 + erf(x / sqrt 2)) in one of the associations (a) (x*p)*0.5, (b) x*(p*0.5),
    (c) (x*0.5)*p; ``scale`` "div" (x / sqrt 2) or "mul" (1/sqrt 2 * x)."""
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["s"]) if scale == "div"
             else helper.make_node("Mul", ["inv_sqrt2", "x"], ["s"]),
             helper.make_node("Erf", ["s"], ["e"]),
             helper.make_node("Add", ["one", "e"], ["p"])]
    nodes += {
        "a": [helper.make_node("Mul", ["x", "p"], ["xp"]), helper.make_node("Mul", ["xp", "half"], ["y"])],
        "b": [helper.make_node("Mul", ["half", "p"], ["ph"]), helper.make_node("Mul", ["ph", "x"], ["y"])],
        "c": [helper.make_node("Mul", ["x", "half"], ["xh"]), helper.make_node("Mul", ["p", "xh"], ["y"])],
    }[form]
    inits = [graphs.const("sqrt2", math.sqrt(2)), graphs.const("inv_sqrt2", 1 / math.sqrt(2)),
             graphs.const("one", 1.0), graphs.const("half", half)]
    outputs = [graphs.tensor_info("y", SHAPE)] + ([graphs.tensor_info("e", SHAPE)] if erf_is_output else [])
    return graphs.make_model(nodes, [graphs.tensor_info("x", SHAPE)], outputs, inits, opset=opset)


def tanh_gelu_model(cube: str = "mul") -> onnx.ModelProto:
    """The tanh GELU as torch exports F.gelu(x, approximate="tanh") (cube as x*x*x or Pow(x, 3))."""
    cube_nodes = ([helper.make_node("Mul", ["x", "x"], ["x2"]), helper.make_node("Mul", ["x", "x2"], ["x3"])]
                  if cube == "mul" else [helper.make_node("Pow", ["x", "three"], ["x3"])])
    nodes = [*cube_nodes,
             helper.make_node("Mul", ["c1", "x3"], ["cx3"]),
             helper.make_node("Add", ["x", "cx3"], ["inner"]),
             helper.make_node("Mul", ["c2", "inner"], ["scaled"]),
             helper.make_node("Tanh", ["scaled"], ["t"]),
             helper.make_node("Add", ["one", "t"], ["p"]),
             helper.make_node("Mul", ["x", "p"], ["xp"]),
             helper.make_node("Mul", ["half", "xp"], ["y"])]
    inits = [graphs.const("three", 3.0), graphs.const("c1", 0.044715), graphs.const("c2", math.sqrt(2 / math.pi)),
             graphs.const("one", 1.0), graphs.const("half", 0.5)]
    return graphs.make_model(nodes, [graphs.tensor_info("x", SHAPE)], [graphs.tensor_info("y", SHAPE)], inits)


def quick_gelu_model() -> onnx.ModelProto:
    """CLIP's quick_gelu: x * sigmoid(1.702 * x), and a plain SiLU beside it that must stay."""
    nodes = [helper.make_node("Mul", ["x", "alpha"], ["ax"]), helper.make_node("Sigmoid", ["ax"], ["s"]),
             helper.make_node("Mul", ["x", "s"], ["y"]),
             helper.make_node("Sigmoid", ["x"], ["s2"]), helper.make_node("Mul", ["x", "s2"], ["z"])]
    return graphs.make_model(nodes, [graphs.tensor_info("x", SHAPE)],
                             [graphs.tensor_info("y", SHAPE), graphs.tensor_info("z", SHAPE)],
                             [graphs.const("alpha", 1.702)])


def the_node(model: onnx.ModelProto, op: str) -> onnx.NodeProto:
    (node,) = [n for n in model.graph.node if n.op_type == op]
    return node


@pytest.mark.parametrize(("form", "scale"), [("a", "div"), ("b", "div"), ("c", "mul")])
def test_erf_forms_to_contrib_gelu_on_ort(form: str, scale: str) -> None:
    model = erf_gelu_model(form, scale)
    for device in ("cpu", "cuda"):
        out, counts = fuse(model, fuse_gelu, "ort", device)
        assert counts == {"Gelu": 1, "FastGelu": 0, "QuickGelu": 0, "rejected": 0, "skipped_for_target": 0}
        assert graphs.op_counts(out) == {"Gelu": 1} and the_node(out, "Gelu").domain == "com.microsoft"
        graphs.assert_same_outputs(model, out)


def test_erf_gelu_to_standard_gelu_at_opset_20_on_ort_cpu() -> None:
    model = erf_gelu_model(opset=20)
    out, counts = fuse(model, fuse_gelu, "ort", "cpu")
    assert counts["Gelu"] == 1 and the_node(out, "Gelu").domain == ""
    onnx.checker.check_model(out, full_check=True)
    graphs.assert_same_outputs(model, out)


def test_tensorrt_raises_opset_to_20_and_emits_standard_gelu() -> None:
    model = erf_gelu_model("b")
    out, counts = fuse(model, fuse_gelu, "tensorrt", "cuda")
    assert counts["Gelu"] == 1 and domains(out)[""] == 20 and the_node(out, "Gelu").domain == ""
    onnx.checker.check_model(out, full_check=True)
    graphs.assert_same_outputs(model, out)
    out, counts = fuse(model, fuse_gelu, "tensorrt", "cuda", fuse_gelu_raise_opset=False)
    assert counts["Gelu"] == 0 and counts["rejected"] == 1 and domains(out)[""] == 17


@pytest.mark.parametrize("cube", ["mul", "pow"])
def test_tanh_gelu(cube: str) -> None:
    model = tanh_gelu_model(cube)
    out, counts = fuse(model, fuse_gelu, "ort", "cpu")
    assert counts["FastGelu"] == 1 and graphs.op_counts(out) == {"FastGelu": 1}
    graphs.assert_same_outputs(model, out)
    out, counts = fuse(model, fuse_gelu, "tensorrt", "cuda")
    node = the_node(out, "Gelu")
    assert counts["Gelu"] == 1 and helper.get_attribute_value(node.attribute[0]) == b"tanh"
    graphs.assert_same_outputs(model, out)


def test_quick_gelu_on_ort_and_left_for_tensorrt() -> None:
    model = quick_gelu_model()
    out, counts = fuse(model, fuse_gelu, "ort", "cpu")
    assert counts == {"Gelu": 0, "FastGelu": 0, "QuickGelu": 1, "rejected": 0, "skipped_for_target": 0}
    node = the_node(out, "QuickGelu")
    assert node.domain == "com.microsoft" and helper.get_attribute_value(node.attribute[0]) == pytest.approx(1.702)
    assert graphs.op_counts(out) == {"QuickGelu": 1, "Sigmoid": 1, "Mul": 1}  # the plain SiLU is no candidate
    graphs.assert_same_outputs(model, out)
    out, counts = fuse(model, fuse_gelu, "tensorrt", "cuda")
    assert counts["skipped_for_target"] == 1 and graphs.op_counts(out) == graphs.op_counts(model)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"erf_is_output": True}, "'e' is a graph output"),
    ({"half": 0.6}, "the Mul after 1 + f(x)"),
], ids=["inner-output", "wrong-constant"])
def test_rejects_with_reason(kwargs: dict, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    model = erf_gelu_model("c", **kwargs)
    out, counts = fuse(model, fuse_gelu, "ort", "cpu")
    assert counts["Gelu"] == 0 and counts["rejected"] == 1
    assert graphs.op_counts(out) == graphs.op_counts(model)
    assert any(reason in message for message in reasons(caplog, "fuse_gelu")), reasons(caplog, "fuse_gelu")
    graphs.assert_same_outputs(model, out)


def test_torch_exports(tmp_path: Path) -> None:
    """What torch's TorchScript exporter writes at opset 17 for F.gelu (erf and tanh) and quick_gelu."""
    import torch

    class Acts(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            erf = torch.nn.functional.gelu(x)
            tanh = torch.nn.functional.gelu(x + 1, approximate="tanh")
            quick = (x - 1) * torch.sigmoid(1.702 * (x - 1))
            return erf + tanh + quick

    path = tmp_path / "acts.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Acts().eval(), (torch.randn(2, 6),), str(path), opset_version=17, dynamo=False,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}})
    model = onnx.load(str(path))
    out, counts = fuse(model, fuse_gelu, "ort", "cpu")
    assert counts == {"Gelu": 1, "FastGelu": 1, "QuickGelu": 1, "rejected": 0, "skipped_for_target": 0}
    assert not {"Erf", "Tanh", "Sigmoid"} & set(graphs.op_counts(out))
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)}
    graphs.assert_same_outputs(model, out, feeds)

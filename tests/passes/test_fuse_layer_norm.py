"""fuse_layer_norm: the decomposed LayerNorm (older exporters, opset < 17 style) -> LayerNormalization."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.passes.fuse_layer_norm import fuse_layer_norm
from tests import graphs
from tests.passes.fusion_helpers import fuse, reasons

D = 8


def decomposed_layer_norm(
    *,
    opset: int = 17,
    square: str = "pow",
    affine: bool = True,
    eps: np.ndarray | float = 1e-5,
    axis: int = -1,
    mean_is_output: bool = False,
    gamma_size: int = D,
    normalize: str = "div_sqrt",
) -> onnx.ModelProto:
    """y = (x - mean) / sqrt(mean((x - mean)^2) + eps) * gamma + beta over x:[2, 3, D] (N symbolic)."""
    rng = np.random.default_rng(3)

    def reduce_mean(src: str, dst: str) -> onnx.NodeProto:
        if opset >= 18:
            return helper.make_node("ReduceMean", [src, "axes"], [dst])
        return helper.make_node("ReduceMean", [src], [dst], axes=[axis])

    nodes = [
        reduce_mean("x", "mean"),
        helper.make_node("Sub", ["x", "mean"], ["d"]),
        (helper.make_node("Pow", ["d", "two"], ["sq"]) if square == "pow"
         else helper.make_node("Mul", ["d", "d"], ["sq"])),
        reduce_mean("sq", "var"),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
    ]
    normed = "norm" if affine else "y"
    nodes += {  # the forms exporters write for d / sqrt(var + eps)
        "div_sqrt": [helper.make_node("Sqrt", ["ve"], ["std"]), helper.make_node("Div", ["d", "std"], [normed])],
        "div_pow": [helper.make_node("Pow", ["ve", "half"], ["std"]), helper.make_node("Div", ["d", "std"], [normed])],
        "mul_reciprocal": [helper.make_node("Sqrt", ["ve"], ["std"]), helper.make_node("Reciprocal", ["std"], ["inv"]),
                           helper.make_node("Mul", ["inv", "d"], [normed])],
        "mul_rsqrt": [helper.make_node("Pow", ["ve", "minus_half"], ["inv"]),
                      helper.make_node("Mul", ["d", "inv"], [normed])],
        "mul_pow_2": [helper.make_node("Pow", ["ve", "two"], ["inv"]), helper.make_node("Mul", ["d", "inv"], [normed])],
    }[normalize]
    inits = [graphs.const("two", 2.0), graphs.const("eps", eps), graphs.const("half", 0.5),
             graphs.const("minus_half", -0.5)]
    if opset >= 18:
        inits.append(graphs.const("axes", [axis], np.int64))
    if affine:
        nodes += [helper.make_node("Mul", ["gamma", "norm"], ["scaled"]),  # gamma first: order must not matter
                  helper.make_node("Add", ["scaled", "beta"], ["y"])]
        inits += [graphs.const("gamma", rng.standard_normal(gamma_size)), graphs.const("beta", rng.standard_normal(D))]
    outputs = [graphs.tensor_info("y", ["N", 3, D])]
    if mean_is_output:
        outputs.append(graphs.tensor_info("mean", ["N", 3, 1]))
    return graphs.make_model(nodes, [graphs.tensor_info("x", ["N", 3, D])], outputs, inits, opset=opset)


@pytest.mark.parametrize(("opset", "square", "affine"),
                         [(17, "pow", True), (17, "mul", True), (18, "pow", True), (17, "pow", False)],
                         ids=["opset17", "mul-square", "opset18-axes-input", "no-affine"])
def test_fuses_and_matches_outputs(opset: int, square: str, affine: bool) -> None:
    model = decomposed_layer_norm(opset=opset, square=square, affine=affine)
    out, counts = fuse(model, fuse_layer_norm)
    assert counts == {"LayerNormalization": 1, "rejected": 0}
    assert graphs.op_counts(out) == {"LayerNormalization": 1}
    (node,) = out.graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["axis"] == -1 and attrs["epsilon"] == pytest.approx(1e-5)
    assert len(node.input) == (3 if affine else 2)
    onnx.checker.check_model(out, full_check=True)
    graphs.assert_same_outputs(model, out)


def test_same_fusion_for_every_target() -> None:
    model = decomposed_layer_norm()
    for backend, device in (("ort", "cuda"), ("tensorrt", "cuda")):
        out, counts = fuse(model, fuse_layer_norm, backend, device)
        assert counts["LayerNormalization"] == 1 and graphs.op_counts(out) == {"LayerNormalization": 1}


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"mean_is_output": True}, "'mean' is a graph output"),
        ({"eps": np.full(D, 1e-5)}, "epsilon 'eps' is not a one-element constant"),
        ({"axis": 1}, "not over the last axis"),
        ({"gamma_size": 1}, "gamma 'gamma' has shape (1,), expected (8,)"),
    ],
    ids=["mean-is-output", "eps-shape", "axis-1", "gamma-shape"],
)
def test_rejects_with_reason(kwargs: dict, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    model = decomposed_layer_norm(**kwargs)
    out, counts = fuse(model, fuse_layer_norm)
    assert counts == {"LayerNormalization": 0, "rejected": 1}
    assert "LayerNormalization" not in graphs.op_counts(out)
    assert any(reason in message for message in reasons(caplog, "fuse_layer_norm"))
    graphs.assert_same_outputs(model, out)


def test_second_consumer_of_the_deviation_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    base = decomposed_layer_norm()
    nodes = [*base.graph.node, helper.make_node("Relu", ["d"], ["r"])]
    model = graphs.make_model(nodes, base.graph.input, [*base.graph.output, graphs.tensor_info("r", ["N", 3, D])],
                              base.graph.initializer)
    out, counts = fuse(model, fuse_layer_norm)
    assert counts["rejected"] == 1 and counts["LayerNormalization"] == 0
    assert any("'d' is also read by Relu" in m for m in reasons(caplog, "fuse_layer_norm"))
    graphs.assert_same_outputs(model, out)


def _export(module: object, path: Path, opset: int) -> onnx.ModelProto:
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 3, D),), str(path), opset_version=opset, dynamo=False,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N"}})
    return onnx.load(str(path))


def test_torch_forms(tmp_path: Path) -> None:
    """torch 2.x at opset 17 already writes LayerNormalization (counted 0, no rejection); a hand-written
    LayerNorm exports decomposed and is fused."""
    import torch

    class Manual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(D))
            self.bias = torch.nn.Parameter(torch.randn(D))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mean = x.mean(-1, keepdim=True)
            var = ((x - mean) ** 2).mean(-1, keepdim=True)
            return (x - mean) / torch.sqrt(var + 1e-6) * self.weight + self.bias

    native = _export(torch.nn.LayerNorm(D).eval(), tmp_path / "native.onnx", 17)
    assert graphs.op_counts(native) == {"LayerNormalization": 1}
    out, counts = fuse(native, fuse_layer_norm)
    assert counts == {"LayerNormalization": 0, "rejected": 0}

    manual = _export(Manual().eval(), tmp_path / "manual.onnx", 17)
    out, counts = fuse(manual, fuse_layer_norm)
    assert counts == {"LayerNormalization": 1, "rejected": 0}
    assert graphs.op_counts(out) == {"LayerNormalization": 1}
    graphs.assert_same_outputs(manual, out)


@pytest.mark.parametrize("normalize", ["div_pow", "mul_reciprocal", "mul_rsqrt"])
def test_normalization_variants_fuse(normalize: str) -> None:
    model = decomposed_layer_norm(normalize=normalize)
    out, counts = fuse(model, fuse_layer_norm)
    assert counts == {"LayerNormalization": 1, "rejected": 0}
    assert graphs.op_counts(out) == {"LayerNormalization": 1}
    graphs.assert_same_outputs(model, out, graphs.random_feeds(model, dims={"N": 2}))


def test_a_power_other_than_half_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    model = decomposed_layer_norm(normalize="mul_pow_2")
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.fuse_layer_norm"):
        out, counts = fuse(model, fuse_layer_norm)
    assert counts == {"LayerNormalization": 0, "rejected": 1}
    assert any("raised to 2.0, not 0.5 / -0.5" in r for r in reasons(caplog, "fuse_layer_norm"))
    graphs.assert_same_outputs(model, out, graphs.random_feeds(model, dims={"N": 2}))

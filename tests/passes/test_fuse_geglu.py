"""fuse_geglu: the UNet feed-forward's GEGLU -> com.microsoft.BiasSplitGelu (ort-cuda only)."""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.passes.fuse_geglu import fuse_geglu
from diffusion_trt.passes.fuse_gelu import fuse_gelu
from tests import graphs
from tests.passes.fusion_helpers import domains, fuse, reasons

K = 4  # input width: keeps the 2560-wide projection at 40 KB


def geglu_model(width: int = 2560, split: str = "slice", bounds_from: str = "",
                hidden_is_output: bool = False) -> onnx.ModelProto:
    """out = h * gelu(g), (h, g) = (x @ W + b).chunk(2, -1), x:[N, 3, K] (N symbolic), erf-GELU decomposed."""
    rng = np.random.default_rng(5)
    half = width // 2
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]), helper.make_node("Add", ["mm", "bias"], ["proj"])]
    inits = [graphs.const("W", rng.standard_normal((K, width)) / 2), graphs.const("bias", rng.standard_normal(width)),
             graphs.const("sqrt2", math.sqrt(2)), graphs.const("one", 1.0), graphs.const("half", 0.5),
             graphs.const("axes", [-1], np.int64)]
    if split == "slice":
        inits += [graphs.const("zero", [0], np.int64), graphs.const("mid", [half], np.int64),
                  graphs.const("end", [2**62], np.int64)]
        if bounds_from:  # what the exporter writes: bounds computed from Shape(proj) ("last": the static width)
            shape_node = (helper.make_node("Shape", ["proj"], ["shp"], start=-1) if bounds_from == "last"
                          else helper.make_node("Shape", ["proj"], ["shp"], start=0, end=1))
            nodes += [shape_node,
                      helper.make_node("Div", ["shp", "two"], ["mid"])]
            inits = [i for i in inits if i.name != "mid"] + [graphs.const("two", [2], np.int64)]
        nodes += [helper.make_node("Slice", ["proj", "zero", "mid", "axes"], ["h"]),
                  helper.make_node("Slice", ["proj", "mid", "end", "axes"], ["g"])]
    else:
        inits.append(graphs.const("sizes", [half, half], np.int64))
        nodes.append(helper.make_node("Split", ["proj", "sizes"], ["h", "g"], axis=-1))
    nodes += [helper.make_node("Div", ["g", "sqrt2"], ["s"]), helper.make_node("Erf", ["s"], ["e"]),
              helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["g", "p"], ["gp"]),
              helper.make_node("Mul", ["gp", "half"], ["gelu"]), helper.make_node("Mul", ["h", "gelu"], ["y"])]
    outputs = [graphs.tensor_info("y", ["N", 3, half])]
    if hidden_is_output:
        outputs.append(graphs.tensor_info("h", ["N", 3, half]))
    model = graphs.make_model(nodes, [graphs.tensor_info("x", ["N", 3, K])], outputs, inits)
    return onnx.shape_inference.infer_shapes(model)


@pytest.mark.parametrize(("split", "bounds_from"), [("slice", ""), ("slice", "last"), ("split", "")],
                         ids=["slice", "slice-bounds-from-shape", "split"])
def test_ort_cuda_emits_bias_split_gelu(split: str, bounds_from: str) -> None:
    model = geglu_model(split=split, bounds_from=bounds_from)
    out, counts = fuse(model, fuse_geglu, "ort", "cuda")
    assert counts == {"BiasSplitGelu": 1, "rejected": 0, "skipped_for_target": 0}
    assert graphs.op_counts(out) == {"MatMul": 1, "BiasSplitGelu": 1}  # the bound arithmetic is dead too
    node = out.graph.node[-1]
    assert node.domain == "com.microsoft" and list(node.input) == ["mm", "bias"] and list(node.output) == ["y"]
    assert domains(out)["com.microsoft"] == 1
    onnx.checker.check_model(out)


def test_after_fuse_gelu_too() -> None:
    """fuse_gelu first (com.microsoft Gelu on the gate): fuse_geglu still takes the whole GEGLU."""
    model, _ = fuse(geglu_model(), fuse_gelu, "ort", "cuda")
    assert graphs.op_counts(model)["Gelu"] == 1
    out, counts = fuse(model, fuse_geglu, "ort", "cuda")
    assert counts["BiasSplitGelu"] == 1 and graphs.op_counts(out) == {"MatMul": 1, "BiasSplitGelu": 1}


@pytest.mark.gpu
def test_ort_cuda_parity() -> None:
    import onnxruntime as ort

    model = geglu_model()
    out, _ = fuse(model, fuse_geglu, "ort", "cuda")
    feeds = graphs.random_feeds(model)
    want = graphs.run(model, feeds)[0]
    # TF32 off: the reference is an fp32 CPU run; TF32 MatMuls differ by ~1e-2 at these widths
    session = ort.InferenceSession(out.SerializeToString(), providers=[("CUDAExecutionProvider", {"use_tf32": 0})])
    np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("backend", "device"), [("ort", "cpu"), ("tensorrt", "cuda")])
def test_other_targets_leave_it_for_fuse_gelu(backend: str, device: str) -> None:
    model = geglu_model(width=16)
    out, counts = fuse(model, fuse_geglu, backend, device)
    assert counts == {"BiasSplitGelu": 0, "rejected": 0, "skipped_for_target": 1}
    assert graphs.op_counts(out) == graphs.op_counts(model)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"width": 16}, "takes widths [2560, 5120, 10240]; this projection is 16 wide"),
    ({"bounds_from": "batch"}, "the Slice bounds are neither constants nor computable from static dims"),
    ({"hidden_is_output": True}, "'h' is a graph output"),
], ids=["kernel-width", "unknown-bounds", "hidden-is-output"])
def test_rejects_with_reason(kwargs: dict, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    model = geglu_model(**kwargs)
    out, counts = fuse(model, fuse_geglu, "ort", "cuda")
    assert counts["BiasSplitGelu"] == 0 and counts["rejected"] == 1
    assert graphs.op_counts(out) == graphs.op_counts(model)
    assert any(reason in message for message in reasons(caplog, "fuse_geglu")), reasons(caplog, "fuse_geglu")
    graphs.assert_same_outputs(model, out)

"""Bad input through the real pipelines (issue 3, "Bad input"): each a clear message or a counted rejection.

Covered elsewhere, per pass: a second consumer of a fusion's inner tensor (test_fuse_group_norm "second-consumer",
test_fuse_layer_norm, test_fuse_attention, test_cancel_transposes "second-consumer"); opsets below 17 / above the
installed onnx with an empty pass list (test_pass_framework). Here the same through ``pipeline_for`` pipelines.
"""

from __future__ import annotations

import logging

import onnx
import pytest
from onnx import helper

from diffusion_trt.errors import PassError
from diffusion_trt.passes import PassContext, optimize_model, pipeline_for
from diffusion_trt.passes.base import pass_name
from tests import graphs
from tests.passes.test_fuse_group_norm import group_norm_model

KEYS = [("ort", "cuda", "fp16"), ("tensorrt", "cuda", "fp16"), ("ort", "cpu", "fp32")]


def _ctx(backend: str, device: str, precision: str) -> PassContext:
    return PassContext(component="unet", backend=backend, device=device, precision=precision)


@pytest.mark.parametrize("key", KEYS, ids="/".join)
@pytest.mark.parametrize("opset", [11, None], ids=["opset11", "no-default-domain"])
def test_unsupported_opset_names_it_and_the_fix(key: tuple[str, str, str], opset: int | None) -> None:
    model = graphs.make_model([helper.make_node("Relu", ["x"], ["y"])], [graphs.tensor_info("x", [2])],
                              [graphs.tensor_info("y", [2])], opset=opset or 17, check=False)
    if opset is None:
        model.opset_import[0].domain = "com.example"
    with pytest.raises(PassError) as info:
        optimize_model(model, pipeline_for(*key, "unet"), _ctx(*key))
    message = str(info.value)
    assert "unet" in message and "opset_version=17" in message  # the fix
    assert (f"opset {opset};" in message) if opset else ("no default-domain" in message)


def _unknown_shape_group_norm() -> onnx.ModelProto:
    """The GroupNorm pattern fed by a custom-domain op: shape inference cannot type its output."""
    model = group_norm_model()
    graph = model.graph
    for node in graph.node:
        node.input[:] = ["x_unknown" if name == "x" else name for name in node.input]
    graph.node.insert(0, helper.make_node("Mystery", ["x"], ["x_unknown"], domain="com.example"))
    del graph.value_info[:]
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    return model


@pytest.mark.parametrize("key", KEYS[:2], ids="/".join)
def test_uninferable_shapes_are_a_counted_rejection_not_a_wrong_graph(key: tuple[str, str, str],
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    model = _unknown_shape_group_norm()
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    # the TensorRT pipelines end in check_onnx_domain, which refuses the custom op that hides the shapes here: this
    # test is about fuse_group_norm's rejection, so it runs the passes before that check
    passes = [p for p in pipeline_for(*key, "unet") if pass_name(p) != "check_onnx_domain"]
    out, records = optimize_model(model, passes, _ctx(*key))
    counts = {r.name: r.counts for r in records}
    assert counts["fuse_group_norm"]["rejected"] == 1
    assert not counts["fuse_group_norm"].get("GroupNorm") and not counts["fuse_group_norm"].get("GroupNormalization")
    assert "run infer_shapes first" in caplog.text
    ops = graphs.op_counts(out)
    assert ops["InstanceNormalization"] == 1 and ops["Mystery"] == 1  # the pattern is left whole
    onnx.checker.check_model(out)


def test_transpose_without_perm_and_unknown_rank_is_rejected(caplog: pytest.LogCaptureFixture) -> None:
    model = graphs.make_model(
        [helper.make_node("Mystery", ["x"], ["u"], domain="com.example"), helper.make_node("Transpose", ["u"], ["a"]),
         helper.make_node("Transpose", ["a"], ["y"])],
        [graphs.tensor_info("x", [2, 3])], [graphs.tensor_info("y", None)], extra_opsets=[("com.example", 1)],
        check=False)
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    from diffusion_trt.passes.cancel_transposes import cancel_transposes

    out, records = optimize_model(model, [cancel_transposes], _ctx("ort", "cuda", "fp32"))
    assert records[0].counts["rejected"] == 1 and records[0].counts["Transpose_removed"] == 0
    assert "input rank is unknown; run infer_shapes" in caplog.text
    assert graphs.op_counts(out) == {"Mystery": 1, "Transpose": 2}

"""eliminate_noops, fuse_skip_layer_norm, fuse_bias: the transformer block's residual path
``h = (x @ W + b) / 1 + h; LayerNorm(h)`` as diffusers writes it, on small graphs."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes.eliminate_noops import eliminate_noops
from diffusion_trt.passes.fuse_bias import fuse_bias
from diffusion_trt.passes.fuse_skip_layer_norm import fuse_skip_layer_norm
from tests import graphs
from tests.passes.fusion_helpers import assert_cuda_parity, domains, fuse, reasons

S = 6  # tokens


def residual_block(*, width: int = 8, norm: bool = True, div_one: bool = True, sum_read_again: bool = True,
                   bias_first: bool = False, skip_shape: list[int] | None = None, batch: int | str = 2,
                   bias_read_again: bool = False, sum_is_output: bool = False) -> onnx.ModelProto:
    """``p = x @ W + b [/ 1]; s = p + h; y = LayerNorm(s)`` [``z = s * 2`` reads the sum again], x, h: [B, S, D]."""
    rng = np.random.default_rng(11)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["b", "mm"] if bias_first else ["mm", "b"], ["p0"])]
    inits = [graphs.const("W", rng.standard_normal((width, width)) / 3), graphs.const("b", rng.standard_normal(width)),
             graphs.const("two", 2.0)]
    if div_one:
        nodes.append(helper.make_node("Div", ["p0", "one"], ["p"]))
        inits.append(graphs.const("one", 1.0))
    else:
        nodes.append(helper.make_node("Identity", ["p0"], ["p"]))
    nodes.append(helper.make_node("Add", ["p", "h"], ["s"]))
    outputs = []
    if norm:
        nodes.append(helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5))
        inits += [graphs.const("gamma", rng.standard_normal(width)), graphs.const("beta", rng.standard_normal(width))]
        outputs.append(graphs.tensor_info("y", [batch, S, width]))
    if sum_read_again or not norm:
        nodes.append(helper.make_node("Mul", ["s", "two"], ["z"]))
        outputs.append(graphs.tensor_info("z", [batch, S, width]))
    if bias_read_again:
        nodes.append(helper.make_node("Mul", ["p0", "two"], ["q"]))
        outputs.append(graphs.tensor_info("q", [batch, S, width]))
    if sum_is_output:
        outputs.append(graphs.tensor_info("s", [batch, S, width]))
    inputs = [graphs.tensor_info("x", [batch, S, width]), graphs.tensor_info("h", skip_shape or [batch, S, width])]
    return onnx.shape_inference.infer_shapes(graphs.make_model(nodes, inputs, outputs, inits))


def run_passes(model: onnx.ModelProto, passes: list, backend: str = "ort",
               device: str = "cuda") -> tuple[onnx.ModelProto, list]:
    ctx = PassContext(component="unet", backend=backend, device=device, precision="fp32")
    return optimize_model(model, list(passes), ctx)


# --- eliminate_noops -----------------------------------------------------------------------------------------


def test_noops_removed_and_outputs_unchanged() -> None:
    model = residual_block()
    out, counts = fuse(model, eliminate_noops)
    assert counts == {"removed": 1, "rejected": 0}
    assert "Div" not in graphs.op_counts(out)
    graphs.assert_same_outputs(model, out)


@pytest.mark.parametrize(("op", "value", "const_first", "removed"), [
    ("Mul", 1.0, True, 1), ("Add", 0.0, True, 1), ("Sub", 0.0, False, 1),
    ("Sub", 0.0, True, 0),  # 0 - x is not x
    ("Div", 1.0, True, 0),  # 1 / x is not x
    ("Mul", 2.0, False, 0), ("Add", 1e-12, False, 0),
])
def test_noop_forms(op: str, value: float, const_first: bool, removed: int) -> None:
    inputs = ["c", "x"] if const_first else ["x", "c"]
    model = graphs.make_model([helper.make_node(op, inputs, ["t"]), helper.make_node("Relu", ["t"], ["y"])],
                              [graphs.tensor_info("x", [2, 3])], [graphs.tensor_info("y", [2, 3])],
                              [graphs.const("c", value)])
    model = onnx.shape_inference.infer_shapes(model)
    out, counts = fuse(model, eliminate_noops)
    assert counts["removed"] == removed
    graphs.assert_same_outputs(model, out)


def test_noop_that_broadcasts_or_is_an_output_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    # x:[3] * ones[1, 1] gives [1, 3]: removing it would change the shape
    model = graphs.make_model([helper.make_node("Mul", ["x", "c"], ["t"]), helper.make_node("Relu", ["t"], ["y"]),
                               helper.make_node("Div", ["x", "one"], ["w"])],
                              [graphs.tensor_info("x", [3])],
                              [graphs.tensor_info("y", [1, 3]), graphs.tensor_info("w", [3])],
                              [graphs.const("c", [[1.0]]), graphs.const("one", 1.0)])
    out, counts = fuse(onnx.shape_inference.infer_shapes(model), eliminate_noops)
    assert counts == {"removed": 0, "rejected": 2}
    messages = reasons(caplog, "eliminate_noops")
    assert any("rank 2 > rank 1" in m for m in messages) and any("'w' is a graph output" in m for m in messages)
    graphs.assert_same_outputs(model, out)


# --- fuse_skip_layer_norm -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bias_first", [False, True])
def test_skip_layer_norm_with_bias(bias_first: bool) -> None:
    model = residual_block(bias_first=bias_first)
    out, records = run_passes(model, [eliminate_noops, fuse_skip_layer_norm])
    assert records[1].counts == {"SkipLayerNormalization": 1, "with_bias": 1, "rejected": 0, "skipped_for_target": 0}
    assert graphs.op_counts(out) == {"MatMul": 1, "SkipLayerNormalization": 1, "Mul": 1}
    node = next(n for n in out.graph.node if n.op_type == "SkipLayerNormalization")
    assert node.domain == "com.microsoft" and node.input[0] == "mm" and node.input[1] == "h" and len(node.input) == 5
    assert node.output[0] == "y" and node.output[3]  # the sum feeds the Mul
    assert domains(out)["com.microsoft"] == 1
    onnx.checker.check_model(out)
    graphs.assert_same_outputs(model, out)  # ORT's CPU provider has SkipLayerNormalization too


def test_skip_layer_norm_without_other_readers_or_bias() -> None:
    model = residual_block(sum_read_again=False, bias_read_again=True)  # the bias sum is read: no bias folding
    out, records = run_passes(model, [eliminate_noops, fuse_skip_layer_norm])
    assert records[1].counts["SkipLayerNormalization"] == 1 and records[1].counts["with_bias"] == 0
    node = next(n for n in out.graph.node if n.op_type == "SkipLayerNormalization")
    assert list(node.output) == ["y"] and len(node.input) == 4
    graphs.assert_same_outputs(model, out)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"skip_shape": [1, S, 8]}, "the residual Add may broadcast"),
    ({"skip_shape": ["M", S, 8]}, "the residual Add may broadcast"),
    ({"sum_is_output": True}, "'s' is a graph output"),
], ids=["broadcast", "other-symbol", "sum-is-output"])
def test_skip_layer_norm_rejects(kwargs: dict, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    model = residual_block(**kwargs)
    out, records = run_passes(model, [eliminate_noops, fuse_skip_layer_norm])
    assert records[1].counts["SkipLayerNormalization"] == 0 and records[1].counts["rejected"] == 1
    assert any(reason in m for m in reasons(caplog, "fuse_skip_layer_norm")), reasons(caplog, "fuse_skip_layer_norm")
    graphs.assert_same_outputs(model, out, graphs.random_feeds(model))


@pytest.mark.parametrize(("backend", "device"), [("ort", "cpu"), ("tensorrt", "cuda")])
def test_skip_layer_norm_other_targets(backend: str, device: str) -> None:
    model = residual_block()
    out, records = run_passes(model, [eliminate_noops, fuse_skip_layer_norm], backend, device)
    assert records[1].counts == {"SkipLayerNormalization": 0, "with_bias": 0, "rejected": 0, "skipped_for_target": 1}
    assert "LayerNormalization" in graphs.op_counts(out)


# --- fuse_bias -----------------------------------------------------------------------------------------------


def test_bias_add_emitted_for_unet_widths() -> None:
    model = residual_block(width=320, norm=False)
    out, records = run_passes(model, [eliminate_noops, fuse_skip_layer_norm, fuse_bias])
    assert records[2].counts == {"BiasAdd": 1, "rejected": 0, "skipped_for_target": 0}
    assert graphs.op_counts(out) == {"MatMul": 1, "BiasAdd": 1, "Mul": 1}
    node = next(n for n in out.graph.node if n.op_type == "BiasAdd")
    assert node.domain == "com.microsoft" and list(node.input) == ["mm", "b", "h"]
    onnx.checker.check_model(out)


def test_bias_add_leaves_layer_norm_sites_to_skip_layer_norm() -> None:
    model = residual_block(width=320)
    out, records = run_passes(model, [eliminate_noops, fuse_skip_layer_norm, fuse_bias])
    assert records[1].counts["SkipLayerNormalization"] == 1 and records[2].counts["BiasAdd"] == 0
    graphs.assert_same_outputs(model, out)


def test_bias_add_rejects_widths_the_kernel_refuses(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    model = residual_block(width=8, norm=False)
    out, records = run_passes(model, [eliminate_noops, fuse_bias])
    assert records[1].counts == {"BiasAdd": 0, "rejected": 1, "skipped_for_target": 0}
    assert any("takes [320, 640, 1280] channels; this projection has 8" in m for m in reasons(caplog, "fuse_bias"))
    graphs.assert_same_outputs(model, out)


@pytest.mark.parametrize(("backend", "device"), [("ort", "cpu"), ("tensorrt", "cuda")])
def test_bias_add_other_targets(backend: str, device: str) -> None:
    model = residual_block(width=320, norm=False)
    out, records = run_passes(model, [eliminate_noops, fuse_bias], backend, device)
    assert records[1].counts == {"BiasAdd": 0, "rejected": 0, "skipped_for_target": 1}
    graphs.assert_same_outputs(model, out)


@pytest.mark.gpu
def test_bias_add_and_skip_layer_norm_cuda_parity() -> None:
    for model in (residual_block(width=320, norm=False), residual_block(width=640)):
        out, _ = run_passes(model, [eliminate_noops, fuse_skip_layer_norm, fuse_bias])
        assert {"BiasAdd", "SkipLayerNormalization"} & set(graphs.op_counts(out))
        assert_cuda_parity(model, out)


def test_skip_layer_norm_on_a_dynamic_batch() -> None:
    """Symbolic dims that carry the same name are the same dim: dynamic profiles fuse too."""
    model = residual_block(batch="N")
    out, records = run_passes(model, [eliminate_noops, fuse_skip_layer_norm])
    assert records[1].counts["SkipLayerNormalization"] == 1
    graphs.assert_same_outputs(model, out, graphs.random_feeds(model, dims={"N": 3}))


# --- fuse_bias, channels-last form (a 1x1 proj_out rewritten as a MatMul over a weight input) ------------------


def proj_out_block(*, width: int = 320, batch: int | str = 1, height: int | str = 2, shapes_read: bool = False,
                   residual_nhwc: bool = True, bias_sum_is_output: bool = False) -> onnx.ModelProto:
    """What pointwise_convs_as_matmul leaves at a refittable UNet's proj_out: ``t[N,H,W,C] @ w + b`` back to NCHW,
    plus the residual (a channels-last ``r`` transposed to NCHW, as fuse_group_norm's NHWC SkipGroupNorm gives it;
    ``residual_nhwc=False``: an NCHW input) [and ``shape(residual)`` read, as the exporter's ``batch, _, height,
    width = hidden_states.shape``]. w is a graph input (the LoRA slot), [C, C]."""
    rng = np.random.default_rng(5)
    nchw, nhwc = [batch, width, height, 3], [batch, height, 3, width]
    nodes = [helper.make_node("MatMul", ["t", "w"], ["mm"]), helper.make_node("Add", ["mm", "b"], ["p"]),
             helper.make_node("Transpose", ["p"], ["p_t"], perm=[0, 3, 1, 2]),
             helper.make_node("Add", ["p_t", "res"], ["y"])]
    inputs = [graphs.tensor_info("t", nhwc), graphs.tensor_info("w", [width, width])]
    if residual_nhwc:
        nodes.insert(0, helper.make_node("Transpose", ["r"], ["res"], perm=[0, 3, 1, 2]))
        inputs.append(graphs.tensor_info("r", nhwc))
    else:
        inputs.append(graphs.tensor_info("res", nchw))
    outputs = [graphs.tensor_info("y", nchw), *([graphs.tensor_info("p", nhwc)] if bias_sum_is_output else [])]
    if shapes_read:
        nodes.append(helper.make_node("Shape", ["res"], ["res_shape"]))
        outputs.append(graphs.tensor_info("res_shape", [4], onnx.TensorProto.INT64))
    model = graphs.make_model(nodes, inputs, outputs, [graphs.const("b", rng.standard_normal(width))])
    return onnx.shape_inference.infer_shapes(model)


def lowered_bias_add(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each com.microsoft.BiasAdd(x, bias, skip) written as Add(Add(x, bias), skip): what the CUDA
    kernel computes, in ops ONNX Runtime's CPU provider runs (parity of the rewrite's arithmetic, on the CPU)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for node in out.graph.node:
        if node.op_type != "BiasAdd":
            nodes.append(node)
            continue
        x, bias, skip = node.input
        nodes += [helper.make_node("Add", [x, bias], [f"{node.output[0]}_biased"]),
                  helper.make_node("Add", [f"{node.output[0]}_biased", skip], list(node.output))]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def test_channels_last_proj_out_bias_and_residual_become_one_bias_add() -> None:
    """The bias Add and the residual Add go (one BiasAdd over [N, H*W, C] views: Reshapes, no copy); the weight input
    still feeds the MatMul, so a LoRA bound there counts; the arithmetic is the same (BiasAdd lowered on the CPU)."""
    model = proj_out_block()
    out, records = run_passes(model, [fuse_bias])
    assert records[0].counts == {"BiasAdd": 1, "rejected": 0, "skipped_for_target": 0}
    assert graphs.op_counts(out) == {"Reshape": 3, "MatMul": 1, "BiasAdd": 1, "Transpose": 1}
    (matmul,) = [n for n in out.graph.node if n.op_type == "MatMul"]
    assert matmul.input[1] == "w" and "w" in {i.name for i in out.graph.input}
    assert [o.name for o in out.graph.output] == ["y"]
    onnx.checker.check_model(out, full_check=True)
    graphs.assert_same_outputs(model, lowered_bias_add(out))
    feeds = graphs.random_feeds(model, seed=3)
    lora = {**feeds, "w": feeds["w"] * 2}
    assert not np.allclose(graphs.run(lowered_bias_add(out), lora)[0], graphs.run(model, feeds)[0])
    graphs.assert_same_outputs(model, lowered_bias_add(out), lora)


def test_channels_last_on_dynamic_dims_reads_the_shapes_from_the_channels_last_residual() -> None:
    """A dynamic graph: the NHWC view back goes through ``Shape(r)``; the Shape that read the residual's Transpose
    reads ``Gather(Shape(r), (0,3,1,2))``, so that Transpose (a full copy) goes too."""
    model = proj_out_block(batch="N", height="h", shapes_read=True)
    out, records = run_passes(model, [fuse_bias])
    assert records[0].counts["BiasAdd"] == 1
    ops = graphs.op_counts(out)
    assert ops["Transpose"] == 1 and ops["Shape"] == 1 and ops["Gather"] == 1 and "Add" not in ops
    feeds = graphs.random_feeds(model, dims={"N": 2, "h": 5})
    graphs.assert_same_outputs(model, lowered_bias_add(out), feeds)


def test_channels_last_rejects_refused_widths_nchw_residuals_escaping_sums(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    for model, reason in ((proj_out_block(width=16), "takes [320, 640, 1280] channels; this projection has 16"),
                          (proj_out_block(residual_nhwc=False), "is not a Transpose(0,3,1,2) of a channels-last"),
                          (proj_out_block(bias_sum_is_output=True), "'p' is a graph output")):
        out, records = run_passes(model, [fuse_bias])
        assert records[0].counts == {"BiasAdd": 0, "rejected": 1, "skipped_for_target": 0}
        assert any(reason in m for m in reasons(caplog, "fuse_bias")), reasons(caplog, "fuse_bias")
        assert graphs.op_counts(out) == graphs.op_counts(model)


@pytest.mark.parametrize(("backend", "device"), [("ort", "cpu"), ("tensorrt", "cuda")])
def test_channels_last_other_targets(backend: str, device: str) -> None:
    model = proj_out_block()
    out, records = run_passes(model, [fuse_bias], backend, device)
    assert records[0].counts == {"BiasAdd": 0, "rejected": 0, "skipped_for_target": 1}
    assert graphs.op_counts(out) == graphs.op_counts(model)


@pytest.mark.gpu
def test_channels_last_bias_add_cuda_parity() -> None:
    """The channels-last BiasAdd on ORT's CUDA kernel (its width table: 320, 640, 1280), static and dynamic, against the
    unfused graph on the CPU, with the weight input bound as a LoRA would bind it."""
    for model in (proj_out_block(width=640), proj_out_block(width=320, batch="N", height="h", shapes_read=True)):
        out, records = run_passes(model, [fuse_bias])
        assert records[0].counts["BiasAdd"] == 1
        assert_cuda_parity(model, out)  # symbolic dims: 2 each

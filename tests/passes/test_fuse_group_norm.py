"""fuse_group_norm: torch.nn.GroupNorm's Reshape/InstanceNormalization/Reshape/Mul/Add (+ SiLU) per target."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.passes.fuse_group_norm import fuse_group_norm
from tests import graphs
from tests.passes.fusion_helpers import domains, fuse, reasons

N, C, H, W = 2, 8, 3, 5


def group_norm_model(
    *,
    groups: int = 4,
    silu: bool = False,
    gamma_input: bool = False,
    gamma_shape: tuple[int, ...] = (C, 1, 1),
    shape_from: str = "Shape",
    in_affine: bool = False,
    extra_output: str | None = None,
    extra_nodes: tuple[onnx.NodeProto, ...] = (),
) -> onnx.ModelProto:
    """What torch.nn.GroupNorm(groups, C) [+ SiLU] exports on x:[N, C, H, W] (N symbolic)."""
    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("Reshape", ["x", "target"], ["r"]),
        helper.make_node("InstanceNormalization", ["r", "s", "b"], ["n"], epsilon=1e-5),
        helper.make_node("Reshape", ["n", "shape_x"], ["rb"]),
        helper.make_node("Mul", ["rb", "gamma"], ["m"]),
        helper.make_node("Add", ["m", "beta"], ["a" if silu else "y"]),
    ]
    if shape_from == "Shape":
        nodes.insert(0, helper.make_node("Shape", ["x"], ["shape_x"]))
    if silu:
        nodes += [helper.make_node("Sigmoid", ["a"], ["sig"]), helper.make_node("Mul", ["a", "sig"], ["y"])]
    nodes += list(extra_nodes)
    in_scale = rng.uniform(0.5, 1.5, groups) if in_affine else np.ones(groups)
    in_bias = rng.standard_normal(groups) if in_affine else np.zeros(groups)
    inits = [graphs.const("target", [0, groups, -1], np.int64), graphs.const("s", in_scale),
             graphs.const("b", in_bias), graphs.const("beta", rng.standard_normal((C, 1, 1)))]
    if shape_from != "Shape":
        inits.append(graphs.const("shape_x", [N, C, H, W], np.int64))
    inputs = [graphs.tensor_info("x", [N if shape_from != "Shape" else "N", C, H, W])]
    if gamma_input:
        inputs.append(graphs.tensor_info("gamma", list(gamma_shape)))
    else:
        inits.append(graphs.const("gamma", rng.uniform(0.5, 1.5, gamma_shape)))
    outputs = [graphs.tensor_info("y", [inputs[0].type.tensor_type.shape.dim[0].dim_param or N, C, H, W])]
    if extra_output is not None:
        outputs.append(graphs.tensor_info(extra_output, None))
    model = graphs.make_model(nodes, inputs, outputs, inits, check=extra_output is None)
    return onnx.shape_inference.infer_shapes(model)  # the passes run after infer_shapes


def attrs_of(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
def test_ort_cuda_emits_nhwc_group_norm(silu: bool) -> None:
    model = group_norm_model(silu=silu, in_affine=True)
    out, counts = fuse(model, fuse_group_norm, "ort", "cuda")
    assert counts == {"GroupNorm": 1, "with_silu": int(silu), "Transpose": 2, "rejected": 0, "skipped_for_target": 0}
    assert graphs.op_counts(out) == {"Transpose": 2, "GroupNorm": 1}
    assert domains(out)["com.microsoft"] == 1
    to_nhwc, group_norm, to_nchw = out.graph.node
    assert attrs_of(to_nhwc)["perm"] == [0, 2, 3, 1] and attrs_of(to_nchw)["perm"] == [0, 3, 1, 2]
    assert group_norm.domain == "com.microsoft"
    attrs = attrs_of(group_norm)
    assert attrs["groups"] == 4 and attrs["activation"] == int(silu) and attrs["channels_last"] == 1
    assert attrs["epsilon"] == pytest.approx(1e-5)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
    gamma, beta = (weights[name] for name in group_norm.input[1:])
    assert gamma.shape == beta.shape == (C,) and gamma.dtype == beta.dtype == np.float32
    onnx.checker.check_model(out)


@pytest.mark.gpu
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
def test_ort_cuda_group_norm_parity(silu: bool) -> None:
    import onnxruntime as ort

    model = group_norm_model(silu=silu, in_affine=True)
    out, _ = fuse(model, fuse_group_norm, "ort", "cuda")
    feeds = graphs.random_feeds(model)
    want = graphs.run(model, feeds)[0]
    # TF32 off: the reference is an fp32 CPU run; TF32 MatMuls differ by ~1e-2 at these widths
    session = ort.InferenceSession(out.SerializeToString(), providers=[("CUDAExecutionProvider", {"use_tf32": 0})])
    np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("shape_from", ["Shape", "constant"], ids=["shape-node", "static-shape"])
def test_tensorrt_emits_group_normalization_21(silu: bool, shape_from: str) -> None:
    model = group_norm_model(silu=silu, in_affine=True, shape_from=shape_from)
    out, counts = fuse(model, fuse_group_norm, "tensorrt", "cuda")
    assert counts == {"GroupNormalization": 1, "with_silu": 0, "rejected": 0, "skipped_for_target": 0}
    expected = {"GroupNormalization": 1, **({"Sigmoid": 1, "Mul": 1} if silu else {})}
    assert graphs.op_counts(out) == expected  # the SiLU stays: TensorRT fuses the pointwise tail itself
    assert domains(out)[""] == 21
    group_norm = next(n for n in out.graph.node if n.op_type == "GroupNormalization")
    assert attrs_of(group_norm)["num_groups"] == 4
    onnx.checker.check_model(out, full_check=True)
    graphs.assert_same_outputs(model, out)  # ORT CPU runs GroupNormalization-21 (IN scale/bias folded in)


def test_ort_cpu_leaves_the_pattern() -> None:
    model = group_norm_model(silu=True)
    out, counts = fuse(model, fuse_group_norm, "ort", "cpu")
    assert counts == {"GroupNormalization": 0, "with_silu": 0, "rejected": 0, "skipped_for_target": 1}
    assert graphs.op_counts(out) == graphs.op_counts(model)


@pytest.mark.parametrize(
    ("kwargs", "backend", "reason"),
    [
        ({"gamma_input": True}, "tensorrt", "gamma 'gamma' is not a constant"),
        ({"gamma_shape": (C,)}, "tensorrt", "are not per channel"),
        ({"extra_output": "n"}, "tensorrt", "'n' is a graph output"),
        ({"extra_nodes": (helper.make_node("Relu", ["m"], ["r2"]),), "extra_output": "r2"}, "ort",
         "'m' is also read by Relu"),
        ({"groups": 8}, "ort", "even number of channels per group"),  # C/G = 1: ORT's kernel refuses it
        ({"extra_nodes": (helper.make_node("ReduceMean", ["x"], ["mx"], axes=[1]),), "extra_output": "mx"},
         "tensorrt", "ReduceMean '' changes meaning at opset 18"),
    ],
    ids=["gamma-not-constant", "gamma-1d", "inner-output", "second-consumer", "ort-odd-channels", "opset-blocked"],
)
def test_rejects_with_reason(kwargs: dict, backend: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="diffusion_trt.passes")
    model = group_norm_model(**kwargs)
    out, counts = fuse(model, fuse_group_norm, backend, "cuda")
    assert counts["rejected"] == 1 and counts.get("GroupNorm", 0) == counts.get("GroupNormalization", 0) == 0
    assert graphs.op_counts(out) == graphs.op_counts(model)
    assert domains(out)[""] == 17
    assert any(reason in message for message in reasons(caplog, "fuse_group_norm")), reasons(caplog, "fuse_group_norm")


def test_tensorrt_without_raising_the_opset_rejects() -> None:
    model = group_norm_model()
    out, counts = fuse(model, fuse_group_norm, "tensorrt", "cuda", fuse_group_norm_raise_opset=False)
    assert counts["rejected"] == 1 and counts["GroupNormalization"] == 0 and domains(out)[""] == 17


def test_ort_cuda_deterministic_leaves_the_instance_norm_form() -> None:
    """``fuse_group_norm_deterministic`` (compile --deterministic): ort-cuda fuses nothing, since ORT's GroupNorm
    kernel sums with atomicAdd; the exported form stays node for node and the site counts as skipped."""
    model = group_norm_model(silu=True)
    out, counts = fuse(model, fuse_group_norm, "ort", "cuda", fuse_group_norm_deterministic=True)
    assert counts == {"GroupNorm": 0, "with_silu": 0, "Transpose": 0, "rejected": 0, "skipped_for_target": 1}
    assert graphs.op_counts(out) == graphs.op_counts(model)
    out, counts = fuse(model, fuse_group_norm, "tensorrt", "cuda", fuse_group_norm_deterministic=True)
    assert counts["GroupNormalization"] == 1  # an ORT CUDA option: TensorRT's GroupNormalization is still emitted

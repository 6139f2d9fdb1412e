"""group_norm_channel_stats: the unfused GroupNorm of --deterministic rewritten into per-channel fp32 statistics."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from diffusion_trt.passes import pipeline_for
from diffusion_trt.passes.base import PassContext, optimize_model
from diffusion_trt.passes.group_norm_channel_stats import group_norm_channel_stats
from tests import graphs
from tests.passes.fusion_helpers import fuse
from tests.passes.test_fuse_group_norm import group_norm_model


def _rewritten(model: onnx.ModelProto, **options: object) -> tuple[onnx.ModelProto, dict[str, int]]:
    return fuse(model, group_norm_channel_stats, "ort", "cuda", group_norm_channel_stats=True, **options)


@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("shape_from", ["Shape", "constant"], ids=["symbolic-batch", "static"])
def test_same_outputs_as_the_instance_norm_form(silu: bool, shape_from: str) -> None:
    model = group_norm_model(silu=silu, in_affine=True, shape_from=shape_from)
    out, counts = _rewritten(model)
    assert counts == {"rewritten": 1, "rejected": 0, "skipped_for_target": 0}
    ops = graphs.op_counts(out)
    assert "InstanceNormalization" not in ops and "Transpose" not in ops
    assert ops["ReduceSumSquare"] == 1  # H, W static in both: one reduction gives E[x^2]
    onnx.checker.check_model(out)
    graphs.assert_same_outputs(model, out)


def test_spatial_dims_not_static_take_the_mean_of_squares() -> None:
    model = group_norm_model(silu=True)
    for dim in model.graph.input[0].type.tensor_type.shape.dim[2:]:
        dim.dim_param = "h"  # H and W symbolic (the model is only run with H = W below)
    model = onnx.shape_inference.infer_shapes(model)
    out, counts = _rewritten(model)
    assert counts["rewritten"] == 1
    assert "ReduceSumSquare" not in graphs.op_counts(out)
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8, 4, 4)).astype(np.float32)}
    np.testing.assert_allclose(graphs.run(out, feeds)[0], graphs.run(model, feeds)[0], atol=1e-5)


def test_off_by_default_and_on_other_targets() -> None:
    model = group_norm_model(silu=True)
    out, counts = fuse(model, group_norm_channel_stats, "ort", "cuda")
    assert counts == {"rewritten": 0, "rejected": 0, "skipped_for_target": 1}
    assert graphs.op_counts(out) == graphs.op_counts(model)
    for backend, device in (("ort", "cpu"), ("tensorrt", "cuda")):
        _, counts = fuse(model, group_norm_channel_stats, backend, device, group_norm_channel_stats=True)
        assert counts["skipped_for_target"] == 1 and counts["rewritten"] == 0


def test_the_ort_cuda_fp16_pipeline_keeps_the_statistics_fp32() -> None:
    """Through the whole ort-cuda fp16 pipeline with --deterministic's options: the statistics are fp32 (large
    activations: E[x^2] of values near 300 would overflow fp16), the activation's Mul and Add fp16."""
    model = group_norm_model(silu=True, in_affine=True, shape_from="constant")
    ctx = PassContext(component="unet", backend="ort", device="cuda", precision="fp16",
                      options={"fuse_group_norm_deterministic": True, "group_norm_channel_stats": True})
    out, records = optimize_model(model, pipeline_for("ort", "cuda", "fp16", "unet"), ctx)
    assert {r.name: r.counts for r in records}["group_norm_channel_stats"]["rewritten"] == 1
    types = {vi.name: vi.type.tensor_type.elem_type for vi in onnx.shape_inference.infer_shapes(out).graph.value_info}
    reduces = [n for n in out.graph.node if n.op_type.startswith("Reduce")]
    assert reduces and all(types[n.output[0]] == onnx.TensorProto.FLOAT for n in reduces)
    x = (300 + np.random.default_rng(1).standard_normal((2, 8, 3, 5)) * 20).astype(np.float32)
    want = graphs.run(model, {"x": x})[0]
    got = graphs.run(out, {"x": x.astype(np.float16)})[0].astype(np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=1e-2)

"""specialize_shapes: static inputs, every shape computation folded, same outputs at that shape."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest

from diffusion_trt.errors import PassError
from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes.specialize_shapes import specialize_shapes
from tests import graphs


def ctx(**static_shapes: list[int]) -> PassContext:
    return PassContext(component="unet", backend="ort", device="cuda", precision="fp16",
                       options={"static_shapes": static_shapes})


def test_folds_shape_chain_at_the_given_batch() -> None:
    model = graphs.shape_chain_model(batch="B")
    out, records = optimize_model(model, [specialize_shapes], ctx(x=[3, 3, 4]))
    counts = records[0].counts
    assert counts["inputs_fixed"] == 1 and counts["Shape_before"] == 1 and counts["Shape_after"] == 0
    assert graphs.op_counts(out) == {"Reshape": 1}
    assert [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim] == [3, 3, 4]
    graphs.assert_same_outputs(model, out, graphs.random_feeds(out))


def test_static_graph_without_option_still_folds() -> None:
    model = graphs.shape_chain_model(batch=2)
    _, records = optimize_model(model, [specialize_shapes], ctx())
    assert records[0].counts["inputs_fixed"] == 0 and records[0].counts["Shape_after"] == 0


def test_nothing_to_do_on_a_graph_without_shapes() -> None:
    model = graphs.mlp_model()
    out, records = optimize_model(model, [specialize_shapes], ctx(x=[5, 8]))
    assert records[0].counts["Shape_before"] == 0 and records[0].counts["nodes_folded"] == 0
    graphs.assert_same_outputs(model, out, graphs.random_feeds(out))


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ({}, r"input 'x' of unet has shape \['B', 3, 4\]; give it in ctx.options\['static_shapes'\]"),
        ({"y": [1, 3, 4]}, r"static_shapes names \['y'\], which are not inputs of unet"),
        ({"x": [2, 12]}, r"has rank 2; the input is \['B', 3, 4\]"),
        ({"x": [2, 5, 4]}, r"contradicts the input's shape"),
    ],
)
def test_bad_profiles_are_refused(shapes: dict, message: str) -> None:
    with pytest.raises(PassError, match=message):
        optimize_model(graphs.shape_chain_model(batch="B"), [specialize_shapes], ctx(**shapes))


def test_tiny_unet_has_no_shape_op_left(tiny_onnx: Callable[[str, bool], onnx.ModelProto]) -> None:
    model = tiny_onnx("unet", False)
    shapes = {"sample": [2, 4, 9, 7], "timestep": [2], "encoder_hidden_states": [2, 77, 32]}
    out, records = optimize_model(model, [specialize_shapes], ctx(**shapes))
    counts = records[0].counts
    assert counts["Shape_before"] > 200 and counts["Shape_after"] == 0
    assert "Shape" not in graphs.op_counts(out)
    rng = np.random.default_rng(0)
    feeds = {name: rng.standard_normal(dims).astype(np.float32) for name, dims in shapes.items()}
    graphs.assert_same_outputs(model, out, feeds)

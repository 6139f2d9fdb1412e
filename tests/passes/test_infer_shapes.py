"""infer_shapes: in memory and through a temporary file."""

from __future__ import annotations

import logging

import onnx_graphsurgeon as gs
import pytest

from diffusion_trt.passes import PassContext
from diffusion_trt.passes.infer_shapes import infer_shapes
from tests import graphs


def ctx(**options: object) -> PassContext:
    return PassContext(component="unet", backend="ort", device="cpu", precision="fp32", options=dict(options))


@pytest.mark.parametrize("threshold", [None, 0], ids=["in_memory", "via_path"])
def test_adds_shapes(threshold: int | None, caplog: pytest.LogCaptureFixture) -> None:
    model = graphs.mlp_model()
    graph = gs.import_onnx(model)
    assert graph.tensors()["hr"].shape is None
    options = {} if threshold is None else {"infer_shapes_path_threshold_bytes": threshold}
    with caplog.at_level(logging.DEBUG, logger="diffusion_trt.passes.infer_shapes"):
        result = infer_shapes(graph, ctx(**options))
    assert ("temporary file" in caplog.text) == (threshold == 0)
    assert result.modified and result.counts == {"shapes_added": 3, "shapes_changed": 0, "dtypes_added": 3}
    tensors = graph.tensors()
    assert tensors["h"].shape == ["N", 16] and tensors["hr"].shape == ["N", 16]
    assert tensors["hr"].dtype is not None
    graphs.assert_same_outputs(model, gs.export_onnx(graph))


def test_data_propagation_resolves_reshape_target() -> None:
    model = graphs.shape_chain_model(batch="B")
    graph = gs.import_onnx(model)
    graph.outputs[0].shape = None  # forget the declared output shape: inference must find it
    infer_shapes(graph, ctx())
    assert graph.tensors()["y"].shape == ["B", 12]  # needs data_prop through Shape -> Gather -> Concat
    graphs.assert_same_outputs(model, gs.export_onnx(graph), graphs.random_feeds(model, dims={"B": 3}))


def test_no_change_when_shapes_are_known() -> None:
    graph = gs.import_onnx(graphs.mlp_model())
    infer_shapes(graph, ctx())
    result = infer_shapes(graph, ctx())
    assert not result.modified and result.counts == {"shapes_added": 0, "shapes_changed": 0, "dtypes_added": 0}


def test_refines_but_never_loses_known_sizes() -> None:
    graph = gs.import_onnx(graphs.mlp_model())
    tensors = graph.tensors()
    tensors["h"].shape = ["N", "hidden"]  # less specific than inference: refined
    tensors["hr"].shape = ["N", 16]
    result = infer_shapes(graph, ctx())
    assert tensors["h"].shape == ["N", 16] and result.counts["shapes_changed"] == 1

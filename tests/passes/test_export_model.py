"""passes/_export.export_model: gs.export_onnx's bytes, one copy of the weights, the imported model left as it was."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from diffusion_trt.passes import PassContext, base, optimize_model
from diffusion_trt.passes._export import export_model
from diffusion_trt.passes.convert_fp16 import convert_fp16
from diffusion_trt.passes.fold_constants import fold_constants
from tests import graphs
from tests.passes.test_convert_fp16 import mixed_model


def fp16_ctx() -> PassContext:
    return PassContext(component="unet", backend="ort", device="cuda", precision="fp16")


CASES = [
    pytest.param(mixed_model, [convert_fp16], fp16_ctx, id="convert_fp16"),
    pytest.param(graphs.constant_subgraph_model, [fold_constants],
                 lambda: PassContext(component="unet", backend="ort", device="cpu", precision="fp32"),
                 id="fold_constants"),
    pytest.param(graphs.mlp_model, [], lambda: PassContext(component="unet", backend="ort", device="cpu",
                                                           precision="fp32"), id="no_pass"),
]


@pytest.mark.parametrize(("make", "passes", "make_ctx"), CASES)
def test_optimize_model_writes_what_gs_export_onnx_wrote(make, passes, make_ctx,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = make()
    new, _ = optimize_model(model, passes, make_ctx())
    with monkeypatch.context() as patch:
        patch.setattr(base, "export_model", gs.export_onnx)  # the export before this module
        old, _ = optimize_model(make(), passes, make_ctx())
    assert new.SerializeToString() == old.SerializeToString()
    for a, b in zip(new.graph.initializer, old.graph.initializer, strict=True):
        assert (a.name, a.data_type, a.raw_data) == (b.name, b.data_type, b.raw_data)
    feeds = graphs.random_feeds(model)
    if make_ctx().precision == "fp16":
        feeds = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in feeds.items()}
    for a, b in zip(graphs.run(new, feeds), graphs.run(old, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


def test_optimize_model_leaves_its_input_as_it_was() -> None:
    model = mixed_model()
    before = model.SerializeToString()
    out, _ = optimize_model(model, [convert_fp16], fp16_ctx())
    assert model.SerializeToString() == before  # the fp16 range check runs the same fp32 model again
    assert all(a is not b for a in out.graph.initializer for b in model.graph.initializer)


def test_export_releases_each_array_a_pass_made_once_written() -> None:
    graph = gs.import_onnx(graphs.mlp_model())
    made = np.arange(12, dtype=np.float32).reshape(3, 4)
    alive = weakref.ref(made)
    const = gs.Constant("made", made)
    graph.layer(op="Identity", inputs=[const], outputs=[gs.Variable("made_out", np.float32, (3, 4))])
    graph.outputs.append(graph.nodes[-1].outputs[0])
    del made
    lazy = {t.name: t._values.tensor for t in graph.tensors().values()
            if isinstance(t, gs.Constant) and isinstance(t._values, gs.ir.tensor.LazyValues)}
    model = export_model(graph)
    gc.collect()
    assert alive() is None  # the graph no longer holds the array: its bytes are in the model only
    written = {t.name: t for t in model.graph.initializer}
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(written["made"]), np.arange(12).reshape(3, 4))
    np.testing.assert_array_equal(const.values, np.arange(12, dtype=np.float32).reshape(3, 4))
    assert lazy and all(written[name] is not proto and written[name] == proto for name, proto in lazy.items())


def test_export_without_data_writes_headers_only_and_keeps_the_graph_as_it_was() -> None:
    graph = gs.import_onnx(graphs.mlp_model())
    made = np.ones((2, 2), np.float32)
    graph.layer(op="Identity", inputs=[gs.Constant("made", made)],
                outputs=[gs.Variable("made_out", np.float32, (2, 2))])
    graph.outputs.append(graph.nodes[-1].outputs[0])
    full = gs.export_onnx(gs.import_onnx(gs.export_onnx(graph)))
    sizes = {t.name: int(np.prod(t.dims)) for t in full.graph.initializer}
    model = export_model(graph, data=lambda data_type, dims: int(np.prod(dims)) < 16)
    for got, want in zip(model.graph.initializer, full.graph.initializer, strict=True):
        assert (got.name, got.data_type, list(got.dims)) == (want.name, want.data_type, list(want.dims))
        assert (got == want) if sizes[got.name] < 16 else not got.raw_data
    assert graph.tensors()["made"]._values is made  # nothing written, nothing released

"""Weights left in their external-data files through the passes (passes/_external.py): the same model out, byte for
byte, as when the model is loaded with its data, and no weight read that no pass asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes._external import ExternalValues, external_nbytes, import_graph, with_external_data
from diffusion_trt.passes.convert_fp16 import convert_fp16
from diffusion_trt.passes.eliminate_dead_nodes import eliminate_dead_nodes
from diffusion_trt.passes.fold_constants import fold_constants
from diffusion_trt.passes.fp16_check import _weight_bytes
from diffusion_trt.passes.specialize_shapes import specialize_shapes
from tests import graphs
from tests.passes.test_convert_fp16 import mixed_model


def as_torch_writes_it(model: onnx.ModelProto, folder: Path) -> Path:
    """``model`` saved as torch.onnx.export saves a model of 2 GB or more: one file per tensor of 1 KiB or more."""
    path = folder / "model.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=False,
                    size_threshold=64)
    return path


def ctx(precision: str, external: Path | None = None) -> PassContext:
    return PassContext(component="unet", backend="ort", device="cuda" if precision == "fp16" else "cpu",
                       precision=precision, external_data_dir=external)


def deduped_weights_model() -> onnx.ModelProto:
    """What torch.onnx.export makes of two equal weights (the SDXL UNet's LayerNorm gammas, all ones): one
    initializer, read through an Identity, beside a Shape -> Reshape that static shapes fold."""
    from onnx import helper

    rng = np.random.default_rng(3)
    return graphs.make_model(
        [
            helper.make_node("Identity", ["W"], ["W_copy"]),
            helper.make_node("MatMul", ["x", "W"], ["a"]),
            helper.make_node("MatMul", ["a", "W_copy"], ["b"]),
            helper.make_node("Shape", ["b"], ["shape"]),
            helper.make_node("Reshape", ["b", "shape"], ["y"]),
        ],
        [graphs.tensor_info("x", [2, 32])],
        [graphs.tensor_info("y", [2, 32])],
        [graphs.const("W", rng.standard_normal((32, 32)))],
    )


CASES = [
    pytest.param(mixed_model, [convert_fp16], "fp16", id="convert_fp16"),
    pytest.param(graphs.constant_subgraph_model, [fold_constants], "fp32", id="fold_constants"),
    pytest.param(graphs.duplicate_constants_model, [eliminate_dead_nodes], "fp32", id="dedupe"),
    pytest.param(graphs.mlp_model, [], "fp32", id="no_pass"),
    pytest.param(deduped_weights_model, [specialize_shapes, fold_constants], "fp32", id="identity_of_a_weight"),
]


@pytest.mark.parametrize(("make", "passes", "precision"), CASES)
def test_the_weights_left_in_their_files_give_the_same_model_byte_for_byte(make, passes, precision, tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    path = as_torch_writes_it(make(), tmp_path)
    stub = onnx.load(str(path), load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in stub.graph.initializer)  # the case tested
    before, records_before = optimize_model(onnx.load(str(path)), passes, ctx(precision))
    caplog.set_level("DEBUG", logger="diffusion_trt.passes")
    after, records_after = optimize_model(stub, passes, ctx(precision, tmp_path))
    assert "one-session folding failed" not in caplog.text  # ONNX Runtime got the weights gs exported for it
    assert after.SerializeToString() == before.SerializeToString()
    assert [r.counts for r in records_after] == [r.counts for r in records_before]
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in after.graph.initializer)


def test_a_weight_is_read_only_when_a_pass_or_the_export_asks(tmp_path: Path) -> None:
    path = as_torch_writes_it(graphs.mlp_model(hidden=32), tmp_path)
    stub = onnx.load(str(path), load_external_data=False)
    graph = import_graph(stub, tmp_path)
    external = [t for t in graph.tensors().values() if isinstance(getattr(t, "_values", None), ExternalValues)]
    assert external and all(t._values.nbytes == external_nbytes(t._values.tensor) for t in external)
    full = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    first = external[0]
    np.testing.assert_array_equal(first.values, full[first.name])  # read on demand
    assert all(isinstance(t._values, ExternalValues) for t in external[1:])  # the others still in their files
    assert stub.SerializeToString() == onnx.load(str(path), load_external_data=False).SerializeToString()


def test_without_a_folder_or_external_data_the_import_is_gs_own(tmp_path: Path) -> None:
    model = graphs.mlp_model()
    assert not any(isinstance(getattr(t, "_values", None), ExternalValues)
                   for t in import_graph(model, tmp_path).tensors().values())
    assert with_external_data(model, tmp_path) is model


def test_the_range_check_sees_the_weights_bytes_and_runs_the_model_with_its_data(tmp_path: Path) -> None:
    model = graphs.mlp_model(hidden=32)
    path = as_torch_writes_it(model, tmp_path)
    stub = onnx.load(str(path), load_external_data=False)
    full = onnx.load(str(path))
    assert abs(_weight_bytes(stub) - _weight_bytes(full)) < 64 * len(full.graph.initializer)  # headers differ
    loaded = with_external_data(stub, tmp_path)
    assert loaded is not stub and loaded.SerializeToString() == full.SerializeToString()
    feeds = graphs.random_feeds(full)
    for a, b in zip(graphs.run(loaded, feeds), graphs.run(full, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64, np.int32, np.int8, np.uint8, np.bool_])
def test_a_weight_read_from_its_file_equals_what_onnx_reads(dtype, tmp_path: Path) -> None:
    from onnx import helper

    from diffusion_trt.passes._weights import raw_bytes

    values = (np.arange(600).reshape(20, 30) % 7).astype(dtype)
    model = graphs.make_model([helper.make_node("Identity", ["w"], ["y"])], [],
                              [graphs.tensor_info("y", [20, 30], helper.np_dtype_to_tensor_dtype(values.dtype))],
                              [onnx.numpy_helper.from_array(values, "w")])
    path = as_torch_writes_it(model, tmp_path)
    (weight,) = [t for t in import_graph(onnx.load(str(path), load_external_data=False), tmp_path).tensors().values()
                 if t.name == "w"]
    assert isinstance(weight._values, ExternalValues)
    loaded = weight._values.load()
    assert loaded.dtype == values.dtype and loaded.flags.writeable
    np.testing.assert_array_equal(loaded, values)
    assert raw_bytes(weight) == onnx.load(str(path)).graph.initializer[0].raw_data

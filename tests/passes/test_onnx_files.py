"""save_onnx_file: one self-contained file, or the graph plus one external data file beside it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from diffusion_trt.passes.onnx_files import TENSOR_INLINE_BYTES, save_onnx_file


def two_weight_model() -> onnx.ModelProto:
    """y = x + big + small: ``big`` (4 KiB) above the 1 KiB inline threshold, ``small`` (16 B) below it."""
    big = numpy_helper.from_array(np.arange(1024, dtype=np.float32), "big")
    small = numpy_helper.from_array(np.full(4, 0.5, dtype=np.float32), "small")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "big"], ["t"]), helper.make_node("Add", ["t", "small"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024])], initializer=[big, small])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def locations(path: Path) -> dict[str, str | None]:
    """Initializer name -> its external data file (None: inline), read without loading the data."""
    model = onnx.load(str(path), load_external_data=False)
    return {t.name: next((e.value for e in t.external_data if e.key == "location"), None)
            for t in model.graph.initializer}


def reloaded_weights(path: Path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_external_splits_at_the_threshold_into_one_named_file(tmp_path: Path) -> None:
    assert 16 < TENSOR_INLINE_BYTES <= 4096
    path = tmp_path / "sub" / "unet.onnx"  # the folder does not exist yet
    files = save_onnx_file(two_weight_model(), path, external=True)
    assert files == [path, tmp_path / "sub" / "unet.onnx.data"]
    assert locations(path) == {"big": "unet.onnx.data", "small": None}
    assert files[1].stat().st_size == 4096
    weights = reloaded_weights(path)
    assert np.array_equal(weights["big"], np.arange(1024, dtype=np.float32))
    assert np.array_equal(weights["small"], np.full(4, 0.5, dtype=np.float32))


def test_named_location_and_a_stale_data_file_replaced(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    (tmp_path / "weights.bin").write_bytes(b"\1" * 10_000)  # left by an earlier save: onnx would append to it
    files = save_onnx_file(two_weight_model(), path, external=True, location="weights.bin")
    assert files == [path, tmp_path / "weights.bin"]
    assert locations(path) == {"big": "weights.bin", "small": None}
    assert files[1].stat().st_size == 4096
    assert np.array_equal(reloaded_weights(path)["big"], np.arange(1024, dtype=np.float32))


def test_inline_writes_one_file(tmp_path: Path) -> None:
    path = tmp_path / "m.onnx"
    assert save_onnx_file(two_weight_model(), path, external=False) == [path]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    assert locations(path) == {"big": None, "small": None}
    assert np.array_equal(reloaded_weights(path)["big"], np.arange(1024, dtype=np.float32))


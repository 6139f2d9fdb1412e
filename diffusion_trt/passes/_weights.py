"""Reading constant tensors (weights) without copying a whole model: sizes, raw bytes, digests.

onnx-graphsurgeon keeps imported weights lazily (``LazyValues`` around the original TensorProto); reading
``Constant.values`` converts them to a NumPy array for good, which doubles the memory of a model whose
ModelProto the caller still holds. These helpers read one tensor at a time and keep nothing.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter, dtype_to_onnx
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from ._external import ExternalValues


def constant_nbytes(const: gs.Constant) -> int:
    """Size of the constant's values in bytes, without loading them."""
    values = const._values
    if isinstance(values, (LazyValues, np.ndarray)):
        return int(values.nbytes)
    return 0  # SparseValues: rare, small, never moved or deduped


def constant_proto(const: gs.Constant) -> onnx.TensorProto | None:
    """The TensorProto gs would export for ``const``, or None for sparse constants.

    For lazily loaded weights this is the caller's original proto (shared): read it, never change it. A weight still
    in an external-data file (:class:`._external.ExternalValues`) comes back as a new proto with its data read.
    """
    if isinstance(const._values, SparseValues):
        return None
    if isinstance(const._values, ExternalValues):
        return const._values.loaded()
    return OnnxExporter.export_tensor_proto(const)


def constant_layout(const: gs.Constant) -> tuple[int, tuple[int, ...]] | None:
    """(ONNX dtype enum, shape) of the constant as it would be exported, without reading or copying its values.

    None for sparse constants.
    """
    values = const._values
    if isinstance(values, LazyValues):
        return values.tensor.data_type, tuple(values.tensor.dims)
    if isinstance(values, np.ndarray):
        return dtype_to_onnx(const.export_dtype), tuple(values.shape)
    return None


def proto_raw_bytes(proto: onnx.TensorProto) -> bytes | None:
    """The tensor in ONNX ``raw_data`` encoding (little-endian), or None for strings and unloaded external data."""
    if proto.data_type == onnx.TensorProto.STRING or proto.data_location == onnx.TensorProto.EXTERNAL:
        return None
    if proto.HasField("raw_data"):
        return proto.raw_data
    # Values stored in typed fields (float_data, int64_data...): re-encode as raw.
    return numpy_helper.from_array(numpy_helper.to_array(proto)).raw_data


def raw_bytes(const: gs.Constant) -> bytes | None:
    """The constant in ONNX ``raw_data`` encoding (little-endian, the export dtype), one transient copy at most.

    Returns None when the bytes cannot be had cheaply and exactly: sparse or string tensors, and weights that
    live in an external data file that was not loaded.
    """
    if isinstance(const._values, ExternalValues):  # one read of its file, no proto made
        return const._values.raw_data()
    proto = constant_proto(const)
    return None if proto is None else proto_raw_bytes(proto)


def digest(data: bytes) -> str:
    """sha256 hex digest of ``data``."""
    return hashlib.sha256(data).hexdigest()

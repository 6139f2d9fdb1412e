"""Weights left in the exporter's external-data files until a pass or the export reads them, one at a time.

``torch.onnx.export`` writes a model of 2 GB or more (the SD-1.5 and SDXL UNets, SDXL's second text encoder) as a
``model.onnx`` whose initializers name one file each beside it. ``onnx.load`` reads every one of them into the
ModelProto, and that proto stays whole until the passes stage ends: the protobuf runtime (upb) frees a parsed
model's bytes only with the whole model. For the SDXL UNet that is 10.3 GB of fp32 weights held beside the fp16 ones
``convert_fp16`` makes (benchmarks/results/README.md, twentieth session).

Loaded with ``load_external_data=False`` instead, and imported with :func:`import_graph`, each such weight becomes a
gs constant whose values are :class:`ExternalValues`: its stub TensorProto (name, dtype, dims and the file it lies
in) and the folder. Reading ``Constant.values`` reads the file (the NumPy array gs keeps, as for any weight it
loads); :func:`._export.export_model` writes the weights no pass touched by copying the file's bytes into the new
model, exactly as ``onnx.load`` would have put them there (``raw_data`` set, ``data_location`` DEFAULT, no
``external_data``), so the exported model is the same, byte for byte. While the passes run, gs's own export (the
constant folds' parts for ONNX Runtime) writes such weights with their data too (:func:`exported_with_data`).

The files must stay in place until the passes' output model is made (``compile`` removes its ``.raw/<component>/``
folder after the build).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import external_data_helper, numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
from onnx_graphsurgeon.ir.tensor import LazyValues

#: ONNX data types read straight into a NumPy array (little-endian, as ``raw_data`` holds them).
_NUMPY_DTYPES = {t: np.dtype(n) for t, n in (
    (onnx.TensorProto.FLOAT, "<f4"), (onnx.TensorProto.FLOAT16, "<f2"), (onnx.TensorProto.DOUBLE, "<f8"),
    (onnx.TensorProto.INT64, "<i8"), (onnx.TensorProto.INT32, "<i4"), (onnx.TensorProto.INT16, "<i2"),
    (onnx.TensorProto.INT8, "i1"), (onnx.TensorProto.UINT8, "u1"), (onnx.TensorProto.BOOL, "?"))}


def _inside(base_dir: str, location: str) -> Path | None:
    """``base_dir/location`` when it is a regular file inside ``base_dir`` (no absolute path, no ``..``), else None
    (``numpy_helper.to_array`` then reads it, with onnx's own checks and errors)."""
    if not location or Path(location).is_absolute():
        return None
    base = Path(base_dir).resolve()
    path = (base / location).resolve()
    return path if path.is_relative_to(base) and path.is_file() else None


class ExternalValues(LazyValues):
    """The values of a weight whose data lies in an external-data file of ``base_dir`` (``tensor`` is its stub:
    ``data_location`` EXTERNAL, no data). ``shape``, ``dtype`` and ``nbytes`` come from the stub; nothing is read
    until :meth:`load` or :meth:`write_into`."""

    def __init__(self, tensor: onnx.TensorProto, base_dir: str | Path) -> None:
        super().__init__(tensor)
        self.base_dir = str(base_dir)

    def load(self) -> np.ndarray:
        """The values, read from the file (a new array each call; gs keeps the one ``Constant.values`` reads): read
        straight into the array (one copy) where NumPy has the dtype, else through ``numpy_helper.to_array``."""
        info = external_data_helper.ExternalDataInfo(self.tensor)
        dtype = _NUMPY_DTYPES.get(self.tensor.data_type)
        path = _inside(self.base_dir, info.location)
        if dtype is None or path is None or sys.byteorder != "little":
            return np.array(numpy_helper.to_array(self.tensor, self.base_dir))
        count = int(np.prod(self.tensor.dims, dtype=np.int64))
        if info.length and info.length != count * dtype.itemsize:
            raise ValueError(f"{self.tensor.name}: {info.length} bytes in {info.location}, expected "
                             f"{count * dtype.itemsize} for dims {list(self.tensor.dims)}")
        return np.fromfile(path, dtype=dtype, count=count, offset=info.offset or 0).reshape(tuple(self.tensor.dims))

    def raw_data(self) -> bytes:
        """The tensor's bytes as its ``raw_data`` would hold them (one read, no proto)."""
        return external_data_helper._read_external_data_bytes(self.tensor, self.base_dir)

    def write_into(self, out: onnx.TensorProto) -> None:
        """Make ``out`` the tensor ``onnx.load`` would have made of the stub: its fields, ``raw_data`` read from the
        file, ``data_location`` DEFAULT and no ``external_data``."""
        out.CopyFrom(self.tensor)
        external_data_helper.load_external_data_for_tensor(out, self.base_dir)

    def loaded(self) -> onnx.TensorProto:
        """A new TensorProto with the data (:meth:`write_into`)."""
        out = onnx.TensorProto()
        self.write_into(out)
        return out

    def __str__(self) -> str:
        return f"ExternalValues (shape={self.shape}, dtype={self.dtype})"


def external_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every tensor of ``model`` (initializers, attributes, subgraphs, functions) whose data is external."""
    return (t for t in external_data_helper._get_all_tensors(model) if external_data_helper.uses_external_data(t))


def external_nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of an external tensor's data: its ``length`` entry, else dims x item size (0 for a tensor with its
    data inline)."""
    if not external_data_helper.uses_external_data(tensor):
        return 0
    length = next((e.value for e in tensor.external_data if e.key == "length"), "")
    if length:
        return int(length)
    itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
    return int(np.prod(tensor.dims, dtype=np.int64)) * itemsize


def with_external_data(model: onnx.ModelProto, base_dir: str | Path | None) -> onnx.ModelProto:
    """``model`` itself when it holds all its data, else a copy with every external tensor read from ``base_dir``
    (as ``onnx.load`` would have read it)."""
    if base_dir is None or next(external_tensors(model), None) is None:
        return model
    loaded = onnx.ModelProto()
    loaded.CopyFrom(model)
    external_data_helper.load_external_data_for_model(loaded, str(base_dir))
    return loaded


def import_graph(model: onnx.ModelProto, base_dir: str | Path | None = None) -> gs.Graph:
    """``gs.import_onnx(model)``, with the weights whose data lies in files of ``base_dir`` left there as
    :class:`ExternalValues` (see the module's docstring).

    Only the main graph's initializers are left external (where the exporters put weights); a model with external
    tensors anywhere else (a Constant node's attribute, a subgraph, a function) is imported from a copy with all its
    data read (:func:`with_external_data`), as before. ``base_dir`` None: ``gs.import_onnx(model)``.
    """
    if base_dir is None:
        return gs.import_onnx(model)
    external = sum(1 for _ in external_tensors(model))
    if not external:
        return gs.import_onnx(model)
    if external != sum(external_data_helper.uses_external_data(t) for t in model.graph.initializer):
        return gs.import_onnx(with_external_data(model, base_dir))
    graph = gs.import_onnx(model)
    for tensor in graph.tensors().values():
        values = tensor._values if isinstance(tensor, gs.Constant) else None
        if type(values) is LazyValues and external_data_helper.uses_external_data(values.tensor):
            tensor._values = ExternalValues(values.tensor, base_dir)
            # gs writes a constant's data_location into the proto it exports from an array (a pass's new values):
            # what onnx.load leaves in a tensor it read, not the stub's EXTERNAL
            tensor.data_location = onnx.TensorProto.DEFAULT
    return graph


@contextlib.contextmanager
def exported_with_data() -> Iterator[None]:
    """Inside the block onnx-graphsurgeon's own export writes an :class:`ExternalValues` constant with its data
    (:meth:`ExternalValues.loaded`), as it wrote the proto ``onnx.load`` had read, instead of the stub.

    Why: ``gs.Graph.fold_constants`` exports each foldable part with ``gs.export_onnx`` and runs it in ONNX Runtime;
    a stub names a file ONNX Runtime looks for in its working directory and the fold fails (specialize_shapes then
    falls back to the partitioned fold, which gives another graph: seen on the SDXL UNet, whose exporter
    deduplicated equal weights into Identity nodes). Only what gs exports is read. Patches
    ``OnnxExporter.export_tensor_proto`` for the block: not thread-safe (the passes run on one thread).
    """
    real = OnnxExporter.export_tensor_proto

    def export_tensor_proto(tensor: gs.Constant) -> onnx.TensorProto:
        if isinstance(tensor._values, ExternalValues):
            out = tensor._values.loaded()
            out.name = tensor.name
            return out
        return real(tensor)

    OnnxExporter.export_tensor_proto = staticmethod(export_tensor_proto)  # type: ignore[method-assign]
    try:
        yield
    finally:
        OnnxExporter.export_tensor_proto = staticmethod(real)  # type: ignore[method-assign]

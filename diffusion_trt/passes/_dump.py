"""Dump a graph after each pass without writing its weights again each time.

Layout, one folder per component and run::

    {dump_dir}/{component}/00_input.onnx                  the graph the first pass gets
    {dump_dir}/{component}/01_eliminate_dead_nodes.onnx   graph only (small); weights point into weights.bin
    {dump_dir}/{component}/02_fold_constants.onnx
    {dump_dir}/{component}/weights.bin                    every distinct weight of this run, stored once

Constants of ``MIN_EXTERNAL_BYTES`` or more are written to ``weights.bin`` as ONNX external data, keyed by the
sha256 of their bytes: a weight no pass changed is written once however many dumps refer to it, so ten dumps
of a 3 GB UNet cost about 3 GB of disk plus the weights passes create. Each dump hashes every large weight
again (about 1 s per GB), which is exact even if a pass changed an array in place. Every dump is a complete
model: ONNX Runtime and Netron open it from that folder. ``weights.bin`` is truncated when a run starts.

Weights that were never loaded (external data of the original model) keep their original external
reference, relative to the original model's folder. Constants inside subgraphs and functions stay inline.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import BinaryIO

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues

from ._weights import constant_nbytes, constant_proto, digest, proto_raw_bytes

logger = logging.getLogger(__name__)

#: Constants this big or bigger go to weights.bin; smaller ones (shapes, scalars) stay inline and readable.
MIN_EXTERNAL_BYTES = 1024
#: Offsets in weights.bin are multiples of this, so memory-mapped tensors are aligned.
ALIGNMENT = 64
WEIGHTS_FILE = "weights.bin"


class GraphDumper:
    """Writes ``{folder}/{stem}.onnx`` for each call, sharing one ``{folder}/weights.bin``."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.weights_path = self.folder / WEIGHTS_FILE
        self.weights_path.write_bytes(b"")
        self._stored: dict[str, tuple[int, int]] = {}  # sha256 -> (offset, length) in weights.bin

    def dump(self, graph: gs.Graph, stem: str) -> Path:
        """Write ``graph`` as ``{folder}/{stem}.onnx``; ``graph`` itself is not changed. Returns the path."""
        clone = graph.copy()  # copies nodes and tensors, shares weight arrays
        with open(self.weights_path, "ab") as weights:
            for tensor in clone.tensors().values():
                if isinstance(tensor, gs.Constant) and constant_nbytes(tensor) >= MIN_EXTERNAL_BYTES:
                    stub = self._external_stub(tensor, weights)
                    if stub is not None:
                        tensor.values = LazyValues(stub)  # the exporter writes LazyValues' proto as it is
        model = gs.export_onnx(clone, do_type_check=False)
        path = self.folder / f"{stem}.onnx"
        onnx.save_model(model, path)
        return path

    def _external_stub(self, const: gs.Constant, weights: BinaryIO) -> onnx.TensorProto | None:
        proto = constant_proto(const)
        if proto is None:
            return None
        stub = onnx.TensorProto(name=const.name, data_type=proto.data_type, dims=list(proto.dims))
        stub.data_location = onnx.TensorProto.EXTERNAL
        if proto.data_location == onnx.TensorProto.EXTERNAL:
            logger.debug("%s: weight was never loaded; the dump keeps its original external reference", const.name)
            stub.external_data.extend(proto.external_data)
            return stub
        data = proto_raw_bytes(proto)
        if data is None:
            return None
        key = digest(data)
        if key not in self._stored:
            offset = weights.seek(0, 2)
            pad = -offset % ALIGNMENT
            weights.write(b"\0" * pad)
            weights.write(data)
            self._stored[key] = (offset + pad, len(data))
        offset, length = self._stored[key]
        for entry_key, value in (("location", WEIGHTS_FILE), ("offset", str(offset)), ("length", str(length))):
            entry = stub.external_data.add()
            entry.key, entry.value = entry_key, value
        return stub

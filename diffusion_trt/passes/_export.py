"""The graph back to ONNX with one copy of the weights: ``gs.export_onnx``, writing each weight straight into the model.

``gs.export_onnx`` gathers every initializer into a list, hands it to ``onnx.helper.make_graph`` (which copies each
into a GraphProto) and then to ``make_model`` (which copies the GraphProto into the ModelProto): for a 3.4 GB UNet
that is two transient copies of the weights on top of the model it was imported from, and the numpy arrays a pass
made (convert_fp16's fp16 weights) stay alive until the end as well. :func:`export_model` builds the same model
with the weights left out, then copies each initializer into it one at a time, and points each constant a pass made
(numpy-backed) at its exported copy, so its array is freed as soon as it is written. Shape inference
(:func:`.infer_shapes.annotate_shapes`, run by several passes) exports the graph with only the weights it reads
(``data``): the large float weights go out as dtype and dims alone, never copied. A weight still in an
external-data file (:class:`._external.ExternalValues`) is read into the new model as ``onnx.load`` would have read
it.

The imported model is only read: the weights gs still loads lazily from it are copied, never moved. (Moving would
not free memory anyway: the protobuf runtime here, upb, keeps a parsed model's bytes in one arena that is released
only when the whole model is; clearing ``raw_data`` field by field frees nothing.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import (
    OnnxExporter,
    check_duplicate_node_names,
    dtype_to_onnx,
    update_import_domains,
)
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

from ._external import ExternalValues

#: Whether to write the data of an initializer of this ONNX data type and dims (:func:`export_model`'s ``data``).
DataFilter = Callable[[int, Sequence[int]], bool]


def export_model(graph: gs.Graph, *, do_type_check: bool = True, data: DataFilter | None = None) -> onnx.ModelProto:
    """``gs.export_onnx(graph, do_type_check)``, byte for byte, holding one copy of each weight: the model's own.

    Each initializer is copied into the new model one at a time: one that gs loads lazily from the imported model
    (the imported TensorProto is not changed, its name neither), one a pass made from its numpy array, which is then
    dropped: that constant's values are read from the exported TensorProto afterwards (same values, dtype, shape).

    Args:
        data: for a model that only needs some weights (shape inference): initializers for which
            ``data(data_type, dims)`` is False are written as name, data_type and dims alone (no values; not a valid
            model until the caller replaces them), and no constant of the graph is repointed. None: all data.

    Raises:
        onnx_graphsurgeon's own errors, as ``gs.export_onnx`` (e.g. a graph input or output without a dtype).
    """
    check_duplicate_node_names(graph.nodes)
    nodes = [OnnxExporter.export_node(node) for node in graph.nodes]
    inputs = [OnnxExporter.export_value_info_proto(tensor, do_type_check) for tensor in graph.inputs]
    outputs = [OnnxExporter.export_value_info_proto(tensor, do_type_check) for tensor in graph.outputs]
    tensors = graph.tensors()
    constants = [tensor for tensor in tensors.values() if isinstance(tensor, gs.Constant)]
    for tensor in graph.inputs + graph.outputs:
        tensors.pop(tensor.name, None)
    value_info = [OnnxExporter.export_value_info_proto(tensor, do_type_check) for tensor in tensors.values()
                  if isinstance(tensor, gs.Variable) and (tensor.dtype is not None or tensor.shape is not None)]
    body = onnx.helper.make_graph(nodes, graph.name, inputs, outputs, doc_string=graph.doc_string,
                                  value_info=value_info)
    model = onnx.helper.make_model(body, functions=[OnnxExporter.export_function(f) for f in graph.functions],
                                   opset_imports=update_import_domains(graph))
    model.producer_name = graph.producer_name
    model.producer_version = graph.producer_version
    if graph.ir_version is not None:
        model.ir_version = graph.ir_version
    _write_initializers(model.graph, constants, data)
    return model


def _write_initializers(body: onnx.GraphProto, constants: list[gs.Constant], data: DataFilter | None) -> None:
    """Dense constants into ``body.initializer``, sparse ones into ``body.sparse_initializer``, in gs's order."""
    for tensor in constants:
        values = tensor._values  # gs keeps lazily loaded and numpy values here; export_onnx reads it the same way
        if isinstance(values, SparseValues):
            body.sparse_initializer.add().CopyFrom(values.tensor)
            continue
        out = body.initializer.add()
        if data is not None:
            dtype = values.tensor.data_type if isinstance(values, LazyValues) else dtype_to_onnx(tensor.export_dtype)
            if not data(dtype, tuple(tensor.shape)):
                out.name, out.data_type = tensor.name, dtype
                out.dims.extend(tensor.shape)
                continue
        if isinstance(values, ExternalValues):  # still in the exporter's file: read into the model, as onnx.load would
            values.write_into(out)
            out.name = tensor.name
        elif isinstance(values, LazyValues):
            out.CopyFrom(values.tensor)
            out.name = tensor.name
        else:
            out.CopyFrom(OnnxExporter.export_tensor_proto(tensor))
            if data is None and out.data_type == dtype_to_onnx(tensor.dtype):  # not converted on export (bf16, fp8)
                tensor._values = LazyValues(out)  # the numpy array goes: its bytes now live in the model

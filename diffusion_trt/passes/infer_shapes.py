"""Run ONNX shape inference and write the inferred dtypes and shapes onto the graph's tensors."""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.importers.onnx_importer import get_onnx_tensor_dtype, get_onnx_tensor_shape

from ._export import export_model
from ._weights import constant_nbytes
from .base import PassContext, PassResult, option
from .onnx_files import save_onnx_file

logger = logging.getLogger(__name__)

#: protobuf cannot serialize a message of 2 GiB or more, and in-memory shape inference serializes the model.
PROTOBUF_LIMIT_BYTES = 2**31
#: Weights at or above this go through a temporary file; the margin covers the graph structure (nodes, names,
#: value_info: a few MB for a UNet). Override with ctx.options["infer_shapes_path_threshold_bytes"].
DEFAULT_PATH_THRESHOLD_BYTES = PROTOBUF_LIMIT_BYTES - (128 << 20)


@dataclass(frozen=True)
class InferShapesOptions:
    """The options of :func:`infer_shapes`."""

    #: Graphs with this many bytes of weights left after stubbing (or more) are inferred through a temporary file.
    path_threshold_bytes: int = option("infer_shapes_path_threshold_bytes", DEFAULT_PATH_THRESHOLD_BYTES, int)


def infer_shapes(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Annotate every tensor ONNX shape inference can type with its dtype and shape.

    Matches:  Variables without dtype or shape            Conv(x:[1,4,64,64], W:[320,4,3,3]) -> y:?
    Emits:    the same graph, tensors annotated           Conv(...) -> y:float32[1,320,64,64]
    Why:      fusions check shapes (GroupNorm needs C, attention needs heads) and builders want them known.
    Requires: nothing; runs with strict_mode off (an op it cannot type is skipped, not an error) and data
              propagation on (shapes computed by Shape -> Gather -> Concat chains are resolved).

    The weights' values do not decide any shape: every float initializer of more than
    :data:`WEIGHT_STUB_MIN_ELEMENTS` elements becomes a graph input of the same dtype and shape for the inference
    (integer constants, the small float ones such as Resize scales, and Constant nodes stay). What is left is
    inferred in memory with ``onnx.shape_inference.infer_shapes`` (an SD-1.5 UNet: megabytes instead of 3.4 GB
    serialized). Two ways, chosen by the size of what is left:
      * below ``infer_shapes_path_threshold_bytes`` (default 2 GiB - 128 MiB): in memory;
      * at or above it (a graph whose Constant nodes alone pass 2 GB): the model is saved to a temporary folder
        with its weights as external data, ``onnx.shape_inference.infer_shapes_path`` writes the inferred model
        next to it, and only its value_info is read back. Needs free disk space about the size of the weights.
    The stubbed weights are never copied: the graph is exported with their dtype and dims only
    (:func:`._export.export_model`'s ``data``).

    The graph's tensors keep their names; only Variables are annotated (inputs and constants are left as
    they are). A shape already known is replaced by the inferred one only where that refines it (same rank,
    no known size lost).

    Counts: ``shapes_added`` (tensors that had no shape and have one now), ``shapes_changed``,
    ``dtypes_added``; modified when any of them is non-zero.
    """
    counts = annotate_shapes(graph, ctx.options_for(InferShapesOptions))
    return PassResult(modified=any(counts.values()), counts=counts)


def annotate_shapes(graph: gs.Graph, options: InferShapesOptions) -> dict[str, int]:
    """What :func:`infer_shapes` does, as a step other passes run inside themselves (specialize_shapes' rounds,
    convert_fp16's dtypes): the graph's tensors annotated in place; returns the pass's counts."""
    threshold = options.path_threshold_bytes
    model = export_model(graph, do_type_check=False, data=_keeps_data)  # the stubbed weights' data never copied
    stubbed = _stub_weights(model)
    weight_bytes = sum(constant_nbytes(t) for t in graph.tensors().values() if isinstance(t, gs.Constant)) - stubbed
    if weight_bytes >= threshold:
        logger.debug("weights are %d bytes >= %d: shape inference through a temporary file", weight_bytes, threshold)
        value_infos = _infer_via_path(model)
    else:
        value_infos = _infer_in_memory(model)
    del model
    return _annotate(graph, value_infos)


#: Float initializers above this many elements are replaced by graph inputs (dtype and shape only) for inference.
WEIGHT_STUB_MIN_ELEMENTS = 1024
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                          onnx.TensorProto.DOUBLE})


def _stubbed(data_type: int, dims: Iterable[int]) -> bool:
    """Whether :func:`_stub_weights` moves an initializer of this type and shape to the graph inputs."""
    count = 1
    for dim in dims:
        count *= dim
    return data_type in _FLOAT_TYPES and count > WEIGHT_STUB_MIN_ELEMENTS


def _keeps_data(data_type: int, dims: Sequence[int]) -> bool:
    return not _stubbed(data_type, dims)


def _stub_weights(model: onnx.ModelProto) -> int:
    """Move the large float initializers of ``model`` to graph inputs of the same type; returns their bytes."""
    graph = model.graph
    listed = {value.name for value in graph.input}
    keep: list[onnx.TensorProto] = []
    stubs: list[onnx.ValueInfoProto] = []
    moved = 0
    for init in graph.initializer:
        if _stubbed(init.data_type, init.dims):
            if init.name not in listed:
                stubs.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
            count = 1
            for dim in init.dims:
                count *= dim
            moved += count * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        else:
            keep.append(init)
    if stubs or moved:
        del graph.initializer[:]
        graph.initializer.extend(keep)
        graph.input.extend(stubs)
    return moved


def _infer_in_memory(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    return [*inferred.graph.value_info, *inferred.graph.output]


def _infer_via_path(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    with tempfile.TemporaryDirectory(prefix="infer_shapes_") as tmp:
        source, target = Path(tmp) / "model.onnx", Path(tmp) / "inferred.onnx"
        save_onnx_file(model, source, external=True, location="weights.bin")
        onnx.shape_inference.infer_shapes_path(source, target, check_type=False, strict_mode=False, data_prop=True)
        inferred = onnx.load_model(target, load_external_data=False)
    return [*inferred.graph.value_info, *inferred.graph.output]


def _annotate(graph: gs.Graph, value_infos: Iterable[onnx.ValueInfoProto]) -> dict[str, int]:
    tensors = graph.tensors()
    inputs = {tensor.name for tensor in graph.inputs}
    counts = {"shapes_added": 0, "shapes_changed": 0, "dtypes_added": 0}
    for info in value_infos:
        tensor = tensors.get(info.name)
        if not isinstance(tensor, gs.Variable) or tensor.name in inputs or not info.type.HasField("tensor_type"):
            continue
        if info.type.tensor_type.elem_type and tensor.dtype is None:
            tensor.dtype = get_onnx_tensor_dtype(info)
            counts["dtypes_added"] += 1
        shape = get_onnx_tensor_shape(info)
        if shape is None or shape == tensor.shape:
            continue
        if tensor.shape is None:
            counts["shapes_added"] += 1
        elif _refines(tensor.shape, shape):
            counts["shapes_changed"] += 1
        else:
            logger.debug("%s: kept shape %s, inference gave %s", tensor.name, tensor.shape, shape)
            continue
        tensor.shape = shape
    return counts


def _refines(old: list[int | str | None], new: list[int | str | None]) -> bool:
    """Whether ``new`` is at least as specific as ``old``: same rank, and no known size became unknown."""
    if len(old) != len(new):
        return False
    return all(isinstance(n, int) or not isinstance(o, int) for o, n in zip(old, new, strict=True))

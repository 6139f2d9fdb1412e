"""Evaluate the parts of the graph that depend only on constants and replace them by their values."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from diffusion_trt.errors import PassError

from ._match import const_value, in_onnx_domain
from .base import PassContext, PassResult, option

logger = logging.getLogger(__name__)

#: Results larger than this are not folded; override with ctx.options["fold_constants_size_threshold_bytes"].
#: 64 MiB keeps every weight-shaped result a fusion may need to read (the largest SD / SD-XL linear weight,
#: 1280x10240 fp32, is 50 MiB; only the few 2560->1280 3x3 conv weights, 113 MiB in fp32, are larger) while
#: a runaway Expand / Tile / ConstantOfShape stays a runtime op instead of bloating the model. Nothing is lost
#: by not folding: ONNX Runtime and TensorRT both fold constants again when they build.
DEFAULT_SIZE_THRESHOLD_BYTES = 64 << 20
#: The most bytes one fold may add to the graph's constants, all results together (net: bytes of the constants
#: after minus before); beyond it the pass fails with one line naming the option that raises it,
#: ``fold_constants_max_total_bytes``. 1 GiB: folding a real model rewrites weights in place (SD-1.5's UNet grows
#: by kilobytes), while a 187-byte graph of ConstantOfShape feeding many Adds grew to 2.3 GB under the per-result
#: threshold alone.
DEFAULT_MAX_TOTAL_BYTES = 1 << 30
#: Ops whose output size is set by the values of their constant inputs, checked before anything is evaluated: one
#: whose result would pass the per-result threshold is never run (a 10 GB ConstantOfShape was materialised, then
#: dropped, and ran into the memory limit).
_GENERATORS = frozenset({"ConstantOfShape", "Expand", "Tile", "Range"})
#: Ops whose result is a sequence or an optional, not a tensor: never evaluated (a gs.Constant holds a tensor only, and
#: gs 0.6.1 reads ``.nbytes`` off each result: ``SequenceEmpty`` with no inputs, the constant part of ONNX's own test
#: graph ``test_sequence_model1``, failed the pass with "AttributeError: 'list' object has no attribute 'nbytes'").
_NON_TENSOR_RESULTS = frozenset({"SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase",
                                 "SplitToSequence", "SequenceMap", "Optional", "OptionalGetElement"})


@dataclass(frozen=True)
class FoldConstantsOptions:
    """The options of :func:`fold_constants` (and of the folding inside specialize_shapes)."""

    #: Results larger than this (bytes) are not folded.
    size_threshold_bytes: int = option("fold_constants_size_threshold_bytes", DEFAULT_SIZE_THRESHOLD_BYTES, int)
    #: The most bytes one fold may add to the constants, all results together; more fails the pass.
    max_total_bytes: int = option("fold_constants_max_total_bytes", DEFAULT_MAX_TOTAL_BYTES, int)
    #: True: parts ONNX Runtime cannot evaluate are left unfolded instead of failing the pass.
    error_ok: bool = option("fold_constants_error_ok", False, bool)


def fold_constants(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fold constant subgraphs and statically known shapes into constants (onnx-graphsurgeon + ONNX Runtime).

    Matches:  nodes whose inputs are all constants, and Shape (-> Gather / Slice) of tensors with a static shape
                  Constant(2) -> Mul(W) -> Add(b) -> Conv(x, .)        Shape(x:[1,4,64,64]) -> Gather(1)
    Emits:    one constant per folded result
                  Conv(x, W2)                                         4
    Why:      fusion patterns and TensorRT want weights, shapes and scalars as constants, not as subgraphs.
    Requires: a topologically sorted graph (done here). Shapes are folded only where the graph already knows
              them (exporter value_info or a previous infer_shapes).

    Constant nodes are lowered to initializers first (see ``_lower_constant_nodes``). Then it uses
    ``gs.Graph.fold_constants`` with partitioning: each group of foldable nodes is evaluated by its own ONNX
    Runtime CPU session, so the folded part never has to fit in one 2 GB protobuf. Nodes outside the
    ONNX domain (TensorRT plugins, custom ops) and nodes whose result is a sequence or an optional
    (``SequenceEmpty``...) are never evaluated. Q/DQ nodes are never folded (gs rule).

    Options (``ctx.options`` keys, read as :class:`FoldConstantsOptions`):
        fold_constants_size_threshold_bytes (int | None): largest result folded; default 64 MiB; None: no limit.
            A ConstantOfShape / Expand / Tile / Range whose result (read off its constant inputs) is larger is left
            unfolded without being evaluated.
        fold_constants_max_total_bytes (int): the most bytes one fold may add to the graph's constants, all results
            together; default 1 GiB (:data:`DEFAULT_MAX_TOTAL_BYTES`); more fails the pass with one line.
        fold_constants_error_ok (bool): if True, nodes ONNX Runtime cannot evaluate are left unfolded (gs prints
            a warning) and the rest is folded; default False: the first such error fails the pass.

    Counts: ``nodes_folded`` (node count before minus after, Constant nodes included).

    Raises:
        PassError: ONNX Runtime could not evaluate a foldable part (with error_ok False), or the folded constants
            would add more than ``fold_constants_max_total_bytes``.
    """
    folded = fold(graph, ctx.options_for(FoldConstantsOptions))
    return PassResult(modified=folded > 0, counts={"nodes_folded": folded})


def fold(graph: gs.Graph, options: FoldConstantsOptions) -> int:
    """What :func:`fold_constants` does, as a step specialize_shapes runs inside its rounds; returns the number of
    nodes folded away.

    Raises:
        PassError: as :func:`fold_constants`.
    """
    size_threshold, error_ok = options.size_threshold_bytes, options.error_ok
    before = len(graph.nodes)
    _lower_constant_nodes(graph)
    constant_bytes = _constant_bytes(graph)
    graph.toposort()
    quiet_onnxruntime()
    try:
        graph.fold_constants(
            fold_shapes=True,
            # gs 0.6.1: "basic" with error_ok=True recurses forever on a failing part; "recursive" peels the
            # failing node off and retries (and never raises), so it is the tolerant mode.
            partitioning="recursive" if error_ok else "basic",
            error_ok=error_ok,
            size_threshold=size_threshold,
            should_exclude_node=lambda node: (not in_onnx_domain(node) or node.op in _NON_TENSOR_RESULTS
                                              or _too_big(node, size_threshold)),
            # gs inlines an If with a constant condition into its parent graph; inside another If's branch it leaves
            # the branch's nodes out of topological order, which ONNX Runtime refuses ("Nodes in a graph must be
            # topologically sorted": silero-vad's nested If). ORT and TensorRT fold such Ifs themselves.
            flatten_subgraphs=False,
        )
    except Exception as err:
        raise PassError(
            f"ONNX Runtime could not evaluate a constant part of the graph: {type(err).__name__}: {err}; "
            "set ctx.options['fold_constants_error_ok']=True to leave such parts unfolded"
        ) from err
    graph.cleanup()
    added = _constant_bytes(graph) - constant_bytes
    if added > options.max_total_bytes:
        raise PassError(
            f"folding constants would add {added / 2**20:.0f} MiB of constants to a graph that held "
            f"{constant_bytes / 2**20:.0f} MiB, more than fold_constants_max_total_bytes={options.max_total_bytes} "
            "(a graph that generates big tensors from small ones, e.g. ConstantOfShape); if that is meant, raise it: "
            f"--pass-option fold_constants_max_total_bytes={max(added, 1) * 2}"
        )
    return before - len(graph.nodes)


def _constant_bytes(graph: gs.Graph) -> int:
    """Bytes of the graph's constant tensors (subgraphs included), without loading external data."""
    return sum(_nbytes(t) for t in graph.tensors(check_duplicates=False).values() if isinstance(t, gs.Constant))


def _nbytes(tensor: gs.Constant) -> int:
    """A constant's bytes, read off its (possibly lazy, not yet loaded) values: ``.values`` would load them."""
    return int(getattr(getattr(tensor, "_values", None), "nbytes", 0))


def _too_big(node: gs.Node, limit: int | None) -> bool:
    """A generator op (:data:`_GENERATORS`) whose inputs are constants and whose result would pass ``limit`` bytes,
    computed from those inputs' values (shapes, repeats, range bounds) without evaluating it."""
    if limit is None or node.op not in _GENERATORS or not all(isinstance(t, gs.Constant) for t in node.inputs if t):
        return False
    try:
        elements, itemsize = _generated(node)
    except (ValueError, TypeError, IndexError, OverflowError, ZeroDivisionError):
        return False  # malformed: left to ONNX Runtime, which says why
    if elements * itemsize > limit:
        logger.debug("fold_constants: %s %s not evaluated: its result would be %d bytes (> %d)", node.op, node.name,
                     elements * itemsize, limit)
        return True
    return False


def _generated(node: gs.Node) -> tuple[int, int]:
    """(elements, bytes per element) of a generator op's result, from its constant inputs."""
    inputs = node.inputs
    if node.op == "ConstantOfShape":
        value = node.attrs.get("value")
        itemsize = _nbytes(value) // max(_product(value.shape), 1) if isinstance(value, gs.Constant) else 4
        return _product(inputs[0].values), itemsize
    if node.op == "Range":
        start, limit, delta = (float(np.asarray(t.values).reshape(-1)[0]) for t in inputs[:3])
        return max(int(np.ceil((limit - start) / delta)), 0), _nbytes(inputs[0]) or 8
    data = inputs[0]  # Tile, Expand: its shape only (its values may be a weight not loaded yet)
    elements = _product(data.shape)
    itemsize = _nbytes(data) // max(elements, 1)
    if node.op == "Tile":
        return elements * _product(inputs[1].values), itemsize
    shape = [int(d) for d in np.asarray(inputs[1].values).reshape(-1)]  # Expand: data's shape broadcast with shape
    rank = max(len(shape), len(data.shape))
    dims_a = [1] * (rank - len(data.shape)) + [int(d) for d in data.shape]
    dims_b = [1] * (rank - len(shape)) + shape
    return _product([max(a, b) for a, b in zip(dims_a, dims_b, strict=True)]), itemsize


def _product(dims: object) -> int:
    """Product of integer dims as a Python int (no int64 overflow); a negative dim is malformed."""
    out = 1
    for d in np.asarray(dims).reshape(-1):
        if int(d) < 0:
            raise ValueError(f"negative dim {int(d)}")
        out *= int(d)
    return out


def _lower_constant_nodes(graph: gs.Graph) -> None:
    """Turn the outputs of ``Constant`` nodes into initializers, with the dtype ONNX gives each attribute.

    gs does this itself, but turns ``value_float`` / ``value_floats`` into float64 arrays, which then fail
    ONNX Runtime's type check (``Mul`` of float and double) when they meet float32 tensors.
    """
    for node in graph.nodes:
        if node.op != "Constant" or len(node.outputs) != 1:
            continue
        output = node.outputs[0]
        value = const_value(output)
        if value is not None and not isinstance(output, gs.Constant):
            output.to_constant(value)
            output.inputs.clear()


def quiet_onnxruntime() -> None:
    """Raise ONNX Runtime's default log level to errors for the sessions gs creates while folding.

    Its graph optimizer warns once per node it cannot simplify ("UnsqueezeElimination cannot remove node ...":
    hundreds of lines on a UNet) on stderr; those say nothing about our graph's correctness.
    """
    import onnxruntime as ort

    ort.set_default_logger_severity(3)

"""Evaluate the parts of the graph that depend only on constants and replace them by their values."""

from __future__ import annotations

import logging
from dataclasses import dataclass

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


@dataclass(frozen=True)
class FoldConstantsOptions:
    """The options of :func:`fold_constants` (and of the folding inside specialize_shapes)."""

    #: Results larger than this (bytes) are not folded.
    size_threshold_bytes: int = option("fold_constants_size_threshold_bytes", DEFAULT_SIZE_THRESHOLD_BYTES, int)
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
    ONNX domain (TensorRT plugins, custom ops) are never evaluated. Q/DQ nodes are never folded (gs rule).

    Options (``ctx.options`` keys, read as :class:`FoldConstantsOptions`):
        fold_constants_size_threshold_bytes (int | None): largest result folded; default 64 MiB; None: no limit.
        fold_constants_error_ok (bool): if True, nodes ONNX Runtime cannot evaluate are left unfolded (gs prints
            a warning) and the rest is folded; default False: the first such error fails the pass.

    Counts: ``nodes_folded`` (node count before minus after, Constant nodes included).

    Raises:
        PassError: ONNX Runtime could not evaluate a foldable part (with error_ok False).
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
            should_exclude_node=lambda node: not in_onnx_domain(node),
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
    return before - len(graph.nodes)


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

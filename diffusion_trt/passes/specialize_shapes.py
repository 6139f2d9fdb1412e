"""Freeze the graph at one static shape and fold every shape computation into constants."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from diffusion_trt.errors import PassError

from ._match import in_onnx_domain
from .base import PassContext, PassResult, option
from .fold_constants import FoldConstantsOptions, _lower_constant_nodes, fold, quiet_onnxruntime
from .infer_shapes import InferShapesOptions, annotate_shapes

logger = logging.getLogger(__name__)

#: Inference + folding rounds before giving up on a fixpoint (each round resolves at least one more level of
#: Shape -> ... -> Reshape; the SD components need 2-3).
MAX_ROUNDS = 8


@dataclass(frozen=True)
class SpecializeShapesOptions:
    """The options of :func:`specialize_shapes`: compile derives them from a static profile."""

    #: The shape of each graph input, e.g. ``{"sample": (2, 4, 64, 64), "timestep": (2,)}``.
    static_shapes: Mapping[str, tuple[int, ...]] | None = option("static_shapes", None, dict, user=False)


def specialize_shapes(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Make every graph input static and fold all shape arithmetic, so no Shape op is left to run.

    Matches:  dynamic inputs and the shape subgraphs that read them
                  x:[B2,4,h,w] -> Shape -> Gather(0) -> Unsqueeze -> Concat(., [-1, 320]) -> Reshape(y, .)
    Emits:    static inputs and constants
                  x:[2,4,64,64]                                      Reshape(y, [2,-1,320])
    Why:      a static engine: ONNX Runtime can capture the whole UNet in a CUDA graph only when no shape op
              runs on the CPU, and TensorRT gets its static fast path. Also makes the fusions' shape checks exact.
    Requires: run before fusions that emit com.microsoft ops (ONNX shape inference cannot see through them, so
              shapes after them would stay unknown and their Shape readers unfolded).

    Repeats shape inference then folding (the steps of ``infer_shapes`` and ``fold_constants``:
    :func:`.infer_shapes.annotate_shapes`, :func:`.fold_constants.fold`; no pass calls another pass) until the
    number of Shape nodes stops falling (at most :data:`MAX_ROUNDS` rounds).

    Options (``ctx.options`` keys, read as :class:`SpecializeShapesOptions`):
        static_shapes (dict[str, Sequence[int]]): the shape of each graph input, e.g.
            ``{"sample": [2, 4, 64, 64], "timestep": [2], "encoder_hidden_states": [2, 77, 768]}``. Inputs not
            named keep their shape, which must then already be static. Also read: the options of
            ``fold_constants`` and ``infer_shapes``.

    Counts: ``inputs_fixed`` (inputs whose shape changed), ``Shape_before``, ``Shape_after``, ``nodes_folded``,
        ``rounds``.

    Raises:
        PassError: an option names no graph input, gives the wrong rank, contradicts a static dim, or an input
            is left with a symbolic dim.
    """
    wanted: dict[str, Sequence[int]] = dict(ctx.options_for(SpecializeShapesOptions).static_shapes or {})
    inputs = {tensor.name: tensor for tensor in graph.inputs}
    unknown = sorted(set(wanted) - set(inputs))
    if unknown:
        raise PassError(f"static_shapes names {unknown}, which are not inputs of {ctx.component}; "
                        f"its inputs are {sorted(inputs)}")
    fixed = 0
    for name, tensor in inputs.items():
        shape = tensor.shape
        if name in wanted:
            dims = [int(d) for d in wanted[name]]
            if shape is not None and len(shape) != len(dims):
                raise PassError(f"static_shapes[{name!r}]={dims} has rank {len(dims)}; the input is {shape}")
            clash = [(have, want) for have, want in zip(shape or dims, dims, strict=True)
                     if isinstance(have, int) and have != want]
            if clash or any(d <= 0 for d in dims):
                raise PassError(f"static_shapes[{name!r}]={dims} contradicts the input's shape {shape}; "
                                "give a positive size for each symbolic dim and keep the static ones")
            if list(shape or []) != dims:
                tensor.shape = dims
                fixed += 1
        elif shape is None or not all(isinstance(d, int) for d in shape):
            raise PassError(f"input {name!r} of {ctx.component} has shape {shape}; give it in "
                            f"ctx.options['static_shapes'], e.g. {{{name!r}: [...]}}")
    shape_before = _count_shapes(graph)
    nodes_before = len(graph.nodes)
    rounds, shapes = 0, shape_before
    infer_options, fold_options = ctx.options_for(InferShapesOptions), ctx.options_for(FoldConstantsOptions)
    while rounds < MAX_ROUNDS:
        rounds += 1
        annotate_shapes(graph, infer_options)
        _fold(graph, fold_options)
        now = _count_shapes(graph)
        if now == shapes and rounds > 1:
            break
        shapes = now
    annotate_shapes(graph, infer_options)
    shape_after = _count_shapes(graph)
    if shape_after:
        logger.info("%s: %d Shape nodes remain after specialization (they read tensors whose shape inference "
                    "could not make static)", ctx.component, shape_after)
    counts = {"inputs_fixed": fixed, "Shape_before": shape_before, "Shape_after": shape_after,
              "nodes_folded": nodes_before - len(graph.nodes), "rounds": rounds}
    return PassResult(modified=bool(fixed or counts["nodes_folded"]), counts=counts)


def _fold(graph: gs.Graph, options: FoldConstantsOptions) -> None:
    """fold_constants in one ONNX Runtime session (no partitioning: gs 0.6.1 copies the whole graph once per
    partition, 13 s on the tiny UNet instead of 0.5 s); falls back to the partitioned pass if that fails."""
    _lower_constant_nodes(graph)
    graph.toposort()
    quiet_onnxruntime()
    try:
        graph.fold_constants(
            fold_shapes=True,
            partitioning=None,
            size_threshold=options.size_threshold_bytes,
            should_exclude_node=lambda node: not in_onnx_domain(node),
        )
    except Exception as err:  # noqa: BLE001 - any ORT failure: retry with the partitioned, error-reporting pass
        logger.debug("one-session folding failed (%s: %s); folding per partition", type(err).__name__, err)
        fold(graph, options)
    graph.cleanup()


def _count_shapes(graph: gs.Graph) -> int:
    return sum(node.op == "Shape" for node in graph.nodes)

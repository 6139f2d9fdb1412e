"""Fuse a projection's bias Add and the residual Add after it into ORT's BiasAdd."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from ._match import const_value, fuse_each, in_onnx_domain, is_const, is_graph_output, single_consumer
from ._patterns import ORT_CUDA, Namer, producer, replace_output, same_shape, target_of
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "fuse_bias"

#: Channel counts ORT's BiasAdd CUDA kernel accepts (contrib_ops/cuda/diffusion/bias_add.cc: "Number of channels
#: should be 320, 640 or 1280"): the SD 1.x/2.x UNet widths.
BIAS_ADD_CHANNELS: frozenset[int] = frozenset({320, 640, 1280})


@dataclass
class _BiasMatch:
    projected: gs.Tensor  # MatMul output [B, S, C]
    bias: gs.Tensor  # constant [C]
    skip: gs.Tensor  # the residual [B, S, C]
    residual: gs.Node  # Add(bias_add, skip)
    bias_add: gs.Node  # Add(projected, bias)


def fuse_bias(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse ``(x @ W + bias) + residual`` into ORT's BiasAdd (ort-cuda).

    Matches:  MatMul -> Add(bias[C]) -> Add(., residual)   where the residual sum feeds no LayerNorm (those
              are fuse_skip_layer_norm's, which runs first): the feed-forward's output projection plus the
              block's residual in diffusers' BasicTransformerBlock (``hidden_states = ff_output + hidden_states``).
    Emits:    ort-cuda:  com.microsoft.BiasAdd(MatMul output, bias, residual)
              others:    nothing (``skipped_for_target``): TensorRT folds the bias into its GEMM epilogue itself,
                         and the CPU provider is kept on standard ops.
    Why:      one kernel instead of two elementwise passes over [B, S, C]; ORT also stops turning the MatMul and
              its bias into a Gemm that first broadcasts the bias into the output (its ``BroadcastBiasKernel``).
    Requires: the MatMul output of shape [B, S, C] (C static) with C in BIAS_ADD_CHANNELS (the kernel's limits;
              others rejected with the reason); the bias a constant of C elements; the bias Add read only by the
              residual Add; the residual non-constant with the same shape (same ints or symbolic names); the bias
              sum not a graph output.

    Counts: ``BiasAdd``, ``rejected`` (reasons at DEBUG), ``skipped_for_target`` (matched, not ort-cuda).
    """
    target = target_of(ctx.backend, ctx.device)
    names = Namer(graph)

    def rewrite(match: _BiasMatch) -> str | None:
        if target != ORT_CUDA:
            return None
        bias = match.bias
        value = const_value(bias)
        if value is not None and value.ndim != 1:  # BiasAdd wants a 1-D bias
            bias = gs.Constant(names(f"{bias.name}_1d"), value.reshape(-1))
        replace_output(graph, match.residual, gs.Node(op="BiasAdd", domain="com.microsoft",
                                                      name=names(f"{match.residual.name}_BiasAdd"),
                                                      inputs=[match.projected, bias, match.skip]))
        return "BiasAdd"

    tally = fuse_each(graph, NAME, match=_candidate, check=lambda match: _check(graph, match, target),
                      rewrite=rewrite)
    return PassResult.of(tally, "BiasAdd")


def _split_bias_add(node: gs.Node) -> tuple[gs.Tensor, gs.Tensor] | None:
    """(MatMul output, constant bias) when ``node`` is ``Add(MatMul(...), const)`` in either order."""
    first, second = node.inputs
    for x, bias in ((first, second), (second, first)):
        if is_const(bias) and not is_const(x) and producer(x, "MatMul") is not None:
            return x, bias
    return None


def _candidate(node: gs.Node) -> _BiasMatch | None:
    """The match when ``node`` is a residual Add over a biased projection, else None (no candidate)."""
    if node.op != "Add" or not in_onnx_domain(node) or len(node.inputs) != 2 or not node.outputs:
        return None
    first, second = node.inputs
    for inner, skip in ((first, second), (second, first)):
        bias_add = producer(inner, "Add")
        if bias_add is None or is_const(skip):
            continue
        split = _split_bias_add(bias_add)
        if split is not None:
            return _BiasMatch(split[0], split[1], skip, node, bias_add)
    return None


def _check(graph: gs.Graph, match: _BiasMatch, target: str) -> str | None:
    node, projected, bias, skip = match.residual, match.projected, match.bias, match.skip
    inner = match.bias_add.outputs[0]
    if is_graph_output(graph, inner) or single_consumer(inner) is not node:
        return f"the bias sum {inner.name!r} is also read outside the residual Add"
    shape = same_shape(projected, skip)
    if shape is None:
        return (f"the residual's shape {skip.shape} may differ from the projection's {projected.shape} "
                "(BiasAdd cannot broadcast)")
    if len(shape) != 3 or not isinstance(shape[-1], int):
        return f"the projection's shape {shape} is not [B, S, C] with C static"
    value = const_value(bias)
    if value is None or value.size != shape[-1] or any(d != 1 for d in value.shape[:-1]):
        return f"the bias {bias.name!r} is not a constant of {shape[-1]} elements"
    if target == ORT_CUDA and shape[-1] not in BIAS_ADD_CHANNELS:
        return f"ORT's BiasAdd CUDA kernel takes {sorted(BIAS_ADD_CHANNELS)} channels; this projection has {shape[-1]}"
    if any(n.op == "LayerNormalization" for n in node.outputs[0].outputs):
        return "the residual sum feeds a LayerNorm: fuse_skip_layer_norm's (run it first)"
    return None

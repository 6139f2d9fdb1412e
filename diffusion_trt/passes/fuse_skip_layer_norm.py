"""Fuse a residual Add (with the bias Add of the projection before it) into the LayerNormalization it feeds."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ._match import const_value, fuse_each, in_onnx_domain, is_const, is_graph_output, single_consumer
from ._patterns import ORT_CUDA, Namer, producer, redirect_readers, same_shape, target_of
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "fuse_skip_layer_norm"


@dataclass
class _SkipMatch:
    norm: gs.Node  # LayerNormalization(sum, gamma, beta)
    residual: gs.Node  # Add(a, b) -> sum
    input: gs.Tensor  # a, or the MatMul output under a's bias Add
    skip: gs.Tensor  # b
    bias: gs.Tensor | None  # constant [D] folded from a's bias Add
    width: int  # D


def fuse_skip_layer_norm(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse ``LayerNorm(a + b)`` (and ``a = x @ W + bias``) into ORT's SkipLayerNormalization (ort-cuda).

    Matches:  [MatMul -> Add(bias[D]) ->] Add(a, b) -> LayerNormalization(axis -1, gamma[D], beta[D])
              the transformer block's ``h = attn(norm1(h)) + h; norm2(h)`` (diffusers attention_processor.py
              ``AttnProcessor2_0`` + BasicTransformerBlock in attention.py, CLIP's encoder layers likewise); the
              sum may have other readers (the next residual Add): they read the fused node's 4th output.
    Emits:    ort-cuda:  com.microsoft.SkipLayerNormalization(input, skip, gamma, beta, bias; epsilon)
                         -> (output, -, -, input_skip_bias_sum)
              others:    nothing (``skipped_for_target``): TensorRT fuses the add into its normalization layer
                         itself, and ORT's CPU provider is kept on standard ops.
    Why:      one kernel instead of bias add + residual add + LayerNorm; ORT 1.31's own SkipLayerNormFusion left
              the SD-1.5 UNet's LayerNorms alone (figures: benchmarks/results/README.md ("Figures behind code
              defaults")).
    Requires: the LayerNorm over the last axis with a constant gamma (beta optional) of D elements; a and b
              non-constant with the same shape [B, S, D] (rank 3, or rank 2 [tokens, D]; D static, other dims the
              same int or the same symbolic name); the bias Add
              folded only when its output has the residual Add as its sole reader and the bias is a constant of
              D elements; the sum not a graph output.

    Counts: ``SkipLayerNormalization``, ``with_bias`` (of those, a bias Add folded in), ``rejected`` (reasons at
    DEBUG), ``skipped_for_target`` (matched, target not ort-cuda).
    """
    target = target_of(ctx.backend, ctx.device)
    names = Namer(graph)

    def rewrite(match: _SkipMatch) -> dict[str, int] | None:
        if target != ORT_CUDA:
            return None
        _rewrite(graph, match, names)
        return {"SkipLayerNormalization": 1, "with_bias": int(match.bias is not None)}

    tally = fuse_each(graph, NAME, match=lambda node: _candidate(graph, node), rewrite=rewrite)
    return PassResult.of(tally, "SkipLayerNormalization", "with_bias")


def _candidate(graph: gs.Graph, node: gs.Node) -> _SkipMatch | str | None:
    """The match at a LayerNormalization whose input an Add writes, a reason, or None."""
    if node.op != "LayerNormalization" or not in_onnx_domain(node) or not node.outputs:
        return None
    add = producer(node.inputs[0], "Add")
    return None if add is None else _match(graph, node, add)


def _vector(tensor: gs.Tensor | None, width: int) -> bool:
    if tensor is None or not is_const(tensor):
        return False
    value = const_value(tensor)
    return value is not None and value.size == width and all(d == 1 for d in value.shape[:-1])


def _match(graph: gs.Graph, norm: gs.Node, add: gs.Node) -> _SkipMatch | str:
    total = add.outputs[0]
    if is_graph_output(graph, total):
        return f"{total.name!r} is a graph output"
    a, b = add.inputs
    if is_const(a) or is_const(b):
        return "the Add before the LayerNorm adds a constant (a bias, not a residual)"
    shape_a = same_shape(a, b)
    if shape_a is None:
        return (f"the residual Add may broadcast ({a.shape} + {b.shape}): SkipLayerNormalization needs the same "
                "shape on both sides; run infer_shapes (and specialize_shapes) first")
    if len(shape_a) not in (2, 3):
        return f"the residual sum has rank {len(shape_a)}; SkipLayerNormalization takes [B, S, D] or [T, D]"
    width = shape_a[-1]
    if not isinstance(width, int):
        return f"the hidden size {width!r} is not static"
    axis = norm.attrs.get("axis", -1)
    if axis not in (-1, len(shape_a) - 1):
        return f"the LayerNorm normalises axis {axis}, not the last"
    gamma = norm.inputs[1] if len(norm.inputs) > 1 else None
    beta = norm.inputs[2] if len(norm.inputs) > 2 and norm.inputs[2].name else None
    if not _vector(gamma, width):
        return f"gamma is not a constant of {width} elements"
    if beta is not None and not _vector(beta, width):
        return f"beta is not a constant of {width} elements"
    if len(norm.outputs) > 1 and any(o.outputs or is_graph_output(graph, o) for o in norm.outputs[1:]):
        return "the LayerNorm's Mean / InvStdDev outputs are read"
    # Fold the projection's bias: whichever side is Add(MatMul output, bias) read only by the residual Add.
    for inp, skip in ((a, b), (b, a)):
        bias_add = producer(inp, "Add")
        if bias_add is None or single_consumer(inp) is not add or is_graph_output(graph, inp):
            continue
        first, second = bias_add.inputs
        x, bias = (first, second) if is_const(second) else (second, first)
        if is_const(x) or not _vector(bias, width) or producer(x, "MatMul", "Gemm") is None:
            continue
        if same_shape(x, inp) != shape_a:
            continue
        return _SkipMatch(norm, add, x, skip, bias, width)
    return _SkipMatch(norm, add, a, b, None, width)


def _rewrite(graph: gs.Graph, match: _SkipMatch, names: Namer) -> None:
    norm, width = match.norm, match.width
    dtype = np.dtype(match.input.dtype) if match.input.dtype is not None else np.dtype(np.float32)
    gamma = np.asarray(const_value(norm.inputs[1])).reshape(width)
    inputs: list[gs.Tensor] = [match.input, match.skip, gs.Constant(names(f"{norm.name}_sln_gamma"), gamma)]
    beta_tensor = norm.inputs[2] if len(norm.inputs) > 2 and norm.inputs[2].name else None
    if beta_tensor is not None:
        beta = np.asarray(const_value(beta_tensor)).reshape(width)
    else:
        beta = np.zeros(width, dtype=gamma.dtype)  # explicit zeros: the bias slot comes after beta
    inputs.append(gs.Constant(names(f"{norm.name}_sln_beta"), beta))
    if match.bias is not None:
        bias = np.asarray(const_value(match.bias)).reshape(width).astype(dtype, copy=False)
        inputs.append(gs.Constant(names(f"{norm.name}_sln_bias"), bias))
    total = match.residual.outputs[0]
    others = [n for n in total.outputs if n is not norm]
    y = norm.outputs[0]
    norm.outputs.clear()
    outputs: list[gs.Tensor] = [y]
    if others:
        summed = gs.Variable(names(f"{total.name}_sln_sum"), dtype=total.dtype, shape=total.shape)
        outputs += [gs.Variable.empty(), gs.Variable.empty(), summed]
        redirect_readers(total, summed, others)
    node = gs.Node(op="SkipLayerNormalization", name=names(f"{norm.name}_SkipLayerNorm"), domain="com.microsoft",
                   attrs={"epsilon": float(norm.attrs.get("epsilon", 1e-5))}, inputs=inputs, outputs=outputs)
    graph.nodes.append(node)
    match.residual.outputs.clear()

"""Fuse a projection's bias Add and the residual Add after it into ORT's BiasAdd."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ._match import Tally, const_value, fuse_each, in_onnx_domain, is_const, is_graph_output, single_consumer
from ._patterns import (
    ORT_CUDA,
    Namer,
    escape_problem,
    import_domain,
    producer,
    redirect_readers,
    replace_output,
    same_shape,
    static_shape,
    target_of,
)
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "fuse_bias"

#: Channel counts ORT's BiasAdd CUDA kernel accepts (contrib_ops/cuda/diffusion/bias_add.cc: "Number of channels
#: should be 320, 640 or 1280"): the SD 1.x/2.x UNet widths.
BIAS_ADD_CHANNELS: frozenset[int] = frozenset({320, 640, 1280})

#: The perm of a channels-last [N, H, W, C] -> [N, C, H, W] Transpose.
_TO_NCHW = (0, 3, 1, 2)


@dataclass
class _BiasMatch:
    projected: gs.Tensor  # MatMul output [B, S, C]
    bias: gs.Tensor  # constant [C]
    skip: gs.Tensor  # the residual [B, S, C]
    residual: gs.Node  # Add(bias_add, skip)
    bias_add: gs.Node  # Add(projected, bias)


@dataclass
class _ChannelsLastMatch:
    matmul: gs.Node  # MatMul(x [N, H, W, C], W [C, O])
    bias: gs.Tensor  # constant [O]
    skip: gs.Tensor  # the residual, channels-last [N, H, W, O]
    inside: list[gs.Tensor]  # MatMul output, bias sum, its NCHW Transpose: read by the pattern alone
    readers: list[gs.Node]  # the bias Add, the Transpose, the residual Add
    skip_transpose: gs.Node  # Transpose(0,3,1,2)(skip)
    residual: gs.Node  # Add(Transpose(bias sum), Transpose(skip))


def fuse_bias(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse ``(x @ W + bias) + residual`` into ORT's BiasAdd (ort-cuda).

    Matches:  MatMul -> Add(bias[C]) -> Add(., residual)   where the residual sum feeds no LayerNorm (those
              are fuse_skip_layer_norm's, which runs first): the feed-forward's output projection plus the
              block's residual in diffusers' BasicTransformerBlock (``hidden_states = ff_output + hidden_states``).
              Channels-last form: x[N,H,W,C] -> MatMul -> Add(bias[O]) -> Transpose(0,3,1,2) -> Add(., r) with
              r = Transpose(0,3,1,2)(skip[N,H,W,O]): a transformer's 1x1 proj_out that
              :func:`~diffusion_trt.compiler.pointwise_convs.pointwise_convs_as_matmul` made a MatMul over a weight
              input (``compile --refittable``), plus the Transformer2DModel's residual.
    Emits:    ort-cuda:  com.microsoft.BiasAdd(MatMul output, bias, residual)
                         channels-last: BiasAdd(MatMul(Reshape(x, [0,-1,C]), W), bias, Reshape(skip, [0,-1,O]))
                         -> Reshape(shape(skip)) -> Transpose(0,3,1,2) (the Reshapes are views: no copy); Shape
                         nodes that read the residual's Transpose read ``Gather(shape(skip), (0,3,1,2))``, so that
                         Transpose goes too
              others:    nothing (``skipped_for_target``): TensorRT folds the bias into its GEMM epilogue itself,
                         and the CPU provider is kept on standard ops.
    Why:      one kernel instead of two elementwise passes over [B, S, C]; ORT also stops turning the MatMul and
              its bias into a Gemm that first broadcasts the bias into the output (its ``BroadcastBiasKernel``).
              The channels-last form keeps a refittable UNet's proj_out bias from costing that kernel (issue 26:
              on the H100 the refittable SD-1.5 UNet launched 11 more of them than the plain compile, whose proj_out
              is a Conv with the bias as its input).
    Requires: the MatMul output of shape [B, S, C] (C static) with C in BIAS_ADD_CHANNELS (the kernel's limits;
              others rejected with the reason); the bias a constant of C elements; the bias Add read only by the
              residual Add; the residual non-constant with the same shape (same ints or symbolic names); the bias
              sum not a graph output. Channels-last: x [N, H, W, C] with C static, the skip [N, H, W, O] of the
              bias sum's shape, every tensor between the MatMul and the residual Add read by the pattern alone.

    Counts: ``BiasAdd`` (both forms), ``rejected`` (reasons at DEBUG), ``skipped_for_target`` (matched, not
    ort-cuda).
    """
    target = target_of(ctx.backend, ctx.device)
    names = Namer(graph)

    def rewrite(match: _BiasMatch) -> str | None:
        if target != ORT_CUDA:
            return None
        replace_output(graph, match.residual, gs.Node(op="BiasAdd", domain="com.microsoft",
                                                      name=names(f"{match.residual.name}_BiasAdd"),
                                                      inputs=[match.projected, _bias_1d(match.bias, names),
                                                              match.skip]))
        return "BiasAdd"

    def rewrite_channels_last(match: _ChannelsLastMatch) -> str | None:
        if target != ORT_CUDA:
            return None
        _rewrite_channels_last(graph, match, names)
        return "BiasAdd"

    tally = fuse_each(graph, NAME, match=_candidate, check=lambda match: _check(graph, match, target),
                      rewrite=rewrite)
    last = fuse_each(graph, NAME, match=_channels_last_candidate,
                     check=lambda match: _check_channels_last(graph, match, target), rewrite=rewrite_channels_last)
    tally = Tally(tally.counts + last.counts, tally.rejected + last.rejected, tally.skipped + last.skipped)
    return PassResult.of(tally, "BiasAdd")


def _bias_1d(bias: gs.Tensor, names: Namer) -> gs.Tensor:
    """``bias`` as BiasAdd wants it: 1-D (a [1, 1, C] constant flattened)."""
    value = const_value(bias)
    if value is not None and value.ndim != 1:
        return gs.Constant(names(f"{bias.name}_1d"), value.reshape(-1))
    return bias


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


# --- channels-last form (a 1x1 Conv rewritten as a MatMul, compile --refittable) ----------------------------


def _to_nchw(tensor: gs.Tensor) -> gs.Node | None:
    """The Transpose(0,3,1,2) that writes ``tensor``, else None."""
    node = producer(tensor, "Transpose")
    return node if node is not None and tuple(node.attrs.get("perm", ())) == _TO_NCHW else None


def _channels_last_candidate(node: gs.Node) -> _ChannelsLastMatch | str | None:
    """The match when ``node`` is ``Add(Transpose(x @ W + bias), residual)``, a reason when the residual is no
    Transpose(0,3,1,2) of a channels-last tensor, else None (no candidate)."""
    if node.op != "Add" or not in_onnx_domain(node) or len(node.inputs) != 2 or not node.outputs:
        return None
    first, second = node.inputs
    for inner, other in ((first, second), (second, first)):
        transpose = _to_nchw(inner)
        bias_add = producer(transpose.inputs[0], "Add") if transpose is not None else None
        split = _split_bias_add(bias_add) if bias_add is not None else None
        if split is None:
            continue
        skip_transpose = _to_nchw(other)
        if skip_transpose is None:
            return (f"the residual {other.name!r} is not a Transpose(0,3,1,2) of a channels-last tensor "
                    "(BiasAdd would need one more Transpose)")
        matmul = producer(split[0], "MatMul")
        assert matmul is not None  # _split_bias_add checked it
        return _ChannelsLastMatch(matmul, split[1], skip_transpose.inputs[0], [split[0], *bias_add.outputs, inner],
                                  [bias_add, transpose, node], skip_transpose, node)
    return None


def _check_channels_last(graph: gs.Graph, match: _ChannelsLastMatch, target: str) -> str | None:
    problem = escape_problem(graph, match.inside, match.readers)
    if problem is not None:
        return problem
    summed, x = match.inside[1], match.matmul.inputs[0]
    shape = same_shape(summed, match.skip)
    if shape is None or len(shape) != 4 or not isinstance(shape[-1], int):
        return (f"the bias sum's shape {summed.shape} and the residual's {match.skip.shape} are not one [N, H, W, O] "
                "with O static")
    if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[-1], int):
        return f"the MatMul's input shape {x.shape} is not [N, H, W, C] with C static"
    value = const_value(match.bias)
    if value is None or value.size != shape[-1] or any(d != 1 for d in value.shape[:-1]):
        return f"the bias {match.bias.name!r} is not a constant of {shape[-1]} elements"
    if target == ORT_CUDA and shape[-1] not in BIAS_ADD_CHANNELS:
        return f"ORT's BiasAdd CUDA kernel takes {sorted(BIAS_ADD_CHANNELS)} channels; this projection has {shape[-1]}"
    return None


def _rewrite_channels_last(graph: gs.Graph, match: _ChannelsLastMatch, names: Namer) -> None:
    """BiasAdd over [N, H*W, C] views of the MatMul's input and the skip; the residual's output keeps its name."""
    x, weight = match.matmul.inputs
    skip, base = match.skip, match.residual.name or "residual"
    dtype, channels = skip.dtype, skip.shape[-1]
    rows = [skip.shape[0], _area(skip.shape[1], skip.shape[2])]
    product = gs.Variable(names(f"{base}_projected"), dtype=dtype, shape=[*rows, channels])
    summed = gs.Variable(names(f"{base}_sum"), dtype=dtype, shape=[*rows, channels])
    nhwc = gs.Variable(names(f"{base}_nhwc"), dtype=dtype, shape=list(skip.shape))
    skip_shape = _shape_of(graph, skip, names)
    graph.nodes.extend([
        gs.Node(op="MatMul", name=names(f"{base}_MatMul"), inputs=[_rows(graph, x, names), weight],
                outputs=[product]),
        gs.Node(op="BiasAdd", domain="com.microsoft", name=names(f"{base}_BiasAdd"),
                inputs=[product, _bias_1d(match.bias, names), _rows(graph, skip, names)], outputs=[summed]),
        gs.Node(op="Reshape", name=names(f"{base}_to_nhwc"), inputs=[summed, skip_shape], outputs=[nhwc]),
    ])
    replace_output(graph, match.residual, gs.Node(op="Transpose", name=names(f"{base}_to_nchw"),
                                                  attrs={"perm": list(_TO_NCHW)}, inputs=[nhwc]))
    match.residual.inputs.clear()  # dead now: the skip's Transpose is left to its other readers
    _detach_shape_readers(graph, match.skip_transpose, skip_shape, names)
    import_domain(graph, "com.microsoft")


def _area(height: object, width: object) -> int | None:
    return height * width if isinstance(height, int) and isinstance(width, int) else None


def _rows(graph: gs.Graph, tensor: gs.Tensor, names: Namer) -> gs.Variable:
    """``tensor`` [N, H, W, C] (C static) viewed as [N, H*W, C] through a Reshape to the constant [0, -1, C]."""
    shape = tensor.shape
    out = gs.Variable(names(f"{tensor.name}_rows"), dtype=tensor.dtype,
                      shape=[shape[0], _area(shape[1], shape[2]), shape[-1]])
    target = gs.Constant(names(f"{tensor.name}_rows_shape"), np.asarray([0, -1, shape[-1]], dtype=np.int64))
    graph.nodes.append(gs.Node(op="Reshape", name=names(f"{tensor.name}_Reshape"), inputs=[tensor, target],
                               outputs=[out]))
    return out


def _shape_of(graph: gs.Graph, tensor: gs.Tensor, names: Namer) -> gs.Tensor:
    """The shape of ``tensor`` as an int64 tensor: a constant when static, else a Shape node's output."""
    static = static_shape(tensor)
    if static is not None:
        return gs.Constant(names(f"{tensor.name}_shape"), np.asarray(static, dtype=np.int64))
    out = gs.Variable(names(f"{tensor.name}_shape"), dtype=np.int64, shape=[len(tensor.shape)])
    graph.nodes.append(gs.Node(op="Shape", name=names(f"{tensor.name}_Shape"), inputs=[tensor], outputs=[out]))
    return out


def _detach_shape_readers(graph: gs.Graph, transpose: gs.Node, source_shape: gs.Tensor, names: Namer) -> None:
    """When only Shape nodes still read ``transpose``'s output (a dynamic graph's ``batch, _, height, width =
    hidden_states.shape``), make them read ``Gather(source_shape, (0,3,1,2))``, the same values: the Transpose
    (a full copy) then goes. Otherwise leave it to its readers."""
    out = transpose.outputs[0]
    readers = list({id(n): n for n in out.outputs}.values())
    if is_graph_output(graph, out) or not all(n.op == "Shape" and in_onnx_domain(n) and not {"start", "end"}
                                              & set(n.attrs) for n in readers):
        return
    permuted = gs.Variable(names(f"{out.name}_shape"), dtype=np.int64, shape=[4])
    indices = gs.Constant(names(f"{out.name}_perm"), np.asarray(_TO_NCHW, dtype=np.int64))
    graph.nodes.append(gs.Node(op="Gather", name=names(f"{out.name}_Gather"), attrs={"axis": 0},
                               inputs=[source_shape, indices], outputs=[permuted]))
    for shape_node in readers:
        if is_graph_output(graph, shape_node.outputs[0]):
            shape_node.op, shape_node.inputs[0] = "Identity", permuted  # the output keeps its name
        else:
            redirect_readers(shape_node.outputs[0], permuted)
            shape_node.outputs.clear()

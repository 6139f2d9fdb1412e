"""Fuse the residual / time-embedding Add in front of an NHWC GroupNorm (and a Conv's bias) into SkipGroupNorm."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ._match import const_value, fuse_each, is_const, is_graph_output, single_consumer
from ._patterns import ORT_CUDA, Namer, producer, redirect_readers, target_of
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "fuse_skip_group_norm"

_TO_NHWC = [0, 2, 3, 1]
_TO_NCHW = [0, 3, 1, 2]


@dataclass
class _SkipGroupNormMatch:
    norm: gs.Node  # com.microsoft.GroupNorm (channels_last=1)
    to_nhwc: gs.Node  # Transpose(x) -> norm
    add: gs.Node  # Add(a, b) -> x
    x: gs.Tensor  # the [N, C, H, W] operand
    skip: gs.Tensor  # [N, C, H, W] or [N, C, 1, 1]
    conv: gs.Node | None  # the Conv writing x whose bias moves into the fused node
    channels: int


def fuse_skip_group_norm(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse ``GroupNorm(a + b)`` (and the bias of the Conv writing ``a``) into ORT's SkipGroupNorm (ort-cuda).

    Matches:  [Conv(bias) ->] Add(a, b) -> Transpose(0,2,3,1) -> com.microsoft.GroupNorm(channels_last=1)
              as fuse_group_norm emits it for ort-cuda; ``b`` the same shape as ``a`` (a ResNet's residual
              sum feeding the next block's norm: diffusers resnet.py ResnetBlock2D ``output_tensor = input_tensor +
              hidden_states``) or [N, C, 1, 1] (the time embedding added before ``norm2``:
              ``hidden_states = hidden_states + temb``). The sum may have other readers: they read the fused
              node's second output, transposed back to NCHW.
    Emits:    Transpose(a) -> com.microsoft.SkipGroupNorm(gamma, beta, skip=Transpose(b), bias=the Conv's bias;
              same epsilon / groups / activation) -> (Y in NHWC, sum in NHWC -> Transpose -> NCHW readers)
              The Transposes meet the NHWC Convs ONNX Runtime makes with ``prefer_nhwc=1`` and cancel there.
    Why:      the Add (and the Conv's separate bias kernel, cuDNN's ``op_generic_tensor_kernel``) run inside the
              GroupNorm kernel (the kernel profile behind it: benchmarks/results/README.md ("Figures behind code
              defaults")). Other targets: nothing matches (no GroupNorm contrib
              op: TensorRT fuses the add into its normalization layer itself).
    Requires: the Transpose read only by the GroupNorm; a and b non-constant, rank 4 with the same static C, b's
              H and W the same as a's or both 1, N the same (int or symbolic name); the Add's output not a graph
              output. The Conv's bias moves only when the Conv's output is read by the Add alone and the bias is
              a constant of C elements.

    Counts: ``SkipGroupNorm``, ``with_bias`` (a Conv bias moved in), ``broadcast_skip`` ([N, C, 1, 1] skips),
    ``rejected`` (reasons at DEBUG), ``skipped_for_target`` (not ort-cuda; always 0 there: nothing matches).
    """
    target = target_of(ctx.backend, ctx.device)
    names = Namer(graph)

    def rewrite(match: _SkipGroupNormMatch) -> dict[str, int]:
        if target != ORT_CUDA:  # a com.microsoft GroupNorm in a graph for another target: leave it be
            return {}
        _rewrite(graph, match, names)
        return {"SkipGroupNorm": 1, "with_bias": int(match.conv is not None),
                "broadcast_skip": int(match.skip.shape[2:] == [1, 1])}

    tally = fuse_each(graph, NAME, match=lambda node: _candidate(graph, node), rewrite=rewrite)
    return PassResult.of(tally, "SkipGroupNorm", "with_bias", "broadcast_skip")


def _candidate(graph: gs.Graph, node: gs.Node) -> _SkipGroupNormMatch | str | None:
    if node.op != "GroupNorm" or node.domain != "com.microsoft" or node.attrs.get("channels_last", 1) != 1:
        return None
    return _match(graph, node)


def _dims_equal(a: object, b: object) -> bool:
    return a is not None and b is not None and a == b and not (isinstance(a, int) and a < 0)


def _match(graph: gs.Graph, norm: gs.Node) -> _SkipGroupNormMatch | str | None:
    """The match, a rejection reason, or None when the GroupNorm's input is no Transpose of an Add at all."""
    to_nhwc = producer(norm.inputs[0], "Transpose")
    if to_nhwc is None or to_nhwc.attrs.get("perm") != _TO_NHWC:
        return None
    add = producer(to_nhwc.inputs[0], "Add")
    if add is None:
        return None
    total = add.outputs[0]
    if is_graph_output(graph, total):
        return f"{total.name!r} is a graph output"
    if single_consumer(norm.inputs[0]) is not norm or is_graph_output(graph, norm.inputs[0]):
        return f"the NHWC input {norm.inputs[0].name!r} is also read elsewhere"
    a, b = add.inputs
    if is_const(a) or is_const(b):
        return "the Add adds a constant (a bias, not a residual or time embedding)"
    sa, sb = a.shape, b.shape
    if sa is None or sb is None or len(sa) != 4 or len(sb) != 4:
        return f"the Add's operands are not both rank 4 ({sa}, {sb}); run infer_shapes first"
    # the full-size side is x; a [N, C, 1, 1] side can only be the skip
    if list(sa[2:]) == [1, 1] and list(sb[2:]) != [1, 1]:
        a, b, sa, sb = b, a, sb, sa
    channels = sa[1]
    if not isinstance(channels, int) or not _dims_equal(sb[1], channels) or not _dims_equal(sa[0], sb[0]):
        return f"the Add's operands differ in N or C ({sa} + {sb}) or C is not static"
    same_hw = _dims_equal(sa[2], sb[2]) and _dims_equal(sa[3], sb[3])
    if not same_hw and list(sb[2:]) != [1, 1]:
        return f"the skip {sb} is neither the input's shape {sa} nor [N, C, 1, 1]"
    conv = None
    for x, skip in ((a, b), (b, a)) if same_hw else ((a, b),):
        writer = producer(x, "Conv")
        if (writer is not None and len(writer.inputs) == 3 and single_consumer(x) is add
                and not is_graph_output(graph, x) and is_const(writer.inputs[2])):
            bias = const_value(writer.inputs[2])
            if bias is not None and bias.size == channels:
                a, b, conv = x, skip, writer
                break
    return _SkipGroupNormMatch(norm, to_nhwc, add, a, b, conv, channels)


def _transpose(graph: gs.Graph, names: Namer, tensor: gs.Tensor, perm: list[int], base: str) -> gs.Variable:
    shape = None if tensor.shape is None else [tensor.shape[p] for p in perm]
    out = gs.Variable(names(f"{base}"), dtype=tensor.dtype, shape=shape)
    graph.nodes.append(gs.Node(op="Transpose", name=names(f"{base}_Transpose"), attrs={"perm": list(perm)},
                               inputs=[tensor], outputs=[out]))
    return out


def _rewrite(graph: gs.Graph, match: _SkipGroupNormMatch, names: Namer) -> None:
    norm, base = match.norm, match.norm.name
    x_nhwc = _transpose(graph, names, match.x, _TO_NHWC, f"{base}_x_nhwc")
    skip_nhwc = _transpose(graph, names, match.skip, _TO_NHWC, f"{base}_skip_nhwc")
    inputs: list[gs.Tensor] = [x_nhwc, norm.inputs[1], norm.inputs[2], skip_nhwc]
    if match.conv is not None:
        bias = np.asarray(const_value(match.conv.inputs[2])).reshape(match.channels)
        inputs.append(gs.Constant(names(f"{base}_skip_bias"), bias))
        match.conv.inputs.pop()  # Conv(X, W): its bias is added inside SkipGroupNorm now
    y = norm.outputs[0]
    norm.outputs.clear()
    outputs: list[gs.Tensor] = [y]
    total = match.add.outputs[0]
    others = [n for n in total.outputs if n is not match.to_nhwc]
    if others:
        sum_nhwc = gs.Variable(names(f"{base}_sum_nhwc"), dtype=total.dtype,
                               shape=None if total.shape is None else [total.shape[p] for p in _TO_NHWC])
        outputs.append(sum_nhwc)
        sum_nchw = _transpose(graph, names, sum_nhwc, _TO_NCHW, f"{total.name}_nchw")
        redirect_readers(total, sum_nchw, others)
    graph.nodes.append(gs.Node(op="SkipGroupNorm", domain="com.microsoft", name=names(f"{base}_SkipGroupNorm"),
                               attrs=dict(norm.attrs), inputs=inputs, outputs=outputs))
    match.add.outputs.clear()
    match.to_nhwc.outputs.clear()

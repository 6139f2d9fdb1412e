"""Rewrite an unfused GroupNorm into per-channel statistics: deterministic, and without an [N, G, -1] view."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from onnx import TensorProto

from ._match import fuse_each
from ._opset import graph_opset
from ._patterns import ORT_CUDA, Namer, escape_problem, replace_output, target_of
from .base import PassContext, PassResult, option
from .fuse_group_norm import GroupNormMatch, match_group_norm

logger = logging.getLogger(__name__)

NAME = "group_norm_channel_stats"

#: Opset from which ReduceMean / ReduceSumSquare / ReduceSum take ``axes`` as an input instead of an attribute.
_AXES_INPUT_OPSET = 18


@dataclass(frozen=True)
class GroupNormChannelStatsOptions:
    """The options of :func:`group_norm_channel_stats`."""

    #: ort-cuda: rewrite each unfused GroupNorm (what ``compile --deterministic`` leaves) into this form.
    enabled: bool = option("group_norm_channel_stats", False, bool)


def group_norm_channel_stats(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Rewrite the InstanceNormalization form of GroupNorm into per-channel fp32 statistics (ort-cuda, opt-in).

    Matches:  what fuse_group_norm matches and leaves (``--deterministic``): x -> Reshape([0|N, G, -1]) ->
              InstanceNormalization -> Reshape(Shape(x)) -> Mul(gamma) -> Add(beta), in fp16 or fp32.
    Emits:    x32 = Cast(x, float32) (fp16 graphs); per channel over the spatial axes, keepdims:
              m = ReduceMean(x32), q = ReduceSumSquare(x32) ([N, C, 1, 1]; a spatial dim not static:
              ReduceMean(x32 * x32)); per group on [N, G, C/G] (tiny tensors): mean = ReduceMean(m),
              msq = ReduceMean(q) / HW, rstd = (msq - mean^2 + eps) ^ -0.5; scale = rstd * gamma,
              shift = beta - mean * scale, back to [N, C, 1, 1] and x's dtype; then ``x * scale + shift``
              (the SiLU after it, if any, stays as it is).
    Why:      ``compile --deterministic`` cannot use ORT's fused GroupNorm (its partial sums meet in atomicAdd);
              the InstanceNormalization form it keeps needs the activation viewed as [N, G, -1], which the CUDA
              provider's NHWC layout can only give through a Transpose on each side. Reductions over the spatial
              axes and per-channel broadcasts are layout-free: ORT's layout transformer moves them to NHWC. The
              variance is E[x^2] - E[x]^2 in fp32, as ORT's fused kernel computes it (group_norm_impl.cu,
              ``groupNormNHWCScaleKernel``); ORT's Reduce kernels take their deterministic path under
              ``use_deterministic_compute`` (reduction_ops.cc), which the runtime's deterministic mode sets.
    Requires: run last (after convert_fp16, so the statistics stay fp32 and the Casts are explicit); x of rank >= 3
              with C known.

    Options (``ctx.options`` keys, read as :class:`GroupNormChannelStatsOptions`):
        group_norm_channel_stats (bool): rewrite (default False: the InstanceNormalization form stays).

    Counts: ``rewritten``, ``rejected`` (reasons at DEBUG), ``skipped_for_target`` (not ort-cuda, or the option
        off).
    """
    target = target_of(ctx.backend, ctx.device)
    enabled = ctx.options_for(GroupNormChannelStatsOptions).enabled and target == ORT_CUDA
    names = Namer(graph)
    axes_as_input = graph_opset(graph) >= _AXES_INPUT_OPSET

    def check(match: GroupNormMatch) -> str | None:
        if match.x.shape is None or len(match.x.shape) < 3:
            return "the rank of x is unknown or < 3"
        return escape_problem(graph, match.internal, match.nodes)

    def rewrite(match: GroupNormMatch) -> dict[str, int] | None:
        if not enabled:
            return None
        _emit(graph, match, names, axes_as_input)
        return {"rewritten": 1}

    tally = fuse_each(graph, NAME, match=match_group_norm, check=check, rewrite=rewrite)
    return PassResult.of(tally, "rewritten")


class _Emitter:
    """Appends nodes to ``graph`` under names derived from ``base``; each call returns the new node's output."""

    def __init__(self, graph: gs.Graph, names: Namer, base: str, axes_as_input: bool) -> None:
        self.graph, self.names, self.base, self.axes_as_input = graph, names, base, axes_as_input

    def const(self, tag: str, value: np.ndarray) -> gs.Constant:
        return gs.Constant(self.names(f"{self.base}_{tag}"), np.asarray(value))

    def op(self, op: str, tag: str, inputs: list[gs.Tensor], dtype: type, attrs: dict | None = None) -> gs.Variable:
        out = gs.Variable(self.names(f"{self.base}_{tag}"), dtype=dtype)
        self.graph.nodes.append(gs.Node(op=op, name=self.names(f"{self.base}_{tag}_{op}"), attrs=attrs or {},
                                        inputs=inputs, outputs=[out]))
        return out

    def reduce(self, op: str, tag: str, x: gs.Tensor, axes: list[int]) -> gs.Variable:
        if self.axes_as_input:
            return self.op(op, tag, [x, self.const(f"{tag}_axes", np.array(axes, np.int64))], np.float32,
                           {"keepdims": 1})
        return self.op(op, tag, [x], np.float32, {"axes": axes, "keepdims": 1})


def _emit(graph: gs.Graph, m: GroupNormMatch, names: Namer, axes_as_input: bool) -> None:
    x, c, g = m.x, m.channels, m.groups
    e = _Emitter(graph, names, m.affine_last.name or "group_norm", axes_as_input)
    dtype = np.dtype(x.dtype) if x.dtype is not None else np.dtype(np.float32)
    spatial = list(range(2, len(x.shape)))
    known = [d for d in x.shape[2:] if isinstance(d, int)]
    x32 = x if dtype == np.float32 else e.op("Cast", "x32", [x], np.float32, {"to": TensorProto.FLOAT})
    mean_c = e.reduce("ReduceMean", "mean_c", x32, spatial)
    if len(known) == len(spatial):  # E[x^2] from one reduction, its 1/HW folded into the group mean below
        sq_c, inv_hw = e.reduce("ReduceSumSquare", "sumsq_c", x32, spatial), 1.0 / float(np.prod(known))
    else:
        sq_c, inv_hw = e.reduce("ReduceMean", "meansq_c", e.op("Mul", "sq", [x32, x32], np.float32), spatial), 1.0
    grouped = e.const("grouped", np.array([0, g, c // g], np.int64))
    mean = e.reduce("ReduceMean", "mean", e.op("Reshape", "mean_cg", [mean_c, grouped], np.float32), [2])
    msq = e.reduce("ReduceMean", "msq_sum", e.op("Reshape", "sq_cg", [sq_c, grouped], np.float32), [2])
    if inv_hw != 1.0:
        msq = e.op("Mul", "msq", [msq, e.const("inv_hw", np.array(inv_hw, np.float32))], np.float32)
    var = e.op("Sub", "var", [msq, e.op("Mul", "mean2", [mean, mean], np.float32)], np.float32)
    rstd = e.op("Pow", "rstd", [e.op("Add", "var_eps", [var, e.const("eps", np.array(m.epsilon, np.float32))],
                                      np.float32), e.const("minus_half", np.array(-0.5, np.float32))], np.float32)
    gamma = e.const("gamma", m.gamma.reshape(1, g, c // g).astype(np.float32))
    beta = e.const("beta", m.beta.reshape(1, g, c // g).astype(np.float32))
    scale = e.op("Mul", "scale_g", [rstd, gamma], np.float32)
    shift = e.op("Sub", "shift_g", [beta, e.op("Mul", "mean_scale", [mean, scale], np.float32)], np.float32)
    per_channel = e.const("per_channel", np.array([0, c] + [1] * len(spatial), np.int64))
    scale, shift = (e.op("Reshape", f"{t.name}_c", [t, per_channel], np.float32) for t in (scale, shift))
    if dtype != np.float32:
        to = {"to": TensorProto.FLOAT16}
        scale, shift = (e.op("Cast", f"{t.name}_x", [t], dtype.type, to) for t in (scale, shift))
    scaled = e.op("Mul", "scaled", [x, scale], dtype.type)
    replace_output(graph, m.affine_last, gs.Node(op="Add", name=names(f"{e.base}_shifted_Add"),
                                                 inputs=[scaled, shift]))

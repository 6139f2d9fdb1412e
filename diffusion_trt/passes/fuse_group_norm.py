"""Fuse the GroupNorm that torch.nn.GroupNorm exports (and an optional SiLU after it) into the target's op."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ._match import const_value, fuse_each, in_onnx_domain, is_const
from ._opset import opset_problem
from ._patterns import (
    ORT_CPU,
    ORT_CUDA,
    TENSORRT,
    Namer,
    consumer,
    escape_problem,
    int_values,
    other_input,
    per_channel,
    producer,
    reader,
    replace_output,
    static_shape,
    target_of,
)
from .base import PassContext, PassResult, option

logger = logging.getLogger(__name__)

NAME = "fuse_group_norm"

#: Default-domain opset whose GroupNormalization has per-channel scale / bias ([C]; opset 18's is per group).
GROUP_NORMALIZATION_OPSET = 21

#: ORT's NHWC GroupNorm CUDA kernel handles at most this many channels per group (contrib_ops/cuda/diffusion,
#: ``kMaxSize`` of group_norm_common_base.h) and only an even number (``CHANNELS_PER_THREAD`` = 2).
ORT_GROUP_NORM_MAX_CHANNELS_PER_GROUP = 512


@dataclass(frozen=True)
class FuseGroupNormOptions:
    """The options of :func:`fuse_group_norm`."""

    #: tensorrt: raise the opset to 21 where safe; False keeps the graph's opset (sites below 21 are rejected).
    raise_opset: bool = option("fuse_group_norm_raise_opset", True, bool)
    #: ort-cuda: leave every site unfused (``compile --deterministic``): ORT's GroupNorm kernel adds per-block partial
    #: sums with atomicAdd in whatever order the blocks finish (measured: its output differs run to run by up to
    #: 0.0039 on an H200, ``benchmarks/results/h200-2026-12-01-s4-determinism.json``).
    deterministic: bool = option("fuse_group_norm_deterministic", False, bool)


@dataclass
class _GroupNormMatch:
    x: gs.Tensor
    groups: int
    channels: int
    epsilon: float
    gamma: np.ndarray  # [C], the IN scale folded in
    beta: np.ndarray  # [C], the IN bias folded in
    norm: gs.Node  # the InstanceNormalization
    affine_last: gs.Node  # the Add(beta)
    silu_last: gs.Node | None  # the Mul(a, Sigmoid(a)) when a SiLU follows
    nodes: list[gs.Node]
    internal: list[gs.Tensor]
    silu_nodes: list[gs.Node]


def fuse_group_norm(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse the GroupNorm that torch.nn.GroupNorm exports, with the SiLU after it where the target takes one.

    Matches:  x -> Reshape([0|N, G, -1]) -> InstanceNormalization(s[G], b[G], eps) -> Reshape(Shape(x))
                -> Mul(gamma[C,1,1]) -> Add(beta[C,1,1])  [-> a * Sigmoid(a)]
    Emits:    ort-cuda:  Transpose(NHWC) -> com.microsoft.GroupNorm(gamma[C], beta[C] fp32, groups=G, epsilon,
                         activation=1 with the SiLU, channels_last=1) -> Transpose(NCHW)
              tensorrt:  GroupNormalization(x, gamma[C], beta[C], num_groups=G, epsilon) at opset 21 (the SiLU
                         stays: TensorRT fuses the pointwise tail itself)
              ort-cpu:   nothing: ORT CPU has no GroupNormalization kernel (it expands the function into more
                         nodes than the InstanceNormalization form); counted as ``skipped_for_target``.
              ort-cuda with ``fuse_group_norm_deterministic``: nothing either (``skipped_for_target``): the
                         InstanceNormalization form stays, and with it no GroupNorm for fuse_skip_group_norm.
    Why:      one kernel instead of five to seven (SD-1.5 UNet: 61 sites, 45 with SiLU; VAE decoder: 30).
    Requires: x's rank known (run infer_shapes); IN scale/bias constant [G] (folded into gamma/beta); gamma and
              beta constant, per channel ((C,1,1) or (1,C,1,1)). ort-cuda: rank 4, C/G even and <= 512 (the
              kernel's limits). tensorrt: the graph's opset is raised to 21 when no node changes meaning by it
              (see _opset.py), else the site is rejected with the reason; ``ctx.opset`` is not updated: later
              passes read ``graph.opset``.

    Options (``ctx.options`` keys, read as :class:`FuseGroupNormOptions`):
        fuse_group_norm_raise_opset (bool): tensorrt: raise the opset to 21 where safe (default True); False
            keeps the graph's opset (sites below 21 are rejected), e.g. for a TensorRT whose parser stops at 20.
        fuse_group_norm_deterministic (bool): ort-cuda: fuse nothing (default False); set by
            ``CompileConfig.deterministic``. ORT's GroupNorm kernel is not run-to-run deterministic.

    Counts: ``GroupNorm`` (ort-cuda) or ``GroupNormalization`` (tensorrt) sites fused, ``with_silu`` (of those,
    SiLU included), ``Transpose`` (inserted, ort-cuda; a later pass may cancel adjacent pairs), ``rejected``
    (reasons at DEBUG), ``skipped_for_target`` (matched but left: ort-cpu).
    """
    target = target_of(ctx.backend, ctx.device)
    op = {ORT_CUDA: "GroupNorm", TENSORRT: "GroupNormalization", ORT_CPU: "GroupNormalization"}[target]
    names = Namer(graph)
    options = ctx.options_for(FuseGroupNormOptions)
    may_raise = options.raise_opset
    leave = {ORT_CPU: "ort-cpu (no faster standard form)"}
    if options.deterministic:
        leave[ORT_CUDA] = "ort-cuda in deterministic mode (ORT's GroupNorm kernel sums with atomicAdd)"
    # tensorrt: why opset 21 cannot be had; asked once, at the first site that passes its check
    opset_problem_once = functools.cache(lambda: opset_problem(graph, GROUP_NORMALIZATION_OPSET, may_raise=may_raise))

    def check(match: _GroupNormMatch) -> str | None:
        problem = _check(graph, match, target)
        if problem is None and target == TENSORRT and (why := opset_problem_once()) is not None:
            return f"GroupNormalization with per-channel scale needs opset {GROUP_NORMALIZATION_OPSET}; {why}"
        return problem

    def rewrite(match: _GroupNormMatch) -> dict[str, int] | None:
        if target in leave:
            logger.debug("%s: left GroupNorm at %r for %s", NAME, match.norm.name, leave[target])
            return None
        if target == ORT_CUDA:
            return {op: 1, "with_silu": _rewrite_ort_cuda(graph, match, names), "Transpose": 2}
        _rewrite_group_normalization(graph, match, names)
        return {op: 1}

    tally = fuse_each(graph, NAME, match=_candidate, check=check, rewrite=rewrite)
    return PassResult.of(tally, op, "with_silu", *(("Transpose",) if target == ORT_CUDA else ()))


def _candidate(node: gs.Node) -> _GroupNormMatch | str | None:
    if node.op != "InstanceNormalization" or not in_onnx_domain(node) or not node.outputs:
        return None
    return _match(node)


def _affine(node: gs.Node | None, tensor: gs.Tensor, op: str) -> tuple[gs.Node, gs.Tensor] | None:
    if node is None or node.op != op:
        return None
    other = other_input(node, tensor)
    return (node, other) if other is not None else None


def _match(norm: gs.Node) -> _GroupNormMatch | str:
    reshape_in = producer(norm.inputs[0], "Reshape")
    if reshape_in is None:
        return "the InstanceNormalization input is not a Reshape"
    x = reshape_in.inputs[0]
    target = int_values(reshape_in.inputs[1])
    if target is None or len(target) != 3:
        return f"the Reshape before it has no constant 3-element target (got {target}); run fold_constants"
    if len(norm.inputs) < 3 or not is_const(norm.inputs[1]) or not is_const(norm.inputs[2]):
        return "the InstanceNormalization scale / bias are not constants"
    scale, bias = const_value(norm.inputs[1]), const_value(norm.inputs[2])
    groups = target[1]
    if scale is None or bias is None or scale.size != groups or bias.size != groups:
        return f"InstanceNormalization scale / bias do not have G={groups} elements"
    reshape_out = reader(norm.outputs[0], "Reshape")
    if reshape_out is None:
        return "the InstanceNormalization output is not read by a Reshape"
    if not _is_shape_of(reshape_out.inputs[1], x):
        return "the Reshape after it does not restore shape(x)"
    mul = _affine(reader(reshape_out.outputs[0], "Mul"), reshape_out.outputs[0], "Mul")
    if mul is None:
        return "the normalized tensor is not read by a Mul(gamma)"
    add = _affine(reader(mul[0].outputs[0], "Add"), mul[0].outputs[0], "Add")
    if add is None:
        return "the scaled tensor is not read by an Add(beta)"
    (mul_node, gamma_t), (add_node, beta_t) = mul, add
    if not is_const(gamma_t):
        return f"gamma {gamma_t.name!r} is not a constant"
    if not is_const(beta_t):
        return f"beta {beta_t.name!r} is not a constant"
    gamma, beta = const_value(gamma_t), const_value(beta_t)
    if gamma is None or beta is None:
        return "gamma / beta cannot be read"
    r = None if x.shape is None else len(x.shape)
    if r is None or r < 3:
        return f"the rank of x {x.name!r} is unknown or < 3; run infer_shapes first"
    channels = x.shape[1] if isinstance(x.shape[1], int) else gamma.size
    if not per_channel(gamma, channels, r) or not per_channel(beta, channels, r):
        return (f"gamma {tuple(gamma.shape)} / beta {tuple(beta.shape)} are not per channel "
                f"(C={channels}, shape (C{', 1' * (r - 2)}))")
    if channels % groups != 0:
        return f"C={channels} is not a multiple of G={groups}"
    if not _reshape_target_ok(target, x, groups, channels):
        return f"the Reshape target {target} is not (N or 0, G, -1) for x {x.shape}"
    if reshape_in.attrs.get("allowzero", 0) != 0 and 0 in target:
        return "Reshape allowzero=1 with a 0 in the target"
    per_group = channels // groups
    gamma_c = gamma.reshape(channels).astype(np.float32)
    beta_c = beta.reshape(channels).astype(np.float32)
    scale_c = np.repeat(scale.reshape(groups).astype(np.float32), per_group)
    bias_c = np.repeat(bias.reshape(groups).astype(np.float32), per_group)
    nodes = [reshape_in, norm, reshape_out, mul_node, add_node]
    internal = [reshape_in.outputs[0], norm.outputs[0], reshape_out.outputs[0], mul_node.outputs[0]]
    silu_last, silu_nodes = _match_silu(add_node.outputs[0])
    return _GroupNormMatch(
        x=x, groups=groups, channels=channels, epsilon=float(norm.attrs.get("epsilon", 1e-5)), norm=norm,
        gamma=scale_c * gamma_c, beta=bias_c * gamma_c + beta_c, affine_last=add_node, silu_last=silu_last,
        nodes=nodes, internal=internal, silu_nodes=silu_nodes,
    )


def _is_shape_of(shape: gs.Tensor, x: gs.Tensor) -> bool:
    """Whether ``shape`` is Shape(x) (whole shape) or a constant equal to x's static shape."""
    node = producer(shape, "Shape")
    if node is not None:
        return node.inputs[0] is x and node.attrs.get("start", 0) == 0 and node.attrs.get("end") is None
    values, known = int_values(shape), static_shape(x)
    return values is not None and known is not None and values == known


def _reshape_target_ok(target: list[int], x: gs.Tensor, groups: int, channels: int) -> bool:
    batch, rest = target[0], target[2]
    if target[1] != groups:
        return False
    n = x.shape[0]
    if batch != 0 and not (isinstance(n, int) and batch == n):
        return False
    if rest == -1:
        return True
    spatial = x.shape[2:]
    return all(isinstance(d, int) for d in spatial) and rest == channels // groups * int(np.prod(spatial))


def _match_silu(a: gs.Tensor) -> tuple[gs.Node | None, list[gs.Node]]:
    """The Mul of ``a * Sigmoid(a)`` when ``a`` is read by exactly that Sigmoid and that Mul."""
    readers = {id(n): n for n in a.outputs}
    if len(readers) != 2:
        return None, []
    sigmoid = next((n for n in readers.values() if n.op == "Sigmoid" and in_onnx_domain(n)), None)
    mul = next((n for n in readers.values() if n.op == "Mul" and in_onnx_domain(n)), None)
    if sigmoid is None or mul is None or other_input(mul, a) is not sigmoid.outputs[0]:
        return None, []
    if consumer(sigmoid.outputs[0], "Mul") is not mul:
        return None, []
    return mul, [sigmoid, mul]


def _check(graph: gs.Graph, match: _GroupNormMatch, target: str) -> str | None:
    if match.epsilon < 0:
        return f"epsilon {match.epsilon} is negative"
    if target == ORT_CUDA:
        if len(match.x.shape) != 4:
            return f"ORT's GroupNorm takes 4-D NHWC input; x has rank {len(match.x.shape)}"
        per_group = match.channels // match.groups
        if per_group % 2 != 0 or per_group > ORT_GROUP_NORM_MAX_CHANNELS_PER_GROUP:
            return (f"ORT's CUDA GroupNorm kernel needs an even number of channels per group <= "
                    f"{ORT_GROUP_NORM_MAX_CHANNELS_PER_GROUP}; C={match.channels}, G={match.groups} gives {per_group}")
    return escape_problem(graph, match.internal, match.nodes)


def _rewrite_ort_cuda(graph: gs.Graph, match: _GroupNormMatch, names: Namer) -> int:
    """NCHW -> Transpose -> GroupNorm (NHWC) -> Transpose -> NCHW; returns 1 if the SiLU went in."""
    x, base = match.x, match.affine_last.name
    silu = match.silu_last is not None and escape_problem(
        graph, [match.affine_last.outputs[0], match.silu_nodes[0].outputs[0]], match.silu_nodes) is None
    last = match.silu_last if silu and match.silu_last is not None else match.affine_last
    nhwc_shape = None if x.shape is None else [x.shape[0], *x.shape[2:], x.shape[1]]
    nhwc = gs.Variable(names(f"{base}_nhwc"), dtype=x.dtype, shape=nhwc_shape)
    graph.nodes.append(gs.Node(op="Transpose", name=names(f"{base}_to_nhwc"), attrs={"perm": [0, 2, 3, 1]},
                               inputs=[x], outputs=[nhwc]))
    normed = gs.Variable(names(f"{base}_gn_nhwc"), dtype=x.dtype, shape=nhwc_shape)
    graph.nodes.append(gs.Node(
        op="GroupNorm", domain="com.microsoft", name=names(f"{base}_GroupNorm"),
        attrs={"epsilon": match.epsilon, "groups": match.groups, "activation": int(silu), "channels_last": 1},
        inputs=[
            nhwc,
            gs.Constant(names(f"{base}_gn_gamma"), match.gamma.astype(np.float32)),
            gs.Constant(names(f"{base}_gn_beta"), match.beta.astype(np.float32)),
        ],
        outputs=[normed],
    ))
    back = gs.Node(op="Transpose", name=names(f"{base}_to_nchw"), attrs={"perm": [0, 3, 1, 2]},
                   inputs=[normed])
    replace_output(graph, last, back)
    return int(silu)


def _rewrite_group_normalization(graph: gs.Graph, match: _GroupNormMatch, names: Namer) -> None:
    base = match.affine_last.name
    dtype = match.x.dtype if match.x.dtype is not None else np.float32
    node = gs.Node(
        op="GroupNormalization", name=names(f"{base}_GroupNormalization"),
        attrs={"num_groups": match.groups, "epsilon": match.epsilon},
        inputs=[match.x, gs.Constant(names(f"{base}_gn_scale"), match.gamma.astype(dtype)),
                gs.Constant(names(f"{base}_gn_bias"), match.beta.astype(dtype))],
    )
    replace_output(graph, match.affine_last, node)

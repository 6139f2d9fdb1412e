"""Fuse the decomposed LayerNorm that older exporters (and opset < 17) write into one LayerNormalization."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ._match import const_value, fuse_each, in_onnx_domain, is_const
from ._opset import graph_opset
from ._patterns import (
    Namer,
    consumer,
    escape_problem,
    int_values,
    is_scalar,
    other_input,
    rank,
    replace_output,
    scalar,
)
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "fuse_layer_norm"


@dataclass
class _LayerNormMatch:
    x: gs.Tensor
    epsilon: float
    gamma: gs.Tensor | None  # constant, or None: no scale Mul (elementwise_affine=False)
    beta: gs.Tensor | None
    last: gs.Node
    nodes: list[gs.Node]
    internal: list[gs.Tensor]


def fuse_layer_norm(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse ``(x - mean) / sqrt(var + eps) * gamma + beta`` over the last axis into one LayerNormalization.

    Matches:  x -> ReduceMean(-1) -> Sub(x, .) -> Pow(2) -> ReduceMean(-1) -> Add(eps) -> Sqrt
                                       |                                                  |
                                       +-------------------> Div(., sqrt) <---------------+
                                                              -> Mul(gamma) -> Add(beta)      (Mul/Add optional)
              ReduceMean with an ``axes`` attribute (opset < 18) or input (18+); Pow(d, 2) or Mul(d, d);
              the normalization as Div(d, Sqrt(v)) (torch < 1.x, paddle2onnx: PP-OCRv4), Div(d, Pow(v, 0.5)),
              Mul(d, Reciprocal(Sqrt(v))) or Mul(d, Pow(v, -0.5)) (rsqrt exporters).
    Emits:    LayerNormalization(x, gamma, beta, axis=-1, epsilon=eps)   (gamma = ones, beta absent without them)
    Why:      one kernel instead of nine, on every target; TensorRT maps it to its normalization layer.
    Requires: epsilon a one-element constant; gamma / beta constants of D elements ([D] or [1, .., D]); the last
              dim D known (from x's shape or gamma). torch >= 2.x at opset >= 17 already exports
              LayerNormalization: on those graphs this pass counts 0 and changes nothing.

    Counts: ``LayerNormalization`` (fused), ``rejected`` (candidate ReduceMeans turned down; reasons at DEBUG).
    """
    del ctx  # one emitter for every target: LayerNormalization is standard from opset 17 (MIN_OPSET)
    names = Namer(graph)
    opset = graph_opset(graph)

    def rewrite(match: _LayerNormMatch) -> str:
        _rewrite(graph, match, names)
        return "LayerNormalization"

    tally = fuse_each(graph, NAME, match=_candidate, check=lambda match: _check(graph, match, opset), rewrite=rewrite)
    return PassResult.of(tally, "LayerNormalization", skipped=False)


def _candidate(node: gs.Node) -> _LayerNormMatch | str | None:
    """The match at the first ReduceMean of a LayerNorm (the one read by Sub), a reason, or None."""
    if node.op != "ReduceMean" or not in_onnx_domain(node) or not node.outputs:
        return None
    if consumer(node.outputs[0], "Sub") is None:
        return None  # not the first ReduceMean of a LayerNorm (the second one feeds Add(eps))
    return _match(node)


def _last_axis_mean(node: gs.Node, tensor: gs.Tensor) -> bool:
    """Whether ``node`` is ReduceMean(tensor) over the last axis only, keeping dims."""
    if node.op != "ReduceMean" or node.inputs[0] is not tensor or node.attrs.get("keepdims", 1) != 1:
        return False
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:
        axes = int_values(node.inputs[1])
    if axes is None or len(axes) != 1:
        return False
    r = rank(tensor)
    return axes[0] == -1 or (r is not None and axes[0] == r - 1)


def _match(mean: gs.Node) -> _LayerNormMatch | str:
    x = mean.inputs[0]
    if not _last_axis_mean(mean, x):
        return "ReduceMean is not over the last axis only (keepdims=1)"
    sub = consumer(mean.outputs[0], "Sub")
    if sub is None or sub.inputs[0] is not x or sub.inputs[1] is not mean.outputs[0]:
        return "the mean is not subtracted from the same x"
    d = sub.outputs[0]
    readers = {id(n): n for n in d.outputs}
    square = next((n for n in readers.values()
                   if (n.op == "Pow" and n.inputs[0] is d and is_scalar(n.inputs[1], 2.0))
                   or (n.op == "Mul" and n.inputs[0] is d and n.inputs[1] is d)), None)
    if square is None:
        return "x - mean is not squared (Pow 2 / Mul(d, d))"
    var = consumer(square.outputs[0], "ReduceMean")
    if var is None or not _last_axis_mean(var, square.outputs[0]):
        return "the squared deviation is not averaged over the last axis"
    add_eps = consumer(var.outputs[0], "Add")
    eps_tensor = other_input(add_eps, var.outputs[0]) if add_eps is not None else None
    if eps_tensor is None or not is_const(eps_tensor):
        return "the variance is not increased by a constant epsilon"
    epsilon = scalar(eps_tensor)
    if epsilon is None:
        return f"epsilon {eps_tensor.name!r} is not a one-element constant (shape {eps_tensor.shape})"
    norm = _normalizer(d, add_eps.outputs[0], [n for n in readers.values() if n is not square])
    if isinstance(norm, str):
        return norm
    div = norm[-1]
    nodes = [mean, sub, square, var, add_eps, *norm]
    internal = [n.outputs[0] for n in nodes[:-1]]
    last, gamma, beta = div, None, None
    mul = consumer(div.outputs[0], "Mul")
    if mul is not None and (factor := other_input(mul, div.outputs[0])) is not None and is_const(factor):
        gamma, last = factor, mul
        internal.append(div.outputs[0])
        nodes.append(mul)
        add = consumer(mul.outputs[0], "Add")
        if add is not None and (shift := other_input(add, mul.outputs[0])) is not None and is_const(shift):
            beta, last = shift, add
            internal.append(mul.outputs[0])
            nodes.append(add)
    return _LayerNormMatch(x, epsilon, gamma, beta, last, nodes, internal)


def _normalizer(d: gs.Tensor, var_eps: gs.Tensor, others: list[gs.Node]) -> list[gs.Node] | str:
    """The nodes from ``var + eps`` to ``d / sqrt(var + eps)``, in the forms exporters write:
    ``Div(d, Sqrt(v))``, ``Div(d, Pow(v, 0.5))``, ``Mul(d, Reciprocal(Sqrt(v)))``, ``Mul(d, Pow(v, -0.5))``."""
    root = consumer(var_eps, "Sqrt", "Pow")
    if root is None:
        return "var + eps is not read by one Sqrt / Pow"
    exponent = 0.5 if root.op == "Sqrt" else scalar(root.inputs[1])
    if exponent not in (0.5, -0.5) or (root.op == "Pow" and root.inputs[0] is not var_eps):
        return f"var + eps is raised to {exponent}, not 0.5 / -0.5"
    chain = [root]
    if exponent == 0.5:
        div = next((n for n in others if n.op == "Div" and n.inputs[0] is d and n.inputs[1] is root.outputs[0]), None)
        if div is not None:
            return [*chain, div]
        recip = consumer(root.outputs[0], "Reciprocal")
        if recip is None:
            return "the deviation is not divided by sqrt(var + eps) (Div, or Mul by its Reciprocal)"
        chain.append(recip)
    inverse = chain[-1].outputs[0]
    mul = next((n for n in others if n.op == "Mul" and other_input(n, d) is inverse), None)
    if mul is None:
        return "the deviation is not multiplied by 1 / sqrt(var + eps)"
    return [*chain, mul]


def _last_dim(match: _LayerNormMatch) -> int | None:
    shape = match.x.shape
    if shape and isinstance(shape[-1], int) and shape[-1] > 0:
        return int(shape[-1])
    if match.gamma is not None:
        return int(np.prod(match.gamma.shape or const_value(match.gamma).shape))
    return None


def _vector_problem(tensor: gs.Tensor, dim: int, what: str) -> str | None:
    value = const_value(tensor)
    if value is None or value.size != dim or any(d != 1 for d in value.shape[:-1]):
        shape = None if value is None else tuple(value.shape)
        return f"{what} {tensor.name!r} has shape {shape}, expected ({dim},) over the last axis"
    return None


def _check(graph: gs.Graph, match: _LayerNormMatch, opset: int) -> str | None:
    if opset < 17:
        return f"LayerNormalization needs opset 17; the graph has {opset}"
    dim = _last_dim(match)
    if dim is None:
        return "the last dim of x is unknown and there is no gamma to read it from; run infer_shapes first"
    if match.gamma is not None and (problem := _vector_problem(match.gamma, dim, "gamma")) is not None:
        return problem
    if match.beta is not None and (problem := _vector_problem(match.beta, dim, "beta")) is not None:
        return problem
    if match.epsilon <= 0:
        return f"epsilon {match.epsilon} is not positive"
    return escape_problem(graph, match.internal, match.nodes)


def _rewrite(graph: gs.Graph, match: _LayerNormMatch, names: Namer) -> None:
    dim = _last_dim(match)
    assert dim is not None  # _check
    dtype = match.x.dtype if match.x.dtype is not None else np.float32
    if match.gamma is not None:
        gamma_value = np.asarray(const_value(match.gamma)).reshape(dim)
    else:
        gamma_value = np.ones(dim, dtype=dtype)
    inputs = [match.x, gs.Constant(names(f"{match.last.name}_ln_scale"), gamma_value)]
    if match.beta is not None:
        beta_value = np.asarray(const_value(match.beta)).reshape(dim)
        inputs.append(gs.Constant(names(f"{match.last.name}_ln_bias"), beta_value))
    node = gs.Node(op="LayerNormalization", name=names(f"{match.last.name}_LayerNormalization"),
                   attrs={"axis": -1, "epsilon": float(match.epsilon)}, inputs=inputs)
    replace_output(graph, match.last, node)

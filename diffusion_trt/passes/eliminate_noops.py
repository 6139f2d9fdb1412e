"""Remove arithmetic that leaves its input unchanged: ``x / 1``, ``x * 1``, ``x + 0``, ``x - 0``."""

from __future__ import annotations

import logging

import numpy as np
import onnx_graphsurgeon as gs

from ._match import const_value, fuse_each, in_onnx_domain, is_const, is_graph_output
from ._patterns import rank, redirect_readers
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "eliminate_noops"

#: op -> (the constant that makes it a no-op, whether the constant may be the first input).
_NEUTRAL: dict[str, tuple[float, bool]] = {
    "Div": (1.0, False),
    "Mul": (1.0, True),
    "Add": (0.0, True),
    "Sub": (0.0, False),
}


def eliminate_noops(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Bypass ``Div(x, 1)``, ``Mul(x, 1)``, ``Add(x, 0)``, ``Sub(x, 0)``: readers of the result read ``x``.

    Matches:  Div(x, c) / Sub(x, c), and Mul / Add with c on either side, c a one-element constant equal to the
              neutral value (1 for Div/Mul, 0 for Add/Sub).
    Emits:    nothing: the node's readers are rewired to ``x``; the PassManager's cleanup drops the node.
    Why:      diffusers writes them on every block (``hidden / output_scale_factor`` with factor 1.0 in each
              ResnetBlock2D, ``hidden / rescale_output_factor`` in each Attention): the SD-1.5 UNet has 54
              ``Div(x, 1)``. They cost a kernel each where no runtime removes them, and they sit between the
              nodes that fuse_skip_layer_norm / fuse_bias fuse (MatMul -> bias Add -> Div 1 -> residual Add).
    Requires: c's dtype the same as x's (when x's is known), c's rank <= x's rank (so broadcasting cannot change
              x's shape; x's rank must be known), the result not a graph output. A NaN or inf in x stays what
              it was: x * 1, x / 1, x + 0 and x - 0 are exact in IEEE 754 for every x (x + 0 turns -0 into +0,
              which no later op tells apart except Div by it; the exporter never divides by a residual sum).

    Counts: ``removed``, ``rejected`` (candidates with a neutral constant turned down; reasons at DEBUG).
    """
    del ctx  # the same on every target

    def rewrite(found: tuple[gs.Node, gs.Tensor]) -> str:
        node, x = found
        redirect_readers(node.outputs[0], x)
        node.outputs.clear()
        return "removed"

    tally = fuse_each(graph, NAME, match=_candidate, check=lambda found: _check(graph, *found), rewrite=rewrite)
    return PassResult.of(tally, "removed", skipped=False)


def _candidate(node: gs.Node) -> tuple[gs.Node, gs.Tensor] | None:
    """(node, x) when ``node`` combines x with its neutral constant, else None."""
    if node.op not in _NEUTRAL or not in_onnx_domain(node) or len(node.inputs) != 2 or len(node.outputs) != 1:
        return None
    neutral, either_side = _NEUTRAL[node.op]
    x = _operand(node, neutral, either_side)
    return None if x is None else (node, x)


def _is_neutral(tensor: gs.Tensor, neutral: float) -> bool:
    if not is_const(tensor):
        return False
    value = const_value(tensor)
    return value is not None and value.size == 1 and value.dtype.kind == "f" and float(value.reshape(-1)[0]) == neutral


def _operand(node: gs.Node, neutral: float, either_side: bool) -> gs.Tensor | None:
    """The input that passes through unchanged, or None when the node is not a no-op."""
    first, second = node.inputs
    if _is_neutral(second, neutral) and not is_const(first):
        return first
    if either_side and _is_neutral(first, neutral) and not is_const(second):
        return second
    return None


def _check(graph: gs.Graph, node: gs.Node, x: gs.Tensor) -> str | None:
    out = node.outputs[0]
    if is_graph_output(graph, out):
        return f"{out.name!r} is a graph output"
    c = node.inputs[1] if node.inputs[0] is x else node.inputs[0]
    value = const_value(c)
    assert value is not None  # _operand
    x_rank = rank(x)
    if x_rank is None:
        return f"the rank of {x.name!r} is unknown (broadcasting could change its shape); run infer_shapes first"
    if value.ndim > x_rank:
        return f"constant {c.name!r} has rank {value.ndim} > rank {x_rank} of {x.name!r}: the result is broadcast"
    if x.dtype is not None and np.dtype(x.dtype) != value.dtype:
        return f"constant {c.name!r} is {value.dtype}, {x.name!r} is {np.dtype(x.dtype)}"
    return None

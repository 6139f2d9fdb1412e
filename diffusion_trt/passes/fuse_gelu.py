"""Fuse the GELU forms torch exports (erf, tanh) and CLIP's quick_gelu into one node each."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from ._match import fuse_each, in_onnx_domain, is_const
from ._opset import graph_opset, opset_problem
from ._patterns import (
    ORT_CPU,
    ORT_CUDA,
    TENSORRT,
    GeluMatch,
    Namer,
    consumer,
    escape_problem,
    match_gelu_erf,
    match_gelu_tanh,
    other_input,
    producer,
    replace_output,
    scalar,
    target_of,
)
from .base import PassContext, PassResult, option

logger = logging.getLogger(__name__)

NAME = "fuse_gelu"

#: Default-domain opset that has Gelu (with ``approximate``).
GELU_OPSET = 20


@dataclass(frozen=True)
class FuseGeluOptions:
    """The options of :func:`fuse_gelu`."""

    #: tensorrt: raise the opset to 20 where safe; False keeps the graph's opset (sites below 20 are rejected).
    raise_opset: bool = option("fuse_gelu_raise_opset", True, bool)


def fuse_gelu(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse erf-GELU, tanh-GELU and quick_gelu into the target's GELU op.

    Matches:  erf:   x -> Div(sqrt 2) | Mul(1/sqrt 2) -> Erf -> Add(1) -> Mul(x) -> Mul(0.5)
                     (any operand order; 0.5 * x * (1 + erf) in any association)
              tanh:  x -> x^3 (Pow 3 | x*x*x) -> Mul(0.044715) -> Add(x) -> Mul(sqrt(2/pi)) -> Tanh -> Add(1)
                     -> Mul(x) -> Mul(0.5)
              quick: x -> Mul(alpha) -> Sigmoid -> Mul(x)          (CLIP's quick_gelu, alpha = 1.702)
    Emits:    tensorrt:  Gelu(approximate="none"|"tanh") at opset 20 (raised from the graph's opset where no
                         node changes meaning, see _opset.py; else rejected with the reason). quick_gelu: left,
                         counted as ``skipped_for_target`` (TensorRT fuses Mul/Sigmoid/Mul itself).
              ort-cpu:   Gelu(opset 20) where the graph has opset >= 20, else com.microsoft Gelu / FastGelu (tanh);
                         quick_gelu: com.microsoft QuickGelu(alpha).
              ort-cuda:  com.microsoft Gelu / FastGelu / QuickGelu(alpha) (the forms its CUDA fusions build on).
    Why:      one kernel instead of five to nine (SD-1.5: 16 erf-GELUs in the UNet's GEGLU, 12 quick_gelus in
              CLIP); run fuse_geglu first on ort-cuda, which takes the UNet's GELUs into BiasSplitGelu.
    Requires: the constants one-element constants (matched with rtol 1e-5); no tensor inside the pattern read
              from outside it. ``ctx.opset`` is not updated when the opset is raised: read ``graph.opset``.

    Options (``ctx.options`` keys, read as :class:`FuseGeluOptions`):
        fuse_gelu_raise_opset (bool): tensorrt: raise the opset to 20 where safe (default True); False keeps the
            graph's opset (sites below 20 are then rejected).

    Counts: ``Gelu``, ``FastGelu`` (ORT's tanh form), ``QuickGelu`` emitted; ``rejected`` (reasons at DEBUG);
    ``skipped_for_target`` (quick_gelu on tensorrt).
    """
    target = target_of(ctx.backend, ctx.device)
    names = Namer(graph)
    may_raise = ctx.options_for(FuseGeluOptions).raise_opset
    opset_problem_once = functools.cache(lambda: opset_problem(graph, GELU_OPSET, may_raise=may_raise))

    def check(match: GeluMatch | _QuickGelu) -> str | None:
        problem = escape_problem(graph, match.internal, match.nodes)
        if problem is None and target == TENSORRT and isinstance(match, GeluMatch):
            if (why := opset_problem_once()) is not None:
                return f"Gelu needs opset {GELU_OPSET}; {why}"
        return problem

    def rewrite(match: GeluMatch | _QuickGelu) -> str | None:
        if isinstance(match, GeluMatch):
            return _rewrite(graph, names, match, target)
        if target == TENSORRT:
            return None  # TensorRT fuses Mul/Sigmoid/Mul itself
        _emit(graph, names, match.nodes[-1], "QuickGelu", "com.microsoft", match.x, {"alpha": match.alpha})
        return "QuickGelu"

    tally = fuse_each(graph, NAME, match=_match, check=check, rewrite=rewrite)
    return PassResult.of(tally, "Gelu", "FastGelu", "QuickGelu")


@dataclass
class _QuickGelu:
    """CLIP's ``x * Sigmoid(alpha * x)``; ``nodes`` and ``internal`` are the pattern's nodes and tensors."""

    x: gs.Tensor
    alpha: float
    nodes: list[gs.Node]
    internal: list[gs.Tensor]


def _match(node: gs.Node) -> GeluMatch | _QuickGelu | str | None:
    if not in_onnx_domain(node) or not node.outputs or node.op not in ("Erf", "Tanh", "Sigmoid"):
        return None
    if node.op == "Sigmoid":
        return _match_quick_gelu(node)  # None for a plain Sigmoid / SiLU: not a candidate
    return match_gelu_erf(node) if node.op == "Erf" else match_gelu_tanh(node)


def _match_quick_gelu(sigmoid: gs.Node) -> _QuickGelu | str | None:
    """``x * Sigmoid(alpha * x)`` around ``sigmoid``; None when the Sigmoid's input is no Mul by a constant."""
    scale = producer(sigmoid.inputs[0], "Mul")
    if scale is None or len(scale.inputs) != 2:
        return None
    first, second = scale.inputs
    x, alpha_t = (first, second) if is_const(second) else (second, first)
    if not is_const(alpha_t) or is_const(x):
        return None
    alpha = scalar(alpha_t)
    if alpha is None:
        return f"alpha {alpha_t.name!r} is not a one-element constant"
    mul = consumer(sigmoid.outputs[0], "Mul")
    if mul is None or other_input(mul, sigmoid.outputs[0]) is not x:
        return "Sigmoid(alpha * x) is not read by exactly one Mul(x, .)"
    return _QuickGelu(x, alpha, [scale, sigmoid, mul], [scale.outputs[0], sigmoid.outputs[0]])


def _emit(graph: gs.Graph, names: Namer, last: gs.Node, op: str, domain: str | None, x: gs.Tensor,
          attrs: dict[str, object]) -> None:
    node = gs.Node(op=op, domain=domain, name=names(f"{last.name}_{op}"), attrs=attrs, inputs=[x])
    replace_output(graph, last, node)


def _rewrite(graph: gs.Graph, names: Namer, match: GeluMatch, target: str) -> str:
    """Emit the target's GELU for ``match``; returns the count key."""
    last = match.output.inputs[0]
    standard = target == TENSORRT or (target == ORT_CPU and graph_opset(graph) >= GELU_OPSET)
    if standard:
        attrs: dict[str, object] = {"approximate": "tanh"} if match.approximate == "tanh" else {}
        _emit(graph, names, last, "Gelu", None, match.x, attrs)
        return "Gelu"
    assert target in (ORT_CPU, ORT_CUDA)
    op = "FastGelu" if match.approximate == "tanh" else "Gelu"
    _emit(graph, names, last, op, "com.microsoft", match.x, {})
    return op

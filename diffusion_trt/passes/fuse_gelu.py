"""Fuse the GELU forms torch exports (erf, tanh) and CLIP's quick_gelu into one node each."""

from __future__ import annotations

import logging

import onnx_graphsurgeon as gs

from ._match import Rejection, in_onnx_domain, reject
from ._opset import ensure_opset, graph_opset
from ._patterns import (
    ORT_CPU,
    ORT_CUDA,
    TENSORRT,
    GeluMatch,
    Namer,
    consumer,
    escape_problem,
    is_const,
    match_gelu_erf,
    match_gelu_tanh,
    other_input,
    producer,
    replace_output,
    scalar,
    target_of,
)
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "fuse_gelu"

#: Default-domain opset that has Gelu (with ``approximate``).
GELU_OPSET = 20


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

    Options (ctx.options):
        fuse_gelu_raise_opset (bool): tensorrt: raise the opset to 20 where safe (default True); False keeps the
            graph's opset (sites below 20 are then rejected).

    Counts: ``Gelu``, ``FastGelu`` (ORT's tanh form), ``QuickGelu`` emitted; ``rejected`` (reasons at DEBUG);
    ``skipped_for_target`` (quick_gelu on tensorrt).
    """
    target = target_of(ctx.backend, ctx.device)
    rejections: list[Rejection] = []
    names = Namer(graph)
    counts = {"Gelu": 0, "FastGelu": 0, "QuickGelu": 0}
    skipped = 0
    opset_problem: str | None = None
    opset_asked = False
    for node in list(graph.nodes):
        if not in_onnx_domain(node) or not node.outputs or node.op not in ("Erf", "Tanh", "Sigmoid"):
            continue
        if node.op == "Sigmoid":
            quick = _match_quick_gelu(node)
            if quick is None:
                continue  # a plain Sigmoid / SiLU: not a candidate
            if isinstance(quick, str):
                rejections.append(reject(NAME, node, quick))
                continue
            x, alpha, nodes, internal = quick
            if (problem := escape_problem(graph, internal, nodes)) is not None:
                rejections.append(reject(NAME, node, problem))
                continue
            if target == TENSORRT:
                skipped += 1
                continue
            _emit(graph, names, nodes[-1], "QuickGelu", "com.microsoft", x, {"alpha": alpha})
            counts["QuickGelu"] += 1
            continue
        match = match_gelu_erf(node) if node.op == "Erf" else match_gelu_tanh(node)
        if isinstance(match, str):
            rejections.append(reject(NAME, node, match))
            continue
        if (problem := escape_problem(graph, match.internal, match.nodes)) is not None:
            rejections.append(reject(NAME, node, problem))
            continue
        if target == TENSORRT and not opset_asked:
            opset_problem, opset_asked = _opset_problem(graph, ctx), True
        if target == TENSORRT and opset_problem is not None:
            rejections.append(reject(NAME, node, f"Gelu needs opset {GELU_OPSET}; {opset_problem}"))
            continue
        counts[_rewrite(graph, names, match, target)] += 1
    counts.update(rejected=len(rejections), skipped_for_target=skipped)
    fused = counts["Gelu"] + counts["FastGelu"] + counts["QuickGelu"]
    return PassResult(modified=fused > 0, counts=counts)


def _opset_problem(graph: gs.Graph, ctx: PassContext) -> str | None:
    if ctx.options.get("fuse_gelu_raise_opset", True):
        return ensure_opset(graph, GELU_OPSET)
    opset = graph_opset(graph)
    return None if opset >= GELU_OPSET else f"the graph has opset {opset} and raising it is off"


def _match_quick_gelu(sigmoid: gs.Node) -> tuple[gs.Tensor, float, list[gs.Node], list[gs.Tensor]] | str | None:
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
    return x, alpha, [scale, sigmoid, mul], [scale.outputs[0], sigmoid.outputs[0]]


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

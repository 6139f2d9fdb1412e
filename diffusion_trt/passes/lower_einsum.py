"""Lower two-operand batched-matmul Einsums (the attention of OpenAI's guided-diffusion / CompVis exports) to MatMul."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from ._match import fuse_each, in_onnx_domain
from ._patterns import Namer
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "lower_einsum"


@dataclass(frozen=True)
class _Plan:
    first: int  # which Einsum input is MatMul's A
    transpose_a: bool
    transpose_b: bool
    rank: int


def lower_einsum(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Rewrite ``Einsum`` whose equation is a batched matrix product into ``MatMul`` with Transposes of the last
    two axes where the letters ask for them.

    Matches:  Einsum(a, b, equation="B..xk,B..ky->B..xy") in any arrangement of the last two letters of each
              term, e.g. guided-diffusion's QKVAttentionLegacy:
                  q[bh,c,t] --Einsum("bct,bcs->bts")--> w[bh,t,s] -> Softmax -> Einsum("bts,bcs->bct", w, v)
    Emits:    MatMul(Transpose?(a), Transpose?(b)) [-> Transpose]     (Transpose perm swaps the last two axes)
                  q -> Transpose(0,2,1) -> MatMul(., k) -> Softmax -> MatMul(v, Transpose(0,2,1)(w))
    Why:      ORT's Einsum kernel is a generic loop (reshape/transposes per call), MatMul is one GEMM; TensorRT
              parses both, but its attention fusion looks for MatMul-Softmax-MatMul.
    Requires: no ellipsis; the batch letters (in all three terms) lead every term in the same order; each input
              has exactly one free letter and one contracted letter after them (rank 3 or more).

    Counts: ``MatMul`` (Einsums rewritten), ``Transpose`` (inserted), ``rejected`` (Einsums left, reasons at DEBUG).
    """
    del ctx  # one form for every target
    names = Namer(graph)

    def rewrite(found: tuple[gs.Node, _Plan]) -> dict[str, int]:
        return {"MatMul": 1, "Transpose": _rewrite(graph, *found, names)}

    tally = fuse_each(graph, NAME, match=_candidate, rewrite=rewrite)
    return PassResult.of(tally, "MatMul", "Transpose", skipped=False)


def _candidate(node: gs.Node) -> tuple[gs.Node, _Plan] | str | None:
    if node.op != "Einsum" or not in_onnx_domain(node) or not node.outputs:
        return None
    plan = _plan(node)
    return plan if isinstance(plan, str) else (node, plan)


def _plan(node: gs.Node) -> _Plan | str:
    equation = node.attrs.get("equation")
    equation = equation.decode() if isinstance(equation, bytes) else str(equation or "")
    equation = equation.replace(" ", "")
    if len(node.inputs) != 2:
        return f"{len(node.inputs)} operands, not 2"
    if "..." in equation or "->" not in equation:
        return f"equation {equation!r} has an ellipsis or no explicit output"
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return f"equation {equation!r} does not have two input terms"
    a, b = terms
    if any(len(set(t)) != len(t) for t in (a, b, out)):
        return f"equation {equation!r} repeats a letter within a term (a trace or diagonal)"
    batch = [c for c in out if c in a and c in b]
    nb = len(batch)
    if a[:nb] != "".join(batch) or b[:nb] != "".join(batch) or out[:nb] != "".join(batch):
        return f"equation {equation!r}: the batch letters {''.join(batch)!r} do not lead every term"
    ra, rb, ro = a[nb:], b[nb:], out[nb:]
    contracted = [c for c in ra if c in rb and c not in out]
    if len(ra) != 2 or len(rb) != 2 or len(ro) != 2 or len(contracted) != 1:
        return f"equation {equation!r} is not a batched matrix product (one free and one summed letter per input)"
    k = contracted[0]
    x, y = ro
    if x in ra and y in rb:
        first, fa, fb = 0, ra, rb
    elif x in rb and y in ra:
        first, fa, fb = 1, rb, ra
    else:
        return f"equation {equation!r}: each output letter must come from a different input"
    if fa.replace(k, "") != x or fb.replace(k, "") != y:
        return f"equation {equation!r} is not a batched matrix product"
    return _Plan(first, transpose_a=fa != x + k, transpose_b=fb != k + y, rank=nb + 2)


def _swap_last(graph: gs.Graph, tensor: gs.Tensor, rank: int, names: Namer, base: str) -> gs.Tensor:
    perm = [*range(rank - 2), rank - 1, rank - 2]
    shape = None if tensor.shape is None or len(tensor.shape) != rank else [*tensor.shape[:-2], tensor.shape[-1],
                                                                             tensor.shape[-2]]
    out = gs.Variable(names(f"{base}_T"), dtype=tensor.dtype, shape=shape)  # later fusions read the shape
    graph.nodes.append(gs.Node("Transpose", names(f"{base}_Transpose"), attrs={"perm": perm},
                               inputs=[tensor], outputs=[out]))
    return out


def _rewrite(graph: gs.Graph, node: gs.Node, plan: _Plan, names: Namer) -> int:
    a, b = node.inputs[plan.first], node.inputs[1 - plan.first]
    inserted = 0
    if plan.transpose_a:
        a, inserted = _swap_last(graph, a, plan.rank, names, f"{node.name}_a"), inserted + 1
    if plan.transpose_b:
        b, inserted = _swap_last(graph, b, plan.rank, names, f"{node.name}_b"), inserted + 1
    outputs = list(node.outputs)
    node.outputs.clear()
    graph.nodes.append(gs.Node("MatMul", names(f"{node.name}_MatMul"), inputs=[a, b], outputs=outputs))
    return inserted

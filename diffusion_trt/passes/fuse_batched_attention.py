"""Fuse the heads-in-batch attention (guided-diffusion / CompVis exports, after lower_einsum) into one MHA node."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from ..artifact.manifest import Backend
from ._match import find_each, in_onnx_domain
from ._patterns import Namer, consumer, escape_problem, import_domain, producer, rank, scalar
from .base import PassContext, PassResult
from .fuse_attention import FuseAttentionOptions

logger = logging.getLogger(__name__)

NAME = "fuse_batched_attention"


@dataclass
class _Site:
    softmax: gs.Node
    q: gs.Tensor  # [BH, T, d]
    k: gs.Tensor  # [BH, S, d] or, when k_t, [BH, d, S]
    k_t: bool
    v: gs.Tensor  # [BH, S, d] or, when v_t, [BH, d, S]
    v_t: bool
    out_t: bool  # the output is [BH, d, T] (MatMul(V', P^T)), else [BH, T, d]
    scale: float
    out: gs.Tensor
    nodes: list[gs.Node]
    internal: list[gs.Tensor]


def fuse_batched_attention(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse rank-3 attention whose heads live in the batch axis into ORT's MultiHeadAttention with one head.

    Matches (one site per rank-3 Softmax; fuse_attention takes the rank-4 [B, N, S, L] ones):

        q[BH,T,d]*sq   k[BH,d,S]*sk                        (sq, sk, s: optional constant scalars)
             \\          /
              MatMul -> [Mul|Div(s)] -> Softmax(-1) -> MatMul(P, v[BH,S,d])            -> out[BH,T,d]
                                                    \\-> Transpose(0,2,1) -> MatMul(v'[BH,d,S], .) -> out[BH,d,T]
              (guided-diffusion's QKVAttentionLegacy after lower_einsum: q = Transpose(q'*s), the second form)
    Emits:    ort-cuda / ort-cpu: com.microsoft.MultiHeadAttention(Q[BH,T,d], K[BH,S,d], V[BH,S,d],
              num_heads=1, scale=sq*sk*s) with Transpose(0,2,1) where K / V / the output come channel-first.
              tensorrt: nothing (``skipped_for_target``): TensorRT fuses MatMul-Softmax-MatMul itself.
    Why:      one flash / memory-efficient attention kernel instead of MatMul-Softmax-MatMul and a [BH,T,S]
              score tensor in memory (the foreign terrain UNet: 28 sites of 1,024 tokens).
    Requires: ranks inferred (run infer_shapes); the head size d known (static last dim of q).

    Options (:class:`.fuse_attention.FuseAttentionOptions`): ``fuse_attention_emit`` "none" turns this pass off as
    it does fuse_attention.

    Counts: ``Attention`` (sites rewritten), ``Transpose`` (inserted), ``rejected`` (rank-3 Softmax nodes
    that did not match, reasons at DEBUG), ``skipped_for_target``.
    """
    emit = ctx.options_for(FuseAttentionOptions).emit
    emit = ("trt" if ctx.backend == Backend.TENSORRT else "mha") if emit is None else emit
    found = find_each(graph, NAME, match=lambda node: _candidate(graph, node))
    counts = {"Attention": 0, "Transpose": 0, "rejected": found.rejected, "skipped_for_target": 0}
    if emit != "mha":
        counts["skipped_for_target"] = len(found.matches)
        return PassResult(modified=False, counts=counts)
    names = Namer(graph)
    for site in found.matches:
        counts["Transpose"] += _emit(graph, site, names)
        counts["Attention"] += 1
    if found.matches:
        import_domain(graph, "com.microsoft")
    return PassResult(modified=bool(found.matches), counts=counts)


def _candidate(graph: gs.Graph, node: gs.Node) -> _Site | str | None:
    if node.op != "Softmax" or not in_onnx_domain(node) or rank(node.inputs[0]) != 3:
        return None
    return _match(graph, node)


def _unscaled(tensor: gs.Tensor) -> tuple[gs.Tensor, float, gs.Node | None]:
    """``(x, s, mul)`` when ``tensor = Mul(x, s)`` with a constant scalar s, else ``(tensor, 1, None)``."""
    mul = producer(tensor, "Mul")
    if mul is not None and len(mul.inputs) == 2:
        for x, c in (mul.inputs, reversed(mul.inputs)):
            value = scalar(c)
            if value is not None and scalar(x) is None:
                return x, value, mul
    return tensor, 1.0, None


def _match(graph: gs.Graph, softmax: gs.Node) -> _Site | str:
    axis = softmax.attrs.get("axis", -1)
    if axis not in (-1, 2):
        return f"Softmax axis {axis} is not the last"
    scores = softmax.inputs[0]
    nodes: list[gs.Node] = [softmax]
    scale = 1.0
    post = producer(scores, "Mul", "Div")
    if post is not None:
        factor = scalar(post.inputs[1])
        if factor is None or factor == 0:
            return "the scores are scaled by a non-constant"
        scale, scores = (factor if post.op == "Mul" else 1.0 / factor), post.inputs[0]
        nodes.insert(0, post)
    qk = producer(scores, "MatMul")
    if qk is None:
        return "the Softmax input is not a MatMul of Q and K (after an optional constant scale)"
    nodes.insert(0, qk)
    a, b = qk.inputs
    # Q: [BH, T, d], possibly Transpose(q' * s) as lower_einsum writes it; K: [BH, d, S] (or Transpose of [BH, S, d])
    q, sq, _ = _unscaled(a)
    k, sk, _ = _unscaled(b)
    scale *= sq * sk
    k_t = True  # MatMul's B is [BH, d, S]: MHA wants [BH, S, d]
    k_tr = producer(k, "Transpose")
    if k_tr is not None and k_tr.attrs.get("perm") == [0, 2, 1]:
        k, k_t = k_tr.inputs[0], False
    probs = softmax.outputs[0]
    av = consumer(probs, "MatMul")
    out_t, v_t = False, False
    if av is not None and av.inputs[0] is probs:
        v = av.inputs[1]  # [BH, S, d]
    else:
        tr = consumer(probs, "Transpose")
        av = consumer(tr.outputs[0], "MatMul") if tr is not None and tr.attrs.get("perm") == [0, 2, 1] else None
        if av is None or av.inputs[1] is not tr.outputs[0]:
            return "the probabilities are not multiplied with V (MatMul(P, V) or MatMul(V', P^T))"
        v, v_t, out_t = av.inputs[0], True, True  # [BH, d, S] -> out [BH, d, T]
        nodes.append(tr)
    nodes.append(av)
    d = q.shape[-1] if q.shape is not None and len(q.shape) == 3 else None
    if not isinstance(d, int):
        return "the head size (last dim of Q) is not known; run infer_shapes first"
    if any(rank(t) != 3 for t in (q, k, v)):
        return "Q, K or V is not rank 3"
    internal = [n.outputs[0] for n in nodes[:-1]]
    problem = escape_problem(graph, internal, nodes)
    if problem is not None:
        return problem
    return _Site(softmax, q, k, k_t, v, v_t, out_t, scale, av.outputs[0], nodes, internal)


def _transposed(graph: gs.Graph, tensor: gs.Tensor, names: Namer, base: str) -> gs.Tensor:
    shape = None if tensor.shape is None else [tensor.shape[0], tensor.shape[2], tensor.shape[1]]
    out = gs.Variable(names(f"{base}_T"), dtype=tensor.dtype, shape=shape)
    graph.nodes.append(gs.Node("Transpose", names(f"{base}_Transpose"), attrs={"perm": [0, 2, 1]},
                               inputs=[tensor], outputs=[out]))
    return out


def _emit(graph: gs.Graph, site: _Site, names: Namer) -> int:
    base = f"{site.softmax.name}_mha"
    k = _transposed(graph, site.k, names, f"{base}_k") if site.k_t else site.k
    v = _transposed(graph, site.v, names, f"{base}_v") if site.v_t else site.v
    out = site.out
    out.inputs.clear()
    mha_out = gs.Variable(names(f"{base}_out"), dtype=site.q.dtype) if site.out_t else out
    graph.nodes.append(gs.Node(op="MultiHeadAttention", name=names(base), domain="com.microsoft",
                               attrs={"num_heads": 1, "scale": float(site.scale)},
                               inputs=[site.q, k, v], outputs=[mha_out]))
    if site.out_t:
        graph.nodes.append(gs.Node("Transpose", names(f"{base}_out_Transpose"), attrs={"perm": [0, 2, 1]},
                                   inputs=[mha_out], outputs=[out]))
    return int(site.k_t) + int(site.v_t) + int(site.out_t)

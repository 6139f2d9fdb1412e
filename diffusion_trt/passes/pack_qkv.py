"""Pack the Q/K/V projections of each fused attention into one MatMul (ORT CUDA's packed MultiHeadAttention)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ._match import const_value, find_each, is_graph_output, single_consumer
from ._patterns import ORT_CUDA, Namer, producer, target_of
from .base import PassContext, PassResult, option

logger = logging.getLogger(__name__)

NAME = "pack_qkv"


@dataclass(frozen=True)
class PackQkvOptions:
    """The options of :func:`pack_qkv`."""

    #: True turns the rewrite on (off by default: measured neutral, see the pass's docstring).
    enabled: bool = option("pack_qkv", False, bool)


@dataclass
class _Projections:
    """The MatMuls feeding one MultiHeadAttention: ``x @ Wq``, ``y @ Wk``, ``y @ Wv`` (x is y: self-attention)."""

    mha: gs.Node
    matmuls: tuple[gs.Node, gs.Node, gs.Node]
    weights: tuple[np.ndarray, np.ndarray, np.ndarray]  # each [D_in, N*d]
    heads: int
    head_dim: int
    self_attention: bool


def pack_qkv(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Pack the bias-free Q/K/V projections in front of each MultiHeadAttention into one projection.

    Matches (what fuse_attention emits for diffusers' Attention, whose to_q/to_k/to_v have no bias):

        self:   x -> MatMul(Wq) -> q3 --\\                cross:  x -> MatMul(Wq) -> q3 -------------\\
                x -> MatMul(Wk) -> k3 ---> MultiHeadAttention     y -> MatMul(Wk) -> k3 -> MultiHeadAttention
                x -> MatMul(Wv) -> v3 --/                         y -> MatMul(Wv) -> v3 -------------/

    Emits (ort-cuda), with ORT's packed layouts (contrib op spec, MultiHeadAttention, query / key inputs):
        self:   x -> MatMul(Wqkv[D, N*3*d]) -> Reshape[0, 0, N, 3, d] -> MultiHeadAttention(qkv, "", "")
        cross:  y -> MatMul(Wkv[D, N*2*d])  -> Reshape[0, 0, N, 2, d] -> MultiHeadAttention(q3, kv, "")
        ``Wqkv[:, (n*3 + j)*d : (n*3 + j + 1)*d] = W_j[:, n*d : (n + 1)*d]`` for head n and j in (q, k, v): the
        interleaving that makes a row-major [B, S, N, 3, d] view of the product hold head n's q, k, v side by side.
    Others: nothing (``skipped_for_target``): ORT's CPU MultiHeadAttention has no packed forms ("Packed QKV ... not
        implemented for CPU"), and TensorRT's attention path reads the plain MatMul-Softmax-MatMul.
    Why:  one GEMM instead of three (self) or two (cross), and ORT's TensorRT-derived fused attention kernels read
        the packed layouts directly (SD-1.5 UNet: 16 self + 16 cross sites, 80 -> 32 projection MatMuls).
    Requires: fuse_attention ran (it emits the MultiHeadAttention nodes); the weights constant 2-D with equal
        widths N*d (num_heads N from the node); each projection read only by its attention and not a graph
        output; no bias / mask / attention_bias input on the node (CLIP's attention has both: rejected).

    Options (``ctx.options`` keys, read as :class:`PackQkvOptions`):
        pack_qkv: True turns the rewrite on; default False (every matched site counts as ``disabled``). Off by
            default because it measured neutral with the attention kernel ORT picks (cuDNN flash attention reads
            only unpacked Q/K/V, so ORT inserts an unpack kernel per site that eats the saved GEMMs); ORT's
            TensorRT fused kernels, which read the packed forms, did not run on sm90. Figures:
            benchmarks/results/README.md ("Figures behind code defaults").

    Counts: ``packed_qkv`` (self sites), ``packed_kv`` (cross sites), ``rejected`` (reasons at DEBUG),
        ``skipped_for_target``.
    """
    found = find_each(graph, NAME, match=lambda node: _candidate(graph, node))
    counts = {"packed_qkv": 0, "packed_kv": 0, "rejected": found.rejected, "skipped_for_target": 0}
    if target_of(ctx.backend, ctx.device) != ORT_CUDA:
        counts["skipped_for_target"] = len(found.matches)
        return PassResult(modified=False, counts=counts)
    if not ctx.options_for(PackQkvOptions).enabled:
        counts["disabled"] = len(found.matches)
        return PassResult(modified=False, counts=counts)
    names = Namer(graph)
    for site in found.matches:
        _rewrite(graph, site, names)
        counts["packed_qkv" if site.self_attention else "packed_kv"] += 1
    return PassResult(modified=bool(found.matches), counts=counts)


def _candidate(graph: gs.Graph, node: gs.Node) -> _Projections | str | None:
    if node.op != "MultiHeadAttention" or node.domain != "com.microsoft":
        return None
    return _match(graph, node)


def _match(graph: gs.Graph, mha: gs.Node) -> _Projections | str:
    if len(mha.inputs) < 3 or any(t.name for t in mha.inputs[3:]):
        return "the attention has a bias, mask or attention_bias input (the packed forms take none here)"
    q3, k3, v3 = mha.inputs[:3]
    if not (q3.name and k3.name and v3.name):
        return "the attention is already packed"
    heads = int(mha.attrs.get("num_heads", 0))
    matmuls, weights = [], []
    for role, tensor in zip("qkv", (q3, k3, v3), strict=True):
        mm = producer(tensor, "MatMul")
        if mm is None:
            return f"{role} ({tensor.name!r}) is not a MatMul output (a biased or transformed projection)"
        w = const_value(mm.inputs[1])
        if w is None or w.ndim != 2:
            return f"{role}'s projection weight {mm.inputs[1].name!r} is not a constant 2-D matrix"
        if is_graph_output(graph, tensor) or single_consumer(tensor) is not mha:
            return f"{role} ({tensor.name!r}) is also read outside the attention"
        matmuls.append(mm)
        weights.append(w)
    widths = {w.shape[1] for w in weights}
    if len(widths) != 1 or heads < 1 or weights[0].shape[1] % heads:
        return f"projection widths {[w.shape[1] for w in weights]} are not one N*d with num_heads={heads}"
    x, y = matmuls[0].inputs[0], matmuls[1].inputs[0]
    if matmuls[2].inputs[0] is not y:
        return "K and V are projected from different tensors"
    if weights[1].shape[0] != weights[2].shape[0]:
        return "K and V weights read inputs of different widths"
    return _Projections(mha, tuple(matmuls), tuple(weights), heads, weights[0].shape[1] // heads,  # type: ignore[arg-type]
                        self_attention=x is y)


def pack_weights(weights: list[np.ndarray] | tuple[np.ndarray, ...], heads: int) -> np.ndarray:
    """The packed projection weight: ``weights`` (each [D, N*d]) interleaved per head to [D, N*len(weights)*d]."""
    d_in = weights[0].shape[0]
    head_dim = weights[0].shape[1] // heads
    stacked = np.stack([w.reshape(d_in, heads, head_dim) for w in weights], axis=2)  # [D, N, J, d]
    return np.ascontiguousarray(stacked.reshape(d_in, -1))


def _rewrite(graph: gs.Graph, site: _Projections, names: Namer) -> None:
    mha = site.mha
    packed = 3 if site.self_attention else 2
    mm = site.matmuls[0] if site.self_attention else site.matmuls[1]
    source = mm.inputs[0]
    weight = pack_weights(site.weights[3 - packed:], site.heads)
    base = mm.name or "attention"
    product = gs.Variable(names(f"{base}_packed"), dtype=mm.outputs[0].dtype)
    graph.nodes.append(gs.Node("MatMul", names(f"{base}_PackedMatMul"),
                               inputs=[source, gs.Constant(names(f"{base}_packed_weight"), weight)],
                               outputs=[product]))
    lead = list(mm.outputs[0].shape[:2]) if mm.outputs[0].shape is not None else None
    view = gs.Variable(names(f"{base}_packed_view"), dtype=product.dtype,
                       shape=[*lead, site.heads, packed, site.head_dim] if lead is not None else None)
    target = np.asarray([0, 0, site.heads, packed, site.head_dim], dtype=np.int64)
    graph.nodes.append(gs.Node("Reshape", names(f"{base}_PackedReshape"),
                               inputs=[product, gs.Constant(names(f"{base}_packed_shape"), target)],
                               outputs=[view]))
    first = 0 if site.self_attention else 1  # self: query, key, value <- (qkv, "", ""); cross: key, value <- (kv, "")
    for slot in range(first, 3):
        mha.inputs[slot] = view if slot == first else gs.Variable.empty()
    for node in site.matmuls:
        if not node.outputs[0].outputs:  # no reader left: the PassManager's cleanup removes it
            node.outputs.clear()

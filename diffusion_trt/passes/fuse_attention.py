"""Fuse the multi-head attention that torch exports (SDPA and eager forms) into the target's attention form."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from ..artifact.manifest import Backend
from ._match import const_value, find_each, in_onnx_domain, is_graph_output
from ._patterns import import_domain, producer
from .base import PassContext, PassResult, option

logger = logging.getLogger(__name__)

NAME = "fuse_attention"
#: Ops a scale subgraph may contain: the exporter computes SDPA's 1/sqrt(head_dim) from Shape at run time.
_SHAPE_ARITH_OPS = frozenset(
    {"Shape", "Gather", "Slice", "Cast", "Sqrt", "Div", "Mul", "Add", "Sub", "Reciprocal", "Pow", "Unsqueeze",
     "Squeeze", "Concat", "Identity"}
)
#: What each (backend, device) gets by default; override with ctx.options["fuse_attention_emit"].
_DEFAULT_EMIT: dict[tuple[str, str], str] = {
    (Backend.ORT, "cuda"): "mha",
    (Backend.ORT, "cpu"): "mha",
    (Backend.TENSORRT, "cuda"): "trt",
    (Backend.TENSORRT_RTX, "cuda"): "trt",
}
EMITS: tuple[str, ...] = ("mha", "trt", "none")


@dataclass(frozen=True)
class FuseAttentionOptions:
    """The options of :func:`fuse_attention` (fuse_batched_attention reads them too)."""

    #: "mha" | "trt" | "none"; None: by target (ort -> "mha", tensorrt and tensorrt-rtx -> "trt").
    emit: str | None = option("fuse_attention_emit", None, EMITS)


class _NoMatch(Exception):  # internal control flow: the message is the rejection reason
    pass


@dataclass
class _Branch:
    """One of Q, K, V: ``x3[B,S,N*d] -> Reshape(.,[B,S,N,d]) -> Transpose -> [scale]``."""

    x3: gs.Tensor
    heads: int
    head_dim: int
    scale: float = 1.0
    scale_node: gs.Node | None = None
    unscaled: gs.Tensor | None = None  # the scale node's data input (``top`` when there is no scale node)
    top: gs.Tensor | None = None  # the tensor entering MatMul1/MatMul2 (after transposes and scale)


@dataclass
class _Site:
    softmax: gs.Node
    q: _Branch
    k: _Branch
    v: _Branch
    qk: gs.Node
    av: gs.Node
    out: gs.Tensor  # [B,S,N*d], the merged-heads output
    scale: float
    bias: gs.Tensor | None
    internal: list[gs.Tensor] = field(default_factory=list)


def fuse_attention(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse scaled-dot-product multi-head attention into one attention op (ORT) or TensorRT's MHA form.

    Matches (one site per Softmax; diffusers SDPA self/cross-attention and CLIP eager attention):

        q3[B,S,N*d]  k3[B,L,N*d]                 v3[B,L,N*d]
          Reshape      Reshape                     Reshape       targets [B,S,N,d]: N or d a constant
          Transpose    Transpose(0,2,3,1)          Transpose(0,2,1,3)
          [Mul(sq)]    [Mul(sk)]                      |           sq, sk: constant or Shape-arithmetic scalars
               \\         /                           |
                MatMul -> [Mul|Div(s)] -> [Add(bias)] -> Softmax(-1) -> [Cast]* -> MatMul
                                                                       -> Transpose(0,2,1,3) -> Reshape -> out[B,S,N*d]

    Emits:
        mha  (ONNX Runtime): com.microsoft MultiHeadAttention(q3, k3, v3, attention_bias=bias,
             num_heads=N, scale=sq*sk*s) -> out. bias (CLIP's causal mask [B,1,S,L]) becomes attention_bias.
        trt  (TensorRT): the same MatMul-Softmax-MatMul, normalized to what TensorRT's attention fusion wants:
             one constant Mul(scale) on Q before the first MatMul (the Shape-computed sqrt-scales on Q and K and
             any scale after the MatMul are folded into it), no Casts between Softmax and the second MatMul.
        none: nothing (sites still counted as ``matched``).
    Why:  one flash/memory-efficient attention kernel instead of 10+ nodes and an S x L score tensor in memory
          (SD-1.5 UNet: 32 sites, 16 self + 16 cross; CLIP: one per layer).
    Requires: shapes inferred (hidden size and ranks); Shape-derived scales are evaluated here from known dims,
          so a static export and a dynamic one fuse alike.

    Options (``ctx.options`` keys, read as :class:`FuseAttentionOptions`):
        fuse_attention_emit: "mha" | "trt" | "none"; default by target: ort -> "mha", tensorrt and
            tensorrt-rtx -> "trt".

    Counts: ``Attention`` (sites rewritten), ``self``/``cross`` (Q and K from the same tensor or not),
        ``masked`` (with an additive bias), ``rejected`` (Softmax nodes that did not match, reasons at DEBUG).
    """
    emit = ctx.options_for(FuseAttentionOptions).emit
    emit = _DEFAULT_EMIT.get((ctx.backend, ctx.device), "none") if emit is None else emit
    if emit not in EMITS:
        raise ValueError(f"fuse_attention_emit={emit!r} is unknown; use one of {', '.join(EMITS)}")
    found = find_each(graph, NAME, match=lambda node: _candidate(graph, node))
    sites = found.matches
    counts = {"Attention": 0, "self": 0, "cross": 0, "masked": 0, "rejected": found.rejected}
    for site in sites:
        counts["self" if _source(site.q.x3) is _source(site.k.x3) else "cross"] += 1
        counts["masked"] += site.bias is not None
    if emit == "none":
        counts["matched"] = len(sites)
        return PassResult(modified=False, counts=counts)
    for index, site in enumerate(sites):
        if emit == "mha":
            _emit_mha(graph, site, index)
        else:
            _emit_trt(graph, site, index)
        counts["Attention"] += 1
    return PassResult(modified=bool(sites), counts=counts)


def _candidate(graph: gs.Graph, node: gs.Node) -> _Site | str | None:
    """The attention site around a Softmax, the reason it is none, or None for a node that is no Softmax."""
    if node.op != "Softmax" or not in_onnx_domain(node):
        return None
    try:
        return _match(graph, node)
    except _NoMatch as why:
        return str(why)


def _source(x3: gs.Tensor) -> gs.Tensor:
    """The tensor a projection reads: x for ``x @ W`` or ``x @ W + b``, else ``x3`` itself (self vs cross count)."""
    node = producer(x3, "Add")
    if node is not None:
        x3 = next((t for t in node.inputs if producer(t, "MatMul") is not None), x3)
    node = producer(x3, "MatMul")
    return node.inputs[0] if node is not None else x3


# --- match -----------------------------------------------------------------------------------------------


def _only_consumer(tensor: gs.Tensor) -> gs.Node:
    """The single non-Shape consumer of ``tensor`` (Shape readers feed the exporter's scale arithmetic)."""
    readers = {id(n): n for n in tensor.outputs if n.op != "Shape"}
    if len(readers) != 1:
        ops = ", ".join(n.op for n in readers.values()) or "none"
        raise _NoMatch(f"{tensor.name!r} has {len(readers)} consumers ({ops})")
    return next(iter(readers.values()))


def _scalar_factor(mul: gs.Node, data: gs.Tensor, known: dict[str, list[int | None]]) -> float:
    """The scalar that ``mul`` (Mul or Div, ``data`` being the non-scalar side) multiplies by."""
    other = mul.inputs[1] if mul.inputs[0] is data else mul.inputs[0]
    if mul.op == "Div" and mul.inputs[0] is not data:
        raise _NoMatch(f"Div {mul.name!r} divides by the attention tensor")
    value = _evaluate(other, known, depth=0)
    if value.size != 1:
        raise _NoMatch(f"scale {other.name!r} has {value.size} elements, not 1")
    factor = float(value.reshape(-1)[0])
    return 1.0 / factor if mul.op == "Div" else factor


def _evaluate(tensor: gs.Tensor, known: dict[str, list[int | None]], depth: int) -> np.ndarray:
    """Value of a constant or Shape-arithmetic tensor; Shape dims come from ``known`` or the tensor's shape."""
    value = const_value(tensor)
    if value is not None:
        return np.asarray(value)
    if depth > 24 or len(tensor.inputs) != 1:
        raise _NoMatch(f"scale {tensor.name!r} is not constant")
    node = tensor.inputs[0]
    if node.op not in _SHAPE_ARITH_OPS or not in_onnx_domain(node):
        raise _NoMatch(f"scale {tensor.name!r} comes from {node.op}, not from constants and shapes")
    if node.op == "Shape":
        dims = known.get(node.inputs[0].name) or node.inputs[0].shape
        if dims is None:
            raise _NoMatch(f"scale reads the shape of {node.inputs[0].name!r}, whose rank is unknown")
        out = np.array([d if isinstance(d, int) else None for d in dims], dtype=object)
        start, end = node.attrs.get("start", 0), node.attrs.get("end", None)
        return out[start:end]
    args = [_evaluate(t, known, depth + 1) if t.name else None for t in node.inputs]
    if node.op in ("Gather",):
        return np.take(args[0], args[1].astype(np.int64), axis=int(node.attrs.get("axis", 0)))
    if node.op == "Slice":
        starts, ends = args[1].astype(np.int64), args[2].astype(np.int64)
        axes = args[3].astype(np.int64) if len(args) > 3 and args[3] is not None else np.arange(len(starts))
        steps = args[4].astype(np.int64) if len(args) > 4 and args[4] is not None else np.ones_like(starts)
        index = [slice(None)] * args[0].ndim
        for s, e, a, st in zip(starts, ends, axes, steps, strict=True):
            index[int(a)] = slice(int(s), int(min(e, 2**62)), int(st))
        return args[0][tuple(index)]
    if node.op == "Unsqueeze":
        return np.expand_dims(args[0], tuple(int(a) for a in args[1]))
    if node.op == "Squeeze":
        return np.squeeze(args[0], tuple(int(a) for a in args[1])) if len(args) > 1 else np.squeeze(args[0])
    if node.op == "Concat":
        return np.concatenate(args, axis=int(node.attrs.get("axis", 0)))
    if node.op == "Identity":
        return args[0]
    if any(arg is not None and arg.dtype == object and any(v is None for v in arg.reshape(-1)) for arg in args):
        raise _NoMatch(f"scale {tensor.name!r} depends on a dimension that is not known here")
    numeric = [np.asarray(arg.tolist(), dtype=np.float64) if arg.dtype == object else arg for arg in args]
    if node.op == "Cast":
        return numeric[0].astype(helper.tensor_dtype_to_np_dtype(int(node.attrs["to"])))
    ops = {"Sqrt": lambda a: np.sqrt(a[0]), "Reciprocal": lambda a: 1.0 / a[0], "Div": lambda a: a[0] / a[1],
           "Mul": lambda a: a[0] * a[1], "Add": lambda a: a[0] + a[1], "Sub": lambda a: a[0] - a[1],
           "Pow": lambda a: a[0] ** a[1]}
    return np.asarray(ops[node.op](numeric))


def _reshape_elements(target: gs.Tensor) -> list[int | None] | None:
    """Elements of a Reshape target: ints where constant, None where computed; None if the length is unknown."""
    value = const_value(target)
    if value is not None:
        return [int(v) for v in np.asarray(value).reshape(-1)]
    concat = producer(target, "Concat")
    if concat is None:
        return None
    out: list[int | None] = []
    for part in concat.inputs:
        part_value = const_value(part)
        if part_value is not None:
            out.extend(int(v) for v in np.asarray(part_value).reshape(-1))
        elif part.shape is not None and len(part.shape) == 1 and part.shape[0] == 1:
            out.append(None)
        else:
            return None
    return out


def _hidden(x3: gs.Tensor) -> int | None:
    if x3.shape is not None and len(x3.shape) == 3 and isinstance(x3.shape[2], int):
        return x3.shape[2]
    return None


def _split_heads(reshape: gs.Node, role: str) -> _Branch:
    """Check ``Reshape(x3[B,S,N*d] -> [B,S,N,d])`` and read N and d."""
    x3 = reshape.inputs[0]
    if x3.shape is None or len(x3.shape) != 3:
        raise _NoMatch(f"{role}: {x3.name!r} is not rank 3 ([B, S, hidden]) or its rank is unknown")
    elements = _reshape_elements(reshape.inputs[1])
    if elements is None or len(elements) != 4:
        raise _NoMatch(f"{role}: Reshape {reshape.name!r} target is not 4 known-length elements")
    if reshape.attrs.get("allowzero", 0) and 0 in elements:
        raise _NoMatch(f"{role}: Reshape {reshape.name!r} has allowzero=1 with a 0 in its target")
    batch, seq, heads, head_dim = elements
    for name, got, dim in (("batch", batch, x3.shape[0]), ("sequence", seq, x3.shape[1])):
        if got is not None and got not in (0, -1) and isinstance(dim, int) and got != dim:
            raise _NoMatch(f"{role}: Reshape {reshape.name!r} {name} {got} != input dim {dim}")
    hidden = _hidden(x3)
    if hidden is None:
        raise _NoMatch(f"{role}: hidden size of {x3.name!r} is unknown (run infer_shapes first)")
    if heads is not None and heads > 0:
        n = heads
    elif head_dim is not None and head_dim > 0 and hidden % head_dim == 0:
        n = hidden // head_dim
    else:
        raise _NoMatch(f"{role}: Reshape {reshape.name!r} gives neither the head count nor the head size")
    if hidden % n or (head_dim is not None and head_dim > 0 and head_dim * n != hidden):
        raise _NoMatch(f"{role}: hidden {hidden} does not split into {n} heads of {head_dim}")
    return _Branch(x3=x3, heads=n, head_dim=hidden // n)


def _branch(top: gs.Tensor, role: str, perms: tuple[tuple[int, ...], ...], internal: list[gs.Tensor],
            known: dict[str, list[int | None]]) -> _Branch:
    """Walk up from the MatMul input ``top``: [Mul|Div scalar] <- Transpose(s) <- Reshape."""
    tensor = top
    scale_node = producer(tensor, "Mul", "Div")
    data = tensor
    if scale_node is not None:
        data = next((t for t in scale_node.inputs if producer(t, "Transpose") is not None), None)
        if data is None:
            raise _NoMatch(f"{role}: scale {scale_node.op} {scale_node.name!r} does not follow a Transpose")
        internal.append(data)
        tensor = data
    transposes: list[gs.Node] = []
    node = producer(tensor, "Transpose")
    while node is not None and len(transposes) < 2:
        transposes.insert(0, node)
        tensor = node.inputs[0]
        internal.append(tensor)
        if producer(tensor, "Reshape") is not None:
            break
        node = producer(tensor, "Transpose")
    reshape = producer(tensor, "Reshape")
    if reshape is None or not transposes:
        raise _NoMatch(f"{role}: no Reshape -> Transpose chain feeds the attention MatMul")
    perm = _compose([tuple(t.attrs.get("perm", ())) for t in transposes])
    if perm not in perms:
        raise _NoMatch(f"{role}: transposes compose to {perm}, expected one of {perms}")
    branch = _split_heads(reshape, role)
    branch.top, branch.unscaled = top, data
    dims: list[int | None] = [None, None, branch.heads, branch.head_dim]
    known[reshape.outputs[0].name] = dims
    for transpose in transposes:
        dims = [dims[i] for i in transpose.attrs["perm"]]
        known[transpose.outputs[0].name] = dims
    if scale_node is not None:
        branch.scale = _scalar_factor(scale_node, data, known)
        branch.scale_node = scale_node
    return branch


def _compose(perms: list[tuple[int, ...]]) -> tuple[int, ...]:
    out = (0, 1, 2, 3)
    for perm in perms:
        if len(perm) != 4:
            return tuple(perm)
        out = tuple(out[i] for i in perm)
    return out


def _is_noop_cast(node: gs.Node) -> bool:
    dtype = node.inputs[0].dtype
    return (node.op == "Cast" and in_onnx_domain(node) and dtype is not None
            and helper.tensor_dtype_to_np_dtype(int(node.attrs["to"])) == np.dtype(dtype))


def _match(graph: gs.Graph, softmax: gs.Node) -> _Site:
    internal: list[gs.Tensor] = []
    known: dict[str, list[int | None]] = {}
    if softmax.attrs.get("axis", -1) not in (-1, 3):
        raise _NoMatch(f"Softmax axis {softmax.attrs.get('axis')} is not the last")
    # Before the Softmax: [Add(bias)] <- [Mul|Div(scalar)] <- MatMul(Q, K^T).
    scores = softmax.inputs[0]
    if scores.shape is not None and len(scores.shape) != 4:
        raise _NoMatch(f"Softmax input is rank {len(scores.shape)}, not 4 ([B, N, S, L])")
    bias: gs.Tensor | None = None
    add = producer(scores, "Add")
    if add is not None:
        internal.append(scores)
        sides = [t for t in add.inputs if producer(t, "MatMul", "Mul", "Div") is not None]
        if not sides:
            raise _NoMatch("Add before Softmax has no MatMul/Mul/Div input")
        scores = sides[0]
        bias = add.inputs[1] if add.inputs[0] is scores else add.inputs[0]
        if bias.shape is None or len(bias.shape) != 4:
            raise _NoMatch(f"attention bias {bias.name!r} is not rank 4 ([B|1, N|1, S, L])")
    post_scale_node = producer(scores, "Mul", "Div")
    post_scale = 1.0
    if post_scale_node is not None:
        internal.append(scores)
        data = next((t for t in post_scale_node.inputs if producer(t, "MatMul") is not None), None)
        if data is None:
            raise _NoMatch("scale before Softmax does not follow a MatMul")
        post_scale_source = (post_scale_node, data)
        scores = data
    else:
        post_scale_source = None
    qk = producer(scores, "MatMul")
    if qk is None:
        raise _NoMatch("Softmax input does not come from a MatMul (Q K^T)")
    internal.append(scores)
    q = _branch(qk.inputs[0], "Q", ((0, 2, 1, 3),), internal, known)
    k = _branch(qk.inputs[1], "K", ((0, 2, 3, 1),), internal, known)
    if post_scale_source is not None:
        post_scale = _scalar_factor(*post_scale_source, known)
    # After the Softmax: [no-op Cast]* -> MatMul(., V) -> Transpose(0,2,1,3) -> Reshape -> out.
    probs = softmax.outputs[0]
    internal.append(probs)
    node = _only_consumer(probs)
    while node.op == "Cast" and _is_noop_cast(node):
        internal.append(node.outputs[0])
        node = _only_consumer(node.outputs[0])
    if node.op != "MatMul" or node.inputs[0] is not internal[-1]:
        raise _NoMatch(f"Softmax output goes to {node.op}, not to MatMul(probs, V)")
    av = node
    v = _branch(av.inputs[1], "V", ((0, 2, 1, 3),), internal, known)
    internal.append(av.outputs[0])
    transpose = _only_consumer(av.outputs[0])
    if transpose.op != "Transpose" or tuple(transpose.attrs.get("perm", ())) != (0, 2, 1, 3):
        raise _NoMatch(f"attention output goes to {transpose.op}, not Transpose(0,2,1,3)")
    internal.append(transpose.outputs[0])
    merge = _only_consumer(transpose.outputs[0])
    if merge.op != "Reshape":
        raise _NoMatch(f"merged heads go to {merge.op}, not Reshape")
    out = merge.outputs[0]
    _check_merge(merge, out, q.heads * v.head_dim)
    if (q.heads, q.head_dim) != (k.heads, k.head_dim) or v.heads != q.heads:
        raise _NoMatch(f"Q/K/V heads differ: Q {q.heads}x{q.head_dim}, K {k.heads}x{k.head_dim}, "
                       f"V {v.heads}x{v.head_dim}")
    for tensor in internal:
        if is_graph_output(graph, tensor):
            raise _NoMatch(f"{tensor.name!r} is a graph output")
    for tensor in internal:
        _only_consumer(tensor)
    scale = q.scale * k.scale * post_scale
    if not np.isfinite(scale) or scale <= 0:
        raise _NoMatch(f"attention scale {scale} is not a positive finite number")
    return _Site(softmax=softmax, q=q, k=k, v=v, qk=qk, av=av, out=out, scale=scale, bias=bias, internal=internal)


def _check_merge(merge: gs.Node, out: gs.Tensor, hidden: int) -> None:
    """The Reshape after attention must give [B, S, N*d]; proven by its target, its output shape or its reader."""
    elements = _reshape_elements(merge.inputs[1])
    if elements is None or len(elements) != 3:
        raise _NoMatch(f"Reshape {merge.name!r} after attention is not to rank 3")
    if out.shape is not None and len(out.shape) == 3 and isinstance(out.shape[2], int):
        if out.shape[2] != hidden:
            raise _NoMatch(f"Reshape {merge.name!r} gives last dim {out.shape[2]}, not {hidden}")
        return
    if elements[2] is not None and elements[2] > 0:
        if elements[2] != hidden:
            raise _NoMatch(f"Reshape {merge.name!r} target last dim {elements[2]} != {hidden}")
        return
    # Computed last dim: the model's next MatMul (the output projection) must take `hidden` features.
    reader = out.outputs[0] if len(out.outputs) == 1 else None
    while reader is not None and reader.op == "Cast":
        reader = reader.outputs[0].outputs[0] if len(reader.outputs[0].outputs) == 1 else None
    weight = const_value(reader.inputs[1]) if reader is not None and reader.op == "MatMul" else None
    if weight is None or weight.ndim != 2 or weight.shape[0] != hidden:
        raise _NoMatch(f"cannot prove Reshape {merge.name!r} merges heads into {hidden} features")


# --- rewrite ---------------------------------------------------------------------------------------------


def _emit_mha(graph: gs.Graph, site: _Site, index: int) -> None:
    dtype = site.q.x3.dtype
    inputs: list[gs.Tensor] = [site.q.x3, site.k.x3, site.v.x3]
    if site.bias is not None:
        inputs += [gs.Variable.empty(), gs.Variable.empty(), site.bias]
    out = site.out
    out.inputs.clear()
    mha = gs.Node(
        op="MultiHeadAttention",
        name=f"fuse_attention/MultiHeadAttention_{index}",
        domain="com.microsoft",
        attrs={"num_heads": site.q.heads, "scale": float(site.scale)},
        inputs=inputs,
        outputs=[out],
    )
    if out.dtype is None:
        out.dtype = dtype
    graph.nodes.append(mha)
    import_domain(graph, "com.microsoft")


def _emit_trt(graph: gs.Graph, site: _Site, index: int) -> None:
    """Q*scale (one constant) -> MatMul(., K^T); sqrt-scales on Q/K and post-MatMul scale dropped; Casts removed."""
    q_data, k_data = site.q.unscaled, site.k.unscaled
    assert q_data is not None and k_data is not None
    dtype = np.dtype(q_data.dtype) if q_data.dtype is not None else np.dtype(np.float32)
    scaled = gs.Variable(f"fuse_attention/q_scaled_{index}", dtype=q_data.dtype, shape=q_data.shape)
    graph.nodes.append(gs.Node(
        "Mul", f"fuse_attention/ScaleQ_{index}",
        inputs=[q_data, gs.Constant(f"fuse_attention/scale_{index}", np.asarray(site.scale, dtype=dtype))],
        outputs=[scaled],
    ))
    site.qk.inputs[0] = scaled
    site.qk.inputs[1] = k_data
    scores = site.qk.outputs[0]
    # Drop the post-MatMul scale: the node(s) between MatMul1 and the Add / Softmax.
    after = site.softmax.inputs[0]
    add = producer(after, "Add")
    target = add if add is not None else site.softmax
    for slot, tensor in enumerate(target.inputs):
        if producer(tensor, "Mul", "Div") is not None and tensor in site.internal:
            target.inputs[slot] = scores
    # Drop no-op Casts between Softmax and MatMul2.
    site.av.inputs[0] = site.softmax.outputs[0]



"""Remove Transposes that cancel, moving them through elementwise ops and 1x1 convolutions until they meet."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ._match import Rejection, in_onnx_domain, is_graph_output, reject, single_consumer
from ._patterns import Namer, const_value, is_const
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "cancel_transposes"

#: One-input ops that act on each element alone: a Transpose moves through them unchanged.
UNARY_ELEMENTWISE: frozenset[str] = frozenset(
    {"Abs", "Cast", "Ceil", "Cos", "Elu", "Erf", "Exp", "Floor", "Gelu", "HardSigmoid", "Identity", "LeakyRelu",
     "Log", "Neg", "Reciprocal", "Relu", "Round", "Sigmoid", "Sign", "Sin", "Softplus", "Sqrt", "Tanh"}
)
#: Two-input elementwise ops with numpy broadcasting: a Transpose moves through them when the other input is a
#: constant (permuted to match) or the output of a Transpose with the same perm.
BINARY_ELEMENTWISE: frozenset[str] = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"})

#: The perms of a 4-D NCHW <-> NHWC round trip, as fuse_group_norm writes them around the NHWC GroupNorm.
TO_NCHW: tuple[int, ...] = (0, 3, 1, 2)
TO_NHWC: tuple[int, ...] = (0, 2, 3, 1)

#: Rounds of the rewrite loop before giving up on a fixpoint (each round moves every Transpose one op on).
MAX_ROUNDS = 64


def cancel_transposes(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Remove Transpose pairs whose perms compose to the identity, sinking Transposes forward until they meet.

    Matches:  a -> Transpose(p) -> Transpose(q)                                   (q o p = identity, or not)
              a -> Transpose(p) -> Op(., c | Transpose(p)(b)) -> ... -> Transpose(q)   (Op elementwise)
              a[N,H,W,C] -> Transpose(0,3,1,2) -> Conv(W[Co,C,1,1], b; 1x1, stride 1, no pad, group 1)
                -> Transpose(0,2,3,1)
    Emits:    a                                           (the pair cancels: readers read ``a``)
              Transpose(q o p)(a)                         (the pair merges into one)
              Op(a, c permuted by p^-1 | b) -> ... -> (the pair cancels)
              Op(Transpose(p)(a), Transpose(p)(b)) -> Transpose(p)(Op(a, b))       (two Transposes become one)
              MatMul(a, W^T[C,Co]) -> Add(b)               (the 1x1 convolution on the NHWC tensor)
    Why:      fuse_group_norm's ort-cuda form wraps each NHWC GroupNorm in NCHW<->NHWC Transposes (SD-1.5 UNet:
              122). Where an NHWC chain continues (a GroupNorm into a transformer's 1x1 proj_in and its
              permute(0,2,3,1): 16 sites in the UNet) the Transposes cancel; a Transpose is a full memory copy.
              A pair whose first output Shape nodes also read (a dynamic graph's ``batch, _, height, width =
              hidden_states.shape``) cancels too: the Shapes read ``Gather(Shape(a), p)``, the same values.
    Requires: shapes inferred (ranks of the tensors a Transpose moves past; constants must broadcast at that
              rank); every tensor a moved Transpose leaves behind read by the chain alone and not a graph output.
              Transposes are moved only where that ends in a cancel or a merge, never just moved.

    Counts: ``Transpose_removed`` (Transposes before minus after), ``cancelled`` (pairs removed), ``merged``
    (pairs made one), ``joined`` (two Transposes into one elementwise op made one after it), ``Conv_to_MatMul``
    (1x1 convolutions rewritten), ``rejected`` (candidates turned down, reasons at DEBUG).
    """
    before = sum(node.op == "Transpose" for node in graph.nodes)
    names = Namer(graph)
    counts = {"cancelled": 0, "merged": 0, "joined": 0, "Conv_to_MatMul": 0}
    rejected: dict[tuple[str, str], Rejection] = {}  # one entry per (node, reason): rounds repeat candidates
    for _ in range(MAX_ROUNDS):
        changed = False
        for node in list(graph.nodes):
            if node.op != "Transpose" or not in_onnx_domain(node) or not node.outputs or not node.outputs[0].outputs:
                continue
            outcome = _step(graph, node, names, counts)
            if isinstance(outcome, str):
                key = (node.name, outcome)
                if key not in rejected:
                    rejected[key] = reject(NAME, node, outcome)
            elif outcome:
                changed = True
        if not changed:
            break
        graph.cleanup().toposort()
    else:
        logger.warning("%s: no fixpoint after %d rounds on %s", NAME, MAX_ROUNDS, ctx.component)
    graph.cleanup()
    removed = before - sum(node.op == "Transpose" for node in graph.nodes)
    result = {"Transpose_removed": removed, **counts, "rejected": len({name for name, _ in rejected})}
    return PassResult(modified=removed > 0 or counts["Conv_to_MatMul"] > 0, counts=result)


def perm_of(node: gs.Node, rank: int | None) -> tuple[int, ...] | None:
    """The perm of a Transpose node (the default reverses the axes: needs ``rank``)."""
    perm = node.attrs.get("perm")
    if perm is None:
        return None if rank is None else tuple(range(rank - 1, -1, -1))
    return tuple(int(axis) for axis in perm)


def compose(first: tuple[int, ...], second: tuple[int, ...]) -> tuple[int, ...]:
    """The perm of ``Transpose(second)(Transpose(first)(x))``: output axis i is input axis first[second[i]]."""
    return tuple(first[axis] for axis in second)


def _rank(tensor: gs.Tensor) -> int | None:
    return None if tensor.shape is None else len(tensor.shape)


def _permuted(shape: list[int | str | None] | None, perm: tuple[int, ...]) -> list[int | str | None] | None:
    return None if shape is None else [shape[axis] for axis in perm]


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(axis) for axis in np.argsort(perm))


def _step(graph: gs.Graph, node: gs.Node, names: Namer, counts: dict[str, int]) -> bool | str:
    """Try the rewrites at the Transpose ``node``: True if the graph changed, False if it is no candidate, or the
    reason a candidate was turned down."""
    out = node.outputs[0]
    perm = perm_of(node, _rank(node.inputs[0]))
    if perm is None:
        return "no perm attribute and the input rank is unknown; run infer_shapes"
    nxt = single_consumer(out)
    if nxt is None:
        nxt = _detach_shape_readers(graph, node, perm, names)
    if nxt is None or not in_onnx_domain(nxt):
        return False
    if nxt.op == "Transpose":
        return _pair(graph, node, nxt, perm, counts)
    if nxt.op == "Conv":
        return _conv_1x1(graph, node, nxt, perm, names, counts)
    if nxt.op in UNARY_ELEMENTWISE or nxt.op in BINARY_ELEMENTWISE:
        return _sink(graph, node, nxt, perm, names, counts)
    return False


def _is_plain_shape(node: gs.Node) -> bool:
    return node.op == "Shape" and in_onnx_domain(node) and "start" not in node.attrs and "end" not in node.attrs


def _detach_shape_readers(graph: gs.Graph, node: gs.Node, perm: tuple[int, ...], names: Namer) -> gs.Node | None:
    """When the Transpose's output is read by Shape nodes and one Transpose (a dynamic graph's ``batch, _, height,
    width = hidden_states.shape`` beside the pair that cancels), point the Shapes at the input through
    ``Gather(Shape(a), perm)`` (the same values) and return that Transpose; else None, the graph unchanged."""
    out = node.outputs[0]
    readers = {id(n): n for n in out.outputs}.values()
    shapes = [n for n in readers if _is_plain_shape(n)]
    others = [n for n in readers if not _is_plain_shape(n)]
    if not shapes or len(others) != 1 or others[0].op != "Transpose" or is_graph_output(graph, out):
        return None
    source = node.inputs[0]
    base = node.name or "transpose"
    raw = gs.Variable(names(f"{base}_input_shape"), dtype=np.int64, shape=[len(perm)])
    permuted = gs.Variable(names(f"{base}_shape"), dtype=np.int64, shape=[len(perm)])
    indices = gs.Constant(names(f"{base}_perm"), np.asarray(perm, dtype=np.int64))
    graph.nodes.append(gs.Node(op="Shape", name=names(f"{base}_Shape"), inputs=[source], outputs=[raw]))
    graph.nodes.append(gs.Node(op="Gather", name=names(f"{base}_Gather"), attrs={"axis": 0},
                               inputs=[raw, indices], outputs=[permuted]))
    for shape_node in shapes:
        redirect = shape_node.outputs[0]
        for reader in list(redirect.outputs):
            for index, tensor in enumerate(list(reader.inputs)):
                if tensor is redirect:
                    reader.inputs[index] = permuted
        if is_graph_output(graph, redirect):
            shape_node.op, shape_node.inputs[0] = "Identity", permuted  # the output keeps its name
        else:
            shape_node.outputs.clear()
    return others[0]


def _pair(graph: gs.Graph, first: gs.Node, second: gs.Node, perm: tuple[int, ...],
          counts: dict[str, int]) -> bool | str:
    if is_graph_output(graph, first.outputs[0]):
        return f"{first.outputs[0].name!r} is a graph output"
    second_perm = perm_of(second, len(perm))
    if second_perm is None or len(second_perm) != len(perm):
        return f"the next Transpose's perm {second_perm} does not fit rank {len(perm)}"
    total = compose(perm, second_perm)
    source = first.inputs[0]
    if total == tuple(range(len(total))):
        result = second.outputs[0]
        if is_graph_output(graph, result):
            # the graph output keeps its name: it becomes an Identity of the source
            second.op, second.attrs, second.inputs[0] = "Identity", {}, source
        else:
            for reader in list(result.outputs):
                for index, tensor in enumerate(list(reader.inputs)):
                    if tensor is result:
                        reader.inputs[index] = source
        counts["cancelled"] += 1
        return True
    second.attrs["perm"] = list(total)
    second.inputs[0] = source
    counts["merged"] += 1
    return True


@dataclass
class _Chain:
    """Elementwise nodes a Transpose(perm) moves through, and what it meets at the end."""

    nodes: list[gs.Node]
    end: gs.Node | None  # the Transpose it cancels / merges with, or None when a join ends it
    joins: int  # other Transpose(perm) inputs absorbed on the way


def _sink_problem(graph: gs.Graph, node: gs.Node, moving: gs.Tensor, perm: tuple[int, ...]) -> str | None:
    """Why a Transpose(perm) producing ``moving`` cannot move below the elementwise ``node``."""
    rank = len(perm)
    if len(node.outputs) != 1:
        return f"{node.op} {node.name!r} has {len(node.outputs)} outputs"
    if node.op in UNARY_ELEMENTWISE:
        return None if len(node.inputs) == 1 else f"{node.op} {node.name!r} has {len(node.inputs)} inputs"
    if len(node.inputs) != 2:
        return f"{node.op} {node.name!r} has {len(node.inputs)} inputs"
    for tensor in node.inputs:
        if tensor is moving:
            continue
        if is_const(tensor):
            value = const_value(tensor)
            if value is None or value.ndim > rank:
                return f"constant {tensor.name!r} of {node.op} does not broadcast at rank {rank}"
            continue
        other = tensor.inputs[0] if len(tensor.inputs) == 1 else None
        if other is None or other.op != "Transpose" or not in_onnx_domain(other):
            return f"the other input {tensor.name!r} of {node.op} {node.name!r} is neither a constant nor transposed"
        if perm_of(other, _rank(other.inputs[0])) != perm:
            return f"the other input of {node.op} {node.name!r} is transposed by another perm"
        if single_consumer(tensor) is not node or is_graph_output(graph, tensor):
            return f"{tensor.name!r} (a Transpose output) is read outside {node.op} {node.name!r}"
    if _rank(node.outputs[0]) not in (None, rank):
        return f"{node.op} {node.name!r} broadcasts to rank {_rank(node.outputs[0])}, not {rank}"
    return None


def _chain(graph: gs.Graph, start: gs.Node, perm: tuple[int, ...]) -> _Chain | str:
    """Follow single readers from the Transpose ``start`` through movable elementwise ops."""
    moving, nodes, joins = start.outputs[0], [], 0
    while True:
        if is_graph_output(graph, moving):
            return _Chain(nodes, None, joins) if joins else f"{moving.name!r} is a graph output"
        nxt = single_consumer(moving)
        if nxt is None or not in_onnx_domain(nxt):
            return f"{moving.name!r} is not read by exactly one standard op"
        if nxt.op == "Transpose":
            if not nodes:
                return "no elementwise op in between"  # _pair's case
            return _Chain(nodes, nxt, joins)
        if nxt.op not in UNARY_ELEMENTWISE and nxt.op not in BINARY_ELEMENTWISE:
            if joins:
                return _Chain(nodes, None, joins)
            return f"the chain ends at {nxt.op} {nxt.name!r}, not at a Transpose"
        problem = _sink_problem(graph, nxt, moving, perm)
        if problem is not None:
            return _Chain(nodes, None, joins) if joins else problem
        joins += sum(1 for t in nxt.inputs if t is not moving and not is_const(t))
        nodes.append(nxt)
        moving = nxt.outputs[0]


def _sink(graph: gs.Graph, transpose: gs.Node, first: gs.Node, perm: tuple[int, ...], names: Namer,
          counts: dict[str, int]) -> bool | str:
    """Move ``transpose`` below ``first`` when the chain after it ends in a cancel, a merge or a join."""
    chain = _chain(graph, transpose, perm)
    if isinstance(chain, str):
        return chain
    inverse = _inverse(perm)
    source = transpose.inputs[0]
    moving = transpose.outputs[0]
    # move it below the first node only; the next round moves it on (each step keeps the graph valid)
    node = chain.nodes[0]
    new_inputs: list[gs.Tensor] = []
    for tensor in node.inputs:
        if tensor is moving:
            new_inputs.append(source)
        elif is_const(tensor):
            new_inputs.append(_permuted_constant(tensor, perm, inverse, names))
        else:
            new_inputs.append(tensor.inputs[0].inputs[0])  # the other Transpose(perm)'s input
            counts["joined"] += 1
    result = node.outputs[0]
    inner = gs.Variable(names(f"{result.name}_untransposed"), dtype=result.dtype,
                        shape=_permuted(result.shape, inverse))
    node.inputs.clear()  # gs's synchronized lists: clear + extend keeps the tensors' reader lists right
    node.inputs.extend(new_inputs)
    node.outputs.clear()
    node.outputs.append(inner)
    graph.nodes.append(gs.Node(op="Transpose", name=names(f"{transpose.name}_sunk"), attrs={"perm": list(perm)},
                               inputs=[inner], outputs=[result]))
    return True


def _permuted_constant(tensor: gs.Tensor, perm: tuple[int, ...], inverse: tuple[int, ...], names: Namer) -> gs.Tensor:
    """``c'`` with ``Transpose(perm)(c')`` == ``c`` broadcast at rank len(perm); all-ones shapes stay as they are."""
    value = const_value(tensor)
    assert value is not None  # checked by _sink_problem
    if all(dim == 1 for dim in value.shape):
        return tensor
    full = value.reshape((1,) * (len(perm) - value.ndim) + value.shape)
    return gs.Constant(names(f"{tensor.name}_permuted"), np.ascontiguousarray(np.transpose(full, inverse)))


def _conv_1x1(graph: gs.Graph, transpose: gs.Node, conv: gs.Node, perm: tuple[int, ...], names: Namer,
              counts: dict[str, int]) -> bool | str:
    """NHWC -> Transpose(to NCHW) -> Conv 1x1 -> Transpose(to NHWC)  ==>  MatMul(W^T) [-> Add(b)] on NHWC."""
    if perm != TO_NCHW:
        return False
    conv_out = conv.outputs[0]
    after = single_consumer(conv_out)
    if after is None or after.op != "Transpose" or perm_of(after, 4) != TO_NHWC:
        return False  # a Conv that stays NCHW: no candidate (most GroupNorm sites)
    if is_graph_output(graph, conv_out) or is_graph_output(graph, transpose.outputs[0]):
        return "a tensor around the 1x1 Conv is a graph output"
    if conv.inputs[0] is not transpose.outputs[0] or not is_const(conv.inputs[1]):
        return f"Conv {conv.name!r} reads the Transpose as its weight, or its weight is not constant"
    weight = const_value(conv.inputs[1])
    if weight is None or weight.ndim != 4 or weight.shape[2:] != (1, 1):
        return f"Conv {conv.name!r} is not 1x1 (weight {None if weight is None else weight.shape})"
    attrs = conv.attrs
    for key, neutral in (("strides", [1, 1]), ("dilations", [1, 1]), ("pads", [0, 0, 0, 0])):
        if key in attrs and list(attrs[key]) != neutral:
            return f"Conv {conv.name!r} has {key}={list(attrs[key])}"
    if attrs.get("group", 1) != 1 or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return f"Conv {conv.name!r} is grouped or auto-padded"
    bias = None
    if len(conv.inputs) > 2 and conv.inputs[2].name:
        bias = const_value(conv.inputs[2]) if is_const(conv.inputs[2]) else None
        if bias is None:
            return f"Conv {conv.name!r} has a bias that is not constant"
    source, result = transpose.inputs[0], after.outputs[0]
    base = conv.name or names("conv1x1")
    matrix = gs.Constant(names(f"{base}_matmul_weight"), np.ascontiguousarray(weight[:, :, 0, 0].T))
    if bias is None:
        matmul = gs.Node(op="MatMul", name=names(f"{base}_MatMul"), inputs=[source, matrix])
    else:
        product = gs.Variable(names(f"{base}_matmul"), dtype=result.dtype, shape=result.shape)
        graph.nodes.append(gs.Node(op="MatMul", name=names(f"{base}_MatMul"), inputs=[source, matrix],
                                   outputs=[product]))
        matmul = gs.Node(op="Add", name=names(f"{base}_bias"),
                         inputs=[product, gs.Constant(names(f"{base}_matmul_bias"), bias.reshape(-1))])
    outputs = list(after.outputs)
    after.outputs.clear()
    matmul.outputs = outputs
    graph.nodes.append(matmul)
    counts["Conv_to_MatMul"] += 1
    counts["cancelled"] += 1
    return True


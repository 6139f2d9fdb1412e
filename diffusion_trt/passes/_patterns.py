"""Pattern pieces shared by the fusion passes: operand helpers, a pattern-boundary check, the GELU matcher.

Built on the safety checks of :mod:`._match`. Matchers here return either a match object or a ``str``: the
reason the candidate is not one, which the pass hands to :func:`._match.reject`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from ..artifact.manifest import Backend
from ._match import const_value, in_onnx_domain, is_const, is_graph_output, single_consumer

#: Target names used by the emitters.
ORT_CUDA, ORT_CPU, TENSORRT = "ort-cuda", "ort-cpu", "tensorrt"

#: Relative tolerance for matching exporter constants (sqrt(2) written as 1.4142135 and the like).
CONST_RTOL = 1e-5


#: The backends whose graphs go through a TensorRT ONNX parser: full TensorRT and TensorRT for RTX share one
#: parser's op set, so they share the emitters (and the pass pipelines).
TENSORRT_BACKENDS: tuple[str, ...] = tuple(b.value for b in Backend if b.is_tensorrt)


def target_of(backend: str, device: str) -> str:
    """``"ort-cuda"``, ``"ort-cpu"`` or ``"tensorrt"`` (TensorRT and TensorRT-RTX, which run on CUDA whatever
    ``device`` says).

    Raises:
        ValueError: an unknown backend or device (the message lists the known ones).
    """
    if backend in TENSORRT_BACKENDS:
        return TENSORRT
    if backend == Backend.ORT and device in ("cuda", "cpu"):
        return ORT_CUDA if device == "cuda" else ORT_CPU
    raise ValueError(f"backend={backend!r}, device={device!r} has no fusion emitter; use ort (cpu|cuda), "
                     f"tensorrt or tensorrt-rtx")


def producer(tensor: gs.Tensor, *ops: str) -> gs.Node | None:
    """The standard-domain node that writes ``tensor`` if its op is one of ``ops``, else None."""
    if isinstance(tensor, gs.Constant) or len(tensor.inputs) != 1:
        return None
    node = tensor.inputs[0]
    return node if node.op in ops and in_onnx_domain(node) else None


def consumer(tensor: gs.Tensor, *ops: str) -> gs.Node | None:
    """The single standard-domain node that reads ``tensor`` if its op is one of ``ops``, else None."""
    node = single_consumer(tensor)
    return node if node is not None and node.op in ops and in_onnx_domain(node) else None


def reader(tensor: gs.Tensor, *ops: str) -> gs.Node | None:
    """The one standard-domain node among ``tensor``'s readers whose op is one of ``ops`` (others may read it
    too: the pattern's boundary check names them), else None."""
    found = {id(n): n for n in tensor.outputs if n.op in ops and in_onnx_domain(n)}
    return next(iter(found.values())) if len(found) == 1 else None


def other_input(node: gs.Node, tensor: gs.Tensor) -> gs.Tensor | None:
    """For a binary node that reads ``tensor``: its other input (``tensor`` itself for ``Mul(x, x)``)."""
    if len(node.inputs) != 2:
        return None
    first, second = node.inputs
    if first is tensor:
        return second
    return first if second is tensor else None


def scalar(tensor: gs.Tensor) -> float | None:
    """The value of a one-element constant (any shape: ``[]``, ``[1]``, ``[1, 1]``), else None."""
    if not is_const(tensor):
        return None
    value = const_value(tensor)
    if value is None or value.size != 1 or value.dtype.kind not in "fiu":
        return None
    return float(value.reshape(-1)[0])  # numpy 2: index first, never int()/float() of an array


def is_scalar(tensor: gs.Tensor, expected: float, rtol: float = CONST_RTOL) -> bool:
    """Whether ``tensor`` is a one-element constant equal to ``expected`` within ``rtol``."""
    value = scalar(tensor)
    return value is not None and math.isclose(value, expected, rel_tol=rtol, abs_tol=0.0)


def int_values(tensor: gs.Tensor) -> list[int] | None:
    """The values of an integer constant as a flat list of Python ints, else None."""
    value = const_value(tensor) if is_const(tensor) else None
    if value is None or value.dtype.kind not in "iu":
        return None
    return [int(v) for v in value.reshape(-1).tolist()]


def static_shape(tensor: gs.Tensor) -> list[int] | None:
    """The shape of ``tensor`` if every dim is a known int, else None."""
    shape = tensor.shape
    if shape is None or not all(isinstance(dim, int) and dim >= 0 for dim in shape):
        return None
    return [int(dim) for dim in shape]


def same_shape(a: gs.Tensor, b: gs.Tensor) -> list[int | str] | None:
    """The shape ``a`` and ``b`` provably share (every dim the same int, or the same symbolic name), else None.

    Symbolic dims of a dynamic profile (``"batch"``, ``"height"``...) count as equal only by name: two tensors
    whose dims are unknown (None) or differently named may differ at run time, so they give None.
    """
    shape_a, shape_b = a.shape, b.shape
    if shape_a is None or shape_b is None or len(shape_a) != len(shape_b):
        return None
    for da, db in zip(shape_a, shape_b, strict=True):
        if da is None or db is None or da != db or (isinstance(da, int) and da < 0):
            return None
    return list(shape_a)


def rank(tensor: gs.Tensor) -> int | None:
    """The rank of ``tensor`` if known."""
    return None if tensor.shape is None else len(tensor.shape)


def escape_problem(graph: gs.Graph, tensors: Iterable[gs.Tensor], nodes: Iterable[gs.Node]) -> str | None:
    """Why some tensor inside a pattern is seen from outside it, or None if none is.

    Generalises :func:`._match.internal_edge_problem` to tensors that several pattern nodes read (the
    ``x - mean`` of a LayerNorm feeds both Pow and Div): each tensor must not be a graph output, and every
    node that reads it must be one of ``nodes``.
    """
    inside = {id(node) for node in nodes}
    for tensor in tensors:
        if is_graph_output(graph, tensor):
            return f"{tensor.name!r} is a graph output"
        outside = [node for node in tensor.outputs if id(node) not in inside]
        if outside:
            return f"{tensor.name!r} is also read by {outside[0].op} {outside[0].name!r}"
    return None


class Namer:
    """Hands out tensor / node names the graph does not use yet; build one per pass run (it reads the graph's
    names once) and use it for every node and tensor the pass adds."""

    def __init__(self, graph: gs.Graph) -> None:
        self._taken = set(graph.tensors().keys()) | {node.name for node in graph.nodes}

    def __call__(self, base: str) -> str:
        name, index = base, 0
        while name in self._taken:
            index += 1
            name = f"{base}_{index}"
        self._taken.add(name)
        return name


def redirect_readers(tensor: gs.Tensor, new: gs.Tensor, readers: Iterable[gs.Node] | None = None) -> None:
    """Make ``readers`` (default: every node reading ``tensor``) read ``new`` wherever they read ``tensor``."""
    for reader in list(tensor.outputs if readers is None else readers):
        for i, inp in enumerate(reader.inputs):
            if inp is tensor:
                reader.inputs[i] = new


def import_domain(graph: gs.Graph, domain: str, version: int = 1) -> None:
    """Add ``domain`` (e.g. "com.microsoft") to the opsets the graph imports, unless it is there already."""
    if not any(opset_id.domain == domain for opset_id in graph.import_domains or []):
        graph.import_domains = [*(graph.import_domains or []), helper.make_opsetid(domain, version)]


def replace_output(graph: gs.Graph, last: gs.Node, new_node: gs.Node) -> None:
    """Make ``new_node`` the producer of ``last``'s outputs and add it to the graph.

    ``new_node`` must have been created without outputs; ``last`` keeps no outputs and, with the rest of the
    replaced pattern, becomes dead: the PassManager's cleanup removes it.
    """
    outputs = list(last.outputs)
    last.outputs.clear()
    new_node.outputs = outputs
    graph.nodes.append(new_node)


# --- GELU -------------------------------------------------------------------------------------------------


@dataclass
class GeluMatch:
    """A decomposed GELU: ``output = gelu(x)``; ``nodes`` and ``internal`` are the pattern's nodes and tensors."""

    x: gs.Tensor
    output: gs.Tensor
    approximate: str  # "none" (erf) or "tanh"
    nodes: list[gs.Node] = field(default_factory=list)
    internal: list[gs.Tensor] = field(default_factory=list)


_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_TANH_CUBE_COEF = 0.044715


def _scaled_input(tensor: gs.Tensor, divisor: float) -> tuple[gs.Tensor, gs.Node] | None:
    """``x`` and the node when ``tensor = x / divisor`` (Div) or ``x * (1/divisor)`` (Mul, either order)."""
    node = producer(tensor, "Div", "Mul")
    if node is None or len(node.inputs) != 2:
        return None
    first, second = node.inputs
    if node.op == "Div":
        return (first, node) if is_scalar(second, divisor) else None
    for var, const in ((first, second), (second, first)):
        if is_scalar(const, 1.0 / divisor) and not is_const(var):
            return var, node
    return None


def _plus_one(tensor: gs.Tensor) -> gs.Node | None:
    """The single Add that computes ``tensor + 1`` (either order)."""
    add = consumer(tensor, "Add")
    if add is None:
        return None
    other = other_input(add, tensor)
    return add if other is not None and is_scalar(other, 1.0) else None


def _gelu_tail(x: gs.Tensor, one_plus: gs.Tensor) -> tuple[gs.Tensor, list[gs.Node], list[gs.Tensor]] | str:
    """Match ``0.5 * x * one_plus`` in the three associations torch and hand-written code produce.

    (a) ``(x * one_plus) * 0.5``   (b) ``x * (one_plus * 0.5)``   (c) ``(x * 0.5) * one_plus``
    Every operand order is accepted. Returns (output, nodes, internal tensors) or a reason.
    """
    first = consumer(one_plus, "Mul")
    if first is None:
        return "1 + f(x) is not read by exactly one Mul"
    other = other_input(first, one_plus)
    if other is None:
        return "unexpected Mul arity"
    if other is x or is_scalar(other, 0.5):  # (a) or (b): one more Mul by 0.5 or by x
        second = consumer(first.outputs[0], "Mul")
        if second is None:
            return "x * (1 + f(x)) is not read by exactly one Mul"
        last = other_input(second, first.outputs[0])
        if last is None or not ((other is x and is_scalar(last, 0.5)) or (other is not x and last is x)):
            return "the final Mul is not by 0.5 / by x"
        return second.outputs[0], [first, second], [first.outputs[0]]
    half = producer(other, "Mul")  # (c)
    factor = other_input(half, x) if half is not None else None
    if half is not None and factor is not None and factor is not x and is_scalar(factor, 0.5):
        return first.outputs[0], [half, first], [other]
    return "the Mul after 1 + f(x) multiplies neither by x nor by 0.5"


def match_gelu_erf(erf: gs.Node) -> GeluMatch | str:
    """``x * 0.5 * (1 + erf(x / sqrt(2)))`` around the Erf node ``erf`` (all operand orders torch emits)."""
    scaled = _scaled_input(erf.inputs[0], _SQRT2)
    if scaled is None:
        return "the Erf input is not x / sqrt(2)"
    x, div = scaled
    add = _plus_one(erf.outputs[0])
    if add is None:
        return "erf(x / sqrt(2)) is not read by exactly one Add(1)"
    tail = _gelu_tail(x, add.outputs[0])
    if isinstance(tail, str):
        return tail
    output, tail_nodes, tail_internal = tail
    return GeluMatch(x, output, "none", [div, erf, add, *tail_nodes],
                     [div.outputs[0], erf.outputs[0], add.outputs[0], *tail_internal])


def _cube_of(tensor: gs.Tensor) -> tuple[gs.Tensor, list[gs.Node]] | None:
    """``x`` and the nodes when ``tensor = Pow(x, 3)`` or ``x * (x * x)`` (either order)."""
    pow_node = producer(tensor, "Pow")
    if pow_node is not None and is_scalar(pow_node.inputs[1], 3.0):
        return pow_node.inputs[0], [pow_node]
    outer = producer(tensor, "Mul")
    if outer is None:
        return None
    for x, square in (outer.inputs, reversed(outer.inputs)):
        inner = producer(square, "Mul")
        if inner is not None and inner.inputs[0] is x and inner.inputs[1] is x:
            return x, [inner, outer]
    return None


def match_gelu_tanh(tanh: gs.Node) -> GeluMatch | str:
    """``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))`` around the Tanh node ``tanh``."""
    outer = producer(tanh.inputs[0], "Mul")
    if outer is None or len(outer.inputs) != 2:
        return "the Tanh input is not a Mul by sqrt(2/pi)"
    inner = next((t for t, c in (outer.inputs, reversed(outer.inputs)) if is_scalar(c, _SQRT_2_OVER_PI)), None)
    add = producer(inner, "Add") if inner is not None else None
    if add is None:
        return "the Tanh input is not sqrt(2/pi) * (x + c * x^3)"
    for x, cubic in (add.inputs, reversed(add.inputs)):
        coef = producer(cubic, "Mul")
        if coef is None:
            continue
        for cube, c in (coef.inputs, reversed(coef.inputs)):
            found = _cube_of(cube) if is_scalar(c, _TANH_CUBE_COEF) else None
            if found is not None and found[0] is x:
                plus = _plus_one(tanh.outputs[0])
                if plus is None:
                    return "tanh(...) is not read by exactly one Add(1)"
                tail = _gelu_tail(x, plus.outputs[0])
                if isinstance(tail, str):
                    return tail
                output, tail_nodes, tail_internal = tail
                cube_nodes = found[1]
                nodes = [*cube_nodes, coef, add, outer, tanh, plus, *tail_nodes]
                internal = [n.outputs[0] for n in (*cube_nodes, coef, add, outer, tanh, plus)] + tail_internal
                return GeluMatch(x, output, "tanh", nodes, internal)
    return "the Tanh input is not sqrt(2/pi) * (x + 0.044715 * x^3)"


def per_channel(value: np.ndarray, channels: int, tensor_rank: int) -> bool:
    """Whether a constant of this shape broadcasts per channel (axis 1) against a rank-``tensor_rank`` tensor:
    ``(C, 1, ..., 1)`` with ``tensor_rank - 2`` trailing ones, optionally with leading ones (``(1, C, 1, 1)``)."""
    shape = list(value.shape)
    trailing = tensor_rank - 2
    if len(shape) < trailing + 1 or len(shape) > tensor_rank:
        return False
    if shape[len(shape) - trailing - 1] != channels or any(d != 1 for d in shape[len(shape) - trailing:]):
        return False
    return all(d == 1 for d in shape[: len(shape) - trailing - 1])


# --- small shape arithmetic -------------------------------------------------------------------------------

#: Ops :func:`shape_values` evaluates; enough for the bounds torch writes for ``chunk`` / ``split`` / ``view``.
_SHAPE_OPS = frozenset({"Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Add", "Sub", "Mul", "Div",
                        "Identity"})


def shape_values(tensor: gs.Tensor, depth: int = 12) -> list[int | None] | None:
    """The flat int values of a small shape-arithmetic tensor, each None where it depends on an unknown dim.

    Evaluates constants and Shape / Gather / Unsqueeze / Squeeze / Concat / Cast / Add / Sub / Mul / Div chains
    over static dims, so a pass can read e.g. the ``Slice`` bounds torch computes from ``Shape(x)[-1] // 2``
    without waiting for fold_constants (which folds them only once infer_shapes has run). Returns None for any
    other producer. Div truncates toward zero, as ONNX integer Div does.
    """
    if depth == 0:
        return None
    if is_const(tensor):
        values = int_values(tensor)
        return list(values) if values is not None else None
    node = producer(tensor, *_SHAPE_OPS)
    if node is None:
        return None
    if node.op == "Shape":
        dims = node.inputs[0].shape
        if dims is None:
            return None
        known = [d if isinstance(d, int) and d >= 0 else None for d in dims]
        start, end = node.attrs.get("start", 0), node.attrs.get("end", len(known))
        return known[start:end]
    args = [shape_values(t, depth - 1) for t in node.inputs[:1 if node.op in ("Unsqueeze", "Squeeze") else None]]
    if any(a is None for a in args):
        return None
    if node.op in ("Unsqueeze", "Squeeze", "Cast", "Identity"):
        return args[0]
    if node.op == "Concat":
        return [v for a in args for v in a]
    if node.op == "Gather":
        data, index = args
        if node.attrs.get("axis", 0) != 0 or any(i is None or not -len(data) <= i < len(data) for i in index):
            return None
        return [data[i] for i in index]
    left, right = args
    if len(left) != len(right) and 1 not in (len(left), len(right)):
        return None
    size = max(len(left), len(right))
    left, right = (left * size if len(left) == 1 else left), (right * size if len(right) == 1 else right)
    out: list[int | None] = []
    for a, b in zip(left, right, strict=True):
        if a is None or b is None or (node.op == "Div" and b == 0):
            out.append(None)
        elif node.op == "Div":
            out.append(int(a / b) if (a < 0) != (b < 0) else a // b)
        else:
            out.append({"Add": a + b, "Sub": a - b, "Mul": a * b}[node.op])
    return out

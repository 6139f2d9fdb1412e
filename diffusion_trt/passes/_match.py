"""Safety checks shared by the fusion passes: who consumes a tensor, is it a graph output, is it really constant.

A fusion replaces a chain of nodes by one; it is only safe when nothing else sees the tensors inside the chain
(one consumer each, none a graph output) and when the values it bakes in are constants. Every candidate a pass
turns down goes through :func:`reject`, so a pass that fired 0 times can explain itself at DEBUG::

    rejections: list[Rejection] = []
    ...
    if (reason := internal_edge_problem(graph, mid)) is not None:
        rejections.append(reject("fuse_gelu", node, reason))
        continue
    ...
    return PassResult(modified=fused > 0, counts={"Gelu": fused, "rejected": len(rejections)})
"""

from __future__ import annotations

import contextvars
import logging
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.ir.tensor import LazyValues, SparseValues

logger = logging.getLogger(__name__)

#: Attributes of a Constant node that hold a numeric value, and the dtype ONNX gives each.
_CONSTANT_ATTR_DTYPES: dict[str, type[np.generic]] = {
    "value_float": np.float32,
    "value_floats": np.float32,
    "value_int": np.int64,
    "value_ints": np.int64,
}


def single_consumer(tensor: gs.Tensor) -> gs.Node | None:
    """The only node that reads ``tensor``, or None if zero or several nodes read it.

    A node that reads the tensor twice (``Mul(x, x)``) counts once. This does not know about graph outputs:
    a tensor can have one consumer and still be a graph output; see :func:`internal_edge_problem`.
    """
    consumers = {id(node): node for node in tensor.outputs}
    if len(consumers) != 1:
        return None
    return next(iter(consumers.values()))


def is_graph_output(graph: gs.Graph, tensor: gs.Tensor) -> bool:
    """Whether ``tensor`` is one of ``graph``'s outputs (compared by name, as gs does)."""
    return any(output.name == tensor.name for output in graph.outputs)


def internal_edge_problem(graph: gs.Graph, tensor: gs.Tensor) -> str | None:
    """Why ``tensor`` cannot disappear inside a fusion, or None if it can.

    It can when exactly one node reads it and it is not a graph output. The reason is a short phrase for
    :func:`reject`, e.g. ``"'h' has 2 consumers (Add, Mul)"``.
    """
    if is_graph_output(graph, tensor):
        return f"{tensor.name!r} is a graph output"
    if single_consumer(tensor) is None:
        ops = ", ".join(node.op for node in tensor.outputs) or "none"
        count = len({id(node) for node in tensor.outputs})
        return f"{tensor.name!r} has {count} consumers ({ops})"
    return None


def in_onnx_domain(node: gs.Node) -> bool:
    """Whether ``node`` is a standard ONNX op (gs gives the default domain as None), not a custom/plugin op."""
    return node.domain in (None, "", "ai.onnx")


def _constant_node(tensor: gs.Tensor) -> gs.Node | None:
    if isinstance(tensor, gs.Constant) or len(tensor.inputs) != 1:
        return None
    node = tensor.inputs[0]
    if node.op != "Constant" or not in_onnx_domain(node) or len(node.attrs) != 1:
        return None
    return node


def constant_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of ``tensor`` if it is a constant, else None.

    A constant is a gs.Constant (an initializer) or the output of a ``Constant`` node whose value is a tensor,
    float(s) or int(s) (string and sparse values give None). Lazily loaded weights are read without caching
    the NumPy copy in the graph, so call this on small tensors (scales, shapes, epsilons), not on every weight.
    Values whose dtype NumPy lacks (bfloat16, fp8) come back as gs loads them (float32).
    """
    if isinstance(tensor, gs.Constant):
        values = tensor._values
        if isinstance(values, SparseValues):
            return None
        return values.load() if isinstance(values, LazyValues) else values
    node = _constant_node(tensor)
    if node is None:
        return None
    (name, value), = node.attrs.items()
    if name == "value" and isinstance(value, gs.Constant):
        return constant_value(value)
    if name in _CONSTANT_ATTR_DTYPES:
        return np.asarray(value, dtype=_CONSTANT_ATTR_DTYPES[name])
    return None


def is_constant(tensor: gs.Tensor) -> bool:
    """Whether :func:`constant_value` would return a value, without loading it."""
    if isinstance(tensor, gs.Constant):
        return not isinstance(tensor._values, SparseValues)
    node = _constant_node(tensor)
    if node is None:
        return False
    (name, value), = node.attrs.items()
    if name == "value":
        return isinstance(value, gs.Constant) and is_constant(value)
    return name in _CONSTANT_ATTR_DTYPES


@dataclass(frozen=True)
class Rejection:
    """One candidate a pass turned down, and why."""

    pass_name: str
    op: str
    node: str
    reason: str


def reject(pass_name: str, node: gs.Node, reason: str) -> Rejection:
    """Log at DEBUG why ``pass_name`` did not rewrite at ``node``, and return it for the pass to count.

    The message goes to the logger ``diffusion_trt.passes.<pass_name>``, so ``--log-level`` for one pass
    shows its rejections alone: ``fuse_gelu: rejected Erf 'Erf_12': 'h' has 2 consumers (Add, Mul)``.
    """
    rejection = Rejection(pass_name, node.op, node.name, reason)
    logging.getLogger(f"{__package__}.{pass_name}").debug(
        "%s: rejected %s %r: %s", pass_name, node.op, node.name, reason
    )
    collected = _COLLECTED.get()
    if collected is not None:
        collected.append(rejection)
    return rejection


#: The rejections of the pass now running under :func:`collect_rejections` (None: nobody collects).
_COLLECTED: contextvars.ContextVar[list[Rejection] | None] = contextvars.ContextVar("rejections", default=None)

#: A quoted tensor / node name inside a reason: ``'h' has 2 consumers`` and ``'x.1' has 2 consumers`` are one reason.
_QUOTED = re.compile(r"'[^']*'")


@contextmanager
def collect_rejections() -> Iterator[list[Rejection]]:
    """Collect every :func:`reject` made inside the ``with`` block (the PassManager wraps each pass in one)."""
    collected: list[Rejection] = []
    token = _COLLECTED.set(collected)
    try:
        yield collected
    finally:
        _COLLECTED.reset(token)


def rejection_reasons(rejections: list[Rejection]) -> dict[str, int]:
    """Rejections grouped by reason, most frequent first: ``{"Softmax: '…' has 2 consumers (Add, Mul)": 28}``.

    Quoted names are replaced by ``'…'`` so that the same reason at different sites counts as one; the op of the
    node the pass looked at leads the key.
    """
    counts = Counter(f"{r.op}: {_QUOTED.sub(chr(39) + '…' + chr(39), r.reason)}" for r in rejections)
    return dict(counts.most_common())

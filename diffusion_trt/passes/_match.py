"""The fusion driver and the safety checks shared by the passes: who consumes a tensor, is it a graph output, is it
really constant, and the loop every fusion runs.

A fusion is a rule, not a loop (after onnxscript's rewriter: a rule = pattern + condition + replacement): the pass
gives :func:`fuse_each` a ``match`` (the pattern: a match object, a rejection reason, or None for a node that is no
candidate), a ``check`` (the condition: None or a reason) and a ``rewrite`` (the replacement: what it emitted, as
counts), and the driver owns the iteration, the rejections and the tally::

    tally = fuse_each(graph, "fuse_gelu", match=_match, check=_check, rewrite=_rewrite)
    return PassResult.of(tally, ("Gelu",))          # {"Gelu": 16, "rejected": 2, "skipped_for_target": 0}

A fusion replaces a chain of nodes by one; it is only safe when nothing else sees the tensors inside the chain
(one consumer each, none a graph output) and when the values it bakes in are constants. Every candidate a pass
turns down goes through :func:`reject`, so a pass that fired 0 times can explain itself at DEBUG.
"""

from __future__ import annotations

import contextvars
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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


def through_identity(tensor: gs.Tensor) -> gs.Tensor:
    """The tensor an Identity chain copies (the TorchScript exporter shares equal weights, e.g. all-ones norm
    scales, through Identity nodes until eliminate_dead_nodes / fold_constants merge them)."""
    for _ in range(16):
        node = tensor.inputs[0] if not isinstance(tensor, gs.Constant) and len(tensor.inputs) == 1 else None
        if node is None or node.op != "Identity" or not in_onnx_domain(node):
            break
        tensor = node.inputs[0]
    return tensor


def const_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of ``tensor`` if it is a constant, looking through Identity nodes (:func:`through_identity`),
    else None.

    A constant is a gs.Constant (an initializer) or the output of a ``Constant`` node whose value is a tensor,
    float(s) or int(s) (string and sparse values give None). Lazily loaded weights are read without caching
    the NumPy copy in the graph, so call this on small tensors (scales, shapes, epsilons), not on every weight.
    Values whose dtype NumPy lacks (bfloat16, fp8) come back as gs loads them (float32).
    """
    tensor = through_identity(tensor)
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
        return const_value(value)
    if name in _CONSTANT_ATTR_DTYPES:
        return np.asarray(value, dtype=_CONSTANT_ATTR_DTYPES[name])
    return None


def is_const(tensor: gs.Tensor) -> bool:
    """Whether :func:`const_value` would return a value (looking through Identity nodes), without loading it."""
    tensor = through_identity(tensor)
    if isinstance(tensor, gs.Constant):
        return not isinstance(tensor._values, SparseValues)
    node = _constant_node(tensor)
    if node is None:
        return False
    (name, value), = node.attrs.items()
    if name == "value":
        return isinstance(value, gs.Constant) and is_const(value)
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
#: A quote opens only where no letter precedes it (so the apostrophe of "input's" opens nothing).
_QUOTED = re.compile(r"(?<![A-Za-z])'[^']*'")


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


# --- the fusion driver ------------------------------------------------------------------------------------

M = TypeVar("M")

#: What a rewrite reports: the count key of what it emitted (one), counts per key, or None: matched and checked,
#: but the target has nothing better (counted as ``skipped_for_target``).
Emitted = str | Mapping[str, int] | None


@dataclass
class Tally:
    """What :func:`fuse_each` did: ``counts`` summed over the rewrites, ``rejected`` candidates (each logged at DEBUG
    with its reason by :func:`reject`), ``skipped`` candidates (the rewrite returned None)."""

    counts: Counter[str] = field(default_factory=Counter)
    rejected: int = 0
    skipped: int = 0

    def record(self, *keys: str, skipped: bool = True) -> dict[str, int]:
        """The pass's counts: ``keys`` in order (0 when never emitted), then ``rejected`` and, unless
        ``skipped=False``, ``skipped_for_target``: ``{"Gelu": 16, "rejected": 2, "skipped_for_target": 0}``."""
        out = {key: self.counts[key] for key in keys}
        out["rejected"] = self.rejected
        if skipped:
            out["skipped_for_target"] = self.skipped
        return out


def fuse_each(graph: gs.Graph, pass_name: str, *, match: Callable[[gs.Node], M | str | None],
              check: Callable[[M], str | None] | None = None, rewrite: Callable[[M], Emitted]) -> Tally:
    """Run one fusion rule over every node of ``graph`` (the nodes as they are when it starts), in graph order.

    For each node: ``match(node)`` is None (no candidate: not counted), a ``str`` (the reason it is not a match:
    rejected) or a match; a match goes to ``check`` (None: fine, a ``str``: rejected with that reason) and then to
    ``rewrite``, which changes the graph and returns what it emitted (:data:`Emitted`). Rejections go through
    :func:`reject` under ``pass_name``. A rewrite at one node may leave nodes that are later in the list dead: the
    rule's ``match`` must reject or skip them as it does any other node (the PassManager's cleanup removes them).
    """
    tally = Tally()
    for node in list(graph.nodes):
        found = match(node)
        if found is None:
            continue
        problem = found if isinstance(found, str) else (check(found) if check is not None else None)
        if problem is not None:
            reject(pass_name, node, problem)
            tally.rejected += 1
            continue
        emitted = rewrite(found)
        if emitted is None:
            tally.skipped += 1
        else:
            tally.counts.update({emitted: 1} if isinstance(emitted, str) else emitted)
    return tally


@dataclass
class Found(Generic[M]):
    """What :func:`find_each` found: the ``matches`` that passed their check, in graph order, and how many
    candidates were ``rejected``."""

    matches: list[M]
    rejected: int


def find_each(graph: gs.Graph, pass_name: str, *, match: Callable[[gs.Node], M | str | None],
              check: Callable[[M], str | None] | None = None) -> Found[M]:
    """:func:`fuse_each` without rewriting: for passes that decide what to emit once every site is known (a pass
    that is off, a target that takes none of them) or that must see the graph unchanged while matching."""
    matches: list[M] = []

    def keep(found: M) -> Emitted:
        matches.append(found)
        return {}

    return Found(matches, fuse_each(graph, pass_name, match=match, check=check, rewrite=keep).rejected)

"""Remove nodes no graph output depends on, and merge constants that hold identical values."""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import onnx_graphsurgeon as gs
from onnx import helper

from ._match import const_value, is_const
from ._weights import constant_layout, digest, raw_bytes
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)


def eliminate_dead_nodes(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Remove dead nodes and deduplicate identical constants.

    Matches:  (a) nodes whose outputs reach no graph output          x -> Relu -> (nothing)
              (b) constants equal in dtype, shape and bytes            W1 = [0.5, 2] , W2 = [0.5, 2]
                  (initializers and outputs of Constant nodes, which the TorchScript exporter emits by the dozen)
    Emits:    (a) nothing  (b) one constant; every reader of W2 reads W1 instead (W2 and its node go)
                  A(x, W1)   B(y, W2)   ->   A(x, W1)   B(y, W1)
    Why:      smaller graph, faster later passes; exporters repeat the same small constants (epsilons, shape
              vectors, scales) hundreds of times in a UNet, and identical inputs let later passes and the
              backends' CSE treat them as one.
    Requires: nothing. Graph inputs and outputs are never removed or renamed (a Constant that is a graph
              output is left alone); unused graph inputs stay (they are the model's interface). Constants
              in subgraphs and functions and weights held in external files that were not loaded are left
              as they are.

    Candidates are grouped by (dtype, shape) and only groups of two or more are read; their bytes are hashed
    (sha256) and equal hashes are confirmed byte for byte before merging. Reading is one tensor at a time.

    Counts: ``nodes_removed`` (dead nodes and merged Constant nodes), ``constants_deduped`` (constants
    merged, initializers and Constant nodes alike).
    """
    before = len(graph.nodes)
    graph.cleanup()
    deduped = _dedupe_constants(graph)
    if deduped:
        graph.cleanup()
    removed = before - len(graph.nodes)
    return PassResult(modified=bool(removed or deduped),
                      counts={"nodes_removed": removed, "constants_deduped": deduped})


class _Candidate:
    """A constant that may be merged: an initializer, or the output of a ``Constant`` node."""

    def __init__(self, tensor: gs.Tensor, value: np.ndarray | None = None) -> None:
        self.tensor = tensor
        self.value = value  # set for Constant-node outputs (small, already in memory as an attribute)

    def layout(self) -> tuple[int, tuple[int, ...]] | None:
        if self.value is None:
            assert isinstance(self.tensor, gs.Constant)
            return constant_layout(self.tensor)
        return helper.np_dtype_to_tensor_dtype(self.value.dtype), tuple(self.value.shape)

    def data(self) -> bytes | None:
        if self.value is None:
            assert isinstance(self.tensor, gs.Constant)
            return raw_bytes(self.tensor)
        return np.ascontiguousarray(self.value).tobytes()


def _candidates(graph: gs.Graph) -> list[_Candidate]:
    interface = {tensor.name for tensor in (*graph.inputs, *graph.outputs)}
    found = []
    for tensor in graph.tensors().values():
        if tensor.name in interface:
            continue
        if isinstance(tensor, gs.Constant):
            found.append(_Candidate(tensor))
        elif tensor.inputs and tensor.inputs[0].op == "Constant" and is_const(tensor):
            value = const_value(tensor)
            if value is not None and value.dtype != object:
                found.append(_Candidate(tensor, value))
    return found


def _dedupe_constants(graph: gs.Graph) -> int:
    by_layout: dict[tuple[int, tuple[int, ...]], list[_Candidate]] = defaultdict(list)
    for candidate in _candidates(graph):
        layout = candidate.layout()
        if layout is not None:
            by_layout[layout].append(candidate)

    deduped = 0
    for group in by_layout.values():
        if len(group) < 2:
            continue
        kept: dict[str, _Candidate] = {}  # sha256 -> first candidate with those bytes
        for candidate in group:
            data = candidate.data()
            if data is None:
                continue
            first = kept.setdefault(digest(data), candidate)
            if first is candidate or first.data() != data:  # confirm: never trust a hash alone
                continue
            _rebind_readers(candidate.tensor, first.tensor)
            deduped += 1
            logger.debug("%s -> %s (%d bytes)", candidate.tensor.name, first.tensor.name, len(data))
    return deduped


def _rebind_readers(old: gs.Tensor, new: gs.Tensor) -> None:
    """Make every node that reads ``old`` (including nodes in subgraphs) read ``new``."""
    for node in list(old.outputs):
        for index, tensor in enumerate(node.inputs):
            if tensor is old:
                node.inputs[index] = new

"""Refuse a graph that a TensorRT ONNX parser cannot map: any node outside the default ONNX domain."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator

import onnx_graphsurgeon as gs

from ._match import in_onnx_domain
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "check_onnx_domain"

#: How many distinct foreign ops the error names before it says "and N more".
_NAMED = 6


def check_onnx_domain(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Check that every node, in subgraphs too, is a standard ONNX op (domain "" or "ai.onnx").

    Matches:  any node whose domain is not the default one, e.g. com.microsoft.QuickGelu / MultiHeadAttention /
              SkipLayerNormalization / GroupNorm / BiasAdd (the ORT targets' contrib ops), or a custom domain
    Emits:    nothing; the graph is not changed. A foreign node raises (the PassManager names this pass).
    Why:      the TensorRT (and TensorRT-RTX) ONNX parser maps the ai.onnx ops only: it refuses a contrib op as a
              missing plugin ("Plugin not found"), and TensorRT-RTX 1.7.1's parser crashes the process (SIGSEGV) on
              com.microsoft.MultiHeadAttention, so this must be found before the build stage parses the file.
              Run last in the TensorRT pipelines: it proves the emitters (and an input graph that already held
              contrib ops) left nothing the parser lacks.
    Requires: nothing.

    Counts: ``nodes`` (checked, subgraph nodes included), ``foreign`` (always 0: a foreign node raises).

    Raises:
        ValueError: nodes outside the default domain; the message gives the ops with their counts and a node name
            of each, and the fix (build for --backend ort, or export the model without contrib ops).
    """
    foreign: Counter[str] = Counter()
    example: dict[str, str] = {}
    nodes = 0
    for node in _all_nodes(graph):
        nodes += 1
        if in_onnx_domain(node):
            continue
        key = f"{node.domain}.{node.op}"
        foreign[key] += 1
        example.setdefault(key, node.name)
    if foreign:
        named = ", ".join(f"{op} x{count} (e.g. {example[op]!r})" for op, count in foreign.most_common(_NAMED))
        more = f" and {len(foreign) - _NAMED} more op type(s)" if len(foreign) > _NAMED else ""
        raise ValueError(
            f"{sum(foreign.values())} node(s) outside the default ONNX domain, which the TensorRT ONNX parser "
            f"cannot map: {named}{more}; {ctx.component} for backend {ctx.backend} must hold ai.onnx ops only: "
            "build it with --backend ort, or give an ONNX without ONNX Runtime contrib ops (the raw export)"
        )
    logger.debug("%s: %d nodes, all in the default ONNX domain", NAME, nodes)
    return PassResult(modified=False, counts={"nodes": nodes, "foreign": 0})


def _all_nodes(graph: gs.Graph) -> Iterator[gs.Node]:
    """Every node of ``graph`` and of the subgraphs in its nodes' attributes (If / Loop / Scan bodies)."""
    for node in graph.nodes:
        yield node
        for value in node.attrs.values():
            for sub in value if isinstance(value, list) else [value]:
                if isinstance(sub, gs.Graph):
                    yield from _all_nodes(sub)

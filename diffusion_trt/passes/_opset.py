"""Raising a graph's default-domain opset inside a pass, only where no node changes meaning.

A fusion that emits ``GroupNormalization`` (per-channel affine from opset 21) or ``Gelu`` (opset 20) into an
opset-17 export must raise the graph's opset. That is safe only if every standard-domain node keeps its
meaning at the new opset: for each node we compare the schema version in force at the current opset with the
one at the target; a node whose schema changed must be in :data:`COMPATIBLE_BUMPS` (changes that only add
types, optional inputs or attributes whose defaults keep the old behaviour). Anything else (``ReduceMean``
with an ``axes`` attribute at 18, ``Split`` without sizes at 18, ``GridSample`` at 20, ...) blocks the raise
and the caller rejects its candidate with the reason.

The opset lives in two places in onnx-graphsurgeon: ``graph.opset`` and the ``""`` entry of
``graph.import_domains`` (which wins on export); :func:`raise_opset` updates both. ``PassContext.opset`` is
not updated (a pass never changes its context): later passes must read ``graph.opset``.
"""

from __future__ import annotations

import functools

import onnx
import onnx_graphsurgeon as gs

from ._match import in_onnx_domain

#: (op, since_version) schema changes between opsets 17 and 21 under which a node written for the older
#: version means the same: new types, optional inputs/attributes defaulting to the old behaviour, new modes.
COMPATIBLE_BUMPS: frozenset[tuple[str, int]] = frozenset(
    {
        ("AveragePool", 19), ("Cast", 19), ("Cast", 21), ("CastLike", 19), ("CastLike", 21),
        ("Constant", 19), ("Constant", 21), ("ConstantOfShape", 20), ("ConstantOfShape", 21),
        ("DequantizeLinear", 19), ("DequantizeLinear", 21), ("Equal", 19), ("Flatten", 21),
        ("Identity", 19), ("Identity", 21), ("If", 19), ("If", 21), ("IsInf", 20), ("IsNaN", 20),
        ("Loop", 19), ("Loop", 21), ("LpPool", 18), ("Pad", 18), ("Pad", 19), ("Pad", 21),
        ("QuantizeLinear", 19), ("QuantizeLinear", 21), ("ReduceMax", 20), ("ReduceMin", 20),
        ("Reshape", 19), ("Reshape", 21), ("Resize", 18), ("Resize", 19), ("Scan", 19), ("Scan", 21),
        ("ScatterElements", 18), ("ScatterND", 18), ("Shape", 19), ("Shape", 21), ("Size", 19), ("Size", 21),
        ("Squeeze", 21), ("Transpose", 21), ("Unsqueeze", 21),
    }
)

#: Reduce ops whose ``axes`` attribute became an input at opset 18: compatible only without the attribute.
_AXES_TO_INPUT_AT_18 = frozenset(
    {"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
     "ReduceProd", "ReduceSumSquare"}
)


def graph_opset(graph: gs.Graph) -> int:
    """The default-domain opset the graph will be exported with (``import_domains`` wins over ``opset``)."""
    for opset_id in graph.import_domains or ():
        if opset_id.domain in ("", "ai.onnx"):
            return int(opset_id.version)
    return int(graph.opset)


@functools.cache
def _schema_version(op: str, opset: int) -> int | None:
    try:
        return int(onnx.defs.get_schema(op, opset).since_version)
    except onnx.defs.SchemaError:
        return None


@functools.cache
def _versions(op: str) -> tuple[int, ...]:
    """Every since_version of the standard op ``op``, ascending."""
    return tuple(sorted({int(schema.since_version) for schema in onnx.defs.get_all_schemas_with_history()
                         if schema.name == op and schema.domain == ""}))


def _node_problem(node: gs.Node, current: int, target: int) -> str | None:
    old, new = _schema_version(node.op, current), _schema_version(node.op, target)
    if old is None or new is None:
        return f"{node.op} {node.name!r} has no ONNX schema at opset {current} or {target}"
    if old == new:
        return None
    for version in (v for v in _versions(node.op) if old < v <= new):
        if (node.op, version) in COMPATIBLE_BUMPS:
            continue
        if version == 18 and node.op in _AXES_TO_INPUT_AT_18 and "axes" not in node.attrs:
            continue
        if version == 18 and node.op == "Split" and len(node.inputs) >= 2 and node.inputs[1].name:
            continue  # sizes given as an input: same meaning at 18
        return f"{node.op} {node.name!r} changes meaning at opset {version}"
    return None


def opset_raise_problem(graph: gs.Graph, target: int) -> str | None:
    """Why the graph's default-domain opset cannot be raised to ``target``, or None if it can (or is there).

    Walks subgraphs (If / Loop / Scan bodies) too. Nodes outside the ONNX domain are not affected.
    """
    current = graph_opset(graph)
    if current >= target:
        return None
    if target > onnx.defs.onnx_opset_version():
        return f"the installed onnx {onnx.__version__} knows opsets up to {onnx.defs.onnx_opset_version()} only"
    for sub in (graph, *graph.subgraphs(recursive=True)):
        for node in sub.nodes:
            if in_onnx_domain(node) and (problem := _node_problem(node, current, target)) is not None:
                return f"cannot raise the opset from {current} to {target}: {problem}"
    return None


def raise_opset(graph: gs.Graph, target: int) -> bool:
    """Set the default-domain opset to ``target`` if it is lower; return whether it changed.

    Call :func:`opset_raise_problem` first: this does not check the nodes.
    """
    if graph_opset(graph) >= target:
        return False
    graph.opset = target
    if graph.import_domains is not None:
        # gs keeps the imported model's own opset_import container here: build new entries, never edit those
        graph.import_domains = [
            onnx.helper.make_opsetid(o.domain, target if o.domain in ("", "ai.onnx") else o.version)
            for o in graph.import_domains
        ]
    return True


def ensure_opset(graph: gs.Graph, target: int) -> str | None:
    """Raise the opset to ``target`` where that is safe; return why not otherwise (None: the graph is there)."""
    problem = opset_raise_problem(graph, target)
    if problem is None:
        raise_opset(graph, target)
    return problem


def opset_problem(graph: gs.Graph, target: int, *, may_raise: bool) -> str | None:
    """Why a fusion that emits an op of opset ``target`` cannot emit it in ``graph``, or None if it can.

    It can when the graph has that opset already, or when ``may_raise`` and :func:`ensure_opset` raised it (this
    then changes the graph). Fusions ask once, at their first site (``functools.cache`` around this call), and
    reject every site with the reason: ``"the graph has opset 17 and raising it is off"``.
    """
    if may_raise:
        return ensure_opset(graph, target)
    opset = graph_opset(graph)
    return None if opset >= target else f"the graph has opset {opset} and raising it is off"

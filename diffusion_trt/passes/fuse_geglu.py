"""Fuse the UNet feed-forward's GEGLU (bias add, split in halves, hidden * gelu(gate)) into BiasSplitGelu."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from ._match import const_value, fuse_each, in_onnx_domain, is_const
from ._patterns import (
    ORT_CUDA,
    Namer,
    consumer,
    escape_problem,
    int_values,
    match_gelu_erf,
    other_input,
    producer,
    replace_output,
    shape_values,
    target_of,
)
from .base import PassContext, PassResult

logger = logging.getLogger(__name__)

NAME = "fuse_geglu"

#: Ops of the bound arithmetic the exporter writes for ``chunk`` (see _bound_chain).
_BOUND_OPS = ("Shape", "Gather", "Unsqueeze", "Squeeze", "Concat", "Cast", "Add", "Sub", "Mul", "Div", "Identity")

#: Projection widths (2 x the GEGLU's inner dim) ORT's BiasSplitGelu CUDA kernel accepts
#: (contrib_ops/cuda/diffusion/bias_split_gelu.cc: SD 1.x/2.x inner dims 1280, 2560, 5120).
BIAS_SPLIT_GELU_WIDTHS: frozenset[int] = frozenset({2560, 5120, 10240})


@dataclass
class _GegluMatch:
    projected: gs.Tensor  # MatMul output, before the bias
    bias: gs.Tensor  # constant [2D]
    width: int  # 2D
    last: gs.Node  # Mul(hidden, gelu(gate))
    nodes: list[gs.Node]
    internal: list[gs.Tensor]


def fuse_geglu(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Fuse GEGLU ``h, g = (x @ W + b).chunk(2, -1); h * gelu(g)`` into ORT's BiasSplitGelu (ort-cuda).

    Matches:  MatMul -> Add(b[2D]) -+-> Slice[0:D]  (hidden) ----------------------> Mul -> out
                                    +-> Slice[D:2D] (gate) -> gelu (erf form or Gelu) -^
              Slice bounds constant (axes -1), or one Split(axis -1) into two equal halves; gelu either the
              decomposed erf form or a Gelu node (standard approximate=none, or com.microsoft), so the pass
              works before or after fuse_gelu.
    Emits:    ort-cuda:  com.microsoft.BiasSplitGelu(MatMul output, b) -> out
              others:    nothing; the GELU inside is fuse_gelu's (counted as ``skipped_for_target`` here).
    Why:      one kernel instead of bias add + two slices + GELU + Mul (SD-1.5 UNet: 16 sites).
    Requires: slice bounds constant or computable from static dims (the exporter computes them from
              Shape(proj)[-1]: evaluated here, see _patterns.shape_values, so no second fold_constants is needed);
              ort-cuda: the MatMul output rank 3 and its width in BIAS_SPLIT_GELU_WIDTHS (the kernel's limits;
              other widths are rejected with the reason).

    Counts: ``BiasSplitGelu``, ``rejected`` (reasons at DEBUG), ``skipped_for_target`` (matched, not ort-cuda).
    """
    target = target_of(ctx.backend, ctx.device)
    names = Namer(graph)

    def rewrite(match: _GegluMatch) -> str | None:
        if target != ORT_CUDA:
            return None
        _rewrite(graph, match, names)
        return "BiasSplitGelu"

    tally = fuse_each(graph, NAME, match=_candidate, check=lambda match: _check(graph, match, target),
                      rewrite=rewrite)
    return PassResult.of(tally, "BiasSplitGelu")


def _candidate(node: gs.Node) -> _GegluMatch | str | None:
    """The match at a projection's bias Add that a Slice or Split reads, a reason, or None."""
    if node.op != "Add" or not in_onnx_domain(node) or not node.outputs:
        return None
    if not any(producer(t, "MatMul") is not None for t in node.inputs):
        return None
    if not any(n.op in ("Slice", "Split") for n in node.outputs[0].outputs):
        return None  # an ordinary Linear: not a candidate
    return _match(node)


def _halves(projected: gs.Tensor, width: int) -> tuple[gs.Tensor, gs.Tensor, list[gs.Node]] | str:
    """(hidden, gate, split nodes): the first and second halves of ``projected`` along the last axis."""
    # Shape readers compute the exporter's slice bounds; they are checked through those bounds (and, if they
    # feed anything else, by the boundary check)
    readers = [n for n in {id(n): n for n in projected.outputs}.values() if n.op != "Shape"]
    half = width // 2
    if len(readers) == 1 and readers[0].op == "Split":
        split = readers[0]
        sizes = split.attrs.get("split") or (int_values(split.inputs[1]) if len(split.inputs) > 1 else None)
        equal = sizes == [half, half] or (sizes is None and split.attrs.get("num_outputs", 2) == 2)
        if len(split.outputs) != 2 or not _last_axis(split.attrs.get("axis", 0), projected) or not equal:
            return "the Split is not into two equal halves along the last axis"
        return split.outputs[0], split.outputs[1], [split]
    if len(readers) != 2 or any(n.op != "Slice" for n in readers):
        return "the biased projection is not read by exactly two Slices or one Split"
    ranges = {}
    for node in readers:
        bounds = _slice_range(node, projected, width)
        if isinstance(bounds, str):
            return bounds
        ranges[bounds] = node
    if set(ranges) != {(0, half), (half, width)}:
        return f"the Slices cover {sorted(ranges)}, not the halves [0, {half}) and [{half}, {width})"
    return ranges[(0, half)].outputs[0], ranges[(half, width)].outputs[0], list(ranges.values())


def _bound_chain(slices: list[gs.Node]) -> tuple[list[gs.Node], list[gs.Tensor]]:
    """The shape-arithmetic nodes (Shape(proj) -> Gather -> Div ...) computing the Slices' bounds, and their
    outputs: they die with the pattern, so they belong to it (the boundary check then makes sure nothing else
    reads them)."""
    nodes: dict[int, gs.Node] = {}
    stack = [t for node in slices if node.op == "Slice" for t in node.inputs[1:]]
    while stack:
        tensor = stack.pop()
        node = producer(tensor, *_BOUND_OPS)
        if node is None or id(node) in nodes:
            continue
        nodes[id(node)] = node
        stack.extend(node.inputs if node.op != "Shape" else ())
    found = list(nodes.values())
    return found, [t for node in found for t in node.outputs]


def _last_axis(axis: int, tensor: gs.Tensor) -> bool:
    return axis == -1 or (tensor.shape is not None and axis == len(tensor.shape) - 1)


def _slice_range(node: gs.Node, data: gs.Tensor, width: int) -> tuple[int, int] | str:
    inputs = node.inputs
    if len(inputs) < 3:
        return "a Slice without starts / ends inputs (opset < 10)"
    starts, ends = shape_values(inputs[1]), shape_values(inputs[2])
    axes = int_values(inputs[3]) if len(inputs) > 3 and inputs[3].name else None
    steps = int_values(inputs[4]) if len(inputs) > 4 and inputs[4].name else [1]
    if starts is None or ends is None or None in starts or None in ends or len(starts) != 1 or len(ends) != 1:
        return "the Slice bounds are neither constants nor computable from static dims; run infer_shapes first"
    if axes is None or len(axes) != 1 or not _last_axis(axes[0], data) or steps != [1]:
        return f"a Slice is not along the last axis with step 1 (axes {axes}, steps {steps})"
    start, end = starts[0], ends[0]
    start = start + width if start < 0 else start
    end = min(end + width if end < 0 else end, width)
    return start, end


def _gelu_of(gate: gs.Tensor) -> tuple[gs.Tensor, list[gs.Node], list[gs.Tensor]] | str:
    """(gelu output, nodes, internal tensors) of the erf-GELU applied to ``gate``."""
    readers = list({id(n): n for n in gate.outputs}.values())
    if len(readers) == 1 and readers[0].op == "Gelu" and (
        readers[0].domain == "com.microsoft"
        or (in_onnx_domain(readers[0]) and readers[0].attrs.get("approximate", "none") == "none")
    ):
        return readers[0].outputs[0], readers, []
    for node in readers:
        erf = consumer(node.outputs[0], "Erf") if node.op in ("Div", "Mul") else None
        if erf is None:
            continue
        match = match_gelu_erf(erf)
        if isinstance(match, str):
            return f"the gate's GELU: {match}"
        if match.x is not gate:
            return "the erf-GELU does not read the gate"
        return match.output, match.nodes, match.internal
    return "the gate is not fed to an erf-GELU (tanh GELU has no BiasSplitGelu)"


def _match(add: gs.Node) -> _GegluMatch | str:
    first, second = add.inputs
    projected, bias = (first, second) if producer(first, "MatMul") is not None else (second, first)
    if not is_const(bias):
        return f"the bias {bias.name!r} is not a constant"
    value = const_value(bias)
    if value is None or value.ndim != 1:
        return f"the bias {bias.name!r} is not 1-D (shape {None if value is None else value.shape})"
    width = int(value.shape[0])
    if width % 2 != 0:
        return f"the projection width {width} is odd"
    halves = _halves(add.outputs[0], width)
    if isinstance(halves, str):
        return halves
    hidden, gate, split_nodes = halves
    gelu = _gelu_of(gate)
    if isinstance(gelu, str):
        return gelu
    gelu_out, gelu_nodes, gelu_internal = gelu
    mul = consumer(gelu_out, "Mul")
    if mul is None or other_input(mul, gelu_out) is not hidden:
        return "gelu(gate) is not multiplied by the hidden half"
    bound_nodes, bound_tensors = _bound_chain(split_nodes)
    nodes = [add, *split_nodes, *bound_nodes, *gelu_nodes, mul]
    internal = [projected, add.outputs[0], hidden, gate, *gelu_internal, gelu_out, *bound_tensors]
    return _GegluMatch(projected, bias, width, mul, nodes, internal)


def _check(graph: gs.Graph, match: _GegluMatch, target: str) -> str | None:
    problem = escape_problem(graph, match.internal, match.nodes)
    if problem is not None:
        return problem
    if target == ORT_CUDA:
        shape = match.projected.shape
        if shape is None or len(shape) != 3:
            return f"BiasSplitGelu takes a 3-D input; the projection has shape {shape}"
        if match.width not in BIAS_SPLIT_GELU_WIDTHS:
            return (f"ORT's BiasSplitGelu CUDA kernel takes widths {sorted(BIAS_SPLIT_GELU_WIDTHS)}; "
                    f"this projection is {match.width} wide")
    return None


def _rewrite(graph: gs.Graph, match: _GegluMatch, names: Namer) -> None:
    node = gs.Node(op="BiasSplitGelu", domain="com.microsoft", name=names(f"{match.last.name}_BiasSplitGelu"),
                   inputs=[match.projected, match.bias])
    replace_output(graph, match.last, node)

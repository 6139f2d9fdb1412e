"""Give a dynamic graph's tensors symbolic shapes that say which dims are equal (``h``, ``h*w``, ``h/2``)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from ._export import export_model
from ._match import const_value, in_onnx_domain
from .base import PassContext, PassResult, option
from .infer_shapes import _keeps_data, _stub_weights

logger = logging.getLogger(__name__)

NAME = "infer_symbolic_shapes"

Dim = int | str | None

#: Every value a base dim symbol (``h``, ``w``, ``H``...) takes in any profile is checked, from 1 to this
#: (``config.MAX_IMAGE_SIZE``: the largest image side, in pixels), when two dim expressions are proven equal.
MAX_DIM = 4096

#: Inference rounds at most: each maps one more level of computed dims onto the input symbols that name them
#: (a UNet with ControlNet residuals: one per downsampling level, 3-4).
MAX_ROUNDS = 6

#: An input dim named ``X/k`` (``h/2``: a ControlNet residual's) is ``ceil(X/k)`` of the input dim ``X``: what
#: ``components.symbol_ranges`` gives it, and what k/2 stride-2 3x3 Convs (pad 1) make of X.
_DOWNSAMPLED = re.compile(r"^(\w+)/(\d+)$")


def _relations(value: Mapping[str, str]) -> dict[str, str]:
    return {str(name): str(expr) for name, expr in dict(value).items()}


@dataclass(frozen=True)
class InferSymbolicShapesOptions:
    """The options of :func:`infer_symbolic_shapes`: compile derives them from the components' dim names."""

    #: Input dims that are expressions of other input dims, e.g. ``{"H": "8*h", "W": "8*w"}`` (a ControlNet's
    #: control image is 8x its latent); ``X/k`` names need none (``ceil(X/k)``).
    dim_relations: Mapping[str, str] | None = option("infer_symbolic_shapes_dim_relations", None, dict,
                                                     user=False, convert=_relations)


def infer_symbolic_shapes(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Replace the fresh ``unk__N`` dims ONNX shape inference gives a dynamic graph by symbolic expressions.

    Matches:  tensors of a graph with symbolic input dims whose shapes ONNX inference left as fresh symbols
                  sample:[B2,4,h,w] -> Conv(3x3, pad 1) -> y:[B2,16,unk__0,unk__1]   (a new name per tensor)
    Emits:    the same graph, those dims written as expressions of the input symbols
                  y:[B2,16,h,w];  a stride-2 Conv's output: [B2,32,floor(h/2 - 1/2) + 1, ...];  attention: [B2,h*w,C]
    Why:      the fusions that need both sides of an Add to have one shape (fuse_skip_layer_norm, fuse_bias,
              fuse_skip_group_norm, merge_conv_biases) and cancel_transposes compare dims by name (``same_shape``):
              with a name per tensor a dynamic profile's SD-1.5 UNet kept 0 of their 150 sites a static one fuses.
    Also:     ``Shape(x) -> Gather(const)`` reads of dims that are ints (diffusers' ``inner_dim =
              hidden_states.shape[1]`` after each proj_in) become constants: fold_constants ran before the
              shapes were known, and such a Shape reader keeps cancel_transposes off the 1x1 Conv it reads.
    Requires: infer_shapes first (this keeps every int it found). Skips graphs whose inputs are all static.

    ONNX Runtime's symbolic shape inference (``onnxruntime.tools.symbolic_shape_infer``, sympy) computes the dims,
    with ``auto_merge`` off: two dims get the same expression only when they are equal for every value of the
    input symbols (a broadcast between two different symbols gives an unknown dim, never a merged one), so a
    fusion that relies on equal names is right at every size of the profile. It runs on the graph with the large
    weights stubbed as inputs, as infer_shapes does. A tensor takes the result only where it refines the shape it
    has (same rank, every int kept); graph inputs and outputs keep theirs (the manifest and size buckets read
    their dim names). A failure of the inference is logged and changes nothing.

    Input dims that are functions of others: a ControlNet residual input of the UNet is ``[B2, 32, h/2, w/2]``,
    where the graph's own down path computes ``floor(h/2 - 1/2) + 1``; a ControlNet adds its control image's
    embedding (from ``H`` = 8h) to the latent's (``h``). Those are the same numbers, but not the same symbols, so
    the Add's output dims were unknown and so was everything after it: unet_controlnet fused 5 of the UNet's 45
    SkipGroupNorms and 4 of its 32 SkipLayerNorms, a ControlNet none. A computed dim of one base symbol that equals
    an input symbol at every value 1..``MAX_DIM`` of that base (``X/k`` is ``ceil(X/k)``; ``dim_relations`` gives
    others, e.g. ``H = 8*h``) is renamed to it (ORT's ``suggested_merge_``), and the inference runs again, up to
    ``MAX_ROUNDS`` times. The check is exhaustive over every size a profile allows, so no broadcast is merged away.

    Options: ``infer_symbolic_shapes_dim_relations`` (:class:`InferSymbolicShapesOptions`; compile sets it).

    Counts: ``shapes_refined`` (tensors whose shape changed), ``dims_refined`` (dims that did),
    ``static_dims_folded`` (Gathers of static dims made constants), ``failed`` (1 when the inference raised),
    ``dims_merged`` (computed dim expressions renamed to the input dim they equal).
    """
    counts = {"shapes_refined": 0, "dims_refined": 0, "static_dims_folded": 0, "failed": 0, "dims_merged": 0}
    if not _dynamic(graph):
        return PassResult(modified=False, counts=counts)
    relations = dict(ctx.options_for(InferSymbolicShapesOptions).dim_relations or {})
    try:
        shapes, counts["dims_merged"] = _symbolic_shapes(graph, relations)
    except Exception as err:  # noqa: BLE001 - sympy / ORT tooling failures: the ONNX shapes stay
        logger.warning("%s: symbolic shape inference failed on %s (%s: %s); the fusions see ONNX's shapes",
                       NAME, ctx.component, type(err).__name__, err)
        counts["failed"] = 1
        shapes = {}
    boundary = {t.name for t in (*graph.inputs, *graph.outputs)}
    for name, tensor in graph.tensors().items():
        if not isinstance(tensor, gs.Variable) or name in boundary or tensor.shape is None or name not in shapes:
            continue
        merged = refine(tensor.shape, shapes[name])
        if merged is None:
            continue
        changed = sum(old != new for old, new in zip(tensor.shape, merged, strict=True))
        tensor.shape = merged
        counts["shapes_refined"] += 1
        counts["dims_refined"] += changed
    counts["static_dims_folded"] = fold_static_dims(graph)
    return PassResult(modified=counts["shapes_refined"] > 0 or counts["static_dims_folded"] > 0, counts=counts)


def fold_static_dims(graph: gs.Graph) -> int:
    """Turn each ``Shape(x) -> Gather(axis 0, constant index)`` whose gathered dims of x are all ints into an int64
    constant (the Gather's output then has no producer; the Shape goes at cleanup when nothing else reads it).
    Returns how many Gathers were folded."""
    folded = 0
    for node in list(graph.nodes):
        if node.op != "Gather" or not in_onnx_domain(node) or node.attrs.get("axis", 0) != 0 or not node.inputs:
            continue
        shape_node = node.inputs[0].inputs[0] if len(node.inputs[0].inputs) == 1 else None
        if shape_node is None or shape_node.op != "Shape" or not in_onnx_domain(shape_node):
            continue
        value = _static_gather(shape_node, const_value(node.inputs[1]))
        if value is None:
            continue
        out = node.outputs[0]
        out.to_constant(value)  # gs: the tensor becomes a Constant; the Gather is dead (no outputs)
        node.outputs.clear()
        folded += 1
    return folded


def _static_gather(shape_node: gs.Node, index: np.ndarray | None) -> np.ndarray | None:
    """The int64 value ``Gather(Shape(x), index)`` always has, or None when a gathered dim is not an int."""
    dims = shape_node.inputs[0].shape
    if dims is None or index is None or index.dtype.kind not in "iu" or index.ndim > 1:
        return None
    start, end = shape_node.attrs.get("start", 0), shape_node.attrs.get("end", None)
    window = list(dims)[slice(start, end)]
    picked = []
    for i in np.asarray(index).reshape(-1):
        i = int(i)
        if not -len(window) <= i < len(window):
            return None
        dim = window[i]
        if not isinstance(dim, int) or dim < 0:
            return None
        picked.append(dim)
    return np.asarray(picked, dtype=np.int64).reshape(np.asarray(index).shape)


def _dynamic(graph: gs.Graph) -> bool:
    return any(t.shape is None or not all(isinstance(d, int) for d in t.shape) for t in graph.inputs)


def refine(old: list[Dim], new: list[Dim]) -> list[Dim] | None:
    """``old`` with its non-int dims replaced by ``new``'s known ones, or None when nothing changes or ``new``
    contradicts ``old`` (another rank, or another int where ``old`` has an int: ``old`` is kept)."""
    if len(old) != len(new):
        return None
    merged: list[Dim] = []
    for have, got in zip(old, new, strict=True):
        if isinstance(have, int) and have >= 0:
            if got != have:
                return None
            merged.append(have)
        else:
            merged.append(have if got is None or got == "" else got)
    return merged if merged != list(old) else None


def _symbolic_shapes(graph: gs.Graph, relations: Mapping[str, str]) -> tuple[dict[str, list[Dim]], int]:
    """The tensors' shapes from ORT's symbolic shape inference, by name (unknown dims as None), and how many
    computed dims were renamed to the input dim they equal (:func:`_equal_dims`)."""
    model = export_model(graph, do_type_check=False, data=_keeps_data)
    _stub_weights(model)
    values = _input_dim_values(model, relations)
    merges: dict[str, str] = {}
    inference = _infer(model, merges)
    for _ in range(MAX_ROUNDS):
        found = _equal_dims(inference.symbolic_dims_, values, merges)
        if not found:
            break
        logger.debug("%s: %s", NAME, ", ".join(f"{k} -> {v}" for k, v in sorted(found.items())))
        merges.update(found)
        inference = _infer(model, merges)
    shapes: dict[str, list[Dim]] = {}
    for info in inference.out_mp_.graph.value_info:
        if info.type.HasField("tensor_type") and info.type.tensor_type.HasField("shape"):
            shapes[info.name] = [_dim(d) for d in info.type.tensor_type.shape.dim]
    return shapes, len(merges)


def _infer(model: onnx.ModelProto, merges: Mapping[str, str]) -> Any:  # ORT's SymbolicShapeInference
    """ORT's symbolic shape inference of ``model``, each computed dim named in ``merges`` renamed to its value."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    # SymbolicShapeInference.infer_shapes' steps without its ending: where a dim stays unknown it raises and
    # writes sym_shape_infer_temp.onnx into the working directory; the tensors it did type are still right
    inference = SymbolicShapeInference(2**31 - 1, False, False, 0)  # int_max, auto_merge off, no rank guessing
    inference._preprocess(model)
    # a computed dim whose text is a key becomes the input symbol (ORT's _update_computed_dims), and a broadcast
    # of the two is no longer one of unequal dims (_merge_symbols)
    inference.suggested_merge_ = dict(merges)
    complete = False
    while inference.run_:
        complete = inference._infer_impl()
    if not complete:
        logger.debug("%s: some shapes stay unknown; the tensors before them are refined", NAME)
    return inference


def _input_dim_values(model: onnx.ModelProto, relations: Mapping[str, str]) -> dict[str, object]:
    """Each input dim symbol's value as a sympy expression of the base symbols (itself for a base): ``X/k`` is
    ``ceiling(X/k)`` when X is an input dim too, ``relations`` give others (``{"H": "8*h"}``; one whose symbols are
    not all input dims is left out)."""
    import sympy

    names = {d.dim_param for i in model.graph.input for d in i.type.tensor_type.shape.dim if d.dim_param}
    symbols = {n: sympy.Symbol(n, integer=True, positive=True) for n in names}
    values: dict[str, object] = dict(symbols)
    for name in names:
        m = _DOWNSAMPLED.match(name)
        if m and m.group(1) in names:
            values[name] = sympy.ceiling(symbols[m.group(1)] / int(m.group(2)))
    for name, text in relations.items():
        if name not in names:
            continue
        try:
            expr = sympy.sympify(text, locals=dict(symbols))
        except (sympy.SympifyError, TypeError, SyntaxError) as err:
            logger.warning("%s: dim relation %s=%r does not parse (%s); ignored", NAME, name, text, err)
            continue
        if expr.free_symbols <= {symbols[n] for n in names if n != name}:
            values[name] = expr
    # a value in terms of derived symbols (h/2 of H = 8*h) in terms of the bases
    bases = {symbols[n]: values[n] for n in names}
    return {n: sympy.sympify(v).subs(bases) for n, v in values.items()}


def _equal_dims(dims: Mapping[str, object], values: Mapping[str, object],
                merges: Mapping[str, str]) -> dict[str, str]:
    """The computed dims (ORT's ``symbolic_dims_``: text -> sympy expression) of one base symbol that equal an input
    dim symbol at every value 1..MAX_DIM of that base, not yet in ``merges``: text -> the input symbol's name."""
    import sympy

    grid = np.arange(1, MAX_DIM + 1, dtype=np.float64)  # exact: the dims are small integers and halves

    def table(expr: object) -> tuple[object, np.ndarray] | None:
        free = sympy.sympify(expr).free_symbols
        if len(free) != 1:
            return None
        (base,) = free
        try:
            got = np.broadcast_to(sympy.lambdify(base, expr, "numpy")(grid), grid.shape).astype(np.float64)
        except (TypeError, ValueError, NameError, ZeroDivisionError):  # Max/Mod/Piecewise...: not a candidate
            return None
        return base, got

    targets: dict[tuple[object, bytes], str] = {}
    for name in sorted(values):
        tab = table(values[name])
        if tab is not None:
            targets.setdefault((tab[0], tab[1].tobytes()), name)
    found: dict[str, str] = {}
    for text, expr in dims.items():
        if text in values or text in merges or isinstance(expr, int) or not hasattr(expr, "free_symbols"):
            continue
        subbed = sympy.sympify(expr).subs({sympy.Symbol(n, integer=True, positive=True): v
                                           for n, v in values.items()})
        tab = table(subbed)
        if tab is not None and (tab[0], tab[1].tobytes()) in targets:
            found[text] = targets[(tab[0], tab[1].tobytes())]
    return found


def _dim(dim: onnx.TensorShapeProto.Dimension) -> Dim:
    if dim.HasField("dim_value"):
        return int(dim.dim_value)
    if dim.HasField("dim_param") and not dim.dim_param.startswith("unk__"):
        return dim.dim_param
    return None

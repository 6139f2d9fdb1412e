"""Convert a float32 graph to float16, with fp32 islands, a schema-checked block list and Casts at the borders."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import TensorProto

from diffusion_trt.errors import PassError

from ._match import const_value, in_onnx_domain, is_graph_output
from .base import PassContext, PassResult, option
from .fold_constants import _lower_constant_nodes
from .infer_shapes import InferShapesOptions, annotate_shapes

logger = logging.getLogger(__name__)

FP16_MAX = float(np.finfo(np.float16).max)  # 65504
#: A float32 constant at or beyond this magnitude is float32's own extreme, an infinity stand-in (torch's
#: ``masked_fill(finfo(float32).min)`` in attention masks): it becomes fp16's extreme (+-65504), the same stand-in
#: (counted as ``clipped``). Any other value beyond +-65504 (a BatchNorm variance of 4.8e7) is never clipped: the
#: nodes that read it stay float32 (``fp32_wide_constants``).
F32_EXTREME = 1e38

#: Op types kept in float32 by default, and why:
#:   Sin, Cos       the UNet timestep embedding: arguments up to ~1000 rad lose +-0.5 rad in fp16.
#:   Range, CumSum  index arithmetic: fp16 has 11 bits of mantissa, counts above 2048 are not exact.
#:   RandomNormal, RandomNormalLike, RandomUniform, RandomUniformLike, Multinomial, EyeLike: their output
#:                  dtype is an attribute, not a type constraint; kept rather than rewritten.
#:   If, Loop, Scan subgraphs are not converted: the node stays fp32, and its inputs/outputs get Casts.
#:   TopK, NonMaxSuppression, RoiAlign: index-producing ops with no benefit from fp16.
#: Slots whose type constraint does not allow float16 (Resize scales, LayerNormalization Mean/InvStdDev...)
#: stay float32 on every node: that is read from the ONNX op schema, not listed here.
DEFAULT_FP32_OPS: frozenset[str] = frozenset(
    {"Sin", "Cos", "Range", "CumSum", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
     "Multinomial", "EyeLike", "If", "Loop", "Scan", "TopK", "NonMaxSuppression", "RoiAlign"}
)
#: Contrib / custom-domain ops whose float slots are all of one type T with float16 allowed (output indices
#: listed are float32-only). Any other non-ONNX op is an fp32 island.
FP16_CUSTOM_OPS: dict[tuple[str, str], frozenset[int]] = {
    ("com.microsoft", "MultiHeadAttention"): frozenset(),
    ("com.microsoft", "GroupNorm"): frozenset(),
    ("com.microsoft", "SkipGroupNorm"): frozenset(),
    ("com.microsoft", "BiasSplitGelu"): frozenset(),
    ("com.microsoft", "BiasAdd"): frozenset(),
    ("com.microsoft", "BiasGelu"): frozenset(),
    ("com.microsoft", "FastGelu"): frozenset(),
    ("com.microsoft", "Gelu"): frozenset(),
    ("com.microsoft", "QuickGelu"): frozenset(),
    ("com.microsoft", "SkipLayerNormalization"): frozenset({1, 2}),
}
#: Input slots of contrib ops that must stay float32 in an fp16 graph. ORT 1.31's CUDA GroupNorm kernel
#: refuses fp16 gamma/beta at run time ("GroupNorm only supports gamma and beta in float type", seen on an
#: H200), although the op schema's type constraint M admits float16.
FP32_CUSTOM_INPUTS: dict[tuple[str, str], frozenset[int]] = {
    ("com.microsoft", "GroupNorm"): frozenset({1, 2}),
    ("com.microsoft", "SkipGroupNorm"): frozenset({1, 2}),
}

#: Fused attention ops that ``convert_fp16_fp32_attention`` keeps whole in float32: their scores live in the kernel.
FUSED_ATTENTION_OPS: frozenset[tuple[str, str]] = frozenset(
    {("com.microsoft", "MultiHeadAttention"), ("com.microsoft", "Attention")}
)
#: Ops that may sit between the scores MatMul and its Softmax (scale, additive bias or mask, dtype casts).
_SCORE_PATH_OPS = frozenset({"Mul", "Div", "Add", "Cast"})

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)


@dataclass(frozen=True)
class ConvertFp16Options:
    """The options of :func:`convert_fp16` and of the range check around it (fp16_check.py); per component."""

    #: Op types kept fp32, added to :data:`DEFAULT_FP32_OPS`.
    fp32_ops: tuple[str, ...] = option("convert_fp16_fp32_ops", (), list)
    #: Node names kept fp32 (e.g. from :func:`find_fp16_overflow` or the range check).
    fp32_nodes: tuple[str, ...] = option("convert_fp16_fp32_nodes", (), list)
    #: Graph inputs and outputs stay float32, with Casts inside.
    keep_io_types: bool = option("convert_fp16_keep_io_types", False, bool)
    #: Graph inputs that stay float32 (compile: the spec's inputs pinned to float32, e.g. the UNet ``timestep``).
    fp32_inputs: tuple[str, ...] = option("convert_fp16_fp32_inputs", (), list, user=False)
    #: Keep attention scores float32 (compile: UNets whose config says ``upcast_attention``).
    fp32_attention: bool = option("convert_fp16_fp32_attention", False, bool, user=False)
    #: fp16_check.py: run the calibration range check around the conversion.
    range_check: bool = option("convert_fp16_range_check", True, bool)
    #: fp16_check.py: activations above this |x| are kept fp32 (None: its ``FP16_SAFE_MAX``).
    range_max: float | None = option("convert_fp16_range_max", None, int, convert=float)
    #: fp16_check.py: graphs with more bytes of weights are converted unchecked (None: ``MAX_CHECKED_WEIGHT_BYTES``).
    range_check_max_bytes: int | None = option("convert_fp16_range_check_max_bytes", None, int)


def convert_fp16(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Rewrite float32 tensors, weights and Cast targets to float16, except in fp32 islands.

    Matches:  every node, classified fp16 or fp32 (block list, named islands, custom ops not known to have fp16)
                  x:f32 -> Conv(W:f32) -> Sin -> Resize(scales:f32) -> y:f32
    Emits:    float16 types and weights; Casts only where an fp16 and an fp32 part meet
                  x:f16 -> Conv(W:f16) -> Cast(f32) -> Sin -> Cast(f16) -> Resize(scales:f32) -> y:f16
    Why:      half the memory traffic and tensor-core math; islands keep the ops that overflow or lose precision.
    Requires: dtypes known (the inference step of infer_shapes, :func:`.infer_shapes.annotate_shapes`, runs here
              first); run after every fusion (the Casts it inserts break
              patterns). Subgraphs (If/Loop) are left as they are.

    Per input/output slot, the ONNX op schema decides whether float16 is allowed (Resize ``scales`` and
    LayerNormalization ``Mean``/``InvStdDev`` are float-only), so a converted graph passes
    ``onnx.checker.check_model(full_check=True)``. Float constants read in fp16 are converted once (values
    beyond +-65504 are never clipped: a node that reads one stays fp32, counted in ``fp32_wide_constants``; only
    float32's own extremes, +-3.4e38 infinity stand-ins, become +-65504, counted in ``clipped``); a constant read by
    both kinds is duplicated. ``Cast(to=FLOAT)`` in an fp16
    node becomes ``Cast(to=FLOAT16)``, ``ConstantOfShape``'s float value becomes float16. Afterwards no-op Casts
    (to == input type) and lossless round trips (f16 -> f32 -> f16) are removed.

    Options (``ctx.options`` keys, read as :class:`ConvertFp16Options`; ctx is per component, so these are per
    component):
        convert_fp16_fp32_ops (Iterable[str]): op types kept fp32, added to :data:`DEFAULT_FP32_OPS`.
        convert_fp16_fp32_nodes (Iterable[str]): node names kept fp32 (e.g. from :func:`find_fp16_overflow`).
        convert_fp16_keep_io_types (bool): graph inputs and outputs stay float32, with Casts inside; default False.
        convert_fp16_fp32_inputs (Iterable[str]): graph inputs that stay float32 (e.g. the UNet ``timestep``:
            Euler-family schedulers give fractional timesteps that fp16 rounds to 0.5 above 512).
        convert_fp16_fp32_attention (bool): keep attention scores float32 (:func:`attention_score_nodes`): each
            Softmax with the Q.K^T MatMul and the scale/bias ops between them, and fused attention ops whole. What
            diffusers' ``upcast_attention`` does (SD 2.x UNets, whose scores pass 65504); default False.

    Counts: ``fp16_nodes``, ``fp32_nodes`` (nodes with float data kept fp32), ``constants`` (converted),
        ``clipped`` (constants whose float32 extremes became fp16's), ``fp32_wide_constants`` (nodes kept fp32
        because they read a constant beyond fp16's range; only when there are any), ``Cast_inserted``,
        ``Cast_removed``; with
        ``convert_fp16_fp32_attention``: ``fp32_attention`` (attention sites kept fp32).

    Raises:
        PassError: a float tensor read by a node has no known dtype after shape inference.
    """
    options = ctx.options_for(ConvertFp16Options)
    fp32_ops = DEFAULT_FP32_OPS | frozenset(options.fp32_ops)
    fp32_names = frozenset(options.fp32_nodes)
    keep_io = options.keep_io_types
    fp32_inputs = frozenset(options.fp32_inputs)
    opset = _graph_opset(graph)
    if opset > ctx.opset:  # a fusion raised the opset (Gelu-20, GroupNormalization-21): read schemas there
        ctx = dataclasses.replace(ctx, opset=opset)
    _lower_constant_nodes(graph)
    graph.cleanup()  # drops the emptied Constant nodes
    annotate_shapes(graph, ctx.options_for(InferShapesOptions))  # the dtypes the classification below reads
    counts = {"fp16_nodes": 0, "fp32_nodes": 0, "constants": 0, "clipped": 0, "Cast_inserted": 0,
              "Cast_removed": 0}
    wide: dict[int, bool] = {}  # id(constant) -> holds a value beyond fp16's range (a weight read by several nodes)
    fp32_ids: set[int] = set()
    if options.fp32_attention:
        sites = attention_score_nodes(graph)
        fp32_ids = {id(node) for site in sites for node in site}
        counts["fp32_attention"] = len(sites)

    # 1. classify: which nodes compute in fp16, and which dtype each float slot wants.
    wants: list[tuple[gs.Node, int, np.dtype | None]] = []  # (node, input slot, wanted dtype or None: any)
    for node in graph.nodes:
        fp16 = _fp16_node(node, fp32_ops, fp32_names) and id(node) not in fp32_ids
        if fp16 and _reads_wide_constant(node, wide):
            fp16 = False
            counts["fp32_wide_constants"] = counts.get("fp32_wide_constants", 0) + 1  # listed only when > 0
            logger.debug("convert_fp16: %s %r kept fp32: it reads a constant beyond +-%g", node.op, node.name,
                         FP16_MAX)
        has_float = any(_is_float(t) for t in (*node.inputs, *node.outputs) if t.name)
        if has_float:
            counts["fp16_nodes" if fp16 else "fp32_nodes"] += 1
        for slot, tensor in enumerate(node.inputs):
            if not tensor.name or not _is_float(tensor):
                continue
            if node.op == "Cast" and in_onnx_domain(node):
                wants.append((node, slot, None))  # a Cast reads any type
            else:
                wants.append((node, slot, _F16 if fp16 and _slot_allows_fp16(node, slot, ctx, True) else _F32))
        if fp16:
            _convert_outputs(node, ctx)

    # 2. graph inputs (outputs are handled last: keep_io may need a Cast after the producer).
    for tensor in graph.inputs:
        if _is_float(tensor) and not keep_io and tensor.name not in fp32_inputs:
            tensor.dtype = _F16

    # 3. reconcile every read with its producer: converted constants or a Cast (shared per tensor and dtype).
    constant_wants: dict[str, set[np.dtype | None]] = {}
    for node, slot, want in wants:
        if isinstance(node.inputs[slot], gs.Constant):
            constant_wants.setdefault(node.inputs[slot].name, set()).add(want)
    constants: dict[tuple[str, str], gs.Constant] = {}
    casts: dict[tuple[str, str], gs.Variable] = {}
    for node, slot, want in wants:
        tensor = node.inputs[slot]
        if isinstance(tensor, gs.Constant):
            if want is not None and np.dtype(tensor.dtype) != want:
                key = (tensor.name, want.name)
                if key not in constants:
                    constants[key] = _converted_constant(tensor, want, counts, constant_wants[tensor.name] == {want})
                node.inputs[slot] = constants[key]
            continue
        if tensor.dtype is None:
            raise PassError(f"{ctx.component}: tensor {tensor.name!r} read by {node.op} {node.name!r} has no known "
                            "dtype; run infer_shapes before convert_fp16 or give the custom op's output a dtype")
        if want is None or np.dtype(tensor.dtype) == want or not _is_float(tensor):
            continue
        key = (tensor.name, want.name)
        if key not in casts:
            casts[key] = _insert_cast(graph, tensor, want, f"{tensor.name}/to_{want.name}")
            counts["Cast_inserted"] += 1
        node.inputs[slot] = casts[key]

    # 4. graph outputs: float32 with keep_io, else float16, whatever the precision of the node that writes them.
    io_type = _F32 if keep_io else _F16
    for index, tensor in enumerate(graph.outputs):
        if _is_float(tensor) and np.dtype(tensor.dtype) != io_type:
            name = tensor.name
            tensor.name = f"{name}/{np.dtype(tensor.dtype).name}"
            out = gs.Variable(name, dtype=io_type, shape=tensor.shape)
            to = TensorProto.FLOAT if keep_io else TensorProto.FLOAT16
            graph.nodes.append(gs.Node("Cast", f"convert_fp16/Cast_{name}", attrs={"to": to},
                                       inputs=[tensor], outputs=[out]))
            graph.outputs[index] = out
            counts["Cast_inserted"] += 1

    counts["Cast_removed"] = _remove_redundant_casts(graph)
    return PassResult(modified=counts["fp16_nodes"] > 0 or counts["constants"] > 0, counts=counts)


# --- classification --------------------------------------------------------------------------------------


def _graph_opset(graph: gs.Graph) -> int:
    """The default-domain opset the graph will be exported with (gs: ``import_domains`` wins over ``opset``)."""
    for opset_id in graph.import_domains or ():
        if opset_id.domain in ("", "ai.onnx"):
            return int(opset_id.version)
    return int(graph.opset or 0)


def _is_float(tensor: gs.Tensor) -> bool:
    return tensor.dtype is not None and np.dtype(tensor.dtype) in (_F32, _F16)


def attention_score_nodes(graph: gs.Graph) -> list[list[gs.Node]]:
    """The nodes that compute attention scores, one list per attention site.

    Matches:  MatMul(q, kT) -> [Mul|Div(scale)]* -> [Add(bias)]* -> [Cast]* -> Softmax   (walked up from each Softmax)
              com.microsoft MultiHeadAttention / Attention                                (the whole op)
    Why:      these are the values diffusers' ``upcast_attention`` computes in fp32; the probabilities after the
              Softmax are in [0, 1] and the second MatMul may stay fp16.
    A Softmax whose input does not lead to a MatMul this way is still returned, with the ops walked above it: they
    are kept fp32 too. Node identity, not names, is what the caller keeps (names from fusions may repeat).
    """
    sites: list[list[gs.Node]] = []
    for node in graph.nodes:
        if not in_onnx_domain(node):
            if (node.domain, node.op) in FUSED_ATTENTION_OPS:
                sites.append([node])
            continue
        if node.op != "Softmax":
            continue
        site = [node]
        tensor: gs.Tensor | None = node.inputs[0]
        while tensor is not None and len(tensor.inputs) == 1:
            producer = tensor.inputs[0]
            if not in_onnx_domain(producer) or producer.op not in (_SCORE_PATH_OPS | {"MatMul"}):
                break
            site.append(producer)
            if producer.op == "MatMul":
                break
            # the scores input: a variable made by the score path (a constant scale or a mask leads elsewhere)
            tensor = next((t for t in producer.inputs if isinstance(t, gs.Variable) and len(t.inputs) == 1
                           and in_onnx_domain(t.inputs[0]) and t.inputs[0].op in (_SCORE_PATH_OPS | {"MatMul"})),
                          None)
        if site[-1].op != "MatMul":
            logger.debug("convert_fp16: Softmax %r has no Q.K^T MatMul above it; kept fp32 with %d op(s) above it",
                         node.name, len(site) - 1)
        sites.append(site)
    return sites


def _beyond_fp16(values: np.ndarray | None) -> bool:
    """Whether float ``values`` hold a finite value fp16 cannot: |x| in (65504, :data:`F32_EXTREME`)."""
    if values is None or values.size == 0 or values.dtype.kind != "f":
        return False
    magnitude = np.abs(values)
    return bool(np.any((magnitude > FP16_MAX) & (magnitude < F32_EXTREME)))


def _reads_wide_constant(node: gs.Node, wide: dict[int, bool]) -> bool:
    """Whether ``node`` reads a float constant (an input, or ConstantOfShape's ``value``) beyond fp16's range."""
    tensors = [t for t in node.inputs if isinstance(t, gs.Constant)]
    if node.op == "ConstantOfShape" and isinstance(node.attrs.get("value"), gs.Constant):
        tensors.append(node.attrs["value"])
    for tensor in tensors:
        if id(tensor) not in wide:
            wide[id(tensor)] = _beyond_fp16(const_value(tensor))
        if wide[id(tensor)]:
            return True
    return False


def _fp16_node(node: gs.Node, fp32_ops: frozenset[str], fp32_names: frozenset[str]) -> bool:
    if node.name in fp32_names or node.op in fp32_ops:
        return False
    if in_onnx_domain(node):
        return not any(isinstance(value, gs.Graph) for value in node.attrs.values())
    return (node.domain, node.op) in FP16_CUSTOM_OPS


def _schema(node: gs.Node, ctx: PassContext) -> Any:
    try:
        return onnx.defs.get_schema(node.op, ctx.opset, "")
    except onnx.defs.SchemaError:
        return None


def _slot_allows_fp16(node: gs.Node, slot: int, ctx: PassContext, is_input: bool) -> bool:
    """Whether input/output ``slot`` of ``node`` may be float16, read from the ONNX op schema."""
    if not in_onnx_domain(node):
        if is_input:
            return slot not in FP32_CUSTOM_INPUTS.get((node.domain, node.op), frozenset())
        return slot not in FP16_CUSTOM_OPS.get((node.domain, node.op), frozenset())
    schema = _schema(node, ctx)
    if schema is None:
        return False
    formal = schema.inputs if is_input else schema.outputs
    if not formal:
        return False
    param = formal[min(slot, len(formal) - 1)]  # variadic: the last formal parameter repeats
    allowed = next((c.allowed_type_strs for c in schema.type_constraints if c.type_param_str == param.type_str),
                   [param.type_str])
    return "tensor(float16)" in allowed


def _convert_outputs(node: gs.Node, ctx: PassContext) -> None:
    """Set the dtype of an fp16 node's float32 outputs (and the attributes that decide them) to float16."""
    if in_onnx_domain(node) and node.op == "Cast":
        if node.attrs.get("to") == TensorProto.FLOAT:
            node.attrs["to"] = TensorProto.FLOAT16
            node.outputs[0].dtype = _F16
        return
    if in_onnx_domain(node) and node.op == "ConstantOfShape":
        value = node.attrs.get("value")
        if isinstance(value, gs.Constant) and np.dtype(value.dtype) == _F32:
            node.attrs["value"] = gs.Constant(value.name, np.clip(value.values, -FP16_MAX, FP16_MAX).astype(_F16))
            node.outputs[0].dtype = _F16
        return
    for slot, tensor in enumerate(node.outputs):
        if tensor.name and tensor.dtype is not None and np.dtype(tensor.dtype) == _F32 \
                and _slot_allows_fp16(node, slot, ctx, False):
            tensor.dtype = _F16


# --- rewriting -------------------------------------------------------------------------------------------


def _converted_constant(tensor: gs.Constant, want: np.dtype, counts: dict[str, int], in_place: bool) -> gs.Constant:
    values = const_value(tensor)
    assert values is not None
    if want == _F16 and values.size and float(np.nanmax(np.abs(values))) > FP16_MAX:
        # only float32 extremes get here (a node reading any other value beyond fp16's range stayed fp32)
        counts["clipped"] += 1
        logger.debug("%s: float32 extremes (+-%g) become fp16's (+-%g)", tensor.name, F32_EXTREME, FP16_MAX)
        values = np.clip(values, -FP16_MAX, FP16_MAX)
    counts["constants"] += 1
    converted = np.asarray(values).astype(want)
    if in_place:
        tensor.values = converted
        return tensor
    return gs.Constant(f"{tensor.name}/{want.name}", converted)


def _insert_cast(graph: gs.Graph, tensor: gs.Tensor, want: np.dtype, name: str) -> gs.Variable:
    out = gs.Variable(name, dtype=want, shape=tensor.shape)
    to = TensorProto.FLOAT16 if want == _F16 else TensorProto.FLOAT
    graph.nodes.append(gs.Node("Cast", f"convert_fp16/Cast_{name}", attrs={"to": to}, inputs=[tensor],
                               outputs=[out]))
    return out


def _remove_redundant_casts(graph: gs.Graph) -> int:
    """Bypass Casts to the type their input already has, and lossless round trips f16 -> f32 -> f16."""
    removed = 0
    for node in list(graph.nodes):
        if node.op != "Cast" or not in_onnx_domain(node) or not node.outputs or not node.inputs:
            continue
        out, source = node.outputs[0], node.inputs[0]
        to = onnx.helper.tensor_dtype_to_np_dtype(int(node.attrs["to"]))
        origin: gs.Tensor | None = None
        if source.dtype is not None and np.dtype(source.dtype) == to:
            origin = source
        else:
            inner = source.inputs[0] if len(source.inputs) == 1 else None
            if inner is not None and inner.op == "Cast" and in_onnx_domain(inner) and inner.inputs:
                first = inner.inputs[0]
                mid = np.dtype(source.dtype) if source.dtype is not None else None
                if first.dtype is not None and np.dtype(first.dtype) == to == _F16 and mid == _F32:
                    origin = first
        if origin is None or is_graph_output(graph, out):
            continue
        for reader in list(out.outputs):
            for slot, tensor in enumerate(reader.inputs):
                if tensor is out:
                    reader.inputs[slot] = origin
        node.outputs.clear()
        removed += 1
    return removed


# --- calibration -----------------------------------------------------------------------------------------


def find_fp16_overflow(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]],
                       threshold: float = FP16_MAX) -> list[str]:
    """Names of the nodes to keep in float32 so that no activation overflows float16.

    Runs the fp32 ``model`` with ONNX Runtime CPU on the calibration inputs (one feed dict or several) with every
    float32 node output exposed, and returns, sorted, the names of the nodes that write a tensor with
    ``|x| > threshold`` (or a non-finite value) and of the nodes that read one: keeping both in fp32 puts the
    Casts on in-range tensors. Pass the result as ``ctx.options["convert_fp16_fp32_nodes"]``. Nodes without a
    name cannot be listed (logged at WARNING).

    Raises:
        PassError: the model does not run in ONNX Runtime on these inputs.
    """
    import onnxruntime as ort  # lazily: the passes otherwise need only onnx, onnx-graphsurgeon and numpy

    feed_list = [feeds] if isinstance(feeds, Mapping) else list(feeds)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    float_names = {info.name for info in [*inferred.graph.value_info, *inferred.graph.output]
                   if info.type.tensor_type.elem_type == TensorProto.FLOAT}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {output.name for output in probe.graph.output}
    for node in probe.graph.node:
        for name in node.output:
            if name and name in float_names and name not in have:
                probe.graph.output.append(onnx.helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
                have.add(name)
    names = [output.name for output in probe.graph.output]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
        hot: set[str] = set()
        for feed in feed_list:
            for name, value in zip(names, session.run(names, dict(feed)), strict=True):
                if value.dtype.kind == "f" and value.size and (
                        not np.all(np.isfinite(value)) or float(np.max(np.abs(value))) > threshold):
                    hot.add(name)
    except Exception as err:
        raise PassError(f"find_fp16_overflow: the fp32 model did not run in ONNX Runtime: {type(err).__name__}: "
                        f"{err}; check the calibration inputs' names, dtypes and shapes") from err
    keep: set[str] = set()
    unnamed = 0
    for node in model.graph.node:
        if hot.intersection(node.output) or hot.intersection(node.input):
            if node.name:
                keep.add(node.name)
            else:
                unnamed += 1
    if unnamed:
        logger.warning("find_fp16_overflow: %d overflowing nodes have no name and cannot be kept in fp32", unnamed)
    return sorted(keep)

"""Move Conv biases into a bias that is added anyway (another Conv's, a SkipGroupNorm's): fewer bias kernels."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ._match import const_value, find_each, in_onnx_domain, is_graph_output, single_consumer
from ._patterns import ORT_CUDA, Namer, producer, same_shape, target_of
from .base import PassContext, PassResult, option

logger = logging.getLogger(__name__)

NAME = "merge_conv_biases"

_TO_NHWC = [0, 2, 3, 1]


@dataclass(frozen=True)
class MergeConvBiasesOptions:
    """The options of :func:`merge_conv_biases`."""

    #: False turns the pass off (every match then counts as ``disabled``).
    enabled: bool = option("merge_conv_biases", True, bool)


def merge_conv_biases(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Move a Conv's bias into another per-channel bias added to the same sum (ort-cuda).

    Matches (a ResNet with a 1x1 conv_shortcut, diffusers resnet.py ResnetBlock2D
    ``output_tensor = conv_shortcut(input_tensor) + hidden_states``):

        sum:    Conv(x, A, a) --\\                          norm:  Conv(y, B, b) -> Transpose(0,2,3,1) --\\
                                 Add -> s                                                     SkipGroupNorm(X, g, be,
                Conv(y, B, b) --/   (s feeds no GroupNorm:                                      skip, [bias])
                                     skip tensors, up/down-sampling)     (X or skip; as fuse_skip_group_norm emits it)
    Emits:
        sum:    Conv(x, A) + Conv(y, B, a + b)          (the per-channel constants commute)
        norm:   Conv(y, B) -> Transpose -> SkipGroupNorm(..., bias = [bias] + b)   (SkipGroupNorm adds
                ``X + skip + bias`` before normalizing, and its optional sum output is that same sum)
    Why:  ONNX Runtime's CUDA Conv adds each bias in a kernel of its own (cuDNN's ``op_generic_tensor_kernel``)
          unless ``fuse_conv_bias`` is on, which picked slower conv kernels for the UNet; here the bias rides in
          an add that happens anyway (figures: benchmarks/results/README.md ("Figures behind code defaults")).
    Requires: run after fuse_skip_group_norm (it moves the other Conv's bias into the norm first and emits the
          Transposes matched here). Each moved bias is a constant of C elements (C = the output channels); the
          Conv's output (and the Transpose's) read by the Add / SkipGroupNorm alone and not a graph output; the
          two summands of the same shape (no broadcasting: a [N, C, 1, 1] time-embedding skip is left alone).
    Targets: ort-cuda. Others count ``skipped_for_target``: TensorRT and ORT's CPU Conv add the bias in the
          convolution kernel's epilogue already.

    Options (``ctx.options`` keys, read as :class:`MergeConvBiasesOptions`):
        merge_conv_biases: False turns the pass off (every match then counts as ``disabled``); default True.

    Counts: ``merged`` (into another Conv), ``into_skip_group_norm``, ``rejected`` (reasons at DEBUG),
        ``skipped_for_target``.
    """
    target = target_of(ctx.backend, ctx.device)
    found_sums = find_each(graph, NAME, match=lambda node: _sum_candidate(graph, node))
    # each SkipGroupNorm has two candidate inputs, X (slot 0) and skip (slot 3): one sweep per slot
    found_norms = [find_each(graph, NAME, match=lambda node, slot=slot: _norm_candidate(graph, node, slot))
                   for slot in (0, 3)]
    sums = found_sums.matches
    norms = [match for found in found_norms for match in found.matches]
    rejected = found_sums.rejected + sum(found.rejected for found in found_norms)
    counts = {"merged": 0, "into_skip_group_norm": 0, "rejected": rejected, "skipped_for_target": 0}
    if target != ORT_CUDA:
        counts["skipped_for_target"] = len(sums) + len(norms)
        return PassResult(modified=False, counts=counts)
    if not ctx.options_for(MergeConvBiasesOptions).enabled:
        counts["disabled"] = len(sums) + len(norms)
        return PassResult(modified=False, counts=counts)
    names = Namer(graph)
    for first, second in sums:
        total = _vector(first.inputs[2]) + _vector(second.inputs[2])
        second.inputs[2] = gs.Constant(names(f"{second.name or 'conv'}_merged_bias"), total)
        first.inputs.pop()
        counts["merged"] += 1
    for conv, norm in norms:
        total = _vector(conv.inputs[2]) + (_vector(norm.inputs[4]) if len(norm.inputs) > 4 and norm.inputs[4].name
                                             else 0.0)
        bias = gs.Constant(names(f"{norm.name or 'skip_group_norm'}_merged_bias"), np.asarray(total))
        if len(norm.inputs) > 4:
            norm.inputs[4] = bias
        else:
            norm.inputs.append(bias)
        conv.inputs.pop()
        counts["into_skip_group_norm"] += 1
    return PassResult(modified=bool(sums or norms), counts=counts)


def _vector(bias: gs.Tensor) -> np.ndarray:
    """A constant bias input, flattened to [C]."""
    return np.asarray(const_value(bias)).reshape(-1)


def _bias_problem(conv: gs.Node, channels: object) -> str | None:
    bias = const_value(conv.inputs[2])
    if bias is None or not isinstance(channels, int) or bias.size != channels:
        return f"the bias of {conv.name!r} is not a constant of the output's {channels} channels"
    return None


def _sum_candidate(graph: gs.Graph, node: gs.Node) -> tuple[gs.Node, gs.Node] | str | None:
    """The two biased Convs whose outputs ``node`` (an Add) sums, a reason, or None."""
    if node.op != "Add" or not in_onnx_domain(node) or len(node.inputs) != 2:
        return None
    convs = [producer(t, "Conv") for t in node.inputs]
    if any(c is None or len(c.inputs) != 3 for c in convs):
        return None
    problem = _check_sum(graph, node, convs)  # type: ignore[arg-type]
    return problem if problem is not None else (convs[0], convs[1])  # type: ignore[return-value]


def _check_sum(graph: gs.Graph, add: gs.Node, convs: list[gs.Node]) -> str | None:
    if convs[0] is convs[1]:
        return "both operands come from one Conv"
    for conv, tensor in zip(convs, add.inputs, strict=True):
        if is_graph_output(graph, tensor) or single_consumer(tensor) is not add:
            return f"the Conv output {tensor.name!r} is also read outside the Add"
        problem = _bias_problem(conv, tensor.shape[1] if tensor.shape is not None and len(tensor.shape) > 1 else None)
        if problem is not None:
            return problem
    if same_shape(add.inputs[0], add.inputs[1]) is None:
        return f"the Conv outputs' shapes {add.inputs[0].shape} and {add.inputs[1].shape} may differ"
    return None


def _norm_candidate(graph: gs.Graph, norm: gs.Node, slot: int) -> tuple[gs.Node, gs.Node] | str | None:
    """(the biased Conv feeding SkipGroupNorm input ``slot`` through an NHWC Transpose, the norm), a reason, or
    None."""
    if norm.op != "SkipGroupNorm" or norm.domain != "com.microsoft" or len(norm.inputs) <= slot:
        return None
    tensor = norm.inputs[slot]
    transpose = producer(tensor, "Transpose")
    if transpose is None or transpose.attrs.get("perm") != _TO_NHWC:
        return None
    conv = producer(transpose.inputs[0], "Conv")
    if conv is None or len(conv.inputs) != 3:
        return None
    for t, reader in ((transpose.inputs[0], transpose), (tensor, norm)):
        if is_graph_output(graph, t) or single_consumer(t) is not reader:
            return f"the Conv output {t.name!r} is also read elsewhere"
    if same_shape(norm.inputs[0], norm.inputs[3]) is None:
        return "the skip broadcasts (a time embedding) or its shape may differ from the input's"
    shape = tensor.shape
    return _bias_problem(conv, shape[-1] if shape is not None and len(shape) == 4 else None) or (conv, norm)

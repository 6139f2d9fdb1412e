"""Pad convolution channel counts that are not multiples of 8 with zero weights, and slice the result back."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from ._match import const_value, find_each, in_onnx_domain, is_const, is_graph_output
from ._patterns import Namer
from .base import PassContext, PassResult, option

logger = logging.getLogger(__name__)

NAME = "align_shapes"

#: Channel counts are padded up to a multiple of this: fp16 tensor-core convolutions (cuDNN, TensorRT) want
#: NHWC channel counts in multiples of 8 (16 bytes). The image-size half of the alignment policy (height and
#: width multiples of 8, ``--snap``) is ``diffusion_trt.config.IMAGE_ALIGNMENT`` / ``snap_image_size``: passes/
#: may not import config, and the runtime must not import passes/.
CHANNEL_ALIGNMENT = 8


@dataclass(frozen=True)
class AlignShapesOptions:
    """The options of :func:`align_shapes` (``ctx.options`` keys in each field)."""

    #: The multiple channel counts are padded to; 1 turns the pass off.
    channels: int = option("align_shapes_channels", CHANNEL_ALIGNMENT, int)


def padded(channels: int, multiple: int = CHANNEL_ALIGNMENT) -> int:
    """``channels`` rounded up to a multiple of ``multiple`` (4 -> 8, 320 -> 320, 3 -> 8)."""
    return -(-channels // multiple) * multiple


def align_shapes(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Pad the input and output channels of 2-D convolutions to multiples of 8; numerics unchanged.

    Matches:  Conv(x[N,Ci,H,W], W[Co,Ci,kh,kw], b[Co]), group 1, W (and b) constant, Ci or Co % 8 != 0
                  UNet conv_in  Conv(sample[N,4,h,w], W[320,4,3,3])   conv_out  Conv(x[N,320,h,w], W[4,320,3,3])
    Emits:    input side:   Pad(x, channels to Ci') -> Conv(W[Co,Ci',kh,kw] zero columns)
              output side:  Conv(W[Co',Ci,kh,kw] zero rows, b[Co'] zeros) -> Slice(channels 0:Co)
              chained:      a padded output read only by a padded input skips the Slice and the Pad (the extra
                            channels are exact zeros): VAE post_quant_conv (4 -> 4) -> decoder conv_in (4 -> 512)
    Why:      tensor-core convolution kernels want channel counts in multiples of 8; with 4 channels cuDNN /
              TensorRT fall back to slower kernels or pad on every call. The added products are exact zeros.
    Requires: the weight constant and 4-D (Conv2d); the bias constant if present; group 1. Applies to any Conv
              with an unaligned channel count (SD-1.5: UNet conv_in/conv_out, VAE post_quant_conv, decoder
              conv_in/conv_out, encoder conv_out) but the input side of a Conv on an RGB graph input (the
              encoder's conv_in, a ControlNet's conditioning embedding: :func:`_is_image_input`).

    Options (``ctx.options`` keys, read as :class:`AlignShapesOptions`):
        align_shapes_channels (int): the multiple (default :data:`CHANNEL_ALIGNMENT`); 1 turns the pass off.

    Counts: ``inputs_padded`` (Convs whose input channels were padded), ``outputs_padded``, ``Pad`` and ``Slice``
    (nodes inserted), ``image_inputs_kept`` (a Conv reading an RGB graph input directly: its input side is left
    as it is, :func:`_is_image_input`), ``rejected`` (unaligned Convs left as they are, reasons at DEBUG).
    """
    multiple = ctx.options_for(AlignShapesOptions).channels
    names = Namer(graph)
    counts = {"inputs_padded": 0, "outputs_padded": 0, "Pad": 0, "Slice": 0}
    kept = 0
    found = find_each(graph, NAME, match=lambda node: _candidate(node, multiple))
    plans = found.matches
    # outputs first: a padded output that only padded inputs read then needs no Slice (see _pad_input)
    padded_outputs: dict[str, gs.Tensor] = {}  # name of the sliced (original) tensor -> its padded producer output
    for node, weight, bias in plans:
        if weight.shape[0] % multiple:
            _pad_output(graph, node, weight, bias, multiple, names, padded_outputs)
            counts["outputs_padded"] += 1
    for node, _, _ in plans:
        weight = const_value(node.inputs[1])
        assert weight is not None
        if weight.shape[1] % multiple and _is_image_input(graph, node.inputs[0], weight.shape[1]):
            kept += 1
        elif weight.shape[1] % multiple:
            counts["Pad"] += _pad_input(graph, node, weight, multiple, names, padded_outputs)
            counts["inputs_padded"] += 1
    # Slices whose readers all read the padded tensor now are dead: the PassManager's cleanup drops them
    counts["Slice"] = sum(1 for tensor in padded_outputs.values() if _slice_kept(graph, tensor))
    if kept:
        counts["image_inputs_kept"] = kept
    counts["rejected"] = found.rejected
    return PassResult(modified=bool(plans), counts=counts)


def _candidate(node: gs.Node, multiple: int) -> tuple[gs.Node, np.ndarray, np.ndarray | None] | str | None:
    """(Conv, weight, bias) of a Conv to pad, a reason, or None (no Conv, or aligned)."""
    if node.op != "Conv" or not in_onnx_domain(node) or len(node.inputs) < 2:
        return None
    plan = _plan(node, multiple)
    return plan if plan is None or isinstance(plan, str) else (node, *plan)


def _plan(conv: gs.Node, multiple: int) -> tuple[np.ndarray, np.ndarray | None] | str | None:
    """(weight, bias) of a Conv to pad, None when it is aligned (no candidate), or why it cannot be padded."""
    if not is_const(conv.inputs[1]):
        return None if conv.inputs[1].shape is None or _aligned(conv.inputs[1].shape, multiple) else (
            f"the weight {conv.inputs[1].name!r} is not constant")
    weight = const_value(conv.inputs[1])
    if weight is None or weight.ndim != 4:
        return None if weight is None else (None if _aligned(weight.shape, multiple) else "not a 2-D Conv")
    if _aligned(weight.shape, multiple):
        return None
    if conv.attrs.get("group", 1) != 1:
        return f"group={conv.attrs['group']}: padding would change the grouping"
    bias = None
    if len(conv.inputs) > 2 and conv.inputs[2].name:
        bias = const_value(conv.inputs[2]) if is_const(conv.inputs[2]) else None
        if bias is None:
            return f"the bias {conv.inputs[2].name!r} is not constant"
    return weight, bias


def _aligned(shape: tuple[int, ...] | list[int | str | None], multiple: int) -> bool:
    return all(isinstance(d, int) and d % multiple == 0 for d in shape[:2])


def _pad_output(graph: gs.Graph, conv: gs.Node, weight: np.ndarray, bias: np.ndarray | None, multiple: int,
                names: Namer, padded_outputs: dict[str, gs.Tensor]) -> None:
    """Conv with Co' = padded(Co) zero filters (and zero biases), then Slice(channels 0:Co) to the old output."""
    out_channels = weight.shape[0]
    extra = padded(out_channels, multiple) - out_channels
    base = conv.name or names("conv")
    new_weight = np.concatenate([weight, np.zeros((extra, *weight.shape[1:]), weight.dtype)])
    conv.inputs[1] = gs.Constant(names(f"{base}_weight_padded"), new_weight)
    new_bias = np.concatenate([bias.reshape(-1), np.zeros(extra, bias.dtype)]) if bias is not None else \
        np.zeros(out_channels + extra, weight.dtype)
    bias_tensor = gs.Constant(names(f"{base}_bias_padded"), new_bias)
    if len(conv.inputs) > 2:
        conv.inputs[2] = bias_tensor
    else:
        conv.inputs.append(bias_tensor)  # an explicit zero bias keeps the padded channels exactly zero
    result = conv.outputs[0]
    shape = None if result.shape is None else [result.shape[0], out_channels + extra, *result.shape[2:]]
    wide = gs.Variable(names(f"{result.name}_padded"), dtype=result.dtype, shape=shape)
    conv.outputs[0] = wide
    graph.nodes.append(gs.Node(
        op="Slice", name=names(f"{base}_slice_channels"),
        inputs=[wide, _ints(names, f"{base}_slice_start", [0]), _ints(names, f"{base}_slice_end", [out_channels]),
                _ints(names, f"{base}_slice_axes", [1])],
        outputs=[result],
    ))
    padded_outputs[result.name] = wide


def _pad_input(graph: gs.Graph, conv: gs.Node, weight: np.ndarray, multiple: int, names: Namer,
               padded_outputs: dict[str, gs.Tensor]) -> int:
    """Give the Conv Ci' = padded(Ci) input channels (zero weight columns); returns the number of Pads added."""
    in_channels = weight.shape[1]
    extra = padded(in_channels, multiple) - in_channels
    base = conv.name or names("conv")
    conv.inputs[1] = gs.Constant(names(f"{base}_weight_cin_padded"), np.concatenate(
        [weight, np.zeros((weight.shape[0], extra, *weight.shape[2:]), weight.dtype)], axis=1))
    x = conv.inputs[0]
    wide = padded_outputs.get(x.name)
    if wide is not None and wide.shape is not None and wide.shape[1] == in_channels + extra:
        conv.inputs[0] = wide  # already padded with exact zeros by the producing Conv: no Slice -> Pad round trip
        return 0
    shape = None if x.shape is None else [x.shape[0], in_channels + extra, *x.shape[2:]]
    rank = 4 if x.shape is None else len(x.shape)
    pads = [0] * (2 * rank)
    pads[rank + 1] = extra  # end of axis 1
    padded_x = gs.Variable(names(f"{x.name}_cin_padded"), dtype=x.dtype, shape=shape)
    graph.nodes.append(gs.Node(op="Pad", name=names(f"{base}_pad_channels"),
                               inputs=[x, _ints(names, f"{base}_pads", pads)], outputs=[padded_x],
                               attrs={"mode": "constant"}))
    conv.inputs[0] = padded_x
    return 1


def _is_image_input(graph: gs.Graph, x: gs.Tensor, in_channels: int) -> bool:
    """Whether ``x`` is a graph input of RGB images (3 channels): a ControlNet's control image, the VAE encoder's
    image. Their input side is left unpadded: the Pad would run on every call over the whole image at pixel
    resolution, and the Conv gains nothing from it. Measured on an H200 (SD-1.5 ControlNet, 512x512, CFG batch 2,
    fp16 NHWC, ``benchmarks/profile_kernels.py``, ``benchmarks/results/h200-2026-12-04-s16-cn-profile*.json``): the
    control image's Pad took 0.37 ms of the ControlNet's 3.42 ms of kernels; without it 3.05 ms, the convolutions
    0.808 vs 0.804 ms. Latent inputs (4 channels, 64x smaller) keep their padding (not measured without)."""
    return in_channels == 3 and any(t is x for t in graph.inputs)


def _slice_kept(graph: gs.Graph, wide: gs.Tensor) -> bool:
    """Whether the Slice reading ``wide`` still has readers or writes a graph output (else cleanup drops it)."""
    return any(node.op == "Slice" and (bool(node.outputs[0].outputs) or is_graph_output(graph, node.outputs[0]))
               for node in wide.outputs)


def _ints(names: Namer, name: str, values: list[int]) -> gs.Constant:
    return gs.Constant(names(name), np.asarray(values, dtype=np.int64))

"""``compile --backend ort --refittable``: each 1x1 Conv over a weight input becomes a channels-last MatMul.

:func:`~diffusion_trt.compiler.lora_slots.expose_weights` makes the LoRA-targetable weights graph inputs; this pass
then rewrites the 1x1 Convs that read one (SD's ``proj_in``/``proj_out`` without linear projection,
``conv_shortcut``, ...), and the weight input's layout with them:

Matches:  x[N,C,H,W] -> Conv(W: graph input [O,C,1,1], b[O] or none; kernel 1x1, stride 1, no padding,
          dilation 1, group 1) -> y[N,O,H,W]
Emits:    x -> Transpose(0,2,3,1) -> MatMul(., W: the same graph input, now [C,O]) [-> Add(., b[O])]
            -> Transpose(0,3,1,2) -> y                      (y keeps its name: its readers are unchanged)
          then :func:`~diffusion_trt.passes.cancel_transposes.cancel_transposes`: SD's transformer blocks already
          hold ``permute(0,2,3,1)`` after ``proj_in`` and ``permute(0,3,1,2)`` before ``proj_out``, so the emitted
          Transposes meet their inverses and both go: ``GroupNorm -> Transpose -> MatMul -> Add -> Reshape`` and
          ``Reshape -> MatMul -> Add -> Transpose -> Add(residual)`` hold the Transposes the Convs had, no more.
          On ORT CUDA the caller then runs :func:`~diffusion_trt.passes.fuse_bias.fuse_bias`, whose channels-last
          form makes that proj_out bias Add and the residual Add one BiasAdd (widths 320/640/1280).
Why:      ONNX Runtime's constant-weight Conv fusions and its NHWC layout transform (the CUDA provider's
          ``prefer_nhwc=1``) take constant weights only; a Conv over a weight input stays an NCHW Conv (on the H200,
          onnxruntime-gpu 1.31.1, 2026-12-02, the NHWC kernel read a bound [O,C,1,1] weight as [O,1,1,C] and
          refused it). A MatMul has no layout. Holding W as [C,O] means no per-run transpose of the weight; the
          MatMul on [N,H,W,C] needs no Reshape (it broadcasts over N, H, W), so static and dynamic graphs alike gain
          no Shape/Slice/Concat/Reshape nodes. The same arithmetic: ``y[n,o,h,w] = sum_c W[o,c] x[n,c,h,w] + b[o]``
          is ``(x^T[n,h,w,:] @ W^T)[o] + b[o]``, ONNX ``Conv`` and ``MatMul`` semantics (numpy broadcasting).
Requires: the weight a graph input (not an initializer) of static shape [O,C,1,1], read only as the weight of such
          Convs (its layout changes for every reader); shapes inferred for the cancelling (ranks; the emitted
          tensors carry permuted shapes). A Conv turned down stays a Conv over the input (the caller then runs the
          engine NCHW: :func:`~.lora_slots.write_weight_inputs`).

The caller binds W as ``W[:, :, 0, 0].T`` ([C, O], the graph's dtype): ``lora_base.safetensors`` holds it so and the
refit map records ``"transpose": true, "pointwise": true`` for it (:func:`~.lora_slots.expose_weights`); the
runtime adds a LoRA's delta as ``delta[O,C,1,1].flatten(1).T`` (:class:`~diffusion_trt.runtime.lora_slots.
WeightSlots`).

Counts: ``MatMul`` (Convs rewritten), ``Transpose_added`` (Transposes after minus before, the cancelling
included: 0 where each emitted Transpose met its inverse), ``rejected`` (1x1 Convs over weight inputs left as
Convs, reasons at DEBUG).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx_graphsurgeon as gs

from ..passes._match import fuse_each, in_onnx_domain
from ..passes._patterns import Namer
from ..passes.base import PassContext, PassResult
from ..passes.cancel_transposes import TO_NCHW, TO_NHWC, cancel_transposes

logger = logging.getLogger(__name__)

NAME = "pointwise_convs_as_matmul"

#: Conv attributes of a plain 1x1 convolution (an attribute left out has this value).
_NEUTRAL: dict[str, Any] = {"strides": [1, 1], "dilations": [1, 1], "pads": [0, 0, 0, 0], "group": 1,
                            "kernel_shape": [1, 1]}


def is_pointwise(attrs: Mapping[str, Any], weight_shape: Sequence[Any] | None) -> bool:
    """Whether a Conv with ``attrs`` (name -> value; strings as ``str`` or ``bytes``) and a weight of
    ``weight_shape`` is a plain 1x1 convolution: kernel 1x1, stride 1, no padding, dilation 1, one group."""
    if weight_shape is None or len(weight_shape) != 4 or list(weight_shape[2:]) != [1, 1]:
        return False
    auto_pad = attrs.get("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad not in ("NOTSET", "VALID"):
        return False
    for key, neutral in _NEUTRAL.items():
        value = attrs.get(key, neutral)
        if (list(value) if isinstance(value, list | tuple) else value) != neutral:
            return False
    return True


@dataclass(frozen=True)
class _Site:
    conv: gs.Node
    weight: gs.Variable  # a graph input, [O, C, 1, 1]


def pointwise_convs_as_matmul(graph: gs.Graph, ctx: PassContext) -> PassResult:
    """Rewrite every 1x1 Conv over a weight input as a channels-last MatMul and cancel the Transposes that meet
    (see the module docstring), in place.

    Shapes: x ``[N, C, H, W]`` (symbolic N, H, W fine), the weight input ``[O, C, 1, 1]`` -> ``[C, O]`` (its graph
    input is declared so; the caller binds ``W[:, :, 0, 0].T`` there), bias ``[O]``, y ``[N, O, H, W]`` as before.
    Dtypes: unchanged (fp32 or fp16, the Conv's); the emitted tensors take the Conv output's.

    Raises:
        Nothing of its own: a Conv it cannot rewrite stays as it is, counted in ``rejected`` (reason at DEBUG).
    """
    before = sum(node.op == "Transpose" for node in graph.nodes)
    shared = _reader_problems(graph)
    names = Namer(graph)
    weights: dict[int, gs.Variable] = {}  # relaid out once every reader is rewritten (their match reads the shape)
    tally = fuse_each(graph, NAME, match=lambda node: _match(node, shared),
                      rewrite=lambda site: _rewrite(graph, site, names, weights))
    for weight in weights.values():
        out_channels, in_channels = weight.shape[0], weight.shape[1]
        weight.shape = [in_channels, out_channels]
    done = tally.counts["MatMul"]
    if done:
        graph.cleanup().toposort()
        cancel_transposes(graph, ctx)
        graph.cleanup().toposort()
    added = sum(node.op == "Transpose" for node in graph.nodes) - before
    logger.debug("%s: %s: %d 1x1 Conv(s) over weight inputs as MatMuls, %+d Transpose(s), %d left as Convs",
                 NAME, ctx.component, done, added, tally.rejected)
    return PassResult(modified=done > 0, counts={"MatMul": done, "Transpose_added": added,
                                                 "rejected": tally.rejected})


def _match(node: gs.Node, shared: dict[int, str | None]) -> _Site | str | None:
    """A 1x1 Conv over a graph input (None: no candidate; a str: why it stays a Conv)."""
    if node.op != "Conv" or not in_onnx_domain(node) or len(node.inputs) < 2:
        return None
    weight = node.inputs[1]
    if id(weight) not in shared or not isinstance(weight, gs.Variable):
        return None  # a constant weight: ORT's own Conv handles it (NHWC included)
    shape = weight.shape
    if shape is None or len(shape) != 4 or not all(isinstance(d, int) for d in shape):
        return f"weight input {weight.name!r} has no static 4-D shape ({shape})"
    if not is_pointwise(node.attrs, shape):
        return None  # a spatial Conv (--refit-convs): stays a Conv, run NCHW
    return shared[id(weight)] or _Site(node, weight)


def _reader_problems(graph: gs.Graph) -> dict[int, str | None]:
    """Per graph input (by id): why its layout cannot change (a reader that is not a 1x1 Conv taking it as its weight
    alone), or None; read on the graph as it is before any rewrite."""
    out: dict[int, str | None] = {}
    for weight in graph.inputs:
        out[id(weight)] = None
        for reader in weight.outputs:
            if (reader.op != "Conv" or not in_onnx_domain(reader) or not is_pointwise(reader.attrs, weight.shape)
                    or [i for i, t in enumerate(reader.inputs) if t is weight] != [1] or len(reader.outputs) != 1):
                out[id(weight)] = (f"weight input {weight.name!r} is also read by {reader.op} {reader.name!r}, not "
                                   "as the weight of a 1x1 Conv: its layout cannot change")
                break
    return out


def _permuted(shape: Sequence[Any] | None, perm: Sequence[int]) -> list[Any] | None:
    return None if shape is None or len(shape) != len(perm) else [shape[axis] for axis in perm]


def _rewrite(graph: gs.Graph, site: _Site, names: Namer, weights: dict[int, gs.Variable]) -> str:
    conv, weight = site.conv, site.weight
    x, y = conv.inputs[0], conv.outputs[0]
    bias = conv.inputs[2] if len(conv.inputs) > 2 and conv.inputs[2].name else None
    base = conv.name or y.name
    dtype = y.dtype if y.dtype is not None else weight.dtype
    x_nhwc = gs.Variable(names(f"{base}_nhwc"), dtype=x.dtype, shape=_permuted(x.shape, TO_NHWC))
    y_nhwc = _permuted(y.shape, TO_NHWC)
    product = gs.Variable(names(f"{base}_matmul"), dtype=dtype, shape=y_nhwc)
    nodes = [gs.Node(op="Transpose", name=names(f"{base}_to_nhwc"), attrs={"perm": list(TO_NHWC)},
                     inputs=[x], outputs=[x_nhwc]),
             gs.Node(op="MatMul", name=names(f"{base}_MatMul"), inputs=[x_nhwc, weight], outputs=[product])]
    if bias is not None:
        summed = gs.Variable(names(f"{base}_bias"), dtype=dtype, shape=y_nhwc)
        nodes.append(gs.Node(op="Add", name=names(f"{base}_Add"), inputs=[product, bias], outputs=[summed]))
        product = summed
    conv.inputs.clear()
    conv.outputs.clear()  # y is now the back Transpose's output (readers and graph outputs unchanged)
    nodes.append(gs.Node(op="Transpose", name=names(f"{base}_to_nchw"), attrs={"perm": list(TO_NCHW)},
                         inputs=[product], outputs=[y]))
    graph.nodes.extend(nodes)
    weights[id(weight)] = weight
    return "MatMul"

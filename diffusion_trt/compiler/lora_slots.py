"""``compile --backend ort --refittable``: the LoRA-targetable weights of an ONNX Runtime graph become graph inputs.

The Linear / Conv2d weights of the UNet and text encoder that the refit map ties to one initializer
(:func:`~diffusion_trt.compiler.lora.refit_map`) and that no spatial Conv kernel reads are taken out of
``graph.initializer`` and declared as graph inputs of the same name, dtype and shape; their values go to
``<component>/lora_base.safetensors`` (initializer name -> array, in the graph's layout and dtype). The runtime binds
those inputs on every run: the base values when no LoRA is loaded, ``W + sum(scale * B @ A)`` computed on the device
when one is (:mod:`diffusion_trt.runtime.lora_slots`, which says why this mechanism and not ORT's own LoRA adapters).
The artifact is no bigger: the weights moved, they are not copied.

Which weights (:func:`expose_weights`):

* Linear (MatMul / Gemm) weights: always inputs (attention q/k/v/out, proj_in/proj_out, ff, time_emb_proj, the
  text encoder's q/k/v/out/fc1/fc2: what A1111 / kohya LoRAs target).
* 1x1 Conv weights (stride 1, no padding, one group; proj_in/proj_out of SD 1.x, conv_shortcut): inputs, each of
  their Convs rewritten as a MatMul over the channels (:func:`pointwise_convs_as_matmul`).
* Spatial Conv weights (any other Conv: 3x3, strided, padded or grouped; ResNet conv1/conv2, down/upsamplers):
  constants, unless ``refit_convs`` (``compile --refittable --refit-convs``, for LoCon / LyCORIS conv LoRAs).

Why: ONNX Runtime's NHWC layout transformation (the CUDA provider's ``prefer_nhwc=1``, the UNet's default) transposes
a Conv's weight only when it is a constant. On the H200 (onnxruntime-gpu 1.31.1, 2026-12-02) the refittable SD-1.5
UNet with every Conv weight an input failed at its first run with "Input channels C is not equal to kernel channels *
group. C: 320 kernel channels: 3" at the first 3x3 Conv and "... kernel channels: 1" at a 1x1 one: the NHWC kernel
read the bound [O, C, kH, kW] weight as [O, kH, kW, C]. A MatMul has no layout, so the 1x1 Convs can take weight
inputs in NHWC engines; the spatial ones cannot, and an artifact whose spatial Conv weights are inputs runs NCHW on
CUDA (slower; the manifest's ``spatial_conv_inputs`` tells the runtime, ``runtime.pipeline.cuda_layout_options``).

Why inputs and not initializers that are *also* graph inputs (ONNX's overridable initializers): ONNX Runtime's IO
binding refuses them (``bind_input``: "Failed to find NodeArg with name: W in the def list"), and IO binding is the
CUDA path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

logger = logging.getLogger(__name__)

#: The side file of base weights, per component (``components.<name>.weight_inputs`` in the manifest).
BASE_FILE = "lora_base.safetensors"


def expose_weights(model: onnx.ModelProto, rmap: dict[str, Any], *, refit_convs: bool = False
                   ) -> dict[str, np.ndarray]:
    """Turn the initializers the refit map names into graph inputs, in place (spatial Conv weights only with
    ``refit_convs``; see the module docstring); rewrite the 1x1 Convs reading them as MatMuls; return their values.

    Args:
        model: the optimized graph, weights in memory.
        rmap: its refit map (``{"weights": {torch name: {"initializer", ...}}}``).
        refit_convs: also the weights of spatial Convs (the engine then has to run NCHW on CUDA).

    Returns:
        initializer name -> its array (the graph's dtype and layout), in graph order.
    """
    wanted = {e["initializer"] for e in rmap["weights"].values()}
    if not refit_convs:
        wanted -= spatial_conv_weights(model)
    values: dict[str, np.ndarray] = {}
    kept = []
    for init in model.graph.initializer:
        if init.name in wanted:
            values[init.name] = np.ascontiguousarray(numpy_helper.to_array(init))
        else:
            kept.append(init)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    for name, arr in values.items():
        elem = helper.np_dtype_to_tensor_dtype(arr.dtype)
        model.graph.input.append(helper.make_tensor_value_info(name, elem, list(arr.shape)))
    pointwise_convs_as_matmul(model, {n: a.shape for n, a in values.items()})
    return values


def spatial_conv_weights(model: onnx.ModelProto) -> set[str]:
    """Names of the constant weights read by a Conv that :func:`pointwise_convs_as_matmul` cannot rewrite (kernel
    above 1x1, strides, padding, dilation or groups): the weights an NHWC engine needs constant."""
    shapes = {i.name: tuple(i.dims) for i in model.graph.initializer}
    return {n.input[1] for n in model.graph.node
            if n.op_type == "Conv" and len(n.input) > 1 and n.input[1] in shapes
            and not _is_pointwise(n, shapes[n.input[1]])}


def _is_pointwise(node: onnx.NodeProto, shape: tuple[int, ...]) -> bool:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    neutral = {"strides": [1, 1], "dilations": [1, 1], "pads": [0, 0, 0, 0], "group": 1, "kernel_shape": [1, 1]}
    return (len(shape) == 4 and tuple(shape[2:]) == (1, 1) and attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", b"VALID")
            and all(list(v) == neutral[k] if isinstance(v, list) else v == neutral[k]
                    for k, v in attrs.items() if k in neutral))


def pointwise_convs_as_matmul(model: onnx.ModelProto, weight_inputs: dict[str, tuple[int, ...]]) -> int:
    """Rewrite, in place, every 1x1 Conv (stride 1, no padding, one group) whose weight is one of ``weight_inputs``
    (graph input name -> its [O, C, 1, 1] shape) as ``Reshape(MatMul(W[O, C], X[N, C, H*W])) (+ bias [O, 1, 1])``:
    the same arithmetic (a sum over C per pixel), read from the same bound [O, C, 1, 1] input (see the module
    docstring for why). Returns the number of Convs rewritten."""
    graph, nodes, done, biases = model.graph, [], 0, set()
    inits = {i.name: i for i in graph.initializer}
    for node in graph.node:
        shape = weight_inputs.get(node.input[1]) if node.op_type == "Conv" and len(node.input) > 1 else None
        if shape is None or not _is_pointwise(node, shape):
            nodes.append(node)
            continue
        nodes += _matmul_nodes(graph, inits, node, shape, f"{node.name or node.output[0]}_pointwise")
        biases.update(node.input[2:3])
        done += 1
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for n in nodes for name in n.input}
    unused = [i for i in graph.initializer if i.name in biases and i.name not in used]  # now held reshaped
    for init in unused:
        graph.initializer.remove(init)
    return done


def _matmul_nodes(graph: onnx.GraphProto, inits: dict[str, onnx.TensorProto], conv: onnx.NodeProto,
                  shape: tuple[int, ...], p: str) -> list[onnx.NodeProto]:
    """The nodes replacing one pointwise Conv (``p``: the prefix of every new name)."""
    def const(name: str, values: list[int]) -> str:
        graph.initializer.append(numpy_helper.from_array(np.asarray(values, dtype=np.int64), f"{p}_{name}"))
        return f"{p}_{name}"

    x, w, y = conv.input[0], conv.input[1], conv.output[0]
    out = [helper.make_node("Reshape", [w, const("w_shape", [shape[0], shape[1]])], [f"{p}_w"]),
           helper.make_node("Reshape", [x, const("x_shape", [0, 0, -1])], [f"{p}_x"]),
           helper.make_node("MatMul", [f"{p}_w", f"{p}_x"], [f"{p}_y"]),
           helper.make_node("Shape", [x], [f"{p}_xs"]),
           helper.make_node("Slice", [f"{p}_xs", const("s0", [2]), const("s1", [4])], [f"{p}_hw"]),
           helper.make_node("Slice", [f"{p}_xs", const("n0", [0]), const("n1", [1])], [f"{p}_n"]),
           helper.make_node("Concat", [f"{p}_n", const("o", [shape[0]]), f"{p}_hw"], [f"{p}_ys"], axis=0)]
    bias = conv.input[2] if len(conv.input) > 2 and conv.input[2] else None
    if bias is None:
        return [*out, helper.make_node("Reshape", [f"{p}_y", f"{p}_ys"], [y])]
    if bias in inits:  # the usual case: a constant bias, reshaped once here
        b = numpy_helper.to_array(inits[bias]).reshape(-1, 1, 1)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(b), f"{p}_b"))
    else:
        out.append(helper.make_node("Reshape", [bias, const("b_shape", [-1, 1, 1])], [f"{p}_b"]))
    return [*out, helper.make_node("Reshape", [f"{p}_y", f"{p}_ys"], [f"{p}_y4"]),
            helper.make_node("Add", [f"{p}_y4", f"{p}_b"], [y])]


def write_weight_inputs(name: str, model: onnx.ModelProto, rmap: dict[str, Any], staging: Path, *,
                        refit_convs: bool = False) -> dict[str, Any]:
    """:func:`expose_weights` on ``model`` and its values written to ``<name>/lora_base.safetensors``.

    Returns:
        The manifest entry's ``{"weight_inputs": "<name>/lora_base.safetensors", "spatial_conv_inputs": bool}``
        (``spatial_conv_inputs``: some weight input is a spatial Conv's, so the engine must run NCHW on CUDA).
    """
    from safetensors.numpy import save_file

    spatial = spatial_conv_weights(model)
    values = expose_weights(model, rmap, refit_convs=refit_convs)
    (staging / name).mkdir(parents=True, exist_ok=True)
    save_file(values, str(staging / name / BASE_FILE))
    kept = len({e["initializer"] for e in rmap["weights"].values()} - set(values))
    logger.info("%s: %d LoRA-targetable weight(s) are graph inputs (%.1f MB in %s), %d spatial Conv weight(s) "
                "constant", name, len(values), sum(a.nbytes for a in values.values()) / 1e6, BASE_FILE, kept)
    return {"weight_inputs": f"{name}/{BASE_FILE}", "spatial_conv_inputs": bool(spatial & set(values))}

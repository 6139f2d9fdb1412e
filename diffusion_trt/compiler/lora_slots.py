"""``compile --backend ort --refittable``: the LoRA-targetable weights of an ONNX Runtime graph become graph inputs.

The Linear / Conv2d weights of the UNet and text encoder that the refit map ties to one initializer
(:func:`~diffusion_trt.compiler.lora.refit_map`) and that no spatial Conv kernel reads are taken out of
``graph.initializer`` and declared as graph inputs of the same name and dtype (the same shape, but for the 1x1
Convs' weights: ``[C, O]``, below); their values go to ``<component>/lora_base.safetensors`` (initializer name ->
array, in the input's layout and the graph's dtype). The runtime binds those inputs on every run: the base values
when no LoRA is loaded, ``W + sum(scale * B @ A)`` computed on the device when one is
(:mod:`diffusion_trt.runtime.lora_slots`, which says why this mechanism and not ORT's own LoRA adapters).
The artifact is no bigger: the weights moved, they are not copied.

Which weights (:func:`expose_weights`):

* Linear (MatMul / Gemm) weights: always inputs (attention q/k/v/out, proj_in/proj_out, ff, time_emb_proj, the
  text encoder's q/k/v/out/fc1/fc2: what A1111 / kohya LoRAs target).
* 1x1 Conv weights (stride 1, no padding, dilation 1, one group; proj_in/proj_out of SD 1.x, conv_shortcut):
  inputs, each of their Convs rewritten as a channels-last MatMul
  (:func:`~diffusion_trt.compiler.pointwise_convs.pointwise_convs_as_matmul`: ``Transpose(0,2,3,1) -> MatMul(W[C, O])
  [-> Add(b)] -> Transpose(0,3,1,2)``, the Transposes that meet their inverses cancelled), the weight stored and bound
  as ``W[:, :, 0, 0].T``, ``[C, O]``; the refit map's entry says ``"transpose": true, "pointwise": true`` (artifacts
  made before this rewrite bound ``[O, C, 1, 1]`` under a Reshape-MatMul and lack ``pointwise``: read as false).
* Spatial Conv weights (any other Conv: 3x3, strided, padded or grouped; ResNet conv1/conv2, down/upsamplers):
  constants, unless ``refit_convs`` (``compile --refittable --refit-convs``, for LoCon / LyCORIS conv LoRAs).

Why: ONNX Runtime's NHWC layout transformation (the CUDA provider's ``prefer_nhwc=1``, the UNet's default) transposes
a Conv's weight only when it is a constant. On the H200 (onnxruntime-gpu 1.31.1, 2026-12-02) the refittable SD-1.5
UNet with every Conv weight an input failed at its first run with "Input channels C is not equal to kernel channels *
group. C: 320 kernel channels: 3" at the first 3x3 Conv and "... kernel channels: 1" at a 1x1 one: the NHWC kernel
read the bound [O, C, kH, kW] weight as [O, kH, kW, C]. A MatMul has no layout, so the 1x1 Convs can take weight
inputs in NHWC engines (as ``[C, O]`` over channels-last activations: no per-run transpose of the weight and, beside
SD's ``permute(0,2,3,1)`` / ``permute(0,3,1,2)``, no Transpose of its own); the spatial ones cannot, and an artifact
whose spatial Conv weights are inputs runs NCHW on CUDA (slower; the manifest's ``spatial_conv_inputs`` tells the
runtime, ``runtime.pipeline.cuda_layout_options``).

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


def expose_weights(model: onnx.ModelProto, rmap: dict[str, Any], *, refit_convs: bool = False,
                   component: str = "model") -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Turn the initializers the refit map names into graph inputs (spatial Conv weights only with ``refit_convs``;
    see the module docstring); rewrite the 1x1 Convs reading them as channels-last MatMuls
    (:func:`~.pointwise_convs.pointwise_convs_as_matmul`); return the new model and the inputs' values.

    The 1x1 Convs' weights change layout with their Convs: ``[O, C, 1, 1]`` becomes ``W[:, :, 0, 0].T``, ``[C, O]``
    (graph input and value alike), and their refit-map entries are updated in place to say so: ``"transpose": true,
    "pointwise": true`` and the ``sha256`` of the new array (what ``runtime.refit.as_initializer(w, True, dtype)``
    gives; maps written before this rewrite lack ``pointwise``: false, the weight bound as ``[O, C, 1, 1]``).

    Args:
        model: the optimized graph, weights in memory; only read from once the inputs are declared (its weight
            initializers are taken out): drop it after the call and keep the returned model.
        rmap: its refit map (``{"weights": {torch name: {"initializer", "transpose", ...}}}``); updated in place.
        refit_convs: also the weights of spatial Convs (the engine then has to run NCHW on CUDA).
        component: for logs and errors ("unet", "text_encoder").

    Returns:
        The rewritten model, and initializer name -> its array (the graph's dtype and the input's layout), in graph
        order.

    Raises:
        PassError: the rewrite failed (the message names the pass).
    """
    model, values, _ = _expose(model, rmap, refit_convs, component)
    return model, values


def _expose(model: onnx.ModelProto, rmap: dict[str, Any], refit_convs: bool,
            component: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[dict[str, Any]]]:
    """:func:`expose_weights`, and the pointwise rewrite's pass record as JSON ([] when no 1x1 Conv read a weight
    input) for the manifest's ``passes``."""
    from ..passes.base import PassContext, optimize_model
    from ..runtime.refit import array_key
    from .pointwise_convs import pointwise_convs_as_matmul

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
    if not any(n.op_type == "Conv" and len(n.input) > 1 and n.input[1] in values for n in model.graph.node):
        return model, values, []
    ctx = PassContext(component=component, backend="ort", device="cpu", precision="fp32")  # read for logs only
    model, records = optimize_model(model, (pointwise_convs_as_matmul,), ctx)
    logger.info("%s: %s", component, records[0].summary())
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    transposed = {n for n, a in values.items() if a.ndim == 4 and len(shapes[n]) == 2}
    for name in transposed:
        values[name] = np.ascontiguousarray(values[name][:, :, 0, 0].T)
    for entry in rmap["weights"].values():
        if entry["initializer"] in transposed:
            entry.update(transpose=True, pointwise=True, sha256=array_key(values[entry["initializer"]]))
    return model, values, [r.to_json() for r in records]


def spatial_conv_weights(model: onnx.ModelProto) -> set[str]:
    """Names of the constant weights read by a Conv that :func:`~.pointwise_convs.pointwise_convs_as_matmul` cannot
    rewrite (kernel above 1x1, strides, padding, dilation or groups): the weights an NHWC engine needs constant."""
    from .pointwise_convs import is_pointwise

    shapes = {i.name: tuple(i.dims) for i in model.graph.initializer}
    return {n.input[1] for n in model.graph.node
            if n.op_type == "Conv" and len(n.input) > 1 and n.input[1] in shapes
            and not is_pointwise({a.name: helper.get_attribute_value(a) for a in n.attribute}, shapes[n.input[1]])}


def write_weight_inputs(name: str, model: onnx.ModelProto, rmap: dict[str, Any], staging: Path, *,
                        refit_convs: bool = False) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """:func:`expose_weights` on ``model`` and its values written to ``<name>/lora_base.safetensors``; ``rmap``
    updated in place (the 1x1 Convs' weights now ``pointwise``: the caller writes it out again).

    Returns:
        The rewritten model (drop ``model``), and the manifest entry's ``{"weight_inputs":
        "<name>/lora_base.safetensors", "spatial_conv_inputs": bool, "passes": [record]}`` (``spatial_conv_inputs``:
        some Conv still reads a weight input, a spatial Conv's with ``refit_convs`` or a 1x1 one the rewrite turned
        down, so the engine must run NCHW on CUDA; ``passes``: the pointwise rewrite's record, for the entry's
        ``passes`` after the others).
    """
    from safetensors.numpy import save_file

    from .pointwise_convs import is_pointwise

    model, values, records = _expose(model, rmap, refit_convs, name)
    convs = [n for n in model.graph.node if n.op_type == "Conv" and len(n.input) > 1 and n.input[1] in values]
    stuck = sorted({n.input[1] for n in convs if is_pointwise(
        {a.name: helper.get_attribute_value(a) for a in n.attribute}, values[n.input[1]].shape)})
    if stuck:
        logger.warning("%s: %d 1x1 Conv(s) over weight inputs stayed Convs (%s; the reasons: -v), so the engine runs "
                       "NCHW on CUDA", name, len(stuck), ", ".join(stuck[:3]))
    (staging / name).mkdir(parents=True, exist_ok=True)
    save_file(values, str(staging / name / BASE_FILE))
    kept = len({e["initializer"] for e in rmap["weights"].values()} - set(values))
    logger.info("%s: %d LoRA-targetable weight(s) are graph inputs (%.1f MB in %s), %d spatial Conv weight(s) "
                "constant", name, len(values), sum(a.nbytes for a in values.values()) / 1e6, BASE_FILE, kept)
    return model, {"weight_inputs": f"{name}/{BASE_FILE}", "spatial_conv_inputs": bool(convs), "passes": records}

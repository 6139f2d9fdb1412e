"""``compile --backend ort --refittable``: the LoRA-targetable weights of an ONNX Runtime graph become graph inputs.

The Linear / Conv2d weights of the UNet and text encoder that the refit map ties to one initializer
(:func:`~diffusion_trt.compiler.lora.refit_map`) and that no spatial Conv kernel reads are taken out of
``graph.initializer`` and declared as graph inputs of the same name and dtype (the same shape, but for the 1x1
Convs' weights: ``[C, O]``, below); their values go to ``<component>/lora_base.safetensors`` (initializer name ->
array, in the input's layout and the graph's dtype). The runtime binds those inputs on every run: the base values
when no LoRA is loaded, ``W + sum(scale * B @ A)`` computed on the device when one is
(:mod:`diffusion_trt.runtime.lora_slots`, which says why this mechanism and not ORT's own LoRA adapters).
The artifact is no bigger: the weights moved, they are not copied. ``unet_controlnet`` (``--controlnet``: the UNet
with the ControlNet residual inputs, the same weights) gets the same treatment, its inputs renamed to ``unet``'s and
its base values read from ``unet/lora_base.safetensors`` (``write_weight_inputs(share_with="unet")``): stored once.

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
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..artifact.folder import umask_mode

logger = logging.getLogger(__name__)

#: The side file of base weights, per component (``components.<name>.weight_inputs`` in the manifest).
BASE_FILE = "lora_base.safetensors"


def expose_weights(model: onnx.ModelProto, rmap: dict[str, Any], *, refit_convs: bool = False,
                   component: str = "model", device: str = "cpu") -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Turn the initializers the refit map names into graph inputs (spatial Conv weights only with ``refit_convs``;
    see the module docstring); rewrite the 1x1 Convs reading them as channels-last MatMuls
    (:func:`~.pointwise_convs.pointwise_convs_as_matmul`; on CUDA then
    :func:`~diffusion_trt.passes.fuse_bias.fuse_bias`, which folds a rewritten proj_out's bias and the residual after
    it into one BiasAdd); return the new model and the inputs' values.

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
        device: where the engine runs ("cpu" or "cuda"): on "cuda" the bias fold follows the rewrite.

    Returns:
        The rewritten model, and initializer name -> its array (the graph's dtype and the input's layout), in graph
        order.

    Raises:
        PassError: the rewrite failed (the message names the pass).
    """
    model, values, _ = _expose(model, rmap, refit_convs, component, device)
    return model, values


def _expose(model: onnx.ModelProto, rmap: dict[str, Any], refit_convs: bool, component: str,
            device: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[dict[str, Any]]]:
    """:func:`expose_weights`, and the pass records of the pointwise rewrite (and, on CUDA, of the bias fold after
    it) as JSON ([] when no 1x1 Conv read a weight input) for the manifest's ``passes``."""
    from ..passes.base import PassContext, optimize_model
    from ..passes.fuse_bias import fuse_bias
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
    # fuse_bias after the rewrite: the MatMul -> Add(bias) -> Transpose -> Add(residual) it leaves at each proj_out
    # is its channels-last form (the main passes ran before the Conv was a MatMul); neither pass reads the precision
    ctx = PassContext(component=component, backend="ort", device=device, precision="fp32")
    passes = (pointwise_convs_as_matmul, fuse_bias) if device == "cuda" else (pointwise_convs_as_matmul,)
    model, records = optimize_model(model, passes, ctx)
    for record in records:
        logger.info("%s: %s", component, record.summary())
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
                        refit_convs: bool = False, share_with: str | None = None, device: str = "cpu"
                        ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """:func:`expose_weights` on ``model`` and its values written to ``<name>/lora_base.safetensors``; ``rmap``
    updated in place (the 1x1 Convs' weights now ``pointwise``: the caller writes it out again).

    ``share_with``: another component of the same weights compiled before into ``staging`` (``unet`` for
    ``unet_controlnet``, the UNet with the ControlNet residual inputs). When every weight input of ``name`` holds the
    very bytes of one of ``share_with``'s (same torch weight, layout, dtype and sha256 in both refit maps) and the two
    sets of weight inputs are the same, ``name``'s inputs are renamed to ``share_with``'s initializer names (the
    exporter names them anew in each graph) and no file is written: the entry's ``weight_inputs`` is
    ``share_with``'s file, so the base weights are stored once and the runtime binds one set of tensors to both
    engines (:func:`~diffusion_trt.runtime.lora_slots.load_slots`). Otherwise (another precision, a refit map that
    differs) ``name`` gets its own file, with one INFO line saying why.

    Returns:
        The rewritten model (drop ``model``), and the manifest entry's ``{"weight_inputs":
        "<name or share_with>/lora_base.safetensors", "spatial_conv_inputs": bool, "passes": [record]}``
        (``spatial_conv_inputs``: some Conv still reads a weight input, a spatial Conv's with ``refit_convs`` or a 1x1
        one the rewrite turned down, so the engine must run NCHW on CUDA; ``passes``: the pointwise rewrite's record,
        for the entry's ``passes`` after the others; on ``device="cuda"`` the bias fold's after it).
    """
    from safetensors.numpy import save_file

    from .pointwise_convs import is_pointwise

    model, values, records = _expose(model, rmap, refit_convs, name, device)
    if share_with is not None:
        renames, why = shared_inputs(rmap, values, staging / share_with)
        try:
            if renames is not None:
                rename_tensors(model, renames)
        except ValueError as e:
            renames, why = None, f"renaming its inputs: {e}"
        if renames is not None:
            for entry in rmap["weights"].values():
                entry["initializer"] = renames.get(entry["initializer"], entry["initializer"])
            convs = [n for n in model.graph.node if n.op_type == "Conv" and len(n.input) > 1
                     and n.input[1] in renames.values()]
            logger.info("%s: %d LoRA-targetable weight(s) are graph inputs, their base values %s/%s's (the same "
                        "bytes, stored once)", name, len(values), share_with, BASE_FILE)
            return model, {"weight_inputs": f"{share_with}/{BASE_FILE}", "spatial_conv_inputs": bool(convs),
                           "passes": records}
        logger.info("%s: its weight inputs are not %s's (%s): their base values go to %s/%s", name, share_with, why,
                    name, BASE_FILE)
    convs = [n for n in model.graph.node if n.op_type == "Conv" and len(n.input) > 1 and n.input[1] in values]
    stuck = sorted({n.input[1] for n in convs if is_pointwise(
        {a.name: helper.get_attribute_value(a) for a in n.attribute}, values[n.input[1]].shape)})
    if stuck:
        logger.warning("%s: %d 1x1 Conv(s) over weight inputs stayed Convs (%s; the reasons: -v), so the engine runs "
                       "NCHW on CUDA", name, len(stuck), ", ".join(stuck[:3]))
    (staging / name).mkdir(parents=True, exist_ok=True)
    save_file(values, str(staging / name / BASE_FILE))
    os.chmod(staging / name / BASE_FILE, umask_mode("file"))  # safetensors writes 0600; artifacts go to other users
    kept = len({e["initializer"] for e in rmap["weights"].values()} - set(values))
    logger.info("%s: %d LoRA-targetable weight(s) are graph inputs (%.1f MB in %s), %d spatial Conv weight(s) "
                "constant", name, len(values), sum(a.nbytes for a in values.values()) / 1e6, BASE_FILE, kept)
    return model, {"weight_inputs": f"{name}/{BASE_FILE}", "spatial_conv_inputs": bool(convs), "passes": records}


def shared_inputs(rmap: dict[str, Any], values: dict[str, np.ndarray], other: Path
                  ) -> tuple[dict[str, str] | None, str]:
    """Whether the weight inputs ``values`` (a component's, its refit map ``rmap``) are those of the component
    compiled into the folder ``other`` (its ``refit_map.json`` and ``lora_base.safetensors``), weight for weight.

    Returns:
        (this component's input name -> ``other``'s input name of the same torch weight, ``""``) when every input
        holds the same bytes as one of ``other``'s (the refit maps' ``initializer`` layout, ``transpose``,
        ``pointwise``, ``dtype`` and ``sha256`` agree) and both have the same weights as inputs; else (``None``,
        the first reason it is not so).
    """
    import json

    from safetensors import safe_open

    if not (other / "refit_map.json").is_file() or not (other / BASE_FILE).is_file():
        return None, f"{other.name} has no weight inputs"
    theirs = json.loads((other / "refit_map.json").read_text())["weights"]
    with safe_open(str(other / BASE_FILE), framework="numpy") as f:
        their_inputs = set(f.keys())
    mine = {w: e for w, e in rmap["weights"].items() if e["initializer"] in values}
    theirs = {w: e for w, e in theirs.items() if e["initializer"] in their_inputs}
    if set(mine) != set(theirs):
        first = sorted(set(mine) ^ set(theirs))[0]
        return None, f"{first} is an input of one and not of the other"
    keys = ("transpose", "pointwise", "dtype", "sha256")
    for w, e in mine.items():
        if any(e.get(k) != theirs[w].get(k) for k in keys):
            return None, f"{w} differs ({', '.join(k for k in keys if e.get(k) != theirs[w].get(k))})"
    return {e["initializer"]: theirs[w]["initializer"] for w, e in mine.items()}, ""


def rename_tensors(model: onnx.ModelProto, renames: dict[str, str]) -> None:
    """Rename tensors of ``model``'s top-level graph (inputs, initializers, value infos, node inputs and outputs) in
    place, all at once (``{a: b, b: c}`` swaps nothing into a clash). A tensor that is not renamed but holds a new
    name already is moved aside first (``<name>__<i>``): the exporter numbers tensors anew in each graph, so
    ``onnx::MatMul_5704`` can be a weight in one and another tensor in the next.

    Raises:
        ValueError: a new name is a graph input's or output's that is not renamed (they are the component's
            contract), two tensors would get one name, or a node has a subgraph (its outer-scope references are not
            followed); nothing is renamed then.
    """
    graph = model.graph
    if len(set(renames.values())) != len(renames):
        raise ValueError("two tensors would get one name")
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
        raise ValueError("a node has a subgraph")
    taken = {*(i.name for i in graph.input), *(o.name for o in graph.output), *(t.name for t in graph.initializer),
             *(v.name for v in graph.value_info), *(n for node in graph.node for n in (*node.input, *node.output))}
    contract = {o.name for o in graph.output} | {i.name for i in graph.input}
    moved: dict[str, str] = {}
    for new in renames.values():
        if new in contract and new not in renames:
            raise ValueError(f"{new!r} is a graph input or output")
        if new in taken and new not in renames:
            i = 0
            while f"{new}__{i}" in taken or f"{new}__{i}" in renames.values():
                i += 1
            moved[new] = f"{new}__{i}"
    full = {**moved, **renames}

    def rn(name: str) -> str:
        return full.get(name, name) if name else name

    for seq in (graph.input, graph.initializer, graph.value_info):
        for item in seq:
            item.name = rn(item.name)
    for node in graph.node:
        node.input[:] = [rn(n) for n in node.input]
        node.output[:] = [rn(n) for n in node.output]

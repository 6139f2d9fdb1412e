"""``compile --backend ort --refittable``: the LoRA-targetable weights of an ONNX Runtime graph become graph inputs.

Every Linear / Conv2d weight of the UNet and text encoder that the refit map ties to one initializer
(:func:`~diffusion_trt.compiler.lora.refit_map`) is taken out of ``graph.initializer`` and declared as a graph input
of the same name, dtype and shape; its values go to ``<component>/lora_base.safetensors`` (initializer name ->
array, in the graph's layout and dtype). The runtime binds those inputs on every run: the base values when no LoRA
is loaded, ``W + sum(scale * B @ A)`` computed on the device when one is (:mod:`diffusion_trt.runtime.lora_slots`,
which says why this mechanism and not ORT's own LoRA adapters). The artifact is no bigger: the weights moved, they
are not copied.

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


def expose_weights(model: onnx.ModelProto, rmap: dict[str, Any]) -> dict[str, np.ndarray]:
    """Turn every initializer the refit map names into a graph input, in place; return their values.

    Args:
        model: the optimized graph, weights in memory.
        rmap: its refit map (``{"weights": {torch name: {"initializer", ...}}}``).

    Returns:
        initializer name -> its array (the graph's dtype and layout), in graph order.
    """
    wanted = {e["initializer"] for e in rmap["weights"].values()}
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
    return values


def write_weight_inputs(name: str, model: onnx.ModelProto, rmap: dict[str, Any], staging: Path) -> dict[str, str]:
    """:func:`expose_weights` on ``model`` and its values written to ``<name>/lora_base.safetensors``.

    Returns:
        The manifest entry's ``{"weight_inputs": "<name>/lora_base.safetensors"}``.
    """
    from safetensors.numpy import save_file

    values = expose_weights(model, rmap)
    (staging / name).mkdir(parents=True, exist_ok=True)
    save_file(values, str(staging / name / BASE_FILE))
    logger.info("%s: %d LoRA-targetable weight(s) are graph inputs (%.1f MB in %s)", name, len(values),
                sum(a.nbytes for a in values.values()) / 1e6, BASE_FILE)
    return {"weight_inputs": f"{name}/{BASE_FILE}"}

"""Refit weights for ``EnginePipeline.load_lora``: base + LoRA, from safetensors, without model classes.

At compile time ``compiler.lora.refit_map`` ties every Linear / Conv2d weight of the UNet and text encoder(s) (the
layers a LoRA changes) to the ONNX initializer TensorRT built it from, by value: the same tensor, its transpose
(Linear exported as MatMul), in the initializer's dtype (fp16 after convert_fp16). :func:`refit_weights` then:

1. reads the base weights (fp32) from the model folder's safetensors, checked against the map's sha256 of every
   weight (:func:`base_weights`);
2. reads the LoRA with diffusers' own key conversion (kohya ``lora_unet_*``, old diffusers ``.lora.down``, peft
   ``lora_A``) and peft's scaling rule (``alpha / r`` per layer, times the LoRA scale), as ``compile --lora``'s
   ``load_lora_weights`` + ``fuse_lora`` does (:func:`~.lora_deltas.lora_deltas`);
3. returns the initializers whose value changed, plus those the previous LoRA changed (back to base): always base
   + this LoRA, never on top.

No diffusers or transformers model class is loaded (a serving host needs none): the LoRA key conversion comes from
``diffusers.loaders.lora_conversion_utils`` and ``diffusers.utils`` (plain functions on dicts of tensors).
LoRA variants whose merge is not ``W + scale * B @ A`` (DoRA, LoKr, LoRA biases) are refused with the fix: merge
them at compile time with ``--lora``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import LoraError
from ..lora import LoraFile
from .lora_deltas import lora_deltas

#: Weight files that are pickles: loading one runs arbitrary code (compile refuses them without --trust-pickle).
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")


def array_key(arr: Any) -> str:
    """sha256 over dtype, shape and bytes: equal keys = equal tensors."""
    a = np.ascontiguousarray(arr)
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def as_initializer(weight: torch.Tensor, transpose: bool, dtype: str) -> np.ndarray:
    """A torch weight as the ONNX initializer holds it (numpy, transposed for MatMul, in the graph's dtype).

    ``transpose`` on a 1x1 Conv2d weight ``[O, C, 1, 1]`` gives the ``[C, O]`` matrix ``W[:, :, 0, 0].T`` a MatMul
    over the channels reads (the refit map's ``pointwise``: ``passes/cancel_transposes`` rewrites NHWC-sandwiched 1x1
    Convs so, SD-1.5's ``proj_in``/``proj_out`` on CUDA targets; an ORT ``--refittable`` compile every 1x1 Conv over
    a weight input, ``compiler/pointwise_convs.py``)."""
    w = weight.detach().to("cpu", dtype=torch.float32)
    w = w.flatten(1).T if transpose else w
    return np.ascontiguousarray(w.numpy().astype(np.dtype(dtype)))


def refit_weights(
    maps: dict[str, dict[str, Any]],
    model_dir: Path,
    lora: LoraFile | None,
    previous: dict[str, dict[str, Any]] | None = None,
    *,
    trust_pickle: bool = False,
) -> dict[str, dict[str, np.ndarray]]:
    """The initializer values that turn the refittable engines into base + ``lora`` (see the module docstring).

    Args:
        maps: component -> its refit map (``compiler.lora.refit_map``).
        model_dir: the diffusers folder the artifact was compiled from.
        lora: the checked LoRA file and scale; ``None``: the base weights (``unload_lora``: the file is not read).
        previous: what the last call returned (its initializers go back to base if this LoRA leaves them).
        trust_pickle: allow pickle weights in ``model_dir`` (see :func:`weights_are_safetensors`).

    Returns:
        component -> {initializer name: numpy array in the initializer's dtype and layout}.

    Raises:
        LoraError: the folder's weights are not the artifact's (a weight's sha256 differs from the map's), are
            pickles without ``trust_pickle``, or cannot be read; the LoRA matches no (or only part of the) layers,
            changes a weight the engines cannot refit, leaves NaN/Inf, or is a variant refit cannot merge.
    """
    bases = {c: base_weights(model_dir, c, rmap, trust_pickle=trust_pickle) for c, rmap in maps.items()}
    deltas = {c: {} for c in maps} if lora is None else lora_deltas(
        lora, bases, unet_config=_sdxl_unet_config(model_dir) if "text_encoder_2" in maps else None,
        dead={c: rmap.get("dead", ()) for c, rmap in maps.items()})
    out: dict[str, dict[str, np.ndarray]] = {}
    for comp, rmap in maps.items():
        if lora is not None:
            _check_refittable(comp, rmap, deltas[comp], lora)
        before = set((previous or {}).get(comp, {}))
        weights = {}
        for wname, e in rmap["weights"].items():
            delta = deltas[comp].get(wname)
            merged = bases[comp][wname] if lora is None or delta is None else _merged(
                bases[comp][wname], delta, comp, wname, lora)
            arr = as_initializer(merged, e["transpose"], e["dtype"])
            if e["initializer"] in before or array_key(arr) != e["sha256"]:
                weights[e["initializer"]] = arr
        out[comp] = weights
    return out


def _merged(base: torch.Tensor, delta: torch.Tensor | None, comp: str, wname: str, lora: LoraFile) -> torch.Tensor:
    """``base + delta`` (peft's ``weight.data += delta_weight``), refused when it is not finite.

    Raises:
        LoraError: NaN/Inf in the merged weight (the engines would only give black images).
    """
    if delta is None:
        return base
    merged = base + delta
    if not bool(torch.isfinite(merged).all()):
        raise LoraError(
            f"LoRA file {lora.path} at scale {lora.scale:g} leaves NaN/Inf in {comp}.{wname}: the file "
            "holds non-finite values or the scale is too large; check the file, or use a smaller scale"
        )
    return merged


def _check_refittable(comp: str, rmap: Mapping[str, Any], deltas: Mapping[str, torch.Tensor], lora: LoraFile) -> None:
    """Refuse a LoRA that changes a weight the map could not tie to one initializer.

    Raises:
        LoraError: naming the weight and the fix (merge at compile time).
    """
    for wname in sorted(set(rmap.get("unmapped", [])) & set(deltas)):
        if bool(torch.any(deltas[wname] != 0)):
            raise LoraError(
                f"LoRA file {lora.path} changes the {comp} weight {wname}, which the engine cannot refit (the graph "
                "passes padded it, or it shares its values with another weight); merge this LoRA at compile time "
                "with --lora instead"
            )


# -- base weights: the model folder's safetensors --------------------------------------------------------------


def weights_are_safetensors(folder: Path, trust_pickle: bool) -> bool:
    """Whether ``folder`` (a component of a diffusers folder) is loaded from safetensors: True when it has any; else
    its weights are pickles, allowed only with ``trust_pickle`` (the rule of ``compile --trust-pickle``).

    Raises:
        LoraError: pickle weights without ``trust_pickle``, naming the file and the fix.
    """
    files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    if any(p.suffix == ".safetensors" for p in files):
        return True
    pickles = [p for p in files if p.suffix in PICKLE_SUFFIXES]
    if pickles and not trust_pickle:
        raise LoraError(
            f"{pickles[0]} is a pickle file and loading it runs arbitrary code; convert the model folder to "
            "safetensors (save_pretrained(..., safe_serialization=True)) or pass trust_pickle=True "
            "(load_lora(..., trust_pickle=True)) if you trust its source"
        )
    return not pickles  # no weights at all: base_weights names what is missing


def base_weights(model_dir: Path, comp: str, rmap: Mapping[str, Any], *, trust_pickle: bool = False
                 ) -> dict[str, torch.Tensor]:
    """The fp32 weights of ``comp`` the refit map names (mapped and unmapped), read from the model folder's weight
    files (safetensors; pickles with ``trust_pickle``), each checked against the map's sha256.

    Raises:
        LoraError: no weight files; pickles without ``trust_pickle``; a weight missing or different from the
            engine's (another model folder).
    """
    folder = Path(model_dir) / comp
    tensors = _read_weights(folder, weights_are_safetensors(folder, trust_pickle), [
        *rmap["weights"], *rmap.get("unmapped", [])])
    for wname, e in rmap["weights"].items():
        w = tensors.get(wname)
        if w is None or array_key(as_initializer(w, e["transpose"], e["dtype"])) != e["sha256"]:
            raise LoraError(
                f"the model folder {model_dir} is not the one the artifact was compiled from: its {comp} weight "
                f"{wname} differs from the engine's; pass model_dir= the original diffusers folder"
            )
    return tensors


def _weight_files(folder: Path, safetensors: bool) -> list[Path]:
    """The weight files ``from_pretrained`` reads without a variant: ``model.safetensors``, its shards
    (``model-00001-of-00002.safetensors``), ``diffusion_pytorch_model.safetensors`` (or the ``.bin`` files)."""
    suffix = ".safetensors" if safetensors else ".bin"
    files = sorted(folder.glob(f"*{suffix}")) if folder.is_dir() else []
    return [p for p in files if "." not in p.name.removesuffix(suffix)]


def _read_weights(folder: Path, safetensors: bool, names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Tensors ``names`` of the weight files in ``folder`` as fp32 CPU tensors (those found; older transformers
    checkpoints name CLIP weights ``text_model.<name>``).

    Raises:
        LoraError: no weight file in ``folder``.
    """
    files = _weight_files(folder, safetensors)
    if not files:
        raise LoraError(
            f"cannot load {folder.name}/ from the model folder {folder.parent} (no weight file in {folder}); "
            "load_lora needs the diffusers folder the artifact was compiled from: pass model_dir="
        )
    wanted = set(names)
    out: dict[str, torch.Tensor] = {}
    for path in files:
        for key, value in _file_tensors(path, safetensors, wanted):
            out[key] = value.to(torch.float32)
    return out


def _file_tensors(path: Path, safetensors: bool, wanted: set[str]) -> Iterable[tuple[str, torch.Tensor]]:
    """(weight name, tensor) for every tensor of ``path`` whose name, or name without ``text_model.``, is wanted."""
    if safetensors:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                name = _wanted_name(key, wanted)
                if name is not None:
                    yield name, f.get_tensor(key)
        return
    for key, value in torch.load(path, map_location="cpu", weights_only=True).items():
        name = _wanted_name(key, wanted)
        if name is not None:
            yield name, value


def _wanted_name(key: str, wanted: set[str]) -> str | None:
    for name in (key, key.removeprefix("text_model."), f"text_model.{key}"):
        if name in wanted:
            return name
    return None


def _sdxl_unet_config(model_dir: Path) -> Any:
    """``unet/config.json`` as attributes (what ``_maybe_map_sgm_blocks_to_diffusers`` reads); empty when absent."""
    from types import SimpleNamespace

    path = Path(model_dir) / "unet" / "config.json"
    return SimpleNamespace(**(json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}))


def onnx_initializers(path: Path, names: Any) -> dict[str, Any]:
    """Initializers ``names`` of the ONNX file ``path`` as numpy arrays (external data read for those only)."""
    import onnx
    from onnx import numpy_helper

    wanted = set(names)
    model = onnx.load(str(path), load_external_data=False)
    return {
        t.name: numpy_helper.to_array(t, base_dir=str(path.parent)) for t in model.graph.initializer if t.name in wanted
    }

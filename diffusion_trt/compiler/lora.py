"""LoRA at compile time: merging into the torch modules before export, and the refit maps of refittable engines.

``diffusion-trt compile MODEL --lora FILE[:scale]`` (repeatable) merges each LoRA into the exported weights,
with diffusers' own code, one after another in command-line order (:func:`merge_loras`):

1. ``pipeline.load_lora_weights(FILE, adapter_name=...)`` (``diffusers/loaders/lora_pipeline.py``,
   ``StableDiffusionLoraLoaderMixin``; ``StableDiffusionXLLoraLoaderMixin`` for SDXL): every format diffusers reads
   (diffusers/peft keys, kohya ``lora_unet_*``/``lora_te_*`` with ``.alpha``...), converted by diffusers;
2. ``pipeline.fuse_lora(lora_scale=scale, adapter_names=[...])``: peft's merge, ``W += scale * (alpha / r) * B @ A``
   for every layer the LoRA targets (UNet and text encoder(s));
3. ``pipeline.unload_lora_weights()``: the plain modules again, fused weights kept.

The manifest records every merged LoRA (``"loras": [{"file", "sha256", "scale", "layers"}]``), so that a LoRA
is never applied twice (``EnginePipeline.load_lora`` refuses a file merged already).

``compile --backend tensorrt --refittable`` writes a refit map per component (:func:`refit_map`): which ONNX
initializer holds each Linear / Conv2d weight; ``EnginePipeline.load_lora`` computes base + LoRA for those
initializers without model classes (:mod:`diffusion_trt.runtime.refit`).

The file checks (``FILE[:scale]`` parsing, safetensors, sha256) are :mod:`diffusion_trt.lora`'s, shared with the
runtime. torch, diffusers and peft are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

from ..errors import LoraError, MissingPackageError
from ..lora import LoraFile, check_lora_files, error_summary  # check_lora_files: compile's check, before any work
from ..runtime.lora_deltas import is_down_key
from ..runtime.refit import array_key, as_initializer, weights_are_safetensors

logger = logging.getLogger(__name__)

__all__ = ["REFIT_COMPONENTS", "REFIT_MAP_FORMAT", "check_lora_files", "load_base_modules", "merge_loras", "refit_map"]

#: Components whose weights a LoRA changes, in the order diffusers loads them.
REFIT_COMPONENTS: tuple[str, ...] = ("unet", "text_encoder", "text_encoder_2")
REFIT_MAP_FORMAT = 1


def _require_peft() -> None:
    from diffusers.utils import USE_PEFT_BACKEND

    if not USE_PEFT_BACKEND:
        raise MissingPackageError(
            "merging LoRAs needs diffusers' PEFT backend (peft >= 0.17 and transformers > 4.45): "
            "pip install 'diffusion-trt[lora]' (or pip install peft)"
        )


def _lora_host(models: dict[str, Any]) -> Any:
    """A diffusers pipeline object around the loaded modules (its LoRA mixin does the loading and fusing)."""
    import diffusers

    if models.get("text_encoder_2") is not None:
        return diffusers.StableDiffusionXLPipeline(
            vae=models["vae"], text_encoder=models["text_encoder"], text_encoder_2=models["text_encoder_2"],
            tokenizer=None, tokenizer_2=None, unet=models["unet"], scheduler=None,
        )
    return diffusers.StableDiffusionPipeline(
        vae=models.get("vae"), text_encoder=models.get("text_encoder"), tokenizer=None, unet=models["unet"],
        scheduler=None, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def lora_layer_count(module: Any, adapter: str) -> int:
    """Layers of ``module`` that carry the peft adapter ``adapter`` (after ``load_lora_weights``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sum(1 for m in module.modules() if isinstance(m, BaseTunerLayer) and adapter in getattr(m, "lora_A", {}))


def merge_loras(models: dict[str, Any], loras: list[LoraFile]) -> list[dict[str, Any]]:
    """Merge ``loras`` into the torch modules in ``models`` (in place), one after another; see the module docstring.

    Args:
        models: ``unet``, ``text_encoder``, ``vae`` (and ``text_encoder_2`` for SDXL) torch modules, fp32.
        loras: checked files (:func:`check_lora_files`).

    Returns:
        The manifest records (:meth:`LoraFile.record`), in order.

    Raises:
        MissingPackageError: peft is missing (exit 2).
        LoraError: diffusers cannot read or merge the file (its message quoted); the file's keys match no
            layer of the UNet or text encoder(s) (a LoRA for another architecture); or fewer layers took the LoRA
            than it has (partly another architecture).
    """
    if not loras:
        return []
    _require_peft()
    host = _lora_host(models)
    components = [c for c in ("unet", "text_encoder", "text_encoder_2") if models.get(c) is not None]
    records = []
    for i, lora in enumerate(loras):
        adapter = f"diffusion_trt_lora_{i}"
        try:
            state, _ = type(host).lora_state_dict(str(lora.path))
            expected = sum(1 for k in state if is_down_key(k))
            with _diffusers_logs_at_debug():
                host.load_lora_weights(str(lora.path), adapter_name=adapter)
        except (ValueError, KeyError, RuntimeError, TypeError, IndexError) as e:  # IndexError: some key forms
            logger.debug("load_lora_weights(%s) failed:\n%s", lora.path, e)
            raise LoraError(
                f"LoRA file {lora.path}: diffusers could not load it into this model ({error_summary(e)}); was it made "
                "for another architecture (SD 1.x / 2.x / SDXL)?"
            ) from e
        layers = {c: lora_layer_count(models[c], adapter) for c in components}
        if not any(layers.values()):
            raise LoraError(
                f"LoRA file {lora.path}: none of its {expected} LoRA layers matches a layer of this model's "
                f"{' or '.join(components)} (keys like {next(iter(state), '?')!r}); it was made for another "
                "architecture"
            )
        if expected and sum(layers.values()) < expected:
            raise LoraError(
                f"LoRA file {lora.path}: only {sum(layers.values())} of its {expected} LoRA layers match layers of "
                "this model; it was made for another architecture (merging part of it would give neither model)"
            )
        try:
            host.fuse_lora(components=[c for c, n in layers.items() if n], lora_scale=lora.scale,
                           adapter_names=[adapter])
        except (ValueError, RuntimeError) as e:  # peft: a LoRA bias on a layer that has none
            raise LoraError(f"LoRA file {lora.path}: diffusers could not merge it into this model "
                            f"({error_summary(e)})") from e
        host.unload_lora_weights()
        _check_finite(models, [c for c, n in layers.items() if n], lora)
        logger.info("merged LoRA %s (scale %g): %s", lora.path.name, lora.scale,
                    ", ".join(f"{c} {n} layers" for c, n in layers.items() if n))
        records.append(lora.record({c: n for c, n in layers.items() if n}))
    return records


def _check_finite(models: dict[str, Any], components: list[str], lora: LoraFile) -> None:
    """Refuse a merge that left NaN/Inf in a weight (a broken file, or a scale that overflows fp32): the engines
    would only ever give black images.

    Raises:
        LoraError: naming the first non-finite parameter.
    """
    import torch

    for component in components:
        for name, param in models[component].named_parameters():
            if not bool(torch.isfinite(param).all()):
                raise LoraError(
                    f"LoRA file {lora.path} at scale {lora.scale:g} leaves NaN/Inf in {component}.{name}: the file "
                    "holds non-finite values or the scale is too large; check the file, or use a smaller scale"
                )


@contextlib.contextmanager
def _diffusers_logs_at_debug() -> Iterator[None]:
    """Silence diffusers' own log lines (it logs the error it then raises, and warnings per key prefix) unless this
    module logs at DEBUG (``-v``): the error is reported once, by the caller."""
    diffusers_logger = logging.getLogger("diffusers")
    level = diffusers_logger.level
    if not logger.isEnabledFor(logging.DEBUG):
        diffusers_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        diffusers_logger.setLevel(level)


def refit_map(model: Any, module: Any, find_dead: Callable[[list[str]], Collection[str]] | None = None
              ) -> dict[str, Any]:
    """Which ONNX initializer of ``model`` holds each Linear / Conv2d weight of ``module``, by value (the same
    tensor, or its transpose for a Linear exported as MatMul or a 1x1 Conv rewritten as one, ``[C, O]``:
    ``pointwise``; in the initializer's dtype: fp16 after convert_fp16).

    Args:
        model: the optimized ``onnx.ModelProto`` TensorRT builds from (weights in memory).
        module: the torch module it was exported from (``unet``, ``text_encoder``...).
        find_dead: given the weights found in no initializer, those that reach no output of the graph
            (:func:`~diffusion_trt.compiler.dead_weights.dead_weights`: SDXL's last ``text_encoder`` layer); ``None``:
            none is tested.

    Returns:
        ``{"format": 1, "weights": {"<module path>.weight": {"initializer", "transpose", "dtype", "sha256"[,
        "pointwise"]}},
        "unmapped": [weights found in no initializer, or in one shared with another weight, that are not dead],
        "dead": [weights no output depends on: a LoRA's layers on them change nothing and are ignored]}``
        (maps written before ``dead`` existed lack it: none dead).

    This is the map TensorRT refits from, as it is. An ORT ``--refittable`` compile then rewrites the 1x1 Convs over
    weight inputs as channels-last MatMuls and updates their entries (``transpose``, ``pointwise``, ``sha256`` of the
    ``[C, O]`` layout; :func:`~.lora_slots.expose_weights`) before the map is written for the runtime.
    """
    import torch
    from onnx import TensorProto, numpy_helper

    dtypes = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16"}
    by_key: dict[str, str] = {}
    graph_dtypes = set()
    for init in model.graph.initializer:
        if init.data_type in dtypes and len(init.dims) >= 2:
            by_key.setdefault(array_key(numpy_helper.to_array(init)), init.name)
            graph_dtypes.add(dtypes[init.data_type])
    weights: dict[str, dict[str, Any]] = {}
    unmapped: list[str] = []
    not_found: list[str] = []
    claimed: dict[str, str] = {}
    for name, m in module.named_modules():
        if not isinstance(m, torch.nn.Linear | torch.nn.Conv2d):
            continue
        wname = f"{name}.weight"
        found = None
        for dtype in sorted(graph_dtypes):
            pointwise = m.weight.ndim == 4 and tuple(m.weight.shape[2:]) == (1, 1)
            for transpose in (False, True) if m.weight.ndim == 2 or pointwise else (False,):
                key = array_key(as_initializer(m.weight, transpose, dtype))
                if key in by_key:
                    found = {"initializer": by_key[key], "transpose": transpose, "dtype": dtype, "sha256": key,
                             **({"pointwise": True} if transpose and pointwise else {})}
                    break
            if found:
                break
        if found is None:
            unmapped.append(wname)
            not_found.append(wname)
        elif found["initializer"] in claimed:  # two weights with equal values: refitting one would change both
            unmapped += [wname, claimed[found["initializer"]]]
            weights.pop(claimed[found["initializer"]], None)
        else:
            claimed[found["initializer"]] = wname
            weights[wname] = found
    dead = set(find_dead(not_found)) & set(not_found) if find_dead is not None and not_found else set()
    return {"format": REFIT_MAP_FORMAT, "weights": weights, "unmapped": sorted(set(unmapped) - dead),
            "dead": sorted(dead)}


def load_base_modules(model_dir: Path, components: Any, *, trust_pickle: bool = False) -> dict[str, Any]:
    """The UNet and text encoder(s) of a diffusers folder, fp32 on the CPU (what compile exported; compile time and
    tests only: load_lora reads the weights without model classes, :func:`~diffusion_trt.runtime.refit.base_weights`).

    Args:
        model_dir: the diffusers folder.
        components: "unet", "text_encoder", "text_encoder_2".
        trust_pickle: allow ``.bin``/``.ckpt`` weights where a component has no safetensors (unpickling runs
            arbitrary code), as ``compile --trust-pickle``.

    Raises:
        LoraError: the folder or a component cannot be loaded, or its weights are pickles and ``trust_pickle`` is
            false.
    """
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    classes = {"unet": UNet2DConditionModel, "text_encoder": CLIPTextModel,
               "text_encoder_2": CLIPTextModelWithProjection}
    models: dict[str, Any] = {}
    for comp in components:
        use_st = weights_are_safetensors(Path(model_dir) / comp, trust_pickle)
        try:
            if comp == "unet":
                m = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet", local_files_only=True,
                                                         use_safetensors=use_st)
            else:
                m = classes[comp].from_pretrained(Path(model_dir) / comp, local_files_only=True,
                                                  use_safetensors=use_st)
        except (OSError, ValueError) as e:
            raise LoraError(
                f"cannot load {comp}/ from the model folder {model_dir} ({e}); load_lora needs the diffusers folder "
                "the artifact was compiled from: pass model_dir="
            ) from e
        models[comp] = m.eval()
    models["vae"] = None
    return models

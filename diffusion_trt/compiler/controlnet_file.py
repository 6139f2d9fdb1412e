"""Single-file ControlNets (``--controlnet [NAME=]FILE.safetensors``), loaded by diffusers' ``from_single_file``.

A1111 and lllyasviel's ControlNet-v1-1 ship ControlNets as one file in the original LDM key layout
(``control_model.input_blocks...`` or bare ``input_blocks...``, ``zero_convs``, ``input_hint_block``); some SDXL ones
are a diffusers state dict in one file. diffusers' ``ControlNetModel.from_single_file`` converts both; this module only
chooses where the diffusers config comes from, always offline (``local_files_only=True``), in this order:

1. ``FILE.yaml`` beside the file: the original LDM config (``cldm_v15.yaml``-style, the A1111 convention), mapped by
   diffusers (``original_config=``).
2. ``config.json`` of a ``ControlNetModel`` in the file's folder: diffusers' ``config=`` argument (that folder).
3. Neither: diffusers infers the Hub repo from the keys (e.g. ``lllyasviel/control_v11p_sd15_canny``) and reads its
   config.json from the local Hugging Face cache only.

Pickled files (``.pt``, ``.pth``, ``.ckpt``, ``.bin``) are refused before any byte is read: no unpickling.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelFolderError

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl")
#: Key parts only a ControlNet has: the LDM layout's hint encoder and zero convolutions, diffusers' names for them.
CONTROLNET_KEY_PARTS = ("input_hint_block.", "zero_convs.", "controlnet_cond_embedding.", "controlnet_down_blocks.")


def is_single_file(path: str | Path) -> bool:
    """Whether ``--controlnet`` names one file (a single-file ControlNet) rather than a diffusers folder."""
    p = Path(path)
    return p.is_file() or p.suffix.lower() in (".safetensors", *PICKLE_SUFFIXES)


def config_route(path: Path) -> dict[str, str]:
    """The keyword that tells ``from_single_file`` where the config is (see the module docstring): ``original_config``
    (``FILE.yaml``), ``config`` (the folder of a ControlNetModel config.json) or nothing (diffusers' own inference)."""
    yaml = path.with_suffix(".yaml")
    if yaml.is_file():
        return {"original_config": str(yaml)}
    beside = path.parent / "config.json"
    if beside.is_file():
        try:
            cls = json.loads(beside.read_text(encoding="utf-8")).get("_class_name")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            cls = None
        if cls == "ControlNetModel":
            return {"config": str(path.parent)}
    return {}


def load_single_file(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``ControlNetModel.from_single_file(path)`` (eval), its config resolved offline by :func:`config_route`.

    Args:
        path: a ``.safetensors`` ControlNet, original LDM layout or diffusers layout.
        dtype: the parameters' dtype.

    Raises:
        ModelFolderError: the file is missing, pickled (``.pt``/``.pth``/``.ckpt``/``.bin``: convert it to
            safetensors), not safetensors, holds no ControlNet (a LoRA, a checkpoint...: none of
            :data:`CONTROLNET_KEY_PARTS`), or diffusers cannot find its config offline or load it (its message kept).
    """
    from diffusers import ControlNetModel

    file = Path(path)
    if file.suffix.lower() in PICKLE_SUFFIXES:
        raise ModelFolderError(f"--controlnet {file} is a pickled checkpoint ({file.suffix}); it is not unpickled "
                               "(a pickle can run code). Convert it to .safetensors (e.g. safetensors.torch.save_file "
                               "of torch.load(path, weights_only=True)) and pass that")
    if not file.is_file():
        raise ModelFolderError(f"--controlnet {file}: no such file; pass a ControlNet .safetensors or a diffusers "
                               "ControlNetModel folder")
    if file.suffix.lower() != ".safetensors":
        raise ModelFolderError(f"--controlnet {file} is neither a .safetensors file nor a diffusers ControlNetModel "
                               "folder")
    _refuse_other_kinds(file)
    route = config_route(file)
    try:
        model = ControlNetModel.from_single_file(str(file), local_files_only=True, torch_dtype=dtype, **route)
    except Exception as e:
        raise ModelFolderError(f"could not load the single-file ControlNet {file} ({_route_label(route)}): "
                               f"{_one_line(e)}; {_fix(file, route)}") from e
    logger.info("loaded the single-file ControlNet %s (%s)", file, _route_label(route))
    return model.eval()


def single_file_config(path: str | Path) -> dict[str, Any]:
    """The diffusers config of a single-file ControlNet as ``from_single_file`` builds it (the file is loaded once).

    Raises:
        ModelFolderError: as :func:`load_single_file`.
    """
    model = load_single_file(path)
    config = dict(model.config)
    config.setdefault("_class_name", "ControlNetModel")
    del model
    return config


def _refuse_other_kinds(file: Path) -> None:
    """Refuse a safetensors file that is no ControlNet (a LoRA given to --controlnet instead of --lora, an SD
    checkpoint...) from its header's keys, before diffusers guesses a config for it (whose message then spoke of a
    Hub repo's config.json missing from the cache).

    Raises:
        ModelFolderError: the header cannot be read, or no key holds a part of :data:`CONTROLNET_KEY_PARTS`.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
    except Exception as e:  # safetensors raises its own SafetensorError (and OSError) for a damaged header
        raise ModelFolderError(f"--controlnet {file} is not a readable safetensors file ({_one_line(e)}); pass a "
                               "ControlNet .safetensors or a diffusers ControlNetModel folder") from e
    if any(part in k for k in keys for part in CONTROLNET_KEY_PARTS):
        return
    lora = any("lora" in k.lower() for k in keys)
    what = "it holds LoRA layers: pass it with --lora (compile) or run --lora" if lora else "it is not a ControlNet"
    example = f" (keys like {keys[0]!r})" if keys else " (no tensors)"
    raise ModelFolderError(f"--controlnet {file} holds no ControlNet weights{example}: none of its keys has "
                           f"{', '.join(p.rstrip('.') for p in CONTROLNET_KEY_PARTS)}; {what}")


def _route_label(route: dict[str, str]) -> str:
    if "original_config" in route:
        return f"config from {Path(route['original_config']).name}"
    if "config" in route:
        return f"config from {route['config']}/config.json"
    return "config inferred by diffusers from the keys, from the local Hugging Face cache"


def _fix(file: Path, route: dict[str, str]) -> str:
    if "original_config" in route:
        return (f"check that {file.with_suffix('.yaml').name} is this ControlNet's original LDM config (cldm_v15.yaml-"
                "style, with model.params.control_stage_config)")
    if "config" in route:
        return f"check that {file.parent / 'config.json'} is this ControlNet's diffusers config"
    return (f"put its original LDM config beside it as {file.with_suffix('.yaml').name}, or the config.json of its "
            "diffusers ControlNetModel in its folder")


def _one_line(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 400 else text[:400] + "..."

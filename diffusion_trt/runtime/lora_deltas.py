"""LoRA deltas without model classes: ``scale * (alpha / r) * B @ A`` per layer, as diffusers + peft merge them.

``compile --lora`` merges with ``load_lora_weights`` + ``fuse_lora`` (:mod:`diffusion_trt.compiler.lora`); this is
the same arithmetic for ``EnginePipeline.load_lora`` on a serving host, from the file alone:

1. the tensors, converted as diffusers' ``lora_state_dict`` converts them (``dora_scale`` dropped; kohya
   ``lora_unet_*``/``lora_te_*`` keys and their ``.alpha`` by ``diffusers.loaders.lora_conversion_utils``);
2. per component, the keys in peft form (``diffusers.utils.state_dict_utils``) and the adapter config
   (``diffusers.utils.peft_utils.get_peft_kwargs``, or the file header's ``lora_adapter_metadata``);
3. per layer, peft's ``scaling = lora_alpha / r`` (``rank_pattern``/``alpha_pattern`` matched as peft does), times
   the LoRA scale (``fuse_lora``'s ``scale_layer``), times peft's ``get_delta_weight`` (Linear ``B @ A``; Conv2d).

Bit for bit what the merge path gives (``tests/compiler/test_lora.py``). Variants whose merge is not ``W + delta``
(DoRA, LoKr, LoRA biases) and layers on no weight input (peft's embedding LoRA) are refused with the fix: merge
them at compile time with ``--lora``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import is_real_number
from ..errors import LoraError
from ..lora import LORA_METADATA_KEY, LoraFile, adapter_metadata, error_summary

logger = logging.getLogger(__name__)

#: What peft's ``LoraConfig`` takes for the settings a header's adapter metadata leaves out (diffusers builds
#: ``LoraConfig(**metadata)``).
_PEFT_DEFAULTS = {"r": 8, "lora_alpha": 8}
#: Text encoder modules diffusers reads a LoRA rank for (``_load_lora_into_text_encoder``).
_TEXT_RANK_MODULES = (".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")


def lora_deltas(lora: LoraFile, bases: Mapping[str, Mapping[str, torch.Tensor]], unet_config: Any = None,
                *, device: torch.device | None = None,
                constants: Mapping[str, Collection[str]] | None = None,
                dead: Mapping[str, Collection[str]] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """``scale * (alpha / r) * B @ A`` per weight the LoRA targets, component by component (peft's delta weight).

    Args:
        lora: the checked file and scale.
        bases: component -> {weight name: base weight}: the layers a LoRA may target (only their shapes are read:
            ``meta`` tensors do).
        unet_config: SDXL: the UNet's config (``layers_per_block``), to map kohya's SGM block names as
            ``StableDiffusionXLLoraLoaderMixin`` does; ``None`` for SD 1.x/2.x.
        device: where the LoRA's matrices go and the deltas are computed; ``None`` = the CPU.
        constants: component -> weight names of the model that the artifact keeps constant (an ORT ``--refittable``
            artifact's spatial Conv weights, :mod:`~diffusion_trt.runtime.lora_slots`); a LoRA layer on one is
            refused. ``None``: none.
        dead: component -> weight names of the model that reach no output of its graph (the refit map's ``dead``:
            SDXL's last ``text_encoder`` layer, :mod:`~diffusion_trt.compiler.dead_weights`); a LoRA layer on one
            changes nothing: it counts as matched, gets no delta, and one INFO line says how many were ignored.
            ``None``: none.

    Returns:
        component -> {weight name: fp32 delta of the weight's shape}.

    Raises:
        LoraError: diffusers cannot convert the file's keys; a LoRA variant refit cannot merge; its layers match
            none (or only part) of the components' layers (a LoRA for another architecture; the message names the
            first layer that matches none); a layer on a weight of ``constants`` (naming it and the fix); a
            layer whose A and B matrices do not multiply into its weight, or with one of them only.
    """
    state, alphas, metadata = _lora_state_dict(lora.path, unet_config)
    if device is not None:
        state = {k: v.to(device) for k, v in state.items()}
    expected = sum(1 for k in state if is_down_key(k))
    constants, dead = constants or {}, dead or {}
    ignored: dict[str, list[str]] = {c: [] for c in bases}
    unmatched: dict[str, list[str]] = {c: [] for c in bases}
    deltas = {c: _component_deltas(c, state, alphas, metadata, bases[c], lora, constants.get(c, ()),
                                   frozenset(dead.get(c, ())), ignored[c], unmatched[c]) for c in bases}
    n_ignored = sum(len(v) for v in ignored.values())
    matched = sum(len(d) for d in deltas.values()) + n_ignored
    components = " or ".join(bases)
    if not matched:
        raise LoraError(
            f"LoRA file {lora.path}: none of its {expected} LoRA layers matches a layer of this model's "
            f"{components} (keys like {next(iter(state), '?')!r}); it was made for another architecture"
        )
    if expected and matched < expected:
        first = next((key for keys in unmatched.values() for key in keys), None) or _first_foreign(state, bases)
        raise LoraError(
            f"LoRA file {lora.path}: only {matched} of its {expected} LoRA layers match layers of "
            f"this model (the first that matches none: {first!r}); it was made for another architecture (merging "
            "part of it would give neither model)"
        )
    if n_ignored:
        logger.info("LoRA %s: %d of its %d layers ignored (%s): they train weights no output of this artifact reads "
                    "(e.g. SDXL's last text_encoder layer, whose output SDXL does not use), so they change nothing",
                    lora.path.name, n_ignored, expected, ", ".join(f"{c} {len(v)}" for c, v in ignored.items() if v))
    return deltas


def _first_foreign(state: Mapping[str, torch.Tensor], bases: Mapping[str, Any]) -> str:
    """The first down-matrix key of ``state`` (file order) whose prefix names no component of ``bases``
    (``text_encoder_2.`` on SD 1.x, no prefix), for messages; "?" if none."""
    return next((key for key in state if is_down_key(key) and key.split(".")[0] not in bases), "?")


def _lora_state_dict(path: Path, unet_config: Any) -> tuple[dict[str, torch.Tensor], dict[str, float], Any]:
    """diffusers' ``lora_state_dict``: the tensors (``dora_scale`` dropped), kohya keys converted with their alphas,
    and the adapter metadata of the safetensors header.

    Raises:
        LoraError: diffusers cannot convert the keys.
    """
    from diffusers.loaders.lora_conversion_utils import (
        _convert_non_diffusers_lora_to_diffusers,
        _maybe_map_sgm_blocks_to_diffusers,
    )
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if "dora_scale" not in k}
        raw = (f.metadata() or {}).get(LORA_METADATA_KEY)
    alphas: dict[str, float] = {}
    kohya = ("lora_te_", "lora_unet_", "lora_te1_", "lora_te2_")
    if state and all(k.startswith(kohya) for k in state):
        try:
            if unet_config is not None:  # SDXL
                state = _maybe_map_sgm_blocks_to_diffusers(state, unet_config)
            state, alphas = _convert_non_diffusers_lora_to_diffusers(state)
        except (ValueError, KeyError) as e:
            logger.debug("converting the keys of %s failed:\n%s", path, e)
            raise LoraError(f"LoRA file {path}: diffusers could not convert its keys ({error_summary(e)})") from e
    return state, alphas or {}, adapter_metadata(path, raw) if raw else None


def _component_deltas(comp: str, state: Mapping[str, torch.Tensor], alphas: Mapping[str, float], metadata: Any,
                      base: Mapping[str, torch.Tensor], lora: LoraFile, constants: Collection[str] = (),
                      dead: Collection[str] = frozenset(), ignored: list[str] | None = None,
                      unmatched: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The deltas of one component (``unet``, ``text_encoder``, ``text_encoder_2``); see :func:`lora_deltas`. The
    weight names of its layers on ``dead`` weights are appended to ``ignored`` (no delta), the down-matrix keys (peft
    form, ``unet.<module>.lora_A.weight``) of its layers on no weight of ``base`` or ``dead`` to ``unmatched``.

    Raises:
        LoraError: see :func:`lora_deltas`; a layer with a down (A) or an up (B) matrix only."""
    sub = {k.removeprefix(f"{comp}."): v for k, v in state.items() if k.startswith(f"{comp}.")}
    if not sub:
        return {}
    sub_alphas = {k.removeprefix(f"{comp}."): v for k, v in alphas.items() if k.split(".")[0] == comp}
    sub_meta = ({k.removeprefix(f"{comp}."): v for k, v in metadata.items() if k.startswith(f"{comp}.")}
                if metadata is not None else None)
    config = None if sub_meta is None else _metadata_config(comp, sub_meta, lora)
    try:
        peft_state, rank = _peft_state(comp, sub, [*base, *dead])
        if config is None:
            config = _lora_config(comp, peft_state, rank, sub_alphas)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        logger.debug("reading the %s keys of %s failed:\n%s", comp, lora.path, e)
        raise LoraError(f"LoRA file {lora.path}: diffusers could not read its {comp} keys ({error_summary(e)}); was it "
                        "made for another architecture (SD 1.x / 2.x / SDXL)?") from e
    _refuse_variants(peft_state, config, lora)
    _refuse_constants(comp, peft_state, constants, lora)
    out = {}
    downs = sorted({k.split(".lora_A.")[0] for k in peft_state if ".lora_A." in k})
    ups = {k.split(".lora_B.")[0] for k in peft_state if k.endswith(".lora_B.weight")}
    lone = [(m, "an up (B)", "down (A)") for m in sorted(ups - set(downs))]
    known = {*base, *dead}
    lone += [(m, "a down (A)", "up (B)") for m in downs if m not in ups and f"{m}.weight" in known]
    if lone:
        module, has, lacks = lone[0]
        raise LoraError(f"LoRA file {lora.path}: its layer {comp}.{module} has {has} matrix but no {lacks} one; the "
                        "file is damaged: re-save it, or drop that layer's keys")
    for module in downs:
        wname = f"{module}.weight"
        if wname not in base and wname not in dead:
            if unmatched is not None:
                unmatched.append(f"{comp}.{module}.lora_A.weight")
        elif wname not in base:
            if ignored is not None:
                ignored.append(wname)
        else:
            scaling = _scaling(config, module) * lora.scale  # fuse_lora's scale_layer: scaling *= lora_scale
            a, b = peft_state[f"{module}.lora_A.weight"], peft_state[f"{module}.lora_B.weight"]
            if metadata is not None and _config_rank(config, module) != a.shape[0]:  # peft's A has the config's rank
                raise LoraError(
                    f"LoRA file {lora.path}: its layer {comp}.{module} has rank {a.shape[0]} but its header's "
                    f"{LORA_METADATA_KEY!r} gives rank {_config_rank(config, module)} (peft's default 8 where it "
                    "names none): diffusers cannot load it either; drop that header entry or fix its r / rank_pattern"
                )
            try:
                out[wname] = _delta_weight(a.to(torch.float32), b.to(torch.float32), base[wname], scaling)
            except (RuntimeError, IndexError) as e:  # A and B do not multiply (ranks or dimensions differ)
                raise LoraError(
                    f"LoRA file {lora.path}: its layer {comp}.{module} has a {tuple(a.shape)} down (A) and a "
                    f"{tuple(b.shape)} up (B) matrix, which give no update for its {tuple(base[wname].shape)} weight "
                    "(their ranks or widths disagree); the file is damaged or was made for another architecture"
                ) from e
            if tuple(out[wname].shape) != tuple(base[wname].shape):
                raise LoraError(
                    f"LoRA file {lora.path}: its layer {comp}.{module} gives a {tuple(out[wname].shape)} update for a "
                    f"{tuple(base[wname].shape)} weight; it was made for another architecture (other widths)"
                )
    return out


def _peft_state(comp: str, sub: dict[str, torch.Tensor], base: Collection[str]
                ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """The component's LoRA keys in peft form (``<module>.lora_A.weight``) and its ranks, as diffusers makes them
    (``load_lora_adapter`` for the UNet, ``_load_lora_into_text_encoder`` for text encoders, over every weight
    name of ``base``: the dead ones too, as diffusers reads every module's rank)."""
    from diffusers.utils.state_dict_utils import (
        convert_state_dict_to_diffusers,
        convert_state_dict_to_peft,
        convert_unet_state_dict_to_peft,
    )

    if comp == "unet":
        state = sub if "lora_A" in next(iter(sub)) else convert_unet_state_dict_to_peft(sub)
        return state, {f"^{k}": v.shape[1] for k, v in state.items() if "lora_B" in k and v.ndim > 1}
    state = convert_state_dict_to_peft(convert_state_dict_to_diffusers(sub))
    if not any(n.startswith("text_model.") for n in base):  # CLIP flattened in transformers 5
        state = {k.removeprefix("text_model."): v for k, v in state.items()}
    modules = {n.removesuffix(".weight") for n in base}
    rank = {f"{m}.lora_B.weight": state[f"{m}.lora_B.weight"].shape[1] for m in sorted(modules)
            if m.endswith(_TEXT_RANK_MODULES) and f"{m}.lora_B.weight" in state}
    return state, rank


def _lora_config(comp: str, state: dict[str, torch.Tensor], rank: dict[str, int], alphas: dict[str, float]
                 ) -> dict[str, Any]:
    """diffusers' ``_create_lora_config`` kwargs (``r``, ``lora_alpha``, ``rank_pattern``, ``alpha_pattern``,
    ``use_rslora``...) of a file without adapter metadata: ``get_peft_kwargs``. The layers merged are those the
    state dict holds (a layer the config targets but the file lacks gets a zero ``B`` in peft: no change)."""
    from diffusers.utils.peft_utils import get_peft_kwargs

    return get_peft_kwargs(rank, alphas or None, state, is_unet=comp == "unet")


def _metadata_config(comp: str, metadata: Mapping[str, Any], lora: LoraFile) -> dict[str, Any]:
    """The config of ``comp`` from the header's adapter metadata (its keys less the ``comp.`` prefix), as diffusers'
    ``LoraConfig(**metadata)`` takes it: ``r`` and ``lora_alpha`` default to peft's 8.

    Raises:
        LoraError: no ``target_modules`` (peft refuses such a config: diffusers cannot load the file), or a rank
            that is not a positive number, an alpha that is not a number.
    """
    if not (metadata.get("target_modules") or metadata.get("target_parameters")):
        raise LoraError(f"LoRA file {lora.path} holds {comp} layers but its header's {LORA_METADATA_KEY!r} names no "
                        f"{comp} target_modules (diffusers cannot load it either); drop that header entry or re-save "
                        "the LoRA with its adapter config")
    config = {**_PEFT_DEFAULTS, **metadata}
    ranks = [config["r"], *_pattern_values(config.get("rank_pattern"))]
    alphas = [config["lora_alpha"], *_pattern_values(config.get("alpha_pattern"))]
    if not all(is_real_number(r) and r > 0 for r in ranks) or not all(is_real_number(a) for a in alphas):
        raise LoraError(f"LoRA file {lora.path}: its header's {LORA_METADATA_KEY!r} gives {comp} the ranks "
                        f"{ranks[:4]} and alphas {alphas[:4]}; ranks must be positive numbers, alphas numbers")
    return config


def _pattern_values(pattern: Any) -> list[Any]:
    """The values of a ``rank_pattern`` / ``alpha_pattern`` (``None`` for one that is no mapping: refused)."""
    return list(pattern.values()) if isinstance(pattern, Mapping) else [] if pattern is None else [None]


def _refuse_variants(state: Mapping[str, Any], config: Mapping[str, Any], lora: LoraFile) -> None:
    """Refuse LoRA variants whose merge is not ``W + scale * B @ A`` (refit would drop part of them).

    Raises:
        LoraError: DoRA, LoKr or LoRA-bias files, or files with an embedding layer (peft's ``lora_embedding_A`` /
            ``_B``: the text encoder's token embedding, which diffusers merges, is no weight input), naming the fix.
    """
    kinds = [name for name, found in (
        ("DoRA", config.get("use_dora") or any("lora_magnitude_vector" in k for k in state)),
        ("LoKr", any(".lokr_" in k for k in state)),
        ("LoRA bias", config.get("lora_bias") or any("lora_B" in k and k.endswith(".bias") for k in state)),
        ("token-embedding LoRA", any(".lora_embedding_" in k for k in state)),
    ) if found]
    if kinds:
        raise LoraError(
            f"LoRA file {lora.path} is a {kinds[0]} adapter, which load_lora cannot refit (only plain LoRA "
            f"layers); merge it at compile time with `diffusion-trt compile MODEL --lora {lora.path.name}:"
            f"{lora.scale:g}`"
        )


def _refuse_constants(comp: str, state: Mapping[str, Any], constants: Collection[str], lora: LoraFile) -> None:
    """Refuse a LoRA with a layer on a weight the artifact keeps constant (see :func:`lora_deltas`).

    Raises:
        LoraError: naming the first such layer (in module order) and the two fixes.
    """
    hits = sorted({k.split(".lora_A.")[0] for k in state if ".lora_A." in k} & {w.removesuffix(".weight")
                                                                                 for w in constants})
    if hits:
        raise LoraError(
            f"LoRA file {lora.path}: its layer {comp}.{hits[0]} is a spatial Conv, whose weight this artifact keeps "
            "constant (--refittable binds Linear and 1x1 Conv weights only, so the UNet keeps NHWC on CUDA); "
            "recompile with `diffusion-trt compile MODEL --refittable --refit-convs` (NCHW on CUDA, slower), or merge "
            f"it with `diffusion-trt compile MODEL --lora {lora.path.name}:{lora.scale:g}`"
        )


def _config_rank(config: Mapping[str, Any], module: str) -> Any:
    """The rank peft gives the layer ``module``: ``rank_pattern``'s (as peft's ``get_pattern_key``), else ``r``."""
    return (config.get("rank_pattern") or {}).get(_pattern_key(config.get("rank_pattern") or {}, module), config["r"])


def _scaling(config: Mapping[str, Any], module: str) -> float:
    """peft's ``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) for ``module``, with ``rank_pattern`` and
    ``alpha_pattern`` matched as peft's ``get_pattern_key`` does."""
    r = config["r"]
    alpha = config["lora_alpha"]
    r = (config.get("rank_pattern") or {}).get(_pattern_key(config.get("rank_pattern") or {}, module), r)
    alpha = (config.get("alpha_pattern") or {}).get(_pattern_key(config.get("alpha_pattern") or {}, module), alpha)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern_key(patterns: Mapping[str, Any], module: str) -> str:
    """peft's ``get_pattern_key``: the first pattern that matches the end of ``module`` (at a ``.``), else it."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def _delta_weight(a: torch.Tensor, b: torch.Tensor, base: torch.Tensor, scaling: float) -> torch.Tensor:
    """peft's ``get_delta_weight`` for Linear (``B @ A``) and Conv2d (1x1: the same on squeezed kernels; else
    ``conv2d(A^T, B)^T``), times ``scaling``."""
    if base.ndim == 2:
        return (b @ a) * scaling
    if base.shape[2:4] == (1, 1):
        return (b.squeeze(3).squeeze(2) @ a.squeeze(3).squeeze(2)).unsqueeze(2).unsqueeze(3) * scaling
    return torch.nn.functional.conv2d(a.transpose(0, 1), b).transpose(0, 1) * scaling


def is_down_key(key: str) -> bool:
    """One key per LoRA layer in diffusers' converted state dicts: the down (A) matrix."""
    return key.endswith(("lora_A.weight", "lora.down.weight", "lora_down.weight", "lora_linear_layer.down.weight"))

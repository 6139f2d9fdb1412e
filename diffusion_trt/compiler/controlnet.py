"""ControlNets as components of their own, and the UNet that takes their residuals as graph inputs.

``compile MODEL --controlnet [NAME=]FOLDER`` adds, beside today's components (the plain ``unet`` stays, unchanged):

* ``unet_controlnet``: the UNet with diffusers' ``down_block_additional_residuals`` and
  ``mid_block_additional_residual`` as graph inputs ``down_block_residual_{i}`` [B2, C_i, h/k_i, w/k_i] and
  ``mid_block_residual`` [B2, C_mid, h/k, w/k] (SD 1.x/2.x: 12 + 1, SDXL: 9 + 1; ``h/k`` = ceil(h / k), see
  :mod:`.components`). It serves every ControlNet of the base model: one can be added or swapped without rebuilding it.
* ``cond_embed_<NAME>`` per ControlNet: ``controlnet_cond`` [B2, 3, H, W] (the control image in [0, 1], the
  component's float type) -> ``controlnet_cond_embedding`` [B2, C0, h, w] (C0 = the ControlNet's
  ``block_out_channels[0]``; h = H / 8): diffusers' ``controlnet_cond_embedding`` (``ControlNetConditioningEmbedding``,
  the conv stack over the full-resolution image), after the RGB -> BGR channel flip of a ControlNet whose
  ``controlnet_conditioning_channel_order`` is ``"bgr"``. Its input is the same at every denoising step, so the runtime
  runs it once per call (per chunk of rows) instead of once a step.
* ``controlnet_<NAME>`` per ControlNet: the UNet's inputs (``sample``, ``timestep``, ``encoder_hidden_states``; SDXL
  also ``text_embeds``, ``time_ids``) plus ``controlnet_cond_embedding`` [B2, C0, h, w] (``cond_embed_<NAME>``'s
  output) and ``conditioning_scale`` [R] float32 (one factor per residual, R = 13 for SD 1.x/2.x: ``scale``
  everywhere, or diffusers' guess-mode ramp ``logspace(-1, 0, R) * scale``) -> the residuals, each already times its
  factor. It is diffusers' ``ControlNetModel.forward`` with the embedding given: ``conv_in(sample) + embedding``.

Artifacts compiled before the split have no ``cond_embed_<NAME>``, and their ``controlnet_<NAME>`` takes the image
``controlnet_cond`` [B2, 3, H, W] itself (the embedding inside); the runtime tells them apart by that input's name
(``runtime/controlnet.py``). ``controlnet_specs(..., split_embedding=False)`` still gives that layout.

The manifest keeps the plain ``unet`` (no residual inputs) for calls without a ControlNet, so a ControlNet never costs
a call that uses none. This is the only module that knows ``ControlNetModel``; the export wrappers live here too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..artifact.manifest import CONTROL_COND as COND
from ..artifact.manifest import CONTROL_EMBEDDING as EMBEDDING
from ..artifact.manifest import CONTROLNET_PREFIX as PREFIX
from ..artifact.manifest import EMBED_PREFIX, UNET_CONTROLNET
from ..errors import ExportError, ModelFolderError, RuntimeInputError
from .components import ComponentSpec, TensorSpec
from .controlnet_file import is_single_file, load_single_file, single_file_config

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^[a-z0-9][a-z0-9_]*$")
#: UNet config keys a ControlNet must share with its base model (the residuals' count, widths and the conditioning).
_BASE_KEYS = ("block_out_channels", "layers_per_block", "down_block_types", "cross_attention_dim",
              "use_linear_projection", "attention_head_dim", "addition_embed_type",
              "projection_class_embeddings_input_dim", "transformer_layers_per_block")


@dataclass(frozen=True)
class ControlNetSource:
    """One ``--controlnet``: its component name (``controlnet_<name>``), folder or single file, and its diffusers
    config (a folder's config.json; a single file's as ``from_single_file`` builds it)."""

    name: str
    path: Path
    config: Mapping[str, Any]

    @property
    def component(self) -> str:
        return PREFIX + self.name

    @property
    def embed_component(self) -> str:
        """``cond_embed_<name>``: the conditioning embedding, run once per call."""
        return EMBED_PREFIX + self.name


def parse_controlnet_arg(value: str) -> tuple[str, str]:
    """``"NAME=FOLDER"`` or ``"FOLDER"`` (or a single file) -> (name, path); the name defaults to the folder's name
    (a file's name without its suffix), lower-cased, with every character outside ``[a-z0-9_]`` made ``_``.

    Raises:
        RuntimeInputError: an empty folder, or a name that is not ``[a-z0-9][a-z0-9_]*``.
    """
    name, sep, path = value.partition("=")
    if not sep:
        path = value
        given = Path(value.rstrip("/"))
        stem = given.stem if is_single_file(given) else given.name
        name = re.sub(r"[^a-z0-9_]", "_", stem.lower()).lstrip("_") or "cn"
    if not path:
        raise RuntimeInputError(f"--controlnet {value!r} names no folder; pass NAME=FOLDER or FOLDER")
    if not _NAME.match(name):
        raise RuntimeInputError(f"--controlnet {value!r}: the name {name!r} must be lower-case letters, digits and _ "
                                "(it becomes the component controlnet_<name>), e.g. canny=models/cn-canny")
    return name, path


def base_label(unet_config: Mapping[str, Any]) -> str:
    """A readable name of the base architecture a UNet (or ControlNet) config belongs to."""
    if unet_config.get("addition_embed_type") == "text_time":
        family = "SDXL"
    elif unet_config.get("use_linear_projection"):
        family = "SD 2.x"
    else:
        family = "SD 1.x"
    return (f"{family} (cross_attention_dim {unet_config.get('cross_attention_dim')}, block_out_channels "
            f"{list(unet_config.get('block_out_channels') or [])})")


def check_controlnet(name: str, path: str | Path, unet_config: Mapping[str, Any], model: Path) -> ControlNetSource:
    """Check a diffusers ``ControlNetModel`` folder, or a single ``.safetensors`` file (:mod:`.controlnet_file`: its
    config as diffusers' ``from_single_file`` builds it, loading the file once), against the model's UNet config.

    Raises:
        ModelFolderError: ``path`` does not exist (the message names it and ``name``); the folder's config.json or
            its safetensors weights are missing; it is not a
            ControlNet; a single file diffusers cannot load offline, or a pickled one (``.pt``/``.pth``/``.ckpt``);
            ``global_pool_conditions`` (shuffle-style) ControlNets (not supported); or it was trained for another
            base architecture (the message names both).
    """
    folder = Path(path)
    if not folder.exists():
        raise ModelFolderError(f"--controlnet {name}={folder}: {folder} does not exist; pass a folder written by "
                               "ControlNetModel.save_pretrained or one .safetensors ControlNet file")
    config = single_file_config(folder) if is_single_file(folder) else _folder_config(folder)
    if config.get("global_pool_conditions"):
        raise ModelFolderError(f"--controlnet {folder} pools its residuals (global_pool_conditions=true); such "
                               "ControlNets are not supported yet")
    differ = [k for k in _BASE_KEYS if _norm(config, k) != _norm(unet_config, k)]
    if differ:
        raise ModelFolderError(
            f"--controlnet {folder} is for an {base_label(config)} base, but {model} is an {base_label(unet_config)} "
            f"model ({differ[0]}: {_norm(config, differ[0])} vs {_norm(unet_config, differ[0])}); use a "
            "ControlNet trained for this base model")
    return ControlNetSource(name, folder, config)


def _folder_config(folder: Path) -> dict[str, Any]:
    """The config.json of a diffusers ``ControlNetModel`` folder with safetensors weights.

    Raises:
        ModelFolderError: as :func:`check_controlnet`.
    """
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelFolderError(f"--controlnet {folder}: no config.json there; pass a folder written by "
                               "ControlNetModel.save_pretrained (or `diffusion-trt dummy-controlnet`)")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFolderError(f"{cfg_path} is not valid JSON ({e}); re-save the ControlNet") from None
    if not isinstance(config, dict) or config.get("_class_name") != "ControlNetModel":
        cls = config.get("_class_name") if isinstance(config, dict) else None
        raise ModelFolderError(f"--controlnet {folder} holds a {cls or 'unnamed'} model, not a ControlNetModel")
    if not any(folder.glob("*.safetensors")):
        raise ModelFolderError(f"--controlnet {folder} has no *.safetensors weights; re-save it with "
                               "save_pretrained(..., safe_serialization=True)")
    return config


#: diffusers' defaults of the compared keys a config may leave out.
_DEFAULTS: dict[str, Any] = {"layers_per_block": 2, "transformer_layers_per_block": 1, "use_linear_projection": False,
                             "attention_head_dim": 8}
_PER_BLOCK = ("layers_per_block", "transformer_layers_per_block", "attention_head_dim")


def _norm(config: Mapping[str, Any], key: str) -> Any:
    """``config[key]`` comparable across UNet and ControlNet configs: defaults filled, per-block ints expanded."""
    value = config.get(key)
    value = _DEFAULTS.get(key) if value is None else value
    if key in _PER_BLOCK and isinstance(value, int):
        value = [value] * len(config.get("block_out_channels") or [])
    return list(value) if isinstance(value, list | tuple) else value


def check_controlnets(args: Sequence[tuple[str, str]], unet_config: Mapping[str, Any],
                      model: Path) -> tuple[ControlNetSource, ...]:
    """Every ``(name, folder)`` checked (:func:`check_controlnet`).

    Raises:
        RuntimeInputError: a name given twice.
        ModelFolderError: as :func:`check_controlnet`.
    """
    names = [n for n, _ in args]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RuntimeInputError(f"--controlnet: the name(s) {', '.join(dup)} are given twice; name each one "
                                "(NAME=FOLDER)")
    return tuple(check_controlnet(n, p, unet_config, model) for n, p in args)


def residual_layout(unet_config: Mapping[str, Any]) -> tuple[tuple[int, int], ...]:
    """(channels, downsampling factor) of each residual a ControlNet gives its UNet: the down blocks' outputs in
    order (``conv_in``, then per level ``layers_per_block`` resnets and, except on the last level, the downsampler),
    then the mid block's. SD 1.x/2.x: 12 + 1; SDXL: 9 + 1."""
    blocks = list(unet_config["block_out_channels"])
    lpb = unet_config.get("layers_per_block", 2)
    layers = list(lpb) if isinstance(lpb, list | tuple) else [int(lpb)] * len(blocks)
    down: list[tuple[int, int]] = [(int(blocks[0]), 1)]
    for i, ch in enumerate(blocks):
        down += [(int(ch), 2**i)] * layers[i]
        if i < len(blocks) - 1:
            down.append((int(ch), 2 ** (i + 1)))
    return (*down, (int(blocks[-1]), 2 ** (len(blocks) - 1)))


def _dims(factor: int) -> tuple[str, str]:
    return ("h", "w") if factor == 1 else (f"h/{factor}", f"w/{factor}")


def residual_specs(unet_config: Mapping[str, Any]) -> tuple[TensorSpec, ...]:
    """The residual tensors ``down_block_residual_{i}`` ... ``mid_block_residual`` ([B2, C, h/k, w/k], the
    component's float type) of :func:`residual_layout`."""
    layout = residual_layout(unet_config)
    names = [f"down_block_residual_{i}" for i in range(len(layout) - 1)] + ["mid_block_residual"]
    return tuple(TensorSpec(n, "float", ("B2", c, *_dims(k))) for n, (c, k) in zip(names, layout, strict=True))


def controlnet_specs(unet: ComponentSpec, unet_config: Mapping[str, Any], sources: Sequence[ControlNetSource],
                     *, split_embedding: bool = True) -> dict[str, ComponentSpec]:
    """``unet_controlnet``, then per source ``cond_embed_<name>`` and ``controlnet_<name>``, from the model's ``unet``
    spec (its own symbol ranges too: the context length ``S`` of long prompts).

    ``split_embedding=False``: the layout before the split (no ``cond_embed_<name>``; ``controlnet_<name>`` takes the
    image ``controlnet_cond`` [B2, 3, H, W]), kept to make such artifacts in tests.
    """
    residuals = residual_specs(unet_config)
    specs = {UNET_CONTROLNET: ComponentSpec(UNET_CONTROLNET, (*unet.inputs, *residuals), unet.outputs,
                                            symbols=unet.symbols)}
    for src in sources:
        inputs = [t if t.name != "sample" else TensorSpec("sample", "float", ("B2", int(src.config.get(
            "in_channels", 4)), "h", "w")) for t in unet.inputs]
        image = TensorSpec(COND, "float", ("B2", int(src.config.get("conditioning_channels", 3)), "H", "W"))
        if split_embedding:
            embedding = TensorSpec(EMBEDDING, "float", ("B2", embedding_channels(src.config), "h", "w"))
            specs[src.embed_component] = ComponentSpec(src.embed_component, (image,), (embedding,))
            inputs.append(embedding)
        else:
            inputs.append(image)
        inputs.append(TensorSpec("conditioning_scale", "float32", (len(residuals),)))
        specs[src.component] = ComponentSpec(src.component, tuple(inputs), residuals, symbols=unet.symbols)
    return specs


def embedding_channels(config: Mapping[str, Any]) -> int:
    """C0 of the conditioning embedding [B2, C0, h, w]: the ControlNet's ``block_out_channels[0]`` (its ``conv_in``'s
    width, which the embedding is added to)."""
    return int(config.get("block_out_channels", (320, 640, 1280, 1280))[0])


def with_embeddings(names: Sequence[str], specs: Mapping[str, ComponentSpec]) -> tuple[str, ...]:
    """``names`` with ``cond_embed_<name>`` right before each ``controlnet_<name>`` that takes its embedding (asking
    for a ControlNet brings the embedding it cannot run without), each once."""
    out: list[str] = []
    for n in names:
        embed = EMBED_PREFIX + n[len(PREFIX):]
        if n.startswith(PREFIX) and embed in specs and embed not in out and embed not in names:
            out.append(embed)
        if n not in out:
            out.append(n)
    return tuple(out)


def load_controlnets(sources: Sequence[ControlNetSource], device: str) -> dict[str, torch.nn.Module]:
    """Each ControlNet (fp32, eval, on ``device``) by component name: folders by ``from_pretrained``, single files
    by ``from_single_file`` (:func:`~.controlnet_file.load_single_file`).

    Raises:
        ModelFolderError: diffusers cannot load a folder or file.
    """
    from diffusers import ControlNetModel

    out: dict[str, torch.nn.Module] = {}
    for src in sources:
        if is_single_file(src.path):
            out[src.component] = load_single_file(src.path).to(device).eval()
            continue
        try:
            model = ControlNetModel.from_pretrained(src.path, local_files_only=True, use_safetensors=True,
                                                    torch_dtype=torch.float32)
        except Exception as e:
            raise ModelFolderError(f"could not load the ControlNet {src.path}: {e}") from e
        out[src.component] = model.to(device).eval()
    return out


def channel_flip(controlnet: torch.nn.Module) -> bool:
    """Whether the ControlNet flips the control image's channels first (``controlnet_conditioning_channel_order``
    "bgr": diffusers' ``torch.flip(cond, dims=[1])``); "rgb" (the default) does not.

    Raises:
        ExportError: any other value (diffusers refuses it too, at its first forward).
    """
    order = controlnet.config.get("controlnet_conditioning_channel_order", "rgb")
    if order not in ("rgb", "bgr"):
        raise ExportError(f"the ControlNet's controlnet_conditioning_channel_order={order!r} is unknown; diffusers "
                          "takes 'rgb' or 'bgr'")
    return order == "bgr"


class CondEmbedExport(torch.nn.Module):
    """controlnet_cond [B2, 3, H, W] -> controlnet_cond_embedding [B2, C0, H/8, W/8]: what diffusers'
    ``ControlNetModel.forward`` does to the control image before adding it to ``conv_in(sample)``: the channel flip
    of a "bgr" ControlNet, then ``controlnet_cond_embedding``."""

    def __init__(self, controlnet: torch.nn.Module) -> None:
        super().__init__()
        self.embedding, self.flip = controlnet.controlnet_cond_embedding, channel_flip(controlnet)

    def forward(self, controlnet_cond: torch.Tensor) -> torch.Tensor:
        if self.flip:
            controlnet_cond = torch.flip(controlnet_cond, dims=[1])
        return self.embedding(controlnet_cond)


class _Given(torch.nn.Module):
    """Stands in for ``controlnet_cond_embedding`` while the embedding is given: returns its input."""

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return embedding


@contextlib.contextmanager
def embedding_given(controlnet: torch.nn.Module) -> Iterator[None]:
    """Inside: ``controlnet``'s forward takes the conditioning embedding as ``controlnet_cond`` (its embedding module
    returns its input, and its channel order is "rgb": :class:`CondEmbedExport` flipped the image already); the
    module and config are restored on exit."""
    module, config = controlnet.controlnet_cond_embedding, controlnet._internal_dict
    from diffusers.configuration_utils import FrozenDict

    controlnet.controlnet_cond_embedding = _Given()
    controlnet._internal_dict = FrozenDict({**config, "controlnet_conditioning_channel_order": "rgb"})
    try:
        yield
    finally:
        controlnet.controlnet_cond_embedding, controlnet._internal_dict = module, config


class ControlNetExport(torch.nn.Module):
    """(sample, timestep, encoder_hidden_states, [text_embeds, time_ids,] controlnet_cond_embedding,
    conditioning_scale[R]) -> R residuals, residual i times ``conditioning_scale[i]`` (diffusers' ``ControlNetModel``
    at scale 1 with the embedding given, then the per-residual factors: its plain and guess-mode scalings are both
    such factors). ``embedded=False``: the layout before the split, ``controlnet_cond`` (the image) in its place."""

    def __init__(self, controlnet: torch.nn.Module, sdxl: bool, embedded: bool = True) -> None:
        super().__init__()
        self.controlnet, self.sdxl, self.embedded = controlnet, sdxl, embedded

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        added = {"text_embeds": rest[0], "time_ids": rest[1]} if self.sdxl else None
        cond, scale = rest[-2], rest[-1]
        with embedding_given(self.controlnet) if self.embedded else contextlib.nullcontext():
            down, mid = self.controlnet(sample, timestep, encoder_hidden_states, controlnet_cond=cond,
                                        conditioning_scale=1.0, added_cond_kwargs=added, return_dict=False)
        out = (*down, mid)
        return tuple(r * scale[i] for i, r in enumerate(out))


class UNetWithResiduals(torch.nn.Module):
    """(sample, timestep, encoder_hidden_states, [text_embeds, time_ids,] R residuals) -> noise_pred: diffusers'
    ``UNet2DConditionModel`` with ``down_block_additional_residuals`` / ``mid_block_additional_residual``."""

    def __init__(self, unet: torch.nn.Module, sdxl: bool, residuals: int) -> None:
        super().__init__()
        self.unet, self.sdxl, self.residuals = unet, sdxl, residuals

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                *rest: torch.Tensor) -> torch.Tensor:
        added = {"text_embeds": rest[0], "time_ids": rest[1]} if self.sdxl else None
        res = rest[len(rest) - self.residuals:]
        return self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added,
                         down_block_additional_residuals=tuple(res[:-1]), mid_block_additional_residual=res[-1],
                         return_dict=False)[0]


def wrap(component: str, models: Mapping[str, Any], architecture: str,
         spec: ComponentSpec | None = None) -> torch.nn.Module | None:
    """The export wrapper of ``unet_controlnet`` / ``cond_embed_<name>`` / ``controlnet_<name>``; ``None`` for any
    other component. A ``controlnet_<name>`` takes the embedding unless ``spec`` has the image input ``controlnet_cond``
    (``split_embedding=False``)."""
    sdxl = architecture == "sdxl"
    if component == UNET_CONTROLNET:
        return UNetWithResiduals(models["unet"], sdxl, len(residual_layout(models["unet"].config)))
    if component.startswith(EMBED_PREFIX) and PREFIX + component[len(EMBED_PREFIX):] in models:
        return CondEmbedExport(models[PREFIX + component[len(EMBED_PREFIX):]])
    if component.startswith(PREFIX) and component in models:
        embedded = spec is None or all(t.name != COND for t in spec.inputs)
        return ControlNetExport(models[component], sdxl, embedded=embedded)
    return None

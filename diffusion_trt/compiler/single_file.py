"""Single-file checkpoints (the A1111 / ComfyUI layout) into a diffusers pipeline folder, offline.

    style.safetensors ──header only: keys and shapes──► CheckpointInfo (family, architecture, inpainting, prediction)
        ──our shipped configs (compiler/dummy.py) + CLIP tokenizers from the bundled BPE──► config folder
        ──diffusers' from_single_file(config=<that folder>, local_files_only=True)──► save_pretrained ──► folder

Layout read: ``model.diffusion_model.*`` (UNet), ``first_stage_model.*`` (VAE), and the text encoders:
``cond_stage_model.transformer.text_model.*`` (SD 1.x, CLIP-L), ``cond_stage_model.model.*`` (SD 2.x, OpenCLIP-H),
``conditioner.embedders.0.transformer.text_model.*`` + ``conditioner.embedders.1.model.*`` (SDXL base).
The architecture is the shipped one (``sd15``, ``sd21``, ``sdxl`` and their ``tiny-*`` toy widths) whose widths,
depths and cross-attention width the file's shapes match; a UNet with 9 input channels is the inpainting variant.
Nothing here downloads: diffusers does the key conversion from a local config folder.

The prediction type is not in the weights: SD 2.x 768-v (v-prediction) and 512-base (epsilon) checkpoints have the
same shapes. ``prediction_type="auto"`` takes v-prediction for SD 2.x (the 2.0-v / 2.1 releases most single files
derive from) except SD 2.x inpainting (epsilon, as stabilityai's 512-inpainting), epsilon for SD 1.x and SDXL;
``--prediction-type`` overrides it.
"""

from __future__ import annotations

import json
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifact.values import parse_json
from ..errors import ArtifactError, ModelFolderError
from ..lora import looks_like_lora

logger = logging.getLogger(__name__)

UNET = "model.diffusion_model."
VAE = "first_stage_model."
SD1_TEXT = "cond_stage_model.transformer.text_model."
SD2_TEXT = "cond_stage_model.model."
SDXL_TEXT = "conditioner.embedders.0.transformer.text_model."
SDXL_TEXT_2 = "conditioner.embedders.1.model."
#: ``--prediction-type`` values.
PREDICTION_TYPES = ("auto", "epsilon", "v_prediction")
#: family -> (its name in messages, the shipped architectures it can be, real size first).
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "sd1": ("SD 1.x", ("sd15", "tiny")),
    "sd2": ("SD 2.x", ("sd21", "tiny-sd21")),
    "sdxl": ("SDXL", ("sdxl", "tiny-sdxl")),
}
_INPAINT_CHANNELS = 9
_MAX_HEADER = 100 << 20  # a safetensors header is JSON; 100 MB is far beyond any real one
#: A block number in a key (``input_blocks.11.``): ASCII digits only (``str.isdigit`` also takes "²" and "٣").
_BLOCK_NUMBER = re.compile(r"[0-9]{1,6}")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a single file holds, read from its keys and shapes.

    Attributes:
        family: "sd1", "sd2" or "sdxl".
        architecture: the shipped architecture whose configs build the components (``compiler/dummy.py``).
        in_channels: UNet input channels: 4, or 9 for inpainting.
        prediction_type: "epsilon" or "v_prediction" (resolved from "auto", see the module docstring).
        pipeline_class: the diffusers pipeline class of the converted folder.
    """

    family: str
    architecture: str
    in_channels: int
    prediction_type: str
    pipeline_class: str

    @property
    def sample_size(self) -> int:
        """The UNet's ``sample_size`` (latent pixels) of the folder :func:`write_config_folder` writes: the
        architecture's, except SD 2.x with ``prediction_type="epsilon"``: 64 (the 512-base) instead of 96."""
        from .dummy import arch_config

        size = int(arch_config(self.architecture)["unet"]["sample_size"])
        return 64 if self.family == "sd2" and self.prediction_type == "epsilon" and size == 96 else size

    @property
    def facts(self) -> dict[str, Any]:
        """The model facts compile reads before converting (``pipeline.model_facts``' keys of the same meaning):
        ``architecture``, ``unet_in_channels``, ``latent_channels`` and the default size in pixels."""
        size = self.sample_size * 8  # the VAE's factor for every architecture read here
        return {"architecture": "sdxl" if self.family == "sdxl" else "sd", "unet_in_channels": self.in_channels,
                "latent_channels": 4, "default_height": size, "default_width": size}

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "architecture": self.architecture, "in_channels": self.in_channels,
                "prediction_type": self.prediction_type, "pipeline_class": self.pipeline_class}


def read_shapes(path: str | Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a ``.safetensors`` file's header (no tensor data is read).

    Raises:
        ModelFolderError: the file is not a safetensors file (naming it and what to pass instead).
    """
    path = Path(path)
    if path.suffix.lower() != ".safetensors":
        raise ModelFolderError(
            f"{path} is a file, not a folder, and not a .safetensors checkpoint: pass a diffusers pipeline folder "
            "(the one with model_index.json) or one .safetensors file (a .ckpt is a pickle and loading it runs "
            "arbitrary code: convert it to .safetensors)"
        )
    data = _read_header(path)
    fix = "re-download or re-save it"
    shapes = {}
    for key, entry in data.items():
        if key == "__metadata__" or not isinstance(entry, dict):
            continue
        shape = entry.get("shape", [])
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ModelFolderError(f"{path}: tensor {_printable(key)} has shape {_printable(shape)} in its header, "
                                   f"not a list of non-negative integers; the file is damaged: {fix}")
        shapes[key] = shape
    return shapes


def _read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a ``.safetensors`` file, checked against the file's size.

    Raises:
        ModelFolderError: no readable header, or a file shorter than the tensor data its header places (a truncated
            download or copy, which diffusers reported as "Unable to load weights ...", and the CLI as a path to
            check), naming the file and the fix.
    """
    fix = "re-download or re-save it"
    with path.open("rb") as f:
        raw = f.read(8)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        header = f.read(size) if 0 < size <= _MAX_HEADER else b""
    try:
        data = parse_json(header, "its header", fix) if len(header) == size else None
    except ArtifactError as e:  # too deep, not UTF-8, a lone surrogate... (one line): a bad input here, exit 2
        raise ModelFolderError(f"{path} is not a valid safetensors file: {e}") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path} is not a valid safetensors file (unreadable header); {fix}")
    end = 8 + size + max((_data_end(entry) for entry in data.values()), default=0)
    have = path.stat().st_size
    if have < end:
        raise ModelFolderError(f"{path} is truncated: its header places tensor data up to byte {end:,}, but the file "
                               f"has {have:,} bytes; {fix}")
    return data


def _data_end(entry: Any) -> int:
    """Where a header entry's tensor data ends (its ``data_offsets`` [begin, end]); 0 for anything else."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets):
        return offsets[1]
    return 0


def check_complete(path: str | Path) -> None:
    """Refuse a ``.safetensors`` weights file (of a model folder) whose header is unreadable or that is shorter than
    the tensor data its header places.

    Raises:
        ModelFolderError: as :func:`_read_header`.
    """
    _read_header(Path(path))


def _printable(value: Any, limit: int = 80) -> str:
    """``repr`` of a header value for a message, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _layers(shapes: dict[str, list[int]], prefix: str) -> int:
    """How many numbered blocks ``prefix<N>.`` the file has (max N + 1; 0 when none)."""
    found = [int(k[len(prefix):].split(".", 1)[0]) for k in shapes
             if k.startswith(prefix) and _BLOCK_NUMBER.fullmatch(k[len(prefix):].split(".", 1)[0])]
    return max(found) + 1 if found else 0


def _shape(shapes: dict[str, list[int]], key: str, dim: int) -> int | None:
    shape = shapes.get(key)
    return shape[dim] if shape is not None and len(shape) > dim else None


def _family(shapes: dict[str, list[int]], path: Path) -> str:
    """The checkpoint family from its key prefixes.

    Raises:
        ModelFolderError: no UNet/VAE/text encoder of a supported layout, naming what was found.
    """
    keys = shapes.keys()

    def has(prefix: str) -> bool:
        return any(k.startswith(prefix) for k in keys)

    if not has(UNET):
        if looks_like_lora(keys):
            what = "a LoRA (lora_* keys): pass it with --lora next to a base model"
        elif any(k.startswith(("down_blocks.", "conv_in.", "encoder.down_blocks.")) for k in keys):
            what = "one diffusers component's weights: pass the whole diffusers pipeline folder"
        else:
            what = f"not an SD checkpoint (e.g. key {next(iter(keys), 'none')!r})"
        raise ModelFolderError(f"{path} has no UNet weights ({UNET}*): it is {what}")
    if not has(VAE):
        raise ModelFolderError(f"{path} has no VAE weights ({VAE}*): a UNet-only file cannot be compiled alone; use "
                               "a full checkpoint (UNet, VAE and text encoder in one file) or a diffusers folder")
    if has(SDXL_TEXT_2) and has(SDXL_TEXT):
        return "sdxl"
    if has("conditioner.embedders.0.model."):
        raise ModelFolderError(f"{path} is an SDXL refiner (one OpenCLIP-bigG text encoder); only SDXL base "
                               "checkpoints are supported")
    if has(SD2_TEXT):
        return "sd2"
    if has(SD1_TEXT):
        return "sd1"
    raise ModelFolderError(
        f"{path} has a UNet and a VAE but no text encoder of a known layout ({SD1_TEXT}* for SD 1.x, {SD2_TEXT}* "
        "for SD 2.x, conditioner.embedders.* for SDXL); it cannot be identified"
    )


def checkpoint_fingerprint(shapes: dict[str, list[int]], family: str) -> dict[str, int | None]:
    """The widths and depths that tell the shipped architectures apart, read from a checkpoint."""
    cross = next((s[1] for k, s in sorted(shapes.items())
                  if k.startswith(UNET) and k.endswith("attn2.to_k.weight") and len(s) == 2), None)
    fp: dict[str, int | None] = {
        "unet_width": _shape(shapes, UNET + "input_blocks.0.0.weight", 0),
        "unet_input_blocks": _layers(shapes, UNET + "input_blocks."),
        "cross_attention_dim": cross,
        "vae_width": _shape(shapes, VAE + "encoder.conv_in.weight", 0),
        "latent_channels": _shape(shapes, VAE + "decoder.conv_in.weight", 1),
    }
    if family == "sd1":
        fp["text_hidden"] = _shape(shapes, SD1_TEXT + "embeddings.token_embedding.weight", 1)
        fp["text_layers"] = _layers(shapes, SD1_TEXT + "encoder.layers.")
    elif family == "sd2":
        fp["text_hidden"] = _shape(shapes, SD2_TEXT + "token_embedding.weight", 1)
        fp["text_layers"] = _layers(shapes, SD2_TEXT + "transformer.resblocks.")
    else:
        fp["text_hidden"] = _shape(shapes, SDXL_TEXT + "embeddings.token_embedding.weight", 1)
        fp["text_layers"] = _layers(shapes, SDXL_TEXT + "encoder.layers.")
        fp["text_2_hidden"] = _shape(shapes, SDXL_TEXT_2 + "token_embedding.weight", 1)
        fp["text_2_layers"] = _layers(shapes, SDXL_TEXT_2 + "transformer.resblocks.")
        fp["text_2_projection"] = _shape(shapes, SDXL_TEXT_2 + "text_projection", 1)
    return fp


def arch_fingerprint(arch: str) -> dict[str, int | None]:
    """What :func:`checkpoint_fingerprint` reads from a file of the shipped architecture ``arch``."""
    from .dummy import arch_config

    cfg = arch_config(arch)
    unet, vae, te = cfg["unet"], cfg["vae"], cfg["text_encoder"]
    fp: dict[str, int | None] = {
        "unet_width": unet["block_out_channels"][0],
        "unet_input_blocks": len(unet["block_out_channels"]) * (unet["layers_per_block"] + 1),
        "cross_attention_dim": unet["cross_attention_dim"],
        "vae_width": vae["block_out_channels"][0],
        "latent_channels": vae["latent_channels"],
        "text_hidden": te["hidden_size"],
        "text_layers": te["num_hidden_layers"],
    }
    if "text_encoder_2" in cfg:
        te2 = cfg["text_encoder_2"]
        fp.update(text_2_hidden=te2["hidden_size"], text_2_layers=te2["num_hidden_layers"],
                  text_2_projection=te2["projection_dim"])
    return fp


def _differences(found: dict[str, int | None], expected: dict[str, int | None], family: str) -> list[str]:
    """``["unet_width 448 (sd15: 320)", ...]``; OpenCLIP towers may hold one layer more than diffusers keeps (SD 2.x
    reads the penultimate layer, so diffusers' config has 23 of the checkpoint's 24)."""
    out = []
    for key, want in expected.items():
        got = found.get(key)
        slack = (1 if (key == "text_layers" and family == "sd2") or key == "text_2_layers" else 0)
        if got is None or not want <= got <= want + slack:  # type: ignore[operator]
            out.append(f"{key} {got}")
    return out


def _match_architecture(found: dict[str, int | None], family: str, path: Path) -> str:
    """The shipped architecture of ``family`` whose fingerprint ``found`` matches.

    Raises:
        ModelFolderError: none matches; names the values read and what each candidate expects.
    """
    name, candidates = FAMILIES[family]
    misses = []
    for arch in candidates:
        expected = arch_fingerprint(arch)
        diff = _differences(found, expected, family)
        if not diff:
            return arch
        misses.append(f"{arch} expects " + ", ".join(f"{k.split()[0]} {expected[k.split()[0]]}" for k in diff))
    read = ", ".join(f"{k} {v}" for k, v in found.items())
    raise ModelFolderError(
        f"{path} is an {name} checkpoint whose shapes match none of the shipped {name} architectures "
        f"({'; '.join(misses)}; read: {read}); only these architectures can be built offline: convert it to a "
        "diffusers folder elsewhere (diffusers' from_single_file with its own config) and compile that"
    )


def inspect_checkpoint(path: str | Path, prediction_type: str = "auto") -> CheckpointInfo:
    """Identify a single-file checkpoint from its keys and shapes (the header only).

    Args:
        path: an A1111 / ComfyUI ``.safetensors`` checkpoint.
        prediction_type: "auto", "epsilon" or "v_prediction" (see the module docstring).

    Raises:
        ModelFolderError: not safetensors, not a full SD 1.x/2.x/SDXL-base checkpoint, shapes of no shipped
            architecture, a UNet input width other than 4 or 9, or SDXL inpainting; each names what was read.
        RuntimeInputError: an unknown ``prediction_type``.
    """
    from ..errors import RuntimeInputError

    path = Path(path)
    if prediction_type not in PREDICTION_TYPES:
        raise RuntimeInputError(f"--prediction-type {prediction_type!r} is unknown; use one of "
                                f"{', '.join(PREDICTION_TYPES)}")
    shapes = read_shapes(path)
    family = _family(shapes, path)
    found = checkpoint_fingerprint(shapes, family)
    arch = _match_architecture(found, family, path)
    in_channels = _shape(shapes, UNET + "input_blocks.0.0.weight", 1) or 0
    if in_channels not in (4, _INPAINT_CHANNELS):
        raise ModelFolderError(f"{path}: the UNet takes {in_channels} input channels; only 4 (text-to-image) and 9 "
                               "(inpainting) are supported")
    inpaint = in_channels == _INPAINT_CHANNELS
    if inpaint and family == "sdxl":
        raise ModelFolderError(f"{path} is an SDXL inpainting checkpoint (9 input channels); inpainting is SD 1.x/2.x "
                               "only for now")
    if prediction_type == "auto":
        prediction_type = "v_prediction" if family == "sd2" and not inpaint else "epsilon"
        if family == "sd2":
            logger.warning("%s: SD 2.x checkpoint, prediction type assumed %s (%s); the weights cannot tell "
                           "768-v from 512-base: pass --prediction-type %s if that is wrong (grey or noisy images)",
                           path.name, prediction_type, "inpainting" if inpaint else "the 768-v releases",
                           "v_prediction" if inpaint else "epsilon")
    pipeline_class = ("StableDiffusionXLPipeline" if family == "sdxl"
                      else "StableDiffusionInpaintPipeline" if inpaint else "StableDiffusionPipeline")
    info = CheckpointInfo(family, arch, in_channels, prediction_type, pipeline_class)
    logger.info("%s: %s checkpoint, architecture %s%s, %s", path.name, FAMILIES[family][0], arch,
                ", inpainting" if inpaint else "", prediction_type)
    return info


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=list), encoding="utf-8")


def write_config_folder(info: CheckpointInfo, dest: Path) -> Path:
    """A diffusers pipeline folder without weights (configs, tokenizers, scheduler) for ``info``'s architecture.

    SD 2.x with ``prediction_type="epsilon"`` gets the 512-base default size (sample size 64) instead of 768.
    """
    import diffusers
    from transformers import CLIPTextConfig

    from .dummy import SD15_SCHEDULER_CONFIG, arch_config, write_clip_tokenizer

    cfg = arch_config(info.architecture)
    version = diffusers.__version__
    unet = {"_class_name": "UNet2DConditionModel", "_diffusers_version": version, **cfg["unet"],
            "in_channels": info.in_channels, "sample_size": info.sample_size}
    _write_json(dest / "unet" / "config.json", unet)
    _write_json(dest / "vae" / "config.json", {"_class_name": "AutoencoderKL", "_diffusers_version": version,
                                                 **cfg["vae"]})
    sched = dict(cfg.get("scheduler") or {"_class_name": "PNDMScheduler", **SD15_SCHEDULER_CONFIG})
    sched["prediction_type"] = info.prediction_type
    _write_json(dest / "scheduler" / "scheduler_config.json", {**sched, "_diffusers_version": version})
    CLIPTextConfig(**cfg["text_encoder"]).save_pretrained(dest / "text_encoder")
    write_clip_tokenizer(dest / "tokenizer", cfg.get("pad_token", "<|endoftext|>"))
    index: dict[str, Any] = {
        "_class_name": info.pipeline_class, "_diffusers_version": version,
        "unet": ["diffusers", "UNet2DConditionModel"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
        "scheduler": ["diffusers", sched["_class_name"]],
    }
    if info.family == "sdxl":
        CLIPTextConfig(**cfg["text_encoder_2"]).save_pretrained(dest / "text_encoder_2")
        write_clip_tokenizer(dest / "tokenizer_2", cfg.get("pad_token_2", "!"))
        index.update(text_encoder_2=["transformers", "CLIPTextModelWithProjection"],
                     tokenizer_2=["transformers", "CLIPTokenizer"], force_zeros_for_empty_prompt=True)
    else:
        index.update(safety_checker=[None, None], feature_extractor=[None, None], requires_safety_checker=False)
    _write_json(dest / "model_index.json", index)
    return dest


def root_cause(error: BaseException) -> BaseException:
    """The first exception of ``error``'s chain (``__cause__``, else ``__context__``): safetensors' own error under
    diffusers' OSError and the UnicodeDecodeError of its git-lfs pointer check."""
    seen = {id(error)}
    while (nxt := error.__cause__ or error.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        error = nxt
    return error


def folder_from_single_file(path: str | Path, info: CheckpointInfo, dest: str | Path) -> Path:
    """Convert ``path`` into a diffusers pipeline folder ``dest`` with diffusers' ``from_single_file``, offline.

    Raises:
        ModelFolderError: diffusers cannot map the weights onto the architecture (a missing or misshapen tensor), or
            cannot read them (a header that does not match its data: the CLI said "check the path and its
            permissions"), with its message.
    """
    import tempfile

    import diffusers

    dest = Path(dest)
    cls = getattr(diffusers, info.pipeline_class)
    extra = {"add_watermarker": False} if info.family == "sdxl" else {"safety_checker": None,
                                                                     "requires_safety_checker": False}
    with tempfile.TemporaryDirectory(prefix="diffusion-trt-config-") as tmp:
        config = write_config_folder(info, Path(tmp))
        try:
            pipe = cls.from_single_file(str(path), config=str(config), local_files_only=True, **extra)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ModelFolderError(f"{path}: its weights do not load into the {info.architecture} architecture "
                                   f"({type(e).__name__}: {str(e)[:300]}); the file may be damaged or pruned") from e
        except OSError as e:  # diffusers' "Unable to load weights from checkpoint file", from safetensors' error
            why = root_cause(e)
            raise ModelFolderError(f"{path}: its tensors cannot be read ({type(why).__name__}: {str(why)[:300]}); "
                                   "the file is damaged: re-download or re-save it") from e
    pipe.save_pretrained(dest, safe_serialization=True)
    logger.info("converted %s -> %s (%s)", Path(path).name, dest, info.architecture)
    return dest

"""Seeded random-weight diffusers pipelines that stand in for trained checkpoints.

``tiny`` has the SD-1.5 structure (4 UNet levels, 3 cross-attention levels, 2 layers per block, a
4-level VAE with the 8x latent factor, a CLIP text tower with quick_gelu and 77 positions) at toy
widths: a few MB, for tests and the README default. ``sd15`` is the true SD-1.5 architecture, configs as
in the ``runwayml/stable-diffusion-v1-5`` ``*/config.json`` files (UNet 859,520,964 parameters).

``sd21`` is the true SD-2.1 architecture (``stabilityai/stable-diffusion-2-1``: OpenCLIP-H text tower cut
to 23 layers, 1024-d, GELU; UNet with linear projections, per-level head counts and ``upcast_attention``;
768x768; DDIM with ``prediction_type="v_prediction"``). ``sdxl`` is the true SDXL-base architecture
(``stabilityai/stable-diffusion-xl-base-1.0``: CLIP-L and OpenCLIP-bigG text towers, a 3-level UNet with 1/2/10
transformer layers and the ``text_time`` added conditioning, a VAE with ``force_upcast`` and scaling 0.13025,
1024x1024, Euler). ``tiny-sd21`` and ``tiny-sdxl`` have the same structures at toy widths, for tests.

Every pipeline is written by its diffusers class's ``save_pretrained`` (safetensors), with real CLIP
tokenizers built from the BPE merges shipped in ``diffusion_trt/data`` (see its NOTICE.md; SD-2.x and SDXL's
second tokenizer pad with ``!`` as the OpenCLIP checkpoints do), so the code paths downstream are exactly
those of a real checkpoint. Add an architecture by adding an entry to ``_CONFIGS`` (see its comment).
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.resources
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..artifact.folder import umask_mode
from ..errors import ModelFolderError

logger = logging.getLogger(__name__)

CLIP_VOCAB_SIZE = 49408
CLIP_MAX_LENGTH = 77

# SD-1.5 scheduler config (scheduler/scheduler_config.json of runwayml/stable-diffusion-v1-5).
SD15_SCHEDULER_CONFIG: dict[str, Any] = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "clip_sample": False,
    "trained_betas": None,
}
# SD-2.1 (768, v-prediction) scheduler config (scheduler/scheduler_config.json of stabilityai/stable-diffusion-2-1).
SD21_SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "DDIMScheduler",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "num_train_timesteps": 1000,
    "prediction_type": "v_prediction",
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "trained_betas": None,
}
# SDXL-base scheduler config (scheduler/scheduler_config.json of stabilityai/stable-diffusion-xl-base-1.0).
SDXL_SCHEDULER_CONFIG: dict[str, Any] = {
    "_class_name": "EulerDiscreteScheduler",
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "trained_betas": None,
    "use_karras_sigmas": False,
}
_CLIP_IDS: dict[str, Any] = {"vocab_size": CLIP_VOCAB_SIZE, "max_position_embeddings": CLIP_MAX_LENGTH,
                             "layer_norm_eps": 1e-5, "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": 2}
_SD_VAE: dict[str, Any] = {  # the SD VAE (4 levels, 8x latents); the SD-2.1 and SDXL ones differ in the keys set
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "norm_num_groups": 32,
    "act_fn": "silu",
}
_TINY_VAE: dict[str, Any] = {**_SD_VAE, "sample_size": 64, "layers_per_block": 1, "block_out_channels": (8, 16, 16, 16),
                             "norm_num_groups": 8}
_UNET: dict[str, Any] = {  # what every UNet here shares (4 latent channels in and out, 2 layers per block)
    "in_channels": 4,
    "out_channels": 4,
    "layers_per_block": 2,
    "norm_eps": 1e-5,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "act_fn": "silu",
}
_SD_UNET: dict[str, Any] = {  # SD 1.x / 2.x: 4 levels, cross-attention in the first three down and last three up
    **_UNET,
    "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
}
_SDXL_UNET: dict[str, Any] = {  # SDXL: 3 levels, no attention at the highest resolution, added text/time embeddings
    **_UNET,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "use_linear_projection": True,
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
}
_CLIP_L: dict[str, Any] = {  # CLIP ViT-L/14: SD-1.5's text encoder and SDXL's first
    **_CLIP_IDS,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}

#: Per architecture: "unet", "vae", "text_encoder" (configs of the diffusers / transformers classes), and where
#: it differs from SD-1.5: "text_encoder_2" (a CLIPTextModelWithProjection config: an SDXL pipeline),
#: "scheduler" (a scheduler config with its "_class_name"; default PNDM with SD15_SCHEDULER_CONFIG),
#: "pad_token" / "pad_token_2" (the tokenizers' padding token; default "<|endoftext|>" / "!"),
#: "pipeline_class" (the diffusers class saved, model_index.json's _class_name; default StableDiffusionPipeline).
_CONFIGS: dict[str, dict[str, Any]] = {
    "sd15": {
        "unet": {
            **_SD_UNET,
            "sample_size": 64,
            "block_out_channels": (320, 640, 1280, 1280),
            "cross_attention_dim": 768,
            "attention_head_dim": 8,
            "norm_num_groups": 32,
        },
        "vae": {**_SD_VAE, "sample_size": 512, "scaling_factor": 0.18215},
        "text_encoder": _CLIP_L,
    },
    "tiny": {
        "unet": {
            **_SD_UNET,
            "sample_size": 8,
            "block_out_channels": (16, 32, 32, 32),
            "cross_attention_dim": 32,
            "attention_head_dim": 2,
            "norm_num_groups": 8,
        },
        "vae": {**_TINY_VAE, "scaling_factor": 0.18215},
        "text_encoder": {**_CLIP_IDS, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "hidden_act": "quick_gelu", "projection_dim": 32},
    },
    "sd21": {  # stabilityai/stable-diffusion-2-1 */config.json
        "unet": {
            **_SD_UNET,
            "sample_size": 96,
            "block_out_channels": (320, 640, 1280, 1280),
            "cross_attention_dim": 1024,
            "attention_head_dim": (5, 10, 20, 20),  # diffusers' name; the values are head counts (64-d heads)
            "use_linear_projection": True,
            "upcast_attention": True,
            "norm_num_groups": 32,
        },
        "vae": {**_SD_VAE, "sample_size": 768, "scaling_factor": 0.18215},
        "text_encoder": {  # OpenCLIP ViT-H/14 text tower without its last layer (SD 2.x reads the penultimate)
            **_CLIP_IDS,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": 23,
            "num_attention_heads": 16,
            "hidden_act": "gelu",
            "projection_dim": 512,
        },
        "scheduler": SD21_SCHEDULER_CONFIG,
        "pad_token": "!",
    },
    "tiny-sd21": {
        "unet": {
            **_SD_UNET,
            "sample_size": 8,
            "block_out_channels": (16, 32, 32, 32),
            "cross_attention_dim": 32,
            "attention_head_dim": (2, 4, 4, 4),
            "use_linear_projection": True,
            "upcast_attention": True,
            "norm_num_groups": 8,
        },
        "vae": {**_TINY_VAE, "scaling_factor": 0.18215},
        "text_encoder": {**_CLIP_IDS, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "hidden_act": "gelu", "projection_dim": 16},
        "scheduler": SD21_SCHEDULER_CONFIG,
        "pad_token": "!",
    },
    "sdxl": {  # stabilityai/stable-diffusion-xl-base-1.0 */config.json
        "unet": {
            **_SDXL_UNET,
            "sample_size": 128,
            "block_out_channels": (320, 640, 1280),
            "transformer_layers_per_block": (1, 2, 10),
            "cross_attention_dim": 2048,  # 768 (text_encoder) + 1280 (text_encoder_2)
            "attention_head_dim": (5, 10, 20),
            "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 2816,  # 6 time ids x 256 + 1280 pooled text
            "norm_num_groups": 32,
        },
        "vae": {**_SD_VAE, "sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True},
        "text_encoder": _CLIP_L,
        "text_encoder_2": {  # OpenCLIP ViT-bigG/14 text tower with its projection
            **_CLIP_IDS,
            "hidden_size": 1280,
            "intermediate_size": 5120,
            "num_hidden_layers": 32,
            "num_attention_heads": 20,
            "hidden_act": "gelu",
            "projection_dim": 1280,
        },
        "scheduler": SDXL_SCHEDULER_CONFIG,
    },
    "tiny-sdxl": {  # distinct widths everywhere (32 + 48 text, 24 pooled) so a swapped dimension fails loudly
        "unet": {
            **_SDXL_UNET,
            "sample_size": 8,
            "block_out_channels": (16, 32, 64),
            "transformer_layers_per_block": (1, 1, 2),
            "cross_attention_dim": 80,  # 32 + 48
            "attention_head_dim": (2, 4, 8),
            "addition_time_embed_dim": 8,
            "projection_class_embeddings_input_dim": 72,  # 6 x 8 + 24
            "norm_num_groups": 8,
        },
        "vae": {**_TINY_VAE, "scaling_factor": 0.13025, "force_upcast": True},
        "text_encoder": {**_CLIP_IDS, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "hidden_act": "quick_gelu", "projection_dim": 32},
        "text_encoder_2": {**_CLIP_IDS, "hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 3,
                           "num_attention_heads": 4, "hidden_act": "gelu", "projection_dim": 24},
        "scheduler": SDXL_SCHEDULER_CONFIG,
    },
}
# SD-1.5 inpainting (runwayml/stable-diffusion-inpainting): the SD-1.5 configs with a UNet of 9 input channels
# (4 noisy latents + 1 mask + 4 masked-image latents, concatenated by StableDiffusionInpaintPipeline).
for _base, _arch in (("sd15", "sd15-inpaint"), ("tiny", "tiny-sd15-inpaint")):
    _CONFIGS[_arch] = {**_CONFIGS[_base], "unet": {**_CONFIGS[_base]["unet"], "in_channels": 9},
                       "pipeline_class": "StableDiffusionInpaintPipeline"}
#: The architecture names, the default ("tiny") first.
ARCHS: tuple[str, ...] = ("tiny", *(a for a in _CONFIGS if a != "tiny"))


def arch_config(arch: str) -> dict[str, Any]:
    """A deep copy of one architecture's entry of the config table (see ``_CONFIGS``'s comment for its keys).

    Raises:
        KeyError: ``arch`` is not one of :data:`ARCHS`.
    """
    import copy

    return copy.deepcopy(_CONFIGS[arch])


def arch_family(arch: str) -> str:
    """The pipeline family of a dummy architecture: "sdxl" (StableDiffusionXLPipeline) or "sd"."""
    return "sdxl" if "text_encoder_2" in _CONFIGS[arch] else "sd"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode table (openai/gpt-2 ``encoder.py``; CLIP reuses it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


@lru_cache(maxsize=1)
def clip_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """Build CLIP's 49,408-token vocabulary and its merge list from the bundled BPE file.

    Same construction as open_clip's ``SimpleTokenizer`` (and the ``vocab.json`` of the OpenAI CLIP
    checkpoints): 256 byte symbols, the same with ``</w>``, the first 48,894 merges, then the two
    special tokens.
    """
    data = importlib.resources.files("diffusion_trt.data").joinpath("bpe_simple_vocab_16e6.txt.gz").read_bytes()
    lines = gzip.decompress(data).decode("utf-8").split("\n")
    n_merges = CLIP_VOCAB_SIZE - 2 * 256 - 2  # 48,894: the vocabulary is bytes, bytes</w>, merges, 2 specials
    merges = lines[1 : 1 + n_merges]
    base = list(_bytes_to_unicode().values())
    tokens = base + [t + "</w>" for t in base] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    assert len(tokens) == CLIP_VOCAB_SIZE, len(tokens)
    return {t: i for i, t in enumerate(tokens)}, merges


def write_clip_tokenizer(out_dir: Path, pad_token: str = "<|endoftext|>") -> None:
    """Save a ``CLIPTokenizer`` (77 positions) into ``out_dir``.

    Args:
        pad_token: ``"<|endoftext|>"`` as SD-1.x and SDXL's first tokenizer, ``"!"`` as the OpenCLIP ones (SD-2.x,
            SDXL's ``tokenizer_2``).
    """
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab_and_merges()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    tok = CLIPTokenizer(
        vocab=str(out_dir / "vocab.json"),
        merges=str(out_dir / "merges.txt"),
        model_max_length=CLIP_MAX_LENGTH,
        pad_token=pad_token,
    )
    tok.save_pretrained(out_dir)


@contextlib.contextmanager
def replaced_folder(out: Path, overwrite: bool, marker: str, what: str, class_name: str | None = None
                    ) -> Iterator[Path]:
    """Yield a fresh folder beside ``out`` that replaces it whole when the block succeeds (``out`` is left as it was
    when it fails). ``--overwrite`` wrote into the old folder, so a pipeline written over another architecture's kept
    the files that one had and this one lacks (an SDXL ``text_encoder_2/``), and one written over an artifact mixed
    the two. A non-empty ``out`` is replaced only with ``overwrite`` and only when it holds ``marker`` (the file this
    writer makes: ``model_index.json``...) and, with ``class_name``, the marker's ``_class_name`` is that one
    (``config.json`` alone is no ControlNet's: a diffusers folder's ``unet/`` has one, and ``dummy-controlnet
    MODEL/unet --overwrite`` replaced a model's UNet), so a folder of something else is never deleted.

    Raises:
        ModelFolderError: ``out`` is not empty and ``overwrite`` is false, or it holds no ``marker`` (of
            ``class_name``).
    """
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ModelFolderError(f"{out} exists and is not empty; choose another folder or pass --overwrite")
        if not (out / marker).is_file():
            raise ModelFolderError(f"{out} is not empty and holds no {marker}: --overwrite only replaces a {what} "
                                   "folder; choose an empty or new folder (nothing was deleted)")
        found = _class_name_of(out / marker)
        if class_name is not None and found != class_name:
            raise ModelFolderError(f"{out} holds a {found or 'nameless'} ({marker} _class_name), not a "
                                   f"{class_name}: --overwrite only replaces a {what} folder; choose an empty or new "
                                   "folder (nothing was deleted)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        os.chmod(tmp, umask_mode("dir"))
        old = out.with_name(f".{out.name}.old-{os.getpid()}") if out.exists() else None
        if old is not None:
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None and old.is_symlink():  # OUT was a link: the link goes, the folder it named stays
            old.unlink()
        elif old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _class_name_of(config: Path) -> str | None:
    """The ``_class_name`` of a diffusers config file, or ``None`` when it has none or cannot be read."""
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = data.get("_class_name") if isinstance(data, dict) else None
    return name if isinstance(name, str) else None


def write_dummy_pipeline(out_dir: str | Path, arch: str = "tiny", seed: int = 0, overwrite: bool = False) -> Path:
    """Write a ``StableDiffusionPipeline`` (or, for the SDXL archs, ``StableDiffusionXLPipeline``) folder with
    seeded random weights.

    Args:
        out_dir: destination folder (created).
        arch: one of :data:`ARCHS` (see the module docstring).
        seed: torch seed; the same seed gives byte-identical weights.
        overwrite: replace a non-empty ``out_dir``.

    Returns:
        The folder, loadable with ``<Pipeline class>.from_pretrained(out_dir, local_files_only=True)``.

    Raises:
        ModelFolderError: unknown ``arch`` (the message lists the valid ones), or ``out_dir`` not empty (without
            ``overwrite``, or holding no ``model_index.json``: see :func:`replaced_folder`).
    """
    if arch not in ARCHS:
        raise ModelFolderError(f"--arch {arch!r} is unknown; use one of {', '.join(ARCHS)}")
    out = Path(out_dir)
    with replaced_folder(out, overwrite, "model_index.json", "diffusers pipeline") as tmp:
        unet = _write_dummy_pipeline(tmp, arch, seed)
    n_unet = sum(p.numel() for p in unet.parameters())
    logger.info("wrote %s pipeline (seed %d, UNet %s parameters) to %s", arch, seed, f"{n_unet:,}", out)
    return out


def _write_dummy_pipeline(out: Path, arch: str, seed: int) -> Any:
    """Write the pipeline of :func:`write_dummy_pipeline` into the empty folder ``out``; returns its UNet."""
    import diffusers
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    cfg = _CONFIGS[arch]

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**cfg["unet"])
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(**cfg["vae"])
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"]))
    if "scheduler" in cfg:
        sched_cfg = dict(cfg["scheduler"])
        scheduler = getattr(diffusers, sched_cfg.pop("_class_name")).from_config(sched_cfg)
    else:
        scheduler = PNDMScheduler.from_config(SD15_SCHEDULER_CONFIG)

    out.mkdir(parents=True, exist_ok=True)
    write_clip_tokenizer(out / "_tokenizer_tmp", cfg.get("pad_token", "<|endoftext|>"))
    tokenizer = CLIPTokenizer.from_pretrained(out / "_tokenizer_tmp", local_files_only=True)
    pipe: Any
    if arch_family(arch) == "sdxl":
        torch.manual_seed(seed + 3)
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**cfg["text_encoder_2"]))
        write_clip_tokenizer(out / "_tokenizer_2_tmp", cfg.get("pad_token_2", "!"))
        tokenizer_2 = CLIPTokenizer.from_pretrained(out / "_tokenizer_2_tmp", local_files_only=True)
        pipe = diffusers.StableDiffusionXLPipeline(
            vae=vae,
            text_encoder=text_encoder,
            text_encoder_2=text_encoder_2,
            tokenizer=tokenizer,
            tokenizer_2=tokenizer_2,
            unet=unet,
            scheduler=scheduler,
            force_zeros_for_empty_prompt=True,  # as the SDXL-base model_index.json
            add_watermarker=False,
        )
    else:
        pipe = getattr(diffusers, cfg.get("pipeline_class", "StableDiffusionPipeline"))(
            vae=vae,
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            unet=unet,
            scheduler=scheduler,
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.save_pretrained(out, safe_serialization=True)
    for tmp in ("_tokenizer_tmp", "_tokenizer_2_tmp"):
        shutil.rmtree(out / tmp, ignore_errors=True)
    return unet

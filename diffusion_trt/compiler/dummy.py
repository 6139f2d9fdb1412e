"""Seeded random-weight diffusers pipelines that stand in for trained checkpoints.

``tiny`` has the SD-1.5 structure (4 UNet levels, 3 cross-attention levels, 2 layers per block, a
4-level VAE with the 8x latent factor, a CLIP text tower with quick_gelu and 77 positions) at toy
widths: a few MB, for tests and the README default. ``sd15`` is the true SD-1.5 architecture, configs as
in the ``runwayml/stable-diffusion-v1-5`` ``*/config.json`` files (UNet 859,520,964 parameters).

Both are written by ``StableDiffusionPipeline.save_pretrained`` (safetensors), with a real CLIP
tokenizer built from the BPE merges shipped in ``diffusion_trt/data`` (see its NOTICE.md), so the code
paths downstream are exactly those of a real checkpoint.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ModelFolderError

logger = logging.getLogger(__name__)

ARCHS: tuple[str, ...] = ("tiny", "sd15")
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

_CONFIGS: dict[str, dict[str, dict[str, Any]]] = {
    "sd15": {
        "unet": {
            "sample_size": 64,
            "in_channels": 4,
            "out_channels": 4,
            "layers_per_block": 2,
            "block_out_channels": (320, 640, 1280, 1280),
            "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            "cross_attention_dim": 768,
            "attention_head_dim": 8,
            "norm_num_groups": 32,
            "norm_eps": 1e-5,
            "flip_sin_to_cos": True,
            "freq_shift": 0,
            "act_fn": "silu",
        },
        "vae": {
            "sample_size": 512,
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 4,
            "layers_per_block": 2,
            "block_out_channels": (128, 256, 512, 512),
            "down_block_types": ("DownEncoderBlock2D",) * 4,
            "up_block_types": ("UpDecoderBlock2D",) * 4,
            "norm_num_groups": 32,
            "act_fn": "silu",
            "scaling_factor": 0.18215,
        },
        "text_encoder": {
            "vocab_size": CLIP_VOCAB_SIZE,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": CLIP_MAX_LENGTH,
            "hidden_act": "quick_gelu",
            "projection_dim": 768,
            "layer_norm_eps": 1e-5,
            "bos_token_id": 0,
            "pad_token_id": 1,
            "eos_token_id": 2,
        },
    },
    "tiny": {
        "unet": {
            "sample_size": 8,
            "in_channels": 4,
            "out_channels": 4,
            "layers_per_block": 2,
            "block_out_channels": (16, 32, 32, 32),
            "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            "cross_attention_dim": 32,
            "attention_head_dim": 2,
            "norm_num_groups": 8,
            "norm_eps": 1e-5,
            "flip_sin_to_cos": True,
            "freq_shift": 0,
            "act_fn": "silu",
        },
        "vae": {
            "sample_size": 64,
            "in_channels": 3,
            "out_channels": 3,
            "latent_channels": 4,
            "layers_per_block": 1,
            "block_out_channels": (8, 16, 16, 16),
            "down_block_types": ("DownEncoderBlock2D",) * 4,
            "up_block_types": ("UpDecoderBlock2D",) * 4,
            "norm_num_groups": 8,
            "act_fn": "silu",
            "scaling_factor": 0.18215,
        },
        "text_encoder": {
            "vocab_size": CLIP_VOCAB_SIZE,
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": CLIP_MAX_LENGTH,
            "hidden_act": "quick_gelu",
            "projection_dim": 32,
            "layer_norm_eps": 1e-5,
            "bos_token_id": 0,
            "pad_token_id": 1,
            "eos_token_id": 2,
        },
    },
}


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


def write_clip_tokenizer(out_dir: Path) -> None:
    """Save an SD-1.x ``CLIPTokenizer`` (77 positions, pad = ``<|endoftext|>``) into ``out_dir``."""
    from transformers import CLIPTokenizer

    vocab, merges = clip_vocab_and_merges()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    tok = CLIPTokenizer(
        vocab=str(out_dir / "vocab.json"), merges=str(out_dir / "merges.txt"), model_max_length=CLIP_MAX_LENGTH
    )
    tok.save_pretrained(out_dir)


def write_dummy_pipeline(out_dir: str | Path, arch: str = "tiny", seed: int = 0, overwrite: bool = False) -> Path:
    """Write a ``StableDiffusionPipeline`` folder with seeded random weights.

    Args:
        out_dir: destination folder (created).
        arch: ``"tiny"`` or ``"sd15"`` (see the module docstring).
        seed: torch seed; the same seed gives byte-identical weights.
        overwrite: replace a non-empty ``out_dir``.

    Returns:
        The folder, loadable with ``StableDiffusionPipeline.from_pretrained(out_dir, local_files_only=True)``.

    Raises:
        ModelFolderError: unknown ``arch`` or ``out_dir`` not empty.
    """
    import torch
    from diffusers import AutoencoderKL, PNDMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    if arch not in ARCHS:
        raise ModelFolderError(f"--arch {arch!r} is unknown; use one of {', '.join(ARCHS)}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ModelFolderError(f"{out} exists and is not empty; choose another folder or pass --overwrite")
    cfg = _CONFIGS[arch]

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**cfg["unet"])
    torch.manual_seed(seed + 1)
    vae = AutoencoderKL(**cfg["vae"])
    torch.manual_seed(seed + 2)
    text_encoder = CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"]))
    scheduler = PNDMScheduler.from_config(SD15_SCHEDULER_CONFIG)

    out.mkdir(parents=True, exist_ok=True)
    write_clip_tokenizer(out / "_tokenizer_tmp")
    tokenizer = CLIPTokenizer.from_pretrained(out / "_tokenizer_tmp", local_files_only=True)
    pipe = StableDiffusionPipeline(
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
    import shutil

    shutil.rmtree(out / "_tokenizer_tmp", ignore_errors=True)
    n_unet = sum(p.numel() for p in unet.parameters())
    logger.info("wrote %s pipeline (seed %d, UNet %s parameters) to %s", arch, seed, f"{n_unet:,}", out)
    return out

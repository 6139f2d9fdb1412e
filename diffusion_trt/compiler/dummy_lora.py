"""``diffusion-trt dummy-lora MODEL_DIR OUT.safetensors``: a seeded random LoRA for a pipeline folder (for trying
``run --lora`` and ``compile --lora`` on the dummy pipelines, as ``dummy-pipeline`` is for trying ``compile``).

Layers: every attention projection of the UNet (``to_q``, ``to_k``, ``to_v``, ``to_out.0``) and of the text
encoder(s) (``q_proj``, ``k_proj``, ``v_proj``, ``out_proj``; SDXL folders: ``text_encoder_2`` too), found by name in
the folder's safetensors weights (no model class). Keys in diffusers' peft form (``unet.<module>.lora_A.weight``
[r, in], ``lora_B.weight`` [out, r]), alpha = rank (diffusers' default when the file names none): the delta is
``B @ A``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..artifact.folder import write_bytes_atomic
from ..errors import ModelFolderError

UNET_TARGETS: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
TEXT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj")
_FILES = {"unet": ("unet/diffusion_pytorch_model.safetensors", UNET_TARGETS),
          "text_encoder": ("text_encoder/model.safetensors", TEXT_TARGETS),
          "text_encoder_2": ("text_encoder_2/model.safetensors", TEXT_TARGETS)}
#: Components a folder may lack (SD 1.x/2.x have no second text encoder).
_OPTIONAL = ("text_encoder_2",)


def write_dummy_lora(model_dir: str | Path, out: str | Path, *, rank: int = 4, seed: int = 0,
                     std: float = 0.1) -> dict[str, int]:
    """Write a random rank-``rank`` LoRA for the pipeline folder ``model_dir`` to ``out``.

    Args:
        model_dir: a diffusers SD 1.x/2.x or SDXL folder with safetensors weights (e.g. ``dummy-pipeline``'s).
        out: the ``.safetensors`` file to write.
        rank: LoRA rank, >= 1.
        seed: seeds the CPU generator.
        std: standard deviation of the A and B entries.

    Returns:
        component -> layers written.

    Raises:
        ModelFolderError: ``model_dir`` lacks a component's safetensors file, or none of its layers is a target.
        ValueError: ``rank`` < 1.
    """
    from safetensors import safe_open
    from safetensors.torch import save

    if rank < 1:
        raise ValueError(f"rank={rank} must be >= 1")
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    counts = {}
    for comp, (rel, targets) in _FILES.items():
        path = Path(model_dir) / rel
        if comp in _OPTIONAL and not path.parent.is_dir():
            continue
        if not path.is_file():
            raise ModelFolderError(f"{path} does not exist; dummy-lora needs a diffusers folder with safetensors "
                                   "weights (e.g. from `diffusion-trt dummy-pipeline`)")
        with safe_open(str(path), framework="pt") as f:
            names = [k for k in f.keys() if k.removesuffix(".weight").endswith(targets) and k.endswith(".weight")]
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
        for key in sorted(k for k, s in shapes.items() if len(s) == 2):
            n_out, n_in = shapes[key]
            module = key.removesuffix(".weight")
            tensors[f"{comp}.{module}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
            tensors[f"{comp}.{module}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
            counts[comp] = counts.get(comp, 0) + 1
        if not counts.get(comp):
            raise ModelFolderError(f"{path} has no attention projection ({', '.join(targets)}) to put a LoRA on")
    # whole or not at all, with the umask's mode: save_file wrote in place (Ctrl-C: a truncated LoRA), mode 0600
    write_bytes_atomic(Path(out), save(tensors))
    return counts

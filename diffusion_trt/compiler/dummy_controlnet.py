"""Seeded random-weight ControlNets of the dummy architectures (``diffusion-trt dummy-controlnet``).

A ControlNet is made as diffusers makes one to train: ``ControlNetModel.from_unet`` of the architecture's UNet,
seeded as :func:`~.dummy.write_dummy_pipeline` seeds it (with the same ``seed`` the ControlNet starts from the dummy
pipeline's own UNet weights). ``from_unet`` zero-initialises the residual projections (``controlnet_down_blocks``,
``controlnet_mid_block``) and the last conditioning convolution, so a fresh ControlNet adds exactly zero; those are
then drawn from N(0, 0.02) with ``seed + 100`` so that tests and benchmarks see residuals that change the images.
The tiny architectures use a narrower conditioning embedding (8, 8, 16, 16 channels instead of 16, 32, 96, 256).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..errors import ModelFolderError
from .dummy import ARCHS, arch_config, replaced_folder

logger = logging.getLogger(__name__)

_TINY_EMBEDDING = (8, 8, 16, 16)
_INIT_STD = 0.02


def write_dummy_controlnet(out_dir: str | Path, arch: str = "tiny", seed: int = 0, overwrite: bool = False) -> Path:
    """Write a ``ControlNetModel`` folder (config.json + safetensors) with seeded random weights for ``arch``.

    Args:
        out_dir: destination folder (created).
        arch: one of :data:`~.dummy.ARCHS` except the inpainting ones (ControlNets take 4 latent channels).
        seed: torch seed; the same seed gives byte-identical weights.
        overwrite: replace a non-empty ``out_dir``.

    Returns:
        The folder, loadable with ``ControlNetModel.from_pretrained(out_dir)``.

    Raises:
        ModelFolderError: unknown or inpainting ``arch`` (the message lists the valid ones), or ``out_dir`` not empty
            (without ``overwrite``, or holding no ``config.json``: see :func:`~.dummy.replaced_folder`).
    """
    valid = [a for a in ARCHS if "inpaint" not in a]
    if arch not in valid:
        raise ModelFolderError(f"--arch {arch!r} has no ControlNet; use one of {', '.join(valid)}")
    out = Path(out_dir)
    with replaced_folder(out, overwrite, "config.json", "ControlNet", class_name="ControlNetModel") as tmp:
        controlnet = _write_dummy_controlnet(tmp, arch, seed)
    logger.info("wrote %s ControlNet (seed %d, %s parameters) to %s", arch, seed,
                f"{sum(p.numel() for p in controlnet.parameters()):,}", out)
    return out


def _write_dummy_controlnet(out: Path, arch: str, seed: int) -> Any:
    """Write the ControlNet of :func:`write_dummy_controlnet` into the empty folder ``out``; returns it."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    torch.manual_seed(seed)  # as write_dummy_pipeline: the same seed gives the pipeline's own UNet
    unet = UNet2DConditionModel(**arch_config(arch)["unet"])
    kwargs = {"conditioning_embedding_out_channels": _TINY_EMBEDDING} if arch.startswith("tiny") else {}
    controlnet = ControlNetModel.from_unet(unet, **kwargs)
    gen = torch.Generator().manual_seed(seed + 100)
    zeroed = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
              controlnet.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for conv in zeroed:
            for p in conv.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * _INIT_STD)
    controlnet.save_pretrained(out, safe_serialization=True)
    return controlnet

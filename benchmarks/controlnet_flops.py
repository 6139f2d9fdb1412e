"""A ControlNet's arithmetic next to its UNet's: floating-point operations of one denoising step, per architecture.

Why: issue 25's goal is that each ControlNet adds at most 35 % to the UNet step. A ControlNet is the UNet's down and
mid blocks plus the condition embedding (diffusers' ``ControlNetModel.from_unet``), so the share of the UNet's
arithmetic it repeats bounds what any engine that runs it as written can reach, and the gap between that share and
the measured step cost is the ControlNet engine's loss of efficiency against the UNet's.

What it counts: ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions, attention) over one forward of
each model on the ``meta`` device (no weights, no arithmetic done: machine-independent figures), at a CFG batch of 2
(``--batch``), the architecture's default latent size and 77 text tokens; the condition embedding
(``controlnet_cond_embedding``) on its own too, since it depends only on the control image and not on the step.

Usage: ``python benchmarks/controlnet_flops.py [--arch sd15] [--batch 2] [--json OUT.json]``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode


def _flops(fn: Any, *args: Any, **kwargs: Any) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())


def count(arch: str, batch: int) -> dict[str, Any]:
    """The step's FLOPs of the UNet, the ControlNet and its condition embedding for the dummy architecture ``arch``.

    Raises:
        KeyError: ``arch`` is not a dummy architecture with a UNet config (``compiler/dummy.py``).
    """
    from diffusers import ControlNetModel, UNet2DConditionModel

    from diffusion_trt.compiler.dummy import _CONFIGS

    config = _CONFIGS[arch]["unet"]
    with torch.device("meta"):
        unet = UNet2DConditionModel(**config)
        controlnet = ControlNetModel.from_unet(unet)
    h = w = int(config["sample_size"])
    sample = torch.empty(batch, 4, h, w, device="meta")
    timestep = torch.full((batch,), 10.0, device="meta")
    context = torch.empty(batch, 77, int(config["cross_attention_dim"]), device="meta")
    image = torch.empty(batch, 3, 8 * h, 8 * w, device="meta")
    unet_flops = _flops(unet, sample, timestep, context)
    cn_flops = _flops(controlnet, sample, timestep, context, controlnet_cond=image, return_dict=False)
    embedding = _flops(controlnet.controlnet_cond_embedding, image)
    return {"arch": arch, "batch": batch, "latent": [h, w], "unet_tflop": unet_flops / 1e12,
            "controlnet_tflop": cn_flops / 1e12, "controlnet_share_of_unet": cn_flops / unet_flops,
            "cond_embedding_tflop": embedding / 1e12, "cond_embedding_share_of_controlnet": embedding / cn_flops}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sd15", help="a dummy architecture with a UNet (sd15, sd21, tiny...)")
    parser.add_argument("--batch", type=int, default=2, help="UNet batch (2 = one image with CFG)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    row = count(args.arch, args.batch)
    print(f"{row['arch']} batch {row['batch']} latent {row['latent'][0]}x{row['latent'][1]}: UNet "
          f"{row['unet_tflop']:.3f} TFLOP, ControlNet {row['controlnet_tflop']:.3f} TFLOP "
          f"({row['controlnet_share_of_unet']:.1%} of the UNet), its condition embedding "
          f"{row['cond_embedding_tflop']:.4f} TFLOP "
          f"({row['cond_embedding_share_of_controlnet']:.1%} of the ControlNet)")
    if args.json is not None:
        args.json.write_text(json.dumps(row, indent=1) + "\n")
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()

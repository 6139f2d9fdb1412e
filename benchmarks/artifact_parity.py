"""Two artifacts of one model, one prompt and seed: the largest difference between their images.

    python benchmarks/artifact_parity.py ART_A ART_B [--lora FILE] [--steps 30] [--json out.json]

Why (issue 26): ``compile --refittable`` rewrites the UNet's 1x1 Convs as MatMuls over weight inputs and, on ORT
CUDA, folds each proj_out's bias and residual into one ``com.microsoft.BiasAdd``; the refittable artifact must make
the plain one's images (fp16 noise only: ~0.003 on an image in [0, 1], H100, session 22). ``--lora``: B also runs with
that LoRA loaded (its difference from B's own image shows the LoRA took effect). A check, not a test: run on a GPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from diffusion_trt import EnginePipeline


def image(pipe: EnginePipeline, steps: int) -> np.ndarray:
    import torch

    generator = torch.Generator(device="cpu").manual_seed(0)
    out = pipe("an ink painting of a mountain village", num_inference_steps=steps, generator=generator,
               output_type="np")
    return np.asarray(out.images, dtype=np.float32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--lora", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from diffusion_trt import EnginePipeline

    images = {}
    for key, path in (("a", args.a), ("b", args.b)):
        pipe = EnginePipeline.from_artifacts(path)
        images[key] = image(pipe, args.steps)
        if key == "b" and args.lora is not None:
            pipe.load_lora(args.lora)
            images["b_lora"] = image(pipe, args.steps)
        del pipe
    result = {"a": str(args.a), "b": str(args.b), "steps": args.steps,
              "max_abs_a_b": float(np.abs(images["a"] - images["b"]).max())}
    if "b_lora" in images:
        result["max_abs_b_b_lora"] = float(np.abs(images["b"] - images["b_lora"]).max())
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""End-to-end figures for one compiled artifact next to diffusers eager, in one process, same weights and seed.

Prints (and writes as JSON with --json): UNet step time (median of N, CUDA-synchronised wall clock),
end-to-end time per image, and the max abs difference between our image and diffusers' image.

    python benchmarks/e2e_vs_diffusers.py MODEL_DIR ARTIFACT_DIR --device cuda --steps 50 --json out.json

A benchmark, not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("artifact_dir", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--guidance", type=float, default=7.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default="an ink painting of mountains above a river, guohua style")
    ap.add_argument("--unet-iters", type=int, default=30)
    ap.add_argument("--e2e-iters", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--save-images", type=Path, default=None, help="folder for ours.png / diffusers.png")
    args = ap.parse_args()

    from diffusers import StableDiffusionPipeline

    from diffusion_trt.runtime.pipeline import EnginePipeline

    dev = args.device
    results: dict = {"device": dev, "steps": args.steps, "guidance_scale": args.guidance}
    if dev == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
    results["torch"] = torch.__version__

    # --- ours
    t0 = time.perf_counter()
    pipe = EnginePipeline.from_artifacts(args.artifact_dir, device=dev)
    pipe.__enter__()
    results["ours_load_s"] = time.perf_counter() - t0
    manifest = pipe.manifest
    precision = manifest.precision
    h, w = manifest.model.default_height, manifest.model.default_width
    results.update(precision=precision, height=h, width=w)
    dtype = torch.float16 if precision == "fp16" else torch.float32

    def ours_call(output_type: str = "np"):
        g = torch.Generator("cpu").manual_seed(args.seed)
        return pipe(args.prompt, num_inference_steps=args.steps, guidance_scale=args.guidance, generator=g,
                    height=h, width=w, output_type=output_type, progress=False)

    ours_img = np.asarray(ours_call().images[0], dtype=np.float32)
    e2e = timed(ours_call, dev, warmup=1, iters=args.e2e_iters)
    results["ours_e2e_s"] = statistics.median(e2e)

    unet = pipe.engines["unet"]
    lat = (2, manifest.model.unet_in_channels, h // 8, w // 8)
    feeds = {
        "sample": torch.randn(lat, device=dev, dtype=dtype),
        "timestep": torch.full((2,), 500.0, device=dev, dtype=torch.float32),
        "encoder_hidden_states": torch.randn(2, 77, manifest.model.text_hidden_size, device=dev, dtype=dtype),
    }
    results["ours_unet_step_ms"] = 1e3 * statistics.median(timed(lambda: unet.run(feeds), dev, 5, args.unet_iters))
    pipe.__exit__(None, None, None)  # frees the sessions before diffusers loads
    if dev == "cuda":
        torch.cuda.empty_cache()

    # --- diffusers eager, same folder, same scheduler config, same CPU generator
    ref = StableDiffusionPipeline.from_pretrained(args.model_dir, torch_dtype=dtype, local_files_only=True,
                                                  safety_checker=None, requires_safety_checker=False).to(dev)
    ref.set_progress_bar_config(disable=True)

    def ref_call():
        g = torch.Generator("cpu").manual_seed(args.seed)
        return ref(args.prompt, num_inference_steps=args.steps, guidance_scale=args.guidance, generator=g,
                   height=h, width=w, output_type="np")

    with torch.no_grad():
        ref_img = ref_call().images[0].astype(np.float32)
        e2e_ref = timed(ref_call, dev, warmup=1, iters=args.e2e_iters)
        ref_feeds = (feeds["sample"], feeds["timestep"], feeds["encoder_hidden_states"])
        results["diffusers_unet_step_ms"] = 1e3 * statistics.median(
            timed(lambda: ref.unet(*ref_feeds, return_dict=False), dev, 5, args.unet_iters))
    results["diffusers_e2e_s"] = statistics.median(e2e_ref)

    diff = np.abs(ours_img - ref_img)
    results["image_max_abs_diff"] = float(diff.max())
    results["image_mean_abs_diff"] = float(diff.mean())
    results["image_max_abs_diff_255"] = float(diff.max() * 255)
    results["images_finite"] = bool(np.isfinite(ours_img).all() and np.isfinite(ref_img).all())
    results["image_std"] = float(ours_img.std())
    if args.save_images:
        from PIL import Image

        args.save_images.mkdir(parents=True, exist_ok=True)
        Image.fromarray((ours_img * 255).round().astype(np.uint8)).save(args.save_images / "ours.png")
        Image.fromarray((ref_img * 255).round().astype(np.uint8)).save(args.save_images / "diffusers.png")

    for k, v in results.items():
        print(f"{k:>26}: {v:.4f}" if isinstance(v, float) else f"{k:>26}: {v}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

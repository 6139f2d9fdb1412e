"""SDXL end to end: our EnginePipeline next to diffusers' StableDiffusionXLPipeline (eager fp16), same weights and seed.

For each side: load, one short warm-up call (CUDA graph capture, cuDNN autotuning), then ``--images`` timed calls of
``--steps`` steps at the artifact's default size (1024x1024 for SDXL), one image per call, CFG on. Every step's
latents are checked finite (a callback keeps one device flag per step: no host sync inside the loop) and so is
every image (read as float, before any uint8 conversion hides a NaN). diffusers runs fp16 with its VAE upcast to
fp32 as it does by itself (``vae.config.force_upcast``); our artifact's VAE is fp32 unless compiled fp16-safe.

    python benchmarks/sdxl_e2e.py MODEL_DIR ARTIFACT_DIR --device cuda --steps 30 --images 2 --json out.json
    python benchmarks/sdxl_e2e.py /tmp/sx /tmp/sx-art --arch tiny-sdxl --device cpu --steps 3   # CPU smoke run

With ``--arch``, a missing MODEL_DIR is written by ``dummy-pipeline --arch`` and a missing ARTIFACT_DIR is compiled
(CPU: fp32; CUDA: fp16, static at the model's default size, batch 1). A benchmark, not a test: figures depend on
the machine; the JSON says which.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prepare(args: argparse.Namespace) -> None:
    """``--arch``: make the model folder and the artifact when they are missing."""
    if args.arch is None:
        return
    if not args.model_dir.exists():
        from diffusion_trt.compiler.dummy import write_dummy_pipeline

        write_dummy_pipeline(args.model_dir, arch=args.arch, seed=args.seed)
    if not args.artifact_dir.exists():
        from diffusion_trt.compiler.pipeline import compile_pipeline
        from diffusion_trt.config import CompileConfig

        if args.device == "cuda":
            size = json.loads((args.model_dir / "unet" / "config.json").read_text())["sample_size"] * 8
            config = CompileConfig(device="cuda", precision="fp16", height=size, width=size, min_height=size,
                                   max_height=size, min_width=size, max_width=size, max_batch_size=1)
        else:
            config = CompileConfig()
        compile_pipeline(args.model_dir, args.artifact_dir, config)


class FiniteSteps:
    """Per-step finiteness of the latents, kept as device flags and read once at the end."""

    def __init__(self) -> None:
        self.flags: list[torch.Tensor] = []

    def check(self, latents: torch.Tensor) -> None:
        self.flags.append(torch.isfinite(latents).all())

    def result(self) -> tuple[int, bool]:
        """(steps seen, all finite)."""
        return len(self.flags), bool(torch.stack(self.flags).all().item()) if self.flags else False


def timed_calls(call: Callable[[FiniteSteps], np.ndarray], device: str, images: int) -> dict[str, Any]:
    seconds, steps_ok, images_ok, steps_seen, last = [], True, True, [], None
    for _ in range(images):
        finite = FiniteSteps()
        _sync(device)
        t0 = time.perf_counter()
        image = call(finite)
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        n, ok = finite.result()
        steps_seen.append(n)
        steps_ok &= ok
        images_ok &= bool(np.isfinite(image).all())
        last = image
    return {"seconds_per_image": statistics.median(seconds), "seconds": seconds, "steps_checked": steps_seen,
            "latents_finite_every_step": steps_ok, "image_finite": images_ok, "image": last}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("artifact_dir", type=Path)
    ap.add_argument("--arch", default=None, help="make missing folders with dummy-pipeline --arch ARCH and compile")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--images", type=int, default=2, help="timed images per side (one per call)")
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt", default="an astronaut riding a horse on the moon, detailed, 8k")
    ap.add_argument("--skip-diffusers", action="store_true", help="time our pipeline only")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = args.device
    t_prep = time.perf_counter()
    _prepare(args)

    from diffusion_trt.runtime.pipeline import EnginePipeline

    results: dict[str, Any] = {"device": dev, "steps": args.steps, "guidance_scale": args.guidance, "seed": args.seed,
                               "images_timed": args.images, "torch": torch.__version__,
                               "prepare_seconds": round(time.perf_counter() - t_prep, 1)}
    if dev == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)

    # --- ours
    t0 = time.perf_counter()
    pipe = EnginePipeline.from_artifacts(args.artifact_dir, device=dev)
    results["ours_load_s"] = round(time.perf_counter() - t0, 2)
    manifest = pipe.manifest
    if not manifest.model.is_sdxl:
        raise SystemExit(f"{args.artifact_dir} is not an SDXL artifact (model.architecture="
                         f"{manifest.model.architecture!r})")
    h, w = manifest.model.default_height, manifest.model.default_width
    results.update(height=h, width=w, precision=manifest.precision,
                   component_precision={k: v.precision for k, v in manifest.components.items()})

    def ours(finite: FiniteSteps, steps: int = args.steps) -> np.ndarray:
        return pipe(args.prompt, num_inference_steps=steps, guidance_scale=args.guidance, seed=args.seed,
                    height=h, width=w, output_type="np", progress=False,
                    callback=lambda i, t, latents: finite.check(latents)).images

    with pipe:
        t0 = time.perf_counter()
        ours(FiniteSteps(), 2)  # warm-up: the second UNet run captures the CUDA graph of a static artifact
        ours(FiniteSteps(), 2)
        _sync(dev)
        results["ours_warmup_s"] = round(time.perf_counter() - t0, 2)
        r = timed_calls(ours, dev, args.images)
    ours_image = r.pop("image")
    results["ours"] = r

    # --- diffusers eager
    if not args.skip_diffusers:
        from diffusers import StableDiffusionXLPipeline

        dtype = torch.float16 if dev == "cuda" else torch.float32
        t0 = time.perf_counter()
        ref = StableDiffusionXLPipeline.from_pretrained(args.model_dir, torch_dtype=dtype, local_files_only=True,
                                                        add_watermarker=False).to(dev)
        ref.set_progress_bar_config(disable=True)
        results["diffusers_load_s"] = round(time.perf_counter() - t0, 2)
        results["diffusers_dtype"] = str(dtype)
        results["diffusers_vae_force_upcast"] = bool(ref.vae.config.force_upcast)

        def theirs(finite: FiniteSteps, steps: int = args.steps) -> np.ndarray:
            def on_step(_pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
                finite.check(kwargs["latents"])
                return {}

            return ref(args.prompt, num_inference_steps=steps, guidance_scale=args.guidance, height=h, width=w,
                       generator=torch.Generator("cpu").manual_seed(args.seed), output_type="np",
                       callback_on_step_end=on_step).images

        with torch.inference_mode():
            t0 = time.perf_counter()
            theirs(FiniteSteps(), 2)
            _sync(dev)
            results["diffusers_warmup_s"] = round(time.perf_counter() - t0, 2)
            r = timed_calls(theirs, dev, args.images)
        theirs_image = r.pop("image")
        results["diffusers"] = r
        both = np.isfinite(ours_image).all() and np.isfinite(theirs_image).all()
        results["max_abs_image_diff_vs_diffusers"] = float(np.abs(ours_image - theirs_image).max()) if both else None
        results["speedup"] = round(results["diffusers"]["seconds_per_image"] / results["ours"]["seconds_per_image"], 3)

    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    ok = results["ours"]["latents_finite_every_step"] and results["ours"]["image_finite"]
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()

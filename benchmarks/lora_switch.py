"""LoRA per request on an ONNX Runtime artifact (issue 26): switch time, step cost, and parity with the merged compile.

    python benchmarks/lora_switch.py OUT.json [--work DIR] [--arch sd15] [--rank 64] [--steps 30] [--runs 20]

Makes, under ``--work`` (default ``/tmp/lora-switch``): the ``--arch`` dummy pipeline (seeded random weights), two
rank-``--rank`` LoRAs on its UNet (attention q/k/v/out, proj_in/proj_out, feed-forward) and text encoder
(q/k/v/out, fc1/fc2), made with peft (``inject_adapter_in_model`` + random ``lora_B``) and saved with diffusers'
``save_lora_weights``; and three artifacts, all ``--device cuda --precision fp16``, static 512x512 batch 1:
``base`` (no LoRA), ``refit`` (``--refittable``: weights as graph inputs) and ``merged`` (``--lora A``).

Figures (CUDA events around each call, after warm-up; medians with min..max):

* ``unet_step_ms``: one UNet run (CFG batch 2) of ``base``, of ``refit`` with no LoRA, and of ``refit`` with LoRA A
  loaded; goals: ``refit`` with a LoRA <= 1.05x ``base``, with none = ``base``;
* ``switch_ms``: ``load_lora(A)``, ``load_lora(B)`` (a switch), ``load_lora([A, B])`` and ``unload_lora()``,
  wall time until the GPU finished (goal: a switch <= 200 ms), five rounds; ``switch_ms_first``: the first round
  alone, when neither file was hashed in this process yet (later rounds reuse the digest: ``lora.lora_sha256``);
* ``e2e_s``: a whole ``--steps`` image, ``base`` and ``refit`` with A;
* ``parity``: max abs difference of the ``refit`` + A image from the ``merged`` image (goal <= 4/255), and of
  ``refit`` after ``unload_lora()`` from ``base`` (goal: 0 or fp16 noise).

Not for a CPU: the SD-1.5 compile alone takes tens of minutes there. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
PROMPT = "an ink wash painting of a mountain village"


def make_lora(model_dir: Path, path: Path, rank: int, seed: int) -> Path:
    """A random rank-``rank`` LoRA on the UNet and text encoder, made with peft (``inject_adapter_in_model``; random
    ``lora_B``, as a trained LoRA has), saved as diffusers saves one."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    pipe = StableDiffusionPipeline.from_pretrained(model_dir, local_files_only=True)
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for name, module, targets in (("unet", pipe.unet, UNET_TARGETS), ("text_encoder", pipe.text_encoder,
                                                                        TEXT_TARGETS)):
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights="gaussian")
        module = inject_adapter_in_model(config, module)
        with torch.no_grad():
            for pname, p in module.named_parameters():
                if "lora_B" in pname:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        layers[name] = get_peft_model_state_dict(module)
    StableDiffusionPipeline.save_lora_weights(path.parent, unet_lora_layers=layers["unet"],
                                              text_encoder_lora_layers=layers["text_encoder"],
                                              weight_name=path.name)
    return path


def compile_all(work: Path, model: Path, lora: Path) -> dict[str, Path]:
    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig

    static = {"height": 512, "width": 512, "min_height": 512, "max_height": 512, "min_width": 512,
              "max_width": 512, "batch_size": 1, "min_batch_size": 1, "max_batch_size": 1}
    common = {"device": "cuda", "precision": "fp16", "components": ("text_encoder", "unet", "vae_decoder"), **static}
    out = {}
    for name, extra in (("base", {}), ("refit", {"refittable": True}), ("merged", {"loras": ((str(lora), 1.0),)})):
        art = work / f"art-{name}"
        if not (art / "manifest.json").is_file():
            compile_pipeline(model, art, CompileConfig(**common, **extra))
        out[name] = art
    return out


def stats(ms: list[float]) -> dict[str, float]:
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "n": len(ms)}


def unet_feeds(pipe: Any) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for info in pipe.engines["unet"].spec.inputs:
        shape = tuple(info.max)  # the static profile: min == max
        t = torch.full(shape, 501.0) if info.name == "timestep" else torch.randn(shape, generator=g)
        out[info.name] = t.to(info.torch_dtype).cuda()
    return out


def time_unet(pipe: Any, runs: int) -> dict[str, float]:
    unet, feeds = pipe.engines["unet"], unet_feeds(pipe)
    for _ in range(5):
        unet.run(feeds)
    torch.cuda.synchronize()
    ms = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        unet.run(feeds)
        end.record()
        end.synchronize()
        ms.append(start.elapsed_time(end))
    return stats(ms)


def timed(fn: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def image(pipe: Any, steps: int) -> np.ndarray:
    return pipe(PROMPT, num_inference_steps=steps, seed=0, output_type="np", progress=False).images


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--work", type=Path, default=Path("/tmp/lora-switch"))
    ap.add_argument("--arch", default="sd15")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()

    from diffusion_trt.compiler.dummy import write_dummy_pipeline

    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / f"model-{args.arch}"
    if not (model / "model_index.json").is_file():
        write_dummy_pipeline(model, arch=args.arch, seed=0)
    loras = {k: args.work / f"lora_{k}_r{args.rank}.safetensors" for k in ("a", "b")}
    for i, path in enumerate(loras.values()):
        if not path.is_file():
            make_lora(model, path, args.rank, seed=i + 1)
    arts = compile_all(args.work, model, loras["a"])
    res: dict[str, Any] = {"arch": args.arch, "rank": args.rank, "steps": args.steps,
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import onnxruntime

    res["onnxruntime"] = onnxruntime.__version__
    try:
        measure(res, arts, loras, args)
    except Exception as e:  # keep what was measured before the failure, and say what failed
        res["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        print(json.dumps(res, indent=1))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))


def measure(res: dict[str, Any], arts: dict[str, Path], loras: dict[str, Path], args: argparse.Namespace) -> None:
    """Every figure of the module docstring, into ``res`` as it is measured."""
    from diffusion_trt.runtime import EnginePipeline

    with EnginePipeline.from_artifacts(arts["base"], device="cuda") as pipe:
        res["unet_step_ms"] = {"base": time_unet(pipe, args.runs)}
        t0 = time.perf_counter()
        base_img = image(pipe, args.steps)
        res["e2e_s"] = {"base": time.perf_counter() - t0}
    with EnginePipeline.from_artifacts(arts["merged"], device="cuda") as pipe:
        merged_img = image(pipe, args.steps)
    with EnginePipeline.from_artifacts(arts["refit"], device="cuda") as pipe:
        res["unet_step_ms"]["refit_no_lora"] = time_unet(pipe, args.runs)
        switch: dict[str, list[float]] = {"load_a": [], "switch_a_to_b": [], "load_a_and_b": [], "unload": []}
        for _ in range(5):
            switch["load_a"].append(timed(lambda: pipe.load_lora(loras["a"], 1.0)))
            switch["switch_a_to_b"].append(timed(lambda: pipe.load_lora(loras["b"], 1.0)))
            switch["load_a_and_b"].append(timed(lambda: pipe.load_lora([(loras["a"], 1.0), (loras["b"], 0.5)])))
            switch["unload"].append(timed(pipe.unload_lora))
        res["switch_ms"] = {k: stats(v) for k, v in switch.items()}
        res["switch_ms_first"] = {k: v[0] for k, v in switch.items()}  # the files not yet hashed in this process
        pipe.load_lora(loras["a"], 1.0)
        res["unet_step_ms"]["refit_with_lora"] = time_unet(pipe, args.runs)
        t0 = time.perf_counter()
        lora_img = image(pipe, args.steps)
        res["e2e_s"]["refit_with_lora"] = time.perf_counter() - t0
        pipe.unload_lora()
        after_img = image(pipe, args.steps)
    steps_ms = res["unet_step_ms"]
    res["step_ratio_with_lora"] = steps_ms["refit_with_lora"]["median"] / steps_ms["base"]["median"]
    res["step_ratio_no_lora"] = steps_ms["refit_no_lora"]["median"] / steps_ms["base"]["median"]
    res["parity"] = {"lora_vs_merged_max_abs": float(np.abs(lora_img - merged_img).max()),
                     "unloaded_vs_base_max_abs": float(np.abs(after_img - base_img).max()),
                     "lora_vs_base_max_abs": float(np.abs(lora_img - base_img).max())}
    res["goals"] = {"switch_le_200ms": res["switch_ms"]["switch_a_to_b"]["median"] <= 200,
                    "step_le_1.05x": res["step_ratio_with_lora"] <= 1.05,
                    "parity_le_4_255": res["parity"]["lora_vs_merged_max_abs"] <= 4 / 255}


if __name__ == "__main__":
    main()

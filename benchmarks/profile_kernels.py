"""Where the GPU time of a compiled component goes: every CUDA kernel ONNX Runtime launches, grouped and summed.

    python benchmarks/profile_kernels.py ARTIFACT_DIR [--component unet --component vae_decoder]
        [--options prefer_nhwc=1] [--iters 5] [--top 25] [--json out.json]

Runs the component at its opt shape through :class:`~diffusion_trt.runtime.engines.ort_engine.OrtEngine` (CUDA,
IO binding) under ``torch.profiler`` with CUDA activity on: CUPTI records the kernels of every library in the process,
ONNX Runtime's and cuDNN's/cuBLAS's included, with their GPU durations. Reports per run: the summed kernel time, the
kernel count, the time by category (conv, gemm, attention, normalization, transpose, elementwise, copy, other;
matched on the kernel name, see :data:`CATEGORIES`) and the top kernels.

A benchmark, not a test: the figures depend on the machine and library versions.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch

#: (category, regex on the lower-cased kernel name), first match wins. Names are cuDNN/cuBLAS/CUTLASS/ORT's.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("attention", r"flash|fmha|attention|mha|softmax"),
    ("normalization", r"groupnorm|group_norm|layernorm|layer_norm|instancenorm|skiplayer"),
    ("transpose", r"transpose"),
    ("conv", r"conv|fprop|dgrad|implicit|winograd|nchwtonhwc|nhwctonchw|xmma_fprop"),
    ("gemm", r"gemm|cublas|cutlass|sm90_xmma|matmul"),
    ("copy", r"memcpy|memset|copy|concat|slice|pad"),
    ("elementwise", r"elementwise|binary|unary|add|mul|div|sub|silu|gelu|sigmoid|cast|expand|resize|upsample"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def profile_component(art: Path, comp: str, options: dict[str, str], iters: int, top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from diffusion_trt.artifact import folder as artifacts
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from components import feeds_for  # the same inputs as the timing benchmark

    from diffusion_trt.artifact.reader import ArtifactReader
    from diffusion_trt.runtime.lora_slots import load_slots

    manifest = artifacts.load_verified(art, check_hashes=False)
    entry = manifest["components"][comp]
    feeds = feeds_for(entry)
    with ArtifactReader.open(art, check_hashes=False) as reader:  # --refittable: its weight inputs, bound as at run
        slots = load_slots(reader, "cuda")
    with OrtEngine(art / entry["onnx"], entry, name=comp, device="cuda", provider_options=options,
                   weight_inputs=slots.get(comp)) as eng:
        for _ in range(3):
            eng.run(feeds)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                eng.run(feeds)
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0.0)
        if t <= 0:
            continue
        rows.append({"name": ev.key, "count": ev.count / iters, "us": t / iters})
    rows.sort(key=lambda r: -r["us"])
    by_cat: dict[str, dict[str, float]] = {}
    for r in rows:
        c = by_cat.setdefault(category(r["name"]), {"us": 0.0, "count": 0.0})
        c["us"] += r["us"]
        c["count"] += r["count"]
    total = sum(r["us"] for r in rows)
    return {"component": comp, "options": options, "kernel_ms_per_run": total / 1e3,
            "kernels_per_run": sum(r["count"] for r in rows),
            "by_category_ms": {k: round(v["us"] / 1e3, 4)
                               for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1]["us"])},
            "count_by_category": {k: v["count"] for k, v in by_cat.items()},
            "top": [{**r, "name": r["name"][:160], "category": category(r["name"])} for r in rows[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--component", action="append", default=None)
    ap.add_argument("--options", default="prefer_nhwc=1", help="CUDA provider options, k=v,k=v ('' for none)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    options = dict(kv.split("=", 1) for kv in args.options.split(",") if kv)
    results = []
    for comp in args.component or ["unet", "vae_decoder", "text_encoder"]:
        r = profile_component(args.artifact, comp, options, args.iters, args.top)
        results.append(r)
        print(f"== {comp} {options}: {r['kernel_ms_per_run']:.3f} ms of kernels, "
              f"{r['kernels_per_run']:.0f} kernels/run")
        for cat, ms in r["by_category_ms"].items():
            print(f"   {cat:14s} {ms:8.3f} ms  ({r['count_by_category'][cat]:.0f} kernels)")
        for row in r["top"]:
            print(f"   {row['us']:9.1f} us x{row['count']:5.1f} [{row['category']}] {row['name'][:110]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

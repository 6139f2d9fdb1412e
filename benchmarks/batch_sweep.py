"""Issue 19, batch throughput: where the time of the CFG-batch-8 UNet step (batch 4 with CFG) and of the batch-4 VAE
decode goes, and which ONNX Runtime CUDA provider options move it.

    python3 benchmarks/batch_sweep.py ARTIFACT_DIR [--variants V1,V2,...] [--top 15] [--json out.json]

ARTIFACT_DIR: a static CUDA fp16 artifact (e.g. batch 4, 512x512: the UNet runs its opt shape, CFG batch 8). For
each component (unet, vae_decoder) and each variant (benchmarks/components.py ``variant_options`` syntax, on top
of the runtime's own defaults ``diffusion_trt.runtime.pipeline.cuda_layout_options``): the median of 20 CUDA-graph
runs (ms), then a CUPTI kernel profile (benchmarks/profile_kernels.py) of the default and of the fastest variant,
top kernels. Every variant runs in this one process, one session at a time; a variant ORT refuses is recorded with
its error. A benchmark, not a test: the figures depend on the GPU and library versions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from components import feeds_for, median_ms, variant_options
from profile_kernels import profile_component

DEFAULT_VARIANTS = ("default", "sdpa_kernel=1", "sdpa_kernel=2", "sdpa_kernel=0",
                    "tunable_op_enable=1+tunable_op_tuning_enable=1", "cudnn_conv_use_max_workspace=0")


def options_for(component: str, variant: str) -> dict[str, str]:
    from diffusion_trt.runtime.pipeline import cuda_layout_options

    base = {**cuda_layout_options(component, "cuda"), "enable_cuda_graph": "1"}
    return base if variant == "default" else {**base, **variant_options(variant)}


def time_variants(art: Path, component: str, variants: list[str]) -> dict[str, Any]:
    from diffusion_trt.artifact import folder as artifacts
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine

    entry = artifacts.load_verified(art, check_hashes=False)["components"][component]
    feeds = feeds_for(entry)
    out: dict[str, Any] = {"shape": {t["name"]: t["opt"] for t in entry["inputs"]}}
    for var in variants:
        opts = options_for(component, var)
        try:
            with OrtEngine(art / entry["onnx"], entry, name=component, device="cuda", provider_options=opts) as eng:
                out[var] = {"ms": round(median_ms(lambda e=eng: e.run(feeds), warmup=5, iters=20), 3),
                            "options": opts}
        except Exception as e:  # noqa: BLE001 - a variant ORT refuses is a result too
            out[var] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "options": opts}
        print(f"{component} {var}: {out[var].get('ms', out[var].get('error'))}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--components", default="unet,vae_decoder")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    variants = args.variants.split(",")
    result: dict[str, Any] = {"artifact": str(args.artifact), "variants": variants}
    for comp in args.components.split(","):
        timed = time_variants(args.artifact, comp, variants)
        ok = {v: r["ms"] for v, r in timed.items() if isinstance(r, dict) and "ms" in r}
        best = min(ok, key=ok.get) if ok else None
        profiles = {}
        for var in dict.fromkeys(["default", best]):
            if var is None:
                continue
            try:
                # without the CUDA graph, as the earlier profiles (results/*kernel-profile*)
                no_graph = {k: v for k, v in options_for(comp, var).items() if k != "enable_cuda_graph"}
                profiles[var] = profile_component(args.artifact, comp, no_graph, 5, args.top)
            except Exception as e:  # noqa: BLE001
                profiles[var] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            p = profiles[var]
            print(f"== {comp} [{var}] kernels {p.get('kernel_ms_per_run', float('nan')):.3f} ms/run", flush=True)
            for row in p.get("top", []):
                print(f"   {row['us']:9.1f} us x{row['count']:5.1f} [{row['category']}] {row['name'][:100]}")
        result[comp] = {"timed": timed, "best": best, "profiles": profiles}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()

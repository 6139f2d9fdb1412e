"""What a component's first run costs under each CUDA provider option (issue 28): session, first run, warm run.

    python benchmarks/first_run_options.py ARTIFACT --components unet,vae_decoder [--latents 64x64,96x96]
        [--variants default,no_fuse_bias,sdpa_math,nchw] [--cudnn HEURISTIC] --json OUT.json

Why: on the H200 (s12) the SD-1.5 VAE decoder's first run took 1.37 s with HEURISTIC and 1.44 s with EXHAUSTIVE, so
the cuDNN search is not what it pays for; a dynamic VAE's first run at a new size took 2.4..5.1 s. The suspects are
options whose kernels cuDNN compiles at run time, per shape: ``fuse_conv_bias`` (a runtime-fusion Conv + bias
epilogue), ``sdpa_kernel=8`` (cuDNN's flash attention, a compiled graph) and ``prefer_nhwc``. Each (component,
variant) runs in a fresh process (nothing compiled is kept in the process), the OS page cache warm: the session
(``OrtEngine`` with the runtime's options, no CUDA graph, so each run is a plain run), then per latent size in
``--latents`` (the artifact's own size when static): the first run, a second run, and the median of 10 warm runs.

Variants (merged over the runtime's options for that component, :func:`cuda_layout_options`):
``default`` (none), ``no_fuse_bias`` (fuse_conv_bias=0), ``sdpa_math`` (sdpa_kernel=16: ORT's unfused attention),
``sdpa_flash`` (sdpa_kernel=1: ORT's own flash kernels), ``nchw`` (prefer_nhwc=0), ``plain`` (all three off).
A benchmark for a GPU host, not a test. Seconds unless named ``_ms``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "no_fuse_bias": {"fuse_conv_bias": "0"},
    "sdpa_math": {"sdpa_kernel": "16"},
    "sdpa_flash": {"sdpa_kernel": "1"},
    "nchw": {"prefer_nhwc": "0"},
    "plain": {"fuse_conv_bias": "0", "sdpa_kernel": "16", "prefer_nhwc": "0"},
}


def _feeds(engine, latent: tuple[int, int] | None):
    """Zeros at the spec's min shape, with the latent's h/w (and 8x for an image input) when given."""
    import torch

    feeds = {}
    for info in engine.spec.inputs:
        shape = list(info.min)
        if latent is not None and len(shape) == 4:
            scale = 8 if shape[1] == 3 else 1
            shape[2], shape[3] = latent[0] * scale, latent[1] * scale
        feeds[info.name] = torch.zeros(tuple(shape), dtype=info.torch_dtype, device=engine.device)
    return feeds


def _run(engine, feeds) -> float:
    import torch

    t = time.perf_counter()
    engine.run(feeds)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def one(art: str, component: str, variant: str, latents: list[tuple[int, int]] | None, cudnn: str) -> dict:
    """One (component, variant) in this process."""
    import torch

    from diffusion_trt.artifact.reader import ArtifactReader
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine
    from diffusion_trt.runtime.pipeline import cuda_layout_options

    torch.zeros(1, device="cuda")
    entry = ArtifactReader.open(art).manifest.components[component]
    options = {**cuda_layout_options(component, "cuda"), **VARIANTS[variant]}
    engine = OrtEngine(art + "/" + entry.onnx, entry.spec, name=component, device="cuda",
                       cudnn_conv_algo_search=cudnn, provider_options=options, cuda_graph=False)
    t = time.perf_counter()
    engine.__enter__()
    row: dict = {"component": component, "variant": variant, "options": options,
                 "session_s": time.perf_counter() - t, "sizes": []}
    for latent in latents or [None]:
        feeds = _feeds(engine, latent)
        size = {"latent": list(latent) if latent else None, "first_run_s": _run(engine, feeds),
                "second_run_s": _run(engine, feeds)}
        size["warm_ms"] = statistics.median(_run(engine, feeds) * 1e3 for _ in range(10))
        row["sizes"].append(size)
    engine.__exit__(None, None, None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--components", default="unet,vae_decoder")
    ap.add_argument("--variants", default="default,no_fuse_bias,sdpa_math,nchw")
    ap.add_argument("--latents", default="", help="latent sizes HxW for a dynamic artifact, e.g. 64x64,96x96")
    ap.add_argument("--cudnn", default="HEURISTIC")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # component:variant, in the child process
    ns = ap.parse_args()
    latents = [tuple(int(v) for v in s.split("x")) for s in ns.latents.split(",") if s] or None
    if ns.one:
        component, variant = ns.one.split(":")
        print(json.dumps(one(ns.artifact, component, variant, latents, ns.cudnn)), flush=True)
        return
    rows = []
    for component in ns.components.split(","):
        for variant in ns.variants.split(","):
            args = [sys.executable, __file__, ns.artifact, "--one", f"{component}:{variant}", "--cudnn", ns.cudnn,
                    "--latents", ns.latents]
            t = time.perf_counter()
            proc = subprocess.run(args, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if proc.returncode != 0:
                rows.append({"component": component, "variant": variant, "rc": proc.returncode,
                             "error": proc.stderr.strip().splitlines()[-1:] or [""]})
                print(component, variant, "failed:", rows[-1]["error"], flush=True)
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["process_wall_s"] = wall
            rows.append(row)
            sizes = "; ".join(f"{s['latent']}: first {s['first_run_s']:.3f} s, second {s['second_run_s']:.3f} s, "
                              f"warm {s['warm_ms']:.2f} ms" for s in row["sizes"])
            print(f"{component:12s} {variant:13s} session {row['session_s']:.2f} s; {sizes}", flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"artifact": ns.artifact, "cudnn": ns.cudnn, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

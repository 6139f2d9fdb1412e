#!/usr/bin/env bash
# Determinism on one nvidia-h200 (issue 19; first run in the sixth session), one call after the wheels are installed:
#   bash benchmarks/gpu_determinism.sh "$OUT"   (or: bash benchmarks/gpu_run.sh OUT determinism)
# 1. benchmarks/norm_probe.py: one GroupNorm site fused vs unfused, run-to-run identity and time;
# 2. the tiny pipeline compiled for ORT CUDA fp16 without and with --deterministic: two identical calls each
#    (same seed, deterministic=True at run time), max abs difference of the images, and the UNet step time.
set -u
out=${1:?OUT folder}
python3 benchmarks/norm_probe.py --json "$out/norm_probe.json" > "$out/norm_probe.log" 2>&1
D="python3 -m diffusion_trt.cli"
$D dummy-pipeline --arch tiny --overwrite /tmp/s6m/tiny > "$out/tiny.log" 2>&1
for det in 0 1; do
  flag=$([ "$det" = 1 ] && echo --deterministic)
  $D compile /tmp/s6m/tiny -o "/tmp/s6a$det" --device cuda --precision fp16 --no-cache --overwrite $flag >> "$out/tiny.log" 2>&1
done
python3 - "$out/tiny_e2e.json" >> "$out/tiny.log" 2>&1 <<'PY'
import json, sys, time
import numpy as np, torch
from diffusion_trt import EnginePipeline

res = {}
for det in (0, 1):
    pipe = EnginePipeline.from_artifacts(f"/tmp/s6a{det}", deterministic=True)
    images, times = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        out = pipe(prompt="an ink painting of a mountain", num_inference_steps=20, guidance_scale=7.5,
                   generator=torch.Generator().manual_seed(0), output_type="np", progress=False)
        times.append(time.perf_counter() - t0)
        images.append(np.asarray(out.images, dtype=np.float32))
    diffs = [float(np.abs(im - images[0]).max()) for im in images[1:]]
    res["deterministic_compile" if det else "default_compile"] = {"max_abs_vs_first": diffs, "call_s": times}
    print(det, res, flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=2)
PY
ls -la "$out"

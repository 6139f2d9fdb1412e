#!/usr/bin/env bash
# The GPU host's run for the runtime issue (5): gpu-marked runtime tests, static fp16 SD-1.5 artifacts at batch
# 1 and batch 4, then `diffusion-trt bench` against diffusers (eager fp16 SDPA and a CUDA-graphed UNet).
#   bash benchmarks/gpu_runtime.sh RESULTS_DIR            # nvidia-h200: tests, compiles, bench b1 and b4
#   MULTI=1 bash benchmarks/gpu_runtime.sh RESULTS_DIR    # nvidia-h200-x2: adds batch 8 over --devices 0,1
# Expects onnxruntime-gpu + diffusers importable (shared/gpu-wheels/install.sh; export PYTHONPATH=/tmp/site).
set -u
res=${1:-/tmp/results}; mkdir -p "$res"
export PYTHONUNBUFFERED=1
py=python3
step() { echo "=== $(date +%T) $*"; }
static512=(--device cuda --precision fp16 --height 512 --width 512 --min-height 512 --max-height 512
           --min-width 512 --max-width 512 --overwrite)
step "gpu runtime tests"; $py -m pytest -q -m gpu tests/runtime -p no:cacheprovider 2>&1 | tail -25
[ -d /tmp/sd15 ] || { step "sd15 dummy"; $py -m diffusion_trt.cli dummy-pipeline --arch sd15 /tmp/sd15; }
[ -d /tmp/art_static ] || { step "compile static b1"; $py -m diffusion_trt.cli compile /tmp/sd15 -o /tmp/art_static \
  "${static512[@]}" --batch-size 1 --max-batch-size 1 2>&1 | grep -v -E "it/s|stage/s"; }
[ -d /tmp/art_static_b4 ] || { step "compile static b4"; $py -m diffusion_trt.cli compile /tmp/sd15 \
  -o /tmp/art_static_b4 "${static512[@]}" --batch-size 4 --min-batch-size 4 --max-batch-size 4 2>&1 \
  | grep -v -E "it/s|stage/s"; }
step "bench b1"; $py -m diffusion_trt.cli bench /tmp/art_static --batch-size 1 --steps 50 --iters 5 \
  --json "$res/bench_b1.json" --plot "$res/bench_b1.png"
step "bench b4"; $py -m diffusion_trt.cli bench /tmp/art_static_b4 --batch-size 4 --steps 50 --iters 5 \
  --json "$res/bench_b4.json" --plot "$res/bench_b4.png"
if [ "${MULTI:-0}" = 1 ]; then
  step "bench b8 on two GPUs"; $py -m diffusion_trt.cli bench /tmp/art_static_b4 --batch-size 8 --steps 50 \
    --iters 5 --devices 0,1 --baseline none --json "$res/bench_b8_2gpu.json" --plot "$res/bench_b8_2gpu.png"
fi
step "done"

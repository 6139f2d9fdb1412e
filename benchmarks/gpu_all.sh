#!/usr/bin/env bash
# One GPU-host run for the passes (3) and runtime (5) issues, on nvidia-h200-x2 (or nvidia-h200 with MULTI=0):
# gpu-marked tests, sd15 dummy, static fp16 512x512 artifacts at batch 1 and batch 4 (the batch-4 compile runs on
# GPU 1 while GPU 0 is timed), per-component timings with provider-option variants, diffusers eager and ORT's own
# optimizer (numpy-1 child process, NP1=folder), the kernel profile, then `bench` at batch 1, 4 and 8 over 2 GPUs.
#   NP1=/tmp/np1 MULTI=1 bash benchmarks/gpu_all.sh RESULTS_DIR
set -u
res=${1:-/tmp/results}; mkdir -p "$res"
export PYTHONUNBUFFERED=1
py=python3
step() { echo "=== $(date +%T) $*"; }
quiet() { grep -v -E "it/s|stage/s|Warning"; }
static512=(--device cuda --precision fp16 --height 512 --width 512 --min-height 512 --max-height 512
           --min-width 512 --max-width 512 --overwrite)
step "gpu tests"; $py -m pytest -q -m gpu tests/passes tests/runtime -p no:cacheprovider 2>&1 | tail -15
[ -d /tmp/sd15 ] || { step "sd15 dummy"; $py -m diffusion_trt.cli dummy-pipeline --arch sd15 /tmp/sd15 2>&1 | tail -1; }
gpu_b4=0; [ "${MULTI:-0}" = 1 ] && gpu_b4=1
( CUDA_VISIBLE_DEVICES=$gpu_b4 $py -m diffusion_trt.cli compile /tmp/sd15 -o /tmp/art_static_b4 "${static512[@]}" \
    --batch-size 4 --min-batch-size 4 --max-batch-size 4 > /tmp/compile_b4.log 2>&1; echo "b4 compile rc=$?" ) &
b4_pid=$!
step "compile static b1"; $py -m diffusion_trt.cli compile /tmp/sd15 -o /tmp/art_static "${static512[@]}" \
  --batch-size 1 --max-batch-size 1 2>&1 | quiet | tail -8
cp /tmp/art_static/manifest.json "$res/manifest_static.json"
step "components"; $py benchmarks/components.py /tmp/sd15 --artifact static=/tmp/art_static --iters 20 \
  --variants "cuda_graph+nhwc,cuda_graph+nhwc+fuse_conv_bias=1,nhwc,cuda_graph" --ort-optimizer-baseline \
  ${NP1:+--numpy1 $NP1} --json "$res/components.json" 2>&1 | quiet | grep -v '^ *"' | tail -30
step "kernel profile"; $py benchmarks/profile_kernels.py /tmp/art_static --options prefer_nhwc=1 --top 15 \
  --json "$res/profile.json" 2>&1 | quiet | grep -E "^==|^   [a-z]" 
step "bench b1"; $py -m diffusion_trt.cli bench /tmp/art_static --batch-size 1 --steps 50 --iters 5 \
  --json "$res/bench_b1.json" 2>&1 | quiet | tail -25
step "wait for the b4 compile"; wait $b4_pid; grep -E "compiled|Error|error" /tmp/compile_b4.log | tail -3
step "bench b4"; $py -m diffusion_trt.cli bench /tmp/art_static_b4 --batch-size 4 --steps 50 --iters 3 \
  --json "$res/bench_b4.json" 2>&1 | quiet | tail -25
if [ "${MULTI:-0}" = 1 ]; then
  step "bench b8 on two GPUs"; $py -m diffusion_trt.cli bench /tmp/art_static_b4 --batch-size 8 --steps 50 \
    --iters 3 --devices 0,1 --baseline none --json "$res/bench_b8_2gpu.json" 2>&1 | quiet | tail -25
fi
step "done"

#!/usr/bin/env bash
# merge_conv_biases on vs off, on one nvidia-h200 (issues 3 and 5; first run in the third session): the gpu-marked
# pass tests (CUDA parity of the new rewrites), sd15 static fp16 512x512 batch-1 artifacts with and without
# merge_conv_biases (A/B in one process), component timings next to diffusers eager, a kernel profile of the UNet,
# `bench` at batch 1 (PNDM with the diffusers baselines, DDIM without), and last ORT's own optimizer (numpy-1 child
# process, NP1=folder).
#   NP1=/tmp/np1 bash benchmarks/gpu_conv_bias_merge.sh RESULTS_DIR  (or: bash benchmarks/gpu_run.sh OUT conv-bias-merge)
set -u
res=${1:-/tmp/results}; mkdir -p "$res"
export PYTHONUNBUFFERED=1
py=python3
step() { echo "=== $(date +%T) $*"; }
quiet() { grep -v -E "it/s|stage/s|Warning|warn\(|W:onnxruntime"; }
static512=(--device cuda --precision fp16 --height 512 --width 512 --min-height 512 --max-height 512
           --min-width 512 --max-width 512 --batch-size 1 --max-batch-size 1 --overwrite)
step "gpu pass tests"; $py -m pytest -q -m gpu tests/passes -p no:cacheprovider 2>&1 | tail -4
[ -d /tmp/sd15 ] || { step "sd15 dummy"; $py -m diffusion_trt.cli dummy-pipeline --arch sd15 /tmp/sd15 2>&1 | tail -1; }
step "compiles: static b1 (default) and static b1 with merge_conv_biases off, in parallel"
$py -m diffusion_trt.cli compile /tmp/sd15 -o /tmp/art_nomerge "${static512[@]}" \
  --pass-option merge_conv_biases=false > /tmp/compile_nomerge.log 2>&1 &
nm_pid=$!
$py -m diffusion_trt.cli compile /tmp/sd15 -o /tmp/art_static "${static512[@]}" 2>&1 | quiet | grep -E "unet|compiled"
cp /tmp/art_static/manifest.json "$res/manifest_static.json"
wait $nm_pid; echo "nomerge compile rc=$?"
step "components"; $py benchmarks/components.py /tmp/sd15 --artifact static=/tmp/art_static \
  --artifact nomerge=/tmp/art_nomerge --iters 30 \
  --variants "cuda_graph+nhwc+sdpa_kernel=8,cuda_graph+nhwc+sdpa_kernel=8+fuse_conv_bias=1" \
  --json "$res/components.json" 2>&1 | quiet | grep -E "^(unet|vae|text)" | head -20
step "bench b1 (pndm, with diffusers)"; $py -m diffusion_trt.cli bench /tmp/art_static --batch-size 1 --steps 50 \
  --iters 5 --json "$res/bench_b1.json" 2>&1 | quiet | grep -A12 "^system"
step "bench b1 (ddim)"; $py -m diffusion_trt.cli bench /tmp/art_static --batch-size 1 --steps 50 --iters 5 \
  --baseline none --scheduler ddim --json "$res/bench_b1_ddim.json" 2>&1 | quiet | grep -A3 "^system"
step "kernel profile unet"; $py benchmarks/profile_kernels.py /tmp/art_static --component unet \
  --options prefer_nhwc=1,sdpa_kernel=8 --top 80 --json "$res/profile_unet.json" 2>&1 | quiet | grep -E "^==|ms  \("
if [ -n "${NP1:-}" ]; then
  step "ORT optimizer baseline (numpy 1)"; $py benchmarks/components.py /tmp/sd15 --artifact static=/tmp/art_static \
    --variants cuda_graph+nhwc+sdpa_kernel=8 --iters 30 --ort-optimizer-baseline --numpy1 "$NP1" \
    --json "$res/components_ortopt.json" 2>&1 | quiet | grep -E "^(unet|vae|text)|\"ort_optimizer/unet" | head -12
fi
step "done"

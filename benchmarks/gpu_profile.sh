#!/usr/bin/env bash
# The GPU host's profiling run for the passes issue (3): sd15 dummy, a static fp16 512x512 batch-1 artifact, the
# kernel profile of each component (benchmarks/profile_kernels.py), a sweep of ORT CUDA provider options on the
# timings (benchmarks/components.py), then ORT's own transformers optimizer as a baseline in a numpy-1 process
# (ORT 1.31.1's UNet fusion crashes under numpy 2; NP1 names a folder holding numpy 1.26).
#   NP1=/tmp/np1 bash benchmarks/gpu_profile.sh RESULTS_DIR
set -u
res=${1:-/tmp/results}; mkdir -p "$res"
export PYTHONUNBUFFERED=1
py=python3
step() { echo "=== $(date +%T) $*"; }
[ -d /tmp/sd15 ] || { step "sd15 dummy"; $py -m diffusion_trt.cli dummy-pipeline --arch sd15 /tmp/sd15 2>&1 | tail -2; }
[ -d /tmp/art_static ] || { step "compile static b1"; $py -m diffusion_trt.cli compile /tmp/sd15 -o /tmp/art_static \
  --device cuda --precision fp16 --height 512 --width 512 --min-height 512 --max-height 512 --min-width 512 \
  --max-width 512 --batch-size 1 --max-batch-size 1 --overwrite 2>&1 | grep -v -E "it/s|stage/s"; }
cp /tmp/art_static/manifest.json "$res/manifest_static.json"
step "kernel profile (prefer_nhwc)"; $py benchmarks/profile_kernels.py /tmp/art_static --options prefer_nhwc=1 \
  --json "$res/profile_nhwc.json" 2>&1 | grep -v Warning
step "kernel profile unet (plain)"; $py benchmarks/profile_kernels.py /tmp/art_static --component unet --options "" \
  --top 12 --json "$res/profile_plain_unet.json" 2>&1 | grep -v Warning
step "provider sweep"; $py benchmarks/components.py /tmp/sd15 --artifact static=/tmp/art_static --iters 20 \
  --variants "cuda_graph+nhwc,cuda_graph+nhwc+sdpa_kernel=8,cuda_graph+nhwc+sdpa_kernel=1,cuda_graph+nhwc+sdpa_kernel=2,cuda_graph+nhwc+tunable_op_enable=1+tunable_op_tuning_enable=1,nhwc" \
  --json "$res/components_sweep.json" 2>&1 | grep -v -E "it/s|Warning" | tail -60
if [ -n "${NP1:-}" ]; then
  step "ORT optimizer baseline (numpy 1)"; PYTHONPATH=$NP1:$PYTHONPATH $py benchmarks/components.py /tmp/sd15 \
    --artifact static=/tmp/art_static --variants cuda_graph+nhwc --iters 20 --ort-optimizer-baseline \
    --json "$res/components_ortopt.json" 2>&1 | grep -v -E "it/s|Warning" | tail -40
fi
step "done"

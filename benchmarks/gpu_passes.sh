#!/usr/bin/env bash
# The GPU host's run for the passes issue: gpu-marked tests, sd15 dummy, two fp16 CUDA compiles (dynamic and
# static 512x512 batch 1), per-component timings with baselines, and the end-to-end comparison.
#   bash benchmarks/gpu_passes.sh RESULTS_DIR
set -u
res=${1:-/tmp/results}; mkdir -p "$res"
export PYTHONUNBUFFERED=1
py=python3
step() { echo "=== $(date +%T) $*"; }
step "gpu tests"; $py -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tail -25
[ -d /tmp/sd15 ] || { step "sd15 dummy"; $py -m diffusion_trt.cli dummy-pipeline --arch sd15 /tmp/sd15; }
step "compile dynamic"; $py -m diffusion_trt.cli compile /tmp/sd15 -o /tmp/art_dyn --device cuda --precision fp16 --overwrite 2>&1 | grep -v -E "it/s|stage/s"
step "compile static"; $py -m diffusion_trt.cli compile /tmp/sd15 -o /tmp/art_static --device cuda --precision fp16 \
  --height 512 --width 512 --min-height 512 --max-height 512 --min-width 512 --max-width 512 --max-batch-size 1 \
  --overwrite 2>&1 | grep -v -E "it/s|stage/s"
cp /tmp/art_dyn/manifest.json "$res/manifest_dyn.json"; cp /tmp/art_static/manifest.json "$res/manifest_static.json"
step "components"; $py benchmarks/components.py /tmp/sd15 --artifact dyn=/tmp/art_dyn --artifact static=/tmp/art_static \
  --ort-optimizer-baseline --json "$res/components.json" 2>&1 | grep -v -E "it/s"
step "e2e"; $py benchmarks/e2e_vs_diffusers.py /tmp/sd15 /tmp/art_dyn --steps 50 --json "$res/e2e.json" 2>&1 | tail -22
step "done"

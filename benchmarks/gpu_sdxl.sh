#!/usr/bin/env bash
# The GPU host's run for SDXL (issue 8 part A), on nvidia-h200: the true SDXL-base architecture with seeded random
# weights, compiled ORT CUDA fp16, static 1024x1024, batch 1 (VAE fp32: SDXL's VAE overflows in fp16), then
# benchmarks/sdxl_e2e.py: 30 steps at 1024x1024, 2 timed images each for our EnginePipeline and diffusers'
# StableDiffusionXLPipeline eager fp16 (its VAE upcast as diffusers does), latents checked finite every step.
#   bash benchmarks/gpu_sdxl.sh RESULTS_DIR
# Each stage is skipped when its output exists (/tmp/sdxl, /tmp/art_sdxl), so a run cut short resumes where it
# stopped. Expects onnxruntime-gpu + diffusers importable (shared/gpu-wheels/install.sh; export PYTHONPATH=/tmp/site).
# IMAGES=1 STEPS=30 override the benchmark's timed images and steps.
set -u
res=${1:-/tmp/results}; mkdir -p "$res"
export PYTHONUNBUFFERED=1
py=python3
step() { echo "=== $(date +%T) $*"; }
quiet() { grep -v -E "it/s|stage/s|Warning|warn\("; }
static1024=(--device cuda --precision fp16 --height 1024 --width 1024 --min-height 1024 --max-height 1024
            --min-width 1024 --max-width 1024 --batch-size 1 --max-batch-size 1)
[ -d /tmp/sdxl ] || { step "sdxl dummy (~14 GB of fp32 safetensors)"
  $py -m diffusion_trt.cli dummy-pipeline --arch sdxl /tmp/sdxl 2>&1 | quiet | tail -2; }
[ -f /tmp/art_sdxl/manifest.json ] || { step "compile sdxl fp16 static 1024"
  $py -m diffusion_trt.cli compile /tmp/sdxl -o /tmp/art_sdxl "${static1024[@]}" --overwrite 2>&1 | quiet | tail -12; }
cp /tmp/art_sdxl/manifest.json "$res/manifest_sdxl.json" 2>/dev/null
$py -m diffusion_trt.cli inspect /tmp/art_sdxl 2>&1 | head -30
step "e2e sdxl vs diffusers"; $py benchmarks/sdxl_e2e.py /tmp/sdxl /tmp/art_sdxl --device cuda \
  --steps "${STEPS:-30}" --images "${IMAGES:-2}" --json "$res/sdxl_e2e.json" 2>&1 | quiet | tail -60
echo "sdxl_e2e rc=${PIPESTATUS[0]}"
step "done"

#!/usr/bin/env bash
# Issue 18 (VRAM budget) on the GPU host, one bounded step per invocation (see benchmarks/gpu_vram.py):
#   bash benchmarks/gpu_vram.sh build sd15 ; bash benchmarks/gpu_vram.sh measure sd15 4GB ; bash benchmarks/gpu_vram.sh vae sd15
#   bash benchmarks/gpu_vram.sh build sdxl ; bash benchmarks/gpu_vram.sh measure sdxl 8GB facts,unbounded
#   bash benchmarks/gpu_vram.sh measure sdxl 8GB budget
# The steps share /tmp (models, artifacts, recorded memory facts): run them on one warm machine, in this order; a
# step whose inputs exist skips building them. JSON goes to $OUT (default /tmp/out). Expects onnxruntime-gpu and
# diffusers importable (shared/gpu-wheels/install.sh; PYTHONPATH=/tmp/site), as benchmarks/gpu_sdxl.sh.
set -u
export PYTHONPATH="/tmp/site:${PWD}${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OUT="${OUT:-/tmp/out}"
echo "=== $(date +%T) gpu_vram $*"
python3 benchmarks/gpu_vram.py "$@" 2>&1 | grep -v -E "it/s\]|stage/s\]"
echo "=== $(date +%T) done rc=${PIPESTATUS[0]}"

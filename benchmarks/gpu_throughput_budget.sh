#!/usr/bin/env bash
# Batch throughput and VRAM budgets on one nvidia-h200 (first run in the fifth session), in two back-to-back
# invocations (/tmp survives between them only while the host is warm):
#   PHASE=A bash benchmarks/gpu_throughput_budget.sh "$OUT"  # builds, batch-4 throughput (issue 19), CFG-8 kernel
#                                                            # sweep, tiled 1024x1024 VAE decode (issue 18)
#   PHASE=B bash benchmarks/gpu_throughput_budget.sh "$OUT"  # SDXL 1024 unbounded vs --vram-budget 8GB, SD-1.5 4GB
#                                                            # with the estimates alone, batch-1 static regression
# (or: bash benchmarks/gpu_run.sh OUT throughput vram-budget)
# SD-1.5 / SDXL architectures with seeded random weights, fp16, ORT CUDA. Every step is bounded (benchmarks/gpu_lib.sh)
# and recorded in steps.jsonl; a failed step costs only itself. Expects onnxruntime-gpu + diffusers importable
# (shared/gpu-wheels install.sh; PYTHONPATH=/tmp/site:$PWD).
set -u
res=${1:-${OUT:-/tmp/results}}; mkdir -p "$res"
budget=${BUDGET_S:-560}; start=$(date +%s)
export PYTHONUNBUFFERED=1 OUT="$res"
py=python3; nsteps=50
export res py nsteps
# shellcheck source=benchmarks/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
exec > >(tee -a "$res/gpu_throughput_budget_${PHASE:-A}.log") 2>&1
cli=("$py" -m diffusion_trt.cli)
static() { echo "--height $1 --width $1 --min-height $1 --max-height $1 --min-width $1 --max-width $1 --batch-size $2 --min-batch-size $2 --max-batch-size $2"; }

phase_a() {
  step env 5 20 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c 'import torch, onnxruntime as o, diffusers; print(torch.__version__, o.__version__, diffusers.__version__)'"
  # SDXL in the background: dummy (~50 s) then compile (~5 min), for phase B
  ( [ -d /tmp/sdxl ] || "${cli[@]}" dummy-pipeline --arch sdxl /tmp/sdxl > "$res/sdxl_dummy.log" 2>&1
    # shellcheck disable=SC2046
    "${cli[@]}" compile /tmp/sdxl -o /tmp/sdxl-art --device cuda --precision fp16 $(static 1024 1) --overwrite \
      > "$res/compile_sdxl.log" 2>&1; echo "sdxl compile rc=$?" >> "$res/compile_sdxl.log" ) &
  sdxl_pid=$!
  [ -d /tmp/sd15 ] || step dummy_sd15 30 150 "${cli[@]}" dummy-pipeline --arch sd15 /tmp/sd15
  local -A pids=()
  local common=(--device cuda --precision fp16 --overwrite --components text_encoder,unet,vae_decoder)
  # shellcheck disable=SC2046
  "${cli[@]}" compile /tmp/sd15 -o /tmp/sd15-art "${common[@]}" $(static 512 1) > "$res/compile_s512b1.log" 2>&1 & pids[s512b1]=$!
  # shellcheck disable=SC2046
  "${cli[@]}" compile /tmp/sd15 -o /tmp/art_s512b4 "${common[@]}" $(static 512 4) > "$res/compile_s512b4.log" 2>&1 & pids[s512b4]=$!
  "${cli[@]}" compile /tmp/sd15 -o /tmp/art_dyn "${common[@]}" --height 512 --width 512 --min-height 256 \
    --max-height 1024 --min-width 256 --max-width 1024 --batch-size 1 --min-batch-size 1 --max-batch-size 4 \
    > "$res/compile_dyn.log" 2>&1 & pids[dyn]=$!
  for n in s512b4 s512b1 dyn; do wait "${pids[$n]}"; echo "compile $n rc=$?: $(tail -1 "$res/compile_$n.log")"; done
  step bench_b4_static 60 170 bash -c "bench b4_static /tmp/art_s512b4 --model-dir /tmp/sd15 --batch-size 4 --iters 2 --stage-iters 10"
  step batch_sweep 60 150 bash -o pipefail -c "$py benchmarks/batch_sweep.py /tmp/art_s512b4 --json $res/batch_sweep.json 2>&1 | quiet | tail -60"
  step vae_tiled_1024 40 120 bash -o pipefail -c "$py benchmarks/gpu_vram.py vae sd15 2>&1 | quiet | tail -40"
  step bench_b4_dyn 60 150 bash -c "bench b4_dyn /tmp/art_dyn --baseline none --batch-size 4 --sizes 512x512,768x768,640x384 --size-buckets auto --iters 2 --stage-iters 5"
  echo "=== waiting for the SDXL compile"; wait "$sdxl_pid"; tail -3 "$res/compile_sdxl.log"
  cp /tmp/art_s512b4/manifest.json "$res/manifest_s512b4.json" 2>/dev/null || true
}

phase_b() {
  step sdxl_facts_unbounded 100 300 bash -o pipefail -c "$py benchmarks/gpu_vram.py measure sdxl 8GB facts,unbounded 2>&1 | quiet | tail -30"
  step sdxl_budget_8gb 80 240 bash -o pipefail -c "$py benchmarks/gpu_vram.py measure sdxl 8GB budget 2>&1 | quiet | tail -30"
  step sd15_4gb_estimates 60 150 bash -o pipefail -c "$py benchmarks/gpu_vram.py measure sd15 4GB unbounded,budget 2>&1 | quiet | tail -30"
  step bench_b1_static 30 90 bash -c "bench b1_static /tmp/sd15-art --baseline none --iters 3"
}

if [ "${PHASE:-A}" = A ]; then phase_a; else phase_b; fi
$py -c "
import json, sys; from pathlib import Path
res = Path('$res'); rows = [json.loads(l) for l in (res / 'steps.jsonl').read_text().splitlines() if l.strip()]
print(json.dumps(rows, indent=1))" || true
echo "=== phase ${PHASE:-A} done in $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# The one GPU runner: named phases, each what one benchmarks/gpu_*.sh script measures, run in the order given.
#   bash benchmarks/gpu_run.sh OUT PHASE [PHASE ...]     e.g.  bash benchmarks/gpu_run.sh "$OUT" tests runtime sdxl
#   bash benchmarks/gpu_run.sh --list                     the phases and what each measures
# PHASE is NAME or NAME:ARG[:ARG...]; the ARGs go to the phase's script (vram:measure:sd15:4GB runs
# `gpu_vram.sh measure sd15 4GB`, cold-start:compile-b1 runs `gpu_cold_start.sh compile-b1 OUT/cold-start`).
# Each phase writes into OUT/NAME (phases of one NAME share it: later ones read what earlier ones wrote) and logs
# to OUT/PHASE.log (":" -> "_"); a failed phase costs only itself. OUT/phases.jsonl records each phase's exit status
# and seconds; the runner exits 1 when a phase failed, 2 on a wrong argument (before anything runs). DRY=1 prints
# each phase's command instead of running it. The scripts' own knobs (NP1, MULTI, BUDGET_S, STEPS, IMAGES, BEFORE, ...)
# pass through the environment; set the host up first as they expect (onnxruntime-gpu and diffusers importable,
# e.g. PYTHONPATH=/tmp/site:$PWD). Runs from the repository root wherever it is called from.
set -u
cd "$(dirname "$0")/.." || exit 2
PHASES=(tests passes profile runtime static-fp16 attention-qkv conv-bias-merge dynamic sdxl throughput vram-budget
        vram determinism cold-start)

describe() {  # what phase $1 measures (and its script)
  case $1 in
    tests) echo "the gpu-marked tests (pytest -m gpu tests)" ;;
    passes) echo "gpu_passes.sh: gpu tests, dynamic and static sd15 fp16 compiles, components vs baselines, e2e vs diffusers" ;;
    profile) echo "gpu_profile.sh: kernel profile per component, ORT CUDA provider-option sweep, ORT optimizer (NP1)" ;;
    runtime) echo "gpu_runtime.sh: gpu runtime tests, static sd15 b1/b4, bench vs diffusers (MULTI=1: b8 on 2 GPUs)" ;;
    static-fp16) echo "gpu_all.sh: static sd15 fp16 b1/b4, components x provider variants, kernel profile, bench b1/b4/b8" ;;
    attention-qkv) echo "gpu_attention_qkv.sh: packed vs unpacked Q/K/V x ORT attention backends, bench b1/b4/b8, SDXL on GPU 1" ;;
    conv-bias-merge) echo "gpu_conv_bias_merge.sh: merge_conv_biases on vs off, bench b1 pndm/ddim, UNet kernel profile" ;;
    dynamic) echo "gpu_dynamic.sh: dynamic profile vs static, size buckets, cuDNN EXHAUSTIVE vs HEURISTIC, determinism" ;;
    sdxl) echo "gpu_sdxl.sh: SDXL fp16 static 1024 vs diffusers' StableDiffusionXLPipeline" ;;
    throughput) echo "gpu_throughput_budget.sh PHASE=A: batch-4 throughput, batch sweep, tiled 1024 VAE, size buckets" ;;
    vram-budget) echo "gpu_throughput_budget.sh PHASE=B: SDXL 1024 vs --vram-budget 8GB, SD-1.5 4GB from estimates" ;;
    vram) echo "gpu_vram.sh STEP ARCH [BUDGET] [WHAT]: engine memory facts, per-stage peaks, tiled VAE (vram:build:sd15)" ;;
    determinism) echo "gpu_determinism.sh: GroupNorm fused vs unfused probe, --deterministic compile run-to-run identity" ;;
    cold-start) echo "gpu_cold_start.sh compile-b1|cold|compile-b4|prep|models|compiles|bytecode|readhash|cold-base|offline|controlnet|lora: compile peak RSS, cold start, import and read+hash times, bench, ORT offline optimisation, ControlNet and LoRA costs (cold-start:cold)" ;;
    *) return 1 ;;
  esac
}

command_of() {  # the command of phase NAME with DIR and ARGS, one word a line
  local name=$1 dir=$2; shift 2
  case $name in
    tests) printf '%s\n' python3 -m pytest -q -m gpu tests -p no:cacheprovider ;;
    passes) printf '%s\n' bash benchmarks/gpu_passes.sh "$dir" ;;
    profile) printf '%s\n' bash benchmarks/gpu_profile.sh "$dir" ;;
    runtime) printf '%s\n' bash benchmarks/gpu_runtime.sh "$dir" ;;
    static-fp16) printf '%s\n' bash benchmarks/gpu_all.sh "$dir" ;;
    attention-qkv) printf '%s\n' bash benchmarks/gpu_attention_qkv.sh "$dir" ;;
    conv-bias-merge) printf '%s\n' bash benchmarks/gpu_conv_bias_merge.sh "$dir" ;;
    dynamic) printf '%s\n' bash benchmarks/gpu_dynamic.sh "$dir" ;;
    sdxl) printf '%s\n' bash benchmarks/gpu_sdxl.sh "$dir" ;;
    throughput) printf '%s\n' env PHASE=A bash benchmarks/gpu_throughput_budget.sh "$dir" ;;
    vram-budget) printf '%s\n' env PHASE=B bash benchmarks/gpu_throughput_budget.sh "$dir" ;;
    vram) printf '%s\n' env "OUT=$dir" bash benchmarks/gpu_vram.sh "$@" ;;
    determinism) printf '%s\n' bash benchmarks/gpu_determinism.sh "$dir" ;;
    cold-start) printf '%s\n' bash benchmarks/gpu_cold_start.sh "$1" "$dir" ;;
  esac
}

needs_args() {  # phases that take ARGs: vram (STEP ARCH ...) and cold-start (its phase)
  case $1 in vram|cold-start) return 0 ;; *) return 1 ;; esac
}

if [ "${1:-}" = --list ]; then
  for p in "${PHASES[@]}"; do printf '%-16s %s\n' "$p" "$(describe "$p")"; done
  exit 0
fi
if [ $# -lt 2 ]; then
  echo "error: usage: bash benchmarks/gpu_run.sh OUT PHASE [PHASE ...] (phases: bash benchmarks/gpu_run.sh --list)" >&2
  exit 2
fi
out=$1; shift
for phase in "$@"; do  # check every phase before anything runs
  name=${phase%%:*}
  if ! describe "$name" > /dev/null; then
    echo "error: unknown phase '$name' in '$phase'; use one of: ${PHASES[*]}" >&2; exit 2
  fi
  if needs_args "$name" && [ "$name" = "$phase" ]; then
    echo "error: phase '$name' needs arguments ($(describe "$name"))" >&2; exit 2
  fi
  if ! needs_args "$name" && [ "$name" != "$phase" ]; then
    echo "error: phase '$name' takes no arguments; got '$phase'" >&2; exit 2
  fi
done
[ "${DRY:-0}" = 1 ] || mkdir -p "$out" || exit 2
failed=0
for phase in "$@"; do
  name=${phase%%:*}; args=()
  [ "$name" != "$phase" ] && IFS=: read -r -a args <<< "${phase#*:}"
  dir=$out/$name; log=$out/${phase//:/_}.log
  mapfile -t cmd < <(command_of "$name" "$dir" "${args[@]}")
  if [ "${DRY:-0}" = 1 ]; then echo "${cmd[*]}"; continue; fi
  mkdir -p "$dir"
  echo "=== $(date +%T) phase $phase: ${cmd[*]} (log: $log)"
  t0=$(date +%s)
  "${cmd[@]}" 2>&1 | tee "$log"; rc=${PIPESTATUS[0]}
  dt=$(( $(date +%s) - t0 ))
  printf '{"phase": "%s", "rc": %d, "seconds": %d}\n' "$phase" "$rc" "$dt" >> "$out/phases.jsonl"
  echo "=== phase $phase rc=$rc ${dt}s"
  [ "$rc" -eq 0 ] || failed=1
done
exit "$failed"

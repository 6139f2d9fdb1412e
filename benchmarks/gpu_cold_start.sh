#!/usr/bin/env bash
# Issue 28 on the GPU host, in named phases (one device call each, back to back; files under /tmp stay while the
# host is held):
#   bash benchmarks/gpu_cold_start.sh compile-b1 OUT   sd15 dummy pipeline; static 512 b1 fp16 ORT CUDA compile,
#                                                       peak RSS per stage (compile_memory.py)
#   bash benchmarks/gpu_cold_start.sh cold OUT         cold_start.py all (ours, diffusers one-shot, phases, levels,
#                                                       profile; BEFORE=DIR: that tree's package too); bench b1
#   bash benchmarks/gpu_cold_start.sh compile-b4 OUT   static 512 b4 compile with its memory profile; bench b4
# Run from the folder holding the diffusion_trt package to measure; SITE: where the host's extra wheels went.
set -u
phase=${1:?phase}; out=${2:?OUT folder}
export PYTHONUNBUFFERED=1 SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD
py=python3
D="$py -m diffusion_trt.cli"
M=/tmp/cs/sd15
log() { echo "=== $(date +%T) $*"; }
static() { echo "--height $1 --width $1 --min-height $1 --max-height $1 --min-width $1 --max-width $1 --batch-size $2 --min-batch-size $2 --max-batch-size $2"; }
common="--device cuda --precision fp16 --no-cache --overwrite --components text_encoder,unet,vae_decoder"
case $phase in
  compile-b1)
    log dummy; $D dummy-pipeline --arch sd15 --seed 0 --overwrite $M > "$out/dummy.log" 2>&1 || tail -5 "$out/dummy.log"
    log compile b1
    $py benchmarks/compile_memory.py --json "$out/compile_memory_b1.json" -- compile $M -o /tmp/cs/art_b1 \
      $common $(static 512 1) 2>&1 \
      | grep -v -E "it/s|stage/s" | tail -40
    ls -la /tmp/cs/art_b1/unet ;;
  cold)
    log cold start
    $py benchmarks/cold_start.py all /tmp/cs/art_b1 --model-dir $M --repeat 2 ${BEFORE:+--code-before "$BEFORE"} \
      --levels "${LEVELS-basic,extended}" \
      --json "$out/cold_start.json" 2>&1 | tail -60
    log bench b1
    timeout 150 $D bench /tmp/cs/art_b1 --baseline none --steps 50 --json "$out/bench_b1.json" 2>&1 \
      | grep -v -E "it/s|stage/s" | tail -25 ;;
  compile-b4)
    log compile b4
    $py benchmarks/compile_memory.py --json "$out/compile_memory_b4.json" -- compile $M -o /tmp/cs/art_b4 \
      $common $(static 512 4) 2>&1 \
      | grep -v -E "it/s|stage/s" | tail -40
    log bench b4
    timeout 150 $D bench /tmp/cs/art_b4 --baseline none --steps 50 --batch-size 4 --json "$out/bench_b4.json" 2>&1 \
      | grep -v -E "it/s|stage/s" | tail -25 ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac

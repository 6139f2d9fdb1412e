#!/usr/bin/env bash
# Issue 28 on the GPU host, in named phases (one device call each, back to back; files under /tmp stay while the
# host is held):
#   bash benchmarks/gpu_cold_start.sh compile-b1 OUT   sd15 dummy pipeline; static 512 b1 fp16 ORT CUDA compile,
#                                                       peak RSS per stage (compile_memory.py)
#   bash benchmarks/gpu_cold_start.sh cold OUT         cold_start.py all (ours, diffusers one-shot, phases, levels,
#                                                       profile; BEFORE=DIR: that tree's package too); bench b1
#   bash benchmarks/gpu_cold_start.sh compile-b4 OUT   static 512 b4 compile with its memory profile; bench b4
# Four artifacts at once, then the measurements on a quiet host:
#   bash benchmarks/gpu_cold_start.sh prep OUT         models, then compiles (below) in one call
#   bash benchmarks/gpu_cold_start.sh prep-tests OUT   prep started in a process session of its own (setsid: it
#                                                       outlives the device call, and its files stay under OUT/prep,
#                                                       OUT on /tmp, not $OUT) while `pytest -m gpu tests` runs; waits
#                                                       for prep until PREP_UNTIL seconds (default 560) into the call
#                                                       (TESTS: the test paths, default tests);
#                                                       a later phase's call waits for the rest (WAIT_PREP=1)
#   bash benchmarks/gpu_cold_start.sh diag OUT         (read: benchmarks/cold_start_report.py OUT/rows.jsonl) one call: base compiled, then first-image rows with every
#                                                       thread sampled (cold_start.py --sample), the load variants
#                                                       (--set), phases, profile, `run`, diffusers' one-shot
#   bash benchmarks/gpu_cold_start.sh diag2 OUT        (read: cold_start_report.py OUT/rows.jsonl) one call: base compiled,
#                                                       first-image rows of the defaults against load variants (no
#                                                       pre-import, every engine graphed, text encoder only eager),
#                                                       `run` timed to its image line, diffusers' one-shot
#   bash benchmarks/gpu_cold_start.sh anatomy OUT      (read: cold_start_report.py OUT/rows.jsonl) one call: base
#                                                       compiled, first-image rows of this tree against BEFORE
#                                                       (default .before: an older package) and its own variants
#   bash benchmarks/gpu_cold_start.sh anatomy-parts OUT the UNet's first run taken apart (first_run_anatomy.py), the
#                                                       first call's profile, `run` to its image line, diffusers'
#                                                       one-shot
#   bash benchmarks/gpu_cold_start.sh goals OUT        (after ARTS="base b4 det dyn refit" prep-tests) one call:
#                                                       first-image rows, `run` against diffusers' one-shot, bench of
#                                                       the static b1, --deterministic and b4 artifacts
#   bash benchmarks/gpu_cold_start.sh models OUT       sd15 pipeline, ControlNets a/b, rank-64 LoRAs a/b
#   bash benchmarks/gpu_cold_start.sh compiles OUT     compiles side by side, waited for (a process left in the
#                                                       background does not outlive the device call); ARTS picks
#                                                       them (default "base refit merged cn", ~6 min on the H200):
#                                                       base (peak RSS per stage: compile_memory.py), refit
#                                                       (--refittable), merged (--lora a), cn (--controlnet a,b),
#                                                       b4 (static b4, compile_memory.py), dyn (256..1024, b1..4),
#                                                       dynrefit (dyn with --refittable), det (base with
#                                                       --deterministic),
#                                                       cnlite (unet, unet_controlnet, controlnet_a only),
#                                                       cnnoalign (controlnet_a, align_shapes off)
#   bash benchmarks/gpu_cold_start.sh bench-b4 OUT     bench of the b4 artifact (batch 4, 50 steps)
#   bash benchmarks/gpu_cold_start.sh dyn-sizes OUT    bench of the dyn (and dynrefit) artifact at 512x512, 768x768, 640x384
#                                                       (--size-buckets auto, HEURISTIC): first call per new size
#   bash benchmarks/gpu_cold_start.sh dyn-sizes-noprime OUT   the same with the specialised sessions not primed
#   bash benchmarks/gpu_cold_start.sh dyn-sizes-prime OUT     the default against the UNet's sessions primed too,
#                                                       alternating, twice each
#   bash benchmarks/gpu_cold_start.sh profiles OUT     (ARTS="base cnlite refit" prep) kernel profiles of the ControlNet
#                                                       components (cond_embed_a too, if there) and of base's and
#                                                       refit's UNet
#   bash benchmarks/gpu_cold_start.sh cn-profile OUT   kernel profile of unet, unet_controlnet and controlnet_a
#                                                       (ARTS=cnlite prep: those three components only, ~3 min)
#   bash benchmarks/gpu_cold_start.sh bytecode OUT     compile $SITE's bytecode (pip does at install; the wheel
#                                                       installer here uses --no-compile), then `import diffusers`'
#                                                       -X importtime, twice, in fresh processes
#   bash benchmarks/gpu_cold_start.sh readhash OUT     read_hash_throughput.py --sweep on base's UNet weights
#   bash benchmarks/gpu_cold_start.sh compile-b4 OUT   (with W's model) static 512 b4 compile, its memory, bench b4
#   bash benchmarks/gpu_cold_start.sh cold-base OUT    cold_start.py all on base (BEFORE=DIR: that tree too), bench b1
#   bash benchmarks/gpu_cold_start.sh offline OUT      ort_offline_optimization.py on base's UNet
#   bash benchmarks/gpu_cold_start.sh controlnet OUT   controlnet_step.py (0/1/2 ControlNets, ours vs diffusers)
#   bash benchmarks/gpu_cold_start.sh lora OUT         lora_switch.py on the refit/merged/base artifacts
#   bash benchmarks/gpu_cold_start.sh norm-forms OUT   groupnorm_forms.py (GroupNorm forms at every SD-1.5 site:
#                                                       run-to-run identity, cost per UNet step / decode), then the
#                                                       GPU tests
#   bash benchmarks/gpu_cold_start.sh det-forms OUT    (after ARTS="base det" prep) bench of base, --deterministic, base
#                                                       run --deterministic; then groupnorm_forms.py
#   bash benchmarks/gpu_cold_start.sh refit-bias OUT   (after ARTS="base refit" prep) refit vs base images
#                                                       (artifact_parity.py, LoRA a too), both UNets' kernel profiles
#   bash benchmarks/gpu_cold_start.sh first-run OUT    first_run_options.py: session / first / warm run per CUDA
#                                                       provider option, static base (unet, vae_decoder) and dyn
#                                                       at three latent sizes
#   bash benchmarks/gpu_cold_start.sh sources OUT      weight_sources.py on base: ORT opening the files, in-memory
#                                                       files, OrtValue initializers over the verified bytes
#   bash benchmarks/gpu_cold_start.sh lean OUT         first image, diffusers' one-shot and `run` in a folder of
#                                                       diffusion-trt's dependency closure only (lean_site.py), -S
#   bash benchmarks/gpu_cold_start.sh pyenv OUT        what the host's Python does with bytecode, scipy present
#   bash benchmarks/gpu_cold_start.sh shared OUT       shared_initializers.py: the dyn UNet at 3 sizes, one device
#                                                       copy of the weights for all sessions or one each
# Bytecode: the host's system site-packages (torch, numpy, transformers) hold no usable .pyc for its Python and are
# not writable, so every process compiled ~1000 modules from source (s12 profile: builtins.compile 3.2 s). A user's
# pip writes bytecode at install time; to measure that case every phase runs with PYTHONPYCACHEPREFIX=/tmp/pycache,
# which prep fills (compileall of those folders, our package and $SITE) while the compiles run. It serves ours and
# diffusers alike.
# Run from the folder holding the diffusion_trt package to measure; SITE: where the host's extra wheels went.
set -u
phase=${1:?phase}; out=${2:?OUT folder}
export PYTHONUNBUFFERED=1 SITE=${SITE:-/tmp/site}
export PYTHONPATH=$SITE:$PWD PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
py=python3
D="$py -m diffusion_trt.cli"
M=/tmp/cs/sd15
log() { echo "=== $(date +%T) $*"; }
# Preflight: stop at once (exit 3) where $SITE lacks what every phase imports, e.g. after an install whose wheel parts
# did not all reach this host (session 24 lost a whole call to that: the install failed, the phases ran on and failed)
$py -c "import diffusers, onnxruntime, onnx_graphsurgeon" 2> /tmp/preflight.err || {
  echo "preflight: diffusers / onnxruntime / onnx_graphsurgeon do not import from SITE=$SITE (was the install complete?):"
  tail -2 /tmp/preflight.err; exit 3; }
static() { echo "--height $1 --width $1 --min-height $1 --max-height $1 --min-width $1 --max-width $1 --batch-size $2 --min-batch-size $2 --max-batch-size $2"; }
common="--device cuda --precision fp16 --no-cache --overwrite --components text_encoder,unet,vae_decoder"
W=/tmp/lora-switch
models() {
    mkdir -p $W /tmp/cs
    log dummy; $D dummy-pipeline --arch sd15 --seed 0 --overwrite $W/model-sd15 > "$out/dummy.log" 2>&1 || tail -5 "$out/dummy.log"
    case " ${ARTS:-cn} " in *" cn "*|*" cnlite "*|*" cnnoalign "*)  # ControlNets and LoRAs only for the artifacts that use them
      $D dummy-controlnet --arch sd15 --seed 0 --overwrite /tmp/cs/cn-a >> "$out/dummy.log" 2>&1 || tail -5 "$out/dummy.log"
      $D dummy-controlnet --arch sd15 --seed 1 --overwrite /tmp/cs/cn-b >> "$out/dummy.log" 2>&1 || tail -5 "$out/dummy.log" ;;
    esac
    case " ${ARTS:-merged} " in *" merged "*|*" refit "*) ;; *) ls -la $W; return ;; esac
    log loras
    $py -c "
import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import lora_switch as ls
for i, k in enumerate('ab'): ls.make_lora(Path('$W/model-sd15'), Path('$W/lora_%s_r64.safetensors' % k), 64, seed=i + 1)
" 2>&1 | tail -3
    ls -la $W
}
compiles() {  # ARTS: which of base refit merged cn b4 dyn (default: the first four), side by side
    log "compiles: ${ARTS:=base refit merged cn}"
    base="$common $(static 512 1)"
    for a in $ARTS; do case $a in
      base) $py benchmarks/compile_memory.py --json "$out/compile_memory_b1.json" -- compile $W/model-sd15 \
              -o $W/art-base $base > /tmp/cs/c-base.log 2>&1 & ;;
      refit) $D compile $W/model-sd15 -o $W/art-refit $base --refittable > /tmp/cs/c-refit.log 2>&1 & ;;
      det) $D compile $W/model-sd15 -o /tmp/cs/art-det $base --deterministic > /tmp/cs/c-det.log 2>&1 & ;;
      merged) $D compile $W/model-sd15 -o $W/art-merged $base --lora $W/lora_a_r64.safetensors \
                > /tmp/cs/c-merged.log 2>&1 & ;;
      cn) $D compile $W/model-sd15 -o /tmp/cs/art-cn $base --controlnet a=/tmp/cs/cn-a --controlnet b=/tmp/cs/cn-b \
            > /tmp/cs/c-cn.log 2>&1 & ;;
      cnlite) $D compile $W/model-sd15 -o /tmp/cs/art-cnlite $common $(static 512 1) --controlnet a=/tmp/cs/cn-a \
                --components unet,unet_controlnet,controlnet_a > /tmp/cs/c-cnlite.log 2>&1 & ;;
      cnnoalign) $D compile $W/model-sd15 -o /tmp/cs/art-cnnoalign $common $(static 512 1) --controlnet a=/tmp/cs/cn-a \
                --components controlnet_a --pass-option align_shapes_channels=1 > /tmp/cs/c-cnnoalign.log 2>&1 & ;;
      b4) $py benchmarks/compile_memory.py --json "$out/compile_memory_b4.json" -- compile $W/model-sd15 \
            -o /tmp/cs/art_b4 $common $(static 512 4) > /tmp/cs/c-b4.log 2>&1 & ;;
      dyn|dynrefit) $D compile $W/model-sd15 -o /tmp/cs/art-$a $common --height 512 --width 512 --min-height 256 \
             --max-height 1024 --min-width 256 --max-width 1024 --batch-size 1 --min-batch-size 1 --max-batch-size 4 \
             $([ $a = dynrefit ] && echo --refittable) > /tmp/cs/c-$a.log 2>&1 & ;;
      *) echo "unknown artifact $a" ;;
    esac; done
    wait
    log compiled
    for f in /tmp/cs/c-*.log; do echo "--- $f"; grep -v -E "it/s|stage/s" "$f" | tail -3; done
    ls $W/art-*/manifest.json /tmp/cs/art-*/manifest.json /tmp/cs/art_b4/manifest.json 2>/dev/null
}
base_compiled() {  # the static 512 b1 base artifact, unless an earlier prep made it (its peak RSS per stage in OUT)
  if [ ! -f $W/art-base/manifest.json ]; then
    bytecode_all; ARTS=base; models
    log compile base
    $py benchmarks/compile_memory.py --json "$out/compile_memory_b1.json" -- compile $W/model-sd15 -o $W/art-base \
      $common $(static 512 1) > /tmp/compile_base.log 2>&1; echo "compile rc $?"
    grep -v -E "it/s|stage/s" /tmp/compile_base.log | tail -4
    wait
  fi
}
cs() {  # one cold_start.py row TAG ARGS...: its JSON line (tagged) into OUT/rows.jsonl, its stderr into OUT/rows.err
  local tag=$1; shift; local t=$EPOCHREALTIME
  echo "=== $tag" >> "$out/rows.err"
  timeout 120 $py benchmarks/cold_start.py "$@" > /tmp/row_$tag.out 2>> "$out/rows.err"
  local rc=$?; echo "$tag rc $rc wall $(awk "BEGIN{print $EPOCHREALTIME - $t}")"
  grep '^{' /tmp/row_$tag.out | tail -1 | sed "s/^{/{\"tag\": \"$tag\", \"rc\": $rc, /" >> "$out/rows.jsonl"
}
cli() {  # `run` of one 30-step image TAG, timed from process start to each line it prints (the PNG: "image:") and exit
  local t=$EPOCHREALTIME
  timeout 120 $D run $A --prompt "an ink painting" --steps 30 -o /tmp/cli.png --overwrite 2>> "$out/cli.log" \
    | while IFS= read -r line; do echo "$1 at $(awk "BEGIN{print $EPOCHREALTIME - $t}") s: $line"; done
  echo "$1 exit at $(awk "BEGIN{print $EPOCHREALTIME - $t}") s"; }
bench() {  # bench TAG ARTIFACT ARGS...: `bench` of one artifact, its JSON in OUT/bench_TAG.json
  local tag=$1 art=$2; shift 2; log "bench $tag"
  timeout ${BENCH_TIMEOUT:-150} $D bench $art --baseline none --json "$out/bench_$tag.json" "$@" 2>&1 \
    | grep -v -E "it/s|stage/s" | tail -12; }
bytecode_all() {  # into $PYTHONPYCACHEPREFIX, in the background of the compiles
    local system; system=$($py -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    ( t=$(date +%s); $py -m compileall -q -j 0 "$system" "$SITE" "$PWD/diffusion_trt" > /dev/null 2>&1
      echo "compileall into $PYTHONPYCACHEPREFIX rc $? in $(( $(date +%s) - t )) s ($system)" ) &
}
prep_running() { pgrep -f "gpu_cold_start.sh prep " > /dev/null; }
if [ "${WAIT_PREP:-0}" = 1 ]; then  # a phase after prep-tests: its compiles may still run
  while prep_running && [ $SECONDS -lt ${PREP_UNTIL:-560} ]; do sleep 3; done
  prep_running && { echo "prep still running after ${SECONDS}s"; exit 1; }
fi
case $phase in
  prep) bytecode_all; models; compiles ;;
  prep-tests)
    mkdir -p "$out/prep"
    setsid nohup bash "$0" prep "$out/prep" > "$out/prep.log" 2>&1 < /dev/null &
    sleep 1
    log "gpu tests beside the compiles"
    timeout ${TESTS_TIMEOUT:-420} $py -m pytest -q -m gpu ${TESTS:-tests} -p no:cacheprovider -rs > "$out/gpu_tests.log" 2>&1
    echo "gpu tests rc $?"; grep -E "passed|failed|FAILED|ERROR" "$out/gpu_tests.log" | tail -25
    while prep_running && [ $SECONDS -lt ${PREP_UNTIL:-560} ]; do sleep 3; done
    echo "prep running: $(prep_running && echo yes || echo no) at ${SECONDS}s"
    grep -v -E "it/s|stage/s" "$out/prep.log" | tail -30 ;;
  diag)  # one call: base compiled (unless a prep made it), then where the load's time goes (issue 28): host facts;
         # first-image rows with every thread sampled (the first process on this host first), the load variants
         # (--set), profile, phases, `run`, spill throughput, diffusers' one-shot, most telling first (a call cut
         # short keeps the rows before). OUT may be the device call's $OUT: at most 7 files land there (each row's
         # JSON line in rows.jsonl, its stderr in rows.err)
    log "host facts"
    { nproc; free -g | head -2; df -hT /tmp "$PWD" /dev/shm | cat; cat /sys/kernel/mm/transparent_hugepage/enabled \
        /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>&1; uname -r; nvidia-smi -L; } 2>&1
    base_compiled
    A=$W/art-base; H="--cudnn HEURISTIC --steps 30"
    cs fresh-host first-image $A $H --sample
    cs default-1 first-image $A $H --sample
    cs nodefer first-image $A $H --sample --set runtime.schedulers.DEFER_DYNAMO=0
    TMPDIR=/dev/shm cs shm first-image $A $H --sample --set artifact.digests.SPILL_HUGE_PAGES=1
    cs callerall first-image $A $H --sample --set runtime.loading.CALLER_FIRST_RUN=text_encoder,unet,unet_controlnet,vae_decoder
    cs default-2 first-image $A $H --sample
    cs profile profile $A $H
    cs phases phases $A --cudnn HEURISTIC
    t=$EPOCHREALTIME; timeout 120 $D run $A --prompt "an ink painting" --steps 30 -o /tmp/cli.png --overwrite \
      > "$out/cli.log" 2>&1; echo "cli rc $? wall $(awk "BEGIN{print $EPOCHREALTIME - $t}")"
    log "spill write throughput"
    timeout 60 $py benchmarks/spill_write_throughput.py $A/unet/model.onnx.data --repeat 2 --json "$out/spill.json"
    cs intra1 first-image $A $H --sample --set runtime.engines.ort_engine.CUDA_INTRA_OP_THREADS=1
    cs exhaustive first-image $A --cudnn EXHAUSTIVE --steps 30 --sample
    cs diffusers diffusers $W/model-sd15 --steps 30 --png /tmp/diffusers.png ;;
  diag2)  # one call (issue 28): base compiled, then first-image rows of this tree's defaults (onnx and onnxruntime
          # imported from the load's start; text encoders and VAE eager) against the variants: no pre-import, every
          # engine graphed, only the text encoder eager; `run` timed to its "image:" line and to its exit; diffusers'
          # one-shot (session 22 ran it with every engine graphed by default, the eager rows and a GIL switch interval
          # as variants; the switch was dropped after: no gain). Files in OUT: rows.jsonl, rows.err, cli.log,
          # compile_memory_b1.json, dummy.log
    log "host facts"; { nproc; nvidia-smi -L; } 2>&1
    base_compiled
    A=$W/art-base; H="--cudnn HEURISTIC --steps 30"; L=runtime.loading
    cs fresh-host first-image $A $H --sample
    cs default-1 first-image $A $H --sample
    cs nopre-1 first-image $A $H --sample --set $L.PREIMPORT=
    cs allgraph-1 first-image $A $H --sample --set $L.EAGER_COMPONENTS=
    cs eagerte-1 first-image $A $H --sample --set $L.EAGER_COMPONENTS=text_encoder
    cli cli-1
    cs default-2 first-image $A $H --sample
    cs nopre-2 first-image $A $H --sample --set $L.PREIMPORT=
    cs allgraph-2 first-image $A $H --sample --set $L.EAGER_COMPONENTS=
    cli cli-2
    cs diffusers diffusers $W/model-sd15 --steps 30 --png /tmp/diffusers.png
    cs default-3 first-image $A $H --sample
    cs eagerte-2 first-image $A $H --sample --set $L.EAGER_COMPONENTS=text_encoder ;;
  goals)  # one call (issue 28's goal table for this tree, after ARTS="base b4 det dyn refit" prep-tests): first-image
          # rows (the first process after the compiles first), `run` timed to its image line against diffusers'
          # one-shot, then bench of the static b1 (warm s/image, UNet step), the --deterministic compile run with
          # --deterministic (its cost; two identical calls) and the static b4 artifact (img/s). Files in OUT:
          # rows.jsonl, rows.err, cli.log, bench_{b1,det,b4}.json
    log "host facts"; { nproc; nvidia-smi -L; } 2>&1
    base_compiled
    A=$W/art-base; H="--cudnn HEURISTIC --steps 30"
    cs fresh-host first-image $A $H --sample
    cs default-1 first-image $A $H --sample
    cli cli-1
    cs diffusers diffusers $W/model-sd15 --steps 30 --png /tmp/diffusers.png
    cs default-2 first-image $A $H --sample
    cli cli-2
    cs default-3 first-image $A $H --sample
    bench b1 $A --steps 50
    [ -f /tmp/cs/art-det/manifest.json ] && bench det /tmp/cs/art-det --steps 50 --deterministic
    [ -f /tmp/cs/art_b4/manifest.json ] && bench b4 /tmp/cs/art_b4 --steps 50 --batch-size 4
    true ;;
  anatomy)  # one call (issue 28): base compiled, then first-image rows of this tree against BEFORE (a folder holding
            # an older diffusion_trt package, default .before) and against itself without the read-ahead
            # (loading.READ_AHEAD) or the loop's warm-up (WARM_LOOP), interleaved; one row with the arena growing by
            # what is asked. Files in OUT: rows.jsonl, rows.err, compile_memory_b1.json, dummy.log
    log "host facts"; { nproc; nvidia-smi -L; } 2>&1
    base_compiled
    A=$W/art-base; H="--cudnn HEURISTIC --steps 30"
    cs fresh-host first-image $A $H --sample
    for i in 1 2 3; do
      PYTHONPATH=$SITE:$PWD/${BEFORE:-.before} cs before-$i first-image $A $H --sample
      cs after-$i first-image $A $H --sample
      [ $i = 3 ] && break
      cs noread-$i first-image $A $H --sample --set runtime.loading.READ_AHEAD=0
      cs nowarm-$i first-image $A $H --sample --set runtime.loading.WARM_LOOP=0
    done
    cs arena first-image $A $H --provider-options '{"arena_extend_strategy": "kSameAsRequested"}' ;;
  anatomy-parts)  # after anatomy, one call: what the UNet's first run is made of (first_run_anatomy.py), the first
                  # call's profile, `run` timed to its image line, diffusers' one-shot. Files in OUT: anatomy.json,
                  # rows.jsonl, rows.err, cli.log
    A=$W/art-base; H="--cudnn HEURISTIC --steps 30"
    log "first-run anatomy"
    timeout 300 $py benchmarks/first_run_anatomy.py $A --json "$out/anatomy.json" 2>&1 | tail -70
    cs profile profile $A $H
    t=$EPOCHREALTIME
    timeout 120 $D run $A --prompt "an ink painting" --steps 30 -o /tmp/cli.png --overwrite 2>> "$out/cli.log" \
      | while IFS= read -r line; do echo "cli at $(awk "BEGIN{print $EPOCHREALTIME - $t}") s: $line"; done
    echo "cli exit at $(awk "BEGIN{print $EPOCHREALTIME - $t}") s"
    cs diffusers diffusers $W/model-sd15 --steps 30 --png /tmp/diffusers.png ;;
  models) models ;;
  compiles) compiles ;;
  bytecode)
    log bytecode; $py -m compileall -q -j 0 "$SITE" > /dev/null 2>&1; echo "compileall rc $?"
    for i in 1 2; do
      log "import diffusers $i"
      $py -X importtime -c "import diffusers; diffusers.PNDMScheduler" 2> "$out/importtime_diffusers_$i.txt"
      sort -t'|' -k2 -n -r "$out/importtime_diffusers_$i.txt" | head -12
    done ;;
  readhash)
    log readhash
    $py benchmarks/read_hash_throughput.py $W/art-base/unet/model.onnx.data --repeat 2 --sweep \
      --json "$out/read_hash.json" 2>&1 | tail -14 ;;
  cold-base)
    log cold start
    $py benchmarks/cold_start.py all $W/art-base --model-dir $W/model-sd15 --repeat 2 ${BEFORE:+--code-before "$BEFORE"} \
      --levels "" --no-prime-variant none --json "$out/cold_start.json" 2>&1 | tail -40
    log bench b1
    timeout 150 $D bench $W/art-base --baseline none --steps 50 --json "$out/bench_b1.json" 2>&1 \
      | grep -v -E "it/s|stage/s" | tail -12 ;;
  offline)
    log offline optimisation
    timeout 400 $py benchmarks/ort_offline_optimization.py $W/art-base --json "$out/ort_offline.json" 2>&1 | tail -12 ;;
  controlnet)
    log controlnet
    timeout ${CN_TIMEOUT:-400} $py benchmarks/controlnet_step.py $W/model-sd15 /tmp/cs/art-cn /tmp/cs/cn-a /tmp/cs/cn-b --warmup 1 \
      --json "$out/controlnet_step.json" 2>&1 | tail -60 ;;
  lora)
    log lora
    timeout ${LORA_TIMEOUT:-300} $py benchmarks/lora_switch.py "$out/lora_switch.json" --work $W 2>&1 | tail -40 ;;
  bench-b4)
    log bench b4
    timeout ${B4_TIMEOUT:-150} $D bench /tmp/cs/art_b4 --baseline none --steps 50 --batch-size 4 \
      --json "$out/bench_b4.json" 2>&1 | grep -v -E "it/s|stage/s" | tail -25 ;;
  dyn-sizes)  # each dynamic artifact there: art-dyn, art-dynrefit (--refittable: the size sessions bind one copy of
              # the weight inputs)
    for a in dyn dynrefit; do
      [ -f /tmp/cs/art-$a/manifest.json ] || continue
      log "dynamic artifact $a at new sizes (size buckets auto, HEURISTIC: run's default)"
      timeout ${DYN_TIMEOUT:-200} $D bench /tmp/cs/art-$a --baseline none --steps 30 --sizes 512x512,768x768,640x384 \
        --size-buckets auto --cudnn-algo-search heuristic --json "$out/bench_${a}_sizes.json" 2>&1 \
        | grep -v -E "it/s|stage/s" | tail -30
    done ;;
  cn-profile)  # where a ControlNet step's GPU time goes, next to the UNet's (issue 25): ARTS=cnlite prep first
    log "kernel profile: unet, unet_controlnet, controlnet_a"
    timeout ${PROFILE_TIMEOUT:-200} $py benchmarks/profile_kernels.py /tmp/cs/art-cnlite --component unet \
      --component unet_controlnet --component controlnet_a --iters 5 --top 15 --json "$out/cn_profile.json" 2>&1 \
      | tail -60 ;;
  profiles)  # issues 25 and 26 in one call (ARTS="base cnlite refit" prep): the ControlNet's per-step engine next to
             # the UNet's, its once-per-call cond_embed_a where the artifact has one; the refittable UNet against base
             # (without cnlite: the two UNets only)
    comps="--component unet --component unet_controlnet --component controlnet_a"
    [ -d /tmp/cs/art-cnlite/cond_embed_a ] && comps="$comps --component cond_embed_a"
    [ -f /tmp/cs/art-cnlite/manifest.json ] && { log "kernel profile: $comps"
      timeout ${PROFILE_TIMEOUT:-200} $py benchmarks/profile_kernels.py /tmp/cs/art-cnlite $comps --iters 5 --top 12 \
        --json "$out/cn_profile.json" 2>&1 | tail -50; }
    for a in base refit; do
      log "kernel profile: $a unet"
      timeout ${PROFILE_TIMEOUT:-200} $py benchmarks/profile_kernels.py $W/art-$a --component unet --iters 5 --top 20 \
        --json "$out/unet_profile_$a.json" 2>&1 | tail -26
    done ;;
  cn-profile-noalign)  # controlnet_a without align_shapes (no Pad of the 3-channel control image): ARTS=cnnoalign
    log "kernel profile: controlnet_a, align_shapes off"
    timeout ${PROFILE_TIMEOUT:-200} $py benchmarks/profile_kernels.py /tmp/cs/art-cnnoalign --component controlnet_a \
      --iters 5 --top 15 --json "$out/cn_profile_noalign.json" 2>&1 | tail -25 ;;
  dyn-sizes-prime)  # the dyn artifact at new sizes with the UNet's specialised sessions primed on the worker thread
                   # too (buckets.PRIMED_COMPONENTS + unet) against the default (VAE decoder only), alternating
    for i in 1 2; do for v in default unet; do
      log "dynamic artifact at new sizes, primed: $v ($i)"
      timeout ${DYN_TIMEOUT:-200} $py -c "
import sys; from diffusion_trt.runtime.engines import buckets
if '$v' == 'unet': buckets.PRIMED_COMPONENTS = buckets.PRIMED_COMPONENTS | {'unet'}
from diffusion_trt.cli import main; sys.argv[0] = 'diffusion-trt'; main()" bench /tmp/cs/art-dyn --baseline none \
        --steps 30 --sizes 512x512,768x768,640x384 --size-buckets auto --cudnn-algo-search heuristic \
        --json "$out/bench_dyn_prime_${v}_$i.json" 2>&1 | grep -E "first|unet:|^ours " | grep -v multi
    done; done ;;
  norm-forms)  # issue 28's deterministic mode: the GroupNorm forms at every SD-1.5 site (groupnorm_forms.py, no
              # compile needed), then `pytest -m gpu` (TESTS: the paths, default tests)
    log "groupnorm forms"
    timeout ${FORMS_TIMEOUT:-200} $py benchmarks/groupnorm_forms.py --runs 4 --json "$out/groupnorm_forms.json" 2>&1 \
      | grep -v '^{' | tail -20
    log "gpu tests"
    timeout ${TESTS_TIMEOUT:-300} $py -m pytest -q -m gpu ${TESTS:-tests} -p no:cacheprovider -rs > "$out/gpu_tests.log" 2>&1
    echo "gpu tests rc $?"; grep -E "passed|failed|FAILED|ERROR" "$out/gpu_tests.log" | tail -25 ;;
  det-forms)  # issue 28's deterministic mode, after ARTS="base det" prep: bench (50 steps, HEURISTIC) of the static b1
              # artifact, of the --deterministic compile run --deterministic, and of the static b1 artifact run
              # --deterministic (the runtime flag's share of the cost: not yet run), ROUNDS times; then the GroupNorm
              # forms at every SD-1.5 site (groupnorm_forms.py). Files in OUT: bench_{b1,det,b1det}_N.json,
              # groupnorm_forms.json
    for i in $(seq ${ROUNDS:-2}); do
      bench b1_$i $W/art-base --steps 50 --cudnn-algo-search heuristic
      [ -f /tmp/cs/art-det/manifest.json ] && bench det_$i /tmp/cs/art-det --steps 50 --cudnn-algo-search heuristic --deterministic
      bench b1det_$i $W/art-base --steps 50 --cudnn-algo-search heuristic --deterministic  # the runtime flag alone
    done
    log "groupnorm forms"
    timeout ${FORMS_TIMEOUT:-200} $py benchmarks/groupnorm_forms.py --runs 4 --json "$out/groupnorm_forms.json" 2>&1 \
      | grep -v '^{' | tail -8; true ;;
  refit-bias)  # issue 26, after ARTS="base refit ..." prep: the refittable UNet (proj_out biases folded into BiasAdd)
               # against base: images (artifact_parity.py, the refittable one also with LoRA a), then both UNets'
               # kernel profiles. Files in OUT: refit_parity.json, unet_profile_{base,refit}.json
    log "refit vs base images"
    timeout 150 $py benchmarks/artifact_parity.py $W/art-base $W/art-refit --lora $W/lora_a_r64.safetensors \
      --json "$out/refit_parity.json" 2>&1 | grep -v -E "it/s|step/s" | tail -3
    for a in base refit; do
      log "kernel profile: $a unet"
      timeout ${PROFILE_TIMEOUT:-120} $py benchmarks/profile_kernels.py $W/art-$a --component unet --iters 5 --top 20 \
        --json "$out/unet_profile_$a.json" 2>&1 | tail -24
    done ;;
  dyn-sizes-noprime)  # the same bench with OrtEngine.prime turned off: the run before the priming, side by side
    log "dynamic artifact at new sizes, sessions not primed"
    timeout ${DYN_TIMEOUT:-200} $py -c "
import sys; from diffusion_trt.runtime.engines.ort_engine import OrtEngine; OrtEngine.prime = lambda self: False
from diffusion_trt.cli import main; sys.argv[0] = 'diffusion-trt'; main()" bench /tmp/cs/art-dyn --baseline none \
      --steps 30 --sizes 512x512,768x768,640x384 --size-buckets auto --cudnn-algo-search heuristic \
      --json "$out/bench_dyn_sizes_noprime.json" 2>&1 | grep -v -E "it/s|stage/s" | tail -30 ;;
  first-run)
    log "first run per provider option: static base"
    timeout ${FR_TIMEOUT:-200} $py benchmarks/first_run_options.py $W/art-base --components unet,vae_decoder \
      --variants default,no_fuse_bias,sdpa_math,nchw,plain --json "$out/first_run_static.json" 2>&1 | tail -12
    log "first run per provider option: dyn at 64x64, 96x96, 80x48 latents"
    timeout ${FR_TIMEOUT:-200} $py benchmarks/first_run_options.py /tmp/cs/art-dyn --components vae_decoder,unet \
      --variants default,no_fuse_bias,sdpa_math,plain --latents 64x64,96x96,80x48 \
      --json "$out/first_run_dyn.json" 2>&1 | tail -10 ;;
  shared)
    log "shared initializers: dyn UNet at 64x64, 96x96, 80x48 latents, batch 2"
    timeout ${SHARED_TIMEOUT:-240} $py benchmarks/shared_initializers.py /tmp/cs/art-dyn --component unet \
      --latents 64x64,96x96,80x48 --batch 2 --layouts nhwc,nchw --json "$out/shared_initializers.json" 2>&1 | tail -24 ;;
  sources)  # where a session's weights come from: ORT by path, in-memory files, OrtValue initializers (issue 28)
    log "session sources: unet x2, text encoder and VAE decoder x1"
    timeout ${SOURCES_TIMEOUT:-240} $py benchmarks/weight_sources.py $W/art-base --components unet --repeat 2 \
      --json "$out/session_sources_unet.json" 2>&1 | tail -8
    timeout ${SOURCES_TIMEOUT:-240} $py benchmarks/weight_sources.py $W/art-base --components text_encoder,vae_decoder \
      --repeat 1 --json "$out/session_sources_small.json" 2>&1 | tail -8 ;;
  lean)  # the cold start in a folder of diffusion-trt's dependency closure only, as a user's venv (python -S)
    log "lean site"
    rm -rf /tmp/lean; $py benchmarks/lean_site.py /tmp/lean 2>&1 | tail -3
    $py -m compileall -q -j 0 /tmp/lean/* > /dev/null 2>&1; echo "compileall /tmp/lean/* (each link: compileall skips linked folders) rc $?"
    for i in 1 2; do
      for what in first-image diffusers; do
        arg=$W/art-base; [ $what = diffusers ] && arg=$W/model-sd15
        t=$EPOCHREALTIME
        PYTHONPATH=/tmp/lean:$PWD timeout 120 $py -S benchmarks/cold_start.py $what $arg --steps 30 \
          > "$out/lean_${what}_$i.json" 2> "$out/lean_${what}_$i.err"
        echo "lean $what $i rc $? wall $(awk "BEGIN{print $EPOCHREALTIME - $t}")"; tail -c 600 "$out/lean_${what}_$i.json"; echo
      done
      t=$EPOCHREALTIME
      PYTHONPATH=/tmp/lean:$PWD timeout 120 $py -S -m diffusion_trt.cli run $W/art-base --prompt "an ink painting" \
        --steps 30 -o /tmp/lean_cli.png --overwrite > "$out/lean_cli_$i.log" 2>&1
      echo "lean cli $i rc $? wall $(awk "BEGIN{print $EPOCHREALTIME - $t}")"
    done ;;
  pyenv)
    $py -c "import sys, importlib.util as u; print('dont_write_bytecode', sys.flags.dont_write_bytecode, \
      'pycache_prefix', sys.pycache_prefix, 'scipy', u.find_spec('scipy') is not None)"
    env | grep -i -E "^PYTHON" ;;
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
    [ -d $M ] || M=$W/model-sd15
    $py benchmarks/compile_memory.py --json "$out/compile_memory_b4.json" -- compile $M -o /tmp/cs/art_b4 \
      $common $(static 512 4) 2>&1 \
      | grep -v -E "it/s|stage/s" | tail -40
    log bench b4
    timeout 150 $D bench /tmp/cs/art_b4 --baseline none --steps 50 --batch-size 4 --json "$out/bench_b4.json" 2>&1 \
      | grep -v -E "it/s|stage/s" | tail -25 ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue 19 on one nvidia-h200, ONE run of at most ~9 minutes: dynamic profiles at static speed (size buckets),
# first-call time per size (cuDNN EXHAUSTIVE vs HEURISTIC), determinism (on/off, which kernels differ), parity.
#
#   cd REPO && PYTHONPATH=/tmp/site:$PWD timeout 590 bash benchmarks/gpu_dynamic.sh "$OUT"
#
# Writes into RESULTS_DIR (default $OUT): gpu_dynamic.log (everything), steps.json (every step: ok / error rc /
# skipped for lack of time, seconds), summary.json (the headline figures of every bench JSON), bench_*.json,
# determinism.json, components.json, manifest_*.json, compile_*.log. Steps run in priority order; each is bounded by
# `timeout` and by what is left of BUDGET_S (default 540 s), so a failure or a slow step costs only itself.
# Sizes are HEIGHTxWIDTH (640x384: 640 high, 384 wide). SD-1.5 architecture, random weights, fp16, 50 PNDM steps.
# Knobs for a CPU smoke run of the plumbing (not for figures): ARCH=tiny DEVICE=cpu PRECISION=fp32 STEPS=2
# MODEL=/tmp/x/tiny ARTS=/tmp/x BUDGET_S=... SIZES=64x64,96x96,80x48 COMPILE=0 (use the artifacts in ARTS).
set -u
res=${1:-${OUT:-/tmp/results}}; mkdir -p "$res"
budget=${BUDGET_S:-540}
start=$(date +%s)
export PYTHONUNBUFFERED=1
py=${PY:-python3}
arch=${ARCH:-sd15}; device=${DEVICE:-cuda}; precision=${PRECISION:-fp16}; nsteps=${STEPS:-50}
model=${MODEL:-/tmp/sd15}; arts=${ARTS:-/tmp}
cli=("$py" -m diffusion_trt.cli)
exec > >(tee -a "$res/gpu_dynamic.log") 2>&1
steps="$res/steps.jsonl"; : > "$steps"
# shellcheck source=benchmarks/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"  # left, record, step, quiet, bench
export -f bench quiet; export res py arch device precision nsteps model arts

step env 5 20 bash -o pipefail -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c 'import torch, onnxruntime as o, diffusers; print(torch.__version__, o.__version__, diffusers.__version__, o.get_available_providers())'"
[ -d "$model" ] || step dummy 30 150 "${cli[@]}" dummy-pipeline --arch "$arch" "$model"

# -- compiles, in parallel: static 512x512 / 768x768 / 640x384 batch 1, dynamic 256..1024 batch 1..4 (no VAE encoder)
compile_all() {
  local common=(--device "$device" --precision "$precision" --overwrite --components text_encoder,unet,vae_decoder)
  local -A args=(
    [s512]="--height 512 --width 512 --min-height 512 --max-height 512 --min-width 512 --max-width 512 --batch-size 1 --max-batch-size 1"
    [s768]="--height 768 --width 768 --min-height 768 --max-height 768 --min-width 768 --max-width 768 --batch-size 1 --max-batch-size 1"
    [s640x384]="--height 640 --width 384 --min-height 640 --max-height 640 --min-width 384 --max-width 384 --batch-size 1 --max-batch-size 1"
    [dyn]="--height 512 --width 512 --min-height 256 --max-height 1024 --min-width 256 --max-width 1024 --batch-size 1 --min-batch-size 1 --max-batch-size 4"
  )
  local -A pids=()
  for name in s512 dyn s768 s640x384; do
    # shellcheck disable=SC2086
    $py -m diffusion_trt.cli compile "$model" -o "$arts/art_$name" "${common[@]}" ${args[$name]} \
      > "$res/compile_$name.log" 2>&1 &
    pids[$name]=$!
  done
  local worst=0
  for name in s512 dyn s768 s640x384; do
    wait "${pids[$name]}"; local rc=$?
    echo "compile $name rc=$rc: $(tail -1 "$res/compile_$name.log")"
    printf '{"step": "compile_%s", "status": "%s", "rc": %d, "seconds": null, "reason": null}\n' \
      "$name" "$([ $rc -eq 0 ] && echo ok || echo error)" "$rc" >> "$res/steps.jsonl"
    [ -f "$arts/art_$name/manifest.json" ] && cp "$arts/art_$name/manifest.json" "$res/manifest_$name.json"
    (( rc > worst )) && worst=$rc
  done
  return $worst
}
export -f compile_all
[ "${COMPILE:-1}" = 1 ] && step compiles 90 300 bash -c compile_all
sizes=${SIZES:-512x512,768x768,640x384}

# -- benches, in priority order ------------------------------------------------------------------------------------
# 1. static 512 next to diffusers eager / CUDA graph (first call + repeatability included)
step bench_static512 40 150 bash -c "bench static512 $arts/art_s512 --batch-size 1 --iters 3"
# 2. dynamic + size buckets (lazy: the first call at each size creates its sessions), EXHAUSTIVE (today's default)
step bench_dyn_buckets_exhaustive 50 170 bash -c "bench dyn_buckets_exhaustive $arts/art_dyn --baseline none --sizes $sizes --size-buckets auto --iters 3 --stage-iters 10"
# 3. the static artifacts of the other two sizes (the targets of goal 1)
step bench_static768 20 60 bash -c "bench static768 $arts/art_s768 --baseline none --iters 3 --stage-iters 10"
step bench_static640x384 20 60 bash -c "bench static640x384 $arts/art_s640x384 --baseline none --iters 3 --stage-iters 10"
# 4. dynamic without buckets (today's path: 75 Memcpy nodes, no CUDA graph)
step bench_dyn_plain 40 150 bash -c "bench dyn_plain $arts/art_dyn --baseline none --sizes $sizes --iters 2 --stage-iters 10"
# 5. first calls with cuDNN HEURISTIC (buckets, lazy) and the steady state it gives
step bench_dyn_buckets_heuristic 50 170 bash -c "bench dyn_buckets_heuristic $arts/art_dyn --baseline none --sizes $sizes --size-buckets auto --cudnn-algo-search HEURISTIC --iters 3 --stage-iters 10"
# 6. determinism: cost and two identical calls, static 512
step bench_static512_deterministic 20 60 bash -c "bench static512_deterministic $arts/art_s512 --baseline none --deterministic --iters 3"
# 7. which kernels differ between identical runs (components x modes, single ops)
step determinism 30 100 bash -o pipefail -c "$py benchmarks/determinism.py $arts/art_s512 --runs 4 --modes default,deterministic,heuristic,math_attention,cuda_graph --json $res/determinism.json 2>&1 | quiet | grep -v '^[{}\" ]' | tail -30"
# 8. parity: fp16 UNet vs torch fp16 / fp32 (max abs, cosine), per-component timings
step parity 40 120 bash -o pipefail -c "$py benchmarks/components.py $model --artifact static=$arts/art_s512 --variants cuda_graph+nhwc+sdpa_kernel=8+fuse_conv_bias=1 --iters 10 --json $res/components.json 2>&1 | quiet | grep -E '^(unet|vae|text)|max_abs|cosine' | head -20"
# 9. static 512 HEURISTIC: does HEURISTIC cost steady-state speed where the profile is static?
step bench_static512_heuristic 20 60 bash -c "bench static512_heuristic $arts/art_s512 --baseline none --cudnn-algo-search HEURISTIC --iters 3"
# 9b. the dynamic session's own first calls with HEURISTIC (what a call outside every bucket pays)
step bench_dyn_plain_heuristic 40 120 bash -c "bench dyn_plain_heuristic $arts/art_dyn --baseline none --sizes $sizes --cudnn-algo-search HEURISTIC --iters 1 --stage-iters 5"
# 10. listed buckets (sessions opened at load) and batch 4 (CFG batch 8)
step bench_dyn_buckets_listed_b4 60 170 bash -c "bench dyn_buckets_listed_b4 $arts/art_dyn --baseline none --sizes ${sizes%%,*} --size-buckets $sizes --batch-size 1,4 --iters 2 --stage-iters 10"
# 11. diffusers at the other two sizes
step bench_static768_diffusers 60 120 bash -c "bench static768_diffusers $arts/art_s768 --iters 2 --stage-iters 10"

# -- what came back -------------------------------------------------------------------------------------------------
$py - "$res" <<'EOF' || true
import json, sys
from pathlib import Path
res = Path(sys.argv[1])
steps = [json.loads(line) for line in (res / "steps.jsonl").read_text().splitlines() if line.strip()]
(res / "steps.json").write_text(json.dumps(steps, indent=2))
summary = {"steps": {s["step"]: s["status"] for s in steps}}
for path in sorted(res.glob("bench_*.json")):
    try:
        data = json.loads(path.read_text())
    except Exception as e:  # noqa: BLE001
        summary[path.stem] = {"error": str(e)}
        continue
    rows = [{k: r.get(k) for k in ("system", "height", "width", "batch_size", "status", "e2e_s", "s_per_image")}
            | {"unet_step_ms": r["stages_ms"].get("unet_step"), "vae_ms": r["stages_ms"].get("vae_decode")}
            for r in data["runs"] if r["status"] != "skipped"]
    summary[path.stem] = {"load_s": data.get("load_s"), "runs": rows, "first_calls": data.get("first_calls"),
                          "repeatability": data.get("repeatability"), "notes": data.get("notes")}
(res / "summary.json").write_text(json.dumps(summary, indent=2))
for name, item in summary.items():
    if name == "steps":
        print("steps:", item)
        continue
    print(f"-- {name} (load {item.get('load_s')})")
    for r in item.get("runs", []):
        print(f"   {r['system']:<20} {r['height']}x{r['width']} b={r['batch_size']} unet {r['unet_step_ms']} ms "
              f"vae {r['vae_ms']} ms e2e {r['e2e_s']} s {r['status']}")
    for f in item.get("first_calls") or []:
        print(f"   first call {f['height']}x{f['width']} b={f['batch_size']}: {f['first_call_s']:.2f} s "
              f"(warm {f['warm_e2e_s']}, overhead {f['overhead_s']})")
    for q in item.get("repeatability") or []:
        print(f"   repeat {q['height']}x{q['width']}: max abs {q['max_abs_diff']}")
EOF
echo "=== done in $(( $(date +%s) - start )) s; files in $res"

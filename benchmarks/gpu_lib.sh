# Shared helpers of the GPU-host scripts (source it): bounded steps recorded in $res/steps.jsonl, quiet logs,
# `bench` into $res/bench_NAME.json. Needs: res (results folder), budget (s), start (epoch s), py, nsteps.
left() { echo $(( budget - ($(date +%s) - start) )); }
record() { printf '{"step": "%s", "status": "%s", "rc": %s, "seconds": %s, "reason": %s}\n' "$1" "$2" "$3" "$4" "$5" >> "$res/steps.jsonl"; }
# step NAME NEED_S LIMIT_S CMD...: run CMD (bounded by LIMIT_S and the budget) unless fewer than NEED_S s are left
step() {
  local name=$1 need=$2 limit=$3; shift 3
  local l; l=$(left)
  if (( l < need )); then
    echo "=== skip $name: $l s left of the budget, it needs ~$need s"
    record "$name" skipped null null "\"$l s left of the ${budget} s budget, needs ~$need s\""; return 0
  fi
  (( limit > l )) && limit=$l
  echo "=== $(date +%T) [$(( $(date +%s) - start ))s] $name (limit ${limit}s)"
  local t0; t0=$(date +%s)
  timeout -k 5 "$limit" "$@"; local rc=$?
  local dt=$(( $(date +%s) - t0 ))
  record "$name" "$([ $rc -eq 0 ] && echo ok || echo error)" "$rc" "$dt" \
    "$([ $rc -eq 124 ] && echo '"timed out"' || echo null)"
  echo "=== $name rc=$rc ${dt}s"
}
quiet() { grep -v -E "it/s|stage/s|Warning|warn\(|W:onnxruntime" || true; }
bench() {  # bench NAME ARTIFACT ARGS...: the table to the log, JSON to bench_NAME.json
  local name=$1 art=$2; shift 2
  $py -m diffusion_trt.cli bench "$art" --steps "$nsteps" --json "$res/bench_$name.json" "$@" 2>&1 | quiet | tail -40
  return "${PIPESTATUS[0]}"
}
export -f bench quiet

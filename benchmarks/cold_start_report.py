"""Print the rows of ``gpu_cold_start.sh diag`` (``rows.jsonl``: one ``cold_start.py`` JSON line per row) for reading.

    python benchmarks/cold_start_report.py rows.jsonl [--frames 6]
    python benchmarks/cold_start_report.py benchmarks/results/h100-2026-12-07-s22-cold-start-variants.json

A results file (one JSON object whose ``rows`` are those lines) reads the same.

Per first-image row: its tag and variant (``--set``), ``from_artifacts`` + first call = time to the first image, the
warm UNet step, the marks since process start and the load timeline (seconds from the opening's start); with
``--frames N``, each thread's N most sampled frames (``cold_start.py --sample``). Profile rows: the top functions of
ours by cumulative time, for the load and the first call. Other rows: their JSON, shortened.
"""

from __future__ import annotations

import argparse
import json


def first_image(r: dict, frames: int) -> None:
    marks = {a: round(b, 2) for a, b in r["marks_since_process_start_s"].items() if isinstance(b, float)}
    print(f"== {r['tag']} rc={r['rc']} sets={r.get('sets')} cudnn={r.get('cudnn')}: load {r['from_artifacts_s']:.2f} + "
          f"first {r['first_call_s']:.2f} = {r['time_to_first_image_s']:.2f} (second {r['second_call_s']:.3f}); "
          f"unet {r['unet_warm_ms']:.2f} ms; marks {json.dumps(marks)}")
    for name, m in r.get("load_timeline_s", {}).items():
        print("     ", name, {a: round(b, 3) for a, b in m.items()})
    for thread, d in r.get("thread_samples", {}).items() if frames else ():
        print("   ~", thread, d["samples"], "samples")
        for where, count in d["top"][:frames]:
            print("        ", count, where)


def profile(r: dict) -> None:
    print(f"== {r['tag']} profile: total {r['total_s']:.2f} s, first call {r['first_call_s']:.2f} s")
    for f in r["top_diffusion_trt"][:15]:
        print("      load", round(f["cumtime_s"], 3), f["function"])
    for f in r["first_call"]["top_diffusion_trt"][:15]:
        print("     first", round(f["cumtime_s"], 3), f["function"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rows")
    ap.add_argument("--frames", type=int, default=0)
    ns = ap.parse_args()
    for r in _rows(ns.rows):
        if "from_artifacts_s" in r:
            first_image(r, ns.frames)
        elif "total_s" in r:
            profile(r)
        else:
            print(f"== {r.get('tag')} rc={r.get('rc')}", json.dumps(r)[:1500])


def _rows(path: str) -> list[dict]:
    """The rows of a ``rows.jsonl`` file, or the ``rows`` of a results JSON file."""
    with open(path) as f:
        text = f.read()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:  # several lines: JSON lines
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return whole["rows"] if isinstance(whole, dict) and "rows" in whole else [whole]


if __name__ == "__main__":
    main()

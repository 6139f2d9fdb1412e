"""Seconds to import the diffusers scheduler class a load builds, with and without torch._dynamo deferred (issue 28).

    python benchmarks/scheduler_import_time.py [--class PNDMScheduler] [--repeat 3] [--json OUT.json]

Each measurement is a fresh interpreter that imports torch first (as every process of ours has), then times
``getattr(diffusers, CLASS)`` plain and inside :func:`diffusion_trt.runtime.deferred_dynamo.deferred_dynamo` (what
``from_artifacts`` does on its import thread), and says whether ``torch._dynamo`` ended up imported. Rows alternate
between the two ways, ``--repeat`` of each.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys

CHILD = """
import json, sys, time, contextlib, torch
from diffusion_trt.runtime.deferred_dynamo import deferred_dynamo
defer = sys.argv[1] == "1"
t = time.perf_counter()
with deferred_dynamo() if defer else contextlib.nullcontext():
    import diffusers
    getattr(diffusers, sys.argv[2])
print(json.dumps({"seconds": time.perf_counter() - t, "dynamo_imported": "torch._dynamo.eval_frame" in sys.modules}))
"""


def one(defer: bool, cls: str) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, "1" if defer else "0", cls], capture_output=True, text=True,
                       check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--class", dest="cls", default="PNDMScheduler")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ns = ap.parse_args()
    one(False, ns.cls)  # the first import after an install writes bytecode: not measured
    rows = []
    for rep in range(ns.repeat):
        for defer in (False, True):
            row = {"deferred": defer, "repeat": rep, **one(defer, ns.cls)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    summary = {str(d): statistics.median(r["seconds"] for r in rows if r["deferred"] == d) for d in (False, True)}
    print(f"median seconds: plain {summary['False']:.3f}, torch._dynamo deferred {summary['True']:.3f}")
    if ns.json:
        import diffusers
        import torch

        with open(ns.json, "w") as f:
            json.dump({"class": ns.cls, "python": platform.python_version(), "torch": torch.__version__,
                       "diffusers": diffusers.__version__, "machine": platform.node(), "rows": rows,
                       "median_s": summary}, f, indent=1)


if __name__ == "__main__":
    main()

"""First compile next to the identical second one (a compile cache hit), each a whole ``diffusion-trt compile``
process as a user runs it, with a fresh cache folder.

    python benchmarks/compile_cache.py --arch tiny --work /tmp/cc [--single-file] [--json out.json]

Writes the dummy pipeline ``--arch`` (or, with ``--single-file``, also its A1111-layout single file, compiled
instead), then runs ``diffusion-trt compile MODEL -o WORK/a`` and ``... -o WORK/b`` with ``DIFFUSION_TRT_CACHE``
pointing at ``WORK/cache``, and a third ``--no-cache`` compile onto ``WORK/c`` as the control. Reports the wall
seconds of each (process start to exit: imports, hashing the source, verifying the cache entry included), the
manifests' ``cache`` records, the load average and the machine. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return seconds, out.stderr + out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="tiny")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--single-file", action="store_true", help="compile the A1111-layout single file")
    parser.add_argument("--no-control", action="store_true", help="skip the third (--no-cache) compile")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    exe = str(Path(sys.executable).parent / "diffusion-trt")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    env = {**os.environ, "DIFFUSION_TRT_CACHE": str(args.work / "cache")}
    model = args.work / "model"
    t_dummy, _ = _run([exe, "dummy-pipeline", "--arch", args.arch, str(model)], env)
    if args.single_file:
        sys.path.insert(0, str(REPO / "tests" / "compiler"))
        from ldm_layout import write_single_file

        model = write_single_file(model, args.work / f"{args.arch}.safetensors")
    result: dict[str, Any] = {
        "what": "first compile vs the identical second (compile cache hit), whole CLI processes",
        "command": " ".join(["python", "benchmarks/compile_cache.py", *sys.argv[1:]]),
        "arch": args.arch,
        "source": "single file (A1111 layout)" if args.single_file else "diffusers folder",
        "source_bytes": (model.stat().st_size if model.is_file()
                         else sum(p.stat().st_size for p in model.rglob("*") if p.is_file())),
        "dummy_pipeline_seconds": round(t_dummy, 2),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average_before": list(os.getloadavg()),
    }
    runs = [("first", "a", []), ("second_identical", "b", [])]
    if not args.no_control:
        runs.append(("no_cache_control", "c", ["--no-cache"]))
    for name, out, extra in runs:
        seconds, log = _run([exe, "compile", str(model), "-o", str(args.work / out), *extra], env)
        manifest = json.loads((args.work / out / "manifest.json").read_text())
        result[name] = {"wall_seconds": round(seconds, 2), "cache": manifest.get("cache"),
                        "compile_seconds_in_manifest": manifest.get("compile_seconds"),
                        "hit_line": next((line for line in log.splitlines() if "compile cache hit" in line), None)}
        print(f"{name}: {seconds:.1f} s", flush=True)
    result["load_average_after"] = list(os.getloadavg())
    result["speedup_second_vs_first"] = round(result["first"]["wall_seconds"]
                                              / result["second_identical"]["wall_seconds"], 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

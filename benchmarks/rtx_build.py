"""TensorRT-RTX builds on a machine without a GPU: wall time, peak RSS, plan size and layer count per component.

    python benchmarks/rtx_build.py MODEL_DIR --work /tmp/rtx --json out.json \
        [--profile static|dynamic ...] [--precision fp16] [--compute-capability 8.6,8.9,12.0] [--components unet,...]

For each (profile, component) it runs ``compile --backend tensorrt-rtx`` for that one component in a child
process (so peak RSS is the component's own, read from ``os.wait4``), then reads the artifact's manifest: export,
pass and build seconds, plan bytes, TensorRT layer count, quantized layers (QDQ pairs of the optimized ONNX for
fp8). Profiles: ``static`` = 512x512, batch 1; ``dynamic`` = 256..1024 (opt 512), batch 1..4 (opt 1). A
benchmark, not a test: the figures depend on the machine and its load (recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROFILES: dict[str, list[str]] = {
    "static": ["--height", "512", "--width", "512", "--min-height", "512", "--max-height", "512",
               "--min-width", "512", "--max-width", "512", "--batch-size", "1", "--max-batch-size", "1"],
    "dynamic": ["--height", "512", "--width", "512", "--min-height", "256", "--max-height", "1024",
                "--min-width", "256", "--max-width", "1024", "--batch-size", "1", "--min-batch-size", "1",
                "--max-batch-size", "4"],
}

#: One component per child: compile_pipeline with components=(NAME,), the CLI's options otherwise.
_CHILD = r"""
import sys
from pathlib import Path
from diffusion_trt.cli import main
sys.argv = ["diffusion-trt", *sys.argv[1:]]
main()
"""


def run_child(args: list[str], log: Path) -> dict[str, Any]:
    """Run one compile in a child process; wall seconds, peak RSS (GiB) and exit code."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, *args], stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    return {"wall_seconds": round(time.perf_counter() - t0, 1), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
            "exit_code": os.waitstatus_to_exitcode(status)}


def quantized_layers(onnx_path: Path) -> dict[str, int]:
    """QuantizeLinear / DequantizeLinear counts and the MatMul/Conv/Gemm nodes fed by a DequantizeLinear."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    dq_out = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    counts = {"QuantizeLinear": 0, "DequantizeLinear": 0, "quantized_compute_nodes": 0}
    for n in graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            counts[n.op_type] += 1
        elif n.op_type in ("MatMul", "Conv", "Gemm") and any(i in dq_out for i in n.input):
            counts["quantized_compute_nodes"] += 1
    return counts


def component_figures(artifact: Path, name: str) -> dict[str, Any]:
    manifest = json.loads((artifact / "manifest.json").read_text())
    entry = manifest["components"][name]
    build = entry["build"]
    out = {
        "precision": entry["precision"],
        "export_seconds": entry.get("export_seconds"),
        "passes_seconds": round(sum(p.get("seconds", 0) for p in entry.get("passes", [])), 1),
        "build_seconds": build["build_seconds"],
        "plan_bytes": build["plan_bytes"],
        "plan_mib": round(build["plan_bytes"] / 2**20, 1),
        "num_layers": build["num_layers"],
        "profiles": [p["kind"] for p in build["profiles"]],
        "compute_capabilities": build["compute_capabilities"],
        "onnx_bytes": sum((artifact / f).stat().st_size for f in entry["files"] if "model.onnx" in f),
        "tensorrt_rtx": build["tensorrt"],
    }
    if entry.get("quantization"):
        out["quantized"] = quantized_layers(artifact / entry["onnx"])
        out["quality"] = entry.get("quality")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--profile", action="append", choices=sorted(PROFILES))
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--compute-capability", default=None)
    ap.add_argument("--components", default="text_encoder,unet,vae_decoder,vae_encoder")
    ap.add_argument("--extra", default="", help="more compile options, space-separated")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "what": "compile --backend tensorrt-rtx per component in a child process (peak RSS per component)",
        "command": " ".join(sys.argv),
        "machine": {"cpu": platform.machine(), "cores": os.cpu_count(), "gpu": "none"},
        "precision": a.precision, "runs": [],
    }
    for profile in a.profile or ["static"]:
        for name in a.components.split(","):
            out = a.work / f"{profile}-{name}"
            args = ["compile", str(a.model_dir), "-o", str(out), "--overwrite", "--backend", "tensorrt-rtx",
                    "--precision", a.precision, "--components", name, *PROFILES[profile], *a.extra.split()]
            if a.compute_capability:
                args += ["--compute-capability", a.compute_capability]
            load = os.getloadavg()
            row: dict[str, Any] = {"profile": profile, "component": name, "load_average_before": load,
                                   **run_child(args, a.work / f"{profile}-{name}.log")}
            row["load_average_after"] = os.getloadavg()
            if row["exit_code"] == 0:
                row.update(component_figures(out, name))
            else:
                row["log_tail"] = (a.work / f"{profile}-{name}.log").read_text()[-2000:]
            results["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("log_tail", "quality")}), flush=True)
            a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

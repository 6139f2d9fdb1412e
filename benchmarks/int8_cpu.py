"""ONNX Runtime CPU speed of the int8 QDQ UNet next to the fp32 UNet, side by side, with their output agreement.

    python benchmarks/int8_cpu.py --fp32 ARTIFACT_FP32 --int8 ARTIFACT_INT8 [--runs 20] [--threads N] [--json out.json]
    python benchmarks/int8_cpu.py --model-dir models/tiny --work /tmp/int8-bench [--calibration-size 8 ...]

With ``--model-dir`` it first compiles both artifacts (UNet only; ORT CPU; the int8 one calibrated with the given
settings, and the calibration time reported). It then times one UNet step at each artifact's opt shape (CFG batch
2), median of ``--runs`` runs after 2 warm-up runs, on the same random inputs, and reports the cosine similarity of
the two noise predictions. A benchmark, not a test: the figures depend on the machine. TensorRT int8/fp8 speed is
not measured here (no GPU, no TensorRT on the CPU host).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np


def unet_feeds(manifest: dict[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Random UNet inputs at the artifact's opt shape (the timestep mid-schedule)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for t in manifest["components"]["unet"]["inputs"]:
        shape = t["opt"]
        feeds[t["name"]] = (np.full(shape, 500.0, np.float32) if t["name"] == "timestep"
                            else rng.standard_normal(shape).astype(np.float32))
    return feeds


def time_unet(artifact: Path, feeds: dict[str, np.ndarray], runs: int, threads: int | None) -> dict[str, Any]:
    """Median/min latency (ms) of one UNet step in ONNX Runtime's CPU provider, and the output."""
    from diffusion_trt.compiler.quantize import cpu_session

    sess = cpu_session(artifact / "unet" / "model.onnx", threads)
    for _ in range(2):
        out = sess.run(["noise_pred"], feeds)[0]
    times = []
    load_before = os.getloadavg()
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(["noise_pred"], feeds)
        times.append((time.perf_counter() - t0) * 1000)
    size = sum(p.stat().st_size for p in (artifact / "unet").glob("model.onnx*"))
    threads_used = int(sess.get_session_options().intra_op_num_threads) or os.cpu_count()
    return {"median_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2), "runs": runs,
            "all_ms": [round(t, 1) for t in times], "intra_op_threads": threads_used,
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()], "unet_bytes": size, "output": out}


def compile_both(model_dir: Path, work: Path, args: argparse.Namespace) -> tuple[Path, Path, dict[str, Any]]:
    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig, QuantizeConfig

    fp32 = work / "fp32"
    if not (args.reuse_fp32 and (fp32 / "manifest.json").is_file()):
        fp32 = compile_pipeline(model_dir, fp32, CompileConfig(components=("unet",), timing_cache=None),
                                overwrite=True)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    q = QuantizeConfig(size=args.calibration_size, steps=args.calibration_steps, accept_quality_loss=True)
    int8 = compile_pipeline(model_dir, work / "int8",
                            CompileConfig(components=("unet",), precision="int8", quantize=q, timing_cache=None),
                            overwrite=True)
    manifest = json.loads((int8 / "manifest.json").read_text())
    unet = manifest["components"]["unet"]
    quant = unet["quantization"]
    cal = quant["calibration"]
    return fp32, int8, {
        "int8_compile_seconds": round(time.perf_counter() - t0, 1),
        "int8_compile_load_average": {"before": [round(x, 2) for x in load_before],
                                      "after": [round(x, 2) for x in os.getloadavg()]},
        # where the int8 compile's time went (seconds); "loop" = the calibration loop with its range collection
        "stages_seconds": {"export": unet.get("export_seconds"), "calibration_loop": cal.get("capture_seconds"),
                           "ranges": quant.get("ranges_seconds"), "write_qdq": quant.get("qdq_seconds"),
                           "quantize_onnx_total": quant.get("seconds"), "quality_gate": unet["quality"]["seconds"]},
        "calibration": cal, "quantize_seconds": quant["seconds"], "quality": unet["quality"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp32", type=Path, help="fp32 ORT CPU artifact")
    ap.add_argument("--int8", type=Path, help="int8 ORT CPU artifact")
    ap.add_argument("--model-dir", type=Path, help="compile both from this pipeline folder instead")
    ap.add_argument("--work", type=Path, default=Path("artifacts/int8-bench"))
    ap.add_argument("--calibration-size", type=int, default=8)
    ap.add_argument("--calibration-steps", type=int, default=4)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--reuse-fp32", action="store_true", help="with --model-dir: keep WORK/fp32 if it exists")
    ap.add_argument("-v", "--verbose", action="store_true", help="log the compile (INFO) and the loop's progress")
    args = ap.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        logging.getLogger("diffusion_trt.compiler.calibrate").setLevel(logging.DEBUG)
    extra: dict[str, Any] = {}
    if args.model_dir is not None:
        fp32, int8, extra = compile_both(args.model_dir, args.work, args)
    elif args.fp32 and args.int8:
        fp32, int8 = args.fp32, args.int8
    else:
        ap.error("pass --fp32 and --int8, or --model-dir")
    feeds = unet_feeds(json.loads((fp32 / "manifest.json").read_text()))
    a = time_unet(fp32, feeds, args.runs, args.threads)
    b = time_unet(int8, feeds, args.runs, args.threads)
    from diffusion_trt.compiler.quantize import cosine

    report = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "shape": {k: list(v.shape) for k, v in feeds.items()},
        "fp32": {k: v for k, v in a.items() if k != "output"},
        "int8": {k: v for k, v in b.items() if k != "output"},
        "speedup": round(a["median_ms"] / b["median_ms"], 3),
        "cosine_int8_vs_fp32": round(cosine(a["output"], b["output"]), 6),
        "int8_over_fp32_bytes": round(b["unet_bytes"] / a["unet_bytes"], 4),
        **extra,
        # ru_maxrss: KiB on Linux; the largest process of this run (the compile runs in it)
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    print(f"UNet step, ORT CPU, {report['shape']['sample']}: fp32 {a['median_ms']} ms, int8 {b['median_ms']} ms "
          f"(x{report['speedup']}); size {a['unet_bytes'] / 1e6:.1f} -> {b['unet_bytes'] / 1e6:.1f} MB; "
          f"cosine {report['cosine_int8_vs_fp32']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()

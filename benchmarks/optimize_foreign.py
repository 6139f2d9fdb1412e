"""``optimize`` on ONNX graphs that no one here wrote: per-pass counts, rejections, parity, fp16 islands.

    python benchmarks/optimize_foreign.py MODEL.onnx [MODEL.onnx ...] \\
        [--inputs MODEL.onnx=inputs.npz] [--shape MODEL.onnx=x:1x3x48x320] [--source MODEL.onnx="pkg 1.0: path"] \\
        --out benchmarks/results/cpu-2core-2026-12-01-optimize-foreign.json

For each file and each (target, precision) of :data:`RUNS` it calls :func:`diffusion_trt.optimize.optimize_file`
with ``check=True`` (original vs optimized in ONNX Runtime, CPU or CUDA, whichever can run each graph) and
stores the result (``OptimizeResult.to_json``) with the file's sha256; a run that fails stores the error. The
files themselves are not in the repository (their licences are their packages'): benchmarks/results/README.md
names the packages and paths.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

RUNS: tuple[tuple[str, str], ...] = (("ort-cpu", "fp32"), ("ort-cuda", "fp32"), ("tensorrt", "fp32"),
                                     ("tensorrt", "fp16"), ("ort-cuda", "fp16"))


def _pairs(items: list[str], flag: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        path, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{flag} {item!r}: expected MODEL.onnx=VALUE")
        out.setdefault(str(Path(path)), []).append(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--inputs", action="append", default=[], help="MODEL.onnx=inputs.npz")
    ap.add_argument("--shape", action="append", default=[], help="MODEL.onnx=name:1x3x48x320 (repeatable)")
    ap.add_argument("--source", action="append", default=[], help='MODEL.onnx="package version: path in wheel"')
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import onnx
    import onnxruntime

    from diffusion_trt.optimize import optimize_file, parse_shape

    inputs, shapes, sources = _pairs(args.inputs, "--inputs"), _pairs(args.shape, "--shape"), _pairs(args.source,
                                                                                                        "--source")
    models = []
    for path in args.models:
        key = str(path)
        entry = {"file": path.name, "source": (sources.get(key) or [""])[0],
                 "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "bytes": path.stat().st_size,
                 "inputs": (inputs.get(key) or [None])[0], "shapes": shapes.get(key, []), "runs": []}
        for target, precision in RUNS:
            t0 = time.perf_counter()
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    result = optimize_file(
                        path, Path(tmp) / "out.onnx", target=target, precision=precision, check=True,
                        inputs=Path(entry["inputs"]) if entry["inputs"] else None,
                        shapes=dict(parse_shape(s) for s in entry["shapes"]))
                    run = result.to_json()
                    run.pop("files")
                except Exception as err:  # noqa: BLE001 - recorded: a refusal is a result too
                    run = {"target": target, "precision": precision, "error": f"{type(err).__name__}: {err}"}
            run["seconds"] = round(time.perf_counter() - t0, 2)
            entry["runs"].append(run)
            print(f"{path.name} {target}/{precision}: {run.get('error') or 'ok'} ({run['seconds']} s)",
                  file=sys.stderr)
        models.append(entry)
    data = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip() + ", 2 cores (shared)",
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "providers": onnxruntime.get_available_providers(), "models": models}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Can sessions of one graph at several static sizes share one device copy of its weights? (issue 28)

    python benchmarks/shared_initializers.py ARTIFACT [--component unet] [--latents 64x64,96x96,80x48]
        [--batch 2] [--layouts nhwc,nchw] [--device cuda] --json OUT.json

Why: a dynamic artifact's first call at a new size opens a session with the size's symbolic dims fixed
(``add_free_dimension_override_by_name``), and each such session holds its own copy of the weights (s12 on the
H200: device memory 8979 -> 17221 -> 20651 MiB over three sizes). ONNX Runtime's
``SessionOptions.add_initializer(name, OrtValue)`` hands a session a tensor the caller owns; ORT uses it in place
when it already lies where the session plans it (microsoft/onnxruntime PR 5092, issue 29009), so one upload could
serve every size. The NHWC layout transform writes transposed Conv weights as new initializers, which would stay
per-session copies: both layouts are measured.

Each (layout, mode) runs in a fresh process. ``plain``: one session per latent size, the weights read from the
artifact by each; ``shared``: every initializer uploaded once as an ``OrtValue`` on the device, then one session per
size with ``add_initializer`` for all of them. Per size: session-creation seconds, device memory used after it and
after the first run (``torch.cuda.mem_get_info``: the whole device, MiB), first-run seconds, median warm ms of 5.
The parent compares each size's output of ``shared`` with ``plain`` (max abs). Seeded random feeds.
A benchmark for a GPU host (or the CPU with ``--device cpu``, where memory is not measured), not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _mib_used() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


def _dims(model, latent: tuple[int, int], batch: int) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """Free-dimension values and the input shapes at one latent size: dim 0 is the batch, a 4-D input's dims 2/3
    are the latent h/w (x8 for a 3-channel image), a 3-D input's dim 1 is the 77-token sequence."""
    free: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for inp in model.graph.input:
        dims = inp.type.tensor_type.shape.dim
        shape = []
        for i, d in enumerate(dims):
            if d.dim_param:
                scale = 8 if len(dims) == 4 and dims[1].dim_value == 3 else 1
                value = (batch if i == 0 else latent[i - 2] * scale if len(dims) == 4 and i >= 2
                         else 77 if len(dims) == 3 and i == 1 else None)
                if value is None:
                    raise SystemExit(f"error: no rule for dim {d.dim_param!r} of input {inp.name!r}")
                free[d.dim_param] = value
                shape.append(value)
            else:
                shape.append(d.dim_value)
        shapes[inp.name] = tuple(shape)
    return free, shapes


def _feeds(model, shapes, seed: int):
    import numpy as np
    from onnx.helper import tensor_dtype_to_np_dtype

    rng = np.random.default_rng(seed)
    feeds = {}
    for inp in model.graph.input:
        dtype = tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)
        value = rng.standard_normal(shapes[inp.name]) if np.issubdtype(dtype, np.floating) else \
            rng.integers(0, 1000, shapes[inp.name])
        feeds[inp.name] = value.astype(dtype)
    return feeds


def _upload(onnx_path: Path, device: str) -> tuple[dict, float]:
    """Every initializer of the graph as an OrtValue on ``device`` (kept alive by the returned dict)."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    t = time.perf_counter()
    model = onnx.load(str(onnx_path), load_external_data=True)
    values = {}
    for init in model.graph.initializer:
        array = numpy_helper.to_array(init)
        values[init.name] = ort.OrtValue.ortvalue_from_numpy(array, device, 0) if device == "cuda" else \
            ort.OrtValue.ortvalue_from_numpy(array)
    return values, time.perf_counter() - t


def one(art: str, component: str, layout: str, mode: str, latents, batch: int, device: str, out_dir: Path) -> dict:
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch

    from diffusion_trt.runtime.pipeline import cuda_layout_options

    if device == "cuda":
        torch.zeros(1, device="cuda")
    onnx_path = Path(art) / component / "model.onnx"
    graph = onnx.load(str(onnx_path), load_external_data=False)
    options = {**cuda_layout_options(component, device), "cudnn_conv_algo_search": "HEURISTIC"}
    options["prefer_nhwc"] = "1" if layout == "nhwc" else "0"
    providers = [("CUDAExecutionProvider", options), "CPUExecutionProvider"] if device == "cuda" else \
        ["CPUExecutionProvider"]
    row: dict = {"component": component, "layout": layout, "mode": mode, "options": options,
                 "mib_start": _mib_used(), "sizes": []}
    shared = None
    if mode == "shared":
        shared, row["upload_s"] = _upload(onnx_path, device)
        row["mib_after_upload"] = _mib_used()
        row["initializers"] = len(shared)
    sessions = []  # kept open: the point is what several open sessions hold together
    for latent in latents:
        free, shapes = _dims(graph, latent, batch)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        for name, value in free.items():
            so.add_free_dimension_override_by_name(name, value)
        for name, value in (shared or {}).items():
            so.add_initializer(name, value)
        t = time.perf_counter()
        sess = ort.InferenceSession(str(onnx_path), so, providers=providers)
        size = {"latent": list(latent), "free_dims": free, "session_s": time.perf_counter() - t,
                "mib_after_session": _mib_used()}
        feeds = _feeds(graph, shapes, seed=0)
        t = time.perf_counter()
        out = sess.run(None, feeds)[0]
        size["first_run_s"] = time.perf_counter() - t
        size["mib_after_first_run"] = _mib_used()
        warm = []
        for _ in range(5):
            t = time.perf_counter()
            sess.run(None, feeds)
            warm.append((time.perf_counter() - t) * 1e3)
        size["warm_ms"] = statistics.median(warm)
        np.save(out_dir / f"{layout}-{mode}-{latent[0]}x{latent[1]}.npy", out)
        sessions.append(sess)
        row["sizes"].append(size)
    row["mib_end"] = _mib_used()
    return row


def main() -> None:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--component", default="unet")
    ap.add_argument("--latents", default="64x64,96x96,80x48")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--layouts", default="nhwc,nchw")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--outputs", default="/tmp/shared_initializers")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # layout:mode, in the child process
    ns = ap.parse_args()
    latents = [tuple(int(v) for v in s.split("x")) for s in ns.latents.split(",") if s]
    out_dir = Path(ns.outputs)
    out_dir.mkdir(parents=True, exist_ok=True)
    if ns.one:
        layout, mode = ns.one.split(":")
        row = one(ns.artifact, ns.component, layout, mode, latents, ns.batch, ns.device, out_dir)
        print(json.dumps(row), flush=True)
        return
    rows = []
    for layout in ns.layouts.split(","):
        for mode in ("plain", "shared"):
            args = [sys.executable, __file__, ns.artifact, "--one", f"{layout}:{mode}", "--component", ns.component,
                    "--latents", ns.latents, "--batch", str(ns.batch), "--device", ns.device,
                    "--outputs", str(out_dir)]
            proc = subprocess.run(args, capture_output=True, text=True)
            if proc.returncode != 0:
                err = proc.stderr.strip().splitlines()[-3:]
                rows.append({"layout": layout, "mode": mode, "rc": proc.returncode, "error": err})
                print(layout, mode, "failed:", err, flush=True)
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            if mode == "shared":
                for size in row["sizes"]:
                    tag = f"{size['latent'][0]}x{size['latent'][1]}"
                    a = np.load(out_dir / f"{layout}-plain-{tag}.npy").astype(np.float32)
                    b = np.load(out_dir / f"{layout}-shared-{tag}.npy").astype(np.float32)
                    size["max_abs_vs_plain"] = float(np.abs(a - b).max())
            rows.append(row)
            upload = f" upload {row['upload_s']:.2f} s -> {row['mib_after_upload']} MiB;" if mode == "shared" else ""
            print(f"{layout} {mode:6s} start {row['mib_start']} MiB;{upload}", flush=True)
            for s in row["sizes"]:
                print(f"   {s['latent']}: session {s['session_s']:.2f} s -> {s['mib_after_session']} MiB, first run "
                      f"{s['first_run_s']:.3f} s -> {s['mib_after_first_run']} MiB, warm {s['warm_ms']:.2f} ms"
                      + (f", max abs vs plain {s['max_abs_vs_plain']:.3g}" if "max_abs_vs_plain" in s else ""),
                      flush=True)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"artifact": ns.artifact, "component": ns.component, "batch": ns.batch, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()

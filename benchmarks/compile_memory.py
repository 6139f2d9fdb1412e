"""Peak host memory of a compile, per stage (issue 28).

    python benchmarks/compile_memory.py --json OUT.json -- compile MODEL -o ART [compile options...]

Runs ``diffusion-trt`` in this process with a thread sampling the resident set size (``/proc/self/statm``) every
20 ms, and wraps :func:`diffusion_trt.compiler.pipeline.stage` so every stage (``load models``, ``export of unet``,
``passes of unet``, ``build of unet``...) records the RSS when it starts and ends and the largest RSS sampled while it
ran. Stages nest (a component's passes run inside its compile), so a parent's peak includes its children's.
Each stage also gets ``disk_read_gb`` (what the disk gave it, the page cache apart) and ``peak_anon_gb``, the
largest anonymous share sampled (RSS less its file-backed pages: torch maps the safetensors weights, which count in
the RSS but are clean pages the kernel may drop under memory pressure, as in a memory cgroup at its limit, and read
again). The JSON also has the process's ``VmHWM`` (the kernel's own peak) and the wall time. ``--per-pass`` adds a
stage per pass (``pass convert_fp16``) and per step of the fp16 range check (``activation_peaks``, ``ORT
session``...), and splits the export stage (``torch.onnx.export``, inside it ``trace and constant folding``; the
rest of the export stage reads the exported files back).

The JSON is rewritten every few seconds while the compile runs (``"complete": false``, the stages still open under
``open_stages`` with their peak so far), so a compile killed for memory (an OOM kill in a memory cgroup) still
leaves the stage it died in and the RSS it had reached.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Iterator

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def rss_split_bytes() -> tuple[int, int]:
    """(resident, of which file-backed or shared): ``statm``'s resident and shared pages. Weights torch maps from
    safetensors files are file-backed pages: counted in the RSS, but clean, so the kernel may drop them under
    memory pressure (a memory cgroup's limit) and read them again; anonymous pages it cannot drop without swap."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return int(fields[1]) * PAGE, int(fields[2]) * PAGE


def disk_read_bytes() -> int:
    """Bytes this process made the kernel read from the disk (``/proc/self/io`` read_bytes: page-cache misses, not
    reads the cache served)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def vm_hwm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler(threading.Thread):
    """Samples RSS; every open stage keeps the largest sample seen since it opened."""

    def __init__(self, period: float = 0.02, on_tick=None, tick_every: int = 100) -> None:
        super().__init__(daemon=True)
        self.period = period
        self.on_tick = on_tick  # called every tick_every samples, outside the lock (the partial JSON)
        self.tick_every = tick_every
        self.open: dict[int, dict] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.peak = 0
        self.peak_anon = 0

    def run(self) -> None:
        n = 0
        while not self.stop.wait(self.period):
            rss, shared = rss_split_bytes()
            with self.lock:
                self.peak = max(self.peak, rss)
                self.peak_anon = max(self.peak_anon, rss - shared)
                for row in self.open.values():
                    row["peak_rss_gb"] = max(row["peak_rss_gb"], rss / 1e9)
                    row["peak_anon_gb"] = max(row.get("peak_anon_gb", 0.0), (rss - shared) / 1e9)
            n += 1
            if self.on_tick is not None and n % self.tick_every == 0:
                self.on_tick()


def measure_passes(pipeline) -> None:
    """Every pass of the compile's pipelines, and the range check's session work, as stages of their own (the
    stage looked up at call time: the measured one)."""
    from diffusion_trt import passes
    from diffusion_trt.passes import _ort, base, fp16_check

    def staged(fn, label: str):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with pipeline.stage(label, None):
                return fn(*args, **kwargs)
        return inner

    real_for = passes.pipeline_for
    passes.pipeline_for = lambda *a, **k: tuple(staged(p, f"pass {base.pass_name(p)}") for p in real_for(*a, **k))
    fp16_check.optimize_model = staged(fp16_check.optimize_model, "optimize_model")
    for name in ("_calibrate", "_nonfinite_tensors", "_check_parity"):
        setattr(fp16_check, name, staged(getattr(fp16_check, name), f"fp16_check.{name}"))
    _ort.activation_peaks = staged(_ort.activation_peaks, "activation_peaks")
    _ort._session = staged(_ort._session, "ORT session")
    # the export stage's parts: torch's exporter (of which trace + constant folding), then reading its files back
    from torch.onnx._internal.torchscript_exporter import utils as ts_utils

    from diffusion_trt.compiler import export

    export.onnx_from_component = staged(export.onnx_from_component, "torch.onnx.export")
    ts_utils._model_to_graph = staged(ts_utils._model_to_graph, "trace and constant folding")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--per-pass", action="store_true",
                    help="also one stage per pass ('pass fold_constants'...) and per range-check step "
                         "(activation_peaks, ORT session, parity)")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then the diffusion-trt command line")
    ns = ap.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args

    from diffusion_trt import cli
    from diffusion_trt.compiler import pipeline

    rows: list[dict] = []
    real_stage = pipeline.stage

    def result(complete: bool) -> dict:
        with sampler.lock:
            open_rows = sorted((dict(r, rss_now_gb=rss_bytes() / 1e9) for r in sampler.open.values()),
                               key=lambda r: r["t_start_s"])
            done = sorted((dict(r) for r in rows), key=lambda r: r["t_start_s"])
        res = {"argv": args, "complete": complete, "wall_s": time.perf_counter() - t0,
               "vm_hwm_gb": vm_hwm_bytes() / 1e9, "sampled_peak_gb": sampler.peak / 1e9,
               "sampled_peak_anon_gb": sampler.peak_anon / 1e9, "stages": done}
        if open_rows:
            res["open_stages"] = open_rows
        return res

    def write(res: dict) -> None:
        tmp = ns.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
        os.replace(tmp, ns.json)

    sampler = Sampler(on_tick=lambda: write(result(False)))

    @contextlib.contextmanager
    def measured(name: str, component: str | None = None) -> Iterator[None]:
        row = {"stage": name, "component": component, "start_rss_gb": rss_bytes() / 1e9, "t_start_s": 0.0}
        read0 = disk_read_bytes()
        row["peak_rss_gb"] = row["start_rss_gb"]
        row["t_start_s"] = time.perf_counter() - t0
        with sampler.lock:
            sampler.open[id(row)] = row
        try:
            with real_stage(name, component):
                yield
        finally:
            with sampler.lock:
                sampler.open.pop(id(row), None)
            row["end_rss_gb"] = rss_bytes() / 1e9
            row["peak_rss_gb"] = max(row["peak_rss_gb"], row["end_rss_gb"])
            row.setdefault("peak_anon_gb", 0.0)
            row["seconds"] = time.perf_counter() - t0 - row["t_start_s"]
            row["disk_read_gb"] = (disk_read_bytes() - read0) / 1e9
            with sampler.lock:
                rows.append(row)

    pipeline.stage = measured
    if ns.per_pass:
        measure_passes(pipeline)
    t0 = time.perf_counter()
    sampler.start()
    rc = 0
    try:
        cli.main.main(args=args, standalone_mode=False)
    except SystemExit as e:
        rc = int(e.code or 0)
    except Exception as e:  # noqa: BLE001 - reported in the JSON
        rc = 1
        print(f"compile failed: {type(e).__name__}: {e}", file=sys.stderr)
    sampler.stop.set()
    sampler.join()
    res = {"rc": rc, **result(True)}
    write(res)
    print(f"rc={rc} wall {res['wall_s']:.1f} s, VmHWM {res['vm_hwm_gb']:.2f} GB, "
          f"anonymous peak {res['sampled_peak_anon_gb']:.2f} GB")
    for r in res["stages"]:
        print(f"  {r['stage']:<28} {r['component'] or '':<14} peak {r['peak_rss_gb']:6.2f} GB  "
              f"(anon {r['peak_anon_gb']:6.2f})  "
              f"start {r['start_rss_gb']:6.2f}  end {r['end_rss_gb']:6.2f}  {r['seconds']:7.1f} s")
    sys.exit(rc)


if __name__ == "__main__":
    main()

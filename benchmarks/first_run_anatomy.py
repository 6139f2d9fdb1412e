"""Where a component's first run goes (issue 28): per operator, per session, per thread, per process.

    python benchmarks/first_run_anatomy.py ARTIFACT [--component unet] [--cases profile,sessions,...]
        [--cudnn HEURISTIC] --json OUT.json

Why: the SD-1.5 UNet's first run (1.0-1.2 s on the H100, ``h100-2026-12-07-s22-cold-start-variants.json``) is the
largest single step left between ``from_artifacts`` and the first image, and whether any of it can move off that
path depends on what it is made of: cost bound to the session (cuDNN plans per node, the arena's first allocations),
to the thread that runs, or to the process (CUDA kernels loaded lazily on first launch, cuDNN / cuBLAS libraries)
that something earlier could pay. Each case runs in a fresh process (the OS page cache warm), the engine opened as
the pipeline opens it (``OrtEngine``, the runtime's CUDA provider options, one user stream), eager unless named:

* ``profile``: ONNX Runtime's profiler over the first and the second run: host time per operator type and the
  slowest nodes of the first run (for the CUDA provider a node's time is its launch, plus whatever the first launch
  settles: algorithm choice, plan build, kernel load, arena growth);
* ``sessions``: a second session of the same model in the same process, after the first one's first run;
* ``threads``: the first run on one thread, then a first run on a second thread, then on the main thread;
* ``graph``: CUDA-graph mode, ``capture()`` on the main thread (the load's critical step: its regular run + capture);
* ``graph-primed``: CUDA-graph mode, ``prime()`` on another thread first, then ``capture()`` on the main thread;
* ``torch-warm``: torch runs fp16 NHWC convolutions, matmuls and attention at the UNet's shapes first (cuDNN and
  cuBLAS loaded and their kernels launched once in this process), then the engine's first run;
* ``eager-modules``: ``CUDA_MODULE_LOADING=EAGER`` (every kernel loaded with its library), then the first run;
* ``arena-same``: the CUDA provider's ``arena_extend_strategy=kSameAsRequested`` (the arena grows by what is asked,
  not by powers of two);
* ``cudnn-default``: ``cudnn_conv_algo_search=DEFAULT`` (no cuDNN query per convolution: a fixed algorithm);
* ``workspace0``: ``cudnn_conv_use_max_workspace=0`` (cuDNN's algorithms limited to a small workspace: fewer and
  smaller allocations in the first run).

The plain cases (``torch-warm`` and after) also time the warm run (median of 10, ``warm_ms``): an option that
shortens the first run must not slow every later one.

A benchmark for a GPU host, not a test. Seconds unless named ``_ms``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time

CASES = ("profile", "sessions", "threads", "graph", "graph-primed", "torch-warm", "eager-modules", "arena-same",
         "cudnn-default", "workspace0")
#: CUDA provider options of a case, over the runtime's own
CASE_OPTIONS = {"arena-same": {"arena_extend_strategy": "kSameAsRequested"},
                "workspace0": {"cudnn_conv_use_max_workspace": "0"}}


def _engine(art: str, component: str, cudnn: str, *, graph: bool = False, session_options=None, options=None):
    import torch

    from diffusion_trt.artifact.reader import ArtifactReader
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine
    from diffusion_trt.runtime.pipeline import cuda_layout_options

    entry = ArtifactReader.open(art).manifest.components[component]
    return OrtEngine(os.path.join(art, entry.onnx), entry.spec, name=component, device="cuda",
                     stream=torch.cuda.Stream(), cudnn_conv_algo_search=cudnn, cuda_graph=graph,
                     provider_options={**cuda_layout_options(component, "cuda"), **(options or {})},
                     session_options=session_options)


def _timed(fn) -> float:
    import torch

    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def _on_thread(fn) -> float:
    out: list[float] = []
    th = threading.Thread(target=lambda: out.append(_timed(fn)))
    th.start()
    th.join()
    return out[0]


def _open(engine) -> float:
    return _timed(engine.__enter__)


def _run(engine):
    return lambda: engine.run(engine.spec.zero_feeds(engine.device))


def _profile_rows(path: str, top: int) -> dict:
    """Per run (the profiler's ``model_run`` events, in order): host ms per operator type, and the slowest nodes."""
    with open(path) as f:
        events = json.load(f)
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    out = []
    for start, end in runs[:2]:
        per_op: collections.Counter = collections.Counter()
        nodes = []
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and start <= e["ts"] <= end:
                op = e.get("args", {}).get("op_name", "?")
                per_op[op] += e["dur"] / 1e3
                nodes.append((e["dur"] / 1e3, e["name"][: -len("_kernel_time")], op))
        nodes.sort(reverse=True)
        out.append({"run_ms": (end - start) / 1e3, "nodes_ms": sum(per_op.values()), "nodes": len(nodes),
                    "per_op_ms": dict(per_op.most_common()), "slowest": [list(n) for n in nodes[:top]]})
    return {"runs": out}


def _torch_warm() -> float:
    """fp16 channels-last 3x3 convolutions, matmuls and attention at the SD-1.5 UNet's 512x512 shapes."""
    import torch
    import torch.nn.functional as F

    def work():
        dev = "cuda"
        for ch, hw in ((320, 64), (640, 32), (1280, 16), (1280, 8)):
            x = torch.zeros(1, ch, hw, hw, device=dev, dtype=torch.float16).to(memory_format=torch.channels_last)
            w = torch.zeros(ch, ch, 3, 3, device=dev, dtype=torch.float16).to(memory_format=torch.channels_last)
            F.conv2d(x, w, padding=1)
            tokens, heads = hw * hw, 8
            q = torch.zeros(1, heads, tokens, ch // heads, device=dev, dtype=torch.float16)
            F.scaled_dot_product_attention(q, q, q)
            kv = torch.zeros(1, heads, 77, ch // heads, device=dev, dtype=torch.float16)
            F.scaled_dot_product_attention(q, kv, kv)
            a = torch.zeros(tokens, ch, device=dev, dtype=torch.float16)
            a @ torch.zeros(ch, 4 * ch, device=dev, dtype=torch.float16)
    return _timed(work)


def one(art: str, component: str, case: str, cudnn: str, top: int) -> dict:
    import torch

    row: dict = {"case": case, "cuda_init_s": _timed(lambda: torch.zeros(1, device="cuda"))}
    if case == "profile":
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = f"/tmp/first_run_anatomy_{os.getpid()}"
        engine = _engine(art, component, cudnn, session_options=so)
        row["session_s"] = _open(engine)
        row["first_run_s"], row["second_run_s"] = _timed(_run(engine)), _timed(_run(engine))
        path = engine._session.end_profiling()
        row.update(_profile_rows(path, top))
        os.unlink(path)
    elif case == "sessions":
        a, b = _engine(art, component, cudnn), _engine(art, component, cudnn)
        row["session_s"] = _open(a)
        row["first_run_s"] = _timed(_run(a))
        row["session_b_s"] = _open(b)
        row["first_run_b_s"], row["second_run_b_s"] = _timed(_run(b)), _timed(_run(b))
    elif case == "threads":
        engine = _engine(art, component, cudnn)
        row["session_s"] = _open(engine)
        row["first_run_thread1_s"] = _on_thread(_run(engine))
        row["first_run_thread2_s"] = _on_thread(_run(engine))
        row["first_run_main_s"], row["second_run_main_s"] = _timed(_run(engine)), _timed(_run(engine))
    elif case in ("graph", "graph-primed"):
        engine = _engine(art, component, cudnn, graph=True)
        row["session_s"] = _open(engine)
        if case == "graph-primed":
            row["prime_thread_s"] = _on_thread(engine.prime)
        row["capture_main_s"] = _timed(engine.capture)
        row["replay_s"] = _timed(_run(engine))
    else:  # torch-warm, eager-modules, arena-same, cudnn-default, workspace0
        if case == "torch-warm":
            row["torch_warm_s"] = _torch_warm()
        engine = _engine(art, component, "DEFAULT" if case == "cudnn-default" else cudnn,
                         options=CASE_OPTIONS.get(case))
        row["session_s"] = _open(engine)
        row["first_run_s"], row["second_run_s"] = _timed(_run(engine)), _timed(_run(engine))
        row["warm_ms"] = statistics.median(_timed(_run(engine)) * 1e3 for _ in range(10))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--component", default="unet")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--cudnn", default="HEURISTIC")
    ap.add_argument("--top", type=int, default=15, help="slowest nodes of the profiled first run to keep")
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the case, in the child process
    ns = ap.parse_args()
    if ns.one:
        print(json.dumps(one(ns.artifact, ns.component, ns.one, ns.cudnn, ns.top)), flush=True)
        return
    rows = []
    for case in ns.cases.split(","):
        env = dict(os.environ, **({"CUDA_MODULE_LOADING": "EAGER"} if case == "eager-modules" else {}))
        args = [sys.executable, __file__, ns.artifact, "--component", ns.component, "--one", case, "--cudnn", ns.cudnn,
                "--top", str(ns.top)]
        t = time.perf_counter()
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
        if proc.returncode != 0:
            rows.append({"case": case, "rc": proc.returncode, "error": proc.stderr.strip().splitlines()[-3:]})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        rows[-1]["process_wall_s"] = time.perf_counter() - t
        brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items() if k != "runs"}
        print(json.dumps(brief), flush=True)
        for i, run in enumerate(rows[-1].get("runs", [])):
            ops = ", ".join(f"{k} {v:.0f}" for k, v in list(run["per_op_ms"].items())[:10])
            print(f"  run {i + 1}: {run['run_ms']:.0f} ms, nodes {run['nodes_ms']:.0f} ms ({run['nodes']}): {ops}")
            if i == 0:
                for ms, node, op in run["slowest"]:
                    print(f"    {ms:8.1f} ms {op:22s} {node}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"artifact": ns.artifact, "component": ns.component, "cudnn": ns.cudnn, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()

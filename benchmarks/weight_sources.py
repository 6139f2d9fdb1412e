"""Where an ONNX Runtime session's weights come from, and what that costs at load (issue 28).

    python benchmarks/weight_sources.py ARTIFACT [--components unet,text_encoder,vae_decoder]
        [--modes path,files,initializers] [--repeat 2] [--json OUT.json]

Per component and mode, each in a fresh process: an :class:`~diffusion_trt.runtime.engines.ort_engine.OrtEngine`
as the pipeline makes it (the component's CUDA layout options, cuDNN HEURISTIC, CUDA graph), timing

* ``read_s``: the artifact reader's read and sha256 before the engine opens (``files``; 0 otherwise);
* ``session_s``: the engine's open (``spill``: the read and sha256 into the private folder included);
  ``open_s`` = both; ``first_run_s`` / ``capture_run_s``: the first two runs (the second captures the CUDA graph);
  ``warm_ms``: median of 20 runs;
* ``checksum``: the sum of the first output on seeded random inputs, to tell the modes give the same graph;
* ``rss_gb``: the process's resident memory after the runs (the host copy of the weights, if one is kept).

Modes: ``path`` = ORT opens the artifact's files itself (no verification: the reference), ``files`` = the
verified bytes handed over from memory (``add_external_initializers_from_files_in_memory``: the runtime before the
sixteenth session), ``spill`` = the runtime now: the verified bytes read into files of a private folder that ORT
opens by path (``ArtifactReader.onnx(spill=)``). The sixteenth session's first run also had ``initializers``
(``add_external_initializers`` with ``OrtValue`` views of the verified bytes): no faster than ``files``, removed.
A benchmark, not a test; CUDA when torch sees it, else CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e6
    return float("nan")


def measure(art: str, component: str, mode: str) -> dict:
    """One component in one mode, in this process."""
    import functools

    import torch

    from diffusion_trt.artifact.reader import ArtifactReader
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine
    from diffusion_trt.runtime.pipeline import cuda_layout_options

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.zeros(1, device=device)
    reader = ArtifactReader.open(art)
    entry = reader.manifest.components[component]
    row: dict = {"component": component, "mode": mode, "device": device}
    source = data = None
    t = time.perf_counter()
    if mode == "files":
        data = reader.onnx(entry.onnx)
        row["bytes"] = len(data.model) + sum(len(b) for b in data.external.values())

        def source(spill=None, d=data):
            return d
    elif mode == "spill":
        source = functools.partial(reader.onnx, entry.onnx)  # read + hash inside the session's open
    row["read_s"] = time.perf_counter() - t
    stream = torch.cuda.Stream() if device == "cuda" else None
    engine = OrtEngine(art + "/" + entry.onnx, entry.spec, name=component, device=device, stream=stream,
                       cudnn_conv_algo_search="HEURISTIC", provider_options=cuda_layout_options(component, device),
                       cuda_graph=device == "cuda", source=source)
    t = time.perf_counter()
    engine.__enter__()
    row["session_s"] = time.perf_counter() - t
    row["open_s"] = row["read_s"] + row["session_s"]
    del source, data
    g = torch.Generator().manual_seed(0)
    feeds = {}
    for i in engine.spec.inputs:
        shape = tuple(i.max)
        if i.torch_dtype in (torch.int32, torch.int64):
            feeds[i.name] = torch.randint(0, 49407, shape, generator=g).to(i.torch_dtype).to(device)
        else:
            feeds[i.name] = (torch.full(shape, 501.0) if i.name == "timestep"
                             else torch.randn(shape, generator=g)).to(i.torch_dtype).to(device)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for key in ("first_run_s", "capture_run_s"):
            t = time.perf_counter()
            out = engine.run(feeds)
            if device == "cuda":
                torch.cuda.synchronize()
            row[key] = time.perf_counter() - t
        first = next(iter(out.values()))
        row["checksum"] = float(first.float().sum())
        times = []
        for _ in range(20):
            t = time.perf_counter()
            engine.run(feeds)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
    row["warm_ms"] = statistics.median(times)
    row["rss_gb"] = _rss_gb()
    engine.__exit__(None, None, None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--components", default="unet,text_encoder,vae_decoder")
    ap.add_argument("--modes", default="path,files,spill")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("COMPONENT", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.artifact, *args.child)))
        return
    rows = []
    for r in range(args.repeat):
        for component in args.components.split(","):
            for mode in args.modes.split(","):
                proc = subprocess.run([sys.executable, __file__, args.artifact, "--child", component, mode],
                                      capture_output=True, text=True, timeout=600)
                lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
                row = json.loads(lines[-1]) if lines else {"component": component, "mode": mode,
                                                             "error": proc.stderr[-800:]}
                row["repeat"] = r
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"artifact": args.artifact, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Time to the first image, phase by phase, each measurement in a fresh process (issue 28).

    python benchmarks/cold_start.py all ARTIFACT --model-dir MODEL --json OUT.json [--repeat 2] [--steps 30]

``all`` runs, each in a new Python process (so nothing is cached in the process; the OS page cache and the CUDA
compute cache are warm after the first repeat):

* ``phases``: per component (text_encoder, unet, vae_decoder), alone and in turn: read + hash (``ArtifactReader``),
  session creation, first run, second run (the CUDA-graph capture), warm run (median of 20);
* ``first-image``: ``EnginePipeline.from_artifacts`` + one 512x512 image of ``--steps`` steps, per cuDNN search,
  with the marks import torch / import diffusion_trt / from_artifacts / first image / second image and the warm
  UNet step of that configuration;
* ``cli``: ``diffusion-trt run`` of one image, from process start to the PNG (wall clock of the process);
* ``diffusers``: diffusers' own one-shot: ``from_pretrained(fp16)`` -> cuda -> one image -> PNG, same steps;
* ``profile``: cProfile of ``from_artifacts`` + the first image (top functions by cumulative time, and those of
  diffusion_trt alone);
* ``levels``: from_artifacts per ONNX Runtime graph optimisation level: UNet session time and warm step;
* ``first-image-no-prime`` (``--no-prime-variant unet``): first-image (HEURISTIC) with those components not primed
  on their loader threads (the caller's CUDA-graph runs at load make their first run); ``--no-prime-variant none``:
  every component primed on its loader thread (``runtime.loading.CALLER_FIRST_RUN`` emptied: the load before it);
* ``first-image-set`` (``--set-variants 'runtime.schedulers.DEFER_DYNAMO=0;...'``): first-image (HEURISTIC) with
  those module constants set (``--set MODULE.NAME=VALUE``, see ``_apply_sets``), the variants' repeats interleaved;
* ``first-image-sampled`` (``--sample``): first-image (HEURISTIC) with every thread's frame sampled each 10 ms during
  the load and the first call: where each thread's time goes;
* ``first-image-options`` (``--option-variants '{"sdpa_kernel": "1"};{...}'``): first-image (HEURISTIC) with those
  CUDA provider options on every component, one process each.

Prints one line per measurement; the JSON holds every figure (seconds unless named ``_ms``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

T0 = time.perf_counter()
PROMPT = "an ink painting of a mountain above a river, mist, pine trees"


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _zeros(engine):
    import torch

    return {i.name: torch.zeros(tuple(i.min), dtype=i.torch_dtype, device=engine.device) for i in engine.spec.inputs}


def _timed_runs(engine, n: int = 20) -> float:
    """Median ms of ``n`` synchronised runs on zeros."""
    feeds = _zeros(engine)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        engine.run(feeds)
        _sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def phases(art: str, cudnn: str) -> dict:
    """Per component, in turn: read + hash, session, first run, capture run, warm run."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke test of this script only
    t = time.perf_counter()
    torch.zeros(1, device=device)
    out: dict = {"cuda_init_s": time.perf_counter() - t}
    from diffusion_trt.artifact.reader import ArtifactReader
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine
    from diffusion_trt.runtime.pipeline import cuda_layout_options

    t = time.perf_counter()
    reader = ArtifactReader.open(art)
    out["reader_open_s"] = time.perf_counter() - t
    manifest = reader.manifest
    stream = torch.cuda.Stream() if device == "cuda" else None
    for name in ("text_encoder", "unet", "vae_decoder"):
        entry = manifest.components[name]
        row: dict = {}
        t = time.perf_counter()
        data = reader.onnx(entry.onnx)
        row["read_hash_s"] = time.perf_counter() - t
        row["bytes"] = len(data.model) + sum(len(b) for b in data.external.values())
        row["read_hash_gb_per_s"] = row["bytes"] / row["read_hash_s"] / 1e9
        engine = OrtEngine(art + "/" + entry.onnx, entry.spec, name=name, device=device, stream=stream,
                           cudnn_conv_algo_search=cudnn, provider_options=cuda_layout_options(name, device),
                           cuda_graph=device == "cuda", source=lambda spill=None, d=data: d)
        t = time.perf_counter()
        engine.__enter__()
        row["session_s"] = time.perf_counter() - t
        feeds = _zeros(engine)
        for key in ("first_run_s", "capture_run_s"):
            t = time.perf_counter()
            engine.run(feeds)
            _sync()
            row[key] = time.perf_counter() - t
        row["warm_ms"] = _timed_runs(engine)
        row["cuda_graph"] = engine.cuda_graph
        engine.__exit__(None, None, None)
        out[name] = row
        del data
    return out


def _load_timeline() -> dict:
    """A dict that fills with runtime/loading.py's DEBUG timeline of the next load: engine -> seconds from the
    opening's start to its session and warm-up end, and when the caller waited (``OpenTogether.timeline``)."""
    import logging

    got: dict = {}

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if hasattr(record, "marks"):
                got[record.engine] = record.marks

    log = logging.getLogger("diffusion_trt.runtime.loading")
    log.setLevel(logging.DEBUG)
    log.addHandler(Grab())
    return got


def _skip_prime(components: set[str]) -> None:
    """A variant of the load, for this benchmark only: ``components`` are not primed on their loader threads, so
    the caller's own CUDA-graph runs at load (``OpenTogether.wait(capture=True)``) make their first run, on the
    thread that replays (no second per-thread first run)."""
    from diffusion_trt.runtime import loading
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine

    if components == {"none"}:  # every engine primed where it loads
        from diffusion_trt.runtime import pipeline

        for module in (loading, pipeline):
            if hasattr(module, "CALLER_FIRST_RUN"):
                module.CALLER_FIRST_RUN = frozenset()
        return
    prime = OrtEngine.prime
    OrtEngine.prime = lambda self: False if self.name in components else prime(self)


def _apply_sets(sets: list[str]) -> dict:
    """A variant of the load, for this benchmark only: each ``MODULE.NAME=VALUE`` (``MODULE`` under diffusion_trt,
    e.g. ``runtime.schedulers.DEFER_DYNAMO=0``) sets that module constant, and the same name in
    ``runtime.pipeline`` where it imported it. VALUE is read as the constant's type: a bool from 0/1, a frozenset
    from comma-separated names, else int, float or str. Returns what was set."""
    import importlib

    done = {}
    for item in sets:
        target, _, value = item.partition("=")
        module_name, _, name = target.rpartition(".")
        module = importlib.import_module(f"diffusion_trt.{module_name}")
        current = getattr(module, name)
        if isinstance(current, bool):
            new = value.strip().lower() in ("1", "true", "yes")
        elif isinstance(current, frozenset):
            new = frozenset(filter(None, value.split(",")))
        else:
            new = type(current)(value)
        for m in (module, importlib.import_module("diffusion_trt.runtime.pipeline")):
            if hasattr(m, name):
                setattr(m, name, new)
        done[target] = sorted(new) if isinstance(new, frozenset) else new
    return done


class _ThreadSampler:
    """Every ``interval`` seconds, the innermost frame of every thread (``sys._current_frames()``), counted per
    thread name: where each thread of the load spends its time (a thread waiting for the GIL shows the line it
    waits at). For this benchmark only: the sampling takes the GIL itself."""

    def __init__(self, interval: float = 0.01) -> None:
        import threading

        self._interval, self._stop = interval, threading.Event()
        self._counts: dict[str, dict[str, int]] = {}
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def _loop(self) -> None:
        import threading

        me = threading.get_ident()
        while not self._stop.wait(self._interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                code = frame.f_code
                where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}"
                ours = frame
                while ours is not None and "diffusion_trt" not in ours.f_code.co_filename:
                    ours = ours.f_back
                if ours is not None and ours is not frame:
                    where += f" <- {os.path.basename(ours.f_code.co_filename)}:{ours.f_lineno}:{ours.f_code.co_name}"
                per = self._counts.setdefault(names.get(ident, str(ident)), {})
                per[where] = per.get(where, 0) + 1

    def __enter__(self) -> _ThreadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self, top: int = 8) -> dict:
        """thread name -> {"samples", "interval_s", "top": [[where, count], ...]}."""
        return {name: {"samples": sum(c.values()), "interval_s": self._interval,
                       "top": sorted(c.items(), key=lambda kv: -kv[1])[:top]} for name, c in self._counts.items()}


def first_image(art: str, cudnn: str, steps: int, level: str = "all", provider_options: dict | None = None,
                no_prime: str = "", sets: list[str] | None = None, sample: bool = False) -> dict:
    """from_artifacts + the first image (and a second), with marks since the process started; ``provider_options``
    go to ``from_artifacts`` (every component); ``no_prime``: components not primed at load (:func:`_skip_prime`);
    ``sets``: module constants set first (:func:`_apply_sets`); ``sample``: where each thread spends the load and the
    first call (:class:`_ThreadSampler`)."""
    marks = {}
    import torch

    marks["import_torch"] = time.perf_counter() - T0
    import diffusion_trt
    from diffusion_trt import EnginePipeline  # the package imports it lazily: here, not inside the timed load

    marks["import_diffusion_trt"] = time.perf_counter() - T0
    marks["package"] = os.path.dirname(diffusion_trt.__file__)
    timeline = _load_timeline()
    if no_prime:
        _skip_prime(set(no_prime.split(",")))
    applied = _apply_sets(sets or [])
    sampler = _ThreadSampler() if sample else None
    if sampler is not None:
        sampler.__enter__()
    t_load = time.perf_counter()
    extra = {"graph_optimization_level": level} if level != "all" else {}  # a tree before the option had "all"
    if provider_options:
        extra["provider_options"] = provider_options
    pipe = EnginePipeline.from_artifacts(art, cudnn_conv_algo_search=cudnn, **extra)
    marks["from_artifacts"] = time.perf_counter() - T0
    out: dict = {"cudnn": cudnn, "graph_optimization_level": level, "provider_options": provider_options or {},
                 "no_prime": no_prime, "sets": applied}
    out["load_timeline_s"] = dict(timeline)
    out["from_artifacts_s"] = time.perf_counter() - t_load
    images = []
    for key in ("first_call_s", "second_call_s"):
        t = time.perf_counter()
        res = pipe(PROMPT, num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="np",
                   progress=False)
        images.append(res.images)
        out[key] = time.perf_counter() - t
        marks[key.replace("_s", "")] = time.perf_counter() - T0
        if sampler is not None:
            sampler.__exit__()
            out["thread_samples"], sampler = sampler.summary(), None
    out["time_to_first_image_s"] = out["from_artifacts_s"] + out["first_call_s"]
    out["first_call_overhead_s"] = out["first_call_s"] - out["second_call_s"]
    out["unet_warm_ms"] = _timed_runs(pipe.engine("unet"))
    out["images_equal"] = bool((images[0] == images[1]).all())
    out["marks_since_process_start_s"] = marks
    pipe.close()
    return out


def _top(prof: object) -> dict:
    """The top functions of a cProfile by cumulative and by own time, and ours by cumulative time."""
    import pstats

    stats = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append({"function": f"{os.path.basename(file)}:{line}:{fn}", "calls": nc, "tottime_s": tt,
                     "cumtime_s": ct})
    rows.sort(key=lambda r: -r["cumtime_s"])
    by_self = sorted(rows, key=lambda r: -r["tottime_s"])[:25]
    ours = sorted(({"function": f"{file.split('diffusion_trt/')[-1]}:{line}:{fn}", "calls": nc, "tottime_s": tt,
                    "cumtime_s": ct} for (file, line, fn), (_cc, nc, tt, ct, _c) in stats.stats.items()
                   if "diffusion_trt" in file), key=lambda r: -r["cumtime_s"])[:40]
    return {"top_cumulative": rows[:40], "top_self": by_self, "top_diffusion_trt": ours}


def profile(art: str, cudnn: str, steps: int) -> dict:
    """cProfile of from_artifacts, and separately of the first image (what the first call does beyond a warm one):
    the top functions by cumulative time of each."""
    import cProfile

    import torch

    from diffusion_trt import EnginePipeline  # imported lazily by the package: not in the profiled load

    load, first = cProfile.Profile(), cProfile.Profile()
    t = time.perf_counter()
    load.enable()
    pipe = EnginePipeline.from_artifacts(art, cudnn_conv_algo_search=cudnn)
    load.disable()
    t_call = time.perf_counter()
    first.enable()
    pipe(PROMPT, num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="np",
         progress=False)
    first.disable()
    end = time.perf_counter()
    pipe.close()
    return {"total_s": end - t, "first_call_s": end - t_call, **_top(load),
            "first_call": {"total_s": end - t_call, **_top(first)}}


def diffusers_oneshot(model_dir: str, steps: int, png: str) -> dict:
    """diffusers' one-shot: import, from_pretrained fp16 -> cuda -> one image -> PNG."""
    marks = {}
    import torch

    marks["import_torch"] = time.perf_counter() - T0
    from diffusers import StableDiffusionPipeline

    marks["import_diffusers"] = time.perf_counter() - T0
    pipe = StableDiffusionPipeline.from_pretrained(model_dir, torch_dtype=torch.float16, safety_checker=None,
                                                   requires_safety_checker=False)
    marks["from_pretrained"] = time.perf_counter() - T0
    pipe = pipe.to("cuda")
    pipe.set_progress_bar_config(disable=True)
    marks["to_cuda"] = time.perf_counter() - T0
    image = pipe(PROMPT, num_inference_steps=steps, generator=torch.Generator("cuda").manual_seed(0)).images[0]
    marks["first_image"] = time.perf_counter() - T0
    image.save(png)
    marks["png"] = time.perf_counter() - T0
    t = time.perf_counter()
    pipe(PROMPT, num_inference_steps=steps, generator=torch.Generator("cuda").manual_seed(0))
    return {"marks_since_process_start_s": marks, "second_call_s": time.perf_counter() - t}


def _child(args: list[str], timeout: float = 300, env: dict | None = None) -> tuple[dict | None, float, str]:
    """Run this script's subcommand in a fresh process; (its JSON, wall seconds from spawn to exit, stderr tail)."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t
    last = [line for line in p.stdout.splitlines() if line.startswith("{")]
    return (json.loads(last[-1]) if p.returncode == 0 and last else None), wall, p.stderr[-1500:]


def _wall(cmd: list[str], timeout: float = 300) -> tuple[float, int, str]:
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return time.perf_counter() - t, p.returncode, (p.stdout + p.stderr)[-1500:]


def run_all(ns: argparse.Namespace) -> dict:
    ns.artifact = ns.path
    res: dict = {"artifact": ns.artifact, "steps": ns.steps, "repeat": ns.repeat, "rows": []}

    def add(kind: str, args: list[str], env: dict | None = None, **extra: object) -> None:
        data, wall, err = _child(args, env=env)
        row = {"kind": kind, "process_wall_s": wall, **extra, **(data or {"error": err})}
        res["rows"].append(row)
        print(kind, extra, json.dumps({k: v for k, v in (data or {"error": err[-300:]}).items()
                                       if not isinstance(v, (dict, list))}), flush=True)

    for rep in range(ns.repeat):
        for cudnn in ("HEURISTIC", "EXHAUSTIVE"):
            add("first-image", ["first-image", ns.artifact, "--cudnn", cudnn, "--steps", str(ns.steps)],
                repeat=rep, cudnn=cudnn)
        cli = [sys.executable, "-m", "diffusion_trt.cli", "run", ns.artifact, "--prompt", PROMPT, "--steps",
               str(ns.steps), "-o", "/tmp/cold_cli.png", "--overwrite"]
        wall, rc, tail = _wall(cli)
        res["rows"].append({"kind": "cli", "repeat": rep, "process_wall_s": wall, "rc": rc, "tail": tail[-400:]})
        print("cli", rep, round(wall, 3), rc, flush=True)
        if ns.model_dir:
            add("diffusers", ["diffusers", ns.model_dir, "--steps", str(ns.steps), "--png", "/tmp/cold_diffusers.png"],
                repeat=rep)
    add("phases", ["phases", ns.artifact, "--cudnn", "HEURISTIC"], cudnn="HEURISTIC")
    add("phases", ["phases", ns.artifact, "--cudnn", "EXHAUSTIVE"], cudnn="EXHAUSTIVE")
    for level in ns.levels.split(",") if ns.levels else ():
        add("first-image", ["first-image", ns.artifact, "--cudnn", "HEURISTIC", "--steps", str(ns.steps),
                            "--level", level], level=level)
    for variant in filter(None, ns.option_variants.split(";")):
        add("first-image-options", ["first-image", ns.artifact, "--cudnn", "HEURISTIC", "--steps", str(ns.steps),
                                    "--provider-options", variant], options=json.loads(variant))
    for rep in range(ns.repeat):  # interleaved: each variant's repeats see the same host drift
        for variant in filter(None, ns.set_variants.split(";")):
            sets = [a for item in variant.split() for a in ("--set", item)]
            add("first-image-set", ["first-image", ns.artifact, "--cudnn", "HEURISTIC", "--steps", str(ns.steps),
                                    *sets], repeat=rep, variant=variant)
    if ns.sample:
        add("first-image-sampled", ["first-image", ns.artifact, "--cudnn", "HEURISTIC", "--steps", str(ns.steps),
                                    "--sample"])
    for rep in range(ns.repeat if ns.no_prime_variant else 0):
        add("first-image-no-prime", ["first-image", ns.artifact, "--cudnn", "HEURISTIC", "--steps", str(ns.steps),
                                     "--no-prime", ns.no_prime_variant], repeat=rep, no_prime=ns.no_prime_variant)
    add("profile", ["profile", ns.artifact, "--cudnn", "HEURISTIC", "--steps", str(ns.steps)])
    if ns.code_before:  # the same measurement with another tree's package (e.g. main before these changes)
        path = os.pathsep.join(p for p in (os.path.abspath(ns.code_before), os.environ.get("SITE", "")) if p)
        for cudnn in ("HEURISTIC", "EXHAUSTIVE"):
            add("first-image-before", ["first-image", ns.artifact, "--cudnn", cudnn, "--steps", str(ns.steps)],
                env={"PYTHONPATH": path}, cudnn=cudnn)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["all", "phases", "first-image", "profile", "diffusers"])
    ap.add_argument("path")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--cudnn", default="HEURISTIC")
    ap.add_argument("--level", default="all")
    ap.add_argument("--levels", default="basic,extended", help="all: the graph optimisation levels to compare")
    ap.add_argument("--png", default="/tmp/cold.png")
    ap.add_argument("--code-before", default=None, help="a folder holding another diffusion_trt package to compare")
    ap.add_argument("--option-variants", default="",
                    help="all: ';'-separated JSON objects of CUDA provider options, one first-image row each")
    ap.add_argument("--provider-options", default="", help="first-image: a JSON object of CUDA provider options")
    ap.add_argument("--no-prime", default="", help="first-image: components (comma-separated) not primed at load")
    ap.add_argument("--no-prime-variant", default="",
                    help="all: also first-image rows (HEURISTIC, --repeat of them) with --no-prime of these components")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="first-image: set a module constant under diffusion_trt first (benchmark variants)")
    ap.add_argument("--set-variants", default="",
                    help="all: ';'-separated variants, each space-separated --set items: first-image rows "
                         "(HEURISTIC, --repeat of each, interleaved)")
    ap.add_argument("--sample", action="store_true",
                    help="first-image: sample every thread's frame during the load and first call; all: one such row")
    ns = ap.parse_args()
    if ns.what == "all":
        res = run_all(ns)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump(res, f, indent=1)
        return
    fn = {"phases": lambda: phases(ns.path, ns.cudnn),
          "first-image": lambda: first_image(ns.path, ns.cudnn, ns.steps, ns.level,
                                             json.loads(ns.provider_options) if ns.provider_options else None,
                                             ns.no_prime, ns.set, ns.sample),
          "profile": lambda: profile(ns.path, ns.cudnn, ns.steps),
          "diffusers": lambda: diffusers_oneshot(ns.path, ns.steps, ns.png)}[ns.what]
    print(json.dumps(fn()), flush=True)


if __name__ == "__main__":
    main()

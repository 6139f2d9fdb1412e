"""Issue 18 on the GPU host: memory per engine and per stage, with and without a VRAM budget, and the tiled VAE.

Steps (each a separate invocation, each bounded; every failure is recorded in the step's JSON, never aborting the
rest; a step whose inputs exist skips building them)::

    python3 benchmarks/gpu_vram.py build sd15          # dummy-pipeline sd15 -> /tmp/sd15; compile fp16 static 512
    python3 benchmarks/gpu_vram.py measure sd15 4GB    # engine facts, e2e unbounded vs --vram-budget 4GB
    python3 benchmarks/gpu_vram.py vae sd15            # 1024x1024 decode through the tiled VAE vs untiled
    python3 benchmarks/gpu_vram.py build sdxl          # dummy-pipeline sdxl -> /tmp/sdxl; compile fp16 static 1024
    python3 benchmarks/gpu_vram.py measure sdxl 8GB facts,unbounded   # SDXL: in two invocations (per-stage
    python3 benchmarks/gpu_vram.py measure sdxl 8GB budget            # reloads of a 5 GB UNet take time)

Each writes ``$OUT/gpu_vram-<step>-<arch>.json`` (``OUT`` default /tmp/out); ``measure`` also copies the recorded
memory facts (``$OUT/memory_facts-<arch>.json``). Every measurement runs in its own subprocess (a fresh CUDA context:
ONNX Runtime's arenas and torch's cache of one run never count in the next), with a timeout.

What is MEASURED, and how (no estimates in this script's figures):

* per engine (``facts``): device used (``cudaMemGetInfo`` via ``torch.cuda.mem_get_info``) before opening the
  engine, after opening it (= its weights, plus ORT's session state) and after three runs at the artifact's shape
  (= its activations: ORT's arena growth, cuDNN workspaces, CUDA-graph pools, our IO buffers); recorded as memory
  facts, which the budgeted run then plans with;
* per stage (``runs``): :class:`~diffusion_trt.runtime.memory.memory_meter.StageMemoryMeter` around one untimed call
  (device used sampled after every engine open and run and every 2 ms; the first call, so it is also the warm-up)
  and e2e wall time (median of the next 2), for the unbounded pipeline and the budgeted one, each in a fresh process;
* ORT's own accounting: onnxruntime's Python API has no allocator statistics (``AllocatorGetStats`` is C API
  only); the script records which attributes it looked for and found.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

OUT = Path(os.environ.get("OUT", "/tmp/out"))
#: "cuda" on the GPU host; "cpu" = a smoke run of the same code on a CPU artifact (memory figures read 0)
DEVICE = os.environ.get("GPU_VRAM_DEVICE", "cuda")
CACHE = "/tmp/dtrt-cache"  # DIFFUSION_TRT_CACHE of every step: where the memory facts are recorded
ARCHS = {
    "sd15": {"model": "/tmp/sd15", "artifact": "/tmp/sd15-art", "size": 512, "steps": 50, "compile_timeout": 480},
    "sdxl": {"model": "/tmp/sdxl", "artifact": "/tmp/sdxl-art", "size": 1024, "steps": 30, "compile_timeout": 540},
    # CPU smoke run of this script (GPU_VRAM_DEVICE=cpu, TINY_MODEL/TINY_ARTIFACT: a tiny folder and its CPU artifact)
    "tiny": {"model": os.environ.get("TINY_MODEL", "/tmp/tiny"), "artifact": os.environ.get("TINY_ARTIFACT",
             "/tmp/tiny-art"), "size": 64, "steps": 2, "compile_timeout": 300},
}


def _env() -> dict[str, str]:
    return {**os.environ, "DIFFUSION_TRT_CACHE": CACHE, "PYTHONUNBUFFERED": "1"}


def _sh(cmd: list[str], timeout: float, keep_stdout: bool = False) -> dict[str, Any]:
    """Run a command; its rc, seconds and output tail (and its whole stdout if asked), or the timeout, as a record."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env())
        return {"cmd": " ".join(cmd), "rc": p.returncode, "seconds": round(time.perf_counter() - t0, 1),
                "tail": (p.stdout + p.stderr)[-3000:], **({"stdout": p.stdout} if keep_stdout else {})}
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"cmd": " ".join(cmd), "rc": None, "seconds": round(time.perf_counter() - t0, 1),
                "error": f"timed out after {timeout} s", "tail": out[-3000:]}


def _child(args: list[str], timeout: float) -> dict[str, Any]:
    """This script's ``child ...`` in a fresh process; its JSON result (last stdout line) or the failure."""
    rec = _sh([sys.executable, __file__, "child", *args], timeout, keep_stdout=True)
    if rec.get("rc") == 0:
        # the result is the last line that parses as a JSON object (ORT's warnings may follow it on stdout)
        for line in reversed(rec.pop("stdout", "").strip().splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except json.JSONDecodeError:
                    continue
        return {"error": "unreadable child output (no JSON line)", "tail": rec["tail"]}
    rec.pop("stdout", None)
    return {"error": rec.get("error") or f"rc={rec.get('rc')}", "tail": rec["tail"]}


def _write(step: str, arch: str, data: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"gpu_vram-{step}-{arch}.json"
    path.write_text(json.dumps(data, indent=2))
    print(f"json: {path}")
    print(json.dumps(data, indent=2)[:6000])


# -- steps (parent) ------------------------------------------------------------------------------------------


def step_build(arch: str) -> None:
    a = ARCHS[arch]
    rec: dict[str, Any] = {"arch": arch}
    cli = [sys.executable, "-m", "diffusion_trt.cli"]
    if not Path(a["model"], "model_index.json").exists():
        rec["dummy"] = _sh([*cli, "dummy-pipeline", "--arch", arch, a["model"], "--overwrite"], 240)
    size = str(a["size"])
    if not Path(a["artifact"], "manifest.json").exists():
        rec["compile"] = _sh([*cli, "compile", a["model"], "-o", a["artifact"], "--device", "cuda", "--precision",
                              "fp16", "--height", size, "--width", size, "--min-height", size, "--max-height", size,
                              "--min-width", size, "--max-width", size, "--batch-size", "1", "--max-batch-size", "1",
                              "--overwrite"], a["compile_timeout"])
    rec["inspect"] = _sh([*cli, "inspect", a["artifact"]], 120) if Path(a["artifact"], "manifest.json").exists() \
        else {"error": "no artifact"}
    _write("build", arch, rec)


def step_measure(arch: str, budget: str, parts: str = "facts,unbounded,budget") -> None:
    """Engine facts (recorded for the budgeted run to plan with), then e2e unbounded and under ``budget``; ``parts``
    picks some of the three (e.g. "budget" alone in a second invocation: the facts stay recorded in /tmp)."""
    a = ARCHS[arch]
    rec: dict[str, Any] = {"arch": arch, "budget": budget, "size": a["size"], "steps": a["steps"], "parts": parts}
    chosen = [p for p in ("facts", "unbounded", "budget") if p in parts.split(",")]
    # the three children share the 10-minute command limit; one alone gets most of it
    timeout = {"facts": 120, "unbounded": 180, "budget": 270} if len(chosen) > 1 else dict.fromkeys(chosen, 540)
    if "facts" in chosen:
        rec["facts"] = _child(["facts", a["artifact"]], timeout["facts"])
    for name, b in (("unbounded", "none"), ("budget", budget)):
        if name in chosen:
            rec[name if name == "unbounded" else f"budget_{budget}"] = _child(["e2e", a["artifact"], b,
                                                                                str(a["steps"])], timeout[name])
    u, v = rec.get("unbounded", {}), rec.get(f"budget_{budget}", {})
    if "e2e_s" in u and "e2e_s" in v:
        rec["budget_cost_s_per_request"] = v["e2e_s"] - u["e2e_s"]
    facts = Path(CACHE, "memory")
    for f in facts.glob("*.json") if facts.is_dir() else []:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"memory_facts-{arch}-{f.stem[:12]}.json").write_text(f.read_text())
    _write("measure" if parts == "facts,unbounded,budget" else f"measure-{parts.replace(',', '+')}", arch, rec)


def step_vae(arch: str) -> None:
    a = ARCHS[arch]
    _write("vae", arch, {"arch": arch, **_child(["vae", a["artifact"], a["model"], str(2 * a["size"])], 300)})


# -- children (one measurement per process) -----------------------------------------------------------------


def _device_used() -> int:
    import torch

    if DEVICE != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def _cuda_init() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.init()
        torch.empty(1, device="cuda")


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _gpu() -> str:
    import torch

    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run)"


def _engine(artifact: str, entry: dict[str, Any], name: str, extra: dict[str, str] | None = None,
            cuda_graph: bool = True) -> tuple[Any, Any]:
    """An OrtEngine on DEVICE with the pipeline's provider options (and ``extra``) and its stream."""
    import torch

    from diffusion_trt.runtime.engines.ort_engine import OrtEngine
    from diffusion_trt.runtime.pipeline import cuda_layout_options

    stream = torch.cuda.Stream() if DEVICE == "cuda" else None
    options = {**cuda_layout_options(name, DEVICE), **((extra or {}) if DEVICE == "cuda" else {})}
    eng = OrtEngine(Path(artifact, entry["onnx"]), entry, name=name, device=DEVICE, stream=stream,
                    provider_options=options, cuda_graph=cuda_graph and DEVICE == "cuda")
    return eng, stream


def _on(stream: Any) -> Any:
    import contextlib

    import torch

    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _ort_accounting(session: Any) -> dict[str, Any]:
    import onnxruntime as ort

    names = ("get_allocator_stats", "get_memory_info", "get_profiling_start_time_ns", "get_provider_options")
    found = {n: hasattr(session, n) for n in names}
    out: dict[str, Any] = {"onnxruntime": ort.__version__, "attributes_looked_for": found}
    if found["get_provider_options"]:
        cuda = session.get_provider_options().get("CUDAExecutionProvider", {})
        out["cuda_arena"] = {k: cuda.get(k) for k in ("gpu_mem_limit", "arena_extend_strategy")}
    out["note"] = "no Python API for arena statistics (AllocatorGetStats is C API only)" \
        if not found["get_allocator_stats"] else "get_allocator_stats found"
    return out


def _feeds(spec: Any, device: Any) -> dict[str, Any]:
    import torch

    feeds = {}
    for info in spec.inputs:
        shape = tuple(info.max)
        if info.torch_dtype in (torch.int64, torch.int32):
            feeds[info.name] = torch.zeros(shape, dtype=info.torch_dtype, device=device)
        elif info.name == "timestep":
            feeds[info.name] = torch.full(shape, 500.0, dtype=info.torch_dtype, device=device)
        else:
            feeds[info.name] = torch.randn(shape, device=device).to(info.torch_dtype)
    return feeds


def child_facts(artifact: str) -> dict[str, Any]:
    """Each engine alone: weights = used after open - before; activations = used after 3 runs - after open."""
    import torch

    from diffusion_trt.artifact.manifest import Manifest
    from diffusion_trt.runtime.memory.plan import facts_path, record_memory_facts
    from diffusion_trt.runtime.pipeline import txt2img_components

    manifest = Manifest.read(artifact)
    _cuda_init()
    if DEVICE == "cuda":
        a = torch.randn(256, 256, device="cuda", dtype=torch.float16)
        (a @ a).sum().item()  # cuBLAS loaded
        torch.nn.functional.conv2d(a[None, None], a[None, None, :3, :3]).sum().item()  # cuDNN loaded
    overhead = _device_used()
    scale = manifest.model.vae_scale_factor
    out: dict[str, Any] = {"overhead_bytes": overhead, "gpu": _gpu(), "engines": {}}
    record: dict[str, Any] = {}
    for name in txt2img_components(manifest):
        entry = manifest.components[name].spec
        try:
            _sync()
            used0 = _device_used()
            t0 = time.perf_counter()
            static = all(i["min"] == i["max"] for i in entry["inputs"])
            # the arena grows as the budgeted pipeline's does (kSameAsRequested), not by powers of two
            eng, stream = _engine(artifact, entry, name, {"arena_extend_strategy": "kSameAsRequested"}, static)
            with eng:
                _sync()
                used1 = _device_used()
                open_s = time.perf_counter() - t0
                feeds = _feeds(eng.spec, eng.device)
                with _on(stream):
                    for _ in range(3):
                        eng.run(feeds)
                _sync()
                used2 = _device_used()
                acct = _ort_accounting(eng._session)
            rows = int(eng.spec.inputs[0].max[0])
            first = eng.spec.inputs[0]
            if name.startswith("text_encoder"):
                h = w = 1
            else:
                h, w = (int(first.max[2]) * (scale if name != "vae_encoder" else 1),
                        int(first.max[3]) * (scale if name != "vae_encoder" else 1))
            out["engines"][name] = {"weights_bytes": used1 - used0, "activations_bytes": used2 - used1,
                                    "rows": rows, "height": h, "width": w, "open_s": round(open_s, 2),
                                    "cuda_graph": eng.cuda_graph, "ort_accounting": acct}
            record[name] = {"weights_bytes": used1 - used0,
                            "activations": [{"rows": rows, "height": h, "width": w, "bytes": used2 - used1}]}
            del eng, feeds
        except Exception as e:  # noqa: BLE001 - recorded, the other engines still measured
            out["engines"][name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
    out["facts_file"] = str(record_memory_facts(facts_path(manifest), manifest, _gpu(), record,
                                                overhead=overhead if DEVICE == "cuda" else None))
    return out


def child_e2e(artifact: str, budget: str, steps: int) -> dict[str, Any]:
    """One pipeline (budget "none" = unbounded): per-stage peaks of its first call (which is also the warm-up:
    cuDNN's algorithm search, CUDA graph capture), then e2e of 2 calls."""
    import torch

    from diffusion_trt.runtime import EnginePipeline
    from diffusion_trt.runtime.memory.memory_meter import StageMemoryMeter

    _cuda_init()
    base = _device_used()
    t0 = time.perf_counter()
    pipe = EnginePipeline.from_artifacts(artifact, device=DEVICE,
                                         **({} if budget == "none" else {"vram_budget": budget}))
    load_s = time.perf_counter() - t0
    after_load = _device_used()
    kw = {"prompt": "an ink painting of mountains", "num_inference_steps": steps, "output_type": "pil",
          "progress": False}
    with pipe:
        meter = StageMemoryMeter(pipe.device)
        with meter.watch(pipe.stages):
            pipe(**kw, seed=0)
        samples = []
        for i in range(2):
            _sync()
            t = time.perf_counter()
            pipe(**kw, seed=i)
            _sync()
            samples.append(time.perf_counter() - t)
        res = pipe.residency
        out: dict[str, Any] = {
            "budget": budget, "gpu": _gpu(), "load_s": round(load_s, 2),
            "device_used_before_load_mib": base / 2**20, "device_used_after_load_mib": after_load / 2**20,
            "stage_peak_mib": meter.peaks_mib(), "stage_peak_above_start_mib": meter.peaks_mib(above_baseline=True),
            "meter_source": meter.source, "e2e_s": statistics.median(samples), "e2e_samples_s": samples,
            "torch_max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else None,
        }
        if res is not None:
            out["plan"] = res.plan.to_json()
            out["plan_text"] = res.plan.describe()
            out["engine_opens"] = {n: s.opens for n, s in res.staged.items()}
            out["engine_open_s"] = {n: round(s.open_seconds, 2) for n, s in res.staged.items()}
    return out


def child_vae(artifact: str, model: str, size: int) -> dict[str, Any]:
    """A ``size`` x ``size`` decode of random latents through our tiled VAE decoder engine (the artifact's static
    tile) vs diffusers' AutoencoderKL (fp32, untiled and tiled) on the same weights."""
    import torch
    from diffusers import AutoencoderKL

    from diffusion_trt.artifact.manifest import Manifest
    from diffusion_trt.runtime.memory.memory_meter import StageMemoryMeter
    from diffusion_trt.runtime.memory.vae_tiling import TiledVaeDecoder, tiled_decode

    manifest = Manifest.read(artifact)
    entry = manifest.components["vae_decoder"].spec
    _cuda_init()
    z = torch.randn(1, 4, size // 8, size // 8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    out: dict[str, Any] = {"size": size, "gpu": _gpu()}
    base = _device_used()
    static = all(i["min"] == i["max"] for i in entry["inputs"])
    eng, stream = _engine(artifact, entry, "vae_decoder", None, static)
    tile = int(entry["inputs"][0]["opt"][2])
    with eng:
        tiled = TiledVaeDecoder(eng, tile=tile)
        meter = StageMemoryMeter(eng.device)
        meter.stage = "vae"
        with _on(stream):
            ours = tiled.run({"latent_sample": z.to(eng.spec.input("latent_sample").torch_dtype)})["sample"]
            _sync()
            meter.sample()
            t = time.perf_counter()
            for _ in range(3):
                tiled.run({"latent_sample": z.to(eng.spec.input("latent_sample").torch_dtype)})
            _sync()
        out.update(layout=tiled.last_layout, tile_latent=tile, ours_tiled_s=(time.perf_counter() - t) / 3,
                   ours_tiled_peak_above_start_mib=(meter.peaks["vae"] - base) / 2**20,
                   ours_tiled_device_used_mib=meter.peaks["vae"] / 2**20)
        ours = ours.float()
    del eng
    _sync()
    vae = AutoencoderKL.from_pretrained(Path(model, "vae")).to(DEVICE).eval()
    cuda = DEVICE == "cuda"
    with torch.no_grad():
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        whole = vae.decode(z).sample
        out["diffusers_untiled_fp32_torch_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
        same_layout = tiled_decode(lambda t: vae.decode(t).sample, z, tile=tile, layout=out["layout"] or "diffusers")
        vae.enable_tiling()
        vae.tile_latent_min_size, vae.tile_sample_min_size = tile, tile * 8
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        dtiled = vae.decode(z).sample
        out["diffusers_tiled_fp32_torch_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    out["max_abs_diff"] = {
        "ours_tiled_vs_untiled_fp32": (ours - whole).abs().max().item(),
        "same_layout_fp32_vs_untiled_fp32 (seams alone)": (same_layout - whole).abs().max().item(),
        "ours_tiled_vs_same_layout_fp32 (engine precision alone)": (ours - same_layout).abs().max().item(),
        "diffusers_tiled_vs_untiled_fp32": (dtiled - whole).abs().max().item(),
    }
    out["mean_abs_diff_ours_tiled_vs_untiled"] = (ours - whole).abs().mean().item()
    out["image_range"] = [whole.min().item(), whole.max().item()]
    return out


def main() -> None:
    args = sys.argv[1:]
    if args and args[0] == "child":
        kind, rest = args[1], args[2:]
        fn = {"facts": child_facts, "e2e": lambda a, b, s: child_e2e(a, b, int(s)),
              "vae": lambda a, m, s: child_vae(a, m, int(s))}[kind]
        try:
            result = fn(*rest)
        except Exception as e:  # noqa: BLE001 - the parent records it
            result = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        print(json.dumps(result, default=str))
        return
    if len(args) < 2 or args[0] not in ("build", "measure", "vae") or args[1] not in ARCHS:
        sys.exit(__doc__)
    step, arch = args[0], args[1]
    try:
        if step == "build":
            step_build(arch)
        elif step == "measure":
            step_measure(arch, args[2] if len(args) > 2 else ("4GB" if arch == "sd15" else "8GB"),
                         *(args[3:4] or []))
        else:
            step_vae(arch)
    except Exception as e:  # noqa: BLE001 - the JSON says what failed
        _write(step, arch, {"arch": arch, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})


if __name__ == "__main__":
    main()

"""Per-component GPU timings of compiled artifacts next to diffusers eager and ORT's own transformers optimizer.

    python benchmarks/components.py MODEL_DIR --artifact dyn=ART1 --artifact static=ART2 --json out.json \
        [--ort-optimizer-baseline]

For each artifact and each ORT CUDA provider-option variant it times text_encoder (CFG batch 2), the UNet step
(CFG batch 2, latents 64x64 for 512x512) and the VAE decode (batch 1) at the artifact's opt shape: median of N
CUDA-synchronised runs after warm-up. ``cuda_graph`` variants use ORT's CUDA graph (static shapes, same bound
buffers every run, as ORT requires). It also reports the fp16 UNet output against diffusers' fp16 and fp32 UNet
on the same inputs (max abs difference, cosine similarity).

A benchmark, not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "nhwc": {"prefer_nhwc": "1"},
    "cuda_graph": {"enable_cuda_graph": "1"},
    "cuda_graph+nhwc": {"enable_cuda_graph": "1", "prefer_nhwc": "1"},
}


def variant_options(name: str) -> dict[str, str]:
    """Provider options of a variant name: a key of VARIANTS, or '+'-joined tokens (``cuda_graph``, ``nhwc``,
    ``key=value`` for any CUDA provider option, e.g. ``cuda_graph+nhwc+sdpa_kernel=8``)."""
    if name in VARIANTS:
        return dict(VARIANTS[name])
    opts: dict[str, str] = {}
    for tok in name.split("+"):
        if tok in VARIANTS:
            opts.update(VARIANTS[tok])
        elif "=" in tok:
            k, v = tok.split("=", 1)
            opts[k] = v
        else:
            raise SystemExit(f"unknown variant token {tok!r} in {name!r}")
    return opts


def median_ms(fn, warmup: int = 5, iters: int = 30) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def feeds_for(entry: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator("cuda").manual_seed(seed)
    out = {}
    for t in entry["inputs"]:
        shape, dtype = t["opt"], getattr(torch, t["dtype"])
        if t["name"] == "input_ids":
            out[t["name"]] = torch.randint(0, 49408, shape, device="cuda", generator=g, dtype=torch.int64)
        elif t["name"] == "timestep":
            out[t["name"]] = torch.full(shape, 501.0, device="cuda", dtype=dtype)
        else:
            out[t["name"]] = torch.randn(shape, device="cuda", generator=g, dtype=torch.float32).to(dtype)
    return out


def time_artifact(art: Path, variants: list[str], iters: int) -> dict[str, Any]:
    from diffusion_trt.artifact import folder as artifacts
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine

    manifest = artifacts.load_verified(art, check_hashes=False)
    res: dict[str, Any] = {"profile": manifest["profile"], "precision": manifest["precision"]}
    for comp in ("text_encoder", "unet", "vae_decoder"):
        entry = manifest["components"][comp]
        feeds = feeds_for(entry)
        for var in variants:
            if "cuda_graph" in var and manifest["profile"]["height"][0] != manifest["profile"]["height"][2]:
                continue  # ORT's CUDA graph needs a static profile
            key = f"{comp}/{var}"
            try:
                with OrtEngine(art / entry["onnx"], entry, name=comp, device="cuda",
                               provider_options=variant_options(var)) as eng:
                    res[key + "_ms"] = median_ms(lambda e=eng, f=feeds: e.run(f), iters=iters)
                    if comp == "unet" and var == variants[0]:
                        res["unet_output"] = eng.run(feeds)["noise_pred"].float().cpu()
            except Exception as e:  # noqa: BLE001 - a variant that ORT refuses is a figure too
                res[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            print(key, res.get(key + "_ms", res.get(key + "_error")), flush=True)
        if comp == "unet":
            res["unet_feeds"] = {k: v.cpu() for k, v in feeds.items()}
    return res


def diffusers_baseline(model_dir: Path, unet_feeds: dict[str, torch.Tensor], iters: int) -> dict[str, Any]:
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    res: dict[str, Any] = {}
    kw = {"local_files_only": True}
    sample = unet_feeds["sample"].cuda()
    ts = unet_feeds["timestep"].cuda().float()
    ehs = unet_feeds["encoder_hidden_states"].cuda()
    for dtype, tag in ((torch.float16, "fp16"), (torch.float32, "fp32")):
        unet = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet", torch_dtype=dtype, **kw).cuda().eval()
        with torch.no_grad():
            args = (sample.to(dtype), ts, ehs.to(dtype))
            res[f"unet_{tag}_output"] = unet(*args, return_dict=False)[0].float().cpu()
            if tag == "fp16":
                res["diffusers_eager/unet_ms"] = median_ms(lambda u=unet, a=args: u(*a, return_dict=False), iters=iters)
        unet = None
        torch.cuda.empty_cache()
    with torch.no_grad():
        te = CLIPTextModel.from_pretrained(model_dir / "text_encoder", torch_dtype=torch.float16, **kw).cuda().eval()
        ids = torch.randint(0, 49408, (2, 77), device="cuda")
        res["diffusers_eager/text_encoder_ms"] = median_ms(lambda: te(ids), iters=iters)
        te = None
        vae = AutoencoderKL.from_pretrained(model_dir, subfolder="vae", torch_dtype=torch.float16, **kw).cuda().eval()
        z = torch.randn(1, 4, sample.shape[2], sample.shape[3], device="cuda", dtype=torch.float16)
        res["diffusers_eager/vae_decoder_ms"] = median_ms(lambda: vae.decode(z), iters=max(5, iters // 3))
        vae = None
    torch.cuda.empty_cache()
    return res


def ort_optimizer_baseline(model_dir: Path, work: Path, feeds: dict[str, torch.Tensor], iters: int,
                           numpy1: str | None = None) -> dict[str, Any]:
    """ORT's own path: plain fp32 export -> onnxruntime.transformers.optimizer (model_type="unet") -> fp16.

    The optimizer runs in a child process; ``numpy1`` names a folder holding numpy 1.x to put first on its path.
    """
    import onnxruntime as ort

    from diffusion_trt.compiler import export
    from diffusion_trt.compiler.components import component_specs
    from diffusion_trt.config import CompileConfig

    res: dict[str, Any] = {}
    folder = export.check_model_folder(model_dir)
    models = export.load_models(folder, "fp32", "cuda")
    spec = component_specs(text_hidden=768, text_len=77, unet_in=4, unet_out=4, latent=4)["unet"]
    prof = CompileConfig(height=512, width=512).resolve_profile(512)
    raw = work / "raw_unet" / "model.onnx"
    export.onnx_from_component("unet", models, spec, raw, precision="fp32", profile_ranges=export.export_ranges(prof),
                               opset=17, device="cuda")
    del models
    torch.cuda.empty_cache()
    out = work / "ort_opt_unet" / "model.onnx"
    out.parent.mkdir(parents=True, exist_ok=True)
    # ORT 1.31.1's UNet fusions crash under numpy 2 ("only 0-dimensional arrays can be converted to Python
    # scalars"): run the optimizer in a child process, with a numpy 1.x folder first on its path when given.
    script = (
        "import json, sys, time\n"
        "from onnxruntime.transformers.optimizer import optimize_model\n"
        "t0 = time.perf_counter()\n"
        "m = optimize_model(sys.argv[1], model_type='unet', opt_level=0, use_gpu=True)\n"
        "m.convert_float_to_float16(keep_io_types=False)\n"
        "m.save_model_to_file(sys.argv[2], use_external_data_format=True)\n"
        "print('RESULT', json.dumps({'seconds': time.perf_counter() - t0,"
        " 'ops': dict(m.get_operator_statistics())}))\n"
    )
    env = dict(os.environ)
    if numpy1:
        env["PYTHONPATH"] = f"{numpy1}:{env.get('PYTHONPATH', '')}"
    proc = subprocess.run([sys.executable, "-c", script, str(raw), str(out)], env=env, capture_output=True,
                          text=True, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        res["ort_optimizer/error"] = (proc.stderr or proc.stdout)[-800:]
        return res
    info = json.loads(line[len("RESULT "):])
    res["ort_optimizer/optimize_s"] = info["seconds"]
    res["ort_optimizer/op_counts"] = info["ops"]
    res["ort_optimizer/numpy"] = "1.x (child process)" if numpy1 else "as installed"
    for var in ("plain", "cuda_graph", "cuda_graph+nhwc"):
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            prov = [("CUDAExecutionProvider", {**variant_options(var), "cudnn_conv_algo_search": "EXHAUSTIVE"})]
            sess = ort.InferenceSession(str(out), so, providers=prov)
            types = {i.name: i.type for i in sess.get_inputs()}
            bound = {k: (v.cuda().half() if "float16" in types[k] else v.cuda()).contiguous() for k, v in feeds.items()}
            b = sess.io_binding()
            for k, v in bound.items():
                b.bind_input(k, "cuda", 0, np.float16 if v.dtype == torch.float16 else np.float32, list(v.shape),
                             v.data_ptr())
            o = torch.empty(bound["sample"].shape, device="cuda", dtype=torch.float16)
            b.bind_output(sess.get_outputs()[0].name, "cuda", 0, np.float16, list(o.shape), o.data_ptr())
            res[f"ort_optimizer/unet/{var}_ms"] = median_ms(lambda s=sess, bb=b: s.run_with_iobinding(bb), iters=iters)
            sess = None
        except Exception as e:  # noqa: BLE001
            res[f"ort_optimizer/unet/{var}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(var, res.get(f"ort_optimizer/unet/{var}_ms", res.get(f"ort_optimizer/unet/{var}_error")), flush=True)
    return res


def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.flatten().double(), b.flatten().double()
    return {"max_abs": float((a - b).abs().max()), "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=0)),
            "finite": bool(torch.isfinite(a).all())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--artifact", action="append", default=[], help="LABEL=DIR")
    ap.add_argument("--variants", default="plain,nhwc,cuda_graph,cuda_graph+nhwc")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--ort-optimizer-baseline", action="store_true")
    ap.add_argument("--numpy1", default=None, help="folder with numpy 1.x for ORT's optimizer (child process)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-work"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    results: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    import onnxruntime as ort

    results["onnxruntime"] = ort.__version__
    unet_feeds = None
    ours_out = {}
    for item in args.artifact:
        label, path = item.split("=", 1)
        r = time_artifact(Path(path), args.variants.split(","), args.iters)
        unet_feeds = unet_feeds or r.pop("unet_feeds")
        r.pop("unet_feeds", None)
        if "unet_output" in r:
            ours_out[label] = r.pop("unet_output")
        results[label] = r
    if unet_feeds is not None:
        base = diffusers_baseline(args.model_dir, unet_feeds, args.iters)
        ref16, ref32 = base.pop("unet_fp16_output"), base.pop("unet_fp32_output")
        results.update(base)
        for label, out in ours_out.items():
            results[label]["unet_vs_torch_fp16"] = compare(out, ref16)
            results[label]["unet_vs_torch_fp32"] = compare(out, ref32)
        results["torch_fp16_vs_fp32"] = compare(ref16, ref32)
        if args.ort_optimizer_baseline:
            results.update(ort_optimizer_baseline(args.model_dir, args.work, unet_feeds, args.iters, args.numpy1))
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()

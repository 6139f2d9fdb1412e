"""Which kernels make two identical calls differ on the GPU? Each component, and single ORT ops, run repeatedly.

    python benchmarks/determinism.py ARTIFACT --json out.json [--runs 4] [--modes default,deterministic,...]

Part 1, components: every component of ARTIFACT (text encoder, UNet, VAE decoder) opened as the runtime opens it
(its CUDA provider options: cuDNN attention, NHWC, fused Conv bias), fed the same fixed inputs ``--runs`` times;
reported: the largest absolute difference of any run from the first, per mode. Modes: ``default``;
``deterministic`` (``SessionOptions.use_deterministic_compute``); ``heuristic`` (cuDNN HEURISTIC algorithm
choice); ``math_attention`` (``sdpa_kernel=16``, ORT's unfused attention); ``nchw`` (``prefer_nhwc=0``);
``cuda_graph`` (the replayed graph, static artifacts only).

Part 2, single ops: one-node ONNX graphs at SD-1.5 shapes, fp16, run ``--runs`` times: ORT's GroupNorm and
SkipGroupNorm contrib ops (their sum kernel adds per-block partial sums with atomicAdd), InstanceNormalization (the
GroupNorm form an artifact compiled with ``--deterministic`` keeps), MultiHeadAttention
(cuDNN flash, sdpa_kernel=8), a 3x3 Conv (EXHAUSTIVE), a MatMul. The op whose outputs differ is the culprit.

A benchmark, not a test: the figures depend on the GPU, the libraries and the timing of the blocks.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

MODES: dict[str, dict[str, Any]] = {
    "default": {},
    "deterministic": {"deterministic": True},
    "heuristic": {"cudnn_conv_algo_search": "HEURISTIC"},
    "math_attention": {"provider_options": {"sdpa_kernel": "16"}},
    "nchw": {"provider_options": {"prefer_nhwc": "0"}},
    "cuda_graph": {"cuda_graph": True},
}


def fixed_feeds(entry: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for t in entry["inputs"]:
        shape, dtype = t["opt"], getattr(torch, t["dtype"])
        if t["name"] == "input_ids":
            out[t["name"]] = torch.randint(0, 49408, shape, generator=g, dtype=torch.int64).cuda()
        elif t["name"] == "timestep":
            out[t["name"]] = torch.full(shape, 501.0, dtype=dtype).cuda()
        else:
            out[t["name"]] = torch.randn(shape, generator=g).to(dtype).cuda()
    return out


def max_diff_over_runs(fn: Any, runs: int) -> dict[str, Any]:
    first = {k: v.detach().float().clone() for k, v in fn().items()}
    worst, differing = 0.0, 0
    t0 = time.perf_counter()
    for _ in range(runs - 1):
        out = fn()
        torch.cuda.synchronize()
        d = max(float((out[k].float() - first[k]).abs().max()) for k in first)
        worst = max(worst, d)
        differing += d > 0
    ms = 1e3 * (time.perf_counter() - t0) / max(1, runs - 1)
    return {"max_abs_diff": worst, "runs_differing": differing, "runs": runs, "ms_per_run": ms}


def components(art: Path, modes: list[str], runs: int) -> dict[str, Any]:
    from diffusion_trt.artifact import folder as artifacts
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine
    from diffusion_trt.runtime.pipeline import cuda_layout_options

    manifest = artifacts.load_verified(art, check_hashes=False)
    static = manifest["profile"]["height"][0] == manifest["profile"]["height"][2]
    res: dict[str, Any] = {}
    for comp in ("text_encoder", "unet", "vae_decoder"):
        entry = manifest["components"][comp]
        feeds = fixed_feeds(entry)
        for mode in modes:
            kw = dict(MODES[mode])
            if mode == "cuda_graph" and not static:
                res[f"{comp}/{mode}"] = {"skipped": "dynamic profile: no CUDA graph"}
                continue
            opts = {**cuda_layout_options(comp, "cuda"), **kw.pop("provider_options", {})}
            key = f"{comp}/{mode}"
            try:
                with OrtEngine(art / entry["onnx"], entry, name=comp, device="cuda", provider_options=opts,
                               **kw) as eng:
                    res[key] = max_diff_over_runs(lambda e=eng, f=feeds: e.run(f), runs)
            except Exception as e:  # noqa: BLE001 - a mode ORT refuses is a finding too
                res[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(key, res[key], flush=True)
    return res


def _one_node_model(op: str, inputs: list[tuple[str, Any, list[int]]], attrs: dict[str, Any],
                    inits: dict[str, np.ndarray], n_out: int = 1, domain: str = "") -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    types = {np.float16: TensorProto.FLOAT16, np.float32: TensorProto.FLOAT}
    graph_in = [helper.make_tensor_value_info(n, types[t], s) for n, t, s in inputs]
    outs = [f"y{i}" for i in range(n_out)]
    node = helper.make_node(op, [n for n, _, _ in inputs] + list(inits), outs, domain=domain or None, **attrs)
    graph = helper.make_graph([node], op, graph_in, [helper.make_tensor_value_info(o, TensorProto.FLOAT16, None)
                                                     for o in outs],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


def op_probes(runs: int) -> dict[str, Any]:
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    h16 = np.float16
    c = 320
    probes: dict[str, tuple[bytes, dict[str, np.ndarray], dict[str, str]]] = {}
    gn_inits = {"gamma": rng.standard_normal(c).astype(np.float32), "beta": rng.standard_normal(c).astype(np.float32)}
    x = rng.standard_normal((2, 64, 64, c)).astype(h16)
    probes["GroupNorm(2x64x64x320, 32 groups)"] = (
        _one_node_model("GroupNorm", [("x", h16, list(x.shape))],
                        {"epsilon": 1e-5, "groups": 32, "activation": 1, "channels_last": 1},
                        gn_inits, domain="com.microsoft"), {"x": x}, {})
    skip = rng.standard_normal(x.shape).astype(h16)
    # SkipGroupNorm takes (X, gamma, beta, skip): the initializers sit between the two graph inputs
    from onnx import TensorProto, helper, numpy_helper

    node = helper.make_node("SkipGroupNorm", ["x", "gamma", "beta", "skip"], ["y0"], domain="com.microsoft",
                            epsilon=1e-5, groups=32, activation=0, channels_last=1)
    graph = helper.make_graph(
        [node], "sgn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, list(x.shape)),
         helper.make_tensor_value_info("skip", TensorProto.FLOAT16, list(x.shape))],
        [helper.make_tensor_value_info("y0", TensorProto.FLOAT16, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in gn_inits.items()])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    probes["SkipGroupNorm(2x64x64x320)"] = (model.SerializeToString(), {"x": x, "skip": skip}, {})
    # compile --deterministic leaves GroupNorm as torch exports it: Reshape [N, G, -1] -> InstanceNormalization (the
    # reduction that matters; the Reshapes, Mul and Add around it have no sums)
    xg = rng.standard_normal((2, 32, 64 * 64 * c // 32)).astype(h16)
    probes["InstanceNormalization(2x32x40960: GroupNorm unfused, compile --deterministic)"] = (
        _one_node_model("InstanceNormalization", [("x", h16, list(xg.shape))], {"epsilon": 1e-5},
                        {"s": np.ones(32, h16), "b": np.zeros(32, h16)}), {"x": xg}, {})
    q = rng.standard_normal((2, 4096, c)).astype(h16)
    kv = rng.standard_normal((2, 77, c)).astype(h16)
    for label, k_len, sdpa in (("self", 4096, "8"), ("cross", 77, "8"), ("self, math", 4096, "16")):
        kk = q if k_len == 4096 else kv
        probes[f"MultiHeadAttention({label}, 8 heads, sdpa_kernel={sdpa})"] = (
            _one_node_model("MultiHeadAttention", [("q", h16, list(q.shape)), ("k", h16, list(kk.shape)),
                                                   ("v", h16, list(kk.shape))], {"num_heads": 8}, {},
                            domain="com.microsoft"), {"q": q, "k": kk, "v": kk}, {"sdpa_kernel": sdpa})
    w = (rng.standard_normal((c, c, 3, 3)) * 0.02).astype(h16)
    xc = rng.standard_normal((2, c, 64, 64)).astype(h16)
    probes["Conv3x3(2x320x64x64, EXHAUSTIVE)"] = (
        _one_node_model("Conv", [("x", h16, list(xc.shape))], {"pads": [1, 1, 1, 1]}, {"w": w}), {"x": xc}, {})
    wm = (rng.standard_normal((c, 4 * c)) * 0.02).astype(h16)
    probes["MatMul(8192x320 @ 320x1280)"] = (
        _one_node_model("MatMul", [("x", h16, [2, 4096, c])], {}, {"w": wm}), {"x": q}, {})
    res: dict[str, Any] = {}
    for label, (model, feeds, extra) in probes.items():
        try:
            sess = ort.InferenceSession(model, providers=[("CUDAExecutionProvider", {"cudnn_conv_algo_search":
                                                                                     "EXHAUSTIVE", **extra})])
            first = sess.run(None, feeds)
            worst, differing = 0.0, 0
            for _ in range(runs - 1):
                out = sess.run(None, feeds)
                d = max(float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max())
                        for a, b in zip(out, first, strict=True))
                worst, differing = max(worst, d), differing + (d > 0)
            res[label] = {"max_abs_diff": worst, "runs_differing": differing, "runs": runs}
        except Exception as e:  # noqa: BLE001
            res[label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(label, res[label], flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no-ops", action="store_true", help="skip the single-op probes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import onnxruntime as ort

    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "onnxruntime": ort.__version__, "artifact": str(args.artifact), "runs": args.runs}
    try:
        result["components"] = components(args.artifact, args.modes.split(","), args.runs)
    except Exception as e:  # noqa: BLE001 - keep the op probes
        result["components_error"] = f"{type(e).__name__}: {e}"
    if not args.no_ops:
        result["ops"] = op_probes(args.runs)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()

"""GroupNorm forms on ONNX Runtime at every GroupNorm site of SD-1.5: run-to-run identity, cost per UNet step / decode.

    python benchmarks/groupnorm_forms.py --json out.json [--forms fused,instnorm,layernorm,reduce] [--iters 50]
    python benchmarks/groupnorm_forms.py --device cpu --dtype float32 --iters 2    (a check of the graphs, on the CPU)

Why (issue 28, "deterministic mode cost <= 10 %"): ``compile --deterministic`` leaves GroupNorm unfused on ORT CUDA
(InstanceNormalization over [N, G, -1], then Mul/Add and SiLU as separate nodes) because ORT's fused GroupNorm sums
its per-block partials with ``atomicAdd``; on an H100 that cost the SD-1.5 UNet step +2.08 ms and the VAE decode
+10.8 ms (``h100-2026-12-07-s24-goals.json``). This measures deterministic candidates site by site, to choose one
before a full compile:

* ``fused``: ``com.microsoft.GroupNorm`` (channels_last, SiLU fused) between Transposes, the default artifact's form
  (run without ``use_deterministic_compute``: the reference cost);
* ``instnorm``: what ``compile --deterministic`` keeps today (torch's export: Reshape [N, G, -1] ->
  InstanceNormalization -> Reshape -> Mul(gamma) -> Add(beta) [-> x * Sigmoid(x)]);
* ``layernorm``: Reshape [N, G, -1] -> LayerNormalization over the last axis (fp32 statistics, ``stash_type=1``; unit
  scale, zero bias) -> Reshape -> Mul -> Add [-> SiLU]: one row per (sample, group), reduced by one block;
* ``reduce``: the statistics spelt out in fp32 (Cast, ReduceMean, Sub, Mul, ReduceMean, Add, Sqrt, Div, Cast);
* ``chanstats``: no [N, G, -1] view of the activation, so the NHWC layout needs no Transpose around the norm:
  per-channel fp32 statistics over H, W (Cast, ReduceMean, ReduceSumSquare: reductions over the spatial axes, which
  ORT's layout transformer moves to NHWC), combined per group on [N, G, C/G] (tiny tensors), folded with gamma and
  beta into a per-(sample, channel) scale and shift, then one Mul and one Add on the activation [-> SiLU]. The
  variance is E[x^2] - E[x]^2 in fp32, as ORT's fused kernel computes it (``groupNormNHWCScaleKernel``).

Every form runs on the SD-1.5 shapes found by hooking ``torch.nn.GroupNorm`` in diffusers' UNet (CFG batch 2, 64x64
latents, 77 tokens) and VAE decoder (batch 1, 512x512 image) built on the meta device from ``dummy.arch_config``,
each site between two 1x1 Convs (C -> C) so the CUDA provider's NHWC layout (``prefer_nhwc=1``, the runtime's) puts
its Transposes where a real graph has them; ``none`` (the two Convs alone) is subtracted. Runs replay a CUDA graph
(``enable_cuda_graph``, IO binding, ``--iters`` launches then one synchronised run, median of 3 such loops), as the
runtime's UNet does; ``use_deterministic_compute`` is on for every form but ``fused``. Identity: ``--runs`` outputs on
one input, largest absolute difference from the first. Totals: sum over sites of count x (form - none), per
component. A benchmark, not a test: figures depend on the GPU and the libraries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

GROUPS, EPS = 32, 1e-5
FORMS = ("none", "fused", "instnorm", "layernorm", "reduce", "chanstats")


def sd15_sites() -> dict[str, Counter]:
    """component -> Counter of ((N, C, H, W), silu) for every GroupNorm the SD-1.5 UNet and VAE decoder run at 512x512
    (the VAE attention's norm over [1, 512, 4096] counted at its 4-D shape [1, 512, 64, 64])."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from diffusion_trt.compiler.dummy import arch_config

    config = arch_config("sd15")
    sites: dict[str, Counter] = {"unet": Counter(), "vae_decoder": Counter()}
    current: list[Counter] = []

    def hook_for(name: str) -> Any:
        silu = not ((name.endswith(".norm") and "attentions" in name) or "group_norm" in name)  # attention norms: none

        def hook(module: Any, args: Any, out: Any) -> None:
            shape = tuple(args[0].shape)
            if len(shape) == 3:
                side = round(shape[2] ** 0.5)
                shape = (shape[0], shape[1], side, side)
            current[-1][(shape, silu)] += 1
        return hook

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config["unet"]).half()
        vae = AutoencoderKL.from_config(config["vae"]).half()
    for model in (unet, vae):
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.GroupNorm):
                module.register_forward_hook(hook_for(name))
    with torch.device("meta"), torch.no_grad():
        current.append(sites["unet"])
        unet(torch.zeros(2, 4, 64, 64, dtype=torch.half), torch.tensor(10),
             torch.zeros(2, 77, 768, dtype=torch.half))
        current.append(sites["vae_decoder"])
        vae.decode(torch.zeros(1, 4, 64, 64, dtype=torch.half))
    return sites


def site_model(form: str, shape: tuple[int, ...], silu: bool, dtype: Any, seed: int = 0) -> bytes:
    """x[N,C,H,W] -> Conv1x1 -> <form> -> Conv1x1 -> y, opset 17 (+ com.microsoft for ``fused``)."""
    from onnx import TensorProto, helper, numpy_helper

    _, c, h, w = shape
    rng = np.random.default_rng(seed)
    elem = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits = {"w1": (rng.standard_normal((c, c, 1, 1)) / np.sqrt(c)).astype(dtype),
             "w2": (rng.standard_normal((c, c, 1, 1)) / np.sqrt(c)).astype(dtype)}
    gamma, beta = rng.uniform(0.5, 1.5, c), rng.standard_normal(c) * 0.1
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"])]
    out = "a" if form == "none" else "n"
    if form == "fused":
        inits.update(gamma=gamma.astype(np.float32), beta=beta.astype(np.float32))
        nodes += [helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 3, 1]),
                  helper.make_node("GroupNorm", ["at", "gamma", "beta"], ["nt"], domain="com.microsoft", epsilon=EPS,
                                   groups=GROUPS, activation=int(silu), channels_last=1),
                  helper.make_node("Transpose", ["nt"], ["n"], perm=[0, 3, 1, 2])]
    elif form == "chanstats":
        nodes += _channel_statistics(shape, gamma, beta, dtype, inits)
        if silu:
            nodes += [helper.make_node("Sigmoid", ["p"], ["sig"]), helper.make_node("Mul", ["p", "sig"], ["n"])]
        else:
            nodes[-1].output[0] = "n"
    elif form != "none":
        inits.update(grouped=np.array([0, GROUPS, -1], np.int64), back=np.array([0, c, h, w], np.int64),
                     gamma=gamma.reshape(c, 1, 1).astype(dtype), beta=beta.reshape(c, 1, 1).astype(dtype))
        nodes.append(helper.make_node("Reshape", ["a", "grouped"], ["g"]))
        nodes += _normalised(form, c // GROUPS * h * w, dtype, inits)
        nodes += [helper.make_node("Reshape", ["gn", "back"], ["r"]),
                  helper.make_node("Mul", ["r", "gamma"], ["m"]),
                  helper.make_node("Add", ["m", "beta"], ["n" if not silu else "p"])]
        if silu:
            nodes += [helper.make_node("Sigmoid", ["p"], ["sig"]), helper.make_node("Mul", ["p", "sig"], ["n"])]
    nodes.append(helper.make_node("Conv", [out, "w2"], ["y"]))
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info("x", elem, list(shape))],
                              [helper.make_tensor_value_info("y", elem, list(shape))],
                              initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


def _channel_statistics(shape: tuple[int, ...], gamma: np.ndarray, beta: np.ndarray, dtype: Any,
                        inits: dict[str, np.ndarray]) -> list[Any]:
    """Nodes from ``a`` ([N, C, H, W]) to ``p``: the GroupNorm from per-channel fp32 sums (the ``chanstats`` form)."""
    from onnx import TensorProto, helper

    n, c, h, w = shape
    back = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
    inits.update(per_group=np.array([n, GROUPS, c // GROUPS], np.int64), per_channel=np.array([n, c, 1, 1], np.int64),
                 inv_hw=np.array(1.0 / (h * w), np.float32), eps=np.array(EPS, np.float32),
                 gamma32=gamma.reshape(1, GROUPS, c // GROUPS).astype(np.float32),
                 beta32=beta.reshape(1, GROUPS, c // GROUPS).astype(np.float32))
    node = helper.make_node
    return [node("Cast", ["a"], ["a32"], to=TensorProto.FLOAT),
            node("ReduceMean", ["a32"], ["mc"], axes=[2, 3], keepdims=1),
            node("ReduceSumSquare", ["a32"], ["sc"], axes=[2, 3], keepdims=1),
            node("Mul", ["sc", "inv_hw"], ["qc"]),
            node("Reshape", ["mc", "per_group"], ["mcg"]), node("Reshape", ["qc", "per_group"], ["qcg"]),
            node("ReduceMean", ["mcg"], ["mean"], axes=[2], keepdims=1),
            node("ReduceMean", ["qcg"], ["meansq"], axes=[2], keepdims=1),
            node("Mul", ["mean", "mean"], ["m2"]), node("Sub", ["meansq", "m2"], ["var"]),
            node("Add", ["var", "eps"], ["ve"]), node("Sqrt", ["ve"], ["sd"]),
            node("Div", ["gamma32", "sd"], ["scale_g"]),  # [N, G, C/G]
            node("Mul", ["mean", "scale_g"], ["ms"]), node("Sub", ["beta32", "ms"], ["shift_g"]),
            node("Reshape", ["scale_g", "per_channel"], ["scale32"]),
            node("Reshape", ["shift_g", "per_channel"], ["shift32"]),
            node("Cast", ["scale32"], ["scale"], to=back), node("Cast", ["shift32"], ["shift"], to=back),
            node("Mul", ["a", "scale"], ["as"]), node("Add", ["as", "shift"], ["p"])]


def _normalised(form: str, k: int, dtype: Any, inits: dict[str, np.ndarray]) -> list[Any]:
    """Nodes from ``g`` ([N, G, K]) to ``gn``: each row normalised to zero mean, unit variance (eps ``EPS``)."""
    from onnx import TensorProto, helper

    if form == "instnorm":
        inits.update(s=np.ones(GROUPS, dtype), b=np.zeros(GROUPS, dtype))
        return [helper.make_node("InstanceNormalization", ["g", "s", "b"], ["gn"], epsilon=EPS)]
    if form == "layernorm":
        inits.update(ls=np.ones(k, dtype), lb=np.zeros(k, dtype))
        return [helper.make_node("LayerNormalization", ["g", "ls", "lb"], ["gn"], axis=-1, epsilon=EPS,
                                 stash_type=1)]
    if form == "reduce":
        inits.update(eps=np.array(EPS, np.float32))
        back = TensorProto.FLOAT16 if dtype == np.float16 else TensorProto.FLOAT
        return [helper.make_node("Cast", ["g"], ["g32"], to=TensorProto.FLOAT),
                helper.make_node("ReduceMean", ["g32"], ["mean"], axes=[2], keepdims=1),
                helper.make_node("Sub", ["g32", "mean"], ["d"]),
                helper.make_node("Mul", ["d", "d"], ["d2"]),
                helper.make_node("ReduceMean", ["d2"], ["var"], axes=[2], keepdims=1),
                helper.make_node("Add", ["var", "eps"], ["ve"]),
                helper.make_node("Sqrt", ["ve"], ["sd"]),
                helper.make_node("Div", ["d", "sd"], ["q"]),
                helper.make_node("Cast", ["q"], ["gn"], to=back)]
    raise ValueError(f"unknown form {form!r}; forms: {', '.join(FORMS)}")


def measure(model: bytes, x: np.ndarray, device: str, deterministic: bool, runs: int, iters: int) -> dict[str, Any]:
    """ms per run (median of 3 loops of ``iters`` graph replays) and the run-to-run largest difference."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.use_deterministic_compute = deterministic
    if device == "cuda":
        providers: list[Any] = [("CUDAExecutionProvider", {"device_id": "0", "prefer_nhwc": "1",
                                                           "cudnn_conv_algo_search": "HEURISTIC",
                                                           "enable_cuda_graph": "1"})]
    else:
        providers = ["CPUExecutionProvider"]
    sess = ort.InferenceSession(model, so, providers=providers)
    where = "cuda" if device == "cuda" else "cpu"
    x_dev = ort.OrtValue.ortvalue_from_numpy(x, where, 0)
    y_dev = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), x.dtype, where, 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x_dev)
    binding.bind_ortvalue_output("y", y_dev)
    asynchronous = ort.RunOptions()
    asynchronous.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def output() -> np.ndarray:
        sess.run_with_iobinding(binding)
        return y_dev.numpy().astype(np.float32)

    first = output()
    diffs = [float(np.abs(output() - first).max()) for _ in range(runs - 1)]
    loops = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            sess.run_with_iobinding(binding, asynchronous)
        sess.run_with_iobinding(binding)  # synchronised
        loops.append((time.perf_counter() - t0) * 1e3 / (iters + 1))
    return {"first": first, "ms": statistics.median(loops), "max_abs_run_to_run": max(diffs, default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--forms", default=",".join(FORMS[1:]), help="besides none (always run)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--components", default="unet,vae_decoder")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import onnxruntime as ort

    forms = ["none"] + [f for f in args.forms.split(",") if f and f != "none"]
    dtype = np.float16 if args.dtype == "float16" else np.float32
    sites = {k: v for k, v in sd15_sites().items() if k in args.components.split(",")}
    result: dict[str, Any] = {"onnxruntime": ort.__version__, "device": args.device, "dtype": args.dtype,
                              "iters": args.iters, "runs": args.runs, "sites": [], "totals_ms": {}}
    if args.device == "cuda":
        import torch
        result["gpu"] = torch.cuda.get_device_name(0)
    for component, counter in sites.items():
        totals = dict.fromkeys(forms[1:], 0.0)
        for (shape, silu), count in sorted(counter.items()):
            row = _site_row(component, shape, silu, count, forms, dtype, args)
            result["sites"].append(row)
            print(json.dumps(row), flush=True)
            if args.json:  # after every site: a run cut short keeps what it measured
                args.json.write_text(json.dumps(result, indent=1))
            for form in forms[1:]:
                if "extra_ms" in row["forms"].get(form, {}) and totals[form] is not None:
                    totals[form] += count * row["forms"][form]["extra_ms"]
                else:
                    totals[form] = None  # a form that failed at one site has no total
        result["totals_ms"][component] = {f: (round(t, 4) if t is not None else None) for f, t in totals.items()}
        print(component, "totals (ms per run, sum of count x (form - none)):", result["totals_ms"][component],
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


def _site_row(component: str, shape: tuple[int, ...], silu: bool, count: int, forms: list[str], dtype: Any,
              args: argparse.Namespace) -> dict[str, Any]:
    """Every form at one site: its extra ms over ``none``, run-to-run difference, difference from ``instnorm``."""
    x = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    row: dict[str, Any] = {"component": component, "shape": list(shape), "silu": silu, "count": count, "forms": {}}
    outputs: dict[str, np.ndarray] = {}
    for form in forms:
        try:
            res = measure(site_model(form, shape, silu, dtype), x, args.device, form not in ("none", "fused"),
                          args.runs, args.iters)
        except Exception as e:  # noqa: BLE001 - a form ORT refuses at a site is reported, the rest go on
            row["forms"][form] = {"error": f"{type(e).__name__}: {str(e)[:240]}"}
            continue
        outputs[form] = res.pop("first")
        row["forms"][form] = {k: round(v, 6) for k, v in res.items()}
    base = row["forms"].get("none", {}).get("ms")
    for form in forms[1:]:
        entry = row["forms"].get(form, {})
        if base is not None and "ms" in entry:
            entry["extra_ms"] = round(entry["ms"] - base, 6)
        if form in outputs and "instnorm" in outputs and form != "instnorm":
            entry["max_abs_vs_instnorm"] = round(float(np.abs(outputs[form] - outputs["instnorm"]).max()), 6)
    return row


if __name__ == "__main__":
    main()

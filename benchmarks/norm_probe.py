"""GroupNorm on ORT CUDA, fused vs as ``compile --deterministic`` leaves it: run-to-run identity and time per site.

    python benchmarks/norm_probe.py --json out.json [--runs 8] [--iters 50]

Two one-site graphs at SD-1.5 UNet shapes (fp16; x [2, 320, 64, 64], 32 groups, SiLU after the norm):

* ``fused``: ``com.microsoft.GroupNorm`` (channels_last=1, activation=1) between the two Transposes the
  fuse_group_norm pass inserts (NCHW -> NHWC -> NCHW), what a default ORT CUDA artifact runs;
* ``unfused``: Reshape [N, G, -1] -> InstanceNormalization -> Reshape -> Mul(gamma) -> Add(beta) -> x * Sigmoid(x),
  what torch exports and ``compile --deterministic`` keeps.

Each runs ``--runs`` times on the same device-resident input, with and without ``use_deterministic_compute``;
reported: the largest absolute difference from the first run, and the median time of ``--iters`` runs (IO binding,
device buffers, one sync per run). A benchmark, not a test: figures depend on the GPU and the libraries.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

N, C, H, W, G = 2, 320, 64, 64, 32


def _model(nodes: list[Any], inits: dict[str, np.ndarray], domain: bool) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes, "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [N, C, H, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [N, C, H, W])],
        initializer=[numpy_helper.from_array(v, k) for k, v in inits.items()])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.microsoft", 1)] if domain else [])
    return helper.make_model(graph, opset_imports=opsets, ir_version=8).SerializeToString()


def fused(gamma: np.ndarray, beta: np.ndarray) -> bytes:
    from onnx import helper

    nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 3, 1]),
             helper.make_node("GroupNorm", ["xt", "gamma", "beta"], ["yt"], domain="com.microsoft", epsilon=1e-5,
                              groups=G, activation=1, channels_last=1),
             helper.make_node("Transpose", ["yt"], ["y"], perm=[0, 3, 1, 2])]
    inits = {"gamma": gamma.astype(np.float32), "beta": beta.astype(np.float32)}
    return _model(nodes, inits, domain=True)


def unfused(gamma: np.ndarray, beta: np.ndarray) -> bytes:
    from onnx import helper

    nodes = [helper.make_node("Reshape", ["x", "target"], ["r"]),
             helper.make_node("InstanceNormalization", ["r", "s", "b"], ["n"], epsilon=1e-5),
             helper.make_node("Reshape", ["n", "shape"], ["rb"]),
             helper.make_node("Mul", ["rb", "gamma"], ["m"]),
             helper.make_node("Add", ["m", "beta"], ["a"]),
             helper.make_node("Sigmoid", ["a"], ["sig"]),
             helper.make_node("Mul", ["a", "sig"], ["y"])]
    inits = {"target": np.array([0, G, -1], np.int64), "shape": np.array([N, C, H, W], np.int64),
             "s": np.ones(G, np.float16), "b": np.zeros(G, np.float16),
             "gamma": gamma.reshape(C, 1, 1).astype(np.float16), "beta": beta.reshape(C, 1, 1).astype(np.float16)}
    return _model(nodes, inits, domain=False)


def probe(model: bytes, x: np.ndarray, deterministic: bool, runs: int, iters: int) -> dict[str, Any]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.use_deterministic_compute = deterministic
    sess = ort.InferenceSession(model, so, providers=[("CUDAExecutionProvider", {"device_id": "0"})])
    x_dev = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
    y_dev = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), np.float16, "cuda", 0)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x_dev)
    binding.bind_ortvalue_output("y", y_dev)

    def run() -> np.ndarray:
        sess.run_with_iobinding(binding)
        return y_dev.numpy().astype(np.float32)

    first = run()
    diffs = [float(np.abs(run() - first).max()) for _ in range(runs - 1)]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"first": first, "max_abs_diff": max(diffs), "runs_differing": sum(d > 0 for d in diffs), "runs": runs,
            "ms_median": statistics.median(times), "ms_min": min(times), "iters": iters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, C, H, W)).astype(np.float16)
    result: dict[str, Any] = {"onnxruntime": ort.__version__, "shape": [N, C, H, W], "groups": G, "results": {}}
    gamma, beta = rng.uniform(0.5, 1.5, C), rng.standard_normal(C)
    outputs = {}
    for name, build in (("fused", fused), ("unfused", unfused)):
        model = build(gamma, beta)
        for det in (False, True):
            label = f"{name}/{'deterministic' if det else 'default'}"
            try:
                res = probe(model, x, det, args.runs, args.iters)
                outputs[name] = res.pop("first")
                result["results"][label] = res
            except Exception as e:  # noqa: BLE001 - report and keep going
                result["results"][label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(label, result["results"][label], flush=True)
    if len(outputs) == 2:  # the two forms compute the same function
        result["fused_vs_unfused_max_abs"] = float(np.abs(outputs["fused"] - outputs["unfused"]).max())
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()

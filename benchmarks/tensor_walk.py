"""The cost of finding every tensor of a big ONNX model (issue 24 item 1): the parse next to the generic protobuf
walk (:func:`diffusion_trt.artifact.folder.onnx_model_tensors`), on one UNet-sized proto.

    PYTHONPATH=. python benchmarks/tensor_walk.py [--gb 1.0] [--initializers 700] [--nodes 5000] [--json out.json]

Builds in memory a model of ``--initializers`` fp32 initializers sharing ``--gb`` GB and ``--nodes`` Conv nodes with
three attributes each (SD-1.5's UNet: 1.7 GB, ~700 initializers), serializes it, parses it once as a reader does and
times ``external_data_locations`` (the walk) three times. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

from diffusion_trt.artifact import folder as artifacts


def _model(gb: float, initializers: int, nodes: int) -> bytes:
    graph = helper.make_graph([], "g", [], [])
    per = int(gb * 1e9) // initializers // 4
    zeros = np.zeros(per, np.float32).tobytes()
    for i in range(initializers):
        graph.initializer.append(TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=[per], raw_data=zeros))
    for i in range(nodes):
        graph.node.append(helper.make_node("Conv", [f"x{i}", f"w{i % initializers}"], [f"x{i + 1}"],
                                           kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[1, 1]))
    return helper.make_model(graph).SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--initializers", type=int, default=700)
    ap.add_argument("--nodes", type=int, default=5000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    data = _model(args.gb, args.initializers, args.nodes)
    t0 = time.perf_counter()
    model = onnx.ModelProto()
    model.ParseFromString(data)
    parse_s = time.perf_counter() - t0
    walks = []
    for _ in range(3):
        t0 = time.perf_counter()
        artifacts.external_data_locations(model)
        walks.append(time.perf_counter() - t0)
    result = {"bytes": len(data), "initializers": args.initializers, "nodes": args.nodes, "parse_s": round(parse_s, 3),
              "walk_ms": [round(w * 1e3, 1) for w in walks],
              "tensors": sum(1 for _ in artifacts.onnx_model_tensors(model)),
              "loadavg": os.getloadavg(), "machine": f"{platform.machine()}, {os.cpu_count()} cpus"}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"command": "PYTHONPATH=. python benchmarks/tensor_walk.py " + " ".join(
                f"--{k} {v}" for k, v in vars(args).items() if k != "json" and v is not None), **result}, f, indent=2)


if __name__ == "__main__":
    main()

"""Bounded load test of ``diffusion-trt serve``: N requests, C concurrent, over KServe v2 HTTP; p50/p99 latency.

Stops by itself: after ``--requests`` requests, or when ``--deadline-s`` passes (then the rest are not sent
and count as failures). Exit status 0 only with zero failures. Each request: a distinct seed, same size.

    python benchmarks/serve_load.py --url 127.0.0.1:8000 --requests 200 --concurrency 8 --steps 3
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _request(client: object, seed: int, steps: int, prompt: str) -> np.ndarray:
    import tritonclient.http as http

    inputs = []
    for name, value, triton_type in (
        ("prompt", np.array([prompt.encode()], dtype=object), "BYTES"),
        ("seed", np.array([seed], np.int64), "INT64"),
        ("steps", np.array([steps], np.int32), "INT32"),
    ):
        tensor = http.InferInput(name, [1], triton_type)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    return client.infer("pipeline", inputs).as_numpy("image")  # type: ignore[attr-defined]


def run(url: str, requests: int, concurrency: int, steps: int, deadline_s: float, prompt: str) -> dict[str, object]:
    """Send the requests; return counts and latency percentiles (milliseconds)."""
    import tritonclient.http as http

    local = threading.local()
    stop_at = time.monotonic() + deadline_s
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        if time.monotonic() > stop_at:
            with lock:
                errors.append(f"request {i}: not sent, deadline passed")
            return
        if not hasattr(local, "client"):
            local.client = http.InferenceServerClient(url, connection_timeout=60, network_timeout=120)
        start = time.perf_counter()
        try:
            image = _request(local.client, i, steps, prompt)
            assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3, image.shape
        except Exception as e:  # noqa: BLE001 - counted and reported
            with lock:
                errors.append(f"request {i}: {type(e).__name__}: {str(e)[-200:]}")
            return
        with lock:
            latencies.append((time.perf_counter() - start) * 1000)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    lat = np.array(latencies) if latencies else np.array([float("nan")])
    return {
        "requests": requests, "concurrency": concurrency, "steps": steps, "ok": len(latencies),
        "failures": len(errors), "first_errors": errors[:5], "wall_s": round(wall, 2),
        "throughput_rps": round(len(latencies) / wall, 2) if wall else None,
        "p50_ms": round(float(np.percentile(lat, 50)), 1), "p99_ms": round(float(np.percentile(lat, 99)), 1),
        "max_ms": round(float(lat.max()), 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8000", help="host:port of the KServe v2 HTTP endpoint")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--deadline-s", type=float, default=600, help="stop sending after this many seconds")
    parser.add_argument("--prompt", default="an ink painting of a mountain")
    args = parser.parse_args(argv)
    result = run(args.url, args.requests, args.concurrency, args.steps, args.deadline_s, args.prompt)
    print(json.dumps(result, indent=2))
    print(f"p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, {result['ok']}/{args.requests} ok", file=sys.stderr)
    return 0 if result["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

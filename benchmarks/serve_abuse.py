"""Load and abuse test of ``diffusion-trt serve`` (issues 14, 24): valid load mixed with bad, huge and abandoned
requests.

Bounded and local: talks to one server on 127.0.0.1 only (refuses other hosts), every request has a timeout, and
each phase has a fixed number of requests. Phases, in order:

1. ``mixed``: ``--requests`` requests over ``--concurrency`` threads, every fifth one invalid (cycling through
   :data:`INVALID`: missing prompt, steps 0 / 2^31-1, height 65 / 100000, guidance NaN, seed -1, an over-long and a
   non-UTF-8 prompt); valid ones must all succeed, invalid ones must get 4xx (or 503), never 500;
2. ``parser``: raw JSON bodies that Triton 2.51's own parser answered 500 to, or took wrongly, each sent
   ``--parser-repeats`` times (:data:`PARSER_CASES`: seed 2^63, shape [-1], a ``timeout`` of -1 or "abc", a lone
   surrogate in a prompt, an INT32 that wraps (steps 2^32+3 ran 3 steps), malformed JSON, a JSON array, null, 10 MB
   of junk...); each must get 4xx, never 500 or 200 (``serve``'s HTTP front checks them: serve/http_front.py);
3. ``oversized``: ``--oversized`` requests with a ``--oversized-mb`` MB prompt over HTTP (tritonclient, binary
   tensors) and one as a raw JSON body (must be refused before any process of the server holds them: 413 from the
   front), then the same prompt ``--oversized`` times over gRPC (which goes to Triton directly: the stub's byte
   bound answers 400 after tritonserver read it; what remains, measured separately);
4. ``abandoned``: ``--abandoned`` heavy requests (``--heavy-steps``) whose client gives up after
   ``--abandon-after-s`` (the socket is closed), then one valid request, timed until it succeeds (503 "queue
   full" retried every 0.5 s, as a client would): the queue bound and the queue timeout keep it from waiting
   behind all of them.

Figures (JSON on stdout): failures of valid requests, status codes of invalid / parser / oversized / abandoned
requests (and the first message of each parser case), p50/p99 latency of valid requests, RSS of the server's Python
process, of its whole process tree, per process name and of every process of the tree (pid, name, MB: tritonserver,
the Python-backend stubs, PyTriton's helpers) before and after each phase, and the time of the valid request after
the burst.

    diffusion-trt serve artifacts/tiny --max-steps 50 --max-queue 16 --queue-timeout-s 20 &
    python benchmarks/serve_abuse.py --url 127.0.0.1:8000 --grpc-url 127.0.0.1:8001 --pid $! --json out.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

#: Invalid requests of the mixed phase (name, fields); every one must get a 4xx.
INVALID: list[tuple[str, dict[str, Any]]] = [
    ("missing-prompt", {"seed": 1}),
    ("steps-0", {"prompt": "x", "steps": 0}),
    ("steps-int32-max", {"prompt": "x", "steps": 2**31 - 1}),
    ("height-65", {"prompt": "x", "height": 65}),
    ("height-100000", {"prompt": "x", "height": 100_000}),
    ("guidance-nan", {"prompt": "x", "guidance_scale": float("nan")}),
    ("seed-minus-1", {"prompt": "x", "seed": -1}),
    ("prompt-too-long", {"prompt": "x" * 5000}),
    ("prompt-not-utf8", {"prompt": b"\xff\xfe"}),
]
def _body(*inputs: dict[str, Any], **top: Any) -> bytes:
    return json.dumps({"inputs": list(inputs), **top}).encode()


def _tensor(name: str, datatype: str, data: list[Any], shape: list[int] | None = None) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": [1] if shape is None else shape, "data": data}


_PROMPT = _tensor("prompt", "BYTES", ["x"])
#: Raw bodies of the parser phase (name, body): Triton 2.51 answered each with 500 (or ran it with a wrapped value).
PARSER_CASES: list[tuple[str, bytes]] = [
    ("seed-2^63", _body(_PROMPT, _tensor("seed", "INT64", [2**63]))),
    ("seed-string", _body(_PROMPT, _tensor("seed", "INT64", ["1"]))),
    ("steps-2^32+3-wraps", _body(_PROMPT, _tensor("steps", "INT32", [2**32 + 3]))),
    ("guidance-string", _body(_PROMPT, _tensor("guidance_scale", "FP32", ["x"]))),
    ("shape-minus-1", _body(_tensor("prompt", "BYTES", ["x"], shape=[-1]))),
    ("shape-float", _body(_tensor("prompt", "BYTES", ["x"], shape=[1.0]))),
    ("no-shape", _body({"name": "prompt", "datatype": "BYTES", "data": ["x"]})),
    ("timeout-minus-1", _body(_PROMPT, parameters={"timeout": -1})),
    ("timeout-abc", _body(_PROMPT, parameters={"timeout": "abc"})),
    ("priority-abc", _body(_PROMPT, parameters={"priority": "abc"})),
    ("lone-surrogate-prompt",
     b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["a \\ud800 b"]}]}'),
    ("prompt-not-a-string", _body(_tensor("prompt", "BYTES", [5]))),
    ("id-not-a-string", _body(_PROMPT, id=5)),
    ("inputs-not-a-list", json.dumps({"inputs": {"prompt": "x"}}).encode()),
    ("duplicate-key", b'{"inputs": [{"name": "prompt", "name": "seed", "datatype": "BYTES", "shape": [1], '
                      b'"data": ["x"]}]}'),
    ("trailing-data", _body(_PROMPT) + b" x"),
    ("nested-100000", b"[" * 100_000),
    ("malformed-json", b'{"inputs": ['),
    ("json-array", b"[]"),
    ("json-null", b"null"),
    ("junk-10mb", os.urandom(10 * 2**20)),
]
#: gRPC statuses that count as a refusal (the client's error or a bound), as 4xx over HTTP.
GRPC_REFUSALS = ("StatusCode.INVALID_ARGUMENT", "StatusCode.RESOURCE_EXHAUSTED")
TYPES = {"prompt": "BYTES", "negative_prompt": "BYTES", "seed": "INT64", "steps": "INT32", "guidance_scale": "FP32",
         "height": "INT32", "width": "INT32"}
NUMPY = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32}


def rss_mb(pid: int) -> float:
    """Resident set size of one process, MB (``/proc/PID/status`` VmRSS); 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from ``/proc/*/stat`` parent ids)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def memory(pid: int | None) -> dict[str, Any] | None:
    """RSS (MB) of the server's Python process, of its process tree (shared memory counted in every process that
    maps it), per process name (tritonserver, the Python-backend stubs, PyTriton's helpers) and of every process
    (``[pid, name, MB]``, the serve process first)."""
    if pid is None:
        return None
    tree = process_tree(pid)
    rss = {p: rss_mb(p) for p in tree}
    by_name: dict[str, float] = {}
    for p in tree[1:]:
        by_name[_name(p)] = round(by_name.get(_name(p), 0.0) + rss[p], 1)
    return {"python_mb": round(rss[pid], 1), "tree_mb": round(sum(rss.values()), 1),
            "processes": len(tree), "children_mb": by_name,
            "per_process": [[p, _name(p), round(rss[p], 1)] for p in tree]}


def _inputs(fields: dict[str, Any]) -> list[Any]:
    import tritonclient.http as http

    out = []
    for name, value in fields.items():
        kind = TYPES[name]
        if kind == "BYTES":
            array = np.array([value if isinstance(value, bytes) else str(value).encode()], dtype=object)
        else:
            array = np.array([value], NUMPY[kind])
        tensor = http.InferInput(name, [1], kind)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def infer(client: Any, fields: dict[str, Any]) -> tuple[str, float]:
    """("200" or the error status, seconds) of one request."""
    from tritonclient.utils import InferenceServerException

    start = time.perf_counter()
    try:
        image = client.infer("pipeline", _inputs(fields)).as_numpy("image")
        assert image.dtype == np.uint8 and image.ndim == 3, image.shape
        status = "200"
    except InferenceServerException as e:
        status = str(e.status() or "error")
    except Exception as e:  # noqa: BLE001 - a dropped connection, a timeout: counted by name
        status = type(e).__name__
    return status, time.perf_counter() - start


def raw_post(url: str, body: bytes, timeout_s: float = 60) -> tuple[int, str]:
    """POST ``body`` to the model's KServe v2 infer endpoint as is: (HTTP status, first 200 characters); a
    connection the server dropped is status 0 with the exception's name."""
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", "/v2/models/pipeline/infer", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()[:200].decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        return 0, type(e).__name__
    finally:
        conn.close()


def abandon(url: str, fields: dict[str, Any], after_s: float) -> str:
    """Send one request and close the socket after ``after_s`` without reading the answer."""
    body = json.dumps({"inputs": [
        {"name": n, "datatype": TYPES[n], "shape": [1], "data": [v]} for n, v in fields.items()
    ]}).encode()
    host, port = url.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v2/models/pipeline/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        sock.settimeout(after_s)
        try:
            head = sock.recv(64)  # an answer within after_s: refused at once (503) or computed
            return head.split(b" ")[1].decode() if head.startswith(b"HTTP/") else "closed"
        except TimeoutError:
            return "abandoned"


def _percentiles(latencies: list[float]) -> dict[str, float | None]:
    if not latencies:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    lat = np.array(latencies) * 1000
    return {"p50_ms": round(float(np.percentile(lat, 50)), 1), "p99_ms": round(float(np.percentile(lat, 99)), 1),
            "max_ms": round(float(lat.max()), 1)}


def mixed(url: str, requests: int, concurrency: int, steps: int, prompt: str) -> dict[str, Any]:
    """Phase 1: valid and (every fifth) invalid requests, ``concurrency`` at once."""
    import tritonclient.http as http

    local = threading.local()

    def one(i: int) -> tuple[str, str, float]:
        if not hasattr(local, "client"):
            local.client = http.InferenceServerClient(url, connection_timeout=60, network_timeout=300)
        if i % 5 == 4:
            name, fields = INVALID[(i // 5) % len(INVALID)]
            return name, *infer(local.client, fields)
        return "valid", *infer(local.client, {"prompt": prompt, "seed": i, "steps": steps})

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - start
    valid = [(s, t) for n, s, t in results if n == "valid"]
    invalid = [(n, s) for n, s, _ in results if n != "valid"]
    return {
        "requests": requests, "concurrency": concurrency, "steps": steps, "valid": len(valid),
        "valid_failures": sum(1 for s, _ in valid if s != "200"),
        "valid_statuses": dict(Counter(s for s, _ in valid)),
        "invalid": len(invalid), "invalid_statuses": dict(Counter(s for _, s in invalid)),
        "invalid_statuses_by_case": {n: dict(Counter(s for m, s in invalid if m == n)) for n, _ in INVALID},
        "wall_s": round(wall, 2), "throughput_rps": round(len(valid) / wall, 2),
        **_percentiles([t for s, t in valid if s == "200"]),
    }


def parser_phase(url: str, repeats: int) -> dict[str, Any]:
    """Phase 2: the raw bodies of :data:`PARSER_CASES`, each ``repeats`` times: statuses and the first message."""
    statuses: dict[str, dict[str, int]] = {}
    messages: dict[str, str] = {}
    for name, body in PARSER_CASES:
        results = [raw_post(url, body) for _ in range(repeats)]
        statuses[name] = dict(Counter(str(status) for status, _ in results))
        messages[name] = results[0][1]
    return {"repeats": repeats, "statuses_by_case": statuses, "first_message_by_case": messages,
            "statuses": dict(Counter(s for case in statuses.values() for s, n in case.items() for _ in range(n)))}


def oversized(url: str, count: int, megabytes: float) -> dict[str, Any]:
    """Phase 3a: huge prompts over HTTP: through tritonclient (binary tensor data) and as one raw JSON body."""
    import tritonclient.http as http

    client = http.InferenceServerClient(url, connection_timeout=60, network_timeout=300)
    big = b"x" * int(megabytes * 2**20)
    statuses = [infer(client, {"prompt": big})[0] for _ in range(count)]
    raw = b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["' + big + b'"]}]}'
    del big
    status, message = raw_post(url, raw, timeout_s=300)
    return {"oversized_mb": megabytes, "oversized_statuses": dict(Counter(statuses)),
            "raw_json_status": status, "raw_json_message": message}


def oversized_grpc(grpc_url: str, count: int, megabytes: float) -> dict[str, Any]:
    """Phase 3b: the same prompts over gRPC (to Triton directly; the stub's byte bound refuses them)."""
    import tritonclient.grpc as grpc
    from tritonclient.utils import InferenceServerException

    client = grpc.InferenceServerClient(grpc_url)
    big = np.array([b"x" * int(megabytes * 2**20)], dtype=object)
    statuses = []
    for _ in range(count):
        tensor = grpc.InferInput("prompt", [1], "BYTES")
        tensor.set_data_from_numpy(big)
        try:
            client.infer("pipeline", [tensor], client_timeout=300)
            statuses.append("OK")
        except InferenceServerException as e:
            statuses.append(str(e.status()))
    return {"oversized_mb": megabytes, "grpc_statuses": dict(Counter(statuses))}


def abandoned(url: str, count: int, steps: int, after_s: float, prompt: str,
              retry_for_s: float = 300) -> dict[str, Any]:
    """Phase 3: heavy requests whose clients go away, then one valid request, timed until it succeeds (a 503, the
    queue still full of the abandoned ones, is retried every 0.5 s for at most ``retry_for_s``)."""
    import tritonclient.http as http

    fields = {"prompt": prompt, "steps": steps, "seed": 0}
    with ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(lambda _: abandon(url, fields, after_s), range(count)))
    client = http.InferenceServerClient(url, connection_timeout=60, network_timeout=600)
    start = time.perf_counter()
    status, _ = infer(client, {"prompt": prompt, "steps": 3, "seed": 1})
    first = status
    attempts = 1
    while status == "503" and time.perf_counter() - start < retry_for_s:  # busy: retry as a client would
        time.sleep(0.5)
        status, _ = infer(client, {"prompt": prompt, "steps": 3, "seed": 1})
        attempts += 1
    return {"abandoned": count, "heavy_steps": steps, "abandon_after_s": after_s,
            "abandoned_outcomes": dict(Counter(outcomes)), "next_valid_first_status": first,
            "next_valid_status": status, "next_valid_attempts": attempts,
            "next_valid_s": round(time.perf_counter() - start, 2)}


def run(url: str, *, grpc_url: str | None = None, pid: int | None = None, requests: int = 200, concurrency: int = 8,
        steps: int = 3, parser_repeats: int = 3, oversized_count: int = 3, oversized_mb: float = 256,
        abandoned_count: int = 150, heavy_steps: int = 50, abandon_after_s: float = 0.5,
        prompt: str = "an ink painting of a mountain") -> dict[str, Any]:
    """All four phases; the figures as a dict (see the module docstring). ``grpc_url`` ``None`` = no gRPC part."""
    for given in (url, grpc_url):
        if given is not None and given.rsplit(":", 1)[0] not in ("127.0.0.1", "localhost"):
            raise SystemExit(f"{given}: this script talks to 127.0.0.1 only")
    result: dict[str, Any] = {"url": url, "grpc_url": grpc_url, "memory_before": memory(pid)}
    result["mixed"] = mixed(url, requests, concurrency, steps, prompt)
    result["memory_after_mixed"] = memory(pid)
    result["parser"] = parser_phase(url, parser_repeats)
    result["memory_after_parser"] = memory(pid)
    result["oversized"] = oversized(url, oversized_count, oversized_mb)
    result["memory_after_oversized"] = memory(pid)
    if grpc_url is not None:
        result["oversized_grpc"] = oversized_grpc(grpc_url, oversized_count, oversized_mb)
        result["memory_after_oversized_grpc"] = memory(pid)
    result["abandoned"] = abandoned(url, abandoned_count, heavy_steps, abandon_after_s, prompt)
    time.sleep(2)
    result["memory_after"] = memory(pid)
    statuses = {**result["mixed"]["invalid_statuses"], **result["oversized"]["oversized_statuses"],
                str(result["oversized"]["raw_json_status"]): 1,
                **result.get("oversized_grpc", {}).get("grpc_statuses", {})}
    parser_ok = all(s.startswith("4") for s in result["parser"]["statuses"])
    result["ok"] = bool(result["mixed"]["valid_failures"] == 0 and result["abandoned"]["next_valid_status"] == "200"
                        and parser_ok and all(s.startswith("4") or s in ("503", *GRPC_REFUSALS) for s in statuses))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8000", help="host:port of the KServe v2 HTTP endpoint")
    parser.add_argument("--grpc-url", default=None, help="host:port of the gRPC endpoint (the gRPC oversized part)")
    parser.add_argument("--pid", type=int, default=None, help="the serve process, for RSS figures")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--parser-repeats", type=int, default=3)
    parser.add_argument("--oversized", type=int, default=3)
    parser.add_argument("--oversized-mb", type=float, default=256)
    parser.add_argument("--abandoned", type=int, default=150)
    parser.add_argument("--heavy-steps", type=int, default=50)
    parser.add_argument("--abandon-after-s", type=float, default=0.5)
    parser.add_argument("--prompt", default="an ink painting of a mountain")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    result = run(args.url, grpc_url=args.grpc_url, pid=args.pid, requests=args.requests,
                 concurrency=args.concurrency, steps=args.steps, parser_repeats=args.parser_repeats,
                 oversized_count=args.oversized, oversized_mb=args.oversized_mb, abandoned_count=args.abandoned,
                 heavy_steps=args.heavy_steps, abandon_after_s=args.abandon_after_s, prompt=args.prompt)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""serve's HTTP front (diffusion_trt/serve/http_front.py) without Triton: its checks as functions, and the server in
front of a stand-in upstream on 127.0.0.1 that records what reaches it (issue 24, item 12). tests/test_serve.py
runs it in front of the real Triton."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from diffusion_trt.serve.http_front import (
    FrontError,
    FrontLimits,
    HttpFront,
    check_infer_body,
    free_loopback_port,
)

PROMPT = {"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["x"]}


def _body(*inputs: dict[str, Any], **top: Any) -> bytes:
    return json.dumps({"inputs": list(inputs or [PROMPT]), **top}).encode()


BAD: list[tuple[str, bytes, str]] = [
    ("seed-2^63", _body(PROMPT, {"name": "seed", "datatype": "INT64", "shape": [1], "data": [2**63]}),
     "seed=9223372036854775808 is outside INT64's range -9223372036854775808..9223372036854775807"),
    ("seed-float", _body(PROMPT, {"name": "seed", "datatype": "INT64", "shape": [1], "data": [1.5]}),
     "seed=1.5 is not an integer (INT64)"),
    ("seed-true", _body(PROMPT, {"name": "seed", "datatype": "INT64", "shape": [1], "data": [True]}),
     "seed=true is not an integer (INT64)"),
    ("steps-int32-wrap", _body(PROMPT, {"name": "steps", "datatype": "INT32", "shape": [1], "data": [2**32 + 3]}),
     "steps=4294967299 is outside INT32's range -2147483648..2147483647"),
    ("guidance-string", _body(PROMPT, {"name": "guidance_scale", "datatype": "FP32", "shape": [1], "data": ["x"]}),
     'guidance_scale="x" is not a number (FP32)'),
    ("shape-minus-1", _body({**PROMPT, "shape": [-1]}), 'input "prompt": shape=[-1] must be a list of integers >= 0, '
                                                        "e.g. [1]"),
    ("shape-missing", _body({"name": "prompt", "datatype": "BYTES", "data": ["x"]}),
     'input "prompt": shape=null must be a list of integers >= 0, e.g. [1]'),
    ("timeout-minus-1", _body(parameters={"timeout": -1}),
     "parameters.timeout=-1 must be an integer in 0..18446744073709551615"),
    ("timeout-abc", _body(parameters={"timeout": "abc"}),
     'parameters.timeout="abc" must be an integer in 0..18446744073709551615'),
    ("custom-parameter-list", _body(parameters={"x": [1]}),
     'parameters.x=[1] must be a string, a boolean or a number (64-bit)'),
    ("lone-surrogate", b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["a\\udc00"]}]}',
     'input "prompt" (BYTES): element 0 holds a lone surrogate ("\\udc00" at character 1), which is not text; send '
     "the text as UTF-8"),
    ("bytes-not-string", _body({**PROMPT, "data": [5]}), 'input "prompt" (BYTES): element 0 is 5, not a string'),
    ("data-object", _body({**PROMPT, "data": {"a": 1}}), 'input "prompt": data must be a JSON array, got {"a": 1}'),
    ("binary-size-minus-1", _body({"name": "prompt", "datatype": "BYTES", "shape": [1],
                                   "parameters": {"binary_data_size": -1}}),
     'input "prompt" parameters.binary_data_size=-1 must be an integer in 0..18446744073709551615'),
    ("id-int", _body(id=5), "id=5 must be a string"),
    ("unknown-top-key", _body(model="x"), 'the request has the unknown key "model"; a KServe v2 infer request has id, '
                                          "inputs, outputs, parameters"),
    ("no-inputs", b"{}", "the request needs inputs, a JSON array of {name, datatype, shape, data} objects"),
    ("output-binary-string", _body(outputs=[{"name": "image", "parameters": {"binary_data": "yes"}}]),
     'output "image" parameters.binary_data="yes" must be true or false'),
    ("duplicate-key", b'{"inputs": [], "inputs": []}',
     'the request JSON has the key "inputs" twice in one object; send it once'),
    ("deep", b"[" * 100_000, "the request JSON is nested more than 8 levels deep"),
    ("deep-but-closed", b'{"inputs": [' + b"[" * 9 + b"]" * 9 + b"]}", "the request JSON is nested more than 8 levels "
                                                                       "deep"),
    ("not-utf8", b'{"inputs": ["\xff"]}', "the request body is not UTF-8 (invalid start byte at byte 13); send JSON "
                                          "as UTF-8"),
    ("trailing", _body() + b" x", "the request body is not valid JSON (Extra data at character 83)"),
    ("null", b"null", "the request must be a JSON object, got null"),
]


@pytest.mark.parametrize(("body", "message"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_infer_bodies_triton_would_answer_500_or_misread(body: bytes, message: str) -> None:
    with pytest.raises(FrontError) as e:
        check_infer_body(body, None)
    assert (e.value.status, e.value.message) == (400, message)


@pytest.mark.parametrize("body", [
    _body(),
    _body(PROMPT, {"name": "seed", "datatype": "INT64", "shape": [1], "data": [2**63 - 1]},
          {"name": "guidance_scale", "datatype": "FP32", "shape": [1], "data": [7]},
          parameters={"timeout": 0, "custom": -5, "f": 1.5}, id="r1",
          outputs=[{"name": "image", "parameters": {"binary_data": True}}]),
    _body({**PROMPT, "data": [["nested"]], "shape": [1, 1]}),
    ('{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["\U0001f600 \\u00e9 '
     '\\ud83d\\ude00"]}]}').encode(),
], ids=["minimal", "every-field", "nested-data", "unicode"])
def test_good_infer_bodies_pass(body: bytes) -> None:
    check_infer_body(body, None)


def test_binary_tensor_header() -> None:
    header = _body({"name": "prompt", "datatype": "BYTES", "shape": [1], "parameters": {"binary_data_size": 5}})
    check_infer_body(header + b"\x01\x00\x00\x00x", str(len(header)))
    for bad in ("abc", "0", "-1", str(len(header) + 6), "\u0663"):
        with pytest.raises(FrontError, match=r"^Inference-Header-Content-Length=.* must be an integer in 1\.\.") as e:
            check_infer_body(header + b"\x01\x00\x00\x00x", bad)
        assert e.value.status == 400


# -- the server, in front of a stand-in upstream ------------------------------------------------------------------


class _Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        super().__init__(("127.0.0.1", 0), _UpstreamHandler)


class _UpstreamHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as Triton: the stand-in adds no delayed-ACK stall of its own
    server: _Upstream

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.seen.append((self.command, self.path, dict(self.headers.items()), body))
        data = json.dumps({"echo": len(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Inference-Header-Content-Length", str(len(data)))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


LIMITS = FrontLimits(max_body_bytes=4096, max_connections=4, idle_timeout_s=2.0, upstream_timeout_s=10.0)


@pytest.fixture()
def upstream() -> Iterator[_Upstream]:
    server = _Upstream()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture()
def front(upstream: _Upstream) -> Iterator[HttpFront]:
    with HttpFront("127.0.0.1", 0, upstream.server_address[1], LIMITS) as f:
        yield f


def _request(port: int, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


INFER = "/v2/models/pipeline/infer"


def test_a_good_request_reaches_triton_byte_for_byte_and_the_answer_comes_back(front: HttpFront,
                                                                               upstream: _Upstream) -> None:
    body = _body() + b"   "
    status, headers, data = _request(front.port, "POST", INFER + "?x=1", body,
                                     {"Content-Type": "application/json", "X-Custom": "kept", "Connection": "close"})
    assert (status, json.loads(data)) == (200, {"echo": len(body)})
    assert headers["inference-header-content-length"] == str(len(data))
    method, path, seen_headers, seen = upstream.seen[-1]
    assert (method, path, seen) == ("POST", INFER + "?x=1", body)
    assert seen_headers["X-Custom"] == "kept" and seen_headers.get("Connection") != "close"
    status, _, data = _request(front.port, "GET", "/v2/health/ready")
    assert status == 200 and upstream.seen[-1][:2] == ("GET", "/v2/health/ready")
    status, _, _ = _request(front.port, "POST", "/v2/models/pipeline/versions/1/infer", body)
    assert status == 200


def test_no_delayed_ack_stall_per_request(front: HttpFront) -> None:
    """Headers and body go out in two writes: without TCP_NODELAY each answer waited ~40 ms for the client's delayed
    ACK (45 ms a request through the front, 2.6 ms with it; serve's throughput halved)."""
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    try:
        start = time.perf_counter()
        for _ in range(20):
            conn.request("POST", INFER, body=_body())
            assert conn.getresponse().read()
        mean_ms = (time.perf_counter() - start) / 20 * 1000
    finally:
        conn.close()
    assert mean_ms < 30, f"{mean_ms:.1f} ms a request"


def _error(port: int, method: str, path: str, body: bytes | None = None, **headers: str) -> tuple[int, str]:
    status, _, data = _request(port, method, path, body, {k.replace("_", "-"): v for k, v in headers.items()})
    return status, json.loads(data)["error"]


def test_refusals_never_reach_triton(front: HttpFront, upstream: _Upstream) -> None:
    big = b"x" * 100_000
    assert _error(front.port, "POST", INFER, big) == (
        413, "the request body is 100000 bytes; at most 4096 are accepted (the prompt length limit, as JSON): send "
             "shorter prompts")
    assert _error(front.port, "POST", INFER, b'{"inputs": [') == (
        400, "the request body is not valid JSON (Expecting value at character 12)")
    import gzip

    assert _error(front.port, "POST", INFER, gzip.compress(_body()), Content_Encoding="gzip") == (
        415, 'Content-Encoding "gzip" is not accepted; send the body uncompressed')
    assert _error(front.port, "POST", "/v2/models/pipeline/generate", b'{"prompt": "x"}') == (
        404, 'POST "/v2/models/pipeline/generate" is not served here; send inference requests to POST '
             "/v2/models/<model>/infer")
    assert _error(front.port, "PUT", INFER, b"{}")[0] == 405
    assert _error(front.port, "GET", "/v2", big)[0] == 413
    assert upstream.seen == []


def _raw(port: int, data: bytes, read_for_s: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=read_for_s) as s:
        s.sendall(data)
        out = b""
        deadline = time.monotonic() + read_for_s
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out and b'"}' in out:
                break
        return out


def test_framing_the_front_does_not_pass_on(front: HttpFront, upstream: _Upstream) -> None:
    head = f"POST {INFER} HTTP/1.1\r\nHost: x\r\n"
    chunked = _raw(front.port, (head + "Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n").encode())
    assert chunked.startswith(b"HTTP/1.1 411") and b"chunked request bodies are not accepted" in chunked
    two = _raw(front.port, (head + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}").encode())
    assert two.startswith(b"HTTP/1.1 400") and b"more than one Content-Length" in two
    expect = _raw(front.port, (head + "Content-Length: 999999999\r\nExpect: 100-continue\r\n\r\n").encode())
    assert expect.startswith(b"HTTP/1.1 413") and b"at most 4096 are accepted" in expect  # before any body byte
    assert b"Connection: close" in expect
    no_length = _raw(front.port, (head + "\r\n").encode())
    assert no_length.startswith(b"HTTP/1.1 411")
    assert upstream.seen == []


def test_connections_beyond_the_bound_get_503_at_once(front: HttpFront) -> None:
    held = [socket.create_connection(("127.0.0.1", front.port), timeout=10) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.3)  # all accepted, each holding a handler thread (idle)
        refused = _raw(front.port, b"GET /v2 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 503") and b"too many connections" in refused
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the slots come back when the held connections close
        if _request(front.port, "GET", "/v2")[0] == 200:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the front did not take connections again")


def test_an_idle_connection_is_closed_after_the_idle_timeout(front: HttpFront) -> None:
    with socket.create_connection(("127.0.0.1", front.port), timeout=10) as s:
        s.sendall(f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{".encode())  # 99 bytes owed
        start = time.monotonic()
        assert s.recv(100) == b""  # closed, without an answer, once the body stalled for idle_timeout_s
        assert LIMITS.idle_timeout_s - 0.5 < time.monotonic() - start < LIMITS.idle_timeout_s + 5


def test_triton_not_answering_is_503(upstream: _Upstream) -> None:
    with HttpFront("127.0.0.1", 0, free_loopback_port(), LIMITS) as f:
        assert _error(f.port, "POST", INFER, _body()) == (503, "the inference server did not answer; retry later")


def test_a_port_in_use_fails_when_the_front_is_made(front: HttpFront, upstream: _Upstream) -> None:
    with pytest.raises(OSError):
        HttpFront("127.0.0.1", front.port, upstream.server_address[1], LIMITS)


def test_the_fronts_run_in_their_own_process_and_stop_with_it(upstream: _Upstream) -> None:
    """serve runs both fronts in a child (front_process): it binds at once, relays, and exits when closed; a port in
    use is one FrontStartError naming it, before anything else starts."""
    pytest.importorskip("grpc", reason="grpcio is not installed (the gRPC relay needs it)")
    from diffusion_trt.serve.front_process import FrontProcess, FrontSettings, FrontStartError

    http_port, grpc_port = free_loopback_port(), free_loopback_port()
    settings = FrontSettings.of("127.0.0.1", http_port, grpc_port, upstream.server_address[1], free_loopback_port(),
                                LIMITS)
    with FrontProcess(settings) as fronts:
        assert fronts.alive()
        status, _, data = _request(http_port, "POST", INFER, _body())
        assert (status, json.loads(data)) == (200, {"echo": len(_body())})
        with pytest.raises(FrontStartError, match=rf"^cannot listen on 127\.0\.0\.1:{http_port} "):
            FrontProcess(settings).__enter__()
        pid = fronts.pid
    assert pid is not None and not fronts.alive()
    with pytest.raises(ConnectionRefusedError):
        _request(http_port, "GET", "/v2")

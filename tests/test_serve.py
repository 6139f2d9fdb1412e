"""`diffusion-trt serve`: a real Triton server (PyTriton) on loopback, spoken to with tritonclient.

Skipped with a reason where nvidia-pytriton or tritonclient is not installed (`pip install -e '.[serve]'`).
The server runs as a subprocess on free loopback ports; every wait is bounded and the process is stopped
(SIGINT, then killed) in the fixture's teardown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pytriton", reason="nvidia-pytriton is not installed (pip install -e '.[serve]')")
http = pytest.importorskip("tritonclient.http", reason="tritonclient is not installed (pip install -e '.[serve]')")
grpc = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is not installed")
from tritonclient.utils import InferenceServerException  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    http_url: str
    grpc_url: str
    log: Path
    pid: int  # the serve process (its children: tritonserver and the Python-backend stubs)


def _start(cmd: list[str], port: int, log: Path) -> subprocess.Popen[bytes] | None:
    """Start serve; the process once its model is ready, or None if it exited during start-up (log kept)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    client = http.InferenceServerClient(f"127.0.0.1:{port}")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        try:
            if client.is_model_ready("pipeline"):
                return proc
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        time.sleep(0.5)
    _stop(proc)
    pytest.fail("serve was not ready within 180 s:\n" + log.read_text()[-3000:])


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``diffusion-trt serve`` on free loopback ports. A start-up that dies is retried once, loudly: about one
    start in ten died here while PyTriton's Python-backend stubs initialised (cause not found yet)."""
    folder = tmp_path_factory.mktemp("serve")
    exe = Path(sys.executable).parent / "diffusion-trt"
    proc = None
    for attempt in (1, 2):
        port, grpc_port = _free_port(), _free_port()
        log = folder / f"serve-{attempt}.log"
        cmd = [str(exe), "serve", str(tiny_artifact), "--port", str(port), "--grpc-port", str(grpc_port),
               "--max-batch-size", "4", "--max-queue-delay-ms", "50", "--max-steps", "20", "--max-queue", "4",
               "--queue-timeout-s", "2"]
        proc = _start(cmd, port, log)
        if proc is not None:
            break
        warnings.warn(f"serve start-up attempt {attempt} died:\n{log.read_text()[-3000:]}", stacklevel=1)
    if proc is None:
        pytest.fail("serve died twice during start-up; logs in " + str(folder))
    try:
        yield Server(f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", log, proc.pid)
    finally:
        _stop(proc)


def _inputs(module: Any, **fields: Any) -> list[Any]:
    types = {"prompt": "BYTES", "negative_prompt": "BYTES", "seed": "INT64", "steps": "INT32",
             "guidance_scale": "FP32", "height": "INT32", "width": "INT32"}
    out = []
    for name, value in fields.items():
        triton_type = types.get(name, "BYTES")
        if isinstance(value, np.ndarray):
            array = value
            triton_type = {"f": "FP32", "i": "INT64"}.get(array.dtype.kind, triton_type)
            if array.dtype == np.int32:
                triton_type = "INT32"
        elif triton_type == "BYTES":
            array = np.array([value if isinstance(value, bytes) else str(value).encode()], dtype=object)
        else:
            array = np.array([value], dtype={"INT64": np.int64, "INT32": np.int32, "FP32": np.float32}[triton_type])
        tensor = module.InferInput(name, list(array.shape), triton_type)
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def _generate(url: str, **fields: Any) -> np.ndarray:
    client = http.InferenceServerClient(url, network_timeout=120)
    return client.infer("pipeline", _inputs(http, **fields)).as_numpy("image")


@pytest.fixture(scope="module")
def expected(tiny_artifact: Path) -> dict[int, np.ndarray]:
    """EnginePipeline in this process, seeds 0..7, the same request as the server gets."""
    from diffusion_trt.runtime import EnginePipeline

    with EnginePipeline.from_artifacts(tiny_artifact) as pipe:
        return {
            seed: np.asarray(pipe("a guohua landscape", num_inference_steps=STEPS, seed=seed, progress=False).images[0])
            for seed in range(8)
        }


def test_images_equal_engine_pipeline(server: Server, expected: dict[int, np.ndarray]) -> None:
    for seed in (0, 1):
        image = _generate(server.http_url, prompt="a guohua landscape", seed=seed, steps=STEPS)
        assert image.dtype == np.uint8 and image.shape == (64, 64, 3)
        np.testing.assert_array_equal(image, expected[seed])
    client = grpc.InferenceServerClient(server.grpc_url)
    result = client.infer("pipeline", _inputs(grpc, prompt="a guohua landscape", seed=2, steps=STEPS))
    np.testing.assert_array_equal(result.as_numpy("image"), expected[2])


def test_concurrent_requests_are_batched_and_equal(server: Server, expected: dict[int, np.ndarray]) -> None:
    before = len(re.findall(r"ran a batch of (\d+)", server.log.read_text()))
    # 4 in flight at most: the fixture's --max-queue. With 8 at once, a burst that reached Triton faster than it
    # handed requests to the 8 instances overflowed the queue (503 "Exceeds maximum queue size" in CI); that bound is
    # test_a_full_queue_answers_503...'s subject, not this test's
    with ThreadPoolExecutor(4) as pool:
        images = list(pool.map(lambda s: _generate(server.http_url, prompt="a guohua landscape", seed=s,
                                                   steps=STEPS), range(8)))
    for seed, image in enumerate(images):
        diff = np.abs(image.astype(int) - expected[seed].astype(int))
        assert diff.max() <= 1, (seed, diff.max())  # batched rows: same noise; float sums may round differently
    sizes = [int(n) for n in re.findall(r"ran a batch of (\d+)", server.log.read_text())[before:]]
    assert sum(sizes) == 8 and max(sizes) > 1, sizes


#: Requests our rules refuse, and the one line each must get: (fields, message). Status: HTTP 400 / INVALID_ARGUMENT.
BAD_REQUESTS: list[tuple[str, dict[str, Any], str]] = [
    ("missing-prompt", {"seed": 1}, "prompt is required (BYTES, shape [1])"),
    ("steps-0", {"prompt": "x", "steps": 0}, "steps=0 must be in 1..20; use e.g. 30"),
    ("steps-int32-max", {"prompt": "x", "steps": 2**31 - 1}, "steps=2147483647 must be in 1..20"),
    ("height-65", {"prompt": "x", "height": 65}, "height=65 must be a multiple of 8 in 32..128 (the engines' profile)"),
    ("height-100000", {"prompt": "x", "height": 100_000}, "height=100000 must be a multiple of 8 in 32..128"),
    ("height-7", {"prompt": "x", "height": 7}, "height=7 must be a multiple of 8"),
    ("guidance-nan", {"prompt": "x", "guidance_scale": float("nan")}, "guidance_scale=nan must be in 0..50"),
    ("guidance-1e9", {"prompt": "x", "guidance_scale": 1e9}, "guidance_scale=1000000000.0 must be in 0..50"),
    ("seed-minus-1", {"prompt": "x", "seed": -1}, "seed=-1 must be in 0..9223372036854775807"),
    ("prompt-5000-chars", {"prompt": "x" * 5000}, "prompt has 5000 characters; at most 2000 are accepted"),
    ("prompt-not-utf8", {"prompt": b"\xff\xfe"}, "prompt is not valid UTF-8 (invalid start byte at byte 0)"),
    ("negative-not-utf8", {"prompt": "x", "negative_prompt": b"ok \xff"}, "negative_prompt is not valid UTF-8"),
    # Triton's own check of the model config (never reaches Python): 400 too
    ("steps-fp32", {"prompt": "x", "steps": np.array([3.0], np.float32)},
     "input 'steps' data-type is 'FP32', but model 'pipeline' expects 'INT32'"),
]


def _no_internals(message: str) -> None:
    """No traceback, no server path, no exception class in what a client reads."""
    assert "Traceback" not in message and 'File "' not in message and "/tmp/" not in message, message
    assert "Error:" not in message and "Exception" not in message and "\n" not in message.strip(), message


@pytest.mark.parametrize(("fields", "message"), [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_400_with_one_line_naming_the_field_and_the_server_keeps_serving(
    server: Server, expected: dict[int, np.ndarray], fields: dict[str, Any], message: str
) -> None:
    """HTTP 400 and gRPC INVALID_ARGUMENT, the message one line naming the field and the range (issue 14, item 11;
    before: 500 / INTERNAL with PyTriton's traceback and server paths)."""
    with pytest.raises(InferenceServerException) as err:
        _generate(server.http_url, **fields)
    assert err.value.status() == "400", (err.value.status(), err.value.message()[-500:])
    assert message in err.value.message(), err.value.message()[-500:]
    _no_internals(err.value.message())
    client = grpc.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.infer("pipeline", _inputs(grpc, **fields))
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT", (err.value.status(), err.value.message()[-500:])
    assert message in err.value.message()
    _no_internals(err.value.message())
    np.testing.assert_array_equal(_generate(server.http_url, prompt="a guohua landscape", seed=3, steps=STEPS),
                                  expected[3])


def _benchmark(name: str) -> Any:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


#: The HTTP front's body bound for the default 2,000-character prompts (ServeConfig.front_limits).
MAX_BODY = 65536 + 24 * 2000


def _tree_mb(abuse: Any, pid: int) -> float:
    return sum(abuse.rss_mb(p) for p in abuse.process_tree(pid))


def test_oversized_prompt_is_refused_before_it_reaches_python(server: Server, expected: dict[int, np.ndarray]) -> None:
    """A 48 MB prompt: over HTTP 413 from serve's front before any process reads the body; over gRPC
    RESOURCE_EXHAUSTED from serve's relay, from the message's length prefix; the serve process's memory stays put
    (issue 14, item 12; before: 500 after the whole body reached the 2,000-character check, and RSS grew by the body
    each time; issue 24, item 12: gRPC reached Triton, the stub's byte bound answered 400)."""
    abuse = _benchmark("serve_abuse")
    big = b"x" * (48 * 2**20)
    _generate(server.http_url, prompt="warm-up", steps=1)
    before = abuse.rss_mb(server.pid)
    for _ in range(3):
        with pytest.raises(InferenceServerException) as err:
            _generate(server.http_url, prompt=big)
        assert err.value.status() == "413", err.value.message()[-300:]
        assert f"bytes; at most {MAX_BODY} are accepted" in err.value.message(), err.value.message()
        _no_internals(err.value.message())
    with pytest.raises(InferenceServerException) as err:
        grpc.InferenceServerClient(server.grpc_url).infer("pipeline", _inputs(grpc, prompt="x", negative_prompt=big))
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED", (err.value.status(), err.value.message()[-300:])
    assert "Received message larger than max" in err.value.message(), err.value.message()
    assert f"vs. {MAX_BODY})" in err.value.message(), err.value.message()
    grown = abuse.rss_mb(server.pid) - before
    assert grown < 24, f"the serve process grew by {grown:.0f} MB over four 48 MB prompts"
    np.testing.assert_array_equal(_generate(server.http_url, prompt="a guohua landscape", seed=4, steps=STEPS),
                                  expected[4])


def test_a_256_mb_body_is_refused_before_any_process_of_the_server_holds_it(server: Server) -> None:
    """Issue 24, item 12: a 256 MB body (raw JSON, and a prompt through tritonclient) gets 413 from serve's HTTP front,
    which reads it 1 MiB at a time and drops it, and RESOURCE_EXHAUSTED from its gRPC relay; no process of the tree
    grows (before: 400 from the stub, but tritonserver and the stub that took it kept ~+512 MB each)."""
    abuse = _benchmark("serve_abuse")
    big = b"x" * (256 * 2**20)
    raw = b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["' + big + b'"]}]}'
    _generate(server.http_url, prompt="warm-up", steps=1)
    before = {p: abuse.rss_mb(p) for p in abuse.process_tree(server.pid)}
    status, text = abuse.raw_post(server.http_url, raw, timeout_s=300)
    assert status == 413 and f"the request body is {len(raw)} bytes; at most {MAX_BODY} are accepted" in text, text
    del raw
    with pytest.raises(InferenceServerException) as err:
        http.InferenceServerClient(server.http_url, network_timeout=300).infer("pipeline", _inputs(http, prompt=big))
    assert err.value.status() == "413", err.value.message()[-300:]
    with pytest.raises(InferenceServerException) as err:
        grpc.InferenceServerClient(server.grpc_url).infer("pipeline", _inputs(grpc, prompt=big), client_timeout=300)
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED", err.value.message()[-300:]
    grown = {p: abuse.rss_mb(p) - mb for p, mb in before.items()}
    assert max(grown.values()) < 32, f"processes grew (MB): {grown}"
    assert _generate(server.http_url, prompt="x", steps=1).shape == (64, 64, 3)


#: Issue 24, item 12: bodies Triton 2.51's parser answered with 500 (or ran with a wrapped value), and the 400 line
#: serve's HTTP front now gives each.
PARSER_400: list[tuple[str, bytes, str]] = [
    ("seed-2^63", b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["x"]}, '
                  b'{"name": "seed", "datatype": "INT64", "shape": [1], "data": [9223372036854775808]}]}',
     "seed=9223372036854775808 is outside INT64's range -9223372036854775808..9223372036854775807"),
    ("shape-minus-1", b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [-1], "data": ["x"]}]}',
     'input "prompt": shape=[-1] must be a list of integers >= 0, e.g. [1]'),
    ("timeout-minus-1", b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["x"]}], '
                        b'"parameters": {"timeout": -1}}',
     "parameters.timeout=-1 must be an integer in 0..18446744073709551615"),
    ("timeout-abc", b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["x"]}], '
                    b'"parameters": {"timeout": "abc"}}',
     'parameters.timeout="abc" must be an integer in 0..18446744073709551615'),
    ("lone-surrogate", b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["a \\ud800"]}]}',
     'input "prompt" (BYTES): element 0 holds a lone surrogate ("\\ud800" at character 2), which is not text; send '
     "the text as UTF-8"),
    ("steps-2^32+3", b'{"inputs": [{"name": "prompt", "datatype": "BYTES", "shape": [1], "data": ["x"]}, '
                     b'{"name": "steps", "datatype": "INT32", "shape": [1], "data": [4294967299]}]}',
     "steps=4294967299 is outside INT32's range -2147483648..2147483647"),  # Triton ran it with steps=3
    ("malformed", b'{"inputs": [', "the request body is not valid JSON (Expecting value at character 12)"),
    ("array", b"[]", "the request must be a JSON object, got []"),
    ("null", b"null", "the request must be a JSON object, got null"),
]


@pytest.mark.parametrize(("body", "message"), [c[1:] for c in PARSER_400], ids=[c[0] for c in PARSER_400])
def test_bodies_triton_answered_500_get_400_naming_the_field(server: Server, body: bytes, message: str) -> None:
    abuse = _benchmark("serve_abuse")
    status, text = abuse.raw_post(server.http_url, body)
    assert (status, json.loads(text)) == (400, {"error": message})


def _statuses(url: str, n: int, **fields: Any) -> list[tuple[str, str]]:
    """(status, message) of ``n`` concurrent requests ("200", "" when one succeeds)."""
    def one(_: int) -> tuple[str, str]:
        try:
            http.InferenceServerClient(url, network_timeout=300).infer("pipeline", _inputs(http, **fields), **extra)
            return "200", ""
        except InferenceServerException as e:
            return str(e.status()), e.message()

    extra = {"timeout": fields.pop("timeout_us")} if "timeout_us" in fields else {}
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_a_full_queue_answers_503_and_expired_requests_are_dropped(server: Server) -> None:
    """--max-queue 4, --queue-timeout-s 2 and 8 instances: of 20 heavy requests at once, up to 8 run, 4 wait and the
    rest get 503 "Exceeds maximum queue size" at once; a request that waited longer than 2 s is rejected (503
    "Request timeout expired"; here the client's own 1 us timeout), not run (issue 14, item 13; before: every request
    waited, unbounded, and was computed)."""
    heavy = {"prompt": "a guohua landscape", "steps": 20}
    results = _statuses(server.http_url, 20, **heavy)
    # how many of the 20 run depends on how fast the batcher hands the burst to instances (CI once saw 7, not 8):
    # what must hold is that some ran, the bounded queue refused some at once, and nothing else happened
    assert "200" in {c for c, _ in results}, results
    full = [m for c, m in results if "Exceeds maximum queue size" in m]
    assert full and all(c == "200" or (c == "503" and ("Exceeds maximum queue size" in m or
                                                        "Request timeout expired" in m)) for c, m in results), results
    stop = time.monotonic() + 8

    def keep_busy(_: int) -> list[list[tuple[str, str]]]:
        return [_statuses(server.http_url, 1, **heavy) for _ in iter(lambda: time.monotonic() < stop, False)]

    with ThreadPoolExecutor(8) as pool:
        busy = list(map(pool.submit, [keep_busy] * 8, range(8)))  # all 8 instances busy, back to back, for 8 s
        time.sleep(3.0)
        # 1 us: shorter than any wait. (20 ms flaked in CI: one of 8 instances, between two back-to-back requests,
        # took a late one within its 20 ms, so it ran; 1 us leaves no such window.)
        late = _statuses(server.http_url, 3, prompt="x", steps=1, timeout_us=1)
        kept_busy = [s for f in busy for r in f.result() for s in r]
    # Triton drops an expired request when an instance frees and it is dequeued: until then the late ones hold queue
    # slots, so a busy thread's next request may find the queue (4) full; every other busy request ran
    assert all(c == "200" or (c == "503" and ("Exceeds maximum queue size" in m or "Request timeout expired" in m))
               for c, m in kept_busy), kept_busy
    assert sum(c == "200" for c, _ in kept_busy) >= 8, kept_busy
    assert all(c == "503" and "Request timeout expired" in m for c, m in late), late


def test_bodies_triton_cannot_parse_get_one_line_4xx_and_leave_nothing_behind(server: Server) -> None:
    """Every body of serve_abuse.PARSER_CASES (malformed JSON, null, 10 MB of junk, 100,000 brackets...): 400 (413 for
    the junk, over the body bound) from serve's front with one line, never 500, before Triton's parser or model code
    sees it; the process tree's memory does not keep the bodies (issue 14, item 14; issue 24, item 12: Triton 2.51
    answered most of them 500)."""
    abuse = _benchmark("serve_abuse")
    abuse.raw_post(server.http_url, abuse.PARSER_CASES[-1][1])  # a first large body sizes the buffers, if any
    before = _tree_mb(abuse, server.pid)
    for _ in range(3):
        for name, body in abuse.PARSER_CASES:
            status, text = abuse.raw_post(server.http_url, body)
            assert status == (413 if len(body) > MAX_BODY else 400), (name, status, text)
            assert text.startswith('{"error": ') and "\n" not in text and "Traceback" not in text, (name, text)
    grown = _tree_mb(abuse, server.pid) - before
    assert grown < 40, f"the server's processes grew by {grown:.0f} MB over 3 x 10 MB of junk"
    assert _generate(server.http_url, prompt="x", steps=1).shape == (64, 64, 3)


def test_load_200_requests_8_concurrent(server: Server) -> None:
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import serve_load
    finally:
        sys.path.pop(0)
    result = serve_load.run(server.http_url, requests=200, concurrency=8, steps=STEPS, deadline_s=300,
                            prompt="a guohua landscape")
    print(f"\nload: {result}")  # shown with -s; the resolution report quotes it
    assert result["failures"] == 0, result["first_errors"]
    assert result["ok"] == 200


def test_serve_listens_on_loopback_only(server: Server) -> None:
    """Every listening socket of the HTTP and gRPC ports is bound to 127.0.0.1 (read from /proc/net/tcp*)."""
    ports = {int(url.rsplit(":", 1)[1]) for url in (server.http_url, server.grpc_url)}
    listening: list[tuple[str, int]] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port = local.rsplit(":", 1)
            if state == "0A" and int(port, 16) in ports:  # 0A = LISTEN
                listening.append((address, int(port, 16)))
    if not listening:
        pytest.skip("cannot read listening sockets from /proc/net/tcp on this system")
    assert {port for _, port in listening} == ports
    loopback = {"0100007F", "0000000000000000FFFF00000100007F"}  # 127.0.0.1 and ::ffff:127.0.0.1 (kernel hex)
    assert all(address in loopback for address, _ in listening), listening

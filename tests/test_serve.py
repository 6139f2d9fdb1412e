"""`diffusion-trt serve`: a real Triton server (PyTriton) on loopback, spoken to with tritonclient.

Skipped with a reason where nvidia-pytriton or tritonclient is not installed (`pip install -e '.[serve]'`).
The server runs as a subprocess on free loopback ports; every wait is bounded and the process is stopped
(SIGINT, then killed) in the fixture's teardown.
"""

from __future__ import annotations

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
               "--max-batch-size", "4", "--max-queue-delay-ms", "50", "--max-steps", "20"]
        proc = _start(cmd, port, log)
        if proc is not None:
            break
        warnings.warn(f"serve start-up attempt {attempt} died:\n{log.read_text()[-3000:]}", stacklevel=1)
    if proc is None:
        pytest.fail("serve died twice during start-up; logs in " + str(folder))
    try:
        yield Server(f"127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", log)
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
            array = np.array([str(value).encode()], dtype=object)
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
    with ThreadPoolExecutor(8) as pool:
        images = list(pool.map(lambda s: _generate(server.http_url, prompt="a guohua landscape", seed=s,
                                                   steps=STEPS), range(8)))
    for seed, image in enumerate(images):
        diff = np.abs(image.astype(int) - expected[seed].astype(int))
        assert diff.max() <= 1, (seed, diff.max())  # batched rows: same noise; float sums may round differently
    sizes = [int(n) for n in re.findall(r"ran a batch of (\d+)", server.log.read_text())[before:]]
    assert sum(sizes) == 8 and max(sizes) > 1, sizes


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"seed": 1}, "prompt is required"),
        ({"prompt": "x", "steps": 0}, "steps=0 must be in 1..20"),
        ({"prompt": "x", "height": 7}, "height=7 must be a multiple of 8"),
        ({"prompt": "x" * 10_000}, "prompt has 10000 characters"),
        ({"prompt": "x", "steps": np.array([3.0], np.float32)},
         "input 'steps' data-type is 'FP32', but model 'pipeline' expects 'INT32'"),
        ({"prompt": "x", "guidance_scale": 1e9}, "guidance_scale=1000000000.0 must be in 0..50"),
    ],
)
def test_bad_input_gets_an_error_naming_the_field_and_the_server_keeps_serving(
    server: Server, expected: dict[int, np.ndarray], fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InferenceServerException) as err:
        _generate(server.http_url, **fields)
    assert message in str(err.value), str(err.value)[-500:]
    np.testing.assert_array_equal(_generate(server.http_url, prompt="a guohua landscape", seed=3, steps=STEPS),
                                  expected[3])


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

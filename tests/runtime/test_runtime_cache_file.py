"""The TensorRT-RTX runtime-cache file as an attacker leaves it (issue 24, item 9): whatever sits at the cache's path,
loading it is a miss with a warning, at once, in bounded memory, never an exception or a hang.

Pure file handling (``runtime_cache`` imports no tensorrt); runs anywhere. The sparse files take no disk space.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

from diffusion_trt import trt_compat
from diffusion_trt.compiler import build_trt
from diffusion_trt.runtime.engines import runtime_cache as rc

KEY = rc.RuntimeCacheKey("tensorrt-rtx", "1.7.1.116", "8.9", "NVIDIA GeForce RTX 4090")
WHERE = "engine 'unet'"


def _framed(header: bytes, payload: bytes = b"") -> bytes:
    return rc.RUNTIME_CACHE_MAGIC + struct.pack("<I", len(header)) + header + payload


def _load(path: Path, caplog: pytest.LogCaptureFixture) -> tuple[bytes | None, str]:
    """``load_runtime_cache`` in a thread that must end within 20 s (a FIFO that blocks is unblocked by the test, so
    a regression fails instead of hanging the run)."""
    out: dict[str, Any] = {"unblocked": False}

    def target() -> None:
        try:
            out["payload"] = rc.load_runtime_cache(path, KEY, WHERE)
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            out["error"] = e

    with caplog.at_level(logging.INFO, logger="diffusion_trt.runtime.engines.runtime_cache"):
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join(20)
        if thread.is_alive() and path.is_fifo():  # blocked in open(): give it a writer, then EOF
            out["unblocked"] = True
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(20)
    assert not thread.is_alive(), f"loading {path} did not return within 20 s"
    assert not out["unblocked"], f"loading {path} blocked on the FIFO until the test opened it for writing"
    assert "error" not in out, f"loading {path} raised {type(out['error']).__name__}: {out['error']}"
    return out["payload"], caplog.text


def test_a_deeply_nested_header_is_a_miss_not_a_recursion_error(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                                 ) -> None:
    path = tmp_path / "unet.runtime-cache"
    path.write_bytes(_framed(b"[" * 20_000 + b"]" * 20_000, b"kernels"))
    payload, log = _load(path, caplog)
    assert payload is None
    assert f"{WHERE}: ignoring the runtime cache {path}: unreadable header (nests deeper" in log


def test_a_header_longer_than_any_we_write_is_not_parsed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "unet.runtime-cache"
    n = trt_compat.MAX_FRAME_HEADER_BYTES + 1
    path.write_bytes(_framed(b" " * n))
    payload, log = _load(path, caplog)
    assert payload is None and f"a header of {n} bytes" in log


def test_a_file_larger_than_the_bound_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A sparse file one byte over the bound (today's reader read it whole; a 20 GB one exhausted memory)."""
    path = tmp_path / "unet.runtime-cache"
    with open(path, "wb") as f:
        f.write(rc.pack_runtime_cache(KEY, b"kernels"))
        f.truncate(rc.MAX_RUNTIME_CACHE_BYTES + 1)
    payload, log = _load(path, caplog)
    assert payload is None
    assert f"it has {rc.MAX_RUNTIME_CACHE_BYTES + 1} bytes, more than the {rc.MAX_RUNTIME_CACHE_BYTES}" in log


@pytest.mark.parametrize("target", ["/dev/zero", "a valid cache"])
def test_a_symbolic_link_is_not_followed(tmp_path: Path, caplog: pytest.LogCaptureFixture, target: str) -> None:
    """Not even to a valid cache: the link is refused (the next save replaces the link itself, not its target)."""
    if target == "/dev/zero":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero here")
        dest = Path("/dev/zero")
    else:
        dest = tmp_path / "elsewhere"
        dest.write_bytes(rc.pack_runtime_cache(KEY, b"kernels"))
    path = tmp_path / "unet.runtime-cache"
    path.symlink_to(dest)
    payload, log = _load(path, caplog)
    assert payload is None and "it is a symbolic link, which is not followed" in log
    assert rc.save_runtime_cache(path, KEY, b"new kernels", WHERE)
    assert not path.is_symlink() and rc.load_runtime_cache(path, KEY, WHERE) == b"new kernels"
    if target != "/dev/zero":
        assert rc.load_runtime_cache(dest, KEY, WHERE) == b"kernels"  # the link's target is untouched


def test_a_fifo_does_not_block(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "unet.runtime-cache"
    os.mkfifo(path)
    payload, log = _load(path, caplog)
    assert payload is None and "it is not a regular file (mode p" in log


@pytest.mark.parametrize("kind", ["device", "folder"])
def test_a_device_or_a_folder_is_not_read(tmp_path: Path, caplog: pytest.LogCaptureFixture, kind: str) -> None:
    if kind == "device":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero here")
        path = Path("/dev/zero")
    else:
        path = tmp_path / "unet.runtime-cache"
        path.mkdir()
    payload, log = _load(path, caplog)
    assert payload is None and "it is not a regular file (mode " in log


def test_header_values_are_printed_escaped_and_short(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A foreign header's values reach the warning line without their control characters."""
    path = tmp_path / "unet.runtime-cache"
    header = {"format": 1, "library": "x\x1b]0;pwned\x07", "version": "9" * 500, "gpu": "g",
              "compute_capability": "8.9", "sha256": "", "size": 0}
    path.write_bytes(_framed(json.dumps(header).encode()))
    payload, log = _load(path, caplog)
    assert payload is None and "\x1b" not in log and "\\x1b]0;pwned\\x07" in log and "9" * 100 not in log
    path.write_bytes(_framed(json.dumps({**header, "format": "\x1b[2J"}).encode()))
    payload, log = _load(path, caplog)
    assert payload is None and "format \\x1b[2J != 1" in log


def test_an_oversized_cache_is_not_saved(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What would not be read back is not written (a warning, as for a full disk)."""
    monkeypatch.setattr(rc, "MAX_RUNTIME_CACHE_BYTES", 1000)
    path = tmp_path / "unet.runtime-cache"
    with caplog.at_level(logging.WARNING, logger="diffusion_trt.runtime.engines.runtime_cache"):
        assert not rc.save_runtime_cache(path, KEY, b"k" * 1000, WHERE)
    assert "more than a cache file may hold (1000); not saved" in caplog.text and not path.exists()
    assert rc.save_runtime_cache(path, KEY, b"k" * 100, WHERE) and rc.load_runtime_cache(path, KEY, WHERE) == b"k" * 100


def test_the_timing_cache_is_read_by_the_same_rules(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The build's timing cache shares the framing and the reader: a FIFO or a link there is ignored at once."""
    key = trt_compat.TimingCacheKey("10.8.0.43", "9.0")
    os.mkfifo(tmp_path / key.filename)
    with caplog.at_level(logging.WARNING, logger="diffusion_trt.compiler.build_trt"):
        payload, facts = build_trt.read_timing_cache(tmp_path, key)
    assert payload is None and facts["ignored"].startswith("it is not a regular file")
    (tmp_path / key.filename).unlink()
    (tmp_path / "real").write_bytes(trt_compat.pack_timing_cache(key, b"timings"))
    (tmp_path / key.filename).symlink_to(tmp_path / "real")
    payload, facts = build_trt.read_timing_cache(tmp_path, key)
    assert payload is None and "symbolic link" in facts["ignored"]
    (tmp_path / key.filename).unlink()
    (tmp_path / "real").rename(tmp_path / key.filename)
    assert build_trt.read_timing_cache(tmp_path, key)[0] == b"timings"

"""Read + sha256 throughput of one large artifact file, as the artifact reader does it (issue 28: >= 4 GB/s).

    python benchmarks/read_hash_throughput.py [FILE] [--bytes 1700000000] [--repeat 2] [--sweep] [--json OUT.json]

Reads FILE (default: a random file of --bytes written under /tmp, then read from the page cache) with
:func:`diffusion_trt.artifact.digests.read_into` (64 MiB chunks on ``digests.workers()`` threads, each chunk hashed
on its thread), into the reader's buffer (private anonymous memory) and, for comparison, into a ``bytearray`` as
before (which zero-fills every page on one thread first). Prints and writes seconds and GB/s per repeat.

``--sweep`` adds the rows that say where the time goes: sha256 of one in-memory 64 MiB chunk on one thread (the
per-core hash speed), the read alone (no hash), the reader with 1, 2, 4, 8 and 16 threads, and the private buffer
without transparent huge pages.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import time
from pathlib import Path
from unittest import mock

from diffusion_trt.artifact import digests


def _sha256(_index: int, part: memoryview) -> None:
    hashlib.sha256(part).hexdigest()


def timed_read(path: Path, buffer: str, threads: int | None = None, hash_chunks: bool = True) -> float:
    """Seconds of one read + per-chunk sha256 of ``path`` into a ``buffer`` ("private", "private-4k": without huge
    pages, or "bytearray") on ``threads`` threads (default :func:`digests.workers`); ``hash_chunks=False``: the read
    alone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        patches = contextlib.ExitStack()
        if buffer == "bytearray":
            patches.enter_context(mock.patch.object(digests, "private_buffer", bytearray))
        if buffer == "private-4k":
            patches.enter_context(mock.patch.object(digests, "HUGE_PAGE_MIN_BYTES", size + 1))
        if threads is not None:
            patches.enter_context(mock.patch.object(digests, "workers", lambda: threads))
        with patches:
            t = time.perf_counter()
            view = digests.read_into(fd, size, _sha256 if hash_chunks else None)
            seconds = time.perf_counter() - t
        view.release()
        return seconds
    finally:
        os.close(fd)


def sweep_rows(path: Path, size: int) -> list[dict[str, object]]:
    """The diagnostic rows of ``--sweep`` (see the module docstring)."""
    chunk = os.urandom(digests.CHUNK_BYTES)
    t = time.perf_counter()
    hashlib.sha256(chunk).hexdigest()
    one = time.perf_counter() - t
    rows: list[dict[str, object]] = [{"what": "sha256 in memory, 1 thread", "bytes": len(chunk),
                                      "seconds": round(one, 4), "gb_per_s": round(len(chunk) / one / 1e9, 3)}]
    cases = [("read only", "private", None, False), ("private-4k", "private-4k", None, True)]
    cases += [(f"private, {n} threads", "private", n, True) for n in (1, 2, 4, 8, 16)]
    for what, buffer, threads, hash_chunks in cases:
        s = timed_read(path, buffer, threads, hash_chunks)
        rows.append({"what": what, "bytes": size, "seconds": round(s, 3), "gb_per_s": round(size / s / 1e9, 3)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", type=Path, default=None)
    ap.add_argument("--bytes", type=int, default=1_700_000_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="also the rows that say where the time goes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    path = args.file
    if path is None:
        path = Path("/tmp/read_hash_throughput.bin")
        if not path.is_file() or path.stat().st_size != args.bytes:
            with open(path, "wb") as f:
                for _ in range(0, args.bytes, 64 << 20):
                    f.write(os.urandom(min(64 << 20, args.bytes - f.tell())))
    size = path.stat().st_size
    timed_read(path, "private")  # page cache warm
    res = {"file_bytes": size, "workers": digests.workers(), "cpus": os.cpu_count(), "machine": platform.node(),
           "rows": []}
    for rep in range(args.repeat):
        for buffer in ("bytearray", "private"):
            s = timed_read(path, buffer)
            res["rows"].append({"repeat": rep, "buffer": buffer, "seconds": round(s, 3),
                                "gb_per_s": round(size / s / 1e9, 3)})
            print(json.dumps(res["rows"][-1]), flush=True)
    if args.sweep:
        res["sweep"] = sweep_rows(path, size)
        for row in res["sweep"]:
            print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Read + sha256 throughput of one large artifact file, as the artifact reader does it (issue 28: >= 4 GB/s).

    python benchmarks/read_hash_throughput.py [FILE] [--bytes 1700000000] [--repeat 2] [--json OUT.json]

Reads FILE (default: a random file of --bytes written under /tmp, then read from the page cache) with
:func:`diffusion_trt.artifact.digests.read_into` (64 MiB chunks on ``digests.workers()`` threads, each chunk hashed
on its thread), into the reader's buffer (private anonymous memory) and, for comparison, into a ``bytearray`` as
before (which zero-fills every page on one thread first). Prints and writes seconds and GB/s per repeat.
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


def timed_read(path: Path, buffer: str) -> float:
    """Seconds of one read + per-chunk sha256 of ``path`` into a ``buffer`` ("private" or "bytearray")."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        patch = (mock.patch.object(digests, "private_buffer", bytearray) if buffer == "bytearray"
                 else contextlib.nullcontext())
        with patch:
            t = time.perf_counter()
            view = digests.read_into(fd, size, lambda i, part: hashlib.sha256(part).hexdigest())
            seconds = time.perf_counter() - t
        view.release()
        return seconds
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", type=Path, default=None)
    ap.add_argument("--bytes", type=int, default=1_700_000_000)
    ap.add_argument("--repeat", type=int, default=2)
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
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

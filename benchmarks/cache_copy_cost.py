"""What the compile cache pays for copies instead of hard links: one large file (default 1.72 GB, the size of an
SD-1.5 fp16 UNet) hard-linked, cloned with FICLONE, copied by the cache's own ``clone_or_copy``, and its sha256
computed (the verification every cache hit already makes), each with a cold and a warm page cache.

    python benchmarks/cache_copy_cost.py --work /tmp/copy-cost [--gb 1.72] [--repeat 3] [--json out.json]

"cold": ``/proc/sys/vm/drop_caches`` before each run (needs root; skipped with a note elsewhere). A copy's seconds
include ``fsync`` of the copy, so the page cache does not hide the writes. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from diffusion_trt.artifact.folder import sha256_file  # noqa: E402
from diffusion_trt.compiler.cache import _FICLONE, clone_or_copy  # noqa: E402


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _write_source(path: Path, size: int) -> None:
    chunk = os.urandom(64 << 20)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed(step: Callable[[], Any], cold: bool, cleanup: Callable[[], None]) -> float | None:
    cleanup()
    if cold and not _drop_caches():
        return None
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    cleanup()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--gb", type=float, default=1.72)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    src, dst = args.work / "src.bin", args.work / "dst.bin"
    size = int(args.gb * 1e9)
    _write_source(src, size)

    def rm_dst() -> None:
        dst.unlink(missing_ok=True)

    def ficlone() -> None:
        with open(src, "rb") as fin, open(dst, "xb") as fout:
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())

    try:
        ficlone()
        reflink = "supported"
    except OSError as e:
        reflink = f"not supported here ({errno.errorcode.get(e.errno or 0, e.errno)})"
    rm_dst()

    def copy() -> None:
        how = clone_or_copy(src, dst)
        _fsync(dst)
        results["clone_or_copy_wrote"] = how

    def copy_shutil() -> None:
        shutil.copyfile(src, dst)
        _fsync(dst)

    fs = subprocess.run(["df", "-T", str(args.work)], capture_output=True, text=True).stdout.splitlines()[-1].split()[1]
    results: dict[str, Any] = {
        "what": "compile cache: the cost of a copy (or reflink) instead of a hard link, next to the sha256 pass a "
                "hit already makes",
        "command": " ".join(["python", "benchmarks/cache_copy_cost.py", *sys.argv[1:]]),
        "bytes": size,
        "file_system": fs,
        "reflink_ficlone": reflink,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average_before": list(os.getloadavg()),
    }
    steps: dict[str, tuple[Callable[[], Any], Callable[[], None]]] = {
        "hard_link": (lambda: os.link(src, dst), rm_dst),
        "clone_or_copy_plus_fsync": (copy, rm_dst),
        "shutil_copyfile_plus_fsync": (copy_shutil, rm_dst),
        "sha256_read": (lambda: sha256_file(src), lambda: None),
    }
    if reflink == "supported":
        steps["ficlone"] = (ficlone, rm_dst)
    for name, (step, cleanup) in steps.items():
        for cache in ("cold", "warm"):
            runs = [_timed(step, cache == "cold", cleanup) for _ in range(args.repeat)]
            if any(r is None for r in runs):
                results[f"{name}_{cache}"] = "skipped: cannot drop the page cache (needs root)"
                continue
            secs = [float(r) for r in runs if r is not None]
            median = statistics.median(secs)
            results[f"{name}_{cache}"] = {"seconds": [round(s, 4) for s in secs], "median_s": round(median, 4),
                                          "GB_per_s": round(size / 1e9 / median, 2) if median > 1e-3 else None}
            print(f"{name} {cache}: median {median:.3f} s", flush=True)
    results["load_average_after"] = list(os.getloadavg())
    src.unlink()
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()

"""Read + sha256 of one large artifact file into a private file, as the ORT load path does (issue 28), per folder.

    python benchmarks/spill_write_throughput.py FILE [--folders $TMPDIR,/dev/shm] [--repeat 2] [--json OUT.json]

The runtime reads each external-data file, hashing each chunk, into a new file of a private folder (a shared
mapping of it: ``digests.spill_buffer``), so that ONNX Runtime opens the hashed bytes by path. On the H100 that read
took 1.19 s for the SD-1.5 UNet's 1.72 GB inside a load, against 0.19 s into private anonymous memory
(``h100-2026-12-07-s20-cold-start.json``). Rows, each ``--repeat`` times, the file removed after each:

* ``anonymous``: into private anonymous memory (``digests.private_buffer``), the reader's default;
* ``FOLDER``: into a new file in FOLDER through its shared mapping, as the runtime does now;
* ``FOLDER+hugepage``: the same with ``MADV_HUGEPAGE`` on the mapping (2 MiB pages where FOLDER is a tmpfs that
  allows them: ``/sys/kernel/mm/transparent_hugepage/shmem_enabled``).

Each row gives seconds and GB/s, and the folder's file system type (``/proc/mounts``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import tempfile
import time
from pathlib import Path

from diffusion_trt.artifact import digests


def _sha256(_index: int, part: memoryview) -> None:
    hashlib.sha256(part).hexdigest()


def fs_type(folder: str) -> str:
    """The file system type of the mount holding ``folder`` (the longest mount point that prefixes it)."""
    best, kind = "", "?"
    real = os.path.realpath(folder)
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and (real == parts[1] or real.startswith(parts[1].rstrip("/") + "/")) \
                    and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def timed(path: Path, folder: str | None, hugepage: bool) -> float:
    """Seconds of one read + per-chunk sha256 of ``path`` into a new file in ``folder`` (None: anonymous memory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        with tempfile.TemporaryDirectory(prefix="spill-bench-", dir=folder) if folder else \
                contextlib.nullcontext() as tmp:
            t = time.perf_counter()
            into = None
            if tmp is not None:
                into = digests.spill_buffer(Path(tmp) / "w.data", size)
                if hugepage and hasattr(mmap, "MADV_HUGEPAGE"):
                    with contextlib.suppress(OSError):
                        into.madvise(mmap.MADV_HUGEPAGE)
            view = digests.read_into(fd, size, _sha256, None, into)
            seconds = time.perf_counter() - t
            view.release()
            if into is not None:
                into.close()
        return seconds
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--folders", default=f"{tempfile.gettempdir()},/dev/shm")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ns = ap.parse_args()
    size = ns.file.stat().st_size
    rows = []
    cases: list[tuple[str, str | None, bool]] = [("anonymous", None, False)]
    for folder in filter(None, ns.folders.split(",")):
        if os.path.isdir(folder):
            cases += [(folder, folder, False), (f"{folder}+hugepage", folder, True)]
    for rep in range(ns.repeat):
        for what, folder, huge in cases:
            s = timed(ns.file, folder, huge)
            row = {"what": what, "fs": fs_type(folder) if folder else "anon", "repeat": rep, "bytes": size,
                   "seconds": round(s, 3), "gb_per_s": round(size / s / 1e9, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if ns.json:
        ns.json.write_text(json.dumps({"file": str(ns.file), "workers": digests.workers(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

"""File digests that verify at memory speed: per-chunk sha256, hashed on several threads.

One sha256 over a file is serial: ~0.7-1 GB/s on one core (2.47 s for the SD-1.5 fp16 UNet's 1.72 GB on the H200
host, issue 28). So the manifest also lists, for every file of at least :data:`CHUNK_BYTES`, the sha256 of each
:data:`CHUNK_BYTES` slice (``files[rel]["chunks"]``). A loader reads the file into one private buffer on
:func:`workers` threads, each thread reading and hashing its own slices (``hashlib`` releases the GIL on large
updates), and compares every slice with the manifest: the bytes handed to ONNX Runtime or TensorRT are the bytes that
were hashed, and a file swapped or edited after the check cannot reach them (the buffer is anonymous memory, not a
mapping of the file).

The whole-file ``sha256`` stays in the manifest (``verify`` and older readers use it); chunk digests are an extra
proof of the same bytes, sealed in the same manifest.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

#: Bytes per hashed slice: large enough that the per-slice overhead vanishes, small enough that a 1.7 GB UNet
#: spreads over 26 slices (every core of a 16-core host busy).
CHUNK_BYTES = 64 << 20
#: Threads that read and hash at most. H200 host (16 cores), the SD-1.5 UNet's 1.72 GB from the page cache,
#: 2026-12-02 (``benchmarks/read_hash_throughput.py --sweep``, ``h200-2026-12-02-s9-read-hash.json``): 1 / 2 / 4 / 8 /
#: 16 threads read + hash at 0.97 / 1.84 / 3.47 / 5.73 / 8.17 GB/s (sha256 alone: 1.41 GB/s per core).
MAX_WORKERS = 16
#: Buffers from this size on ask the kernel for transparent huge pages (:func:`private_buffer`): on the H200 host the
#: UNet's read + hash on 8 threads went 4.70 GB/s (4 KiB pages) -> 5.42-5.90 GB/s (same file, same run).
HUGE_PAGE_MIN_BYTES = 32 << 20


def workers() -> int:
    """Threads for hashing on this machine: the cores this process may use, at most :data:`MAX_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


def slices(size: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """``(offset, length)`` of each ``chunk``-byte (default :data:`CHUNK_BYTES`) slice of a ``size``-byte file (the
    last one shorter; none for an empty file)."""
    chunk = chunk or CHUNK_BYTES
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)]


def file_entry(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest entry of one file: ``{"sha256", "size"}`` plus, at :data:`CHUNK_BYTES` or more,
    ``"chunks": {"bytes": CHUNK_BYTES, "sha256": [one hex digest per chunk]}``.

    The whole-file digest is computed while the chunks are hashed on other threads (one read of the file).
    """
    size = os.stat(path).st_size
    whole = hashlib.sha256()
    if size < CHUNK_BYTES:
        with open(path, "rb") as f:
            whole.update(f.read())
        return {"sha256": whole.hexdigest(), "size": size}
    digests: list[Any] = []
    chunk = CHUNK_BYTES
    with open(path, "rb") as f, ThreadPoolExecutor(workers()) as pool:
        for _off, length in slices(size, chunk):
            data = f.read(length)
            whole.update(data)
            digests.append(pool.submit(lambda d: hashlib.sha256(d).hexdigest(), data))
        chunk_hex = [d.result() for d in digests]
    return {"sha256": whole.hexdigest(), "size": size, "chunks": {"bytes": chunk, "sha256": chunk_hex}}


def chunk_problem(entry: Mapping[str, Any]) -> str | None:
    """Why an entry's ``chunks`` cannot describe a file of ``entry["size"]`` bytes, or ``None`` (also when absent).

    The schema checks the types; this checks that the count matches the size (a short list would leave bytes
    unhashed)."""
    chunks = entry.get("chunks")
    if chunks is None:
        return None
    expected = len(slices(int(entry["size"]), int(chunks["bytes"])))
    if len(chunks["sha256"]) != expected:
        return (f"lists {len(chunks['sha256'])} chunk digest(s) for {entry['size']} bytes in chunks of "
                f"{chunks['bytes']}; {expected} expected")
    return None


def read_into(fd: int, size: int, check: Callable[[int, memoryview], None] | None = None,
              chunk: int | None = None, into: Any = None) -> memoryview:
    """Read ``size`` bytes of the open file ``fd`` into a new buffer, ``chunk`` bytes per ``os.preadv`` on
    :func:`workers` threads; ``check(index, view)`` runs on each chunk right after it is read (on that thread).

    The buffer is private anonymous memory (:func:`private_buffer`), or ``into`` (a writable buffer of ``size``
    bytes, e.g. :func:`spill_buffer`'s mapping of a private file); never a mapping of ``fd``'s file: later writes to
    that file cannot reach these bytes. Returns a writable ``memoryview`` of it.

    Raises:
        EOFError: the file is shorter than ``size`` (it was truncated meanwhile).
        Whatever ``check`` raises (the first failing chunk's, in file order).
    """
    view = memoryview(private_buffer(size) if into is None else into)
    if len(view) != size:
        raise ValueError(f"read_into: a buffer of {len(view)} bytes for a {size}-byte read")
    chunk = chunk or CHUNK_BYTES

    def one(index: int, offset: int, length: int) -> None:
        part = view[offset:offset + length]
        done = 0
        while done < length:
            n = os.preadv(fd, [part[done:]], offset + done)
            if n == 0:
                raise EOFError(f"file ended at byte {offset + done} of {size}")
            done += n
        if check is not None:
            check(index, part)

    parts = slices(size, chunk)
    if len(parts) <= 1:
        for i, (off, length) in enumerate(parts):
            one(i, off, length)
        return view
    with ThreadPoolExecutor(min(workers(), len(parts))) as pool:
        futures = [pool.submit(one, i, off, length) for i, (off, length) in enumerate(parts)]
        for f in futures:
            f.result()
    return view


#: Whether :func:`spill_buffer` asks for transparent huge pages on its mapping (``MADV_HUGEPAGE``: 2 MiB pages on a
#: tmpfs whose ``shmem_enabled`` allows them). A switch for ``benchmarks/cold_start.py`` (``--set``).
SPILL_HUGE_PAGES = False


def spill_buffer(path: str | os.PathLike[str], size: int) -> mmap.mmap | None:
    """A new file at ``path`` (``O_EXCL``, mode 0600) of ``size`` bytes and a writable shared mapping of it: bytes
    written into the mapping are the file's, with no copy (:func:`read_into`'s ``into``). ``None`` for 0 bytes (the
    empty file is made; there is nothing to map).

    Raises:
        OSError: the file exists or cannot be made that large (``posix_fallocate`` reserves its blocks: no room is
            an ``ENOSPC`` here, never a fault in a later store).
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        if size == 0:
            return None
        # the blocks are reserved up front: a store into a shared mapping past a full file system is a SIGBUS
        # (tmpfs), where an ENOSPC here is an OSError the caller can fall back from
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:  # pragma: no cover - not Linux
            os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        if SPILL_HUGE_PAGES and size >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # huge pages only where the file system offers them (a tmpfs)
                mapping.madvise(mmap.MADV_HUGEPAGE)
        return mapping
    finally:
        os.close(fd)


def private_buffer(size: int) -> mmap.mmap | bytearray:
    """``size`` writable bytes of private anonymous memory (``MAP_PRIVATE | MAP_ANONYMOUS``; a ``bytearray`` where
    mmap lacks those flags, or for 0 bytes). Unlike ``bytearray(size)``, which zero-fills every page on the calling
    thread first (1.7 GB: ~1 s on the 2-core CI machine, the larger part of a read + sha256 there), its pages are
    first touched by the threads that read into them; from :data:`HUGE_PAGE_MIN_BYTES` on it asks for transparent huge
    pages (``MADV_HUGEPAGE``: one page fault per 2 MiB instead of per 4 KiB)."""
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    if size == 0 or None in flags:
        return bytearray(size)
    buf = mmap.mmap(-1, size, flags=flags[0] | flags[1])
    if size >= HUGE_PAGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: 4 KiB pages, same bytes
            buf.madvise(mmap.MADV_HUGEPAGE)
    return buf


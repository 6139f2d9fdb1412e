"""The TensorRT-RTX runtime cache on disk: where it lives, how it is framed, loaded and saved.

TensorRT-RTX compiles an engine's kernels for the user's GPU when an execution context is created ("JIT"),
and compiles shape-specialised kernels of dynamic profiles while the engine runs. ``IRuntimeCache`` holds
those kernels; serialised to a file and loaded by the next process, it turns seconds of compilation into a
file read (NVIDIA: "Working with Runtime Cache").

Where (:func:`runtime_cache_path`): one file per component, named by the manifest
(``build.runtime_cache``, e.g. ``unet.runtime-cache``), in

* ``runtime_cache_dir`` when the caller gives one (``--runtime-cache DIR``): one folder for this artifact;
* else ``$XDG_CACHE_HOME/diffusion-trt/runtime-cache/<manifest_sha256[:16]>/`` (``~/.cache`` when
  ``XDG_CACHE_HOME`` is unset or relative): a recompiled artifact gets a new folder.

Never inside the artifact folder: it is sealed (``verify`` reports files the manifest does not list).

File format (:func:`pack_runtime_cache`): :data:`RUNTIME_CACHE_MAGIC`, uint32 little-endian header length,
a JSON header ``{"format", "library", "version", "compute_capability", "gpu", "sha256", "size"}``, then
TensorRT-RTX's serialised cache, unchanged. The header lets a truncated or altered file, or one written on
another GPU or library release, be ignored with a reason before TensorRT sees it; TensorRT-RTX checks the
payload again itself (``IRuntimeCache.deserialize`` returns ``False`` on any mismatch).

Anyone who can write the cache folder can put anything at the file's path, so the reader trusts nothing
(:func:`load_runtime_cache`): a symbolic link is not followed, a FIFO does not block, a device, a folder or a file
over :data:`MAX_RUNTIME_CACHE_BYTES` is not read, the header is bounded and parsed without recursion errors; each
is a miss with a ``warning`` (one more JIT compilation), never an error.

Pure Python: no ``tensorrt`` import (``runtime/engines/trt_engine.py`` passes the bytes in and out).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...artifact.folder import SEAL_KEY, write_bytes_atomic
from ...artifact.manifest import Manifest
from ...errors import ArtifactError, RuntimeInputError
from ...trt_compat import pack_framed, printable, read_cache_file, unpack_framed

logger = logging.getLogger(__name__)

#: First bytes of a runtime-cache file written by :func:`pack_runtime_cache`.
RUNTIME_CACHE_MAGIC = b"DTRT-RUNTIME-CACHE\n"
RUNTIME_CACHE_FORMAT = 1
#: The largest runtime-cache file read (and written): kernels of one engine for one GPU. A larger file is not read
#: (a miss, with a warning), so a huge file or one swapped for a device cannot exhaust memory.
MAX_RUNTIME_CACHE_BYTES = 1 << 30
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True)
class RuntimeCacheKey:
    """What a runtime cache was made for: one library release on one GPU.

    Attributes:
        library: ``TrtLibrary.backend`` ("tensorrt-rtx").
        version: the library's ``__version__`` ("1.7.1.116").
        compute_capability: the GPU's ("8.9").
        gpu: the GPU's name ("NVIDIA GeForce RTX 4090"); kernels are specialised per GPU model, not only per SM.
    """

    library: str
    version: str
    compute_capability: str
    gpu: str

    def to_json(self) -> dict[str, str]:
        return {
            "library": self.library,
            "version": self.version,
            "compute_capability": self.compute_capability,
            "gpu": self.gpu,
        }


def default_runtime_cache_root(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/diffusion-trt/runtime-cache``, or ``~/.cache/...`` when it is unset or relative (XDG spec)."""
    env = os.environ if env is None else env
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "diffusion-trt" / "runtime-cache"


def runtime_cache_path(
    root: str | os.PathLike[str],
    manifest: Manifest,
    build: Mapping[str, Any],
    cache_dir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Path | None:
    """The runtime-cache file of one component (see the module docstring for the rule).

    Args:
        root: the artifact folder.
        manifest: its (verified) manifest; ``manifest_sha256`` names the default folder.
        build: the component's build facts; ``runtime_cache`` is the file name.
        cache_dir: the folder to use instead of the default (``runtime_cache_dir=`` / ``--runtime-cache``).
        env: environment to read ``XDG_CACHE_HOME`` from (default ``os.environ``).

    Returns:
        The file's path (it may not exist yet), or ``None`` when the build records no ``runtime_cache``
        (the engine then keeps its kernels in memory only).

    Raises:
        ArtifactError: ``build.runtime_cache`` is not a plain file name, or the manifest has no seal.
        RuntimeInputError: ``cache_dir`` lies inside the artifact folder (sealed; verify would fail).
    """
    name = build.get("runtime_cache")
    if name is None:
        return None
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise ArtifactError(
            f"the manifest's runtime_cache {name!r} is not a plain file name ([A-Za-z0-9._-], no '/'); recompile "
            "the artifact"
        )
    if cache_dir is not None:
        folder = Path(cache_dir).expanduser()
        art = Path(root).resolve()
        inside = folder.resolve()
        if inside == art or art in inside.parents:
            raise RuntimeInputError(
                f"runtime cache folder {folder} is inside the artifact {root}, which is sealed (verify reports files "
                f"its manifest does not list); use a folder beside it, e.g. {Path(root).resolve()}.runtime-cache"
            )
    else:
        seal = manifest.seal
        if not isinstance(seal, str) or len(seal) < 16:
            raise ArtifactError(f"the manifest of {root} has no {SEAL_KEY}; recompile the artifact")
        folder = default_runtime_cache_root(env) / seal[:16]
    return folder / name


def pack_runtime_cache(key: RuntimeCacheKey, payload: bytes) -> bytes:
    """Frame TensorRT-RTX's serialised runtime cache with its key and checksum (layout: module docstring)."""
    return pack_framed(RUNTIME_CACHE_MAGIC, RUNTIME_CACHE_FORMAT, key.to_json(), payload)


def unpack_runtime_cache(data: bytes, key: RuntimeCacheKey) -> tuple[bytes | None, str | None]:
    """The payload of a file written by :func:`pack_runtime_cache`, if it was made for ``key``.

    Returns:
        ``(payload, None)`` when usable, else ``(None, reason)``: not a runtime-cache file, truncated, corrupt
        (checksum), another format, or another library release / GPU.
    """
    payload, made = unpack_framed(data, RUNTIME_CACHE_MAGIC, RUNTIME_CACHE_FORMAT, "runtime cache", key.to_json())
    if payload is not None:
        return payload, None
    if isinstance(made, str):
        return None, made
    return None, (
        f"made for {printable(made.get('library'))} {printable(made.get('version'))} on {printable(made.get('gpu'))} "
        f"(compute capability {printable(made.get('compute_capability'))}), this is {key.library} {key.version} on "
        f"{key.gpu} ({key.compute_capability})"
    )


def load_runtime_cache(path: Path | None, key: RuntimeCacheKey, where: str) -> bytes | None:
    """TensorRT-RTX's payload from ``path``, or ``None`` (no file, or one that is ignored with a warning).

    The file lies in a user's cache folder: it is read by :func:`~diffusion_trt.trt_compat.read_cache_file`
    (``O_NOFOLLOW | O_NONBLOCK``: a symbolic link, a FIFO, a device, a folder or a file over
    :data:`MAX_RUNTIME_CACHE_BYTES` is not read) and its header parsed with bounds. Never raises for the file: a
    bad one is a miss with a warning (it costs one JIT compilation, not the run); the next save replaces a bad file
    or link.
    """
    if path is None:
        return None
    try:
        data = read_cache_file(path, MAX_RUNTIME_CACHE_BYTES)
    except FileNotFoundError:
        logger.info("%s: no runtime cache at %s yet: kernels are compiled for this GPU on first load", where, path)
        return None
    except OSError as e:
        logger.warning("%s: ignoring the runtime cache %s: %s; kernels are compiled without it", where, path,
                       e.strerror or e)
        return None
    payload, reason = unpack_runtime_cache(data, key)
    if payload is None:
        logger.warning("%s: ignoring the runtime cache %s: %s; it is replaced on close", where, path, reason)
    return payload


def save_runtime_cache(path: Path, key: RuntimeCacheKey, payload: bytes, where: str) -> bool:
    """Write the framed cache to ``path`` atomically (temporary file + ``os.replace``); readers never see half a file.

    Returns:
        Whether it was written. An OS error (read-only home, full disk) or a cache over
        :data:`MAX_RUNTIME_CACHE_BYTES` is a warning, never an exception: the images are already made, only the next
        start is slower. A symbolic link at ``path`` is replaced by the file (``os.replace`` does not follow it).
    """
    data = pack_runtime_cache(key, payload)
    if len(data) > MAX_RUNTIME_CACHE_BYTES:  # it would not be read back
        logger.warning("%s: the runtime cache has %d bytes, more than a cache file may hold (%d); not saved, the next "
                       "load compiles again", where, len(data), MAX_RUNTIME_CACHE_BYTES)
        return False
    try:
        write_bytes_atomic(path, data)
    except OSError as e:
        logger.warning("%s: could not save the runtime cache to %s (%s); the next load compiles again", where, path, e)
        return False
    logger.info("%s: saved the runtime cache (%d bytes) to %s", where, len(payload), path)
    return True

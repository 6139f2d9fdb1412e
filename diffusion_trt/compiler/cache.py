"""The compile cache: an identical recompile reuses the artifact made before.

    key = sha256(source weights hash, LoRA file hashes, the whole CompileConfig, calibration prompt file,
                 tool versions, this package's code, the target machine)
    <cache dir>/entries/<key>/artifact/   a sealed artifact (the files hard-linked where the disk allows)
    <cache dir>/entries/<key>/key.json    what the key was made of; its mtime is the entry's last use (LRU)

A hit is re-verified (schema, seal, every sha256) before it is used, so an entry altered on disk is discarded,
never served; anything that changes the output changes the key (a changed weight, LoRA, option, tool or code
version is a miss). Entries are evicted least recently used first once the cache holds more than ``max_bytes``.

Cache folder: ``--cache-dir``, else ``$DIFFUSION_TRT_CACHE``, else ``$XDG_CACHE_HOME/diffusion-trt/compile``, else
``~/.cache/diffusion-trt/compile``.
"""

from __future__ import annotations

import datetime as _dt
import errno
import functools
import hashlib
import importlib.resources
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import artifacts
from ..config import QUANTIZED_PRECISIONS, CompileConfig
from ..errors import ArtifactError

logger = logging.getLogger(__name__)

ENV_DIR = "DIFFUSION_TRT_CACHE"
#: Default size bound: 20 GiB (about five SD-1.5 fp32 artifacts).
DEFAULT_MAX_BYTES = 20 << 30
#: Bumped when the key's composition or the entry layout changes.
KEY_VERSION = 1


def default_cache_dir() -> Path:
    """``$DIFFUSION_TRT_CACHE``, else ``$XDG_CACHE_HOME/diffusion-trt/compile``, else
    ``~/.cache/diffusion-trt/compile``."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "diffusion-trt" / "compile"


@functools.cache
def code_digest() -> str:
    """sha256 over this package's source and data files: a code change without a version bump is a miss too."""
    root = importlib.resources.files("diffusion_trt")
    h = hashlib.sha256()
    for p in sorted(Path(str(root)).rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(p.relative_to(str(root)).as_posix().encode())
            h.update(artifacts.sha256_file(p).encode())
    return h.hexdigest()


def target_facts(config: CompileConfig) -> dict[str, Any]:
    """The machine an artifact is built for: OS and CPU, and for CUDA builds the GPU's name and compute capability."""
    facts: dict[str, Any] = {"system": platform.system(), "machine": platform.machine()}
    if config.device == "cuda":
        import torch

        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    return facts


def cache_key(source: Mapping[str, Any], config: CompileConfig) -> tuple[str, dict[str, Any]]:
    """The cache key of compiling ``source`` with ``config``, and what it was made of.

    Args:
        source: identifies the weights, e.g. ``{"kind": "folder", "sha256": folder_hash}``.
    """
    from .pipeline import tool_versions

    facts: dict[str, Any] = {
        "key_version": KEY_VERSION,
        "source": dict(source),
        "config": config.to_json(),
        "loras": [[str(p), artifacts.sha256_file(p), float(s)] for p, s in config.loras],
        "tools": tool_versions(),
        "code": code_digest(),
        "target": target_facts(config),
    }
    prompts = Path(config.quantize.prompts)
    if config.precision in QUANTIZED_PRECISIONS and prompts.is_file():
        facts["calibration_prompts_sha256"] = artifacts.sha256_file(prompts)
    return hashlib.sha256(artifacts.canonical_json(facts)).hexdigest(), facts


def uncacheable(config: CompileConfig) -> str:
    """Why ``config`` bypasses the cache ("" when it does not): compiles whose side effects a hit would skip."""
    if config.dump_passes:
        return "--dump-passes writes the graphs while compiling"
    if config.precision in QUANTIZED_PRECISIONS and config.quantize.cache:
        return "--calibration-cache is read and written while compiling"
    if config.controlnets:  # the key hashes the model folder only, not the ControlNet folders
        return "--controlnet folders are not part of the cache key yet"
    if any(not Path(p).is_file() for p, _ in config.loras):
        return "a LoRA file is missing"  # compile_pipeline names it
    return ""


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (same file system), else copy it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copy2(src, dst)


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


class CompileCache:
    """Artifacts by cache key, bounded in size, least recently used evicted first.

    Args:
        root: the cache folder (created on first store).
        max_bytes: size bound of all entries; an artifact larger than it is not stored.
    """

    def __init__(self, root: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root).expanduser()
        self.max_bytes = int(max_bytes)

    def _entry(self, key: str) -> Path:
        return self.root / "entries" / key

    def lookup(self, key: str) -> Path | None:
        """The cached artifact of ``key``, verified (schema, seal, every sha256), or ``None``; a damaged entry is
        deleted. A hit counts as a use for eviction."""
        entry = self._entry(key)
        if not (entry / "artifact" / artifacts.MANIFEST_NAME).is_file():
            return None
        try:
            artifacts.load_verified(entry / "artifact", check_hashes=True)
        except ArtifactError as e:
            logger.warning("compile cache entry %s is damaged and was discarded: %s", key[:12], str(e).splitlines()[0])
            shutil.rmtree(entry, ignore_errors=True)
            return None
        os.utime(entry / "key.json")
        return entry / "artifact"

    def store(self, key: str, facts: Mapping[str, Any], artifact: Path) -> Path | None:
        """Add ``artifact`` under ``key`` (files hard-linked where possible), then evict down to ``max_bytes``.

        Returns:
            The entry's artifact folder, or ``None`` when the artifact alone is larger than the bound.
        """
        size = _tree_bytes(artifact)
        if size > self.max_bytes:
            logger.info("compile cache: not stored, the artifact (%.1f MB) is larger than the cache bound (%.1f MB)",
                        size / 1e6, self.max_bytes / 1e6)
            return None
        final = self._entry(key)
        tmp = final.with_name(f".{key}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        for p in sorted(artifact.rglob("*")):
            if p.is_file():
                _link_or_copy(p, tmp / "artifact" / p.relative_to(artifact))
        (tmp / "key.json").write_text(json.dumps(facts, indent=1, sort_keys=True), encoding="utf-8")
        try:
            os.rename(tmp, final)
        except OSError:  # another compile stored the same key first
            shutil.rmtree(tmp, ignore_errors=True)
        self.evict(keep=key)
        return final / "artifact"

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, folder) of every entry, least recently used first."""
        folder = self.root / "entries"
        if not folder.is_dir():
            return []
        out = []
        for entry in folder.iterdir():
            if entry.is_dir() and (entry / "key.json").is_file():
                out.append(((entry / "key.json").stat().st_mtime, _tree_bytes(entry), entry))
        return sorted(out)

    def evict(self, keep: str | None = None) -> list[str]:
        """Delete least recently used entries until the cache holds at most ``max_bytes`` (``keep`` stays).

        Returns:
            The keys evicted.
        """
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        evicted = []
        for _, size, entry in entries:
            if total <= self.max_bytes:
                break
            if entry.name == keep:
                continue
            shutil.rmtree(entry, ignore_errors=True)
            total -= size
            evicted.append(entry.name)
        if evicted:
            logger.info("compile cache: evicted %d least recently used entr%s (bound %.1f MB)", len(evicted),
                        "y" if len(evicted) == 1 else "ies", self.max_bytes / 1e6)
        return evicted

    def materialize(self, cached: Path, out: Path, key: str, source_path: str, *, overwrite: bool = False,
                    lock_timeout: float = 0.0) -> Path:
        """Write the cached artifact ``cached`` to ``out`` (atomically, like a compile) with a resealed manifest
        whose ``cache`` says it came from the cache.

        Raises:
            OutputPathError: as :func:`~diffusion_trt.artifacts.staging_dir`.
        """
        t0 = time.perf_counter()
        manifest = artifacts.read_manifest(cached)
        with artifacts.staging_dir(out, overwrite=overwrite, lock_timeout=lock_timeout) as stage:
            for rel in manifest["files"]:
                _link_or_copy(artifacts.safe_join(cached, rel), stage / rel)
            manifest["name"] = out.name
            manifest["source"] = {**manifest["source"], "path": source_path}
            manifest["cache"] = {
                "hit": True,
                "key": key,
                "reused_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "original_compile_seconds": manifest.get("compile_seconds"),
                "reused": sorted(manifest["components"]),  # every engine and file came from the cache
            }
            manifest["compile_seconds"] = round(time.perf_counter() - t0, 3)
            artifacts.write_manifest(stage, manifest)
        return out


def mark_stored(out: Path, key: str) -> None:
    """Record in ``out``'s manifest (resealed) that it was compiled and stored under ``key`` (a cache miss)."""
    manifest = artifacts.read_manifest(out)
    manifest["cache"] = {"hit": False, "key": key}
    artifacts.write_manifest(out, manifest)


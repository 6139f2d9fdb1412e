"""The compile cache: an identical recompile reuses the artifact made before.

    key = sha256(source weights hash, LoRA file hashes, the whole CompileConfig, calibration prompt file,
                 tool versions, this package's code, the target machine)
    <cache dir>/secret.key                32 random bytes made at first use, mode 0600 (this user's MAC key)
    <cache dir>/entries/<key>/artifact/   a sealed artifact: its own copy of every file (a reflink where the file
                                          system has them), never a hard link shared with a shipped artifact
    <cache dir>/entries/<key>/key.json    what the key was made of; its mtime is the entry's last use (LRU)
    <cache dir>/entries/<key>/mac         HMAC-SHA256(secret.key, key + manifest digest), hex

A hit must prove it came from this user's own compile: its ``mac`` is recomputed with ``secret.key`` over the cache
key and the entry's manifest (whose seal and sha256 list cover every file), so an entry whose component was replaced
and whose manifest was resealed, or an entry moved under another key, is a miss with a ``warning:`` line and is
deleted. The hit is then re-verified (schema, seal, every sha256) before it is used, so an entry altered on disk is
discarded, never served; anything that changes the output changes the key (a changed weight, LoRA, option, tool or
code version is a miss). Entries are evicted least recently used first once the cache holds more than
``max_bytes``. A ``secret.key`` that is not a private regular file of this user (another owner, group or other
permissions, a link, another size) is never trusted: the cache is not used (a ``warning:`` line) until it is
removed.

Copies, not hard links: a hard link shares the inode, so an in-place edit of a cache file changed every artifact
made from it (and the reverse). Files are cloned with ``FICLONE`` where the file system shares extents
(Btrfs, XFS with reflink, bcachefs: instant, no space), else copied with ``os.copy_file_range``. Measured on ext4
(no reflink), one 1.72 GB file (an SD-1.5 fp16 UNet): a copy plus fsync 5.5 s cold / 2.6 s warm, the sha256 pass
every hit already makes 4.9 s / 3.5 s (medians of 3 on a loaded 2-core host;
``benchmarks/results/cpu-2core-2026-12-01-cache-copy-cost.json``, ``benchmarks/cache_copy_cost.py``): a hit costs
about twice the I/O it did with hard links, seconds against a compile's minutes, so copies it is.

The cache never fails a compile: a cache that cannot store (a full disk, no permission) is a ``warning:`` line and
the compile's artifact stands; its temporary ``.<key>.<pid>.tmp`` folders, and those killed compiles left, are
removed.

Cache folder: ``--cache-dir``, else ``$DIFFUSION_TRT_CACHE``, else ``$XDG_CACHE_HOME/diffusion-trt/compile``, else
``~/.cache/diffusion-trt/compile``.
"""

from __future__ import annotations

import datetime as _dt
import errno
import functools
import hashlib
import hmac
import importlib.resources
import json
import logging
import os
import platform
import re
import secrets
import shutil
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..artifact import folder as artifacts
from ..artifact.manifest import Manifest, amend_source
from ..config import QUANTIZED_PRECISIONS, CompileConfig
from ..errors import ArtifactError

logger = logging.getLogger(__name__)

ENV_DIR = "DIFFUSION_TRT_CACHE"
#: Default size bound: 20 GiB (about five SD-1.5 fp32 artifacts).
DEFAULT_MAX_BYTES = 20 << 30
#: Bumped when the key's composition or the entry layout changes.
KEY_VERSION = 2  # 2: entries carry a MAC, files are copies (not hard links)


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


#: ``ioctl(dst, FICLONE, src)``: share the extents of ``src`` (copy on write); Linux, Btrfs/XFS/bcachefs.
_FICLONE = 0x40049409
#: The cache's MAC key, in the cache folder: 32 random bytes, mode 0600.
SECRET_NAME = "secret.key"
SECRET_BYTES = 32
#: An entry's proof of origin: hex HMAC-SHA256 of the cache key and the manifest digest (:func:`entry_mac`).
MAC_NAME = "mac"
#: What killed stores leave in ``entries/`` (``.<key>.<pid>.tmp``) and a killed first use in the cache folder.
_TMP_ENTRY = re.compile(r"\.(?P<key>[0-9A-Za-z_-]+)\.(?P<pid>\d+)\.tmp")
_TMP_SECRET = re.compile(rf"\.{re.escape(SECRET_NAME)}\.(?P<pid>\d+)\.tmp")


class CacheUnusable(Exception):
    """The cache cannot be trusted or written now (a bad ``secret.key``, a full disk...): a warning, never an error."""


class UnprovenEntry(ArtifactError):
    """A cache entry whose MAC does not prove it came from this user's compile under its key."""


def clone_or_copy(src: Path, dst: Path) -> str:
    """Write ``dst`` as an independent copy of ``src`` (its mode and times too): a reflink (``FICLONE``) where the file
    system shares extents, else ``os.copy_file_range`` (in-kernel), else a plain read/write copy. Never a hard link: a
    later in-place edit of either file leaves the other as it was.

    Returns:
        "reflink" or "copy": how it was written.

    Raises:
        OSError: ``src`` cannot be read or ``dst`` written (``ENOSPC``...); a partial ``dst`` is removed.
    """
    import fcntl

    dst.parent.mkdir(parents=True, exist_ok=True)
    how = "copy"
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        try:
            try:
                fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
                how = "reflink"
            except OSError:  # EOPNOTSUPP/ENOTTY/EINVAL (ext4, tmpfs), EXDEV (another file system)
                _copy_range(fin.fileno(), fout.fileno(), os.fstat(fin.fileno()).st_size)
        except BaseException:
            fout.close()
            dst.unlink(missing_ok=True)
            raise
    shutil.copystat(src, dst)
    return how


def _copy_range(fd_in: int, fd_out: int, size: int) -> None:
    """Copy ``size`` bytes between two descriptors with ``os.copy_file_range``, falling back to read/write where the
    kernel or the file systems refuse it (``EXDEV`` before Linux 5.3, ``ENOSYS``, ``EINVAL``...)."""
    done = 0
    try:
        while done < size:
            n = os.copy_file_range(fd_in, fd_out, min(size - done, 1 << 30))
            if n == 0:
                break
            done += n
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            raise
    os.lseek(fd_in, done, os.SEEK_SET)
    os.lseek(fd_out, done, os.SEEK_SET)
    while chunk := os.read(fd_in, 1 << 20):
        os.write(fd_out, chunk)


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def entry_mac(secret: bytes, key: str, manifest: Mapping[str, Any]) -> str:
    """Hex HMAC-SHA256, keyed with ``secret``, of the cache ``key`` and the entry's manifest digest (the seal, which
    covers the sha256 and size of every file): what ties an entry to this user's compile under this key."""
    message = b"diffusion-trt compile cache entry\0" + key.encode() + b"\0" + \
        artifacts.manifest_digest(dict(manifest)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _read_secret(path: Path) -> bytes:
    """The MAC key at ``path``, refused unless it is a private regular file of this user of the right size.

    Raises:
        FileNotFoundError: there is none yet.
        CacheUnusable: it exists but is not to be trusted (naming why and the fix).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CacheUnusable(f"{path} cannot be opened ({e.strerror}); remove it (a new key is made)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        why = ""
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            why = f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        elif st.st_mode & 0o077:
            why = f"mode {stat.S_IMODE(st.st_mode):04o}: readable or writable by others (0600 expected)"
        elif st.st_size != SECRET_BYTES:
            why = f"{st.st_size} bytes, not {SECRET_BYTES}"
        if why:
            raise CacheUnusable(f"{path} is {why}; it is not trusted, so the cache is not used: remove it "
                                "(a new key is made, and entries made with the old one become misses)")
        return f.read(SECRET_BYTES)


def _create_secret(path: Path) -> None:
    """Make the MAC key at ``path`` (mode 0600) unless another process made it first: written whole to a temporary
    file, then hard-linked into place, so no reader ever sees part of a key."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another compile made it first: use that one
    finally:
        tmp.unlink(missing_ok=True)


class CompileCache:
    """Artifacts by cache key, bounded in size, least recently used evicted first, each entry MAC'ed.

    Args:
        root: the cache folder (created on first store).
        max_bytes: size bound of all entries; an artifact larger than it is not stored.
    """

    def __init__(self, root: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root).expanduser()
        self.max_bytes = int(max_bytes)
        self._secret_value: bytes | None = None
        #: why the cache cannot be used in this process (set by lookup's warning): store then stores nothing
        self._unusable: str | None = None

    def _entry(self, key: str) -> Path:
        return self.root / "entries" / key

    def secret(self) -> bytes:
        """This user's MAC key (``<root>/secret.key``), made at first use.

        Raises:
            CacheUnusable: the key file is not a private regular file of this user, or cannot be made.
        """
        if self._secret_value is None:
            path = self.root / SECRET_NAME
            try:
                self._secret_value = _read_secret(path)
            except FileNotFoundError:
                try:
                    self.root.mkdir(parents=True, exist_ok=True)
                    artifacts.remove_dead_leftovers(self.root, _TMP_SECRET, "an interrupted compile")
                    _create_secret(path)
                except OSError as e:
                    raise CacheUnusable(f"cannot create {path} ({e.strerror})") from None
                self._secret_value = _read_secret(path)
        return self._secret_value

    def lookup(self, key: str) -> Path | None:
        """The cached artifact of ``key``, proven (:meth:`proven_manifest`) and verified (schema, seal, every
        sha256), or ``None``. An entry that fails either is deleted, with a warning naming the reason; a cache that
        cannot be used is a warning and a miss (and :meth:`store` then stores nothing). A hit counts as a use for
        eviction."""
        entry = self._entry(key)
        try:
            self._clean()
            if not (entry / "artifact" / artifacts.MANIFEST_NAME).is_file():
                return None
            self.secret()
        except (CacheUnusable, OSError) as e:
            self._unusable = _reason(e)
            logger.warning("compile cache %s not used: %s", self.root, self._unusable)
            return None
        try:
            manifest = self.proven_manifest(entry / "artifact", key)
            verified = artifacts.load_verified(entry / "artifact", check_hashes=True)
            if artifacts.manifest_digest(verified) != artifacts.manifest_digest(manifest):
                raise ArtifactError("its manifest changed while it was being verified")
        except UnprovenEntry as e:
            logger.warning("compile cache entry %s %s: discarded, compiling anew", key[:12], e)
            shutil.rmtree(entry, ignore_errors=True)
            return None
        except (ArtifactError, OSError) as e:
            logger.warning("compile cache entry %s is damaged and was discarded: %s", key[:12], _reason(e))
            shutil.rmtree(entry, ignore_errors=True)
            return None
        os.utime(entry / "key.json")
        return entry / "artifact"

    def proven_manifest(self, cached: Path, key: str) -> dict[str, Any]:
        """The manifest of the cached artifact ``cached`` (schema and seal checked), once its entry's ``mac`` proves it
        was stored by this user's compile under ``key`` (:func:`entry_mac`).

        Raises:
            UnprovenEntry: the MAC is missing or does not match.
            ArtifactError: as :func:`~diffusion_trt.artifact.folder.read_manifest`.
            CacheUnusable: as :meth:`secret`.
        """
        manifest = artifacts.read_manifest(cached)
        expected = entry_mac(self.secret(), key, manifest).encode()
        if not hmac.compare_digest(_read_mac(cached.parent), expected):
            raise UnprovenEntry(f"was not made by this user's compile (its MAC does not match the key "
                                f"{self.root / SECRET_NAME})")
        return manifest

    def store(self, key: str, facts: Mapping[str, Any], artifact: Path) -> Path | None:
        """Add a copy of ``artifact`` under ``key`` with its MAC (:func:`clone_or_copy`, :func:`entry_mac`), then
        evict down to ``max_bytes``. Never raises for the cache's sake: a cache that cannot store (a full disk, no
        permission, an untrusted key) logs a warning, and nothing of the attempt is left behind.

        Returns:
            The entry's artifact folder, or ``None`` when it was not stored (larger than the bound, or the warning).
        """
        size = _tree_bytes(artifact)
        if size > self.max_bytes:
            logger.info("compile cache: not stored, the artifact (%.1f MB) is larger than the cache bound (%.1f MB)",
                        size / 1e6, self.max_bytes / 1e6)
            return None
        if self._unusable is not None:
            logger.debug("compile cache: not stored, the cache is not used (%s)", self._unusable)
            return None
        final = self._entry(key)
        tmp = final.with_name(f".{key}.{os.getpid()}.tmp")
        try:
            self._clean()
            secret = self.secret()
            manifest = artifacts.read_manifest(artifact)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            for p in sorted(artifact.rglob("*")):
                if p.is_file():
                    clone_or_copy(p, tmp / "artifact" / p.relative_to(artifact))
            (tmp / "key.json").write_text(json.dumps(facts, indent=1, sort_keys=True), encoding="utf-8")
            (tmp / MAC_NAME).write_text(entry_mac(secret, key, manifest) + "\n", encoding="ascii")
            try:
                os.rename(tmp, final)
            except OSError:  # another compile stored the same key first
                shutil.rmtree(tmp, ignore_errors=True)
        except (CacheUnusable, OSError, ArtifactError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            logger.warning("compile cache %s: the artifact was not stored (%s); %s is complete, only the next "
                           "identical compile will not be a hit", self.root, _reason(e), artifact)
            return None
        self.evict(keep=key)
        return final / "artifact"

    def _clean(self) -> None:
        """Remove the ``.<key>.<pid>.tmp`` folders of stores that were killed (their pid no longer runs)."""
        artifacts.remove_dead_leftovers(self.root / "entries", _TMP_ENTRY, "an interrupted compile's cache store")

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
        """Write the cached artifact ``cached`` to ``out`` (atomically, like a compile; each file its own copy, see
        :func:`clone_or_copy`) with a resealed manifest whose ``cache`` says it came from the cache.

        Raises:
            OutputPathError: as :func:`~diffusion_trt.artifact.folder.staging_dir`.
            UnprovenEntry: the entry's manifest was replaced since :meth:`lookup` proved it.
        """
        t0 = time.perf_counter()
        manifest = self.proven_manifest(cached, key)  # the manifest lookup proved, not one swapped in since: amended
        facts = Manifest.from_json(manifest)  # its facts, read typed
        with artifacts.staging_dir(out, overwrite=overwrite, lock_timeout=lock_timeout) as stage:
            for rel in facts.files:
                clone_or_copy(artifacts.safe_join(cached, rel), stage / rel)
            manifest["name"] = out.name
            amend_source(manifest, path=source_path)
            manifest["cache"] = {
                "hit": True,
                "key": key,
                "reused_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "original_compile_seconds": facts.compile_seconds,
                "reused": sorted(facts.components),  # every engine and file came from the cache
            }
            manifest["compile_seconds"] = round(time.perf_counter() - t0, 3)
            artifacts.write_manifest(stage, manifest)
        return out


def _read_mac(entry: Path) -> bytes:
    """The entry's stored MAC (``b""`` when it has none, e.g. made before MACs, or is not a small regular file)."""
    try:
        fd = os.open(entry / MAC_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return b""
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return b""
        return f.read(128).strip()


def _reason(e: BaseException) -> str:
    """An error's whole message on one line (a verification error lists its problems on the lines after a colon)."""
    if isinstance(e, OSError) and not isinstance(e, FileNotFoundError) and e.strerror:
        where = f" at {e.filename}" if e.filename else ""
        return f"{errno.errorcode.get(e.errno or 0, 'OSError')}: {e.strerror}{where}"
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


def mark_stored(out: Path, key: str) -> None:
    """Record in ``out``'s manifest (resealed) that it was compiled and stored under ``key`` (a cache miss)."""
    manifest = artifacts.read_manifest(out)
    manifest["cache"] = {"hit": False, "key": key}
    artifacts.write_manifest(out, manifest)


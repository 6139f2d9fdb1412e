"""The artifact folder: layout, ``manifest.json`` read/write/verify, sha256, atomic writes.

Layout written by ``diffusion-trt compile``::

    ARTIFACT_DIR/
      manifest.json                 this module's schema (``SCHEMA_VERSION``)
      tokenizer/                    copied from the pipeline folder
      scheduler/scheduler_config.json
      text_encoder/model.onnx       one folder per component; ``model.onnx.data`` when > 2 GB
      unet/model.onnx
      vae_decoder/model.onnx
      vae_encoder/model.onnx

Every file of the artifact is listed in the manifest with its sha256 and size, so a copy shipped to
another host can be checked before anything is deserialised (:func:`verify_files`). Paths in the
manifest are relative POSIX paths that must stay inside the artifact folder.

This module is imported by the runtime: it must not import torch, diffusers or the compiler.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import ArtifactError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
#: Components of an SD 1.x artifact, in the order they run.
COMPONENTS: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder", "vae_encoder")
#: Components the text-to-image loop cannot do without.
REQUIRED_COMPONENTS: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder")

_HASH_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (UNet weights are gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def file_entry(root: Path, rel: str) -> dict[str, Any]:
    """``{"sha256": ..., "size": bytes}`` for ``root / rel``."""
    p = root / rel
    return {"sha256": sha256_file(p), "size": p.stat().st_size}


def safe_join(root: Path, rel: str) -> Path:
    """Join a manifest path to the artifact root, refusing anything that escapes it.

    Raises:
        ArtifactError: ``rel`` is absolute, contains ``..``, or resolves (through links) outside ``root``.
    """
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\\" in rel:
        raise ArtifactError(f"manifest path {rel!r} points outside the artifact folder; paths must be relative")
    path = root.joinpath(*pure.parts)
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        raise ArtifactError(
            f"manifest path {rel!r} resolves to {path.resolve()} outside the artifact folder {root}; "
            "remove the symbolic link and copy the file in"
        ) from None
    return path


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file and ``os.replace``: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staging_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; on success it is renamed to ``final``.

    On any exception the staging folder is deleted and an existing ``final`` is left untouched, so a
    failed compile leaves no half artifact.

    Raises:
        ArtifactError: ``final`` exists and ``overwrite`` is false.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise ArtifactError(f"output folder {final} already exists; pass --overwrite or choose another -o")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.staging-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and structurally validate ``root/manifest.json``.

    Raises:
        ArtifactError: the folder or manifest is missing, unreadable, of another schema version, or
            lacks a required component.
    """
    root = Path(root)
    if not root.is_dir():
        raise ArtifactError(f"artifact folder {root} does not exist; run `diffusion-trt compile` first")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{path} is missing; {root} is not a compiled artifact (run `diffusion-trt compile`)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); recompile the artifact") from None
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has schema_version={version!r}; this diffusion-trt reads {SCHEMA_VERSION}: "
            "recompile with this version"
        )
    for key in ("components", "files", "backend", "precision", "profile"):
        if key not in manifest:
            raise ArtifactError(f"{path} lacks the key {key!r}; recompile the artifact")
    missing = [c for c in REQUIRED_COMPONENTS if c not in manifest["components"]]
    if missing:
        raise ArtifactError(f"{path} lacks the component(s) {', '.join(missing)}; recompile with them")
    return manifest


def verify_files(root: str | os.PathLike[str], manifest: dict[str, Any], check_hashes: bool = True) -> list[str]:
    """Check every file the manifest lists: inside the folder, present, right size and sha256.

    Returns:
        One human-readable line per problem; empty when the artifact is intact.
    """
    root = Path(root)
    problems: list[str] = []
    for rel, entry in manifest["files"].items():
        try:
            path = safe_join(root, rel)
        except ArtifactError as e:
            problems.append(str(e))
            continue
        if not path.is_file():
            problems.append(f"{rel}: file is missing; copy the whole artifact folder or recompile")
            continue
        size = path.stat().st_size
        if size != entry["size"]:
            problems.append(f"{rel}: size {size} != {entry['size']} in the manifest; the file is truncated or altered")
            continue
        if check_hashes:
            digest = sha256_file(path)
            if digest != entry["sha256"]:
                problems.append(
                    f"{rel}: sha256 {digest[:12]}… != {entry['sha256'][:12]}… in the manifest; "
                    "the file was altered: recopy or recompile the artifact"
                )
    return problems


def load_verified(root: str | os.PathLike[str], check_hashes: bool = True) -> dict[str, Any]:
    """:func:`read_manifest` then :func:`verify_files`; raise one error listing every problem.

    Raises:
        ArtifactError: as :func:`read_manifest`, or when any file fails verification.
    """
    manifest = read_manifest(root)
    problems = verify_files(root, manifest, check_hashes=check_hashes)
    if problems:
        raise ArtifactError(f"artifact {root} failed verification:\n  " + "\n  ".join(problems))
    return manifest

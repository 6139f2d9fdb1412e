"""The artifact folder: layout, ``manifest.json`` read/write/verify, sha256, atomic writes.

Layout written by ``diffusion-trt compile``::

    ARTIFACT_DIR/
      manifest.json                 this module's schema (``SCHEMA_VERSION``)
      tokenizer/                    copied from the pipeline folder
      scheduler/scheduler_config.json
      text_encoder/model.onnx       one folder per component; ``model.onnx.data`` from 64 MiB of weights
      unet/model.onnx
      vae_decoder/model.onnx
      vae_encoder/model.onnx

Every file of the artifact is listed in the manifest with its sha256 and size, so a copy shipped to
another host can be checked before anything is deserialised (:func:`verify_files`). Paths in the
manifest are relative POSIX paths that must stay inside the artifact folder.

The contract other services rely on:

* ``manifest.json`` follows the JSON Schema ``diffusion_trt/data/manifest.schema.json`` (``schema_version``
  1); :func:`read_manifest` validates it with ``jsonschema``.
* ``manifest_sha256`` seals the manifest: sha256 of its canonical JSON without that key
  (:func:`manifest_digest`). A manifest edited by hand no longer matches and is refused; code that amends a
  manifest writes it with :func:`write_manifest`, which re-seals it.
* Loading never reads a file outside the folder: manifest paths go through :func:`safe_join`, ONNX
  external-data locations are checked before ONNX Runtime sees the file
  (:func:`onnx_external_data_problems`), and symbolic links that leave the folder are refused
  (:func:`link_problems`).
* Writers take :func:`artifact_lock` (``.<name>.lock`` beside the folder) around staging and the final
  rename (:func:`staging_dir`), so two compiles into one folder never interleave and a killed compile
  leaves the previous artifact in place.

This module is imported by the runtime: it must not import torch, diffusers or the compiler.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import hashlib
import importlib.resources
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from ..errors import ArtifactError, ModelFolderError, OutputPathError
from .values import parse_json, schema_problems

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1
#: Components of an SD 1.x artifact, in the order they run.
COMPONENTS: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder", "vae_encoder")
#: Components the text-to-image loop cannot do without.
REQUIRED_COMPONENTS: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder")

_HASH_CHUNK = 1 << 20
#: The most bytes ``manifest.json`` may have (real ones are tens of kB); every reader of it
#: (:func:`read_manifest_bytes`, :class:`~diffusion_trt.artifact.reader.ArtifactReader`) refuses a larger one unread.
MAX_MANIFEST_BYTES = 64 << 20

#: The manifest key that seals the rest of the manifest (see :func:`manifest_digest`).
SEAL_KEY = "manifest_sha256"
#: The JSON Schema of ``manifest.json``, shipped inside the package.
SCHEMA_RESOURCE = ("diffusion_trt.data", "manifest.schema.json")


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (UNet weights are gigabytes)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def is_inpainting(model: Mapping[str, Any]) -> bool:
    """Whether model facts (a manifest's ``model``, or compile's ``model_facts``) describe an inpainting UNet: more
    input channels than latent channels (SD inpainting: 9 = 4 latents + 1 mask + 4 masked-image latents)."""
    return int(model.get("unet_in_channels", 4)) != int(model.get("latent_channels", 4))


def folder_hash(root: str | os.PathLike[str]) -> str:
    """sha256 over the sorted (relative path, file sha256) pairs of every file under ``root``: the manifest's
    ``source.sha256`` of the diffusers folder an artifact was compiled from."""
    root = Path(root)
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file of a diffusers pipeline folder (``model_index.json``, ``unet/config.json``...), parsed.

    Raises:
        ModelFolderError: not valid JSON (or not UTF-8), or not a JSON object; naming the file and the fix.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path} is not valid JSON ({e}); restore it or re-save the pipeline") from None
    if not isinstance(data, dict):
        raise ModelFolderError(f"{path} holds a JSON {type(data).__name__}, not an object; re-save the pipeline")
    return data


def file_entry(root: Path, rel: str) -> dict[str, Any]:
    """``{"sha256": ..., "size": bytes}`` for ``root / rel``, with per-chunk digests for large files (the loader
    verifies those on several threads: :mod:`~diffusion_trt.artifact.digests`)."""
    from .digests import file_entry as entry_of

    return entry_of(root / rel)


def safe_join(root: Path, rel: str) -> Path:
    """Join a manifest path to the artifact root, refusing anything that escapes it.

    Raises:
        ArtifactError: ``rel`` is absolute, contains ``..``, a backslash or a NUL byte, runs into a symbolic link
            loop, or resolves (through links) outside ``root``.
    """
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts or "\\" in rel:
        raise ArtifactError(f"manifest path {rel!r} points outside the artifact folder; paths must be relative")
    if "\0" in rel:
        raise ArtifactError(f"manifest path {rel!r} contains a NUL byte, which no file name can; recompile")
    path = root.joinpath(*pure.parts)
    try:
        resolved = path.resolve()
        resolved.relative_to(root.resolve())
    except (RuntimeError, OSError) as e:  # RuntimeError: Python < 3.13's "Symlink loop"; OSError: ELOOP and friends
        raise ArtifactError(
            f"manifest path {rel!r} cannot be resolved ({e}): a symbolic link loop inside the artifact folder? "
            "replace the links with the files themselves"
        ) from None
    except ValueError:
        raise ArtifactError(
            f"manifest path {rel!r} resolves to {resolved} outside the artifact folder {root}; "
            "remove the symbolic link and copy the file in"
        ) from None
    return path


# -- the manifest's schema and seal ---------------------------------------------------------------------


@functools.cache
def manifest_schema() -> dict[str, Any]:
    """The JSON Schema of ``manifest.json`` (``diffusion_trt/data/manifest.schema.json``), parsed once."""
    package, name = SCHEMA_RESOURCE
    return json.loads(importlib.resources.files(package).joinpath(name).read_text(encoding="utf-8"))


def canonical_json(data: Any) -> bytes:
    """The bytes the seal is computed over: keys sorted, no whitespace, UTF-8 (no ASCII escaping)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def manifest_digest(manifest: dict[str, Any]) -> str:
    """sha256 (hex) of the manifest's canonical JSON without its :data:`SEAL_KEY`."""
    return hashlib.sha256(canonical_json({k: v for k, v in manifest.items() if k != SEAL_KEY})).hexdigest()


def seal_manifest(manifest: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``manifest`` with :data:`SEAL_KEY` set to :func:`manifest_digest` (last key of the file)."""
    body = {k: v for k, v in manifest.items() if k != SEAL_KEY}
    return {**body, SEAL_KEY: manifest_digest(body)}


def write_manifest(root: str | os.PathLike[str], manifest: dict[str, Any]) -> dict[str, Any]:
    """Seal ``manifest`` and write it atomically to ``root/manifest.json``; the one way to write or amend one.

    Returns:
        The sealed manifest as written.
    """
    sealed = seal_manifest(manifest)
    write_json_atomic(Path(root) / MANIFEST_NAME, sealed)
    return sealed


def manifest_problems(manifest: Any) -> list[str]:
    """Schema violations and a broken seal, one line each; empty when the manifest is valid and sealed.

    Integers must be JSON integers (``64``, not ``64.0``); the model facts and the profile are bounded (see the
    schema), so a resealed manifest cannot make the runtime allocate without limit.

    Raises:
        ArtifactError: ``jsonschema`` is not installed (it is a dependency of diffusion-trt).
    """
    problems = schema_problems(manifest, manifest_schema(), MANIFEST_NAME)
    if not problems:
        from .digests import chunk_problem

        problems = [f"files[{rel!r}] {problem}" for rel, entry in manifest["files"].items()
                    if (problem := chunk_problem(entry)) is not None]
    if isinstance(manifest, dict) and isinstance(manifest.get(SEAL_KEY), str):
        stored, actual = manifest[SEAL_KEY], manifest_digest(manifest)
        if stored != actual:
            problems.append(
                f"manifest.json was changed after it was written: {SEAL_KEY} {stored[:12]}… does not match its "
                f"content ({actual[:12]}…); a hand-edited manifest is not trusted: restore the original or "
                "recompile (code that amends a manifest must write it with artifacts.write_manifest)"
            )
    return problems


# -- what loading may read: external data and links -------------------------------------------------------


#: Where the generic walk of :func:`onnx_model_tensors` stops (``TensorProto.DESCRIPTOR.full_name``).
_TENSOR_PROTO = "onnx.TensorProto"


@functools.cache
def _tensor_fields(root: Any) -> dict[str, tuple[tuple[str, str, str], ...]]:
    """The walk's plan, read off the protobuf descriptors once per root message type: for every message type
    reachable from descriptor ``root``, its message fields whose type can hold a ``TensorProto`` at some depth, as
    ``(field name, "repeated" | "map" | "one", type of the messages it holds)``. A field a new ONNX release adds is
    walked with no change here; fields that cannot lead to a tensor (``ValueInfoProto``, ``TypeProto``...) are
    left out, and ``TensorProto`` maps to none: it is where the walk stops."""
    types: dict[str, Any] = {}
    todo = [root]
    while todo:
        desc = todo.pop()
        if desc.full_name not in types:
            types[desc.full_name] = desc
            todo += [f.message_type for f in desc.fields if f.message_type is not None]
    reaches = {name: name == _TENSOR_PROTO for name in types}
    changed = True
    while changed:  # a fixed point: the message types are cyclic (GraphProto > NodeProto > AttributeProto > GraphProto)
        changed = False
        for name, desc in types.items():
            if not reaches[name] and any(f.message_type is not None and reaches[f.message_type.full_name]
                                         for f in desc.fields):
                reaches[name] = changed = True
    plan: dict[str, tuple[tuple[str, str, str], ...]] = {}
    for name, desc in types.items():
        fields = []
        for f in desc.fields if name != _TENSOR_PROTO else ():
            held = f.message_type
            if held is None or not reaches[held.full_name]:
                continue
            if held.GetOptions().map_entry:
                fields.append((f.name, "map", held.fields_by_name["value"].message_type.full_name))
            else:
                repeated = getattr(f, "is_repeated", None)  # protobuf >= 5.29; .label before (deprecated since)
                repeated = f.label == f.LABEL_REPEATED if repeated is None else repeated
                fields.append((f.name, "repeated" if repeated else "one", held.full_name))
        plan[name] = tuple(fields)
    return plan


def onnx_model_tensors(model: Any) -> Iterator[Any]:
    """Every ``TensorProto`` anywhere in a parsed ONNX message (a ``ModelProto``, or any part of one), each once:
    a generic walk of the protobuf messages driven by their descriptors (every set message field, repeated or not,
    to any depth; :func:`_tensor_fields`), so initializers, sparse initializers (their values and indices), node
    attributes (``t``, ``tensors``, ``sparse_tensor``, ``sparse_tensors``), subgraphs (``g``, ``graphs``), model
    functions' nodes and attribute defaults (``attribute_proto``) and ``training_info`` are all covered, nested in
    each other, with no list of places to keep up to date. Order: each message's fields in field-number order, the
    tensors of a field before the messages below it.

    Cost: only fields whose type can hold a tensor are entered and a tensor's own fields (its ``raw_data``) are
    never touched, so the time goes with the nodes and attributes, not the weights. The fields are read by name from
    the plan rather than with ``ListFields()`` on every message, which measured 5 us per AttributeProto (it wraps
    every set field, ``ints`` included). On a 1 GB model of 700 initializers and 5000 nodes
    (``benchmarks/tensor_walk.py``, 2 loaded cores) the walk took 60-80 ms against 1.1-1.3 s for the parse, no
    slower than the hand-listed walk it replaced.
    """
    root = model.DESCRIPTOR
    plan = _tensor_fields(root)
    stack = [(model, root.full_name)]
    while stack:
        msg, kind = stack.pop()
        below = []
        for name, how, held in plan[kind]:
            if how == "one":
                if not msg.HasField(name):
                    continue
                values: Any = (getattr(msg, name),)
            else:
                values = getattr(msg, name)
                if not values:
                    continue
                if how == "map":
                    values = values.values()
            if held == _TENSOR_PROTO:
                yield from values
            else:
                below += [(v, held) for v in values]
        stack += reversed(below)


def external_data_locations(model: Any) -> list[str]:
    """The distinct external-data ``location`` strings of a parsed ``onnx.ModelProto``, in order (``""`` for a
    tensor that claims external data but names no location)."""
    import onnx

    seen: dict[str, None] = {}
    for tensor in onnx_model_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in tensor.external_data}
            seen.setdefault(info.get("location", ""), None)
    return list(seen)


def onnx_external_data_locations(path: str | os.PathLike[str]) -> list[str]:
    """The distinct external-data ``location`` strings of an ONNX file, in order, read without loading weights.

    Raises:
        ArtifactError: the file is not a parseable ONNX model.
    """
    return external_data_locations(read_onnx_structure(path))


def read_onnx_structure(path: str | os.PathLike[str]) -> Any:
    """An artifact's ONNX file as an ``onnx.ModelProto``, its external data not loaded.

    Raises:
        ArtifactError: the file is missing, unreadable or not a parseable ONNX model (a damaged artifact, exit 3:
            ``inspect`` of one whose UNet file was cut short gave protobuf's traceback, exit 1).
    """
    import onnx

    try:
        return onnx.load(str(path), load_external_data=False)
    except OSError as e:
        raise ArtifactError(f"{path}: {e.strerror or e}; copy the whole artifact folder or recompile") from None
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise ArtifactError(f"{path} is not a readable ONNX model ({type(e).__name__}: {e}); recompile") from None


def onnx_external_data_problems(root: str | os.PathLike[str], rel: str, listed: Collection[str]) -> list[str]:
    """Check the external-data references of the ONNX file ``root/rel`` before any runtime opens it.

    Every ``location`` (of every tensor :func:`onnx_model_tensors` walks) must be a relative path that stays inside
    the artifact folder (no ``..``, no absolute path, no link leading out) and must name a file the manifest lists
    (so its sha256 is checked).

    Returns:
        One line per problem; empty when every reference is safe.
    """
    root = Path(root)
    try:
        locations = onnx_external_data_locations(safe_join(root, rel))
    except ArtifactError as e:
        return [str(e)]
    return external_location_problems(root, rel, locations, listed)


def external_location_problems(root: Path, rel: str, locations: Collection[str], listed: Collection[str]) -> list[str]:
    """The problems of the external-data ``locations`` of the ONNX file ``rel`` (see
    :func:`onnx_external_data_problems`); empty when each is a listed file inside ``root``."""
    problems = []
    for location in locations:
        target = external_data_target(rel, location)
        if target is None:
            problems.append(
                f"{rel}: external data location {location!r} points outside the artifact folder; external data "
                "must sit beside the model (location 'model.onnx.data'): recompile the artifact"
            )
            continue
        try:
            safe_join(root, target)
        except ArtifactError:
            problems.append(
                f"{rel}: external data {target!r} is a symbolic link leading outside the artifact folder; "
                "replace it with the file itself"
            )
            continue
        if target not in listed:
            problems.append(
                f"{rel}: external data {target!r} is not listed in the manifest, so its sha256 cannot be checked; "
                "recompile the artifact"
            )
    return problems


def external_data_target(rel: str, location: str) -> str | None:
    """The artifact path (``unet/model.onnx.data``) an external-data ``location`` of ONNX file ``rel`` names, or
    ``None`` when the location is empty, absolute (POSIX or Windows), has a backslash, a NUL or a ``..`` part."""
    pure = PurePosixPath(location)
    if (
        not location
        or "\0" in location
        or pure.is_absolute()
        or PureWindowsPath(location).is_absolute()
        or PureWindowsPath(location).drive
        or "\\" in location
        or ".." in pure.parts
    ):
        return None
    return (PurePosixPath(rel).parent / pure).as_posix()


def link_problems(root: str | os.PathLike[str]) -> list[str]:
    """Symbolic links under ``root`` that resolve outside it (loaders such as the tokenizer read whole folders)."""
    root = Path(root)
    real_root = root.resolve()
    problems = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            if path.is_symlink():
                try:
                    target = path.resolve()
                except (RuntimeError, OSError) as e:  # a loop: Python < 3.13 raises RuntimeError
                    problems.append(
                        f"{path.relative_to(root).as_posix()}: symbolic link that cannot be resolved ({e}); "
                        "replace it with the file itself"
                    )
                    continue
                if not target.is_relative_to(real_root):
                    problems.append(
                        f"{path.relative_to(root).as_posix()}: symbolic link to {target}, outside the artifact "
                        "folder; replace it with the file itself"
                    )
    return problems


def unlisted_files(root: str | os.PathLike[str], manifest: dict[str, Any]) -> list[str]:
    """Files under ``root`` that the manifest does not list (``manifest.json`` itself excepted), sorted."""
    root = Path(root)
    listed = set(manifest.get("files", {}))
    out = []
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if rel != MANIFEST_NAME and rel not in listed:
                out.append(rel)
    return sorted(out)


def component_file_problems(root: str | os.PathLike[str], manifest: dict[str, Any], parse_onnx: bool = True
                            ) -> list[str]:
    """Each component's ``onnx``/``plan``/``files`` must be listed in ``files`` (hashed); ONNX external data safe
    (read from each file by path unless ``parse_onnx`` is false: a reader checks it on the bytes it loads)."""
    listed = manifest.get("files", {})
    problems = []
    for name, entry in manifest.get("components", {}).items():
        paths = [entry[k] for k in ("onnx", "plan") if isinstance(entry.get(k), str)]
        paths += [p for p in entry.get("files", []) if isinstance(p, str)]
        for rel in dict.fromkeys(paths):
            if rel not in listed:
                problems.append(
                    f"component {name!r}: {rel} is not listed in the manifest's files, so it cannot be checked; "
                    "recompile the artifact"
                )
        onnx_rel = entry.get("onnx")
        if parse_onnx and isinstance(onnx_rel, str) and onnx_rel in listed:
            try:
                exists = safe_join(Path(root), onnx_rel).is_file()
            except ArtifactError:
                exists = False  # reported by verify_files
            if exists:
                problems += onnx_external_data_problems(root, onnx_rel, listed)
    return problems


# -- the writer's lock ------------------------------------------------------------------------------------


def lock_path(final: str | os.PathLike[str]) -> Path:
    """The lock file of artifact folder ``final``: ``.<name>.lock`` beside it (the folder itself is replaced)."""
    final = Path(final)
    return final.with_name(f".{final.name}.lock")


@contextlib.contextmanager
def artifact_lock(final: str | os.PathLike[str], timeout: float = 0.0, poll: float = 0.2) -> Iterator[Path]:
    """Hold the exclusive writer lock of artifact folder ``final`` for the ``with`` block.

    The lock is ``flock(2)`` on :func:`lock_path`, holding the holder's pid, host and start time for messages.
    Leaving the block any way Python can (success, error, Ctrl-C, SIGTERM through the CLI) deletes the file while
    still holding the lock. A holder killed outright (SIGKILL, power loss) leaves the file behind, but the kernel
    dropped its lock with the process, so a stale file of a dead pid never blocks the next writer. A waiter that
    gets the lock of a file already deleted (or replaced) reopens the path and tries again, so two writers never
    hold locks on two different files of one name. POSIX only (``fcntl``).

    Args:
        final: the artifact folder.
        timeout: seconds to wait for another holder; 0 = fail at once.
        poll: seconds between attempts while waiting.

    Raises:
        OutputPathError: another process holds the lock past ``timeout`` (message names its pid and host).
    """
    import fcntl

    path = lock_path(final)
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + max(0.0, timeout)
    fd = _acquire(path, final, timeout, deadline, poll)
    try:
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "argv": sys.argv[:8],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            if _same_file(path, fd):
                path.unlink()  # still holding the lock: no writer can be between its open and its flock check
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _acquire(path: Path, final: str | os.PathLike[str], timeout: float, deadline: float, poll: float) -> int:
    """An fd of ``path`` holding its exclusive ``flock``, retried every ``poll`` s until ``deadline``; a lock got
    on a file the previous holder deleted on release is dropped and the path reopened. Raises OutputPathError."""
    import fcntl

    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                holder = _lock_holder(path)
                waited = f"after waiting {timeout:g} s" if timeout > 0 else "now"
                raise OutputPathError(
                    f"another compile ({holder}) is writing {final} {waited}; wait for it to finish, write "
                    f"to another folder, or pass --lock-timeout SECONDS to wait (lock file {path})"
                ) from None
            time.sleep(poll)
            continue
        except BaseException:
            os.close(fd)
            raise
        if _same_file(path, fd):
            return fd
        os.close(fd)  # the holder we waited for deleted this file on release: lock the path's new file


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (False once deleted or replaced)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _lock_holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {info['pid']} on {info['host']}, since {info['since_utc']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "unknown process"


def _leftover_pattern(final: Path) -> re.Pattern[str]:
    """Names of what writers of ``final`` leave beside it: ``.<name>.staging-<pid>-<random>`` (``staging-<random>``
    before the pid was recorded) and ``.<name>.old-<pid>``. Exact names only: ``.sd15.fp16.staging-x`` belongs to
    artifact ``sd15.fp16`` (another lock), not to ``sd15``."""
    prefix = re.escape(f".{final.name}.")
    return re.compile(rf"{prefix}(?:staging-(?:(?P<spid>\d+)-)?[A-Za-z0-9_]+|old-(?P<opid>\d+))")


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (signal 0; a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def leftovers(final: str | os.PathLike[str]) -> list[tuple[Path, int | None]]:
    """Folders an interrupted writer of ``final`` left beside it, oldest first, with the pid that made each
    (``None`` for staging folders of older versions, which did not record it)."""
    final = Path(final)
    pattern = _leftover_pattern(final)
    found = []
    for p in final.parent.glob(f".{glob_escape(final.name)}.*"):
        m = pattern.fullmatch(p.name)
        if m and p.is_dir() and not p.is_symlink():
            pid = m.group("spid") or m.group("opid")
            found.append((p, int(pid) if pid else None))
    return sorted(found, key=lambda item: item[0].stat().st_mtime)


def glob_escape(name: str) -> str:
    """``name`` with the glob metacharacters ``*?[`` made literal."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def leftover_warnings(final: str | os.PathLike[str]) -> list[str]:
    """One line per :func:`leftovers` folder: its size, the writer that left it, and the fix (for inspect/verify)."""
    lines = []
    for path, pid in leftovers(final):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        who = "an older compile" if pid is None else (
            f"compile pid {pid}, still running" if _pid_alive(pid) else f"compile pid {pid}, no longer running")
        lines.append(
            f"{path.name} beside the artifact ({size / 1e6:.1f} MB) was left by an interrupted write ({who}); the "
            f"next compile into {Path(final).name} removes it, or delete it: rm -r {path}"
        )
    return lines


def _recover(final: Path) -> None:
    """Under the lock: clean what a killed writer of ``final`` left beside it.

    A staging folder whose writer is gone is dead (every writer holds the lock while its staging folder lives);
    one whose recorded pid still runs on this host is left alone with a warning (another host sharing the folder,
    or a reused pid). An ``.<name>.old-*`` folder with no ``final`` means a writer died between the two renames of
    a non-atomic swap: it is put back.
    """
    found = leftovers(final)
    old = [p for p, _ in found if ".old-" in p.name]
    if not final.exists() and old:
        logger.warning("restoring %s from %s (a compile was interrupted while swapping folders)", final, old[-1])
        os.replace(old[-1], final)
        old = old[:-1]
    for p, pid in found:
        if not p.exists() or (".old-" in p.name and p not in old):
            continue
        if pid is not None and pid != os.getpid() and _pid_alive(pid) and ".staging-" in p.name:
            logger.warning("leaving %s: its writer (pid %d) still runs on this host", p, pid)
            continue
        logger.warning("removing %s, left by an interrupted compile", p)
        shutil.rmtree(p, ignore_errors=True)


def remove_dead_leftovers(folder: Path, pattern: re.Pattern[str], what: str) -> list[Path]:
    """Remove the temporary folders a killed writer left in ``folder``: entries whose name ``pattern`` matches whole
    and whose writer is gone (the ``pid`` group of the name no longer runs on this host, or the name has none). One
    whose pid still runs (another writer now, or a reused pid) is left alone. Symbolic links are never followed or
    removed. Logs one warning per folder removed, naming ``what`` left it (e.g. "an interrupted export-triton").

    Returns:
        The folders removed.
    """
    removed: list[Path] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        path = folder / name
        if not m or path.is_symlink() or not path.is_dir():
            continue
        pid = m.groupdict().get("pid")
        if pid and int(pid) != os.getpid() and _pid_alive(int(pid)):
            continue
        logger.warning("removing %s, left by %s", path, what)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with ``renameat2(RENAME_EXCHANGE)`` (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    return rc == 0


def umask_mode(kind: str) -> int:
    """The mode a plain ``open``/``mkdir`` would give under this process's umask ("file": 0o666, "dir": 0o777).

    ``tempfile.mkstemp``/``mkdtemp`` create 0600/0700 whatever the umask; artifacts are shipped to other users
    and containers (Triton), so files renamed into place get the ordinary mode back.
    """
    mask = os.umask(0)
    os.umask(mask)
    return (0o666 if kind == "file" else 0o777) & ~mask


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "wb", *, hidden: bool = False) -> Iterator[Any]:
    """A file object (``mode`` "wb", or "w" for UTF-8 text) whose contents replace ``path`` when the block ends
    without an error: written to a temporary file beside it (a dot-file with ``hidden``), given the umask's mode
    (:func:`umask_mode`) and renamed over ``path`` (``os.replace``). Readers never see half a file, and an
    interrupted write leaves the old file (or none) and no temporary file."""
    fd, tmp = tempfile.mkstemp(prefix=f"{'.' if hidden else ''}{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
        os.chmod(tmp, umask_mode("file"))  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through :func:`atomic_file`: readers never see half a file."""
    with atomic_file(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=False)
        f.write("\n")


def write_bytes_atomic(path: Path, data: bytes | memoryview) -> None:
    """Write ``data`` to ``path`` through :func:`atomic_file` (its folder made if missing): readers never see half a
    file, and an interrupted write leaves the old file (or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(data)


def refuse_symlinked_output(final: Path) -> None:
    """An output folder given as a symbolic link is refused: the lock and the staging folder are named after the
    path given, so a compile into a link and one into its target would not exclude each other, and the final
    rename would replace the link with a folder.

    Raises:
        OutputPathError: ``final`` is a symbolic link (the message names its target and the fix).
    """
    if final.is_symlink():
        target = os.readlink(final)
        raise OutputPathError(
            f"output {final} is a symbolic link (to {target}); compiling through a link would lock and replace the "
            f"link, not the folder it points to: pass the real folder (-o {final.parent / target}) or remove the link"
        )


@contextlib.contextmanager
def staging_dir(final: Path, overwrite: bool = False, lock_timeout: float = 0.0) -> Iterator[Path]:
    """Yield a temporary folder beside ``final``; on success it replaces ``final`` in one step.

    The whole block runs under :func:`artifact_lock`, so two writers of ``final`` never interleave; leftovers
    of a killed writer (``.<name>.staging-<pid>-*`` whose pid is gone) are cleaned first. ``final`` given as a
    symbolic link is refused (:func:`refuse_symlinked_output`). On any exception the staging folder is deleted and
    an existing ``final`` is left untouched, so a failed or killed compile leaves no half artifact. The swap with an
    existing ``final`` is atomic where the kernel offers ``renameat2(RENAME_EXCHANGE)`` (Linux); elsewhere
    it is two renames, and a writer killed between them has the old folder restored by the next writer.

    Raises:
        OutputPathError: ``final`` is a symbolic link or a file, or exists and ``overwrite`` is false (or holds no
            manifest), or another writer holds the lock past ``lock_timeout`` seconds.
        OSError: a folder on the way to ``final`` cannot be created (a file in its place, no permission).
    """
    final = Path(final)
    refuse_symlinked_output(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    with artifact_lock(final, timeout=lock_timeout):
        refuse_symlinked_output(final)  # made while we waited for the lock
        _recover(final)
        if final.exists() and not final.is_dir():
            raise OutputPathError(f"output {final} is a file, not a folder; choose another -o")
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()  # an empty folder (made with mkdir -p) is no artifact to protect
        if final.exists() and not overwrite:
            raise OutputPathError(f"output folder {final} already exists; pass --overwrite or choose another -o")
        if final.exists() and not (final / MANIFEST_NAME).is_file():
            raise OutputPathError(
                f"output folder {final} is not empty and holds no {MANIFEST_NAME}: --overwrite only replaces an "
                "artifact; choose another -o (nothing was deleted)"
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.staging-{os.getpid()}-", dir=final.parent))
        os.chmod(tmp, umask_mode("dir"))
        try:
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists() and _exchange(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the previous artifact
            return
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def read_manifest(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Load ``root/manifest.json``, validate it against the schema and check its seal.

    Raises:
        ArtifactError: the folder or manifest is missing, unreadable, of another schema version, invalid
            under the schema (one line per violation), or edited after it was written (broken seal).
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise ArtifactError(f"{root} is a file, not an artifact folder; pass the folder `diffusion-trt compile` wrote")
    if not root.is_dir():
        raise ArtifactError(f"artifact folder {root} does not exist; run `diffusion-trt compile` first")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{path} is missing; {root} is not a compiled artifact (run `diffusion-trt compile`)")
    manifest = parse_manifest(read_manifest_bytes(path), path)
    problems = manifest_problems(manifest)
    if problems:
        raise ArtifactError(
            f"{path} is not a valid artifact manifest (run `diffusion-trt verify {root}`):\n  " + "\n  ".join(problems)
        )
    return manifest


def enclosing_artifact(path: str | os.PathLike[str]) -> Path | None:
    """The artifact folder that ``path`` is or lies inside (resolved), or ``None``: the nearest folder at or above it
    whose ``manifest.json`` is one of ours (a JSON object with :data:`SEAL_KEY`). For commands that write a file
    anywhere (``optimize -o``, ``dummy-lora OUT``): a file put into a sealed artifact is one its manifest does not
    list, and ``verify`` fails on it. A manifest that cannot be read as JSON is not taken as ours.
    """
    p = Path(path).expanduser().resolve()
    for folder in (p, *p.parents):
        candidate = folder / MANIFEST_NAME
        if not candidate.is_file():
            continue
        try:
            data = parse_json(read_manifest_bytes(candidate), str(candidate))
        except ArtifactError:
            continue
        if isinstance(data, dict) and SEAL_KEY in data:
            return folder
    return None


def read_manifest_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a ``manifest.json``, at most :data:`MAX_MANIFEST_BYTES` (a 1 GB manifest was read whole, then
    parsed into several GB). Opened non-blocking (a FIFO in its place must not hang us).

    Raises:
        ArtifactError: not a regular file, larger than the cap, or unreadable; one line with the fix.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise ArtifactError(f"{path} cannot be opened ({e.strerror}); check the path and its permissions") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{path} is not a regular file; recopy or recompile the artifact")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ArtifactError(f"{path} has {st.st_size} bytes, more than {MAX_MANIFEST_BYTES} (real manifests have "
                                "tens of kB); recompile the artifact")
        try:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as e:
            raise ArtifactError(f"{path} cannot be read ({e.strerror}); recopy the artifact") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArtifactError(f"{path} grew past {MAX_MANIFEST_BYTES} bytes while it was read; recompile the artifact")
    return data


def parse_manifest(data: bytes, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest object of ``manifest.json``'s bytes, of this :data:`SCHEMA_VERSION` (not yet schema-checked).

    Raises:
        ArtifactError: not UTF-8 / JSON / an object (:func:`~diffusion_trt.artifact.values.parse_json`), or another
            schema version.
    """
    manifest = parse_json(data, str(path))
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has schema_version={version!r}; this diffusion-trt reads {SCHEMA_VERSION}: "
            "recompile with this version"
        )
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


def folder_problems(root: str | os.PathLike[str], manifest: dict[str, Any], check_hashes: bool = True,
                    parse_onnx: bool = True) -> list[str]:
    """What loading needs of the files of a schema-valid ``manifest``: :func:`verify_files` (inside the folder,
    present, size, and sha256 unless ``check_hashes`` is false), every component file listed and its ONNX external
    data inside the folder (:func:`component_file_problems`), and no symbolic link leading out
    (:func:`link_problems`). One line per problem. ``parse_onnx``: see :func:`component_file_problems`."""
    problems = verify_files(root, manifest, check_hashes=check_hashes)
    problems += component_file_problems(root, manifest, parse_onnx=parse_onnx)
    problems += link_problems(root)
    return problems


def verification_failed(root: str | os.PathLike[str], problems: Sequence[str]) -> ArtifactError:
    """The error for an artifact whose checks found ``problems``: one line, every problem named."""
    return ArtifactError(f"artifact {root} failed verification: " + "; ".join(problems))


def load_verified(root: str | os.PathLike[str], check_hashes: bool = True) -> dict[str, Any]:
    """Everything loading needs checked, before any file is deserialised; one error listing every problem.

    :func:`read_manifest` (schema, seal), then :func:`folder_problems`. Files the manifest does not list are logged
    as a warning (``diffusion-trt verify`` reports them).

    Raises:
        ArtifactError: as :func:`read_manifest`, or when any check fails.
    """
    manifest = read_manifest(root)
    problems = folder_problems(root, manifest, check_hashes=check_hashes)
    if problems:
        raise verification_failed(root, problems)
    extra = unlisted_files(root, manifest)
    if extra:
        logger.warning("artifact %s holds files its manifest does not list: %s", root, ", ".join(extra[:10]))
    return manifest


def sha256_hex_problem(value: str) -> str | None:
    """Why ``value`` is no sha256 digest (64 hex digits; case and surrounding spaces do not matter), or ``None``.
    ``verify --expect-sha256`` refuses such a value as a usage error (exit 2) before reading the artifact."""
    if re.fullmatch(r"[0-9a-f]{64}", value.strip().lower()):
        return None
    return (f"{value!r} is not a sha256 (64 hex digits); pass the manifest_sha256 that `diffusion-trt inspect --json` "
            "prints for the artifact you trust")


def pin_problems(manifest: dict[str, Any], expect_sha256: str | None) -> list[str]:
    """The manifest is not the one a service pinned: its digest (:func:`manifest_digest`, the ``manifest_sha256``
    that ``inspect`` prints) differs from ``expect_sha256``. The seal alone is an unkeyed sha256 anyone can recompute
    after an edit; a digest received out of band (a deployment config) pins every file, since the manifest lists
    each file's sha256. Empty when ``expect_sha256`` is ``None`` or matches."""
    if expect_sha256 is None:
        return []
    problem = sha256_hex_problem(expect_sha256)
    if problem is not None:
        return [f"--expect-sha256 {problem}"]
    expected = expect_sha256.strip().lower()
    actual = manifest_digest(manifest)
    if actual != expected:
        return [f"manifest digest {actual} is not the expected {expected}: this is not the artifact that was pinned "
                "(rebuilt, or altered and resealed); fetch the pinned artifact again or update the pin"]
    return []

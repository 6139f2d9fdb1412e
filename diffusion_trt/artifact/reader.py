"""An artifact folder opened once for loading: every file read through one directory descriptor, hashed as read.

Why (issue 14): loading by path (hash a file, then let a loader open it again by name) loads whatever was swapped
in between, and a folder exchanged while a run loads it (``compile --overwrite``'s rename-exchange) mixes engines of
two artifacts. :class:`ArtifactReader` opens the folder once (``O_DIRECTORY``) and reads ``manifest.json`` and every
file relative to that descriptor (``dir_fd=``), so one run sees one folder even when another takes its name; the
bytes it returns are the bytes it hashed, and the loaders get those bytes, never a path into the artifact (ONNX
Runtime: the model and its external-data files, read into a private folder of the caller's that ORT opens, or from
memory, :meth:`ArtifactReader.onnx`; TensorRT: the plan; the tokenizer: a private copy of its hashed files; the
scheduler config: parsed from its hashed bytes).

If the folder the descriptor holds is deleted while it loads (the writer removes the previous artifact after the
exchange), a read fails with :class:`ArtifactReplacedError`: the caller loads again from the path.

Costs: each engine's bytes sit in memory (or in the private folder's page cache) while its session is created.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..errors import ArtifactError
from . import digests, folder
from .manifest import Manifest

logger = logging.getLogger(__name__)

#: The most bytes ``manifest.json`` may have: one cap for every reader (:data:`folder.MAX_MANIFEST_BYTES`).
MAX_MANIFEST_BYTES = folder.MAX_MANIFEST_BYTES


class ArtifactReplacedError(ArtifactError):
    """The artifact folder was deleted or replaced while it was being loaded; loading again reads the new one."""


@dataclass(frozen=True)
class OnnxBytes:
    """An ONNX model read from an artifact: the ``.onnx`` bytes and each external-data file, by its ``location``.

    Attributes:
        rel: the model's path in the artifact (``unet/model.onnx``).
        model: the ``.onnx`` file's bytes (hashed against the manifest when the reader checks hashes).
        external: ``location`` as the model's tensors name it -> that file's bytes (hashed likewise).
        folder: where :meth:`ArtifactReader.onnx` wrote the model and its external data as it read them (a caller's
            private folder), or ``None``: the bytes are only in memory.
    """

    rel: str
    model: bytes
    external: dict[str, bytes | memoryview] = field(default_factory=dict)
    folder: Path | None = None

    @property
    def model_path(self) -> Path | None:
        """The model's file in :attr:`folder` (its external data beside it, as ``location`` names them), or
        ``None`` when the bytes are only in memory."""
        return None if self.folder is None else self.folder / PurePosixPath(self.rel).name


class ArtifactReader:
    """Read one artifact folder through one directory descriptor; a context manager (closes the descriptor).

    Build it with :meth:`open`. Not thread-safe for concurrent reads of the same file (each read opens its own
    descriptor, so concurrent reads of different files are fine).

    Attributes:
        root: the folder's path as given (for messages only: nothing is opened by it after :meth:`open`).
        manifest: the schema-valid, sealed manifest read through the descriptor, typed (parsed once, after the schema
            check: :class:`~diffusion_trt.artifact.manifest.Manifest`).
        check_hashes: whether :meth:`read` compares each file's sha256 with the manifest (sizes always).
        loaded: artifact path -> sha256 of every file read so far (when hashes are checked).
    """

    manifest: Manifest

    def __init__(self, root: Path, fd: int, check_hashes: bool) -> None:
        self.root = root
        self._fd: int | None = fd
        self._json: dict[str, Any] = {}  # the manifest's JSON: read inside this package only
        self.check_hashes = check_hashes
        self.loaded: dict[str, str] = {}

    @classmethod
    def open(cls, root: str | os.PathLike[str], *, check_hashes: bool = True,
             expect_sha256: str | None = None) -> ArtifactReader:
        """Open ``root`` and read its manifest; check the schema, the seal and (given) the pinned digest, and what
        loading needs of the files (:func:`~diffusion_trt.artifact.folder.folder_problems` without hashes: every file
        present at its size, every component file listed, no link leading out). Hashes and ONNX external data are
        checked by :meth:`read` / :meth:`onnx` on the bytes they return.

        Args:
            root: the artifact folder.
            check_hashes: compare every file read with its sha256 in the manifest.
            expect_sha256: the manifest digest the caller trusts (``manifest_sha256``); ``None`` = any sealed one.

        Raises:
            ArtifactError: the folder or manifest is missing or unreadable, the manifest is invalid, unsealed or not
                the pinned one, or a file check fails (one line per problem).
        """
        root = Path(root)
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ArtifactError(f"artifact folder {root} does not exist; run `diffusion-trt compile` first") from None
        except NotADirectoryError:
            raise ArtifactError(
                f"{root} is a file, not an artifact folder; pass the folder `diffusion-trt compile` wrote"
            ) from None
        except OSError as e:
            raise ArtifactError(f"cannot open the artifact folder {root} ({e.strerror}); check the path") from None
        reader = cls(root, fd, check_hashes)  # owns fd from here: close it through the reader, once
        try:
            reader._json = reader._read_manifest(expect_sha256)
            reader.manifest = Manifest.from_json(reader._json)
            problems = reader._path_problems(
                lambda pinned: folder.folder_problems(pinned, reader._json, check_hashes=False, parse_onnx=False))
            if problems:
                raise reader._unless_replaced(folder.verification_failed(root, problems))
        except BaseException:
            reader.close()  # not os.close(fd): the reader's __del__ would close the number again, by then reused
            raise
        extra = folder.unlisted_files(reader.pinned_root, reader._json)
        if extra:
            logger.warning("artifact %s holds files its manifest does not list: %s", root, ", ".join(extra[:10]))
        return reader

    # -- reading ----------------------------------------------------------------------------------------

    @property
    def pinned_root(self) -> Path:
        """A path to the very folder the descriptor holds (``/proc/self/fd/N`` on Linux), for checks that walk the
        folder by path; elsewhere the path as given."""
        proc = Path(f"/proc/self/fd/{self._require_fd()}")
        return proc if proc.is_dir() else self.root

    def lists(self, rel: str) -> bool:
        """Whether the manifest lists the file ``rel`` (a path relative to the artifact folder)."""
        return rel in self._json["files"]

    def read(self, rel: str, into: Any = None) -> bytes | memoryview:
        """The bytes of the listed file ``rel``, read once through the folder descriptor, checked against the
        manifest's size and (when :attr:`check_hashes`) its digests: per chunk, on several threads, when the manifest
        lists chunk digests (:mod:`~diffusion_trt.artifact.digests`), else one sha256 of the whole file.

        Returns:
            ``bytes`` for small files; for files of :data:`~diffusion_trt.artifact.digests.CHUNK_BYTES` or more, a
            ``memoryview`` of private anonymous memory (:func:`~diffusion_trt.artifact.digests.private_buffer`; read
            in parallel; never a mapping of the file, so later writes to it cannot reach these bytes). Callers that
            need ``bytes`` (protobuf, safetensors, ORT's model argument) convert with ``bytes(...)``. With ``into`` (a
            writable buffer of the file's size), the bytes land there and a view of it is returned.

        Raises:
            ArtifactError: ``rel`` is not listed, leaves the folder, is not a regular file, or differs from the
                manifest; :class:`ArtifactReplacedError` when the folder was deleted meanwhile.
        """
        entry = self._json["files"].get(rel)
        if entry is None:
            raise ArtifactError(f"{rel} is not listed in the manifest of {self.root}, so it cannot be checked; "
                                "recompile the artifact")
        chunks = entry.get("chunks") if self.check_hashes else None
        data = self._read_file(rel, int(entry["size"]), chunks=chunks, into=into)
        if self.check_hashes:
            if chunks is None:
                digest = hashlib.sha256(data).hexdigest()
                if digest != entry["sha256"]:
                    raise self._altered(rel, digest, entry["sha256"])
            self.loaded[rel] = entry["sha256"]  # every chunk matched: the bytes of that whole-file digest
        return data

    def _altered(self, rel: str, digest: str, expected: str, where: str = "") -> ArtifactError:
        return ArtifactError(
            f"{self.root}/{rel}: sha256 {where}{digest[:12]}… != {expected[:12]}… in the manifest; the file "
            "was altered: recopy or recompile the artifact"
        )

    def json(self, rel: str) -> Any:
        """:meth:`read` ``rel`` and parse it as untrusted JSON (:func:`~diffusion_trt.artifact.values.parse_json`)."""
        from .values import parse_json

        return parse_json(self.read(rel), f"{self.root}/{rel}")

    def onnx(self, rel: str, spill: Path | None = None) -> OnnxBytes:
        """The ONNX model ``rel`` and every external-data file its tensors name, each :meth:`read` (checked).

        Args:
            spill: an empty private folder (mode 0700, e.g. ``tempfile.mkdtemp``'s): when the model has external
                data and the folder's file system has room for it, the model and each external-data file are read
                straight into files there (shared mappings of new 0600 files: no copy beyond the read), so that
                ONNX Runtime can open them by path (it builds a session from a file 4-5x faster than from
                in-memory files: ``benchmarks/weight_sources.py``). :attr:`OnnxBytes.folder` says whether it did;
                never into a folder inside the artifact itself.

        Raises:
            ArtifactError: as :meth:`read`; the model does not parse; an external-data location leaves the folder or
                names an unlisted file.
        """
        import onnx

        data = self.read(rel)
        model = onnx.ModelProto()
        try:
            model.ParseFromString(data)
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and friends
            raise ArtifactError(f"{self.root}/{rel} is not a readable ONNX model ({type(e).__name__}: {e}); "
                                "recompile") from None
        locations = folder.external_data_locations(model)
        del model
        problems = self._path_problems(
            lambda pinned: folder.external_location_problems(pinned, rel, locations, self._json["files"]))
        if problems:
            raise self._unless_replaced(folder.verification_failed(self.root, problems))
        targets = {loc: str(folder.external_data_target(rel, loc)) for loc in locations}
        if (spill is not None and locations and not self._holds(spill)
                and self._room_for(spill, set(targets.values()))):
            try:
                return self._spilled(rel, data, targets, spill)
            except OSError as e:  # the folder filled up or went away meanwhile: from memory, as without room
                logger.info("%s: cannot write %s into %s (%s): loading it from memory instead", self.root, rel,
                            spill, e)
                _empty(spill)
        files = {target: self.read(target) for target in dict.fromkeys(targets.values())}  # each file read once
        external = {loc: files[target] for loc, target in targets.items()}
        # ONNX Runtime takes a model only as ``bytes``; a large one (weights inline: artifacts of before the
        # external-data threshold of build_ort) costs one copy here
        return OnnxBytes(rel, data if isinstance(data, bytes) else bytes(data), external)

    def _holds(self, spill: Path) -> bool:
        """Whether ``spill`` lies inside the folder the descriptor holds (``$TMPDIR`` in the artifact): the sealed
        folder gets no copy of its weights (a ``compile --overwrite`` would delete them under the session)."""
        held = os.fstat(self._require_fd())
        try:
            where = spill.resolve()
        except OSError:
            return False
        for path in (where, *where.parents):
            with contextlib.suppress(OSError):
                if os.path.samestat(os.stat(path), held):
                    logger.info("%s: the private folder %s lies inside the artifact (is $TMPDIR there?): loading the "
                                "weights from memory", self.root, spill)
                    return True
        return False

    def _room_for(self, spill: Path, targets: set[str]) -> bool:
        """Whether ``spill``'s file system has room for the files ``targets`` (with 10% to spare)."""
        need = sum(int(self._json["files"][t]["size"]) for t in targets)
        try:
            free = shutil.disk_usage(spill).free
        except OSError:
            return False
        if free < need * 1.1:
            logger.info("%s: %.2f GB free in %s for %.2f GB of weights: loading them from memory instead", self.root,
                        free / 1e9, spill, need / 1e9)
            return False
        return True

    def _spilled(self, rel: str, data: bytes | memoryview, targets: dict[str, str], spill: Path) -> OnnxBytes:
        """:meth:`onnx`'s files written into ``spill`` as they are read (see there)."""
        model_path = spill / PurePosixPath(rel).name
        fd = os.open(model_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        external: dict[str, bytes | memoryview] = {}
        written: dict[str, bytes | memoryview] = {}  # two spellings of one location ("a.data", "./a.data"): once
        for loc, target in targets.items():
            if target not in written:
                dest = spill.joinpath(*PurePosixPath(loc).parts)
                dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                buffer = digests.spill_buffer(dest, int(self._json["files"][target]["size"]))
                written[target] = self.read(target, into=buffer)
            external[loc] = written[target]
        return OnnxBytes(rel, data if isinstance(data, bytes) else bytes(data), external, folder=spill)

    @contextlib.contextmanager
    def private_copy(self, rel_dir: str) -> Iterator[Path]:
        """A temporary folder holding the :meth:`read` bytes of every listed file under ``rel_dir/`` (for loaders
        that take a folder, like a tokenizer); removed on exit."""
        prefix = rel_dir.rstrip("/") + "/"
        with tempfile.TemporaryDirectory(prefix="diffusion-trt-") as tmp:
            for rel in self._json["files"]:
                if rel.startswith(prefix):
                    dest = Path(tmp).joinpath(*PurePosixPath(rel[len(prefix):]).parts)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(self.read(rel))
            yield Path(tmp)

    def close(self) -> None:
        """Close the folder descriptor (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ArtifactReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()

    # -- internals ------------------------------------------------------------------------------------

    def _require_fd(self) -> int:
        if self._fd is None:
            raise ArtifactError(f"the reader of {self.root} is closed; load the artifact again")
        return self._fd

    def _read_manifest(self, expect_sha256: str | None) -> dict[str, Any]:
        where = self.root / folder.MANIFEST_NAME
        try:
            data = self._read_file(folder.MANIFEST_NAME, None, limit=MAX_MANIFEST_BYTES)
        except ArtifactReplacedError:
            raise
        except ArtifactError as e:
            if "is missing" in str(e):
                raise ArtifactError(
                    f"{where} is missing; {self.root} is not a compiled artifact (run `diffusion-trt compile`)"
                ) from None
            raise
        manifest = folder.parse_manifest(data, where)
        problems = folder.manifest_problems(manifest) + folder.pin_problems(manifest, expect_sha256)
        if problems:
            raise ArtifactError(
                f"{where} is not a valid artifact manifest (run `diffusion-trt verify {self.root}`):\n  "
                + "\n  ".join(problems)
            )
        return manifest

    def _read_file(self, rel: str, size: int | None, limit: int | None = None,
                   chunks: dict[str, Any] | None = None, into: Any = None) -> bytes | memoryview:
        """Open ``rel`` relative to the folder descriptor (non-blocking: a FIFO must not hang us), check that it is a
        regular file inside the folder of ``size`` bytes, and read it whole: in parallel chunks at
        :data:`~diffusion_trt.artifact.digests.CHUNK_BYTES` or more, each checked against ``chunks`` (the manifest's
        chunk digests) when given."""
        fd = self._require_fd()
        if problems := self._path_problems(lambda pinned: _join_problems(pinned, rel)):  # lexical checks and links
            raise self._unless_replaced(ArtifactError(problems[0]))
        try:
            f = os.open(rel, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=fd)
        except FileNotFoundError:
            raise self._unless_replaced(ArtifactError(
                f"{self.root}/{rel}: file is missing; copy the whole artifact folder or recompile")) from None
        except OSError as e:
            raise ArtifactError(f"{self.root}/{rel}: cannot be opened ({e.strerror}); recopy the artifact") from None
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode):
                raise ArtifactError(f"{self.root}/{rel} is not a regular file; recopy or recompile the artifact")
            if problems := self._path_problems(lambda pinned: self._outside_problems(f, rel)):
                raise self._unless_replaced(ArtifactError(problems[0]))
            if size is not None and st.st_size != size:
                raise ArtifactError(f"{self.root}/{rel}: size {st.st_size} != {size} in the manifest; the file is "
                                    "truncated or altered")
            if limit is not None and st.st_size > limit:
                raise ArtifactError(f"{self.root}/{rel} has {st.st_size} bytes, more than {limit}; recompile")
            data = self._read_whole(f, rel, st.st_size, chunks, into)
        finally:
            os.close(f)
        return data

    def _read_whole(self, f: int, rel: str, size: int, chunks: dict[str, Any] | None,
                    into: Any = None) -> bytes | memoryview:
        """The ``size`` bytes of the open file ``f``: one read below a chunk, else :func:`digests.read_into` (each
        chunk compared with ``chunks`` on its thread). Growth past ``size`` is refused like a short read."""
        if size < digests.CHUNK_BYTES and chunks is None:
            with os.fdopen(f, "rb", closefd=False) as stream:
                data = stream.read(size + 1)
            if len(data) != size:
                raise ArtifactError(f"{self.root}/{rel} changed size while it was read; recopy the artifact")
            if into is None:
                return data
            view = memoryview(into)
            view[:] = data
            return view

        def check(index: int, part: memoryview) -> None:
            digest = hashlib.sha256(part).hexdigest()
            if digest != chunks["sha256"][index]:
                raise self._altered(rel, digest, chunks["sha256"][index], where=f"of chunk {index} ")

        try:
            data = digests.read_into(f, size, check if chunks is not None else None,
                                     int(chunks["bytes"]) if chunks is not None else digests.CHUNK_BYTES, into)
        except EOFError:
            raise ArtifactError(f"{self.root}/{rel} changed size while it was read; recopy the artifact") from None
        if os.fstat(f).st_size != size:
            raise ArtifactError(f"{self.root}/{rel} changed size while it was read; recopy the artifact")
        return data

    def _unless_replaced(self, error: ArtifactError) -> ArtifactError:
        """``error`` (a file missing, a path seen leading out of the folder), or an :class:`ArtifactReplacedError`
        when the folder itself was deleted or replaced meanwhile (a ``compile --overwrite``): through the descriptor of
        a deleted folder files are missing and every path looks as if it led outside, and the load should start
        again on the new folder rather than report damage."""
        if not self._replaced():
            return error
        return ArtifactReplacedError(f"artifact {self.root} was deleted or replaced while it loaded (a compile "
                                     "--overwrite?); load it again")

    def _replaced(self) -> bool:
        """The folder the descriptor holds was deleted, or its path now names another folder."""
        held = os.fstat(self._require_fd())
        if held.st_nlink == 0:
            return True
        try:
            now = os.stat(self.root)
        except OSError:
            return True
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def _outside_problems(self, f: int, rel: str) -> list[str]:
        """Where ``/proc`` tells: the opened file ``f`` lies under the folder the descriptor holds (a link swapped in
        after the checks cannot lead out); the problem, if not."""
        try:
            where = Path(os.readlink(f"/proc/self/fd/{f}"))
            top = Path(os.readlink(f"/proc/self/fd/{self._require_fd()}"))
        except OSError:
            return []
        if where.is_relative_to(top):
            return []
        return [f"{self.root}/{rel} resolves to {where}, outside the artifact folder; replace the symbolic link with "
                "the file itself"]

    def _path_problems(self, check: Callable[[Path], list[str]]) -> list[str]:
        """``check(pinned_root)``: the problems of a check that walks the held folder by path, named under
        :attr:`root`. A folder renamed while such a check ran (``compile --overwrite``'s rename-exchange moves the
        folder being loaded aside) resolves one path before the rename and the other after, so a file would seem to
        lie outside it: when the folder's name changed meanwhile the check runs again (at most 3 times)."""
        problems: list[str] = []
        for _ in range(3):
            before = self._held_name()
            pinned = self.pinned_root
            problems = [p.replace(str(pinned), str(self.root)) for p in check(pinned)]
            if not problems or self._held_name() == before:
                break
        return problems

    def _held_name(self) -> str | None:
        """The path the held folder has now (``/proc``), or ``None`` where it cannot be told."""
        try:
            return os.readlink(f"/proc/self/fd/{self._require_fd()}")
        except OSError:
            return None


def _join_problems(root: Path, rel: str) -> list[str]:
    """:func:`folder.safe_join`'s refusal of ``rel`` under ``root``, as a problem; none when it is inside."""
    try:
        folder.safe_join(root, rel)
    except ArtifactError as e:
        return [str(e)]
    return []


def _empty(spill: Path) -> None:
    """Remove what :meth:`ArtifactReader._spilled` left in ``spill`` (the folder itself stays: the caller's);
    nothing when the folder itself went away."""
    try:
        children = list(spill.iterdir())
    except FileNotFoundError:
        return
    for child in children:
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)

"""Issue 28's load path: per-chunk digests verified on several threads, engines opened side by side, the compile's
range check bounded by bytes, and the one-shot defaults. Timings are benchmarks/cold_start.py's job, not these
tests'."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from diffusion_trt.artifact import digests
from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.reader import ArtifactReader
from diffusion_trt.cli import ALGO_SEARCH_DEFAULT, main
from diffusion_trt.errors import ArtifactError, RuntimeInputError
from diffusion_trt.passes import _ort
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.loading import OpenTogether
from tests.test_artifact_hardening import _unet_output

MiB = 1 << 20


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(digests, "CHUNK_BYTES", MiB)  # the schema's smallest chunk: several chunks for tiny files
    return MiB


def test_file_entry_lists_one_digest_per_chunk_and_the_whole_file_digest(tmp_path: Path, small_chunks: int) -> None:
    data = np.random.default_rng(0).integers(0, 256, int(2.5 * MiB), dtype=np.uint8).tobytes()
    (tmp_path / "w.bin").write_bytes(data)
    entry = digests.file_entry(tmp_path / "w.bin")
    assert entry["sha256"] == hashlib.sha256(data).hexdigest() and entry["size"] == len(data)
    assert entry["chunks"]["bytes"] == MiB
    assert entry["chunks"]["sha256"] == [hashlib.sha256(data[o:o + MiB]).hexdigest() for o in (0, MiB, 2 * MiB)]
    (tmp_path / "small.bin").write_bytes(b"x" * 100)
    assert "chunks" not in digests.file_entry(tmp_path / "small.bin")
    assert digests.chunk_problem(entry) is None
    short = {**entry, "chunks": {"bytes": MiB, "sha256": entry["chunks"]["sha256"][:2]}}
    assert digests.chunk_problem(short) == (f"lists 2 chunk digest(s) for {len(data)} bytes in chunks of {MiB}; "
                                            "3 expected")


def test_read_into_reads_every_byte_on_threads_and_checks_each_chunk(tmp_path: Path) -> None:
    import os

    data = os.urandom(5 * MiB + 17)
    path = tmp_path / "w.bin"
    path.write_bytes(data)
    seen: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = digests.read_into(fd, len(data), lambda i, part: seen.append(i), chunk=MiB)
        assert bytes(buf) == data and sorted(seen) == list(range(6))
        with pytest.raises(EOFError):
            digests.read_into(fd, len(data) + 1, chunk=MiB)
    finally:
        os.close(fd)


def _externalise_unet(src: Path, dest: Path) -> Path:
    """``src`` copied to ``dest`` with the UNet's weights in ``model.onnx.data`` and chunk digests (1 MiB chunks),
    resealed: what compile writes for a UNet over the external-data threshold."""
    shutil.copytree(src, dest)
    model = onnx.load(str(dest / "unet" / "model.onnx"))
    onnx.save_model(model, str(dest / "unet" / "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=1024)
    manifest = json.loads((dest / "manifest.json").read_text())
    for rel in ("unet/model.onnx", "unet/model.onnx.data"):
        manifest["files"][rel] = artifacts.file_entry(dest, rel)
    manifest["components"]["unet"]["files"] = ["unet/model.onnx", "unet/model.onnx.data"]
    artifacts.write_manifest(dest, manifest)
    assert len(manifest["files"]["unet/model.onnx.data"]["chunks"]["sha256"]) > 1
    return dest


@pytest.fixture
def chunked(tiny_artifact: Path, tmp_path: Path, small_chunks: int) -> Path:
    return _externalise_unet(tiny_artifact, tmp_path / "chunked")


def test_a_chunked_artifact_loads_the_same_weights(tiny_artifact: Path, chunked: Path) -> None:
    with EnginePipeline.from_artifacts(tiny_artifact, device="cpu") as pipe:
        expected = _unet_output(pipe)
    with EnginePipeline.from_artifacts(chunked, device="cpu") as pipe:
        np.testing.assert_array_equal(_unet_output(pipe), expected)
    with ArtifactReader.open(chunked) as reader:
        data = reader.onnx("unet/model.onnx")
        assert reader.loaded["unet/model.onnx.data"] == reader.manifest.files["unet/model.onnx.data"].sha256
        weights = data.external["model.onnx.data"]
        assert isinstance(weights, memoryview) and not weights.readonly  # private anonymous memory
        before = bytes(weights[:64])
    path = chunked / "unet" / "model.onnx.data"  # never a mapping of the file: a later write cannot reach the bytes
    path.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()[:64]) + path.read_bytes()[64:])
    assert bytes(weights[:64]) == before


class _SessionsSeen:
    """Wraps ``onnxruntime.InferenceSession``: records each model argument and, for a path, the folder's and the
    file's modes at that moment; ``before(model)`` runs first."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, before: Any = None) -> None:
        import onnxruntime as ort

        self.models: list[Any] = []
        self.modes: list[tuple[int, int]] = []
        real = ort.InferenceSession

        def create(model: Any, *args: Any, **kwargs: Any) -> Any:
            self.models.append(model)
            if isinstance(model, str):
                self.modes.append((Path(model).parent.stat().st_mode & 0o777, Path(model).stat().st_mode & 0o777))
            if before is not None:
                before(model)
            return real(model, *args, **kwargs)

        monkeypatch.setattr(ort, "InferenceSession", create)

    def spilled(self) -> list[Path]:
        return [Path(m) for m in self.models if isinstance(m, str) and "diffusion-trt-weights-" in m]

    def from_memory(self) -> bool:
        """Every session was built from bytes: no model was opened from a private folder."""
        return not self.spilled() and all(isinstance(m, bytes) for m in self.models)


@pytest.fixture
def expected(tiny_artifact: Path) -> np.ndarray:
    """The tiny UNet's output from the reference artifact (weights inline): what every load below must give."""
    with EnginePipeline.from_artifacts(tiny_artifact, device="cpu") as pipe:
        return _unet_output(pipe)


def _loads_alike(art: Path, expected: np.ndarray, monkeypatch: pytest.MonkeyPatch, before: Any = None
                 ) -> _SessionsSeen:
    """Load ``art`` on the CPU with its sessions watched (:class:`_SessionsSeen`); its UNet must give ``expected``."""
    seen = _SessionsSeen(monkeypatch, before=before)
    with EnginePipeline.from_artifacts(art, device="cpu") as pipe:
        np.testing.assert_array_equal(_unet_output(pipe), expected)
    return seen


def test_external_data_is_read_into_a_private_folder_that_onnx_runtime_opens_and_that_is_removed(
        expected: np.ndarray, chunked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _SessionsSeen(monkeypatch)
    with EnginePipeline.from_artifacts(chunked, device="cpu") as pipe:
        np.testing.assert_array_equal(_unet_output(pipe), expected)
        [model] = seen.spilled()  # only the UNet has external data; the others load from bytes
        assert model.name == "model.onnx" and seen.modes == [(0o700, 0o600)]
        assert not model.parent.exists()  # removed once the session was made, while the session runs on
        assert sum(isinstance(m, bytes) for m in seen.models) == len(seen.models) - 1
        # the removal ran on a thread of its own that the load waited for; its time is in the load's timeline
        parts = pipe.engines["unet"].open_parts
        assert set(parts) == {"read_s", "read_ahead_s", "session_s", "cleanup_s"} and min(parts.values()) >= 0


def test_the_load_reads_the_engines_bytes_from_its_start_unless_switched_off(
        expected: np.ndarray, chunked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``loading.READ_AHEAD``: each engine opened side by side gets the bytes a read started before it existed
    (``read_ahead_s``: the read's own time); switched off, each open reads for itself."""
    from diffusion_trt.runtime import pipeline as pipeline_module

    for ahead in (True, False):
        monkeypatch.setattr(pipeline_module, "READ_AHEAD", ahead)
        seen = _SessionsSeen(monkeypatch)
        with EnginePipeline.from_artifacts(chunked, device="cpu") as pipe:
            np.testing.assert_array_equal(_unet_output(pipe), expected)
            for name in ("text_encoder", "unet", "vae_decoder"):
                assert ("read_ahead_s" in pipe.engines[name].open_parts) == ahead
        assert len(seen.spilled()) == 1


def _empty_soon(folder: Path, seconds: float = 20) -> bool:
    """Whether ``folder`` is empty now or within ``seconds`` (a discarded read's folder goes when the read ends)."""
    end = time.monotonic() + seconds
    while any(folder.iterdir()):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def test_a_load_refused_after_its_reads_started_leaves_no_private_folder(
        chunked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spills = tmp_path / "spills"
    spills.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spills))
    from diffusion_trt.runtime import pipeline as pipeline_module

    started: list[Future] = []

    def start_reads(sources: Any) -> dict[str, Future]:
        reads = real_start_reads(sources)
        started.extend(reads.values())
        return reads

    real_start_reads = pipeline_module.start_reads
    monkeypatch.setattr(pipeline_module, "start_reads", start_reads)
    with pytest.raises(RuntimeInputError, match="nope"):  # refused after the reads began: the weights' folders go
        EnginePipeline.from_artifacts(chunked, device="cpu", scheduler="nope")
    # the reads ended before the load returned: none reads through the reader the load closed
    assert len(started) == 3 and all(read.done() for read in started)
    assert _empty_soon(spills, 0)


def test_synchronous_size_buckets_hold_no_read_for_the_dynamic_engine(
        chunked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deterministic mode specialises sessions synchronously: the dynamic UNet opens only if a call needs it, so the
    read started ahead of it is dropped at once rather than held (1.7 GB for SD-1.5) in ``$TMPDIR``."""
    spills = tmp_path / "spills"
    spills.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spills))
    with EnginePipeline.from_artifacts(chunked, device="cpu", size_buckets=[(64, 64)], deterministic=True):
        assert _empty_soon(spills)


def test_an_engine_closed_before_it_used_its_read_removes_the_reads_folder(
        chunked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine, read_private

    spills = tmp_path / "spills"
    spills.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spills))
    with ArtifactReader.open(chunked) as reader:
        entry = reader.manifest.components["unet"]
        source = functools.partial(reader.onnx, entry.onnx)
        read: Future = Future()
        read.set_result(read_private(source, "unet"))
        assert (Path(read.result().folder.name) / "model.onnx").is_file()
        engine = OrtEngine(chunked / entry.onnx, entry.spec, name="unet", source=source, read_ahead=read)
        engine.close()  # never opened
    assert _empty_soon(spills, 0)


def test_the_private_folder_goes_where_tmpdir_says_with_huge_pages_asked_for(
        expected: np.ndarray, chunked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$TMPDIR`` (``tempfile.gettempdir()``) and ``digests.SPILL_HUGE_PAGES`` (a switch of the cold-start benchmark):
    the folder is made there, the mapping asks for huge pages, and the session still runs the hashed bytes."""
    import mmap
    import tempfile

    where = tmp_path / "spill"
    where.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(where))  # what $TMPDIR sets, read once per process
    monkeypatch.setattr(digests, "SPILL_HUGE_PAGES", True)
    monkeypatch.setattr(digests, "HUGE_PAGE_MIN_BYTES", 1)
    advised: list[tuple[bool, int]] = []  # (a mapping of a file, the advice)
    real = mmap.mmap.madvise

    class Mapping(mmap.mmap):
        def __new__(cls, fileno: int, *args: Any, **kwargs: Any) -> Mapping:
            mapping = super().__new__(cls, fileno, *args, **kwargs)
            mapping.of_file = fileno != -1
            return mapping

        def madvise(self, option: int, *args: Any) -> None:
            advised.append((self.of_file, option))
            real(self, option, *args)

    monkeypatch.setattr(digests.mmap, "mmap", Mapping)
    seen = _loads_alike(chunked, expected, monkeypatch)
    [model] = seen.spilled()
    assert model.parent.parent == where and not model.parent.exists()
    assert (True, mmap.MADV_HUGEPAGE) in advised  # the private file's mapping


def test_a_data_file_altered_after_it_was_read_is_not_what_runs(expected: np.ndarray, chunked: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The UNet's external data is flipped in the artifact right before ONNX Runtime opens the private copy: the
    session runs the hashed bytes."""
    data = chunked / "unet" / "model.onnx.data"

    def tamper(model: Any) -> None:
        if isinstance(model, str):
            raw = data.read_bytes()
            data.write_bytes(bytes(b ^ 0xFF for b in raw[:4096]) + raw[4096:])

    seen = _loads_alike(chunked, expected, monkeypatch, before=tamper)
    assert seen.spilled()


def test_without_room_for_the_private_copy_the_weights_load_from_memory(expected: np.ndarray, chunked: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusion_trt.artifact import reader as reader_module

    monkeypatch.setattr(reader_module.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 0))
    seen = _loads_alike(chunked, expected, monkeypatch)
    assert seen.from_memory()


def test_no_writable_temporary_folder_or_a_full_one_loads_the_weights_from_memory(
        expected: np.ndarray, chunked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))  # TemporaryDirectory fails: OSError
    seen = _loads_alike(chunked, expected, monkeypatch)
    assert seen.from_memory()

    spills = tmp_path / "spills"
    spills.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spills))

    def full(path: Any, size: int) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(digests, "spill_buffer", full)
    seen = _loads_alike(chunked, expected, monkeypatch)
    assert not seen.spilled() and list(spills.iterdir()) == []  # the half-written model file went with the folder


def test_a_private_folder_that_goes_away_while_the_weights_are_written_loads_them_from_memory(
        expected: np.ndarray, chunked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A temporary-file cleaner removes the folder between the model file and its external data: no
    FileNotFoundError, the weights load from memory."""
    real = digests.spill_buffer

    def cleaned(path: Any, size: int) -> Any:
        shutil.rmtree(Path(path).parent)
        return real(path, size)

    monkeypatch.setattr(digests, "spill_buffer", cleaned)
    seen = _loads_alike(chunked, expected, monkeypatch)
    assert seen.from_memory()


def test_a_temporary_folder_whose_name_is_not_utf8_loads_the_weights_from_memory(
        expected: np.ndarray, chunked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ONNX Runtime takes a path only as UTF-8 text: a ``$TMPDIR`` of other bytes must not fail the load (exit 3,
    "could not load") of a sound artifact."""
    import os
    import tempfile

    latin1 = os.fsdecode(os.fsencode(tmp_path) + b"/caf\xe9")
    os.mkdir(latin1)
    monkeypatch.setattr(tempfile, "tempdir", latin1)
    seen = _loads_alike(chunked, expected, monkeypatch)
    assert not seen.spilled() and os.listdir(latin1) == []


def test_a_temporary_folder_where_others_may_rename_entries_loads_the_weights_from_memory(
        expected: np.ndarray, chunked: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A world-writable ``$TMPDIR`` without the sticky bit: another user could swap our private folder for theirs
    between the reader's writes and ONNX Runtime's open; with the sticky bit (``/tmp``) the folder is used."""
    import tempfile

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    seen = _loads_alike(chunked, expected, monkeypatch)
    assert not seen.spilled() and list(shared.iterdir()) == []
    shared.chmod(0o1777)
    seen = _loads_alike(chunked, expected, monkeypatch)
    assert seen.spilled()


def test_a_temporary_folder_inside_the_artifact_gets_no_copy_of_its_weights(
        expected: np.ndarray, chunked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$TMPDIR`` in the sealed artifact: the weights load from memory; no file is written into the folder (only
    OrtEngine's empty private folders come and go)."""
    import os
    import tempfile

    def files() -> set[Path]:  # os.walk: the other engines' empty folders come and go meanwhile
        return {Path(top) / name for top, _, names in os.walk(chunked) for name in names}

    listed = files()
    written: list[Path] = []

    def look(model: Any) -> None:
        written.extend(files() - listed)

    monkeypatch.setattr(tempfile, "tempdir", str(chunked))
    seen = _loads_alike(chunked, expected, monkeypatch, before=look)
    assert not seen.spilled() and written == []
    assert not list(chunked.rglob("diffusion-trt-weights-*"))  # the empty folders OrtEngine made are gone too


@pytest.mark.parametrize("room", [True, False])
def test_two_spellings_of_one_data_file_load_from_a_private_folder_and_from_memory(
        expected: np.ndarray, chunked: Path, monkeypatch: pytest.MonkeyPatch, room: bool) -> None:
    """Tensors naming one file as ``model.onnx.data`` and ``./model.onnx.data``: ONNX Runtime normalises in-memory
    file names and refuses a second entry for one, so the memory route (no room for a private copy) must hand each
    file over once, like the folder route writes it once."""
    from diffusion_trt.artifact import reader as reader_module

    path = chunked / "unet" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    next(e for e in tensor.external_data if e.key == "location").value = "./model.onnx.data"
    path.write_bytes(model.SerializeToString())
    manifest = json.loads((chunked / "manifest.json").read_text())
    manifest["files"]["unet/model.onnx"] = artifacts.file_entry(chunked, "unet/model.onnx")
    artifacts.write_manifest(chunked, manifest)
    with ArtifactReader.open(chunked) as reader:
        data = reader.onnx("unet/model.onnx")
        assert set(data.external) == {"model.onnx.data", "./model.onnx.data"}
        assert data.external["model.onnx.data"] is data.external["./model.onnx.data"]  # read once
    if not room:
        monkeypatch.setattr(reader_module.shutil, "disk_usage",
                            lambda p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 0))
    seen = _loads_alike(chunked, expected, monkeypatch)
    assert bool(seen.spilled()) == room


def test_a_model_file_named_like_onnx_runtimes_own_format_loads_from_the_private_folder(
        expected: np.ndarray, chunked: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest may name the ONNX file ``unet/model.ort``: opened by that name, ONNX Runtime would take it for
    its ORT format ("ORT model verification failed") where the same bytes load from memory."""
    (chunked / "unet" / "model.onnx").rename(chunked / "unet" / "model.ort")
    manifest = json.loads((chunked / "manifest.json").read_text())
    manifest["files"]["unet/model.ort"] = manifest["files"].pop("unet/model.onnx")
    manifest["components"]["unet"]["files"] = ["unet/model.ort", "unet/model.onnx.data"]
    manifest["components"]["unet"]["onnx"] = "unet/model.ort"
    artifacts.write_manifest(chunked, manifest)
    seen = _loads_alike(chunked, expected, monkeypatch)
    assert [m.name for m in seen.spilled()] == ["model.ort"]


def test_spill_buffer_reserves_the_file_and_maps_it(tmp_path: Path) -> None:
    buf = digests.spill_buffer(tmp_path / "w.bin", 3 * MiB)
    assert buf is not None
    buf[:4] = b"abcd"
    buf.flush()
    assert (tmp_path / "w.bin").read_bytes()[:4] == b"abcd" and (tmp_path / "w.bin").stat().st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        digests.spill_buffer(tmp_path / "w.bin", 1)
    assert digests.spill_buffer(tmp_path / "empty.bin", 0) is None and (tmp_path / "empty.bin").stat().st_size == 0


def test_a_byte_flipped_in_one_chunk_is_refused_before_anything_runs(chunked: Path) -> None:
    path = chunked / "unet" / "model.onnx.data"
    raw = bytearray(path.read_bytes())
    raw[MiB + 5] ^= 0xFF  # chunk 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ArtifactError, match=r"model.onnx.data: sha256 of chunk 1 .* the file was altered"):
        EnginePipeline.from_artifacts(chunked, device="cpu")
    result = CliRunner().invoke(main, ["run", str(chunked), "--prompt", "x", "--steps", "1", "-o",
                                       str(chunked.parent / "o.png")])
    assert result.exit_code == 3
    assert result.output.count("error:") == 1 and "sha256 of chunk 1" in result.output
    assert not (chunked.parent / "o.png").exists()


def test_a_chunk_list_that_does_not_cover_the_file_is_an_invalid_manifest(chunked: Path) -> None:
    manifest = json.loads((chunked / "manifest.json").read_text())
    manifest["files"]["unet/model.onnx.data"]["chunks"]["sha256"].pop()  # the last bytes would go unhashed
    artifacts.write_manifest(chunked, manifest)
    with pytest.raises(ArtifactError, match=r"files\['unet/model.onnx.data'\] lists \d+ chunk digest"):
        ArtifactReader.open(chunked)
    assert CliRunner().invoke(main, ["verify", str(chunked)]).exit_code == 3


class _Opens:
    """An engine stand-in that records enters/exits (and fails to open when told)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.depth = fail, 0

    def __enter__(self) -> _Opens:
        if self.fail:
            raise ArtifactError("altered")
        self.depth += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        self.depth -= 1


def test_open_together_closes_what_opened_when_one_engine_fails() -> None:
    good, bad = _Opens(), _Opens(fail=True)
    with pytest.raises(ArtifactError, match="altered"), OpenTogether({"a": good, "b": bad}, warm=False) as opening:
        opening.wait()
    assert good.depth == 0


def test_open_together_hands_over_engines_the_caller_entered() -> None:
    engines = {"a": _Opens(), "b": _Opens()}
    with OpenTogether(engines, warm=False) as opening:
        opening.wait()
        for e in engines.values():
            e.__enter__()  # as EnginePipeline.__init__ does
    assert [e.depth for e in engines.values()] == [1, 1]


class _Warms(_Opens):
    """An engine stand-in on "cuda" with a static spec: records the threads of its warm-up and its capture."""

    device = torch.device("cuda")
    spec = SimpleNamespace(is_static=True)

    def __init__(self, fail: bool = False, graph: bool = True) -> None:
        super().__init__(fail)
        self.graph, self.primed_on, self.captured_on, self.primes = graph, None, [], []

    @property
    def cuda_graph(self) -> bool:
        return self.graph

    def prime(self) -> bool:
        if self.primed_on is None:
            self.primed_on = threading.get_ident()  # the first prime's thread
        self.primes.append(threading.get_ident())
        return True

    def capture(self) -> bool:
        self.captured_on.append(threading.get_ident())
        return self.graph


def test_open_together_captures_each_warmed_engine_on_the_callers_thread() -> None:
    engines = {"unet": _Warms(), "vae_decoder": _Warms(graph=False)}
    with OpenTogether(engines, warm=True, caller_warm={"vae_decoder"}) as opening:
        opening.wait(capture=True)
    me = threading.get_ident()
    assert engines["unet"].captured_on == [me]  # once, on the thread that will call
    assert all(e.primed_on not in (None, me) for e in engines.values())  # the warm-ups ran on the loader threads
    assert "captured_s" in opening.timeline["unet"]
    # not in CUDA-graph mode: nothing captured; one of caller_warm, so run once more on the caller's thread instead
    # (its per-thread first run, out of the first call)
    vae = engines["vae_decoder"]
    assert vae.captured_on == [] and vae.primes[1:] == [me] and vae.primes[0] != me
    assert "captured_s" not in opening.timeline["vae_decoder"] and "caller_warmed_s" in opening.timeline["vae_decoder"]
    plain = {"vae_decoder": _Warms(graph=False)}  # not one of caller_warm (e.g. cuda_graph=False): loader thread only
    with OpenTogether(plain, warm=True) as opening:
        opening.wait(capture=True)
    assert plain["vae_decoder"].primes == [plain["vae_decoder"].primed_on] != [me]
    assert "caller_warmed_s" not in opening.timeline["vae_decoder"]


def test_the_callers_capture_makes_the_unets_first_run_and_the_others_are_primed_on_their_threads() -> None:
    """CALLER_FIRST_RUN: the UNet in CUDA-graph mode is not primed on its loader thread (its first run on the thread
    that replays is the one that counts); an engine of that name without a graph, and every other one, is primed."""
    from diffusion_trt.runtime.loading import CALLER_FIRST_RUN

    engines = {"unet": _Warms(), "text_encoder": _Warms()}
    with OpenTogether(engines, warm=True, caller_first_run=CALLER_FIRST_RUN) as opening:
        opening.wait(capture=True)
    me = threading.get_ident()
    assert engines["unet"].primed_on is None and engines["unet"].captured_on == [me]
    assert engines["text_encoder"].primed_on not in (None, me) and engines["text_encoder"].captured_on == [me]
    assert "warmed_s" not in opening.timeline["unet"] and "captured_s" in opening.timeline["unet"]
    eager = {"unet": _Warms(graph=False)}
    with OpenTogether(eager, warm=True, caller_first_run=CALLER_FIRST_RUN) as opening:
        opening.wait(capture=True)
    assert eager["unet"].primed_on not in (None, me)  # nothing to capture: warmed where it loaded, as before


class _Removes(_Warms):
    """A stand-in whose private folder's removal ends only once its capture has begun (as ``OrtEngine``'s removal
    thread, slower than the capture's start)."""

    def __init__(self) -> None:
        super().__init__()
        self.capture_began, self.removal_waited_on = threading.Event(), []
        self.open_parts: dict[str, float] = {}

    def capture(self) -> bool:
        self.capture_began.set()
        return super().capture()

    def wait_removal(self) -> None:
        assert self.capture_began.wait(5), "the removal was waited for before the caller's first run"
        self.removal_waited_on.append(threading.get_ident())
        self.open_parts["cleanup_s"] = 0.25


def test_the_callers_first_run_does_not_wait_for_the_private_folders_removal() -> None:
    """The UNet's folder (1.7 GB of pages to free: 0.11-0.14 s on the H100) is removed during the caller's first run
    and capture, not between its session and them; ``wait`` still returns with it gone, its time in the timeline."""
    from diffusion_trt.runtime.loading import CALLER_FIRST_RUN

    engines = {"unet": _Removes()}
    with OpenTogether(engines, warm=True, caller_first_run=CALLER_FIRST_RUN) as opening:
        opening.wait(capture=True)
    unet = engines["unet"]
    assert unet.captured_on == [threading.get_ident()] and unet.removal_waited_on == [threading.get_ident()]
    assert opening.timeline["unet"]["cleanup_s"] == 0.25


def test_open_together_captures_nothing_unless_asked_and_closes_all_after_a_failure() -> None:
    engines = {"a": _Warms()}
    with OpenTogether(engines, warm=True) as opening:
        opening.wait()
    assert engines["a"].captured_on == []
    good, bad = _Warms(), _Warms(fail=True)
    with pytest.raises(ArtifactError, match="altered"), OpenTogether({"a": bad, "b": good}, warm=True) as opening:
        opening.wait(capture=True)
    assert good.depth == 0


def test_exposure_groups_bound_bytes_as_well_as_count() -> None:
    sizes = {"a": 600, "b": 600, "c": 600, "d": 5000, "e": None}
    assert _ort.exposure_groups(list(sizes), sizes, budget=1600, most=10) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert _ort.exposure_groups(list(sizes), sizes, budget=10**9, most=2) == [["a", "b"], ["c", "d"], ["e"]]


def test_float_tensor_sizes_come_from_inferred_shapes() -> None:
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Cast", ["y"], ["z"], to=10)],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT16, [2, 3])])
    found = _ort._float_tensors(helper.make_model(graph))
    assert found == {"y": (TensorProto.FLOAT, 24), "z": (TensorProto.FLOAT16, 12)}


def test_graph_optimization_level_is_checked_before_loading(tiny_artifact: Path) -> None:
    with pytest.raises(RuntimeInputError, match="graph_optimization_level='fast' is unknown; use one of disable, "
                                                 "basic, extended, all"):
        EnginePipeline.from_artifacts(tiny_artifact, device="cpu", graph_optimization_level="fast")


def test_run_defaults_to_heuristic_and_bench_to_auto() -> None:
    assert ALGO_SEARCH_DEFAULT == {"run": "HEURISTIC", "bench": "AUTO"}
    run_help = CliRunner().invoke(main, ["run", "--help"], terminal_width=200).output
    bench_help = CliRunner().invoke(main, ["bench", "--help"], terminal_width=200).output
    assert "[default: HEURISTIC]" in " ".join(run_help.split())
    assert "[default: AUTO]" in " ".join(bench_help.split())


def test_start_imports_imports_on_a_thread_of_its_own_and_skips_what_is_imported(monkeypatch: pytest.MonkeyPatch
                                                                                  ) -> None:
    import types

    from diffusion_trt.runtime import loading

    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(loading.importlib, "import_module", lambda name: seen.append((name, threading.get_ident())))
    monkeypatch.setitem(sys.modules, "dtrt_already_here", types.ModuleType("dtrt_already_here"))
    thread = loading.start_imports({"zz_not_here", "aa_not_here", "dtrt_already_here"})
    assert thread is not None
    thread.join()
    assert [name for name, _ in seen] == ["aa_not_here", "zz_not_here"]  # sorted, the imported one left out
    assert {tid for _, tid in seen} == {thread.ident} != {threading.get_ident()}
    assert loading.start_imports({"dtrt_already_here"}) is None


def test_start_imports_leaves_a_failing_import_to_its_user() -> None:
    from diffusion_trt.runtime import loading

    thread = loading.start_imports({"dtrt_no_such_module_anywhere"})
    assert thread is not None
    thread.join()  # no exception escapes the thread; the module simply is not there
    assert "dtrt_no_such_module_anywhere" not in sys.modules


def test_wants_graph_by_option() -> None:
    from diffusion_trt.runtime.loading import EAGER_COMPONENTS, wants_graph

    assert wants_graph("unet", None) and not wants_graph("text_encoder", None)
    assert {"text_encoder", "vae_decoder"} <= EAGER_COMPONENTS and "unet" not in EAGER_COMPONENTS
    assert wants_graph("text_encoder", True) and not wants_graph("unet", False)


def test_cuda_graphs_by_default_for_the_per_step_engines_only_and_for_all_when_asked(tiny_artifact: Path) -> None:
    """loading.EAGER_COMPONENTS: cuda_graph=None asks a CUDA graph of the UNet only (the text encoder and VAE run
    once per image); cuda_graph=True of every engine. The engines are built, not opened (no GPU here)."""
    from diffusion_trt.artifact.reader import ArtifactReader
    from diffusion_trt.runtime import pipeline
    from diffusion_trt.runtime.geometry import LatentGeometry

    reader = ArtifactReader.open(tiny_artifact)
    try:
        derived = LatentGeometry.from_manifest(reader.manifest).derived_dims
        asked = {}
        for option in (None, True):
            engines = pipeline._ort_engines(reader, "cuda", pipeline.LoadOptions(device="cuda", cuda_graph=option),
                                            None, derived, True, None, {})
            asked[option] = {name for name, e in engines.items() if e._graph_requested}  # type: ignore[attr-defined]
    finally:
        reader.close()
    assert asked[None] == {"unet"}
    assert asked[True] == set(engines) >= {"text_encoder", "unet", "vae_decoder"}


def test_the_loops_kernels_warm_up_at_the_artifacts_shapes(tiny_artifact: Path) -> None:
    """``denoise.warm_loop_kernels`` (``loading.WARM_LOOP``, run on CUDA by ``from_artifacts`` while the engines open)
    runs at the static specs' shapes and dtypes (here on the CPU, where it only costs time); a dynamic spec: no run."""
    from diffusion_trt.runtime.denoise import warm_loop_kernels
    from diffusion_trt.runtime.engines.engine import EngineSpec
    from diffusion_trt.runtime.geometry import LatentGeometry

    with ArtifactReader.open(tiny_artifact) as reader:
        derived = LatentGeometry.from_manifest(reader.manifest).derived_dims
        dynamic_unet, dynamic_vae = (EngineSpec.from_manifest(n, reader.manifest.components[n].spec, derived)
                                     for n in ("unet", "vae_decoder"))

    def static(spec: EngineSpec) -> EngineSpec:  # the profile's min shapes only, as a static artifact has
        pin = functools.partial(map, lambda t: dataclasses.replace(t, max=t.min))
        return dataclasses.replace(spec, inputs=tuple(pin(spec.inputs)), outputs=tuple(pin(spec.outputs)))

    unet, vae = static(dynamic_unet), static(dynamic_vae)
    assert unet.is_static and vae.is_static and not dynamic_unet.is_static
    assert warm_loop_kernels(unet, vae, torch.device("cpu"), 0.18215)
    assert warm_loop_kernels(unet, None, torch.device("cpu"), 0.18215)
    assert not warm_loop_kernels(dynamic_unet, vae, torch.device("cpu"), 0.18215)
    assert not warm_loop_kernels(unet, dynamic_vae, torch.device("cpu"), 0.18215)

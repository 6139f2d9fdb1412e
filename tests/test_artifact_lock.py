"""Writers of one artifact folder never interleave, and a killed compile leaves the previous artifact intact.

Every subprocess here is bounded (a timeout on each wait) and killed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.verify import verify_artifact
from diffusion_trt.errors import ArtifactError

HOLD = """
import sys, time
from diffusion_trt.artifact import folder as artifacts
with artifacts.artifact_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


@contextmanager
def _holder(final: Path, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """A separate process holding ``final``'s lock for ``seconds`` (killed on exit)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(final), str(seconds)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_second_writer_fails_at_once_naming_the_holder(tmp_path: Path) -> None:
    final = tmp_path / "art"
    with _holder(final, 30) as proc, pytest.raises(ArtifactError) as err:
        with artifacts.staging_dir(final):
            pytest.fail("entered while another process holds the lock")
    message = str(err.value)
    assert f"another compile (pid {proc.pid} on " in message
    assert f"is writing {final} now; wait for it to finish" in message and "--lock-timeout SECONDS" in message
    assert not final.exists() and not list(tmp_path.glob(".art.staging-*"))


def test_second_writer_waits_up_to_the_timeout(tmp_path: Path) -> None:
    final = tmp_path / "art"
    with _holder(final, 30), pytest.raises(ArtifactError, match=r"is writing .* after waiting 0\.5 s"):
        with artifacts.staging_dir(final, lock_timeout=0.5):
            pass
    with _holder(final, 1.5):
        start = time.monotonic()
        with artifacts.staging_dir(final, lock_timeout=60) as stage:
            waited = time.monotonic() - start
            (stage / "f").write_text("new")
    assert waited > 0.5
    assert (final / "f").read_text() == "new"


def test_a_killed_holder_does_not_block(tmp_path: Path) -> None:
    final = tmp_path / "art"
    with _holder(final, 300) as proc:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert artifacts.lock_path(final).exists()  # the file stays; the kernel dropped the lock with the process
    with artifacts.staging_dir(final) as stage:
        (stage / "f").write_text("x")
    assert (final / "f").is_file()


def test_two_compiles_do_not_interleave_and_a_killed_one_leaves_the_old_artifact(
    tiny_pipeline_dir: Path, tiny_artifact: Path, tmp_path: Path
) -> None:
    from diffusion_trt.compiler.pipeline import compile_pipeline

    out = tmp_path / "art"
    shutil.copytree(tiny_artifact, out)
    before = json.loads((out / "manifest.json").read_text())["manifest_sha256"]
    exe = Path(sys.executable).parent / "diffusion-trt"
    cmd = [str(exe), "compile", str(tiny_pipeline_dir), "-o", str(out), "--overwrite"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        staged: list[Path] = []
        while time.monotonic() < deadline and proc.poll() is None:
            staged = [p for p in tmp_path.glob(".art.staging-*") if (p / "tokenizer").is_dir()]
            if staged:
                break
            time.sleep(0.05)
        assert staged, "the compile never reached its staging folder"
        # a second compile into the same folder is refused while the first runs
        with pytest.raises(ArtifactError, match=rf"another compile \(pid {proc.pid} on .*\) is writing {out}"):
            compile_pipeline(tiny_pipeline_dir, out, overwrite=True)
        os.kill(proc.pid, signal.SIGKILL)  # mid-compile
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert json.loads((out / "manifest.json").read_text())["manifest_sha256"] == before
    assert verify_artifact(out).ok
    assert list(tmp_path.glob(".art.staging-*"))  # the dead compile's leftovers ...
    with pytest.raises(RuntimeError, match="abort"), artifacts.staging_dir(out, overwrite=True):
        raise RuntimeError("abort")
    assert not list(tmp_path.glob(".art.staging-*"))  # ... are cleaned by the next writer, under the lock
    assert verify_artifact(out).ok


def test_an_interrupted_swap_is_undone_by_the_next_writer(tmp_path: Path) -> None:
    """A writer killed between the two renames of the fallback swap left only ``.art.old-PID``."""
    final = tmp_path / "art"
    old = tmp_path / ".art.old-12345"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    with pytest.raises(ArtifactError, match="already exists; pass --overwrite"), artifacts.staging_dir(final):
        pass
    assert (final / "manifest.json").is_file() and not old.exists()


def test_overwrite_swaps_in_one_step(tmp_path: Path) -> None:
    final = tmp_path / "art"
    final.mkdir()
    (final / "v").write_text("1")
    (final / artifacts.MANIFEST_NAME).write_text("{}")  # an artifact: --overwrite replaces only those
    with artifacts.staging_dir(final, overwrite=True) as stage:
        (stage / "v").write_text("2")
    assert (final / "v").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # the lock file goes with the lock


def test_leftovers_of_a_similarly_named_artifact_are_not_touched(tmp_path: Path) -> None:
    other = tmp_path / ".art.v2.staging-abc123"  # a running compile of artifact "art.v2" (its own lock)
    other.mkdir()
    with artifacts.staging_dir(tmp_path / "art") as stage:
        (stage / "f").write_text("x")
    assert other.is_dir()


HOLD_INTERRUPTIBLE = """
import signal, sys, time
from diffusion_trt.artifact import folder as artifacts
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if the parent ignores SIGINT
with artifacts.artifact_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(300)
"""


def test_ctrl_c_while_holding_removes_the_lock_file(tmp_path: Path) -> None:
    final = tmp_path / "art"
    proc = subprocess.Popen([sys.executable, "-c", HOLD_INTERRUPTIBLE, str(final)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        assert json.loads(artifacts.lock_path(final).read_text())["pid"] == proc.pid
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert "KeyboardInterrupt" in err
    assert not artifacts.lock_path(final).exists()
    assert list(tmp_path.iterdir()) == []


def test_released_lock_leaves_no_file_after_success_or_error(tmp_path: Path) -> None:
    final = tmp_path / "art"
    with artifacts.artifact_lock(final) as path:
        assert path.is_file()
    assert not path.exists()
    with pytest.raises(KeyboardInterrupt), artifacts.artifact_lock(final):
        raise KeyboardInterrupt
    assert not path.exists()


@pytest.mark.parametrize("content", ["", '{"pid": 999999999, "host": "elsewhere", "since_utc": "2020-01-01"}\n'])
def test_a_stale_lock_file_of_a_dead_writer_does_not_block(tmp_path: Path, content: str) -> None:
    """An empty file (killed between create and write) or one naming a dead pid: nobody holds its flock."""
    final = tmp_path / "art"
    artifacts.lock_path(final).write_text(content)
    with artifacts.staging_dir(final) as stage:
        assert json.loads(artifacts.lock_path(final).read_text())["pid"] == os.getpid()
        (stage / "f").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_waiter_locks_the_new_file_after_the_holder_deleted_its_own(tmp_path: Path) -> None:
    """The waiter opened the holder's file; the holder deletes it on release, so the waiter must reopen the path
    (else a third writer creating a new file would hold a lock at the same time)."""
    final = tmp_path / "art"
    with _holder(final, 1.0):
        with artifacts.artifact_lock(final, timeout=60) as path:
            assert json.loads(path.read_text())["pid"] == os.getpid()
            with pytest.raises(ArtifactError, match="another compile"), artifacts.artifact_lock(final):
                pass
    assert not artifacts.lock_path(final).exists()

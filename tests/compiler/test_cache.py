"""The compile cache: an identical recompile is a hit, a changed weight or option a miss, damaged entries are never
served, LRU eviction under the size bound, the cache folder's resolution, and verify --source."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.verify import verify_artifact
from diffusion_trt.cli import main
from diffusion_trt.compiler.cache import CompileCache, cache_key, default_cache_dir
from diffusion_trt.compiler.frontend import compile_model
from diffusion_trt.config import CompileConfig

#: No VAE encoder: a little faster, and every cache path is the same as for the whole pipeline.
FAST = CompileConfig(components=("text_encoder", "unet", "vae_decoder"))


def _invoke(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def _change_a_weight(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = next((folder / "text_encoder").glob("*.safetensors"))
    state = load_file(path)
    key = sorted(k for k in state if k.endswith("final_layer_norm.weight"))[0]
    state[key] = state[key] + 1e-3
    save_file(state, str(path), metadata={"format": "pt"})


def test_identical_recompile_is_a_hit_and_a_changed_weight_a_miss(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_pipeline_dir, model)
    cache = CompileCache(tmp_path / "cache")
    t0 = time.perf_counter()
    first = compile_model(model, tmp_path / "a", FAST, cache=cache)
    t1 = time.perf_counter()
    second = compile_model(model, tmp_path / "b", FAST, cache=cache)
    t2 = time.perf_counter()
    m1, m2 = artifacts.read_manifest(first), artifacts.read_manifest(second)
    assert m1["cache"] == {"hit": False, "key": m2["cache"]["key"]}
    assert m2["cache"]["hit"] is True and m2["cache"]["reused"] == ["text_encoder", "unet", "vae_decoder"]
    assert m2["name"] == "b" and m2["files"] == m1["files"]
    assert verify_artifact(second, check_host=False).ok
    assert t2 - t1 < (t1 - t0) / 2, (t1 - t0, t2 - t1)

    _change_a_weight(model)
    changed = artifacts.read_manifest(compile_model(model, tmp_path / "c", FAST, cache=cache))
    assert changed["cache"]["hit"] is False and len(cache.entries()) == 2

    # an entry altered on disk is discarded, never served
    key = m1["cache"]["key"]
    onnx = tmp_path / "cache" / "entries" / key / "artifact" / "text_encoder" / "model.onnx"
    data = bytearray(onnx.read_bytes())
    data[-1] ^= 0xFF
    onnx.unlink()  # a new inode (the artifact "a" has its own copy anyway: see test_cache_files_share_no_inode...)
    onnx.write_bytes(bytes(data))
    assert cache.lookup(key) is None and not (tmp_path / "cache" / "entries" / key).exists()
    assert verify_artifact(first, check_host=False).ok


def test_changed_option_is_another_key(tiny_pipeline_dir: Path) -> None:
    source = {"kind": "folder", "sha256": artifacts.folder_hash(tiny_pipeline_dir)}
    key, facts = cache_key(source, FAST)
    assert cache_key(source, FAST)[0] == key  # deterministic
    assert {"source", "config", "loras", "tools", "code", "target"} <= set(facts)
    for changed in ({"opset": 18}, {"pass_options": {"pack_qkv": True}}, {"batch_size": 2}, {"height": 128}):
        assert cache_key(source, CompileConfig(components=FAST.components, **changed))[0] != key, changed


def _fake_artifact(root: Path, size: int) -> Path:
    root.mkdir(parents=True)
    (root / "blob").write_bytes(b"x" * size)
    return root


def test_lru_eviction_under_the_size_bound(tmp_path: Path, tiny_artifact: Path) -> None:
    size = sum(p.stat().st_size for p in tiny_artifact.rglob("*") if p.is_file())
    cache = CompileCache(tmp_path / "cache", max_bytes=int(2.5 * size))  # room for two entries (each an artifact)
    for i, key in enumerate(("k1", "k2")):
        cache.store(key, {}, tiny_artifact)
        os.utime(tmp_path / "cache" / "entries" / key / "key.json", (1000 + i, 1000 + i))
    os.utime(tmp_path / "cache" / "entries" / "k1" / "key.json", (2000, 2000))  # k1 used last: k2 goes first
    cache.store("k3", {}, tiny_artifact)
    assert sorted(e.name for _, _, e in cache.entries()) == ["k1", "k3"]
    assert cache.store("huge", {}, _fake_artifact(tmp_path / "huge", 5 * size)) is None  # larger than the bound


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DIFFUSION_TRT_CACHE", str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    monkeypatch.delenv("DIFFUSION_TRT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "diffusion-trt" / "compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == Path.home() / ".cache" / "diffusion-trt" / "compile"


def test_cli_second_compile_comes_from_the_cache(tiny_pipeline_dir: Path, tiny_artifact: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusion_trt.compiler.pipeline as pipeline

    calls = []

    def fake_compile(model_dir: Path, out_dir: Path, config: CompileConfig, **kwargs: object) -> Path:
        calls.append(out_dir)  # fast: the session's tiny artifact stands in for a compile of the same folder
        shutil.copytree(tiny_artifact, out_dir)
        return out_dir

    monkeypatch.setattr(pipeline, "compile_pipeline", fake_compile)
    args = ("compile", tiny_pipeline_dir, "--cache-dir", tmp_path / "cache")
    code, out = _invoke(*args, "-o", tmp_path / "a")
    assert code == 0 and len(calls) == 1, out
    code, out = _invoke(*args, "-o", tmp_path / "b")
    assert code == 0 and "compile cache hit" in out and len(calls) == 1
    assert artifacts.read_manifest(tmp_path / "b")["cache"]["hit"] is True
    code, out = _invoke(*args, "-o", tmp_path / "c", "--no-cache")
    assert code == 0 and len(calls) == 2 and "cache" not in artifacts.read_manifest(tmp_path / "c")


def test_a_cache_hit_repeats_the_warnings_of_settings_cut_back(tiny_pipeline_dir: Path, tiny_artifact: Path,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-clip-skip 5 on a 2-layer text encoder builds clip skip 1 with a warning; the identical recompile, a hit,
    built the same without a word (and so --fp16-safe-vae's "no effect")."""
    import diffusion_trt.compiler.pipeline as pipeline

    monkeypatch.setattr(pipeline, "compile_pipeline", lambda model, out, *a, **k: shutil.copytree(tiny_artifact, out))
    args = ("compile", tiny_pipeline_dir, "--cache-dir", tmp_path / "cache", "--max-clip-skip", "5",
            "--fp16-safe-vae")
    assert _invoke(*args, "-o", tmp_path / "a")[0] == 0
    code, out = _invoke(*args, "-o", tmp_path / "b")
    assert code == 0 and "compile cache hit" in out, out
    assert "warning: --max-clip-skip 5: the text encoder has 2 layers; clip skip goes up to 1" in out
    assert "warning: --fp16-safe-vae: no effect on an SD 1.x/2.x model" in out
    code, out = _invoke("compile", tiny_pipeline_dir, "--cache-dir", tmp_path / "cache", "-o", tmp_path / "c")
    assert code == 0 and "warning:" not in out, out  # the defaults cut back say nothing, hit or miss


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cache-max-gb", "0"], "Invalid value for '--cache-max-gb': 0.0 is not in the range x>0"),
        (["--cache-max-gb", "lots"], "'lots' is not a valid float"),
        (["--prediction-type", "x0"], "'x0' is not one of 'auto', 'epsilon', 'v_prediction'"),
    ],
)
def test_cli_bad_cache_and_prediction_options(tiny_pipeline_dir: Path, tmp_path: Path, args: list[str],
                                              message: str) -> None:
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "a", *args)
    assert code == 2 and message in out, out


def test_cli_cache_dir_that_is_a_file(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / "a", "--cache-dir", blocker)
    assert code == 2 and "--cache-dir" in out and f"cannot create the folder {blocker}" in out
    assert "choose another path" in out and not (tmp_path / "a").exists()


def test_cli_no_cache_warns_about_cache_options(tiny_pipeline_dir: Path, tiny_artifact: Path) -> None:
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tiny_artifact, "--no-cache", "--cache-max-gb", "3")
    assert code == 2 and "warning: --cache-max-gb: no effect with --no-cache" in out


def test_prediction_type_on_a_folder_warns(tiny_pipeline_dir: Path, tiny_artifact: Path) -> None:
    code, out = _invoke("compile", tiny_pipeline_dir, "-o", tiny_artifact, "--prediction-type", "epsilon")
    assert code == 2 and "warning: --prediction-type epsilon: no effect on a diffusers folder" in out


def test_verify_source(tiny_pipeline_dir: Path, tiny_artifact: Path, tmp_path: Path) -> None:
    code, out = _invoke("verify", tiny_artifact, "--no-host", "--source", tiny_pipeline_dir)
    assert code == 0 and f"the weights of {tiny_pipeline_dir} were compiled" in out, out
    changed = tmp_path / "model"
    shutil.copytree(tiny_pipeline_dir, changed)
    _change_a_weight(changed)
    code, out = _invoke("verify", tiny_artifact, "--no-host", "--source", changed)
    assert code == 3 and f"--source {changed}: its weights differ from the ones compiled" in out
    code, out = _invoke("verify", tiny_artifact, "--source", tmp_path / "nowhere")
    assert code == 2 and "nowhere" in out and "does not exist" in out
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    assert manifest["source"]["sha256"] == artifacts.folder_hash(tiny_pipeline_dir)


def test_a_folder_is_hashed_once_per_compile(tiny_pipeline_dir: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """compile_model hashes the source folder for the cache key and hands that hash to compile_pipeline: the
    manifest's source.sha256 is the folder's hash, read once."""
    calls: list[Path] = []
    real = artifacts.folder_hash

    def counting(root: str | os.PathLike[str]) -> str:
        calls.append(Path(root))
        return real(root)

    monkeypatch.setattr(artifacts, "folder_hash", counting)
    out = compile_model(tiny_pipeline_dir, tmp_path / "a", FAST, cache=CompileCache(tmp_path / "cache"))
    assert calls == [tiny_pipeline_dir]
    assert artifacts.read_manifest(out)["source"]["sha256"] == real(tiny_pipeline_dir)


# -- issue 24: a cache that cannot be poisoned (item 2), a full disk (item 7), the damaged entry's reason (item 14) --


@pytest.fixture
def fake_compile(tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """compile_pipeline replaced by a copy of the session's tiny artifact (fast); the list holds each call's output."""
    import diffusion_trt.compiler.pipeline as pipeline

    calls: list[Path] = []

    def fake(model_dir: Path, out_dir: Path, config: CompileConfig, **kwargs: object) -> Path:
        calls.append(out_dir)
        shutil.copytree(tiny_artifact, out_dir)
        return out_dir

    monkeypatch.setattr(pipeline, "compile_pipeline", fake)
    return calls


def _only_entry(cache_root: Path) -> Path:
    (entry,) = [p for p in (cache_root / "entries").iterdir() if not p.name.startswith(".")]
    return entry


def _swap_component_and_reseal(artifact: Path, rel: str, data: bytes) -> None:
    """What an attacker with write access to the cache does: replace a file, then reseal the manifest to match."""
    (artifact / rel).unlink()
    (artifact / rel).write_bytes(data)
    manifest = artifacts.read_manifest(artifact)
    manifest["files"][rel] = artifacts.file_entry(artifact, rel)
    artifacts.write_manifest(artifact, manifest)


def test_a_resealed_cache_entry_is_a_miss_not_a_hit(tiny_pipeline_dir: Path, tmp_path: Path, fake_compile: list[Path],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    cache = CompileCache(tmp_path / "cache")
    compile_model(tiny_pipeline_dir, tmp_path / "a", FAST, cache=cache)
    entry = _only_entry(tmp_path / "cache")
    rel = "text_encoder/model.onnx"
    other = (tmp_path / "a" / "unet" / "model.onnx").read_bytes()  # another valid ONNX
    _swap_component_and_reseal(entry / "artifact", rel, other)
    assert artifacts.load_verified(entry / "artifact") is not None  # the seal and every sha256 agree again
    with caplog.at_level("WARNING"):
        out = compile_model(tiny_pipeline_dir, tmp_path / "b", FAST, cache=cache)
    assert len(fake_compile) == 2, "the poisoned entry was served as a hit"
    assert artifacts.read_manifest(out)["cache"]["hit"] is False
    assert (out / rel).read_bytes() == (tmp_path / "a" / rel).read_bytes() != other
    assert any("was not made by this user's compile" in r.getMessage() and "MAC" in r.getMessage()
               for r in caplog.records), caplog.text
    # the poisoned entry was deleted and the fresh compile stored in its place: the next one is a hit again
    compile_model(tiny_pipeline_dir, tmp_path / "c", FAST, cache=cache)
    assert len(fake_compile) == 2 and artifacts.read_manifest(tmp_path / "c")["cache"]["hit"] is True


def test_an_entry_moved_under_another_key_is_a_miss(tmp_path: Path, tiny_artifact: Path) -> None:
    cache = CompileCache(tmp_path / "cache")
    assert cache.store("k1", {}, tiny_artifact) is not None
    os.rename(tmp_path / "cache" / "entries" / "k1", tmp_path / "cache" / "entries" / "k2")
    assert cache.lookup("k2") is None and not (tmp_path / "cache" / "entries" / "k2").exists()


def test_the_mac_key_is_private_and_made_once(tmp_path: Path, tiny_artifact: Path, caplog: pytest.LogCaptureFixture,
                                              ) -> None:
    root = tmp_path / "cache"
    cache = CompileCache(root)
    cache.store("k1", {}, tiny_artifact)
    key_file = root / "secret.key"
    assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.stat().st_size == 32
    assert CompileCache(root).lookup("k1") is not None  # another process: the same key, the entry proves itself
    key_file.chmod(0o644)  # anyone could read it now, and forge entries: not trusted, the cache is not used
    with caplog.at_level("WARNING"):
        assert CompileCache(root).lookup("k1") is None
    assert "secret.key is mode 0644" in caplog.text and "remove it" in caplog.text
    assert (root / "entries" / "k1").is_dir()  # a key problem deletes no entry


def test_cache_files_share_no_inode_with_artifacts(tiny_pipeline_dir: Path, tmp_path: Path,
                                                   fake_compile: list[Path]) -> None:
    cache = CompileCache(tmp_path / "cache")
    a = compile_model(tiny_pipeline_dir, tmp_path / "a", FAST, cache=cache)
    b = compile_model(tiny_pipeline_dir, tmp_path / "b", FAST, cache=cache)
    assert len(fake_compile) == 1  # b was a hit
    entry = _only_entry(tmp_path / "cache") / "artifact"
    rel = "unet/model.onnx"
    inodes = {(p / rel).stat().st_ino for p in (a, b, entry)}
    assert len(inodes) == 3, "an artifact shares an inode with the cache (hard link)"
    with open(entry / rel, "r+b") as f:  # an in-place edit of the cached file
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    assert verify_artifact(a, check_host=False).ok and verify_artifact(b, check_host=False).ok


def test_a_damaged_entry_warning_names_the_reason(tmp_path: Path, tiny_artifact: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)  # with hard links, the edit below would reach the artifact stored
    cache = CompileCache(tmp_path / "cache")
    cache.store("k1", {}, art)
    onnx = tmp_path / "cache" / "entries" / "k1" / "artifact" / "unet" / "model.onnx"
    data = bytearray(onnx.read_bytes())
    data[-1] ^= 0xFF
    onnx.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        assert cache.lookup("k1") is None
    (line,) = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert "failed verification:" in line and "unet/model.onnx: sha256" in line and "the file was altered" in line


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir(parents=True)
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot run mount here ({e})")
    if result.returncode != 0:
        pytest.skip(f"mounting a {size} tmpfs is not permitted here: {result.stderr.strip()}")


@pytest.fixture
def small_cache_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MB file system (tmpfs) for the cache: the tiny artifact (~14 MB) does not fit."""
    where = tmp_path / "small"
    _mount_tmpfs(where, "2M")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def test_a_full_disk_under_the_cache_is_a_warning(tiny_pipeline_dir: Path, tmp_path: Path, small_cache_fs: Path,
                                                  fake_compile: list[Path]) -> None:
    cache_dir = small_cache_fs / "cache"
    (cache_dir / "entries").mkdir(parents=True)
    dead = subprocess.Popen(["true"])  # a pid that no longer runs: a killed compile's leftover
    dead.wait()
    (cache_dir / "entries" / f".{'ab' * 32}.{dead.pid}.tmp" / "artifact").mkdir(parents=True)
    for out in ("a", "b"):  # every compile: exit 0, the artifact complete, nothing left in the cache
        code, text = _invoke("compile", tiny_pipeline_dir, "-o", tmp_path / out, "--cache-dir", cache_dir)
        assert code == 0, text
        assert "warning: compile cache" in text and "the artifact was not stored" in text
        assert "ENOSPC: No space left on device" in text and f"{tmp_path / out} is complete" in text
        assert verify_artifact(tmp_path / out, check_host=False).ok
        assert not [p.name for p in (cache_dir / "entries").iterdir()], "a temporary folder was left in the cache"
    assert len(fake_compile) == 2


def test_a_killed_store_s_temporary_folder_is_removed(tmp_path: Path, tiny_artifact: Path) -> None:
    cache = CompileCache(tmp_path / "cache")
    dead = subprocess.Popen(["true"])
    dead.wait()
    leftover = tmp_path / "cache" / "entries" / f".k0.{dead.pid}.tmp"
    (leftover / "artifact").mkdir(parents=True)
    alive = tmp_path / "cache" / "entries" / f".k9.{os.getppid()}.tmp"  # a writer that still runs: left alone
    alive.mkdir()
    assert cache.lookup("k1") is None
    assert not leftover.exists() and alive.exists()

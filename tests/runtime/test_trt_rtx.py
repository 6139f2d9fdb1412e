"""TensorRT-RTX in the runtime: the runtime cache on disk, the CUDA-graph strategy per profile, the refusal of a GPU
TensorRT-RTX does not support (before any plan byte is read), verify and from_artifacts on tensorrt-rtx artifacts.

Above the ``tensorrt_rtx_gpu`` marker: pure parts over manifest facts, files and bytes; they run on any machine
(this one has no GPU). Below it: a real plan built with the TensorRT-RTX builder for the GPU at hand and run
through :class:`TrtEngine`, compared with ONNX Runtime; it skips unless a GPU TensorRT-RTX supports is present
(none is lent here: the lent H200 is compute capability 9.0). The H200's refusal test is in
``tests/test_trt_rtx_gpu.py`` (it needs neither onnx nor ONNX Runtime).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from diffusion_trt import trt_compat
from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.manifest import Manifest
from diffusion_trt.artifact.verify import verify_artifact
from diffusion_trt.cli import main
from diffusion_trt.errors import ArtifactError, RuntimeInputError
from diffusion_trt.runtime.engines import runtime_cache as rc
from diffusion_trt.runtime.engines.trt_engine import RuntimeProfile, TrtEngine, rtx_cuda_graph_strategy
from diffusion_trt.trt_compat import TrtHost, check_host
from tests.runtime.test_trt_engine import ADD_ENTRY, UNET_ENTRY, _add_model, _feeds

RTX = trt_compat.library("tensorrt-rtx")
VERSION = "1.7.1.116"
SEAL = "ab" * 32
#: a tensorrt-rtx component's build facts, as the build stage writes them (issue 13's manifest contract)
RTX_BUILD: dict[str, Any] = {
    "engine": "tensorrt-rtx",
    "library": "tensorrt-rtx",
    "tensorrt": VERSION,
    "compute_capabilities": ["8.6", "8.9", "12.0"],
    "compute_capability": None,
    "gpu": None,
    "profiles": [],
    "strongly_typed": True,
    "precision": "fp32",
    "runtime_cache": "unet.runtime-cache",
}
KEY = rc.RuntimeCacheKey("tensorrt-rtx", VERSION, "8.9", "NVIDIA GeForce RTX 4090")
H200 = TrtHost("", "9.0", "NVIDIA H200")


# --- where the runtime cache lives ------------------------------------------------------------------------


def test_runtime_cache_defaults_to_the_user_cache_keyed_by_the_manifest_seal(tmp_path: Path) -> None:
    manifest = Manifest.from_json({"manifest_sha256": SEAL})
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    path = rc.runtime_cache_path(tmp_path / "art", manifest, RTX_BUILD, env=env)
    assert path == tmp_path / "xdg" / "diffusion-trt" / "runtime-cache" / SEAL[:16] / "unet.runtime-cache"
    # XDG_CACHE_HOME unset or relative (the XDG spec says: ignore it): ~/.cache
    for env in ({}, {"XDG_CACHE_HOME": "relative/cache"}):
        path = rc.runtime_cache_path(tmp_path / "art", manifest, RTX_BUILD, env=env)
        assert path == Path.home() / ".cache" / "diffusion-trt" / "runtime-cache" / SEAL[:16] / "unet.runtime-cache"


def test_runtime_cache_dir_argument_is_used_as_is_but_never_inside_the_sealed_artifact(tmp_path: Path) -> None:
    art = tmp_path / "art"
    (art / "unet").mkdir(parents=True)
    manifest = Manifest.from_json({"manifest_sha256": SEAL})
    assert rc.runtime_cache_path(art, manifest, RTX_BUILD, tmp_path / "rc") == tmp_path / "rc" / "unet.runtime-cache"
    for inside in (art, art / "unet", art / "new" / "cache"):
        with pytest.raises(RuntimeInputError, match=r"inside the artifact .* sealed .*art\.runtime-cache"):
            rc.runtime_cache_path(art, manifest, RTX_BUILD, inside)


def test_runtime_cache_names_are_plain_file_names(tmp_path: Path) -> None:
    assert rc.runtime_cache_path(tmp_path, Manifest.from_json({"manifest_sha256": SEAL}), {"tensorrt": VERSION}) is None
    for bad in ("../unet.cache", "a/b", "", "..", 7):
        with pytest.raises(ArtifactError, match="not a plain file name"):
            rc.runtime_cache_path(tmp_path, Manifest.from_json({"manifest_sha256": SEAL}),
                                  {**RTX_BUILD, "runtime_cache": bad})


# --- the runtime cache file --------------------------------------------------------------------------------


def test_runtime_cache_round_trips_and_is_written_atomically(tmp_path: Path) -> None:
    path = tmp_path / "rc" / "sub" / "unet.runtime-cache"
    payload = bytes(range(256)) * 40
    assert rc.save_runtime_cache(path, KEY, payload, "engine 'unet'")
    assert rc.load_runtime_cache(path, KEY, "engine 'unet'") == payload
    assert sorted(p.name for p in path.parent.iterdir()) == ["unet.runtime-cache"]  # no temporary file left
    assert rc.save_runtime_cache(path, KEY, b"newer", "engine 'unet'")  # replaces
    assert rc.load_runtime_cache(path, KEY, "engine 'unet'") == b"newer"
    assert rc.load_runtime_cache(tmp_path / "absent", KEY, "engine 'unet'") is None
    assert rc.load_runtime_cache(None, KEY, "engine 'unet'") is None


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b"garbage, not a cache" + b, "bad magic"),
        (lambda b: b[: len(rc.RUNTIME_CACHE_MAGIC) + 2], "truncated header"),
        (lambda b: b[:-1], "checksum mismatch"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]), "checksum mismatch"),
        (lambda b: b.replace(b'"format": 1', b'"format": 9'), "format 9 != 1"),
        (lambda b: rc.pack_runtime_cache(rc.RuntimeCacheKey("tensorrt-rtx", VERSION, "8.6", "NVIDIA RTX A6000"),
                                         b"x"), "made for tensorrt-rtx 1.7.1.116 on NVIDIA RTX A6000"),
    ],
)
def test_a_corrupt_or_foreign_runtime_cache_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any, reason: str
) -> None:
    path = tmp_path / "unet.runtime-cache"
    path.write_bytes(damage(rc.pack_runtime_cache(KEY, b"kernels" * 100)))
    with caplog.at_level(logging.WARNING, logger="diffusion_trt.runtime.engines.runtime_cache"):
        assert rc.load_runtime_cache(path, KEY, "engine 'unet'") is None
    assert f"engine 'unet': ignoring the runtime cache {path}: " in caplog.text and reason in caplog.text
    assert "replaced on close" in caplog.text


def test_an_unwritable_runtime_cache_folder_is_a_warning_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="diffusion_trt.runtime.engines.runtime_cache"):
        assert not rc.save_runtime_cache(blocker / "unet.runtime-cache", KEY, b"k", "engine 'unet'")
    assert "could not save the runtime cache" in caplog.text


# --- CUDA graphs: TensorRT-RTX's own capture on static profiles ---------------------------------------------


def test_whole_graph_capture_on_static_profiles_only() -> None:
    static = RuntimeProfile(1, "static", {"x": ((2, 4, 8, 8),) * 3, "t": ((2,),) * 3})
    dynamic = RuntimeProfile(0, "dynamic", {"x": ((1, 4, 4, 4), (2, 4, 8, 8), (4, 4, 16, 16)), "t": ((2,),) * 3})
    assert rtx_cuda_graph_strategy(static) == "WHOLE_GRAPH_CAPTURE"
    assert rtx_cuda_graph_strategy(dynamic) == "DISABLED"
    assert rtx_cuda_graph_strategy(static, cuda_graphs=False) == "DISABLED"
    # the names are members of the real library's enum (read from tensorrt_rtx_bindings, no GPU needed)
    trt = pytest.importorskip("tensorrt_rtx_bindings")
    assert {"WHOLE_GRAPH_CAPTURE", "DISABLED"} <= set(trt.CudaGraphStrategy.__members__)
    assert "LAZY" in trt.DynamicShapesKernelSpecializationStrategy.__members__
    assert "USER_MANAGED" in trt.ExecutionContextAllocationStrategy.__members__


# --- the refusal of an unsupported GPU, from manifest facts --------------------------------------------------


def test_check_host_refuses_compute_capability_9_0_naming_it_and_the_ort_alternative() -> None:
    with pytest.raises(ArtifactError) as e:
        check_host(RTX, RTX_BUILD, TrtHost(VERSION, "9.0", "NVIDIA H200"), "engine 'unet' (unet/model.plan)")
    msg = str(e.value)
    assert "\n" not in msg
    assert "compute capability 9.0 (NVIDIA H200)" in msg and "--backend ort --device cuda" in msg
    assert msg.startswith("engine 'unet' (unet/model.plan) needs TensorRT-RTX")


def test_check_host_refuses_a_supported_gpu_the_plan_was_not_built_for_and_another_release() -> None:
    with pytest.raises(ArtifactError, match=r"built for compute capability 8\.6, 8\.9, 12\.0, not for this GPU's 7\.5"):
        check_host(RTX, RTX_BUILD, TrtHost(VERSION, "7.5", "NVIDIA T4"), "engine 'unet'")
    with pytest.raises(ArtifactError, match=r"built with TensorRT-RTX 1\.7\.1\.116 but this machine has TensorRT-RTX "
                                            r"1\.8\.0\.1; .*--backend tensorrt-rtx"):
        check_host(RTX, RTX_BUILD, TrtHost("1.8.0.1", "8.9"), "engine 'unet'")
    assert check_host(RTX, RTX_BUILD, TrtHost(VERSION, "8.9", "NVIDIA GeForce RTX 4090"), "engine 'unet'") == []
    assert len(check_host(RTX, RTX_BUILD, TrtHost("1.7.1.200", "12.0"), "engine 'unet'")) == 1  # build number warns
    with pytest.raises(ArtifactError, match="lack the TensorRT-RTX version"):
        check_host(RTX, {**RTX_BUILD, "tensorrt": None}, TrtHost(VERSION, "8.9"), "engine 'unet'")


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, host: TrtHost) -> None:
    """This machine has no GPU: the engine reads the GPU's facts through trt_compat.gpu_facts (our function)."""
    monkeypatch.setattr(trt_compat, "gpu_facts", lambda device_id=0: host)


def _no_library(self: trt_compat.TrtLibrary, error: type[Exception] = ArtifactError) -> Any:
    raise AssertionError(f"{self.module} was imported: the refusal must come first")


def test_the_refusal_comes_before_the_library_is_imported_or_a_plan_byte_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = tmp_path / "unet" / "model.plan"
    plan.parent.mkdir()
    plan.write_bytes(b"\x00garbage, not a plan: deserialising it would fail with another message" * 10)
    _fake_gpu(monkeypatch, H200)
    monkeypatch.setattr(trt_compat.TrtLibrary, "import_module", _no_library)
    engine = TrtEngine(plan, {**UNET_ENTRY, "build": RTX_BUILD}, backend="tensorrt-rtx", runtime_cache=tmp_path / "c")
    with pytest.raises(ArtifactError) as e:
        engine.__enter__()
    msg = str(e.value)
    assert msg.startswith(f"engine 'unet' ({plan}) needs TensorRT-RTX, which does not support this GPU of compute "
                          "capability 9.0 (NVIDIA H200)")
    assert "--backend ort --device cuda" in msg and "\n" not in msg
    assert not engine.is_open and not (tmp_path / "c").exists()


def test_full_tensorrt_keeps_check_plan_compat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same engine class, backend "tensorrt": one compute capability per plan; the message is the old one."""
    from tests.runtime.test_trt_engine import BUILD

    _fake_gpu(monkeypatch, TrtHost("", "8.9", "NVIDIA L40S"))
    monkeypatch.setattr(trt_compat.TrtLibrary, "import_module",
                        lambda self, error=ArtifactError: type("trt", (), {"__version__": "10.8.0.43"}))
    with pytest.raises(ArtifactError, match=r"built for compute capability 9\.0 .* but this GPU is 8\.9"):
        TrtEngine(tmp_path / "model.plan", {**UNET_ENTRY, "build": BUILD}, name="unet").__enter__()


def test_an_unknown_backend_is_an_artifact_error(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="'onnx' is not a TensorRT library"):
        TrtEngine(tmp_path / "model.plan", {**UNET_ENTRY, "build": RTX_BUILD}, backend="onnx")


# --- tensorrt-rtx artifacts: from_artifacts, verify -----------------------------------------------------------


def _rtx_artifact(src: Path, dest: Path, targets: list[str] | None = None) -> dict[str, Any]:
    """A copy of the toy artifact turned into a tensorrt-rtx one whose plans are garbage bytes."""
    shutil.copytree(src, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest.update(backend="tensorrt-rtx", device="cuda")
    for name, entry in manifest["components"].items():
        build = {**RTX_BUILD, "runtime_cache": f"{name}.runtime-cache"}
        if targets is not None:
            build["compute_capabilities"] = targets
        entry["plan"], entry["build"] = f"{name}/model.plan", build
        (dest / entry["plan"]).write_bytes(b"not a plan: never deserialised here")
        manifest["files"][entry["plan"]] = artifacts.file_entry(dest, entry["plan"])
        build["plan_sha256"], build["plan_bytes"] = (manifest["files"][entry["plan"]][k] for k in ("sha256", "size"))
    return artifacts.write_manifest(dest, manifest)


def test_from_artifacts_opens_tensorrt_rtx_artifacts_with_trt_engine(
    toy_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from diffusion_trt.runtime import EnginePipeline

    art = tmp_path / "art"
    _rtx_artifact(toy_artifact, art)
    with pytest.raises(ArtifactError, match="backend='tensorrt-rtx', whose engines run on CUDA only"):
        EnginePipeline.from_artifacts(art, device="cpu")
    with pytest.raises(RuntimeInputError, match="inside the artifact"):
        EnginePipeline.from_artifacts(art, runtime_cache_dir=art / "cache")
    _fake_gpu(monkeypatch, H200)
    monkeypatch.setattr(trt_compat.TrtLibrary, "import_module", _no_library)
    with pytest.raises(ArtifactError, match=r"^engine 'text_encoder' .* compute capability 9\.0 \(NVIDIA H200\).*"
                                            r"--backend ort --device cuda"):
        EnginePipeline.from_artifacts(art, runtime_cache_dir=tmp_path / "rc")
    assert not (tmp_path / "rc").exists()


def test_from_artifacts_without_cuda_says_so(toy_artifact: Path, tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    from diffusion_trt.runtime import EnginePipeline

    _rtx_artifact(toy_artifact, tmp_path / "art")
    with pytest.raises(ArtifactError, match="TensorRT-RTX engines run on CUDA and torch sees no CUDA device"):
        EnginePipeline.from_artifacts(tmp_path / "art", verify=False)


def test_run_and_bench_take_runtime_cache(
    toy_artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import diffusion_trt.bench as bench

    art = tmp_path / "art"
    _rtx_artifact(toy_artifact, art)
    result = CliRunner().invoke(main, ["run", str(art), "-p", "x", "-o", str(tmp_path / "o.png"),
                                       "--runtime-cache", str(art / "rc")])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and "inside the artifact" in result.output
    seen: list[Any] = []

    def fake_run_bench(cfg: Any, progress: Any = None) -> Any:
        seen.append(cfg)
        raise RuntimeInputError("stop here")

    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    result = CliRunner().invoke(main, ["bench", str(art), "--baseline", "none",
                                       "--runtime-cache", str(tmp_path / "rc")])
    assert result.exit_code == 2 and seen[0].runtime_cache_dir == tmp_path / "rc", result.output


def test_verify_checks_tensorrt_rtx_plans_against_a_target_without_a_gpu(toy_artifact: Path, tmp_path: Path) -> None:
    art = tmp_path / "art"
    _rtx_artifact(toy_artifact, art)
    assert verify_artifact(art, trt_host=TrtHost(VERSION, "8.9")).ok
    report = verify_artifact(art, trt_host=TrtHost(VERSION, "9.0", "NVIDIA H200"))
    assert len(report.problems) == 3 and all("compute capability 9.0 (NVIDIA H200)" in p for p in report.problems)
    report = verify_artifact(art, trt_host=TrtHost(VERSION, "8.0"))
    assert all("built for compute capability 8.6, 8.9, 12.0, not for this GPU's 8.0" in p for p in report.problems)
    report = verify_artifact(art, trt_host=TrtHost("1.6.0.1", "8.9"))
    assert all("built with TensorRT-RTX 1.7.1.116 but this machine has TensorRT-RTX 1.6.0.1" in p
               for p in report.problems) and len(report.problems) == 3

    runner = CliRunner()
    ok = runner.invoke(main, ["verify", str(art), "--compute-capability", "8.9", "--tensorrt", VERSION])
    assert ok.exit_code == 0 and "runs on the target" in ok.output, ok.output
    bad = runner.invoke(main, ["verify", str(art), "--compute-capability", "9.0", "--tensorrt", VERSION])
    assert bad.exit_code == 3 and "--backend ort --device cuda" in bad.output
    if not torch.cuda.is_available():  # this machine: the library imports, but there is no GPU to check
        here = verify_artifact(art)
        assert here.problems == ["no CUDA GPU is visible (torch.cuda.is_available() is False); TensorRT-RTX plans "
                                 "need one"]


# --- with a GPU TensorRT-RTX supports ------------------------------------------------------------------------


def build_rtx_plan(root: Path, compute_capability: str) -> dict[str, Any]:
    """The toy add graph built by our build stage with the real TensorRT-RTX builder; returns the manifest entry.

    ``compute_capability`` "8.9" builds on any machine (no GPU); "current" needs a GPU TensorRT-RTX supports.
    """
    from diffusion_trt.compiler.build_trt import TrtBuildConfig, engine_from_onnx

    onnx.save_model(_add_model(), str(root / "model.onnx"))
    build = engine_from_onnx(
        root / "model.onnx", root / "model.plan", ADD_ENTRY["inputs"], precision="fp32",
        build=TrtBuildConfig(library="tensorrt-rtx", compute_capabilities=(compute_capability,)),
        timing_cache_dir=None,
    )
    return {**ADD_ENTRY, "build": build}


@pytest.mark.rtx_builder
def test_a_real_rtx_plan_from_the_build_stage_is_refused_on_9_0_before_deserialising(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The build stage's facts are what the runtime checks: same keys, same meaning (no GPU needed)."""
    entry = build_rtx_plan(tmp_path, "8.9")
    assert entry["build"]["compute_capabilities"] == ["8.9"] and entry["build"]["runtime_cache"]
    assert check_host(RTX, entry["build"], TrtHost(entry["build"]["tensorrt"], "8.9"), "engine 'unet'") == []
    _fake_gpu(monkeypatch, H200)
    monkeypatch.setattr(trt_compat.TrtLibrary, "import_module", _no_library)
    engine = TrtEngine(tmp_path / "model.plan", entry, name="unet", backend="tensorrt-rtx")
    with pytest.raises(ArtifactError, match=r"compute capability 9\.0 \(NVIDIA H200\).*--backend ort --device cuda"):
        engine.__enter__()
    _fake_gpu(monkeypatch, TrtHost("", "8.6", "NVIDIA GeForce RTX 3090"))  # supported, but not a target of this plan
    with pytest.raises(ArtifactError, match=r"built for compute capability 8\.9, not for this GPU's 8\.6 .*"
                                            r"--compute-capability 8\.6"):
        engine.__enter__()


@pytest.mark.tensorrt_rtx_gpu
def test_rtx_engine_matches_ort_and_reuses_its_runtime_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from diffusion_trt.runtime.engines.ort_engine import OrtEngine

    entry = build_rtx_plan(tmp_path, "current")
    cache = tmp_path / "rc" / entry["build"]["runtime_cache"]
    shapes = [(2, 8, 8), (2, 8, 8), (2, 8, 8), (3, 8, 12), (3, 8, 12), (1, 4, 16), (2, 8, 8)]
    for run in range(2):  # the second open reads the kernels the first one compiled and saved
        with caplog.at_level(logging.INFO, logger="diffusion_trt"):
            with (
                OrtEngine(tmp_path / "model.onnx", entry, name="unet") as ort_engine,
                TrtEngine(tmp_path / "model.plan", entry, name="unet", backend="tensorrt-rtx",
                          runtime_cache=cache) as engine,
            ):
                assert [p.kind for p in engine.profiles] == ["dynamic", "static"]
                for seed, (b, h, w) in enumerate(shapes):  # static profile (own CUDA graph) and dynamic ones
                    cpu = _feeds(b, h, w, "cpu", seed)
                    want = ort_engine.run(cpu)["y"]
                    got = engine.run({k: v.cuda() for k, v in cpu.items()})["y"]
                    torch.cuda.synchronize()
                    np.testing.assert_allclose(got.cpu().numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
        assert cache.is_file() and cache.read_bytes().startswith(rc.RUNTIME_CACHE_MAGIC)
        if run == 1:
            assert "runtime cache loaded from" in caplog.text
        caplog.clear()
    assert os.listdir(cache.parent) == [cache.name]

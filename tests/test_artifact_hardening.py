"""Issue 14, items 1-7: hostile artifacts and interrupted compiles.

Each bad folder is a copy of the compiled tiny artifact with one thing changed (resealed where the attack would
reseal it): ``verify`` must exit 3 naming it, ``inspect`` / ``run`` must exit 3 with one ``error:`` line and no
traceback, and ``EnginePipeline.from_artifacts`` must refuse it (or load one whole artifact) before anything outside
the folder is read. Every subprocess is bounded and killed in a ``finally``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner, Result
from onnx import TensorProto, helper

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.verify import verify_artifact
from diffusion_trt.cli import main
from diffusion_trt.errors import ArtifactError, RuntimeInputError
from diffusion_trt.runtime import EnginePipeline
from diffusion_trt.runtime.engines import ort_engine as ort_engine_module


def _run_cli(*args: object) -> Result:
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_error_line(result: Result, code: int = 3) -> str:
    """The output of a failed command that printed one ``error:`` line and no traceback (CliRunner keeps an uncaught
    exception in ``result.exception``)."""
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.fixture
def art(tiny_artifact: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny artifact, safe to damage."""
    dest = tmp_path / "art"
    shutil.copytree(tiny_artifact, dest)
    return dest


def _manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / "manifest.json").read_text())


def _reseal(root: Path, *rels: str) -> dict[str, Any]:
    """Re-list ``rels`` and reseal: what someone altering an artifact on purpose would do."""
    manifest = _manifest(root)
    for rel in rels:
        manifest["files"][rel] = artifacts.file_entry(root, rel)
    return artifacts.write_manifest(root, manifest)


def _tamper_unet(root: Path) -> Path:
    """A valid UNet with other weights (its largest initializer doubled), written beside the original."""
    model = onnx.load(str(root / "unet" / "model.onnx"))
    tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    values = onnx.numpy_helper.to_array(tensor) * 2
    tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    out = root.parent / f"tampered-{root.name}.onnx"
    out.write_bytes(model.SerializeToString())
    return out


def _unet_output(pipe: EnginePipeline) -> np.ndarray:
    """The UNet on fixed feeds (its min shapes, seeded values): tells engines with other weights apart."""
    unet = pipe.engines["unet"]
    gen = torch.Generator().manual_seed(0)
    feeds = {i.name: torch.randn(tuple(i.min), generator=gen).to(i.torch_dtype) for i in unet.spec.inputs}
    return next(iter(unet.run(feeds).values())).clone().numpy()


def _load(root: Path, **kwargs: Any) -> EnginePipeline:
    return EnginePipeline.from_artifacts(root, device="cpu", **kwargs)


# -- 1. external data the check did not see ------------------------------------------------------------


def _external(name: str, location: str) -> TensorProto:
    tensor = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _hide_function_constant(model: onnx.ModelProto, location: str) -> None:
    const = helper.make_node("Constant", [], ["o"], value=_external("v", location))
    model.functions.append(helper.make_function("evil", "F", [], ["o"], [const], [helper.make_opsetid("", 17)]))
    model.opset_import.append(helper.make_opsetid("evil", 1))
    model.graph.node.append(helper.make_node("F", [], ["evil_out"], domain="evil"))


def _hide_sparse_constant(model: onnx.ModelProto, location: str) -> None:
    sparse = helper.make_sparse_tensor(_external("v", location), helper.make_tensor("i", TensorProto.INT64, [4],
                                                                                    [0, 1, 2, 3]), [4])
    model.graph.node.append(helper.make_node("Constant", [], ["evil_out"], sparse_value=sparse))


def _hide_function_if_branch(model: onnx.ModelProto, location: str) -> None:
    branch = helper.make_graph([helper.make_node("Constant", [], ["b"], value=_external("v", location))], "b", [],
                               [helper.make_tensor_value_info("b", TensorProto.FLOAT, [4])])
    cond = helper.make_node("Constant", [], ["c"], value=helper.make_tensor("cv", TensorProto.BOOL, [], [True]))
    node = helper.make_node("If", ["c"], ["o"], then_branch=branch, else_branch=branch)
    model.functions.append(helper.make_function("evil", "G", [], ["o"], [cond, node], [helper.make_opsetid("", 17)]))
    model.opset_import.append(helper.make_opsetid("evil", 1))
    model.graph.node.append(helper.make_node("G", [], ["evil_out"], domain="evil"))


@pytest.mark.parametrize("hide", [_hide_function_constant, _hide_sparse_constant, _hide_function_if_branch],
                         ids=["function-constant", "constant-sparse-value", "if-branch-in-function"])
def test_external_data_anywhere_in_the_model_is_checked(art: Path, hide: Callable[..., None]) -> None:
    path = art / "text_encoder" / "model.onnx"
    model = onnx.load(str(path))
    hide(model, "../../../x")
    path.write_bytes(model.SerializeToString())
    _reseal(art, "text_encoder/model.onnx")
    message = r"text_encoder/model.onnx: external data location '\.\./\.\./\.\./x' points outside the artifact folder"
    assert "../../../x" in artifacts.onnx_external_data_locations(path)
    result = _run_cli("verify", art)
    assert result.exit_code == 3
    assert any(line.startswith("problem: ") and "'../../../x' points outside" in line
               for line in result.output.splitlines()), result.output
    for verify in (True, False):
        with pytest.raises(ArtifactError, match=message):
            _load(art, verify=verify)


# -- 2. hash, then load by path --------------------------------------------------------------------------


def test_a_file_swapped_after_it_was_read_is_not_what_runs(art: Path, tiny_artifact: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The UNet file is atomically replaced right before ONNX Runtime builds its session: the session must still
    be the hashed (original) model, not the file now at that path."""
    import onnxruntime as ort

    with _load(tiny_artifact) as pipe:
        expected = _unet_output(pipe)
    tampered = _tamper_unet(art)
    real = ort.InferenceSession

    def swap_then_create(model: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(model, bytes | str) and tampered.exists() and real_unet_bytes(model):
            os.replace(tampered, art / "unet" / "model.onnx")
        return real(model, *args, **kwargs)

    unet_bytes = (art / "unet" / "model.onnx").read_bytes()

    def real_unet_bytes(model: Any) -> bool:
        return model == unet_bytes or str(model).endswith("unet/model.onnx")

    monkeypatch.setattr(ort, "InferenceSession", swap_then_create)
    with _load(art) as pipe:
        assert not tampered.exists(), "the swap never happened"
        np.testing.assert_array_equal(_unet_output(pipe), expected)


def test_a_file_swapped_before_it_is_read_is_refused(art: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tampered = _tamper_unet(art)
    real_read = ort_engine_module.read_private  # the engine's read, at its open or ahead of it (loading.READ_AHEAD)

    def swap_then_read(source: Any, name: str) -> Any:
        if name == "unet" and tampered.exists():
            os.replace(tampered, art / "unet" / "model.onnx")  # after from_artifacts' checks, before the read
        return real_read(source, name)

    monkeypatch.setattr(ort_engine_module, "read_private", swap_then_read)
    with pytest.raises(ArtifactError, match=r"unet/model\.onnx: sha256 .* the file was altered"):
        _load(art)


def test_external_data_is_loaded_from_the_hashed_bytes(tiny_sdxl_artifact: Path) -> None:
    """tiny-sdxl keeps every weight in external data: the sessions are built from memory, and run."""
    with EnginePipeline.from_artifacts(tiny_sdxl_artifact, device="cpu") as pipe:
        out = pipe("a cat", num_inference_steps=1, seed=0, output_type="np")
    assert np.isfinite(out.images).all()


# -- 3. mixed artifacts -----------------------------------------------------------------------------------


def _other_artifact(art: Path, name: str) -> Path:
    """A second valid artifact: ``art`` with other UNet weights, resealed."""
    other = art.parent / name
    shutil.copytree(art, other)
    os.replace(_tamper_unet(other), other / "unet" / "model.onnx")
    _reseal(other, "unet/model.onnx")
    return other


def _exchange_after_first_engine(monkeypatch: pytest.MonkeyPatch, a: Path, b: Path,
                                 then: Callable[[], None] = lambda: None) -> list[str]:
    """Exchange folders ``a`` and ``b`` (compile --overwrite's rename-exchange) once the first engine has opened."""
    opened: list[str] = []
    real_open = ort_engine_module.OrtEngine._open

    def open_then_exchange(self: Any) -> None:
        real_open(self)
        opened.append(self.name)
        if len(opened) == 1:
            assert artifacts._exchange(a, b), "renameat2(RENAME_EXCHANGE) is not available here"
            then()

    monkeypatch.setattr(ort_engine_module.OrtEngine, "_open", open_then_exchange)
    return opened


def _exchange_on_first_read(monkeypatch: pytest.MonkeyPatch, prefix: str, a: Path, b: Path,
                            then: Callable[[], None] = lambda: None) -> None:
    """Exchange folders ``a`` and ``b`` (and run ``then``) just before the first read of a file under ``prefix``."""
    from diffusion_trt.artifact.reader import ArtifactReader

    real_read = ArtifactReader._read_file
    done: list[bool] = []

    def exchange_then_read(self: Any, rel: str, *args: Any, **kwargs: Any) -> Any:
        if rel.startswith(prefix) and not done:
            done.append(True)
            assert artifacts._exchange(a, b), "renameat2(RENAME_EXCHANGE) is not available here"
            then()
        return real_read(self, rel, *args, **kwargs)

    monkeypatch.setattr(ArtifactReader, "_read_file", exchange_then_read)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2(RENAME_EXCHANGE) is Linux only")
def test_a_folder_exchanged_while_loading_gives_one_whole_artifact(art: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    other = _other_artifact(art, "other")
    with _load(art) as pipe:
        original = _unet_output(pipe)
    with _load(other) as pipe:
        tampered = _unet_output(pipe)
    assert not np.array_equal(original, tampered)
    seal = _manifest(art)["manifest_sha256"]
    opened = _exchange_after_first_engine(monkeypatch, art, other)
    with _load(art) as pipe:
        # the engines open side by side (runtime/loading.py): the exchange came after the first of them opened
        assert set(opened) == {"text_encoder", "unet", "vae_decoder"}
        assert pipe.manifest.seal == seal
        np.testing.assert_array_equal(_unet_output(pipe), original)  # the folder that was opened, not its successor


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2(RENAME_EXCHANGE) is Linux only")
def test_a_folder_exchanged_during_the_inside_check_keeps_reading_the_held_folder(
        art: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exchange lands between the two ``/proc`` look-ups of the check that a file lies inside the folder (the
    file's path read before the rename, the folder's after: on a loaded machine the engine threads hit this window).
    The held folder was only moved, not deleted: the read goes on in it, no reload and no 'outside' error."""
    from diffusion_trt.artifact.reader import ArtifactReader

    other = _other_artifact(art, "other")
    expected = (art / "unet" / "model.onnx").read_bytes()
    real_readlink = os.readlink
    done: list[bool] = []

    def readlink_then_exchange(path: Any, *args: Any, **kwargs: Any) -> Any:
        target = real_readlink(path, *args, **kwargs)
        if str(target).endswith("unet/model.onnx") and not done:
            done.append(True)
            assert artifacts._exchange(art, other), "renameat2(RENAME_EXCHANGE) is not available here"
        return target

    with ArtifactReader.open(art, check_hashes=True) as reader:
        monkeypatch.setattr(os, "readlink", readlink_then_exchange)
        data = reader.read("unet/model.onnx")
    assert done
    assert bytes(data) == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2(RENAME_EXCHANGE) is Linux only")
@pytest.mark.parametrize("prefix", ["tokenizer/", "unet/", "scheduler/"])
def test_a_folder_replaced_and_deleted_while_loading_is_loaded_again(art: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     prefix: str) -> None:
    """The exchange and delete come on the first read under ``prefix``: the first tokenizer read (on the calling
    thread while the engines open on theirs: it fails for sure, whatever the engine threads had read already), the
    UNet's (on a read thread, beside the others' reads) or the scheduler config's (before the engines). Through the
    descriptor of a deleted folder every path looks as if it led outside: the load must see the replacement for what
    it is and load the new folder, never report a link leading outside."""
    other = _other_artifact(art, "other")
    with _load(other) as pipe:
        new_output = _unet_output(pipe)
    new_seal = _manifest(other)["manifest_sha256"]
    _exchange_on_first_read(monkeypatch, prefix, art, other, then=lambda: shutil.rmtree(other))
    with _load(art) as pipe:
        assert pipe.manifest.seal == new_seal
        np.testing.assert_array_equal(_unet_output(pipe), new_output)


# -- 4. resealed but poisonous configs --------------------------------------------------------------------


@pytest.mark.parametrize(("value", "message"), [
    ('"abc"', "'abc' is not of type 'integer'"),
    ("-5", "-5 is less than the minimum of 1"),
    ("3e9", "3000000000.0 is not of type 'integer'"),
    ("3000000000", "3000000000 is greater than the maximum of 100000"),
])
def test_a_resealed_scheduler_config_with_bad_values_is_refused(art: Path, tmp_path: Path, value: str,
                                                                message: str) -> None:
    path = art / "scheduler" / "scheduler_config.json"
    text = path.read_text()
    config = json.loads(text)
    config["num_train_timesteps"] = 0  # placeholder, replaced by the raw JSON value below
    path.write_text(json.dumps(config).replace('"num_train_timesteps": 0', f'"num_train_timesteps": {value}'))
    _reseal(art, "scheduler/scheduler_config.json")
    result = _run_cli("verify", art)
    assert result.exit_code == 3
    assert f"num_train_timesteps: {message}" in result.output, result.output
    line = _one_error_line(_run_cli("run", art, "-p", "x", "--steps", "1", "-o", tmp_path / "o.png"))
    assert f"num_train_timesteps: {message}" in line and "restore the original" in line
    assert not (tmp_path / "o.png").exists()


#: Issue 24, item 3: scheduler configs that passed verify and crashed run (exit 1, a traceback). (the edit of
#: scheduler_config.json, the manifest's scheduler.class_name or None to keep it, what verify's one line says)
CRASHING_SCHEDULERS = {
    "flow_prediction": ({"prediction_type": "flow_prediction"}, None,
                        "prediction_type: 'flow_prediction' is not one of ['epsilon', 'v_prediction'] (PNDMScheduler)"),
    "exp_with_pndm": ({"beta_schedule": "exp"}, None,
                      "beta_schedule: 'exp' is not one of ['linear', 'scaled_linear', 'squaredcos_cap_v2'] "
                      "(PNDMScheduler)"),
    "steps_offset_1000": ({"steps_offset": 1000}, None,
                          "steps_offset: 1000 with num_train_timesteps=1000 starts the default 50 steps at timestep "
                          "1980, past the last training timestep 999; use at most 19"),
    "amused": ({}, "AmusedScheduler", "scheduler class 'AmusedScheduler' is not one the runtime runs"),
    "score_sde_ve": ({}, "ScoreSdeVeScheduler", "scheduler class 'ScoreSdeVeScheduler' is not one the runtime runs"),
    "config_class_amused": ({"_class_name": "AmusedScheduler"}, "",
                            "scheduler class 'AmusedScheduler' is not one the runtime runs"),
}


@pytest.mark.parametrize("case", sorted(CRASHING_SCHEDULERS))
def test_a_scheduler_the_runtime_cannot_run_fails_verify_and_run_before_loading(
        art: Path, tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusion_trt.runtime.pipeline as runtime_pipeline

    edit, class_name, message = CRASHING_SCHEDULERS[case]
    path = art / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    manifest = _reseal(art, "scheduler/scheduler_config.json")
    if class_name is not None:
        manifest["scheduler"]["class_name"] = class_name or None
        artifacts.write_manifest(art, manifest)
    result = _run_cli("verify", art, "--no-host")
    assert result.exit_code == 3, result.output
    problems = [line for line in result.output.splitlines() if "scheduler_config.json" in line]
    assert len(problems) == 1 and message in problems[0], result.output

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("an engine was opened before the scheduler was checked")

    monkeypatch.setattr(runtime_pipeline, "_open_engines", no_engine)
    line = _one_error_line(_run_cli("run", art, "-p", "x", "--steps", "2", "-o", tmp_path / "o.png"))
    assert message in line and not (tmp_path / "o.png").exists()


@pytest.mark.parametrize("class_name", ["DDPMWuerstchenScheduler", "RePaintScheduler", "UnCLIPScheduler",
                                        "AmusedScheduler", "ScoreSdeVeScheduler"])
def test_the_api_builds_only_the_allowed_scheduler_classes(tiny_artifact: Path, class_name: str) -> None:
    """Through the API (make_scheduler, EnginePipeline's default class): refused with the allow-list, before diffusers
    builds anything."""
    from diffusion_trt.runtime.schedulers import SCHEDULERS, make_scheduler

    config = json.loads((tiny_artifact / "scheduler" / "scheduler_config.json").read_text())
    with pytest.raises(ArtifactError, match=f"scheduler class '{class_name}' is not one the runtime runs; use one of "
                                            "PNDMScheduler, DDIMScheduler"):
        make_scheduler(config, None, class_name=class_name)
    from diffusion_trt.artifact.values import scheduler_classes

    assert set(scheduler_classes()) == {cls for cls, _ in SCHEDULERS.values()}  # the schema's list is the table's


def test_a_chosen_scheduler_that_cannot_run_the_config_is_a_usage_error(art: Path, tmp_path: Path) -> None:
    """DDIM accepts prediction_type 'sample'; euler_a does not: `run --scheduler euler_a` is refused (exit 2) before
    loading, naming the value; the artifact itself verifies."""
    path = art / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "_class_name": "DDIMScheduler",
                                "prediction_type": "sample"}))
    manifest = _reseal(art, "scheduler/scheduler_config.json")
    manifest["scheduler"]["class_name"] = "DDIMScheduler"
    artifacts.write_manifest(art, manifest)
    assert _run_cli("verify", art, "--no-host").exit_code == 0
    line = _one_error_line(_run_cli("run", art, "-p", "x", "--steps", "1", "--scheduler", "euler_a", "-o",
                                    tmp_path / "o.png"), code=2)
    assert ("--scheduler euler_a (EulerAncestralDiscreteScheduler) cannot run this artifact's scheduler config: "
            "scheduler_config.json prediction_type: 'sample' is not one of ['epsilon', 'v_prediction']") in line


def test_resealed_model_facts_out_of_range_are_refused(art: Path, tmp_path: Path) -> None:
    manifest = _manifest(art)
    manifest["model"]["vae_scale_factor"] = 3_000_000_000
    artifacts.write_manifest(art, manifest)
    result = _run_cli("verify", art)
    assert result.exit_code == 3
    assert "model.vae_scale_factor: 3000000000 is greater than the maximum of 64" in result.output
    for cmd in (("inspect", art), ("run", art, "-p", "x", "--steps", "1", "-o", tmp_path / "o.png")):
        assert "vae_scale_factor" in _one_error_line(_run_cli(*cmd))


def test_expect_sha256_pins_the_manifest(art: Path, tmp_path: Path) -> None:
    seal = _manifest(art)["manifest_sha256"]
    assert _run_cli("verify", art, "--expect-sha256", seal).exit_code == 0
    config = art / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text().replace('"steps_offset": 1', '"steps_offset": 0'))
    resealed = _reseal(art, "scheduler/scheduler_config.json")["manifest_sha256"]
    assert _run_cli("verify", art).exit_code == 0  # correctly resealed: the seal alone cannot tell
    result = _run_cli("verify", art, "--expect-sha256", seal)
    assert result.exit_code == 3
    assert f"problem: manifest digest {resealed} is not the expected {seal}" in result.output
    with pytest.raises(ArtifactError, match="is not the artifact that was pinned"):
        _load(art, expect_sha256=seal)
    # a malformed value is a usage error (exit 2, like click's own), one line, before the artifact is read
    for value in ("xyz", seal[:-1], seal + "0", seal[:-1] + "g"):
        bad = _run_cli("verify", art, "--expect-sha256", value)
        assert _one_error_line(bad, code=2).startswith(
            f"error: Invalid value for '--expect-sha256': {value!r} is not a sha256 (64 hex digits); pass the "
            "manifest_sha256 that `diffusion-trt inspect --json` prints"), bad.output
    assert _run_cli("verify", tmp_path / "absent", "--expect-sha256", "xyz").exit_code == 2
    with pytest.raises(RuntimeInputError, match=r"^expect_sha256='xyz' is not a sha256 \(64 hex digits\)"):
        _load(art, expect_sha256="xyz")  # the API's is the caller's error too, not a damaged artifact's
    assert _run_cli("verify", art, "--expect-sha256", f" {seal.upper()} ").exit_code == 3  # a well-formed other pin


# -- 5. malformed manifests and paths ---------------------------------------------------------------------


def _write_raw_manifest(art: Path, kind: str) -> None:
    path = art / "manifest.json"
    if kind == "not-utf8":
        path.write_bytes(b'{"schema_version": 1, "name": "\xff\xfe"}')
    elif kind == "deep":
        path.write_text('{"schema_version": 1, "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    elif kind == "huge-int":
        path.write_text('{"schema_version": 1, "x": ' + "7" * 5000 + "}")
    elif kind == "nul-key":
        manifest = _manifest(art)
        manifest["files"]["unet/a\u0000b"] = {"sha256": "0" * 64, "size": 1}
        artifacts.write_manifest(art, manifest)


@pytest.mark.parametrize(("kind", "message"), [
    ("not-utf8", "is not UTF-8 text"),
    ("deep", "deeper than"),
    ("huge-int", "an integer of 5000 digits"),
    ("nul-key", "a\\x00b"),
])
def test_a_malformed_manifest_is_one_error_line(art: Path, tmp_path: Path, kind: str, message: str) -> None:
    _write_raw_manifest(art, kind)
    result = _run_cli("verify", art)
    assert result.exit_code == 3, (result.output, result.exception)
    assert message in result.output
    for cmd in (("inspect", art), ("run", art, "-p", "x", "--steps", "1", "-o", tmp_path / "o.png")):
        assert message in _one_error_line(_run_cli(*cmd))


def test_a_symlink_loop_inside_the_folder_is_one_error_line(art: Path, tmp_path: Path) -> None:
    (art / "tokenizer" / "loop_a").symlink_to("loop_b")
    (art / "tokenizer" / "loop_b").symlink_to("loop_a")
    result = _run_cli("verify", art)
    assert result.exit_code == 3, (result.output, result.exception)
    assert "tokenizer/loop_a: symbolic link that cannot be resolved" in result.output
    line = _one_error_line(_run_cli("run", art, "-p", "x", "--steps", "1", "-o", tmp_path / "o.png"))
    assert "symbolic link that cannot be resolved" in line
    # a listed file that became a loop
    listed = next(p for p in sorted((art / "tokenizer").iterdir()) if p.suffix == ".json")
    listed.unlink()
    listed.symlink_to(listed.name)
    assert _run_cli("verify", art).exit_code == 3
    assert "symbolic link loop" in _one_error_line(_run_cli("run", art, "-p", "x", "--steps", "1",
                                                            "-o", tmp_path / "o.png"))


# -- 6. compiling into a symbolic link ---------------------------------------------------------------------

HOLD = """
import sys, time
from diffusion_trt.artifact import folder as artifacts
with artifacts.artifact_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_compiling_into_a_symlink_is_refused_even_while_its_target_is_locked(
    tiny_pipeline_dir: Path, tiny_artifact: Path, tmp_path: Path
) -> None:
    target = tmp_path / "real"
    shutil.copytree(tiny_artifact, target)
    link = tmp_path / "link"
    link.symlink_to("real")
    before = _manifest(target)["manifest_sha256"]
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(target), "60"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        result = _run_cli("compile", tiny_pipeline_dir, "-o", link, "--overwrite")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    line = _one_error_line(result, code=2)
    assert f"output {link} is a symbolic link (to real)" in line and f"-o {tmp_path / 'real'}" in line
    assert link.is_symlink() and _manifest(target)["manifest_sha256"] == before
    assert not list(tmp_path.glob(".link.*staging*")) and not list(tmp_path.glob(".real.staging-*"))


# -- 7. SIGTERM and kill -9 during compile -----------------------------------------------------------------


def _terminate_once(proc: subprocess.Popen[str], ready: Callable[[], Any], what: str) -> Any:
    """SIGTERM ``proc`` as soon as ``ready()`` gives something true (polled for up to 120 s) and return that; the
    process must then exit 143 with one ``terminated`` line and no traceback."""
    try:
        deadline, got = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None and not got:
            got = ready()
            time.sleep(0.005)
        assert got and proc.poll() is None, f"the process ended before {what}"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 143, err
    assert "terminated" in err and "Traceback" not in err
    return got


def test_sigterm_during_compile_leaves_nothing(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    exe = Path(sys.executable).parent / "diffusion-trt"
    proc = subprocess.Popen([str(exe), "compile", str(tiny_pipeline_dir), "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    staged = _terminate_once(proc, lambda: [p for p in tmp_path.glob(".art.staging-*") if (p / "tokenizer").is_dir()],
                             "the compile reached its staging folder")
    assert staged[0].name.startswith(f".art.staging-{proc.pid}-")  # the owner's pid is recorded
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # not even the lock file


def test_sigterm_during_a_runs_load_leaves_no_private_folder(art: Path, tmp_path: Path) -> None:
    """``run`` reads the weights into private folders under ``$TMPDIR`` from the load's start: SIGTERM there unwinds
    like Ctrl-C (exit 143), and the folders go with it."""
    spills = tmp_path / "spills"
    spills.mkdir()
    exe = Path(sys.executable).parent / "diffusion-trt"
    proc = subprocess.Popen([str(exe), "run", str(art), "--prompt", "a cat", "--steps", "50", "--device", "cpu",
                             "-o", str(tmp_path / "out.png")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "TMPDIR": str(spills)})
    _terminate_once(proc, lambda: any(spills.glob("diffusion-trt-weights-*")), "its load made a private folder")
    assert list(spills.glob("diffusion-trt-weights-*")) == []  # (onnxruntime's import writes a .ses file there)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_a_stale_staging_folder_is_reported_then_removed_by_the_next_compile(art: Path, tmp_path: Path) -> None:
    stale = tmp_path / f".art.staging-{_dead_pid()}-abc123"
    (stale / "unet").mkdir(parents=True)
    (stale / "unet" / "model.onnx").write_bytes(b"\0" * 1000)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live = tmp_path / f".art.staging-{sleeper.pid}-def456"
    live.mkdir()
    try:
        report = verify_artifact(art)
        assert report.ok
        assert any(w.startswith(f"{stale.name} beside the artifact (0.0 MB) was left by an interrupted write "
                                "(compile pid") and "no longer running" in w for w in report.warnings), report.warnings
        inspect = _run_cli("inspect", art)
        assert inspect.exit_code == 0 and f"warning: {stale.name} beside the artifact" in inspect.output
        with artifacts.staging_dir(art, overwrite=True) as stage:
            shutil.copytree(art, stage, dirs_exist_ok=True)
        assert not stale.exists()
        assert live.is_dir()  # its writer still runs (another host, or a reused pid): left alone
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)


def test_a_refused_folder_does_not_close_a_descriptor_it_no_longer_owns(tmp_path: Path) -> None:
    """ArtifactReader.open closes its folder descriptor once when it refuses the folder: a second close by the
    reader's finaliser would close whatever file had been given the same number since ('Bad file descriptor')."""
    import gc
    import os

    from diffusion_trt.artifact.reader import ArtifactReader
    from diffusion_trt.errors import ArtifactError

    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "manifest.json").write_text("{}")
    (tmp_path / "other.txt").write_text("still open")
    with pytest.raises(ArtifactError) as refused:  # its traceback keeps the refused reader alive
        ArtifactReader.open(tmp_path / "art")
    fd = os.open(tmp_path / "other.txt", os.O_RDONLY)  # the lowest free number: the one the reader held
    try:
        del refused  # the reader's finaliser runs now
        gc.collect()
        assert os.read(fd, 10) == b"still open"
    finally:
        os.close(fd)


def test_a_missing_file_is_refused_on_exactly_one_line(art: Path, tmp_path: Path) -> None:
    """run on an artifact that lost a file: exit 3 and the whole message on the one ``error:`` line (it continued on
    an indented line before)."""
    (art / "vae_decoder" / "model.onnx").unlink()
    result = _run_cli("run", art, "-p", "x", "--steps", "1", "-o", tmp_path / "x.png")
    out = _one_error_line(result)
    assert [line for line in out.splitlines() if line.strip()] == [out.strip()], out
    assert "failed verification: " in out and "vae_decoder/model.onnx" in out
    assert not (tmp_path / "x.png").exists()


def test_enclosing_artifact_is_found_by_its_sealed_manifest_only(tmp_path: Path) -> None:
    """What `optimize -o`, `dummy-lora OUT`... refuse to write into: the nearest folder whose manifest.json is ours (a
    JSON object with manifest_sha256), not any manifest.json (a web app's) nor one that is not JSON."""
    from diffusion_trt.artifact.folder import enclosing_artifact, write_manifest

    art, web, bad = tmp_path / "art", tmp_path / "web", tmp_path / "bad"
    for folder in (art / "unet", web, bad):
        folder.mkdir(parents=True)
    write_manifest(art, {"schema_version": 1})
    (web / "manifest.json").write_text(json.dumps({"name": "my app", "icons": []}))
    (bad / "manifest.json").write_bytes(b"\xff not json")
    assert enclosing_artifact(art / "unet" / "x.onnx") == art.resolve()
    assert enclosing_artifact(art) == art.resolve()
    assert enclosing_artifact(web / "x.onnx") is None and enclosing_artifact(bad / "x") is None
    os.symlink(art / "unet", tmp_path / "link")  # through a link: where it resolves to
    assert enclosing_artifact(tmp_path / "link" / "x.png") == art.resolve()


@pytest.mark.parametrize("damage", ["cut", "garbage", "missing", "folder"])
def test_inspect_of_a_damaged_component_file_is_one_error_line_exit_3(art: Path, damage: str) -> None:
    """inspect reads each ONNX file's initializer sizes: a file cut short or garbled gave protobuf's DecodeError
    traceback (exit 1), a missing one "No such file or directory; check the path" (exit 2, a usage error)."""
    unet = art / "unet" / "model.onnx"
    data = unet.read_bytes()
    unet.unlink()
    if damage == "cut":
        unet.write_bytes(data[:1000])
    elif damage == "garbage":
        unet.write_bytes(bytes(range(256)) * 8)
    elif damage == "folder":
        unet.mkdir()
    for args in (("inspect", art), ("inspect", art, "--json")):
        output = _one_error_line(_run_cli(*args))
        assert str(unet) in output, output
        assert ("is not a readable ONNX model" if damage in ("cut", "garbage") else "recompile") in output, output

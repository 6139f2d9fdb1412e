"""`export-triton`: every config.pbtxt parses as Triton's ModelConfig, and the BLS pipeline model's loop gives
the images EnginePipeline gives (run here with ONNX Runtime standing in for the Triton engine models)."""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.cli import main
from diffusion_trt.serve import triton_model
from diffusion_trt.serve.triton_model import RequestError, parse_request


def _invoke(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def _model_config(path: Path) -> Any:
    pb2 = pytest.importorskip(
        "tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] is not installed (pip install '.[serve]')"
    )
    from google.protobuf import text_format

    return text_format.Parse(path.read_text(), pb2.ModelConfig())


@pytest.fixture(scope="module")
def repo(tiny_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("triton") / "repo"
    code, text = _invoke("export-triton", tiny_artifact, out)
    assert code == 0, text
    return out


def test_repository_layout(repo: Path) -> None:
    assert sorted(p.name for p in repo.iterdir()) == ["pipeline", "text_encoder", "unet", "vae_decoder", "vae_encoder"]
    for name in ("text_encoder", "unet", "vae_decoder", "vae_encoder"):
        assert (repo / name / "1" / "model.onnx").is_file()
    version = repo / "pipeline" / "1"
    assert {p.name for p in version.iterdir()} >= {"model.py", "pipeline.json", "tokenizer", "scheduler_config.json"}


def test_engine_configs_parse_as_triton_model_configs(repo: Path, tiny_artifact: Path) -> None:
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] is not installed")
    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    for name, entry in manifest["components"].items():
        cfg = _model_config(repo / name / "config.pbtxt")
        assert cfg.name == name and cfg.platform == "onnxruntime_onnx"
        assert cfg.max_batch_size == entry["inputs"][0]["max"][0]  # 8 for B2 engines (CFG), 4 for B ones
        assert cfg.HasField("dynamic_batching")
        assert [g.kind for g in cfg.instance_group] == [pb2.ModelInstanceGroup.KIND_CPU]
        assert [i.name for i in cfg.input] == [t["name"] for t in entry["inputs"]]
        assert [o.name for o in cfg.output] == [t["name"] for t in entry["outputs"]]
    unet = {i.name: i for i in _model_config(repo / "unet" / "config.pbtxt").input}
    assert list(unet["sample"].dims) == [4, -1, -1] and unet["sample"].data_type == pb2.TYPE_FP32
    assert list(unet["timestep"].dims) == [1] and list(unet["timestep"].reshape.shape) == []
    assert list(unet["encoder_hidden_states"].dims) == [-1, 32]  # 77 * k tokens, k = 1..3 (--max-prompt-chunks)
    te = _model_config(repo / "text_encoder" / "config.pbtxt")
    assert te.input[0].data_type == pb2.TYPE_INT64 and list(te.input[0].dims) == [77]


def test_pipeline_config_parses(repo: Path) -> None:
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] is not installed")
    cfg = _model_config(repo / "pipeline" / "config.pbtxt")
    assert cfg.backend == "python" and cfg.max_batch_size == 0
    inputs = {i.name: i for i in cfg.input}
    assert list(inputs) == list(triton_model.FIELDS)
    assert inputs["prompt"].data_type == pb2.TYPE_STRING and not inputs["prompt"].optional
    assert inputs["seed"].data_type == pb2.TYPE_INT64 and inputs["seed"].optional
    assert inputs["guidance_scale"].data_type == pb2.TYPE_FP32
    assert cfg.output[0].name == "image" and cfg.output[0].data_type == pb2.TYPE_UINT8
    assert list(cfg.output[0].dims) == [-1, -1, 3]


def _plan_artifact(tiny_artifact: Path, art: Path, backend: str, build: Callable[[str], dict[str, Any]]) -> Path:
    """A copy of the tiny artifact made to look like a ``backend`` one: a 4-byte plan per component with
    ``build(name)`` as its build facts, listed and resealed."""
    shutil.copytree(tiny_artifact, art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest.update(backend=backend, device="cuda")
    for name, entry in manifest["components"].items():
        entry["plan"] = f"{name}/model.plan"
        entry["build"] = build(name)
        (art / entry["plan"]).write_bytes(b"plan")
        manifest["files"][entry["plan"]] = artifacts.file_entry(art, entry["plan"])
    artifacts.write_manifest(art, manifest)
    return art


def test_tensorrt_artifact_exports_plans_on_gpu(tiny_artifact: Path, tmp_path: Path) -> None:
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] is not installed")
    art = _plan_artifact(tiny_artifact, tmp_path / "art", "tensorrt",
                         lambda name: {"tensorrt": "10.8.0.43", "compute_capability": "9.0"})
    code, out = _invoke("export-triton", art, tmp_path / "repo", "--prefix", "sd_", "--instances", "2")
    assert code == 0, out
    cfg = _model_config(tmp_path / "repo" / "sd_unet" / "config.pbtxt")
    assert cfg.name == "sd_unet" and cfg.platform == "tensorrt_plan"
    assert [(g.kind, g.count) for g in cfg.instance_group] == [(pb2.ModelInstanceGroup.KIND_GPU, 2)]
    assert (tmp_path / "repo" / "sd_unet" / "1" / "model.plan").read_bytes() == b"plan"
    facts = json.loads((tmp_path / "repo" / "sd_pipeline" / "1" / "pipeline.json").read_text())
    assert facts["models"] == {"text_encoder": "sd_text_encoder", "unet": "sd_unet", "vae_decoder": "sd_vae_decoder"}


def test_export_refuses_a_damaged_artifact_and_existing_models(tiny_artifact: Path, repo: Path, tmp_path: Path) -> None:
    code, out = _invoke("export-triton", tiny_artifact, repo)
    assert code == 2 and "exist; pass --overwrite or use --prefix" in out
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    (art / "unet" / "model.onnx").write_bytes(b"x")
    code, out = _invoke("export-triton", art, tmp_path / "r")
    assert code == 3 and "unet/model.onnx: size 1 !=" in out and not (tmp_path / "r").exists()



@pytest.mark.parametrize("where", ["artifact", "inside", "model folder"])
def test_export_refuses_a_repository_over_the_artifact(tiny_artifact: Path, tmp_path: Path, where: str) -> None:
    """Into the sealed artifact, or with --overwrite over it (that deleted its engines before copying them)."""
    art = tmp_path / "repo" / "unet" if where == "model folder" else tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    repo = {"artifact": art, "inside": art / "triton", "model folder": tmp_path / "repo"}[where]
    code, out = _invoke("export-triton", art, repo, "--overwrite")
    assert code == 2
    assert out.strip() == (f"error: REPO_DIR {repo} overlaps the artifact {art}; write the Triton repository "
                           "elsewhere (e.g. model_repository)")
    assert _invoke("verify", art)[0] == 0 and not (art / "triton").exists()



def test_export_refuses_a_repository_inside_another_artifact(tiny_artifact: Path, tmp_path: Path) -> None:
    """`export-triton A B/repo` with B another artifact wrote the repository into B (exit 0): verify B then failed."""
    other = tmp_path / "other"
    shutil.copytree(tiny_artifact, other)
    repo = other / "repo"
    code, out = _invoke("export-triton", tiny_artifact, repo)
    assert code == 2, out
    assert out.strip() == (f"error: REPO_DIR {repo} lies inside the artifact folder {other}, which is sealed: its "
                           "manifest lists every file, and verify reports any other; write the Triton repository "
                           "elsewhere (e.g. model_repository)")
    assert _invoke("verify", other)[0] == 0 and not repo.exists()


def test_export_changes_nothing_when_it_fails(tiny_artifact: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A file where a model folder goes, and a failure part way: it left the models written before (exit 2)."""
    from diffusion_trt.serve import triton_repo

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "unet").write_text("x")
    code, out = _invoke("export-triton", tiny_artifact, repo, "--overwrite")
    assert code == 2
    assert out.strip() == f"error: {repo / 'unet'}: a file where a model folder goes; remove it or use --prefix"
    assert sorted(p.name for p in repo.iterdir()) == ["unet"]
    (repo / "unet").unlink()
    assert _invoke("export-triton", tiny_artifact, repo)[0] == 0
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*"))

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device", str(repo / "pipeline"))

    monkeypatch.setattr(triton_repo, "_write_pipeline_model", full)
    code, out = _invoke("export-triton", tiny_artifact, repo, "--overwrite")
    assert code == 2 and "No space left on device" in out
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == before  # the old models, nothing staged


def test_export_stages_outside_the_repository_and_cleans_leftovers(tiny_artifact: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24, item 8: `kill -9` left REPO/.diffusion-trt-export-*, which the next export neither reported nor
    removed and tritonserver tried to load as a model (it takes every folder of the repository, hidden ones too)."""
    import subprocess

    from diffusion_trt.serve import triton_repo

    repo = tmp_path / "repo"
    (repo / ".diffusion-trt-export-k1ll3d9x" / "unet" / "1").mkdir(parents=True)  # a kill -9 of the old layout
    dead = subprocess.Popen(["true"])
    dead.wait()
    beside = tmp_path / f".repo.diffusion-trt-export-{dead.pid}-abc123"  # a kill -9 of this version's layout
    (beside / "unet").mkdir(parents=True)
    seen: list[list[str]] = []
    real = triton_repo._write_pipeline_model

    def spying(root: Path, manifest: Mapping[str, Any], folder: Path, *args: Any) -> None:
        seen.append(sorted(p.name for p in repo.iterdir()))  # the repository while the models are being written
        assert folder.parent.parent == tmp_path, folder  # staged beside the repository, on its file system
        real(root, manifest, folder, *args)

    monkeypatch.setattr(triton_repo, "_write_pipeline_model", spying)
    code, out = _invoke("export-triton", tiny_artifact, repo)
    assert code == 0, out
    assert seen == [[]], "a folder Triton would load stood in the repository during the export"
    assert sorted(p.name for p in repo.iterdir()) == ["pipeline", "text_encoder", "unet", "vae_decoder",
                                                      "vae_encoder"]
    assert not beside.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["repo"]
    assert f"warning: removing {repo / '.diffusion-trt-export-k1ll3d9x'}, left by an interrupted export-triton" in out
    assert f"warning: removing {beside}, left by an interrupted export-triton" in out


def test_export_refuses_a_symlinked_model_folder_before_changing_anything(tiny_artifact: Path, tmp_path: Path
                                                                          ) -> None:
    """Issue 24, item 8: with --overwrite, a model folder that is a symbolic link failed after other models were
    already replaced."""
    repo = tmp_path / "repo"
    assert _invoke("export-triton", tiny_artifact, repo)[0] == 0
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(repo / "unet"), elsewhere)
    (repo / "unet").symlink_to(elsewhere)
    before = {str(p.relative_to(repo)): (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in repo.rglob("*")}
    code, out = _invoke("export-triton", tiny_artifact, repo, "--overwrite")
    assert code == 2
    assert out.strip() == (f"error: {repo / 'unet'} (to {elsewhere}): a symbolic link where a model folder goes; "
                           "export-triton replaces model folders whole and does not replace links: remove the link or "
                           "use --prefix (nothing was changed)")
    after = {str(p.relative_to(repo)): (p.lstat().st_ino, p.lstat().st_mtime_ns) for p in repo.rglob("*")}
    assert after == before and (repo / "unet").is_symlink()


def test_tensorrt_rtx_artifact_is_refused_with_the_reason(tiny_artifact: Path, tmp_path: Path) -> None:
    """Issue 23: `export-triton` on a TensorRT-RTX artifact died with KeyError: 'tensorrt-rtx' (exit 1). Triton's
    TensorRT backend loads plans with libnvinfer; a TensorRT-RTX plan needs the TensorRT-RTX runtime: exit 2."""
    art = _plan_artifact(tiny_artifact, tmp_path / "art", "tensorrt-rtx", lambda name: {
        "library": "tensorrt-rtx", "tensorrt": "1.2.0.54", "compute_capabilities": ["8.9"],
        "runtime_cache": f"{name}.runtime-cache", "plan_sha256": "0" * 64, "plan_bytes": 4})
    assert _invoke("verify", art, "--no-host")[0] == 0, "the fake RTX artifact should be a valid one"
    code, out = _invoke("export-triton", art, tmp_path / "repo")
    assert code == 2, out
    assert out.strip() == (f"error: {art} is a TensorRT-RTX artifact: Triton's TensorRT backend loads plans with "
                           "TensorRT (libnvinfer), and a TensorRT-RTX plan needs the TensorRT-RTX runtime, which no "
                           "Triton backend has; serve it with `diffusion-trt serve`, or compile with --backend "
                           "tensorrt (or ort) for a Triton repository")
    assert not (tmp_path / "repo").exists()


# -- the pipeline model's pure code ----------------------------------------------------------------------------


def _load_model_py(repo: Path) -> ModuleType:
    path = repo / "pipeline" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("exported_pipeline_model", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_py_imports_nothing_from_diffusion_trt(repo: Path) -> None:
    tree = ast.parse((repo / "pipeline" / "1" / "model.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(n.startswith(("diffusion_trt", ".")) for n in names), names
    module = _load_model_py(repo)  # imports without Triton (triton_python_backend_utils only inside methods)
    assert hasattr(module, "TritonPythonModel") and module.FIELDS == triton_model.FIELDS


CONFIG = {"model": {"vae_scale_factor": 8, "default_height": 64, "default_width": 64},
          "profile": {"batch": [1, 1, 4], "height": [32, 64, 128], "width": [32, 64, 128]}}


def _b(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=object)


@pytest.mark.parametrize(
    ("inputs", "field", "message"),
    [
        ({}, "prompt", "prompt is required"),
        ({"negative_prompt": _b("x")}, "prompt", "prompt is required"),
        ({"prompt": _b("x"), "steps": np.array([0], np.int32)}, "steps", "steps=0 must be in 1..150"),
        ({"prompt": _b("x"), "height": np.array([7], np.int32)}, "height",
         r"height=7 must be a multiple of 8 in 32\.\.128 \(the engines' profile\); use 32"),
        ({"prompt": _b("x" * 10_000)}, "prompt", "prompt has 10000 characters; at most 2000"),
        ({"prompt": _b("x"), "steps": np.array([3.0], np.float32)}, "steps", "steps must be INT32, got float32"),
        ({"prompt": np.array([1], np.int64)}, "prompt", "prompt must be BYTES, got int64"),
        ({"prompt": _b("x"), "seed": np.array([-1], np.int64)}, "seed", "seed=-1 must be in 0"),
        ({"prompt": _b("x"), "guidance_scale": np.array([np.nan], np.float32)}, "guidance_scale", "guidance_scale=nan"),
        ({"prompt": _b("x"), "width": np.array([1024], np.int32)}, "width", r"width=1024 .* use 128"),
        ({"prompt": np.array([b"a", b"b"], dtype=object)}, "prompt", r"prompt must hold one value, got shape \[2\]"),
        ({"prompt": _b("x"), "sampler": _b("y")}, "sampler", "sampler is not an input of this model"),
        ({"prompt": _b("a ((cat:100))")}, "prompt", r"prompt gives 'cat' the weight 110, beyond ±100"),
        ({"prompt": _b("x"), "negative_prompt": _b("(((a:10):10):10)")}, "negative_prompt",
         r"negative_prompt gives 'a' the weight 1000, beyond ±100 .* e\.g\. \(x:1\.5\)$"),
    ],
)
def test_parse_request_names_the_field(inputs: Mapping[str, np.ndarray], field: str, message: str) -> None:
    with pytest.raises(RequestError, match=message) as err:
        parse_request(inputs, CONFIG)
    assert err.value.field == field and str(err.value).startswith(field)


def test_parse_request_defaults() -> None:
    params = parse_request({"prompt": _b("a cat")}, CONFIG)
    assert params == {"prompt": "a cat", "negative_prompt": "", "seed": 0, "steps": 30, "guidance_scale": 7.5,
                      "height": 64, "width": 64}


def test_sdxl_requests_default_to_sdxl_guidance(tiny_artifact: Path) -> None:
    """serve and export-triton hand parse_request the defaults of the artifact's pipeline kind (they gave SDXL 7.5):
    5.0 for SDXL, as diffusers' StableDiffusionXLPipeline and EnginePipeline; SD stays 7.5."""
    from diffusion_trt.artifact.folder import read_manifest
    from diffusion_trt.artifact.manifest import Manifest
    from diffusion_trt.runtime.generation_args import serve_defaults
    from diffusion_trt.serve.triton_repo import PIPELINE_ENGINES, pipeline_facts, request_facts

    raw = read_manifest(tiny_artifact)
    sd = Manifest.from_json(raw)
    sdxl = Manifest.from_json({**raw, "model": {**raw["model"], "architecture": "sdxl"}})
    models = {c: c for c in PIPELINE_ENGINES}
    for facts in (request_facts(sdxl, {"max_steps": 100}), pipeline_facts(sdxl, models)):
        assert parse_request({"prompt": _b("a cat")}, facts)["guidance_scale"] == 5.0
    for facts in (request_facts(sd), pipeline_facts(sd, models)):
        assert parse_request({"prompt": _b("a cat")}, facts)["guidance_scale"] == 7.5
    # model.py's own fallback (a pipeline.json without defaults) is the SD table's, copied: it imports nothing of ours
    assert triton_model.DEFAULTS == serve_defaults("sd")


def test_bls_loop_gives_the_images_of_engine_pipeline(repo: Path, tiny_artifact: Path) -> None:
    """model.py's loop, with ORT sessions on the repository's model files in place of BLS calls."""
    import onnxruntime as ort

    from diffusion_trt.runtime import EnginePipeline

    module = _load_model_py(repo)
    config, tokenizer, scheduler = module.load_pipeline_assets(repo / "pipeline" / "1")
    sessions = {n: ort.InferenceSession(str(repo / n / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
                for n in ("text_encoder", "unet", "vae_decoder")}
    calls: list[str] = []

    def infer(model: str, inputs: Mapping[str, np.ndarray], output: str) -> np.ndarray:
        calls.append(model)
        return sessions[model].run([output], dict(inputs))[0]

    request = {"prompt": _b("an ink painting of a mountain"), "negative_prompt": _b("blurry"),
               "seed": np.array([7], np.int64), "steps": np.array([4], np.int32),
               "guidance_scale": np.array([6.0], np.float32), "height": np.array([48], np.int32)}
    params = module.parse_request(request, config)
    fresh = type(scheduler).from_config(scheduler.config)
    image = module.text_to_image(params, config, tokenizer, fresh, infer)
    assert image.shape == (48, 64, 3) and image.dtype == np.uint8
    assert calls == ["text_encoder"] + ["unet"] * len(fresh.timesteps) + ["vae_decoder"]  # PNDM: 4 steps, 5 calls
    with EnginePipeline.from_artifacts(tiny_artifact) as pipe:
        expected = pipe("an ink painting of a mountain", negative_prompt="blurry", num_inference_steps=4,
                        guidance_scale=6.0, seed=7, height=48, width=64, progress=False).images[0]
    diff = np.abs(image.astype(int) - np.asarray(expected).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())


LONG = "an ink painting of misty mountains above a quiet lake, pine trees on the shore, a small boat, " * 4


def test_prompt_modules_are_the_runtimes_copied_beside_model_py(repo: Path) -> None:
    from diffusion_trt.runtime import float_range, prompt_encoding, prompt_syntax

    prompts = repo / "pipeline" / "1" / triton_model.PROMPT_MODULES
    for module in (float_range, prompt_syntax, prompt_encoding):
        path = Path(module.__file__)
        assert (prompts / path.name).read_bytes() == path.read_bytes()
    config = json.loads((repo / "pipeline" / "1" / "pipeline.json").read_text())
    assert config["max_prompt_chunks"] == 3 and config["text_encoder_rows"] == [1, 8]  # compile's defaults


def test_prompt_modules_load_without_diffusion_trt(repo: Path) -> None:
    """On a Triton host no diffusion-trt is installed: the copies in prompts/ import only each other, torch and the
    standard library (a copied module importing ``..errors`` broke every BLS request once)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['diffusion_trt'] = None; "  # any import of diffusion_trt now fails
            "import importlib.util as u, pathlib; p = pathlib.Path(sys.argv[1]); "
            "spec = u.spec_from_file_location('model', p / 'model.py'); m = u.module_from_spec(spec); "
            "spec.loader.exec_module(m); s = m.prompt_syntax(p / 'model.py'); "
            "print(s.overweight(s.parse_prompt('(a:1000)', 'a1111')))")
    done = subprocess.run([sys.executable, "-c", code, str(repo / "pipeline" / "1")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1000" in done.stdout


def test_bls_loop_reads_long_weighted_prompts_as_engine_pipeline(repo: Path, tiny_artifact: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of two 75-token chunks with weights and BREAK, and a one-chunk negative: the same chunks, weights and
    padding as EnginePipeline (the runtime's modules, loaded from the repository's copies), the UNet fed 2 x 77."""
    import sys

    import onnxruntime as ort

    from diffusion_trt.runtime import EnginePipeline

    for name in [m for m in sys.modules if m.startswith("_diffusion_trt_prompts")]:
        monkeypatch.delitem(sys.modules, name)  # load them afresh, from the copies
    module = _load_model_py(repo)
    config, tokenizer, scheduler = module.load_pipeline_assets(repo / "pipeline" / "1")
    sessions = {n: ort.InferenceSession(str(repo / n / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
                for n in ("text_encoder", "unet", "vae_decoder")}
    contexts: list[tuple[int, ...]] = []

    def infer(model: str, inputs: Mapping[str, np.ndarray], output: str) -> np.ndarray:
        if model == "unet":
            contexts.append(inputs["encoder_hidden_states"].shape)
        return sessions[model].run([output], dict(inputs))[0]

    prompt, negative = LONG + "BREAK (red seal:1.3), [fog]", "(blurry)"
    params = {"prompt": prompt, "negative_prompt": negative, "seed": 5, "steps": 3, "guidance_scale": 6.0,
              "height": 64, "width": 64}
    image = module.text_to_image(params, config, tokenizer, type(scheduler).from_config(scheduler.config), infer)
    loaded = sys.modules["_diffusion_trt_prompts.prompt_encoding"].__file__
    assert Path(loaded).parent == repo / "pipeline" / "1" / triton_model.PROMPT_MODULES
    assert set(contexts) == {(2, 3 * 77, 32)}  # LONG is two chunks, BREAK starts a third
    with EnginePipeline.from_artifacts(tiny_artifact) as pipe:
        expected = pipe(prompt, negative_prompt=negative, num_inference_steps=3, guidance_scale=6.0, seed=5,
                        height=64, width=64, progress=False).images[0]
        plain = pipe(prompt, negative_prompt=negative, num_inference_steps=3, guidance_scale=6.0, seed=5,
                     height=64, width=64, progress=False, prompt_syntax="plain").images[0]
    diff = np.abs(image.astype(int) - np.asarray(expected).astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())
    assert np.abs(image.astype(int) - np.asarray(plain).astype(int)).max() > 1  # the weights count


@pytest.mark.parametrize(("rows", "limits", "calls"), [(7, [1, 3], [3, 3, 1]), (1, [2, 8], [2])],
                         ids=["split-to-the-max", "padded-to-the-min"])
def test_text_encoder_rows_follow_its_batch_range(rows: int, limits: list[int], calls: list[int]) -> None:
    seen: list[int] = []

    def infer(model: str, inputs: Mapping[str, np.ndarray], output: str) -> np.ndarray:
        seen.append(len(inputs["input_ids"]))
        assert inputs["embedding_vectors"].shape == (len(inputs["input_ids"]), 4, 8)
        return inputs["input_ids"][:, :, None].astype(np.float32).repeat(8, axis=2)

    ids = np.arange(rows * 77, dtype=np.int64).reshape(rows, 77)
    config = {"text_encoder_rows": limits, "embedding_vectors": [4, 8], "models": {"text_encoder": "te"},
              "dtypes": {"text_encoder": {"embedding_vectors": "float32"}}}
    out = triton_model._text_encoder_rows(ids, config, infer)
    assert seen == calls and np.array_equal(out[..., 0], ids.astype(np.float32))


def test_a_prefix_that_makes_bad_model_names_is_refused(tiny_artifact: Path, tmp_path: Path) -> None:
    code, text = _invoke("export-triton", tiny_artifact, tmp_path / "repo", "--prefix", "bad name/")
    assert code == 2 and "would make model names Triton cannot load" in text
    assert not (tmp_path / "repo").exists()


def test_pipeline_queue_is_bounded(repo: Path, tiny_artifact: Path, tmp_path: Path) -> None:
    """The pipeline model waits for at most --max-queue requests (more: UNAVAILABLE) and rejects one that waited
    --queue-timeout-s (issue 14, item 13); before: no dynamic_batching block, so an unbounded queue."""
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] is not installed")
    policy = _model_config(repo / "pipeline" / "config.pbtxt").dynamic_batching.default_queue_policy
    assert policy.max_queue_size == 64 and policy.default_timeout_microseconds == 60_000_000
    assert policy.allow_timeout_override and policy.timeout_action == pb2.ModelQueuePolicy.REJECT
    out = tmp_path / "repo"
    code, text = _invoke("export-triton", tiny_artifact, out, "--max-queue", "8", "--queue-timeout-s", "2.5")
    assert code == 0, text
    cfg = _model_config(out / "pipeline" / "config.pbtxt")
    assert cfg.max_batch_size == 0
    policy = cfg.dynamic_batching.default_queue_policy
    assert policy.max_queue_size == 8 and policy.default_timeout_microseconds == 2_500_000


def test_request_errors_are_invalid_argument(repo: Path) -> None:
    """model.py answers a request its rules refuse with INVALID_ARG (HTTP 400 / gRPC INVALID_ARGUMENT), one line
    (issue 14, item 11); before: the default code, INTERNAL (500)."""
    import sys
    import types

    class TritonError:
        INVALID_ARG = 3

        def __init__(self, message: str, code: int = 0) -> None:
            self.message, self.code = message, code

    class Tensor:
        def __init__(self, value: np.ndarray) -> None:
            self.value = value

        def as_numpy(self) -> np.ndarray:
            return self.value

    fake = types.SimpleNamespace(
        TritonError=TritonError,
        InferenceResponse=lambda output_tensors, error=None: types.SimpleNamespace(error=error),
        get_input_tensor_by_name=lambda request, name: None if name not in request else Tensor(request[name]),
    )
    module = _load_model_py(repo)
    model = module.TritonPythonModel()
    model.config = json.loads((repo / "pipeline" / "1" / "pipeline.json").read_text())
    sys.modules["triton_python_backend_utils"] = fake  # type: ignore[assignment]
    try:
        (response,) = model.execute([{"prompt": _b("x"), "steps": np.array([0], np.int32)}])
    finally:
        del sys.modules["triton_python_backend_utils"]
    assert response.error.code == TritonError.INVALID_ARG
    assert response.error.message == "steps=0 must be in 1..150; use e.g. 30"


def test_overwrite_refuses_to_replace_folders_that_are_no_triton_models(tiny_artifact: Path, tiny_pipeline_dir: Path,
                                                                        tmp_path: Path) -> None:
    """REPO_DIR a diffusers folder (a slip of the argument) with --overwrite: its unet/ and text_encoder/, the model's
    weights, were deleted and replaced by Triton models (exit 0)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_pipeline_dir, model)
    before = sorted(str(p.relative_to(model)) for p in model.rglob("*"))
    code, out = _invoke("export-triton", tiny_artifact, model, "--overwrite")
    assert code == 2, out
    assert out.strip() == (f"error: {model / 'text_encoder'}, {model / 'unet'}: a folder that is no Triton model (no "
                           "config.pbtxt) where a model folder goes; --overwrite replaces only models (is REPO_DIR the "
                           "right folder?): choose another REPO_DIR or use --prefix (nothing was changed)")
    assert sorted(str(p.relative_to(model)) for p in model.rglob("*")) == before
    (tmp_path / "repo" / "unet").mkdir(parents=True)  # an empty folder holds nothing to lose: replaced
    assert _invoke("export-triton", tiny_artifact, tmp_path / "repo", "--overwrite")[0] == 0

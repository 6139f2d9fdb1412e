"""compile org/name: a Hugging Face model id resolved through the local cache (HF_HUB_OFFLINE=1), as
diffusers' from_pretrained resolves it; the cache folder is built here (no hub is reachable).

The snapshot holds the tiny pipeline (seed 0) under the plain names and the same pipeline with seed 1 as the
``fp16`` variant files (``*.fp16.safetensors``; fp32 values, which is all the test needs): which weights were
compiled tells which files were read.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.cli import main
from diffusion_trt.compiler.frontend import compile_model
from diffusion_trt.compiler.hub import is_model_id
from diffusion_trt.config import CompileConfig

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TAGGED = "fedcba9876543210fedcba9876543210fedcba98"
FAST = CompileConfig(components=("text_encoder",))


@pytest.fixture(scope="module")
def seed1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from diffusion_trt.compiler.dummy import write_dummy_pipeline

    return write_dummy_pipeline(tmp_path_factory.mktemp("models") / "tiny-seed1", arch="tiny", seed=1)


@pytest.fixture(scope="module")
def hf_cache(tiny_pipeline_dir: Path, seed1_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """huggingface_hub's cache layout: models--org--tiny/{snapshots/<commit>/..., refs/main, refs/v1}."""
    cache = tmp_path_factory.mktemp("hf-cache")
    repo = cache / "models--org--tiny"
    for commit in (COMMIT, TAGGED):
        snap = repo / "snapshots" / commit
        shutil.copytree(tiny_pipeline_dir, snap)
        for variant in seed1_dir.rglob("*.safetensors"):
            rel = variant.relative_to(seed1_dir)
            shutil.copy(variant, snap / rel.parent / rel.name.replace(".safetensors", ".fp16.safetensors"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "refs" / "v1").write_text(TAGGED)
    return cache


def _onnx_sha(art: Path) -> str:
    return artifacts.read_manifest(art)["files"]["text_encoder/model.onnx"]["sha256"]


@pytest.fixture
def offline(hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_OFFLINE=1 with the cache above, for in-process calls (huggingface_hub reads its env at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_cache))
    return hf_cache


def test_is_model_id(tmp_path: Path) -> None:
    assert is_model_id("org/name") and is_model_id("stable-diffusion-v1-5/stable-diffusion-v1-5")
    assert not is_model_id("models/tiny/unet") and not is_model_id("name") and not is_model_id("/abs/path")
    (tmp_path / "org" / "name").mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert not is_model_id("org/name")  # a folder of that name here is a folder
    finally:
        os.chdir(cwd)


def test_compile_model_id_variant_offline_from_the_cache(hf_cache: Path, seed1_dir: Path, tmp_path: Path) -> None:
    """The CLI in a fresh process with HF_HUB_OFFLINE=1: --variant fp16 compiles the variant files, and the
    manifest records the id and the resolved commit."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hf_cache)}
    out = tmp_path / "art"
    proc = subprocess.run([sys.executable, "-m", "diffusion_trt.cli", "compile", "org/tiny", "--variant", "fp16",
                           "-o", str(out), "--components", "text_encoder", "--no-cache"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    source = artifacts.load_verified(out)["source"]
    assert source["hub"] == {"id": "org/tiny", "revision": "main", "commit": COMMIT, "variant": "fp16"}
    assert source["path"] == str(hf_cache / "models--org--tiny" / "snapshots" / COMMIT)
    direct = compile_model(seed1_dir, tmp_path / "direct", FAST)
    assert _onnx_sha(out) == _onnx_sha(direct)  # the seed-1 (variant) weights, not the plain ones


def test_compile_model_id_revision(offline: Path, tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """A tag resolves through refs/v1 to its commit; no variant reads the plain files."""
    out = compile_model("org/tiny", tmp_path / "art", FAST, revision="v1")
    manifest = artifacts.load_verified(out)
    assert manifest["source"]["hub"] == {"id": "org/tiny", "revision": "v1", "commit": TAGGED, "variant": None}
    direct = compile_model(tiny_pipeline_dir, tmp_path / "direct", FAST)
    assert _onnx_sha(out) == _onnx_sha(direct)


NOT_CACHED_FIX = "HF_HUB_OFFLINE=1: download it first (huggingface-cli download org/"


@pytest.mark.parametrize(
    ("args", "message", "fix"),
    [
        (["org/missing"], "model 'org/missing': there is no folder ", NOT_CACHED_FIX),
        (["org/missing"], "as a Hugging Face model id (revision main) it is not in the Hugging Face cache",
         NOT_CACHED_FIX),
        (["org/tiny", "--revision", "v9"], "(revision v9) it is not in the Hugging Face cache", NOT_CACHED_FIX),
        (["MODEL_DIR", "--revision", "main"], "--revision / --variant apply to a Hugging Face model id", "drop them"),
    ],
    ids=["not-a-folder", "not-cached", "unknown-revision", "revision-with-a-folder"],
)
def test_model_id_errors(offline: Path, tiny_pipeline_dir: Path, tmp_path: Path, args: list[str],
                         message: str, fix: str) -> None:
    args = [str(tiny_pipeline_dir) if a == "MODEL_DIR" else a for a in args]
    result = CliRunner().invoke(main, ["compile", *args, "-o", str(tmp_path / "art"), "--components",
                                       "text_encoder", "--no-cache"])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert message in errors[0] and fix in errors[0], errors[0]
    assert not (tmp_path / "art").exists()

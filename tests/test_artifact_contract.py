"""The artifact contract: manifest schema and seal, `inspect`, and `verify` catching every way a folder goes bad.

Each bad folder is a copy of the compiled tiny artifact with one thing changed; `verify` must name it (exit 3),
and `EnginePipeline.from_artifacts` must refuse it before reading anything outside the folder.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import onnx
import pytest
from click.testing import CliRunner

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.verify import verify_artifact
from diffusion_trt.cli import main
from diffusion_trt.errors import ArtifactError
from diffusion_trt.trt_compat import TrtHost


def _invoke(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture
def art(tiny_artifact: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny artifact, safe to damage."""
    dest = tmp_path / "art"
    shutil.copytree(tiny_artifact, dest)
    return dest


def _manifest(root: Path) -> dict[str, Any]:
    return json.loads((root / "manifest.json").read_text())


def _rehash(root: Path, manifest: dict[str, Any], *rels: str) -> None:
    for rel in rels:
        manifest["files"][rel] = artifacts.file_entry(root, rel)


def _load(root: Path, verify: bool = True) -> None:
    from diffusion_trt.runtime import EnginePipeline

    with EnginePipeline.from_artifacts(root, verify=verify):
        pass


# -- schema and seal ---------------------------------------------------------------------------------------


def test_compiled_manifest_matches_the_packaged_schema_and_is_sealed(tiny_artifact: Path) -> None:
    manifest = _manifest(tiny_artifact)
    schema = artifacts.manifest_schema()
    assert schema["properties"]["schema_version"] == {"const": artifacts.SCHEMA_VERSION}
    assert artifacts.manifest_problems(manifest) == []
    assert manifest[artifacts.SEAL_KEY] == artifacts.manifest_digest(manifest)
    assert list(manifest)[-1] == artifacts.SEAL_KEY
    assert set(schema["required"]) <= set(manifest)


def test_schema_rejects_bad_values_with_their_path(tiny_artifact: Path) -> None:
    manifest = _manifest(tiny_artifact)
    manifest["components"]["unet"]["inputs"][0]["dtype"] = "float8"
    manifest["profile"]["batch"] = [1, 2]
    del manifest["components"]["vae_decoder"]
    problems = artifacts.manifest_problems(artifacts.seal_manifest(manifest))
    text = "\n".join(problems)
    assert "components.unet.inputs[0].dtype: 'float8' is not one of" in text
    assert "profile.batch: [1, 2] is too short" in text
    assert "components: 'vae_decoder' is a required property" in text


@pytest.mark.parametrize("path", ["../outside.bin", "/etc/passwd", "unet/../../x", "C:/x", "a\\..\\b"])
def test_schema_rejects_paths_leaving_the_folder(tiny_artifact: Path, path: str) -> None:
    manifest = _manifest(tiny_artifact)
    manifest["components"]["unet"]["onnx"] = path
    manifest["files"][path] = {"sha256": "0" * 64, "size": 1}
    problems = artifacts.manifest_problems(artifacts.seal_manifest(manifest))
    assert any("components.unet.onnx" in p and "does not match" in p for p in problems), problems
    assert any(p.startswith("manifest.json files:") for p in problems), problems


# -- verify: intact ------------------------------------------------------------------------------------------


def test_verify_passes_a_fresh_artifact(tiny_artifact: Path) -> None:
    code, out = _invoke("verify", tiny_artifact)
    assert code == 0, out
    assert re.search(r": ok \(\d+ files, sha256 and size; runs on this machine\)", out)
    report = verify_artifact(tiny_artifact)
    assert report.ok and report.checked_files == len(_manifest(tiny_artifact)["files"])


# -- verify: each way a folder goes bad ------------------------------------------------------------------------


def test_verify_catches_a_flipped_byte(art: Path) -> None:
    path = art / "unet" / "model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    code, out = _invoke("verify", art)
    assert code == 3
    assert re.search(r"^problem: unet/model\.onnx: sha256 \w+… != \w+… in the manifest", out, re.M), out
    assert len([line for line in out.splitlines() if line.startswith("problem:")]) == 1
    code, out = _invoke("verify", art, "--no-hashes")  # same size: only the hash sees it
    assert code == 0, out


def test_verify_catches_a_deleted_component(art: Path) -> None:
    shutil.rmtree(art / "vae_decoder")
    code, out = _invoke("verify", art)
    assert code == 3
    assert "problem: vae_decoder/model.onnx: file is missing" in out
    with pytest.raises(ArtifactError, match=r"vae_decoder/model\.onnx: file is missing"):
        _load(art, verify=False)


def test_verify_catches_a_hand_edited_manifest(art: Path) -> None:
    manifest = _manifest(art)
    manifest["profile"]["height"] = [32, 64, 1024]  # valid under the schema, but a lie
    (art / "manifest.json").write_text(json.dumps(manifest, indent=2))
    code, out = _invoke("verify", art)
    assert code == 3
    assert "problem: manifest.json was changed after it was written: manifest_sha256" in out
    with pytest.raises(ArtifactError, match="hand-edited manifest is not trusted"):
        _load(art, verify=False)
    code, out = _invoke("inspect", art)
    assert code == 3 and "changed after it was written" in out


def test_verify_catches_a_manifest_entry_removed_by_hand(art: Path) -> None:
    manifest = _manifest(art)
    del manifest["components"]["unet"]
    (art / "manifest.json").write_text(json.dumps(manifest))
    code, out = _invoke("verify", art)
    assert code == 3
    assert "problem: manifest.json components: 'unet' is a required property" in out
    assert "changed after it was written" in out


def test_verify_catches_an_unlisted_file(art: Path) -> None:
    (art / "tokenizer" / "added_tokens.json").write_text("{}")
    code, out = _invoke("verify", art)
    assert code == 3 and "problem: tokenizer/added_tokens.json: not listed in the manifest" in out


def _fabricate_trt(art: Path, compute_capability: str, tensorrt: str = "10.8.0.43") -> None:
    """Turn the copy into a TensorRT artifact whose plans say they were built for ``compute_capability``."""
    manifest = _manifest(art)
    manifest.update(backend="tensorrt", device="cuda")
    for name, entry in manifest["components"].items():
        entry["plan"] = f"{name}/model.plan"
        entry["build"] = {"tensorrt": tensorrt, "compute_capability": compute_capability, "gpu": "NVIDIA A10"}
        (art / entry["plan"]).write_bytes(b"fake plan " + name.encode())
        _rehash(art, manifest, entry["plan"])
    artifacts.write_manifest(art, manifest)


def test_verify_catches_a_plan_for_another_compute_capability(art: Path) -> None:
    _fabricate_trt(art, "8.6")
    h200 = TrtHost(tensorrt="10.8.0.43", compute_capability="9.0", gpu="NVIDIA H200")
    report = verify_artifact(art, trt_host=h200)
    assert len(report.problems) == 4, report.problems
    assert all("built for compute capability 8.6 (NVIDIA A10) but this GPU is 9.0" in p for p in report.problems)
    code, out = _invoke("verify", art, "--tensorrt", "10.8.0.43", "--compute-capability", "9.0")
    assert code == 3 and "problem: engine 'unet' (unet/model.plan) was built for compute capability 8.6" in out
    code, out = _invoke("verify", art, "--tensorrt", "10.9.0.34", "--compute-capability", "8.6")
    assert code == 3 and "was built with TensorRT 10.8.0.43 but this machine has TensorRT 10.9.0.34" in out
    a10g = TrtHost(tensorrt="10.8.0.43", compute_capability="8.6", gpu="NVIDIA A10G")
    report = verify_artifact(art, trt_host=a10g)
    assert report.ok and len(report.warnings) == 4  # same CC, another GPU: loads, with a warning


def test_verify_without_tensorrt_says_so(art: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("this machine has a tensorrt package")
    _fabricate_trt(art, "9.0")
    code, out = _invoke("verify", art)
    assert code == 3 and "problem: TensorRT is not importable here" in out
    code, out = _invoke("verify", art, "--no-host")
    assert code == 0, out


def test_verify_catches_a_cuda_artifact_without_the_cuda_provider(art: Path) -> None:
    manifest = _manifest(art)
    manifest["device"] = "cuda"
    artifacts.write_manifest(art, manifest)
    report = verify_artifact(art, providers=["CPUExecutionProvider"])
    assert report.problems == [
        "the artifact runs on cuda with ONNX Runtime's CUDAExecutionProvider, which this machine lacks "
        "(available: CPUExecutionProvider); install onnxruntime-gpu with a matching CUDA, or recompile for "
        "--device cpu"
    ]


def test_verify_catches_a_symlink_leaving_the_folder(art: Path, tmp_path: Path) -> None:
    # same bytes as the real file, so every sha256 still matches: only the link check sees it
    outside = tmp_path / "outside_tokenizer.json"
    shutil.copy(art / "tokenizer" / "tokenizer.json", outside)
    (art / "tokenizer" / "tokenizer.json").unlink()
    (art / "tokenizer" / "tokenizer.json").symlink_to(outside)
    code, out = _invoke("verify", art)
    assert code == 3
    assert re.search(r"problem: tokenizer/tokenizer\.json.* outside the artifact folder", out), out
    with pytest.raises(ArtifactError, match="outside the artifact folder"):
        _load(art)


def test_verify_catches_a_manifest_path_leaving_the_folder(art: Path, tmp_path: Path) -> None:
    (tmp_path / "evil.onnx").write_bytes((art / "unet" / "model.onnx").read_bytes())
    manifest = _manifest(art)
    manifest["components"]["unet"]["onnx"] = "../evil.onnx"
    manifest["files"]["../evil.onnx"] = manifest["files"]["unet/model.onnx"]
    artifacts.write_manifest(art, manifest)
    code, out = _invoke("verify", art)
    assert code == 3
    assert "problem: manifest.json components.unet.onnx: '../evil.onnx' does not match" in out
    assert "problem: manifest path '../evil.onnx' points outside the artifact folder" in out
    with pytest.raises(ArtifactError, match=r"components\.unet\.onnx: '\.\./evil\.onnx' does not match"):
        _load(art, verify=False)


def _point_external_data(art: Path, location: str) -> None:
    """Make the UNet's first initializer external data at ``location``; re-list and re-seal (a forged artifact)."""
    path = art / "unet" / "model.onnx"
    model = onnx.load(str(path))
    tensor = max(model.graph.initializer, key=lambda t: len(t.raw_data))
    size = len(tensor.raw_data)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(size))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    path.write_bytes(model.SerializeToString())
    manifest = _manifest(art)
    _rehash(art, manifest, "unet/model.onnx")
    artifacts.write_manifest(art, manifest)


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("../../secret.bin", r"external data location '\.\./\.\./secret\.bin' points outside the artifact folder"),
        ("/etc/hostname", r"external data location '/etc/hostname' points outside the artifact folder"),
        ("weights.bin", r"external data 'unet/weights\.bin' is a symbolic link leading outside"),
    ],
)
def test_verify_catches_external_data_leaving_the_folder(art: Path, tmp_path: Path, location: str,
                                                         message: str) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * (1 << 20))
    if location == "weights.bin":
        (art / "unet" / "weights.bin").symlink_to(secret)
    _point_external_data(art, location)
    assert artifacts.onnx_external_data_locations(art / "unet" / "model.onnx") == [location]
    code, out = _invoke("verify", art)
    assert code == 3
    assert re.search("problem: unet/model.onnx: " + message, out), out
    if location == "weights.bin":  # loading walks the folder first (ArtifactReader.open): the link itself is refused
        message = r"unet/weights\.bin: symbolic link to .*secret\.bin, outside the artifact folder"
    for verify in (True, False):  # refused before ONNX Runtime opens the file, with or without hashes
        with pytest.raises(ArtifactError, match=message):
            _load(art, verify=verify)


def test_external_data_inside_the_folder_must_be_listed(art: Path) -> None:
    (art / "unet" / "model.onnx.data").write_bytes(b"\0" * (1 << 20))
    _point_external_data(art, "model.onnx.data")
    problems = artifacts.component_file_problems(art, _manifest(art))
    assert problems == [
        "unet/model.onnx: external data 'unet/model.onnx.data' is not listed in the manifest, so its sha256 "
        "cannot be checked; recompile the artifact"
    ]


def test_verify_reports_a_missing_folder(tmp_path: Path) -> None:
    code, out = _invoke("verify", tmp_path / "nothing")
    assert code == 3 and "artifact folder does not exist" in out
    (tmp_path / "a.png").write_bytes(b"x")
    code, out = _invoke("verify", tmp_path / "a.png")
    assert code == 3 and "a.png: a file, not an artifact folder" in out and "does not exist" not in out


# -- inspect ---------------------------------------------------------------------------------------------------


def test_inspect_text(tiny_artifact: Path) -> None:
    code, out = _invoke("inspect", tiny_artifact)
    assert code == 0, out
    assert re.search(r"^backend    ort on cpu, fp32; compiled in [\d.]+ s from StableDiffusionPipeline", out, re.M)
    assert "profile    batch 1..4 (opt 1), height 32..128 (opt 64), width 32..128 (opt 64)" in out
    assert re.search(r"^  unet +fp32  unet/model\.onnx  [\d.]+ (KiB|MiB)$", out, re.M), out
    assert re.search(r"^      in     sample float32 \[B2, 4, h, w\]  min \[1, 4, 4, 4\]", out, re.M)
    assert re.search(r"passes .*fuse_attention\(Attention=32", out)
    assert "fuse_layer_norm(" not in out.split("  unet")[1].split("  vae_decoder")[0]  # zero counts are left out
    assert "build  providers=['CPUExecutionProvider'], test_loaded=True" in out
    assert re.search(r"^tools      diffusion-trt [\d.]+, torch ", out, re.M)


def test_inspect_json(tiny_artifact: Path) -> None:
    code, out = _invoke("inspect", tiny_artifact, "--json")
    assert code == 0, out
    summary = json.loads(out)
    manifest = _manifest(tiny_artifact)
    assert summary["total_bytes"] == sum(e["size"] for e in manifest["files"].values())
    unet = summary["components"]["unet"]
    assert unet["bytes"] == manifest["files"]["unet/model.onnx"]["size"]
    assert all(all(v for v in counts.values()) for counts in unet["passes"].values())
    assert summary["profile"]["batch"] == {"min": 1, "opt": 1, "max": 4}
    assert summary["tools"]["onnx"] == onnx.__version__

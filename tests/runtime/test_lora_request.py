"""LoRA per request on an ONNX Runtime artifact compiled with --refittable (runtime/lora_slots.py): no recompile.

The LoRAs are tests/compiler/test_lora.py's (peft-key and kohya files made with random low-rank matrices on the
tiny UNet and text encoder). Parity is against ``compile --lora`` (the merged compile) and, for several LoRAs at
once, against diffusers' ``load_lora_weights`` + ``fuse_lora`` of each (which the merged compile equals,
tests/compiler/test_lora.py). CPU fp32.

Those LoRAs have a layer on each ResNet ``conv1`` (a 3x3 Conv), so most tests here run on an artifact compiled with
``--refittable --refit-convs`` (spatial Conv weights as inputs too); the default ``--refittable`` artifact (Linear
and 1x1 Conv weights only, NHWC-safe on CUDA) is tested with the same LoRAs less their conv1 layers, and refuses
those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from safetensors.torch import load_file, save_file

from diffusion_trt.cli import main
from diffusion_trt.compiler.pipeline import compile_pipeline
from diffusion_trt.config import CompileConfig
from diffusion_trt.errors import LoraError
from diffusion_trt.runtime import EnginePipeline
from tests.compiler.test_lora import _diffusers_with, _theirs, make_lora

pytest.importorskip("peft", reason="the reference merge needs peft (pip install -e '.[test]')")

CALL: dict[str, Any] = {"prompt": "a watercolor fox", "num_inference_steps": 4, "output_type": "np", "seed": 5,
                        "progress": False}
COMPONENTS = ("text_encoder", "unet", "vae_decoder")


@pytest.fixture(scope="module")
def loras(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("loras")
    return {
        "peft": make_lora(tiny_pipeline_dir, d / "style.safetensors", "peft", seed=1),
        "kohya": make_lora(tiny_pipeline_dir, d / "kohya_detail.safetensors", "kohya", seed=2),
    }


@pytest.fixture(scope="module")
def refittable(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline compiled for ORT CPU with --refittable --refit-convs and no LoRA (every Conv weight an
    input: the test LoRAs' conv1 layers apply)."""
    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("artifacts") / "tiny-refit",
                            CompileConfig(refittable=True, refit_convs=True, components=COMPONENTS))


@pytest.fixture(scope="module")
def refittable_nhwc(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline compiled for ORT CPU with --refittable only (spatial Conv weights constant)."""
    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("artifacts") / "tiny-refit-nhwc",
                            CompileConfig(refittable=True, components=COMPONENTS))


@pytest.fixture(scope="module")
def linear_lora(loras: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The peft LoRA less its conv1 (3x3) layers: attention, proj_in and text-encoder layers, the usual LoRA."""
    tensors = {k: v for k, v in load_file(str(loras["peft"])).items() if ".conv1." not in k}
    path = tmp_path_factory.mktemp("linear_lora") / "linear_only.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def base_image(refittable: Path) -> np.ndarray:
    with EnginePipeline.from_artifacts(refittable) as pipe:
        return pipe(**CALL).images


def test_weights_are_graph_inputs_with_their_base_values(refittable: Path) -> None:
    import onnx

    manifest = json.loads((refittable / "manifest.json").read_text())
    for comp in ("unet", "text_encoder"):
        entry = manifest["components"][comp]
        rmap = json.loads((refittable / entry["refit_map"]).read_text())
        graph = onnx.load(str(refittable / entry["onnx"])).graph
        inputs = {i.name for i in graph.input}
        inits = {i.name for i in graph.initializer}
        names = {e["initializer"] for e in rmap["weights"].values()}
        base = load_file(str(refittable / entry["weight_inputs"]))
        assert names and names <= inputs and not names & inits and set(base) == names
        assert entry["weight_inputs"] in manifest["files"]
        # readable by whoever may read the model (safetensors writes 0600; an artifact is served by other users)
        assert (refittable / entry["weight_inputs"]).stat().st_mode & 0o777 == \
            (refittable / entry["onnx"]).stat().st_mode & 0o777
    assert "weight_inputs" not in manifest["components"]["vae_decoder"]


def test_default_refittable_binds_no_spatial_conv_weight(refittable_nhwc: Path, refittable: Path) -> None:
    """--refittable alone: no Conv reads a graph input (the 1x1 ones are MatMuls over their weight inputs), the
    spatial Conv weights stay constants; the manifest says so and the runtime then keeps NHWC on CUDA, which it
    drops for --refit-convs."""
    import onnx

    from diffusion_trt.artifact.manifest import Manifest
    from diffusion_trt.runtime.pipeline import cuda_layout_options

    for art, spatial in ((refittable_nhwc, False), (refittable, True)):
        manifest = Manifest.read(art)
        entry = manifest.components["unet"]
        graph = onnx.load(str(art / str(entry.onnx))).graph
        inputs = {i.name for i in graph.input}
        conv_weights = {n.input[1] for n in graph.node if n.op_type == "Conv"}
        base = load_file(str(art / str(entry.weight_inputs)))
        rmap = json.loads((art / str(entry.refit_map)).read_text())
        kept = {w for w, e in rmap["weights"].items() if e["initializer"] not in base}
        assert bool(conv_weights & inputs) is spatial and bool(kept) is not spatial
        assert {rmap["weights"][w]["initializer"] for w in kept} <= conv_weights  # the constants: Conv kernels
        assert spatial or any(w.endswith("resnets.0.conv1.weight") for w in kept)
        assert any("proj_in" in w and e["initializer"] in inputs for w, e in rmap["weights"].items())
        assert entry.spatial_conv_inputs is spatial and not manifest.components["text_encoder"].spatial_conv_inputs
        options = cuda_layout_options("unet", "cuda", entry.spatial_conv_inputs)
        assert ("prefer_nhwc" in options) is not spatial, options


def test_default_refittable_lora_equals_the_merged_compile(
    tiny_pipeline_dir: Path, refittable_nhwc: Path, base_image: np.ndarray, linear_lora: Path, tmp_path: Path
) -> None:
    merged = compile_pipeline(tiny_pipeline_dir, tmp_path / "merged",
                              CompileConfig(loras=((str(linear_lora), 0.7),), components=COMPONENTS))
    with EnginePipeline.from_artifacts(merged) as pipe:
        want = pipe(**CALL).images
    with EnginePipeline.from_artifacts(refittable_nhwc) as pipe:
        assert float(np.abs(pipe(**CALL).images - base_image).max()) <= 1e-5  # 1x1 Convs as MatMuls: the same
        info = pipe.load_lora(linear_lora, 0.7)
        got = pipe(**CALL).images
    assert float(np.abs(got - want).max()) <= 1e-5
    assert float(np.abs(got - base_image).max()) > 1e-2
    assert info["changed"]["text_encoder"] == 4 and info["changed"]["unet"] > 0


def test_default_refittable_1x1_conv_lora_equals_the_merged_compile(
    tiny_pipeline_dir: Path, refittable_nhwc: Path, tmp_path: Path
) -> None:
    """A LoRA on every kind of 1x1 Conv (proj_in, proj_out, conv_shortcut): their weights are [C, O] inputs of
    channels-last MatMuls (compiler/pointwise_convs.py), the deltas bound transposed; the image equals the merged
    compile's, where they are Convs on constant [O, C, 1, 1] weights."""
    from diffusers import UNet2DConditionModel

    from tests.compiler.test_lora import _lora_tensors

    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline_dir, subfolder="unet", local_files_only=True)
    layers = _lora_tensors(unet, ["proj_in", "proj_out", "conv_shortcut"], 4, seed=9)
    assert {n.rsplit(".", 1)[-1] for n in layers} == {"proj_in", "proj_out", "conv_shortcut"}
    tensors = {}
    for name, (a, b) in layers.items():
        tensors[f"unet.{name}.lora_A.weight"], tensors[f"unet.{name}.lora_B.weight"] = a * 4, b * 4
    path = tmp_path / "pointwise.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    rmap = json.loads((refittable_nhwc / "unet" / "refit_map.json").read_text())
    assert all(rmap["weights"][f"{n}.weight"].get("pointwise") for n in layers)  # all bound as [C, O]
    merged = compile_pipeline(tiny_pipeline_dir, tmp_path / "merged",
                              CompileConfig(loras=((str(path), 1.0),), components=COMPONENTS))
    with EnginePipeline.from_artifacts(merged) as pipe:
        want = pipe(**CALL).images
    with EnginePipeline.from_artifacts(refittable_nhwc) as pipe:
        base = pipe(**CALL).images
        info = pipe.load_lora(path, 1.0)
        got = pipe(**CALL).images
        pipe.unload_lora()
        again = pipe(**CALL).images
    assert info["changed"] == {"text_encoder": 0, "unet": len(layers)}
    assert float(np.abs(got - want).max()) <= 1e-5
    assert float(np.abs(got - base).max()) > 1e-2
    assert np.array_equal(again, base)


def test_a_conv_lora_on_a_default_refittable_artifact_is_refused(
    refittable_nhwc: Path, loras: dict[str, Path], linear_lora: Path, tmp_path: Path
) -> None:
    """A LoRA with a 3x3-conv layer on a --refittable artifact (spatial Conv weights constant): one error line
    naming the layer and the fixes, exit 2; nothing half-applied (a good LoRA given with it does not stay)."""
    message = ("its layer unet.down_blocks.0.resnets.0.conv1 is a spatial Conv, whose weight this artifact keeps "
               "constant")
    fixes = ("`diffusion-trt compile MODEL --refittable --refit-convs`", "--lora style.safetensors:1")
    out = tmp_path / "conv.png"
    result = CliRunner().invoke(main, ["run", str(refittable_nhwc), "-p", CALL["prompt"], "--steps", "4", "--seed",
                                       "5", "--lora", str(loras["peft"]), "-o", str(out)])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and message in errors[0], result.output
    assert all(f in errors[0] for f in fixes) and not out.exists()
    with EnginePipeline.from_artifacts(refittable_nhwc) as pipe:
        base = pipe(**CALL).images
        with pytest.raises(LoraError, match=message):
            pipe.load_lora([linear_lora, loras["peft"]])
        assert pipe.lora is None
        assert np.array_equal(pipe(**CALL).images, base)


def test_per_request_lora_equals_the_merged_compile(
    tiny_pipeline_dir: Path, refittable: Path, base_image: np.ndarray, loras: dict[str, Path], tmp_path: Path
) -> None:
    merged = compile_pipeline(tiny_pipeline_dir, tmp_path / "merged",
                              CompileConfig(loras=((str(loras["peft"]), 0.7),), components=COMPONENTS))
    with EnginePipeline.from_artifacts(merged) as pipe:
        want = pipe(**CALL).images
    with EnginePipeline.from_artifacts(refittable) as pipe:
        info = pipe.load_lora(loras["peft"], 0.7)
        got = pipe(**CALL).images
    assert float(np.abs(got - want).max()) <= 1e-5
    assert float(np.abs(got - base_image).max()) > 1e-2  # the LoRA did change the image
    assert info["loras"][0]["file"] == "style.safetensors" and info["loras"][0]["scale"] == 0.7
    assert info["changed"]["text_encoder"] == 4 and info["changed"]["unet"] > 0


def test_several_loras_at_once_equal_diffusers_fuse_lora(
    tiny_pipeline_dir: Path, refittable: Path, loras: dict[str, Path]
) -> None:
    want = _theirs(_diffusers_with(tiny_pipeline_dir, [(loras["kohya"], 1.0), (loras["peft"], -0.5)]))
    with EnginePipeline.from_artifacts(refittable) as pipe:
        pipe.load_lora([f"{loras['kohya']}", (loras["peft"], -0.5)])
        got = pipe(**{k: v for k, v in CALL.items() if k not in ("seed", "progress")},
                   generator=torch.Generator().manual_seed(5), progress=False).images
    assert float(np.abs(got - want).max()) < 1e-4  # the merged compile's own bound against diffusers


def test_requests_do_not_leak(refittable: Path, base_image: np.ndarray, loras: dict[str, Path],
                              tiny_artifact: Path) -> None:
    """With a LoRA, then without, then another: each image is what a fresh pipeline gives."""
    with EnginePipeline.from_artifacts(refittable) as pipe:
        pipe.load_lora(loras["peft"], 0.7)
        first = pipe(**CALL).images
        pipe.unload_lora()
        assert pipe.lora is None
        assert np.array_equal(pipe(**CALL).images, base_image)
        pipe.load_lora(loras["kohya"], 1.0)
        pipe.load_lora(loras["peft"], 0.7)  # replaces kohya: base + peft, not on top
        assert np.array_equal(pipe(**CALL).images, first)
        info = pipe.load_lora(loras["peft"], 0.0)
        assert np.array_equal(pipe(**CALL).images, base_image)
        assert info["changed"] == {c: 0 for c in info["changed"]} and len(info["changed"]) == 2  # nothing differs
    with EnginePipeline.from_artifacts(tiny_artifact) as pipe:  # weights as inputs change nothing by themselves
        assert float(np.abs(pipe(**CALL).images - base_image).max()) <= 1e-5


def test_base_weights_of_a_chunk_or_more_load(refittable: Path, base_image: np.ndarray, loras: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """lora_base.safetensors of CHUNK_BYTES or more (an SD-1.5 UNet's: 1.7 GB) arrives from the reader as a memoryview
    of parallel-read memory, which safetensors does not take (it failed with a TypeError on such a file): here every
    file counts as large."""
    from diffusion_trt.artifact import digests

    monkeypatch.setattr(digests, "CHUNK_BYTES", 4096)
    with EnginePipeline.from_artifacts(refittable) as pipe:
        assert np.array_equal(pipe(**CALL).images, base_image)
        pipe.load_lora(loras["peft"], 0.7)
        assert not np.array_equal(pipe(**CALL).images, base_image)


def _bad_loras(loras: dict[str, Path], d: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, message) for LoRAs that must be refused."""
    tensors = load_file(str(loras["peft"]))
    other = {"unet.no_such_block.proj.lora_A.weight": torch.zeros(4, 8),
             "unet.no_such_block.proj.lora_B.weight": torch.zeros(8, 4)}
    save_file(other, str(d / "other_arch.safetensors"))
    save_file({**tensors, **other}, str(d / "partial.safetensors"))
    wide = {k: torch.zeros(v.shape[0], v.shape[1] * 2) if "lora_A" in k and "to_q" in k else v
            for k, v in tensors.items()}
    save_file(wide, str(d / "wider.safetensors"))
    save_file({k: v * float("inf") if "lora_B" in k else v for k, v in tensors.items()}, str(d / "inf.safetensors"))
    up = next(k for k in tensors if "lora_B" in k and "to_q" in k)  # its rank disagrees with its A matrix's
    save_file({**tensors, up: torch.zeros(tensors[up].shape[0], tensors[up].shape[1] + 1)},
              str(d / "ranks.safetensors"))
    unet_only = {"unet.r": 4, "unet.target_modules": ["to_q"]}  # the file has text_encoder layers too
    text = {"text_encoder.r": 4, "text_encoder.target_modules": ["q_proj"]}
    rank_0 = {"unet.r": 0, "unet.target_modules": ["to_q"], **text}
    no_rank = {"unet.target_modules": ["to_q"], **text}  # peft's default r=8; the file's ranks are 4
    for name, header in (("not_json", "{r: 4"), ("no_te_config", json.dumps(unet_only)),
                         ("rank_0", json.dumps(rank_0)), ("no_rank", json.dumps(no_rank))):
        save_file(tensors, str(d / f"metadata_{name}.safetensors"), {"lora_adapter_metadata": header})
    kohya = load_file(str(loras["kohya"]))
    save_file({**kohya, "lora_unet_no_such_block_proj.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_no_such_block_proj.lora_up.weight": torch.zeros(8, 4)}, str(d / "kohya_partial.safetensors"))
    down = next(k for k in tensors if k.endswith("to_k.lora_A.weight"))
    for name, lone in (("down_only", down.replace("lora_A", "lora_B")), ("up_only", down)):
        save_file({k: v for k, v in tensors.items() if k != lone}, str(d / f"{name}.safetensors"))
    save_file({**tensors, "text_encoder.embeddings.token_embedding.lora_embedding_A": torch.zeros(4, 49408),
               "text_encoder.embeddings.token_embedding.lora_embedding_B": torch.zeros(32, 4)},
              str(d / "embedding.safetensors"))  # diffusers merges it into the token embedding
    diff_b = next(k for k in kohya if k.endswith(".lora_up.weight")).replace("lora_up.weight", "diff_b")
    save_file({**kohya, diff_b: torch.zeros(32)}, str(d / "kohya_diff_b.safetensors"))
    torch.save(tensors, d / "pickled.pt")
    (d / "pickle_renamed.safetensors").write_bytes((d / "pickled.pt").read_bytes())
    return {
        "another-architecture": (d / "other_arch.safetensors", "none of its 1 LoRA layers matches"),
        "keys-matching-no-layer": (d / "partial.safetensors",
                                   "the first that matches none: 'unet.no_such_block.proj.lora_A.weight'"),
        "kohya-keys-matching-no-layer": (d / "kohya_partial.safetensors",
                                         "the first that matches none: 'unet.no.such.block.proj.lora_A.weight'"),
        "down-matrix-only": (d / "down_only.safetensors", "to_k has a down (A) matrix but no up (B) one; the file is "
                             "damaged"),
        "up-matrix-only": (d / "up_only.safetensors", "to_k has an up (B) matrix but no down (A) one; the file is "
                           "damaged"),
        "token-embedding-layer": (d / "embedding.safetensors", "is a token-embedding LoRA adapter, which load_lora "
                                  "cannot refit"),
        "kohya-key-diffusers-cannot-rename": (d / "kohya_diff_b.safetensors",
                                              f"have not been correctly renamed: {diff_b})"),
        "wider-model": (d / "wider.safetensors", "weight; it was made for another architecture (other widths)"),
        "non-finite": (d / "inf.safetensors", "leaves NaN/Inf in"),
        "ranks-disagree": (d / "ranks.safetensors", "up (B) matrix, which give no update for its"),
        "metadata-not-json": (d / "metadata_not_json.safetensors", "header's 'lora_adapter_metadata' is not a JSON"),
        "metadata-without-a-config": (d / "metadata_no_te_config.safetensors", "names no text_encoder target_modules"),
        "metadata-rank-0": (d / "metadata_rank_0.safetensors", "gives unet the ranks [0] and alphas [8]"),
        "metadata-default-rank": (d / "metadata_no_rank.safetensors", "has rank 4 but its header's "
                                  "'lora_adapter_metadata' gives rank 8 (peft's default 8 where it names none)"),
        "pickle": (d / "pickled.pt", "is not a .safetensors file"),
        "pickle-renamed": (d / "pickle_renamed.safetensors", "is not a valid safetensors file"),
    }


def test_bad_loras_are_refused_and_nothing_is_half_applied(
    refittable: Path, base_image: np.ndarray, loras: dict[str, Path], tmp_path: Path
) -> None:
    bad = _bad_loras(loras, tmp_path)
    with EnginePipeline.from_artifacts(refittable) as pipe:
        for name, (path, message) in bad.items():
            with pytest.raises(LoraError) as e:
                pipe.load_lora([loras["kohya"], path])  # a good one first: it must not stay applied either
            assert message in str(e.value) and "\n" not in str(e.value), (name, str(e.value))  # one error line
            assert pipe.lora is None
        assert np.array_equal(pipe(**CALL).images, base_image)
        pipe.load_lora(loras["peft"], 0.7)
        with_peft = pipe(**CALL).images
        with pytest.raises(LoraError) as e:
            pipe.load_lora([loras["peft"], loras["peft"]])
        assert str(e.value).startswith(f"LoRA {loras['peft']} is the same file as {loras['peft']} (sha256 ")
        assert pipe.lora is not None and np.array_equal(pipe(**CALL).images, with_peft)  # the previous state


def test_run_lora_cli(refittable: Path, loras: dict[str, Path], tmp_path: Path, tiny_artifact: Path) -> None:
    runner = CliRunner()
    args = ["run", str(refittable), "-p", CALL["prompt"], "--steps", "4", "--seed", "5"]
    out = tmp_path / "lora.png"
    result = runner.invoke(main, [*args, "--lora", f"{loras['peft']}:0.7", "-o", str(out)])
    assert result.exit_code == 0, result.output
    with EnginePipeline.from_artifacts(refittable) as pipe:
        pipe.load_lora(loras["peft"], 0.7)
        want = pipe(**{**CALL, "output_type": "pil"}).images[0]
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), np.asarray(want))
    assert json.loads(Image.open(out).text["parameters"])["loras"] == [["style.safetensors", 0.7]]
    bad = _bad_loras(loras, tmp_path)
    cases = [
        ([*args, "--lora", str(bad["keys-matching-no-layer"][0])], bad["keys-matching-no-layer"][1]),
        ([*args, "--lora", str(bad["pickle"][0])], "is not a .safetensors file"),
        ([*args, "--lora", str(bad["ranks-disagree"][0])], bad["ranks-disagree"][1]),
        ([*args, "--lora", f"{loras['peft']}:strong"], "'strong' is not a scale"),
        (["run", str(tiny_artifact), "-p", "x", "--steps", "1", "--lora", str(loras["peft"])],
         "was compiled without --refittable"),
    ]
    for i, (cmd, message) in enumerate(cases):
        result = runner.invoke(main, [*cmd, "-o", str(tmp_path / f"bad{i}.png")])
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and message in errors[0], result.output
        assert not (tmp_path / f"bad{i}.png").exists()


def test_dummy_lora_cli(tiny_pipeline_dir: Path, refittable: Path, tmp_path: Path) -> None:
    """The README's example LoRA: dummy-lora writes attention-projection layers that load_lora takes."""
    out = tmp_path / "ink.safetensors"
    result = CliRunner().invoke(main, ["dummy-lora", str(tiny_pipeline_dir), str(out), "--rank", "2"])
    assert result.exit_code == 0 and f"lora: {out}" in result.output, result.output
    keys = load_file(str(out))
    assert all(k.startswith(("unet.", "text_encoder.")) and ".lora_" in k for k in keys)
    assert {v.shape[0] for k, v in keys.items() if "lora_A" in k} == {2}
    with EnginePipeline.from_artifacts(refittable) as pipe:
        changed = pipe.load_lora(out, 0.8)["changed"]
    n_text = sum(1 for k in keys if k.startswith("text_encoder.") and "lora_A" in k)
    assert changed == {"text_encoder": n_text, "unet": len(keys) // 2 - n_text}
    again = CliRunner().invoke(main, ["dummy-lora", str(tiny_pipeline_dir), str(out)])
    assert again.exit_code == 2 and "already exists; pass --overwrite" in again.output
    missing = CliRunner().invoke(main, ["dummy-lora", str(tmp_path / "none"), str(tmp_path / "x.safetensors")])
    assert missing.exit_code == 2 and "dummy-lora needs a diffusers folder" in missing.output


# -- serve --lora-dir: the batcher that owns the pipeline, without Triton (tests/test_serve.py needs PyTriton) ------


def _serve_params(lora: tuple[str, float] | None, seed: int = 5) -> dict[str, Any]:
    return {"prompt": CALL["prompt"], "negative_prompt": "", "seed": seed, "steps": CALL["num_inference_steps"],
            "guidance_scale": 7.5, "height": 64, "width": 64, "lora": lora}


def test_serve_lora_per_request_never_leaks(refittable: Path, loras: dict[str, Path]) -> None:
    from diffusion_trt.serve.loras import LoraLibrary
    from diffusion_trt.serve.server import MicroBatcher

    library = LoraLibrary(loras["peft"].parent)
    assert sorted(library.paths) == ["kohya_detail", "style"]
    with EnginePipeline.from_artifacts(refittable) as pipe:
        base = np.asarray(pipe(**{**CALL, "output_type": "pil"}).images[0])
        pipe.load_lora(loras["peft"], 0.7)
        with_style = np.asarray(pipe(**{**CALL, "output_type": "pil"}).images[0])
        pipe.unload_lora()
        batcher = MicroBatcher(pipe, max_batch_size=2, max_delay_s=0.0, max_queue=8)
        try:
            order = [library.resolve(np.array([b"style:0.7"])), None, library.resolve(np.array([b"style:0.7"])),
                     library.resolve(np.array([b""]))]
            images = [batcher.submit(_serve_params(lora)).result(timeout=300) for lora in order]
        finally:
            batcher.close()
    assert np.array_equal(images[0], with_style) and np.array_equal(images[2], with_style)
    assert np.array_equal(images[1], base) and np.array_equal(images[3], base)


def test_serve_lora_names_are_allow_listed(loras: dict[str, Path], tmp_path: Path) -> None:
    from diffusion_trt.serve.loras import LoraLibrary
    from diffusion_trt.serve.triton_model import RequestError

    library = LoraLibrary(loras["peft"].parent)
    assert library.resolve(None) is None
    assert library.resolve(np.array(["style"], dtype=object)) == (str(loras["peft"]), 1.0)
    for value, message in [
        (np.array([b"../style"]), "lora='../style' is not one of the LoRAs this server offers (kohya_detail, style)"),
        (np.array([b"style:lots"]), "the scale must be a number in -4..4, e.g. style:0.8"),
        (np.array([b"style:9"]), "the scale must be a number in -4..4"),
        (np.array([b"\xff"]), "lora is not valid UTF-8"),
        (np.array([1], dtype=np.int32), "lora must be one BYTES value"),
    ]:
        with pytest.raises(RequestError) as e:
            library.resolve(value)
        assert message in str(e.value), str(e.value)
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.safetensors").write_bytes(b"not a safetensors file")
    for folder, message in [(tmp_path / "none", "is not a folder"), (tmp_path / "empty", "holds no .safetensors"),
                            (tmp_path / "bad", "is not a valid safetensors file")]:
        with pytest.raises(LoraError, match=message):
            LoraLibrary(folder)
        result = CliRunner().invoke(main, ["serve", str(tmp_path), "--lora-dir", str(folder)])
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and message in errors[0], result.output


@pytest.mark.gpu
@pytest.mark.parametrize("refit_convs", [False, True], ids=["nhwc-default", "refit-convs"])
def test_cuda_graph_replays_the_updated_weights(tiny_pipeline_dir: Path, loras: dict[str, Path], linear_lora: Path,
                                                tmp_path: Path, refit_convs: bool) -> None:
    """CUDA, fp16, static profile: the engines replay a CUDA graph bound to the weight tensors, which load_lora
    updates in place; a LoRA image equals the merged compile within fp16 noise, and unload gives the base back.
    The default --refittable UNet runs NHWC (its 1x1 Convs as MatMuls over weight inputs), --refit-convs NCHW."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    static = {"device": "cuda", "precision": "fp16", "height": 64, "width": 64, "min_height": 64, "max_height": 64,
              "min_width": 64, "max_width": 64, "batch_size": 1, "min_batch_size": 1, "max_batch_size": 1,
              "components": COMPONENTS}
    lora = loras["peft"] if refit_convs else linear_lora
    refit = compile_pipeline(tiny_pipeline_dir, tmp_path / "refit",
                             CompileConfig(refittable=True, refit_convs=refit_convs, **static))
    merged = compile_pipeline(tiny_pipeline_dir, tmp_path / "merged",
                              CompileConfig(loras=((str(lora), 0.7),), **static))
    with EnginePipeline.from_artifacts(merged, cuda_graph=True) as pipe:
        want = pipe(**CALL).images
    with EnginePipeline.from_artifacts(refit, cuda_graph=True) as pipe:
        assert pipe.engines["unet"].cuda_graph  # type: ignore[attr-defined]
        base = pipe(**CALL).images
        session = pipe.engines["unet"]._session  # type: ignore[attr-defined]
        nhwc = session.get_provider_options()["CUDAExecutionProvider"].get("prefer_nhwc") == "1"
        assert nhwc is not refit_convs
        noise = float(np.abs(pipe(**CALL).images - base).max())  # captured by now; two base images differ by this
        pipe.load_lora(lora, 0.7)
        got = pipe(**CALL).images
        pipe.unload_lora()
        again = pipe(**CALL).images
    assert float(np.abs(got - want).max()) <= 4 / 255
    assert float(np.abs(got - base).max()) > 1e-2
    # CPU fp32: exact (above). On the H100 (2026-12-07) the image after unload differed from the first base image by
    # up to 5e-4, which the equality here refused; CUDA fp16 engines need not be run-to-run deterministic (e.g. ORT's
    # fused GroupNorm), so the bound is the base's own spread between two calls, twice over: one pair of calls is one
    # sample of that spread (on another H100, 2026-12-07: 0.0022 between two base calls, 0.0024 after the unload),
    # and a LoRA left half-applied moves the image by more than 1e-2 (asserted of the loaded one above)
    assert float(np.abs(again - base).max()) <= max(2 * noise, 1e-3) < 1e-2


def test_a_merge_that_overflows_the_weights_dtype_is_refused() -> None:
    """fp16 weights (every CUDA artifact): a delta finite in fp32 but beyond 65504 in fp16 is refused, naming the
    weight and its dtype, before anything is bound."""
    from diffusion_trt.errors import LoraError
    from diffusion_trt.runtime.lora_slots import WeightSlots

    rmap = {"weights": {"blk.weight": {"initializer": "w0", "transpose": False, "dtype": "float16"}}}
    slots = WeightSlots("unet", rmap, {"w0": torch.zeros(2, 3, dtype=torch.float16)}, torch.device("cpu"))
    ok = slots.merged([{"blk.weight": torch.full((2, 3), 60000.0)}], "LoRA a at scale 1")
    assert ok["w0"].dtype == torch.float16 and bool(torch.isfinite(ok["w0"]).all())
    with pytest.raises(LoraError, match=r"leaves NaN/Inf in unet\.blk\.weight \(in its float16 weights\)"):
        slots.merged([{"blk.weight": torch.full((2, 3), 1e5)}], "LoRA a at scale 1")
    assert bool((slots["w0"] == 0).all())  # nothing was bound


def test_the_nonfinite_weight_is_named_among_several() -> None:
    """The finiteness of every merged weight is read in one device sync; the message still names the bad one."""
    from diffusion_trt.errors import LoraError
    from diffusion_trt.runtime.lora_slots import WeightSlots

    rmap = {"weights": {f"b{i}.weight": {"initializer": f"w{i}", "transpose": False, "dtype": "float16"}
                        for i in range(3)}}
    base = {f"w{i}": torch.zeros(2, 3, dtype=torch.float16) for i in range(3)}
    slots = WeightSlots("unet", rmap, base, torch.device("cpu"))
    deltas = {f"b{i}.weight": torch.full((2, 3), 1e5 if i == 1 else 1.0) for i in range(3)}
    with pytest.raises(LoraError, match=r"leaves NaN/Inf in unet\.b1\.weight"):
        slots.merged([deltas], "LoRA a at scale 1")


def test_a_lora_is_hashed_on_a_thread_when_asked(loras: dict[str, Path]) -> None:
    from concurrent.futures import Future

    from diffusion_trt.artifact.folder import sha256_file
    from diffusion_trt.lora import check_lora_file

    now, later = check_lora_file(loras["peft"], 0.5), check_lora_file(loras["peft"], 0.5, background=True)
    assert isinstance(now.digest, str) and isinstance(later.digest, Future)
    assert later.sha256 == now.sha256 == sha256_file(loras["peft"])


def test_a_lora_is_hashed_once_per_version_of_the_file(loras: dict[str, Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A switch back to a LoRA used before reads no file to hash it; a rewritten file (other bytes, or the same
    size and mtime restored) is hashed again."""
    import hashlib
    import os
    import shutil
    import time

    from diffusion_trt.artifact import folder
    from diffusion_trt.lora import check_lora_file

    hashed: list[str] = []

    def counting(path: str | os.PathLike[str]) -> str:
        hashed.append(str(path))
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()

    monkeypatch.setattr(folder, "sha256_file", counting)
    path = tmp_path / "lora.safetensors"
    shutil.copy(loras["peft"], path)
    first = check_lora_file(path).sha256
    assert check_lora_file(path, 0.5).sha256 == check_lora_file(path, background=True).sha256 == first
    assert len(hashed) == 1
    data = bytearray(path.read_bytes())
    st = path.stat()
    data[-1] ^= 0xFF  # same size; the mtime put back as it was: the ctime still changes
    time.sleep(0.05)  # past the kernel's coarse file-time granularity (a few ms), so the ctime differs
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = check_lora_file(path).sha256
    assert len(hashed) == 2 and again == hashlib.sha256(bytes(data)).hexdigest() != first

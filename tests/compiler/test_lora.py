"""compile --lora: merged LoRAs vs diffusers' load_lora_weights + fuse_lora, the manifest record, bad inputs.

The LoRAs are made here: random low-rank matrices for the tiny pipeline's UNet (attention projections,
proj_in, ResNet conv1: Linear and Conv LoRA layers) and text encoder (q/v projections), written as diffusers
(peft-key) and kohya (``lora_unet_*`` with ``.alpha``) safetensors files. The kohya file has UNet layers only:
diffusers 0.42.1 itself cannot load kohya text-encoder keys with transformers 5 ("Could not automatically infer
state dict type" in convert_state_dict_to_diffusers), which compile reports as a LoraError quoting it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.cli import main
from diffusion_trt.compiler.pipeline import compile_pipeline
from diffusion_trt.config import CompileConfig
from diffusion_trt.errors import LoraError, ModelFolderError, RuntimeInputError
from diffusion_trt.lora import check_lora_file, parse_lora_arg
from diffusion_trt.runtime import EnginePipeline

pytest.importorskip("peft", reason="LoRA merging needs peft (pip install -e '.[test]')")

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1"]
TEXT_TARGETS = ["q_proj", "v_proj"]
CALL: dict[str, Any] = {"prompt": "a watercolor fox", "num_inference_steps": 4, "output_type": "np"}


def _lora_tensors(module: torch.nn.Module, targets: list[str], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """{module path: (A [r, in(, k, k)], B [out, r(, 1, 1)])} for every Linear/Conv2d whose name ends in a target."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name, m in module.named_modules():
        if not any(name == t or name.endswith("." + t) for t in targets):
            continue
        if isinstance(m, torch.nn.Linear):
            a, b = (rank, m.in_features), (m.out_features, rank)
        elif isinstance(m, torch.nn.Conv2d):
            a, b = (rank, m.in_channels, *m.kernel_size), (m.out_channels, rank, 1, 1)
        else:
            continue
        out[name] = (torch.randn(a, generator=g) * 0.1, torch.randn(b, generator=g) * 0.1)
    return out


def make_lora(pipeline_dir: Path, path: Path, fmt: str, seed: int = 0, rank: int = 4, alpha: float = 8.0) -> Path:
    """Write a random LoRA for the tiny pipeline in diffusers ("peft") or "kohya" format."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    unet = UNet2DConditionModel.from_pretrained(pipeline_dir, subfolder="unet", local_files_only=True)
    te = CLIPTextModel.from_pretrained(pipeline_dir / "text_encoder", local_files_only=True)
    tensors: dict[str, torch.Tensor] = {}
    for comp, module, targets in (("unet", unet, UNET_TARGETS), ("text_encoder", te, TEXT_TARGETS)):
        if fmt == "kohya" and comp == "text_encoder":
            continue  # see the module docstring
        for name, (a, b) in _lora_tensors(module, targets, rank, seed + len(comp)).items():
            if fmt == "peft":
                tensors[f"{comp}.{name}.lora_A.weight"] = a
                tensors[f"{comp}.{name}.lora_B.weight"] = b
            else:  # kohya: '.' -> '_'
                key = "lora_unet_" + name.replace(".", "_")
                tensors[f"{key}.lora_down.weight"] = a
                tensors[f"{key}.lora_up.weight"] = b
                tensors[f"{key}.alpha"] = torch.tensor(alpha)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


@pytest.fixture(scope="module")
def loras(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("loras")
    return {
        "peft": make_lora(tiny_pipeline_dir, d / "style.safetensors", "peft", seed=1),
        "kohya": make_lora(tiny_pipeline_dir, d / "kohya_detail.safetensors", "kohya", seed=2),
    }


def _variant_lora(loras: dict[str, Path], tmp_path: Path, variant: str) -> Path:
    """The peft LoRA with diffusers' adapter metadata in the header (alpha != r; ``metadata_defaults``: without
    ``lora_alpha``, which diffusers' ``LoraConfig(**metadata)`` takes as peft's default 8), or with rank 2 on the
    to_q layers and 4 elsewhere (diffusers' rank_pattern)."""
    import json

    from safetensors.torch import load_file

    tensors = load_file(str(loras["peft"]))
    metadata = None
    if variant == "metadata":
        config = {"unet.r": 4, "unet.lora_alpha": 2, "unet.target_modules": UNET_TARGETS,
                  "text_encoder.r": 4, "text_encoder.lora_alpha": 6, "text_encoder.target_modules": TEXT_TARGETS}
        metadata = {"lora_adapter_metadata": json.dumps(config), "format": "pt"}
    elif variant == "metadata_defaults":
        config = {"unet.r": 4, "unet.target_modules": UNET_TARGETS,
                  "text_encoder.r": 4, "text_encoder.target_modules": TEXT_TARGETS}
        metadata = {"lora_adapter_metadata": json.dumps(config), "format": "pt"}
    else:
        for key in [k for k in tensors if "to_q.lora_A" in k]:
            up = key.replace("lora_A", "lora_B")
            tensors[key], tensors[up] = tensors[key][:2].contiguous(), tensors[up][:, :2].contiguous()
    path = tmp_path / f"{variant}.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.fixture(scope="module")
def peft_artifact(tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline compiled with the peft-format LoRA at scale 0.7."""
    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("artifacts") / "tiny-style",
                            CompileConfig(loras=((str(loras["peft"]), 0.7),)))


def _diffusers_with(tiny_pipeline_dir: Path, merged: list[tuple[Path, float]]) -> Any:
    ref = diffusers.StableDiffusionPipeline.from_pretrained(tiny_pipeline_dir, local_files_only=True)
    ref.set_progress_bar_config(disable=True)
    for i, (path, scale) in enumerate(merged):
        ref.load_lora_weights(str(path), adapter_name=f"l{i}")
        ref.fuse_lora(lora_scale=scale, adapter_names=[f"l{i}"])
        ref.unload_lora_weights()
    return ref


def _ours(artifact: Path) -> np.ndarray:
    with EnginePipeline.from_artifacts(artifact) as pipe:
        return pipe(**CALL, seed=5, progress=False).images


def _theirs(ref: Any) -> np.ndarray:
    return ref(**CALL, generator=torch.Generator().manual_seed(5)).images


@pytest.mark.parametrize(
    "merged", [[("peft", 0.7)], [("kohya", 1.0), ("peft", -0.5)]], ids=["peft-0.7", "kohya-then-peft"]
)
def test_merged_lora_matches_diffusers_fuse_lora(
    tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path, merged: list[tuple[str, float]],
    request: pytest.FixtureRequest,
) -> None:
    specs = tuple((str(loras[f]), s) for f, s in merged)
    if merged == [("peft", 0.7)]:
        art = request.getfixturevalue("peft_artifact")
    else:
        art = compile_pipeline(tiny_pipeline_dir, tmp_path / "art", CompileConfig(loras=specs))
    ref = _diffusers_with(tiny_pipeline_dir, [(loras[f], s) for f, s in merged])
    got, want = _ours(art), _theirs(ref)
    diff = float(np.abs(got - want).max())
    assert diff < 1e-4, diff
    # and the LoRA did change the image: the base pipeline's differs
    base = _theirs(_diffusers_with(tiny_pipeline_dir, []))
    assert np.abs(want - base).max() > 1e-2

    manifest = artifacts.load_verified(art)
    records = manifest["loras"]
    assert [(r["file"], r["scale"]) for r in records] == [(loras[f].name, s) for f, s in merged]
    assert all(r["sha256"] == artifacts.sha256_file(loras[f]) for r, (f, _) in zip(records, merged, strict=True))
    n_unet = len(_lora_tensors(ref.unet, UNET_TARGETS, 1, 0))
    for r, (f, _) in zip(records, merged, strict=True):  # text encoder: 2 layers x (q, v)
        assert r["layers"] == ({"unet": n_unet, "text_encoder": 4} if f == "peft" else {"unet": n_unet})
    assert manifest["config"]["loras"] == [[str(loras[f]), s] for f, s in merged]


def test_lora_scale_zero_is_the_base_output(tiny_pipeline_dir: Path, tiny_artifact: Path, loras: dict[str, Path],
                                           tmp_path: Path) -> None:
    art = compile_pipeline(tiny_pipeline_dir, tmp_path / "art", CompileConfig(loras=((str(loras["peft"]), 0.0),)))
    assert np.abs(_ours(art) - _ours(tiny_artifact)).max() < 1e-6
    assert artifacts.read_manifest(art)["loras"][0]["scale"] == 0.0


# -- bad inputs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a.safetensors:strong", "'strong' is not a scale"),
        ("a.safetensors:", "'' is not a scale"),
        ("a.safetensors:nan", "'nan' is not a scale"),
        ("a.safetensors:inf", "'inf' is not a scale"),
    ],
)
def test_bad_scale_strings(text: str, message: str) -> None:
    with pytest.raises(LoraError, match="use FILE or FILE:SCALE") as e:
        parse_lora_arg(text)
    assert message in str(e.value)


@pytest.mark.parametrize("text", ["", " ", ":0.5", ":nan"])
def test_an_argument_without_a_file_names_none(text: str) -> None:
    """`--lora ''` read as the path '' = '.', a folder: 'LoRA path . is a folder'; `:0.5` as a bad scale."""
    with pytest.raises(LoraError) as e:
        parse_lora_arg(text)
    assert str(e.value) == f"--lora {text!r} names no file; pass FILE or FILE:SCALE, e.g. style.safetensors:0.8"
    with pytest.raises(LoraError) as e:
        check_lora_file("")
    assert str(e.value) == "LoRA path '' is empty; pass the path of a .safetensors LoRA"


def test_scale_strings() -> None:
    assert parse_lora_arg("a.safetensors") == ("a.safetensors", 1.0)
    assert parse_lora_arg("dir/a.safetensors:0.75") == ("dir/a.safetensors", 0.75)
    assert parse_lora_arg("a.safetensors:-1") == ("a.safetensors", -1.0)
    assert parse_lora_arg("C:/loras/a.safetensors") == ("C:/loras/a.safetensors", 1.0)


def _bad_files(d: Path) -> dict[str, tuple[Path, str]]:
    (d / "weights.bin").write_bytes(b"\x80\x04")
    (d / "garbage.safetensors").write_bytes(b"not a safetensors file")
    save_file({"unet.conv_in.weight": torch.zeros(2, 2)}, str(d / "plain.safetensors"))
    (d / "folder.safetensors").mkdir()
    return {
        "missing": (d / "nope.safetensors", "does not exist"),
        "folder": (d / "folder.safetensors", "is a folder"),
        "not-safetensors": (d / "weights.bin", "is not a .safetensors file"),
        "invalid": (d / "garbage.safetensors", "is not a valid safetensors file"),
        "no-lora-keys": (d / "plain.safetensors", "holds no LoRA tensors"),
    }


@pytest.mark.parametrize("case", ["missing", "folder", "not-safetensors", "invalid", "no-lora-keys"])
def test_bad_lora_files_fail_before_any_work(tiny_pipeline_dir: Path, tmp_path: Path, case: str) -> None:
    path, message = _bad_files(tmp_path)[case]
    with pytest.raises(LoraError, match="compile failed at LoRA check") as e:
        compile_pipeline(tiny_pipeline_dir, tmp_path / "art", CompileConfig(loras=((str(path), 1.0),)))
    assert message in str(e.value)
    assert not (tmp_path / "art").exists()


def test_same_lora_twice_is_refused(tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(loras["peft"].read_bytes())
    specs = ((str(loras["peft"]), 0.5), (str(copy), 0.5))
    with pytest.raises(LoraError) as e:
        compile_pipeline(tiny_pipeline_dir, tmp_path / "art", CompileConfig(loras=specs))
    assert str(e.value).startswith(f"compile failed at LoRA check: --lora {copy} is the same file as "
                                   f"{loras['peft']} (sha256 ")
    assert str(e.value).endswith("; give each LoRA once with the sum of the scales")


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        ("transformer.", "none of its 1 LoRA layers matches a layer of this model's unet or text_encoder"),
        ("unet.", r"diffusers could not load it into this model \(Target modules .*no_such_block.* not found"),
    ],
    ids=["unknown-component", "unknown-module"],
)
def test_lora_matching_nothing_is_refused(tiny_pipeline_dir: Path, tmp_path: Path, prefix: str, message: str) -> None:
    path = tmp_path / "other_model.safetensors"
    save_file({f"{prefix}no_such_block.proj.lora_A.weight": torch.zeros(4, 8),
               f"{prefix}no_such_block.proj.lora_B.weight": torch.zeros(8, 4)}, str(path))
    with pytest.raises(LoraError, match=message):
        compile_pipeline(tiny_pipeline_dir, tmp_path / "art", CompileConfig(loras=((str(path), 1.0),)))
    assert not (tmp_path / "art").exists()


def test_lora_matching_part_of_the_model_is_refused(
    tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(loras["peft"]))
    tensors["unet.no_such_block.proj.lora_A.weight"] = torch.zeros(4, 8)
    tensors["unet.no_such_block.proj.lora_B.weight"] = torch.zeros(8, 4)
    path = tmp_path / "partial.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(LoraError, match=r"only \d+ of its \d+ LoRA layers match"):
        compile_pipeline(tiny_pipeline_dir, tmp_path / "art", CompileConfig(loras=((str(path), 1.0),)))


def test_lora_for_a_wider_model_is_one_error_line(tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """A LoRA for another architecture: diffusers lists every mismatched tensor (hundreds of lines for SDXL on SD
    1.5) and logs its error itself; the CLI prints one line with the first mismatch and nothing else from diffusers."""
    import logging

    prefix = "unet.down_blocks.0.attentions.0.transformer_blocks.0"
    save_file({f"{prefix}.{attn}.to_q.lora_{ab}.weight": torch.zeros(shape)
               for attn in ("attn1", "attn2") for ab, shape in (("A", (4, 1280)), ("B", (1280, 4)))},
              str(tmp_path / "wide.safetensors"))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("diffusers").addHandler(handler)
    try:
        result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"),
                                           "--lora", str(tmp_path / "wide.safetensors")])
    finally:
        logging.getLogger("diffusers").removeHandler(handler)
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].count("size mismatch") == 1, result.output
    assert "diffusers could not load it into this model" in errors[0] and "logged at DEBUG" in errors[0]
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage()[:200] for r in records]


def test_refittable_rules() -> None:
    """ORT and full TensorRT take --refittable (LoRA per request); TensorRT-RTX and merged LoRAs do not."""
    assert CompileConfig(refittable=True).refittable
    with pytest.raises(RuntimeInputError, match="refittable=True with backend='tensorrt-rtx'"):
        CompileConfig(refittable=True, backend="tensorrt-rtx")
    with pytest.raises(RuntimeInputError, match=r"refittable=True with LoRAs merged at compile time: .* or drop "
                                                r"refittable=True"):
        CompileConfig(refittable=True, loras=(("a.safetensors", 1.0),))
    assert CompileConfig(refittable=True, refit_convs=True).refit_convs  # ORT: spatial Conv weights as inputs too
    # the Python API names its arguments; the CLI its flags (test_cli_lora_errors)
    with pytest.raises(RuntimeInputError, match=r"^refit_convs=True needs refittable=True: .*; add refittable=True$"):
        CompileConfig(refit_convs=True)
    with pytest.raises(RuntimeInputError, match=r"^refit_convs=True is for backend='ort' only, not backend='tensorrt': "
                                                r".*; drop refit_convs=True$"):
        CompileConfig(refit_convs=True, refittable=True, backend="tensorrt", device="cuda")


def test_compiling_an_artifact_is_refused(tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    """A second compile from an artifact (whose weights hold a merged LoRA) names the source and the LoRA."""
    art = tmp_path / "art"
    art.mkdir()
    (art / "manifest.json").write_text(json.dumps({
        "source": {"path": str(tiny_pipeline_dir)},
        "loras": [{"file": "style.safetensors", "sha256": "0" * 64, "scale": 0.7}],
    }))
    with pytest.raises(ModelFolderError) as e:
        compile_pipeline(art, tmp_path / "again", CompileConfig(loras=((str(loras["peft"]), 0.7),)))
    msg = str(e.value)
    assert "is a compiled artifact" in msg and str(tiny_pipeline_dir) in msg
    assert "style.safetensors (scale 0.7) merged already" in msg


def test_a_kohya_key_diffusers_cannot_rename_is_one_error_line(
    tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    """diffusers' kohya conversion refuses a key it cannot rename (a ``.diff_b`` bias difference) with a ValueError
    whose keys follow a blank line: one error line naming the key, exit 2 (it failed as an unexpected ValueError of
    the merge stage, exit 1, the key on a line of its own)."""
    from safetensors.torch import load_file

    tensors = load_file(str(loras["kohya"]))
    key = next(k for k in tensors if k.endswith(".lora_up.weight")).replace("lora_up.weight", "diff_b")
    save_file({**tensors, key: torch.zeros(32)}, str(tmp_path / "diff_b.safetensors"))
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"),
                                       "--lora", str(tmp_path / "diff_b.safetensors")])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert f"have not been correctly renamed: {key})" in errors[0], result.output
    assert not (tmp_path / "a").exists()


def test_a_lora_bias_on_a_layer_without_bias_is_one_error_line(
    tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    """peft refuses to merge a LoRA bias (``lora_B.bias``) into a layer without a bias (``to_q``) in ``fuse_lora``:
    a LoRA error, exit 2 (it failed as an unexpected RuntimeError of the merge stage, exit 1)."""
    from safetensors.torch import load_file

    tensors = load_file(str(loras["peft"]))
    up = next(k for k in tensors if k.endswith("to_q.lora_B.weight"))
    save_file({**tensors, up.replace(".weight", ".bias"): torch.zeros(len(tensors[up]))},
              str(tmp_path / "bias.safetensors"))
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"),
                                       "--lora", str(tmp_path / "bias.safetensors")])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "diffusers could not merge it into this model (Impossible to merge LoRA with `lora_bias=True`" in errors[0]
    assert not (tmp_path / "a").exists()


def test_a_lora_diffusers_fails_on_with_an_index_error_is_one_error_line(
    tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    """The test LoRA's keys in diffusers' ``lora_linear_layer`` form (its conv1 layers too): load_lora_weights fails
    with an IndexError ('list index out of range'): a LoRA error, exit 2, as load_lora refuses it (it failed as an
    unexpected error of the merge stage, exit 1)."""
    from safetensors.torch import load_file

    tensors = {k.replace(".lora_A.", ".lora_linear_layer.down.").replace(".lora_B.", ".lora_linear_layer.up."): v
               for k, v in load_file(str(loras["peft"])).items()}
    save_file(tensors, str(tmp_path / "linear_layer.safetensors"))
    result = CliRunner().invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"),
                                       "--lora", str(tmp_path / "linear_layer.safetensors")])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "diffusers could not load it into this model (list index out of range)" in errors[0], result.output
    assert not (tmp_path / "a").exists()


def test_cli_lora_errors(tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    runner = CliRunner()
    for lora_arg, message in [
        (f"{loras['peft']}:strong", "'strong' is not a scale"),
        (str(tmp_path / "missing.safetensors"), "does not exist"),
    ]:
        result = runner.invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), "--lora", lora_arg])
        assert result.exit_code == 2, result.output
        assert message in result.output
    result = runner.invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), "--refittable",
                                  "--lora", str(loras["peft"])])
    assert result.exit_code == 2 and "error: --refittable with LoRAs merged at compile time: " in result.output
    assert "or drop --refittable" in result.output
    for extra, message in (
        (["--refit-convs"], "error: --refit-convs needs --refittable: it makes the spatial Conv weights of a "
                            "refittable ONNX Runtime artifact graph inputs too; add --refittable"),
        (["--refittable", "--refit-convs", "--backend", "tensorrt"],
         "error: --refit-convs is for --backend ort only, not --backend tensorrt: a refittable TensorRT artifact "
         "refits every weight already; drop --refit-convs"),
    ):
        result = runner.invoke(main, ["compile", str(tiny_pipeline_dir), "-o", str(tmp_path / "a"), *extra])
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and errors == [message], result.output
        assert not (tmp_path / "a").exists()
    help_text = " ".join(runner.invoke(main, ["compile", "--help"]).output.split())
    assert "--refit-convs" in help_text and "engines run NCHW on CUDA, slower" in help_text


# -- load_lora: the refit weights (computed on the CPU; refitting needs TensorRT) --------------------------------


def _initializers(artifact: Path, comp: str) -> dict[str, np.ndarray]:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(artifact / comp / "model.onnx"))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.fixture(scope="module")
def refit_maps(tiny_pipeline_dir: Path, tiny_artifact: Path) -> dict[str, dict[str, Any]]:
    """Refit maps of the tiny artifact's graphs (what compile --backend tensorrt --refittable writes beside a plan)."""
    import onnx

    from diffusion_trt.compiler.lora import load_base_modules, refit_map

    base = load_base_modules(tiny_pipeline_dir, ["unet", "text_encoder"])
    return {c: refit_map(onnx.load(str(tiny_artifact / c / "model.onnx")), base[c]) for c in ("unet", "text_encoder")}


def test_refit_map_covers_the_lora_targets(refit_maps: dict[str, dict[str, Any]]) -> None:
    unet, te = refit_maps["unet"], refit_maps["text_encoder"]
    targets = ("attn1.to_q.weight", "attn2.to_k.weight", "proj_in.weight", "resnets.0.conv1.weight", "ff.net.2.weight")
    for suffix in targets:
        assert any(w.endswith(suffix) for w in unet["weights"]), suffix
    assert "encoder.layers.0.self_attn.q_proj.weight" in te["weights"]
    assert any(e["transpose"] for e in unet["weights"].values())  # Linear -> MatMul with the transposed weight
    assert len({e["initializer"] for e in unet["weights"].values()}) == len(unet["weights"])


def test_refit_weights_are_a_compile_with_the_lora(
    tiny_pipeline_dir: Path, tiny_artifact: Path, peft_artifact: Path, loras: dict[str, Path],
    refit_maps: dict[str, dict[str, Any]],
) -> None:
    """base + LoRA computed for refitting == the initializers of the artifact compiled with --lora at that scale;
    scale 0 after it restores exactly the base initializers; a second LoRA is applied to the base, not on top."""
    from diffusion_trt.lora import check_lora_file
    from diffusion_trt.runtime.refit import refit_weights

    first = refit_weights(refit_maps, tiny_pipeline_dir, check_lora_file(loras["peft"], 0.7))
    from diffusion_trt.lora import safetensors_keys

    n_unet = sum(1 for k in safetensors_keys(loras["peft"]) if k.startswith("unet.") and k.endswith("lora_A.weight"))
    for comp in ("unet", "text_encoder"):
        base, merged = _initializers(tiny_artifact, comp), _initializers(peft_artifact, comp)
        assert set(base) == set(merged)
        changed = {n for n in base if base[n].shape != merged[n].shape or not np.array_equal(base[n], merged[n])}
        assert set(first[comp]) == changed  # exactly the weights the LoRA moves
        for name, value in first[comp].items():
            assert value.dtype == merged[name].dtype and value.shape == merged[name].shape
            np.testing.assert_allclose(value, merged[name], rtol=0, atol=1e-6)
    assert len(first["text_encoder"]) == 4 and len(first["unet"]) == n_unet

    zero = refit_weights(refit_maps, tiny_pipeline_dir, check_lora_file(loras["peft"], 0.0), previous=first)
    for comp in ("unet", "text_encoder"):
        base = _initializers(tiny_artifact, comp)
        assert set(zero[comp]) == set(first[comp])  # the previous LoRA's weights go back ...
        assert all(np.array_equal(v, base[n]) for n, v in zero[comp].items())  # ... to the base values

    # kohya (UNet only) after the peft LoRA: the text encoder returns to base, the UNet is base + kohya only
    second = refit_weights(refit_maps, tiny_pipeline_dir, check_lora_file(loras["kohya"], 1.0), previous=first)
    base_te = _initializers(tiny_artifact, "text_encoder")
    assert all(np.array_equal(v, base_te[n]) for n, v in second["text_encoder"].items())
    alone = refit_weights(refit_maps, tiny_pipeline_dir, check_lora_file(loras["kohya"], 1.0))
    for n, v in alone["unet"].items():
        np.testing.assert_array_equal(second["unet"][n], v)


@pytest.mark.parametrize(("fmt", "scale"), [("peft", 0.7), ("kohya", 1.0), ("peft", -1.5), ("metadata", 0.6),
                                            ("metadata_defaults", 0.6), ("mixed_rank", 1.0)])
def test_refit_weights_equal_the_merge_path(
    tiny_pipeline_dir: Path, loras: dict[str, Path], refit_maps: dict[str, dict[str, Any]], fmt: str, scale: float,
    tmp_path: Path,
) -> None:
    """load_lora's weights, computed from safetensors without model classes (runtime.refit), are bit for bit what
    compile --lora's merge (diffusers' load_lora_weights + fuse_lora on the loaded modules) gives, for every mapped
    weight: with and without alphas (kohya), with the adapter config in the file's header (whole, or without
    lora_alpha: peft's default; a KeyError before), with ranks that differ per layer, and at scales other than 1."""
    from diffusion_trt.compiler.lora import load_base_modules, merge_loras
    from diffusion_trt.lora import check_lora_file
    from diffusion_trt.runtime.refit import array_key, as_initializer, refit_weights

    path = loras[fmt] if fmt in loras else _variant_lora(loras, tmp_path, fmt)
    lora = check_lora_file(path, scale)
    refit = refit_weights(refit_maps, tiny_pipeline_dir, lora)
    models = load_base_modules(tiny_pipeline_dir, list(refit_maps))
    with torch.no_grad():
        merge_loras(models, [lora])
    for comp, rmap in refit_maps.items():
        params = dict(models[comp].named_parameters())
        want = {}
        for wname, e in rmap["weights"].items():
            arr = as_initializer(params[wname], e["transpose"], e["dtype"])
            if array_key(arr) != e["sha256"]:
                want[e["initializer"]] = arr
        assert set(refit[comp]) == set(want), comp
        for name, value in want.items():
            assert refit[comp][name].dtype == value.dtype
            np.testing.assert_array_equal(refit[comp][name], value, err_msg=f"{comp} {name}")
    assert refit["unet"] and (fmt == "kohya") == (not refit["text_encoder"])


def test_tensorrt_unload_refits_the_base_from_the_load_s_model_folder_without_the_lora_file(
    tiny_pipeline_dir: Path, tiny_artifact: Path, loras: dict[str, Path], refit_maps: dict[str, dict[str, Any]],
    tmp_path: Path,
) -> None:
    """TensorRT ``unload_lora`` (the engines faked: refit calls recorded) refits every initializer the LoRA changed
    back to the artifact's own values, from the ``model_dir=`` the load read (the manifest's source folder is gone:
    the artifact was moved), with the LoRA file deleted meanwhile. It refitted the LoRA at scale 0 instead: it read
    the LoRA file again (LoraError: does not exist) and the manifest's source folder, not ``model_dir``."""
    import shutil
    from types import SimpleNamespace

    from diffusion_trt.artifact.manifest import Backend

    class Engine:
        def __init__(self) -> None:
            self.refits: list[dict[str, Any]] = []

        def refit(self, values: dict[str, Any], fill_missing: Any = None) -> None:
            self.refits.append(values)

    root = tmp_path / "artifact"
    entries = {}
    for comp, rmap in refit_maps.items():
        (root / comp).mkdir(parents=True)
        (root / comp / "refit_map.json").write_text(json.dumps(rmap))
        entries[comp] = SimpleNamespace(refit_map=f"{comp}/refit_map.json", onnx=f"{comp}/model.onnx")
    model_dir, lora = tmp_path / "model", tmp_path / "style.safetensors"
    shutil.copytree(tiny_pipeline_dir, model_dir)
    shutil.copy(loras["peft"], lora)
    pipe = SimpleNamespace(
        manifest=SimpleNamespace(loras=[], backend=Backend.TENSORRT, components=entries,
                                 source_path=str(tmp_path / "moved")),
        engines={c: Engine() for c in entries}, root=root, _closed=False, _weight_slots={}, _lora_weights={},
        _trt_source=None, lora=None, _loaded_loras=None, embedding_cache=SimpleNamespace(clear=lambda: None))
    pipe._refit_engines = lambda *a: EnginePipeline._refit_engines(pipe, *a)  # type: ignore[attr-defined]
    loaded = EnginePipeline.load_lora.__wrapped__(pipe, lora, 0.7, model_dir=model_dir)  # type: ignore[attr-defined]
    assert loaded["refitted"]["unet"] > 0 and loaded["refitted"]["text_encoder"] == 4
    lora.unlink()
    EnginePipeline.unload_lora.__wrapped__(pipe)  # type: ignore[attr-defined]
    assert pipe.lora is None
    for comp, engine in pipe.engines.items():
        assert len(engine.refits) == 2 and set(engine.refits[1]) == set(engine.refits[0]), comp
        base = _initializers(tiny_artifact, comp)
        for name, value in engine.refits[1].items():
            np.testing.assert_array_equal(value, base[name], err_msg=f"{comp} {name}")


def test_refit_loads_no_model_class(tiny_pipeline_dir: Path, loras: dict[str, Path],
                                    refit_maps: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """A serving host needs no model classes: computing refit weights imports no diffusers/transformers model
    module and no peft (a fresh interpreter, its sys.modules read after the call)."""
    import subprocess
    import sys

    maps = tmp_path / "maps.json"
    maps.write_text(json.dumps(refit_maps))
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from diffusion_trt.lora import check_lora_file\n"
        "from diffusion_trt.runtime.refit import refit_weights\n"
        f"out = refit_weights(json.loads(Path({str(maps)!r}).read_text()), Path({str(tiny_pipeline_dir)!r}), "
        f"check_lora_file({str(loras['peft'])!r}, 0.5))\n"
        "assert out['unet'] and out['text_encoder']\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    modules = result.stdout.split()
    banned = ("diffusers.models", "diffusers.pipelines", "peft", "diffusion_trt.compiler")
    bad = [m for m in modules if m.startswith(banned) or (m.startswith("transformers.models.") and ".modeling_" in m)]
    assert not bad, bad


def test_refit_weights_refuse_another_model_folder(
    tmp_path: Path, loras: dict[str, Path], refit_maps: dict[str, dict[str, Any]]
) -> None:
    from diffusion_trt.compiler.dummy import write_dummy_pipeline
    from diffusion_trt.lora import check_lora_file
    from diffusion_trt.runtime.refit import refit_weights

    other = write_dummy_pipeline(tmp_path / "other", arch="tiny", seed=1)
    with pytest.raises(LoraError, match="is not the one the artifact was compiled from"):
        refit_weights(refit_maps, other, check_lora_file(loras["peft"], 1.0))


def test_base_weights_as_pickle_need_trust_pickle(
    tiny_pipeline_dir: Path, tmp_path: Path, loras: dict[str, Path], refit_maps: dict[str, dict[str, Any]]
) -> None:
    """load_lora's base weights follow compile's rule: a pickle (.bin) is refused, naming the file and the fix,
    unless trust_pickle=True (issue 14, item 10); before, load_base_modules unpickled it without asking."""
    import shutil

    from safetensors.torch import load_file

    from diffusion_trt.compiler.lora import load_base_modules
    from diffusion_trt.lora import check_lora_file
    from diffusion_trt.runtime.refit import refit_weights

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_pipeline_dir, pickled)
    folder = pickled / "text_encoder"
    torch.save(load_file(folder / "model.safetensors"), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    lora = check_lora_file(loras["peft"], 1.0)
    for call in (lambda **kw: refit_weights(refit_maps, pickled, lora, **kw),
                 lambda **kw: load_base_modules(pickled, ["text_encoder"], **kw)):
        with pytest.raises(LoraError) as e:
            call()
        assert str(e.value).startswith(f"{folder / 'pytorch_model.bin'} is a pickle file and loading it runs arbitrary")
        assert "trust_pickle=True" in str(e.value)
    weights = refit_weights(refit_maps, pickled, lora, trust_pickle=True)
    assert weights["text_encoder"] and weights["unet"]


def test_load_lora_bad_input(tiny_artifact: Path, peft_artifact: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "w.bin").write_bytes(b"x")
    with EnginePipeline.from_artifacts(tiny_artifact) as pipe:
        cases: list[tuple[Any, Any, str]] = [
            (loras["peft"], 1.0, "was compiled without --refittable (its weights are constants of the ONNX Runtime "
                                 "sessions); recompile with `diffusion-trt compile MODEL --refittable`, or merge the "
                                 "LoRA at compile time with `diffusion-trt compile MODEL --lora style.safetensors:1`"),
            (tmp_path / "missing.safetensors", 1.0, "does not exist"),
            (tmp_path / "w.bin", 1.0, "is not a .safetensors file"),
            (loras["peft"], float("nan"), "scale=nan must be a finite number"),
            (loras["peft"], "0.5", "scale='0.5' must be a finite number"),
        ]
        for path, scale, message in cases:
            with pytest.raises(LoraError) as e:
                pipe.load_lora(path, scale)
            assert message in str(e.value)
        assert pipe.lora is None
    with EnginePipeline.from_artifacts(peft_artifact) as pipe, pytest.raises(LoraError) as e:
        pipe.load_lora(loras["peft"], 0.3)
    assert "merged into this artifact already (compile --lora, scale 0.7)" in str(e.value)


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_load_lora_refits_tensorrt_engines(
    tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    """A refittable TensorRT artifact: load_lora = compile --lora (fp32), scale 0 = base, never on top."""
    cfg = {"backend": "tensorrt", "device": "cuda", "precision": "fp32"}
    art = compile_pipeline(tiny_pipeline_dir, tmp_path / "refit", CompileConfig(**cfg, refittable=True))
    merged = compile_pipeline(tiny_pipeline_dir, tmp_path / "merged",
                              CompileConfig(**cfg, loras=((str(loras["peft"]), 0.7),)))
    call = {**CALL, "seed": 5, "progress": False}
    with EnginePipeline.from_artifacts(merged) as pipe:
        want = pipe(**call).images
    with EnginePipeline.from_artifacts(art) as pipe:
        base = pipe(**call).images
        pipe.load_lora(loras["kohya"], 1.0)
        pipe.load_lora(loras["peft"], 0.7)  # from the base weights, not on top of kohya
        assert pipe.lora is not None and pipe.lora["refitted"]["text_encoder"] == 4
        np.testing.assert_allclose(pipe(**call).images, want, atol=2e-3)
        pipe.load_lora(loras["peft"], 0.0)
        np.testing.assert_allclose(pipe(**call).images, base, atol=1e-5)


def test_a_lora_that_leaves_nan_is_refused(tiny_pipeline_dir: Path, loras: dict[str, Path], tmp_path: Path) -> None:
    """NaN in the file (or a scale that overflows) would only give black images: refused at compile time."""
    from safetensors.torch import load_file

    tensors = load_file(str(loras["peft"]))
    first = next(iter(tensors))
    tensors[first] = torch.full_like(tensors[first], float("nan"))
    bad = tmp_path / "nan.safetensors"
    save_file(tensors, str(bad))
    with pytest.raises(LoraError, match=r"leaves NaN/Inf in (unet|text_encoder)\..*check the file, or use a smaller"):
        compile_pipeline(tiny_pipeline_dir, tmp_path / "art", CompileConfig(loras=((str(bad), 1.0),)))
    assert not (tmp_path / "art").exists()


# -- a CUDA-target compile: the 1x1 Convs its NHWC passes turn into MatMuls stay LoRA slots ----------------------


@pytest.fixture(scope="module")
def cuda_target_refittable(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny compiled for CUDA, static 64x64 b1, fp32, ``--refittable``: its CUDA passes run (cancel_transposes turns
    the NHWC-sandwiched 1x1 Convs, ``proj_in``/``proj_out``, into MatMuls over the channels). Compiled here on the
    CPU and not run (its fused GroupNorm is a CUDA-only ONNX Runtime op)."""
    side = {f"{k}{d}": 64 for k in ("", "min_", "max_") for d in ("height", "width")}
    config = CompileConfig(device="cuda", precision="fp32", refittable=True, batch_size=1, min_batch_size=1,
                           max_batch_size=1, components=("text_encoder", "unet", "vae_decoder"), **side)
    return compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp("cuda-refit") / "art", config)


def test_a_cuda_target_refit_map_keeps_the_1x1_convs_rewritten_as_matmuls(
    cuda_target_refittable: Path, tiny_pipeline_dir: Path, tmp_path: Path
) -> None:
    """On the H200 the refittable SD-1.5 UNet refused a rank-64 LoRA on attention and proj_in/proj_out ("only 243
    of its 264 LoRA layers match ... proj_in"): the 21 1x1 Convs cancel_transposes made MatMuls ([C, O] weights)
    were in no refit-map entry. They are now ``pointwise`` entries, bound as inputs, and a LoRA merges into them as
    the merged torch weight would read. The other 1x1 Convs (``conv_shortcut``) are too, by the refittable rewrite
    (compiler/pointwise_convs.py): every 1x1 Conv weight is a ``[C, O]`` MatMul input."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file

    from diffusion_trt.lora import LoraFile
    from diffusion_trt.runtime.lora_deltas import lora_deltas
    from diffusion_trt.runtime.lora_slots import WeightSlots
    from diffusion_trt.runtime.refit import as_initializer

    rmap = json.loads((cuda_target_refittable / "unet" / "refit_map.json").read_text())
    pointwise = sorted(w for w, e in rmap["weights"].items() if e.get("pointwise"))
    kinds = ("proj_in.weight", "proj_out.weight", "conv_shortcut.weight")
    assert {k for k in kinds if any(w.endswith(k) for w in pointwise)} == set(kinds), pointwise
    assert all(w.endswith(kinds) for w in pointwise), pointwise
    assert all(rmap["weights"][w]["transpose"] for w in pointwise)
    import onnx

    graph = onnx.load(str(cuda_target_refittable / "unet" / "model.onnx")).graph
    inputs = {i.name for i in graph.input}
    ops = {n.op_type for n in graph.node}
    assert not [n.name for n in graph.node if n.op_type == "Conv" and n.input[1] in inputs]  # every 1x1: a MatMul
    assert "Shape" not in ops  # static: no shape arithmetic around them (the Reshape-MatMul form had 24 Shapes)
    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline_dir, subfolder="unet", local_files_only=True)
    slot_kinds = {f"{n}.weight" for n, m in unet.named_modules() if isinstance(m, torch.nn.Linear)
                  or (isinstance(m, torch.nn.Conv2d) and tuple(m.kernel_size) == (1, 1))}
    assert not slot_kinds & set(rmap["unmapped"]), sorted(slot_kinds & set(rmap["unmapped"]))
    base = load_file(str(cuda_target_refittable / "unet" / "lora_base.safetensors"))
    assert all(rmap["weights"][w]["initializer"] in base for w in pointwise)  # graph inputs: bound per request
    tensors = {}
    for name, (a, b) in _lora_tensors(unet, ["to_q", "proj_in", "proj_out", "conv_shortcut"], 4, seed=5).items():
        tensors[f"unet.{name}.lora_A.weight"], tensors[f"unet.{name}.lora_B.weight"] = a, b
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "proj.safetensors"))
    slots = WeightSlots("unet", rmap, base, torch.device("cpu"), spatial_conv_inputs=False)
    deltas = lora_deltas(LoraFile(tmp_path / "proj.safetensors", 0.8, ""), {"unet": slots.torch_shapes()},
                         constants={"unet": slots.constants})["unet"]
    merged = slots.merged([deltas], "proj.safetensors")
    weights = unet.state_dict()
    for w in pointwise:
        e = rmap["weights"][w]
        want = as_initializer(weights[w] + deltas[w], True, e["dtype"])
        np.testing.assert_allclose(merged[e["initializer"]].numpy(), want, atol=1e-6, rtol=0)

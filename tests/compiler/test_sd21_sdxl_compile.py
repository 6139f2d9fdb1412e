"""SD-2.x and SDXL on the compile side: dummy architectures, folder checks, model facts, manifest, fp32 islands.

The fp16 checks compile for ``--device cuda --precision fp16`` on this CPU machine (export and passes run here;
the CUDA engines are not test-loaded) and read the dtypes of the saved graphs.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from diffusion_trt.artifact.folder import read_manifest
from diffusion_trt.compiler import export
from diffusion_trt.compiler.dummy import _CONFIGS, ARCHS, write_dummy_pipeline
from diffusion_trt.compiler.pipeline import compile_pipeline, component_precision, model_facts, pass_options, specs_for
from diffusion_trt.config import CompileConfig, ShapeProfile
from diffusion_trt.errors import ExportError, ModelFolderError, RuntimeInputError

F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


def graph_float_types(path: Path) -> Counter[str]:
    """Float element types of every initializer and every typed tensor (inputs, outputs, value_info) of a graph."""
    model = onnx.load(str(path), load_external_data=False)
    types = [t.data_type for t in model.graph.initializer]
    types += [v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output, *model.graph.value_info)]
    return Counter(onnx.TensorProto.DataType.Name(t) for t in types if t in (F32, F16))


def raw_manifest(artifact: Path) -> dict:
    """manifest.json as written (these artifacts hold a subset of the components, which read_manifest's schema
    check refuses: it requires text_encoder, unet and vae_decoder)."""
    return json.loads((artifact / "manifest.json").read_text())


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --- dummy architectures --------------------------------------------------------------------------------------


def test_unknown_arch_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match=r"--arch 'sd3' is unknown; use one of ") as info:
        write_dummy_pipeline(tmp_path / "x", arch="sd3")
    assert str(info.value).split("use one of ")[1].split(", ") == list(ARCHS)
    from diffusion_trt.cli import main

    result = CliRunner().invoke(main, ["dummy-pipeline", "--arch", "sd3", str(tmp_path / "y")])
    assert result.exit_code == 2 and "'sd3' is not one of" in result.output and "'tiny-sdxl'" in result.output
    assert not (tmp_path / "y").exists()


@pytest.mark.parametrize(("arch", "expected"), [
    # published parameter counts of stabilityai/stable-diffusion-2-1 and stable-diffusion-xl-base-1.0
    ("sd21", {"unet": 865_910_724, "text_encoder": 340_387_840}),
    ("sdxl", {"unet": 2_567_463_684, "text_encoder": 123_060_480, "text_encoder_2": 694_659_840}),
])
def test_true_architectures_have_the_published_sizes(arch: str, expected: dict[str, int]) -> None:
    """Built on the meta device (no memory): the configs are the real models' configs."""
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cfg = _CONFIGS[arch]
    with torch.device("meta"):
        models = {"unet": UNet2DConditionModel(**cfg["unet"]),
                  "text_encoder": CLIPTextModel(CLIPTextConfig(**cfg["text_encoder"]))}
        if "text_encoder_2" in cfg:
            models["text_encoder_2"] = CLIPTextModelWithProjection(CLIPTextConfig(**cfg["text_encoder_2"]))
    assert {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()} == expected


def test_dummy_folders_are_the_diffusers_classes(tiny_sd21_dir: Path, tiny_sdxl_dir: Path) -> None:
    sd21 = json.loads((tiny_sd21_dir / "model_index.json").read_text())
    sdxl = json.loads((tiny_sdxl_dir / "model_index.json").read_text())
    assert sd21["_class_name"] == "StableDiffusionPipeline" and sd21["scheduler"] == ["diffusers", "DDIMScheduler"]
    sched = json.loads((tiny_sd21_dir / "scheduler" / "scheduler_config.json").read_text())
    assert sched["prediction_type"] == "v_prediction"
    assert sdxl["_class_name"] == "StableDiffusionXLPipeline" and sdxl["force_zeros_for_empty_prompt"] is True
    assert sdxl["text_encoder_2"] == ["transformers", "CLIPTextModelWithProjection"]
    assert json.loads((tiny_sdxl_dir / "vae" / "config.json").read_text())["force_upcast"] is True
    # OpenCLIP tokenizers pad with "!", CLIP-L's with <|endoftext|>
    from transformers import CLIPTokenizer

    pads = [CLIPTokenizer.from_pretrained(d, local_files_only=True).pad_token
            for d in (tiny_sd21_dir / "tokenizer", tiny_sdxl_dir / "tokenizer", tiny_sdxl_dir / "tokenizer_2")]
    assert pads == ["!", "<|endoftext|>", "!"]
    assert set(ARCHS) >= {"tiny", "sd15", "sd21", "sdxl", "tiny-sd21", "tiny-sdxl"}


# --- folder checks and model facts ----------------------------------------------------------------------------


@pytest.mark.parametrize(("remove", "message"), [
    ("text_encoder_2", r"the text_encoder_2/ folder is missing \(SDXL has a second text encoder"),
    ("tokenizer_2", r"the tokenizer_2/ folder is missing \(SDXL has a second tokenizer"),
    ("text_encoder_2/config.json", r"text_encoder_2/config.json is missing"),
    ("text_encoder_2/model.safetensors", r"text_encoder_2/ has no weights"),
])
def test_incomplete_sdxl_folder(tiny_sdxl_dir: Path, tmp_path: Path, remove: str, message: str) -> None:
    folder = copy_folder(tiny_sdxl_dir, tmp_path / "m")
    target = folder / remove
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(ModelFolderError, match=message):
        export.check_model_folder(folder)


@pytest.mark.parametrize(("sub", "key", "value", "message"), [
    ("unet", "cross_attention_dim", 64, r"cross_attention_dim=64, but text_encoder \(32\) \+ text_encoder_2 \(48\) "
                                        r"give 80"),
    ("unet", "projection_class_embeddings_input_dim", 70, r"projection_class_embeddings_input_dim=70, but 6 time ids "
                                                          r"x addition_time_embed_dim 8 \+ text_encoder_2 "
                                                          r"projection_dim 24 = 72"),
    ("unet", "addition_embed_type", None, r"addition_embed_type=None; an SDXL base UNet has 'text_time'"),
    ("vae", "latents_mean", [0.0] * 4, r"latents_mean/latents_std .* not supported yet"),
])
def test_sdxl_components_that_do_not_fit(tiny_sdxl_dir: Path, tmp_path: Path, sub: str, key: str, value: object,
                                         message: str) -> None:
    folder = copy_folder(tiny_sdxl_dir, tmp_path / "m")
    path = folder / sub / "config.json"
    cfg = json.loads(path.read_text())
    cfg[key] = value
    if key == "latents_mean":
        cfg["latents_std"] = [1.0] * 4
    path.write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=message):
        model_facts(export.check_model_folder(folder))


def test_model_facts(tiny_sd21_dir: Path, tiny_sdxl_dir: Path) -> None:
    sd21 = model_facts(export.check_model_folder(tiny_sd21_dir))
    assert (sd21["architecture"], sd21["prediction_type"], sd21["upcast_attention"]) == ("sd", "v_prediction", True)
    sdxl = model_facts(export.check_model_folder(tiny_sdxl_dir))
    assert {k: sdxl[k] for k in ("architecture", "text_hidden_size", "text_encoder_2_hidden_size", "text_embeds_size",
                                 "time_ids_size", "force_zeros_for_empty_prompt", "vae_force_upcast",
                                 "vae_scaling_factor")} == {
        "architecture": "sdxl", "text_hidden_size": 32, "text_encoder_2_hidden_size": 48, "text_embeds_size": 24,
        "time_ids_size": 6, "force_zeros_for_empty_prompt": True, "vae_force_upcast": True,
        "vae_scaling_factor": 0.13025}
    unet = specs_for(sdxl)["unet"]
    assert [(t.name, t.dtype, t.shape) for t in unet.inputs[2:]] == [
        ("encoder_hidden_states", "float", ("B2", 77, 80)), ("text_embeds", "float", ("B2", 24)),
        ("time_ids", "float32", ("B2", 6))]


def test_int8_is_refused_for_sdxl(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeInputError, match=r"precision='int8' is not supported for SDXL models yet"):
        compile_pipeline(tiny_sdxl_dir, tmp_path / "a", CompileConfig(precision="int8"))
    assert not (tmp_path / "a").exists()


# --- manifest ---------------------------------------------------------------------------------------------------


def test_manifest_records_the_architecture(tiny_sd21_artifact: Path, tiny_sdxl_artifact: Path) -> None:
    sd21 = read_manifest(tiny_sd21_artifact)
    assert sd21["model"]["architecture"] == "sd" and sd21["model"]["prediction_type"] == "v_prediction"
    assert "tokenizer_2" not in sd21 and list(sd21["components"]) == [
        "text_encoder", "unet", "vae_decoder", "vae_encoder"]
    sdxl = read_manifest(tiny_sdxl_artifact)
    assert sdxl["model"]["architecture"] == "sdxl" and sdxl["pipeline_class"] == "StableDiffusionXLPipeline"
    assert sdxl["tokenizer_2"] == "tokenizer_2"
    assert (tiny_sdxl_artifact / "tokenizer_2" / "tokenizer_config.json").is_file()
    te2 = sdxl["components"]["text_encoder_2"]
    assert [(t["name"], t["shape"]) for t in te2["outputs"]] == [
        ("text_embeds", ["B2", 24]), ("penultimate_hidden_state", ["B2", 77, 48]),
        ("clip_skip_states", ["B2", 1, 77, 48])]  # clip skip 1 (the tiny text_encoder's 2 layers less one)
    assert [(t["name"], t["shape"]) for t in te2["inputs"]] == [
        ("input_ids", ["B2", 77]), ("embedding_vectors", ["B2", 128, 48])]
    assert [(t["name"], t["dtype"]) for t in sdxl["components"]["unet"]["inputs"]][3:] == [
        ("text_embeds", "float32"), ("time_ids", "float32")]
    from diffusion_trt.artifact.verify import verify_artifact

    assert verify_artifact(tiny_sdxl_artifact).ok


# --- fp32 islands -----------------------------------------------------------------------------------------------


def test_sdxl_fp16_keeps_the_vae_fp32(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    """ORT CUDA fp16: UNet fp16, the VAE components entirely fp32 (no float16 tensor in their graphs)."""
    out = compile_pipeline(tiny_sdxl_dir, tmp_path / "a", CompileConfig(
        device="cuda", precision="fp16", components=("unet", "vae_decoder", "vae_encoder")))
    manifest = raw_manifest(out)
    assert manifest["precision"] == "fp16"
    for name in ("vae_decoder", "vae_encoder"):
        entry = manifest["components"][name]
        assert entry["precision"] == "fp32" and "force_upcast" in entry["precision_note"]
        assert {t["dtype"] for t in (*entry["inputs"], *entry["outputs"])} == {"float32"}
        types = graph_float_types(out / entry["onnx"])
        assert types["FLOAT"] > 0 and types["FLOAT16"] == 0, (name, types)
    unet = manifest["components"]["unet"]
    assert unet["precision"] == "fp16" and "precision_note" not in unet
    assert graph_float_types(out / unet["onnx"])["FLOAT16"] > 0
    assert [t["dtype"] for t in unet["inputs"]] == ["float16", "float32", "float16", "float16", "float32"]


@pytest.mark.parametrize("how", ["flag", "config"])
def test_sdxl_fp16_safe_vae_is_fp16(tiny_sdxl_dir: Path, tmp_path: Path, how: str) -> None:
    """--fp16-safe-vae, or force_upcast: false in vae/config.json (an fp16-fixed VAE), gives an fp16 VAE."""
    folder = tiny_sdxl_dir
    if how == "config":
        folder = copy_folder(tiny_sdxl_dir, tmp_path / "m")
        cfg = json.loads((folder / "vae" / "config.json").read_text())
        (folder / "vae" / "config.json").write_text(json.dumps({**cfg, "force_upcast": False}))
    out = compile_pipeline(folder, tmp_path / "a", CompileConfig(
        device="cuda", precision="fp16", components=("vae_decoder",), fp16_safe_vae=how == "flag"))
    entry = raw_manifest(out)["components"]["vae_decoder"]
    assert entry["precision"] == "fp16" and "precision_note" not in entry
    assert graph_float_types(out / entry["onnx"])["FLOAT16"] > 0


def test_component_precision_rules() -> None:
    sdxl = {"architecture": "sdxl", "vae_force_upcast": True}
    assert component_precision("vae_decoder", "fp16", sdxl, False)[0] == "fp32"
    assert component_precision("vae_decoder", "fp16", sdxl, True) == ("fp16", "")
    assert component_precision("vae_decoder", "fp16", {**sdxl, "vae_force_upcast": False}, False) == ("fp16", "")
    assert component_precision("unet", "fp16", sdxl, False) == ("fp16", "")
    assert component_precision("vae_decoder", "fp32", sdxl, False) == ("fp32", "")
    # SD 1.x/2.x VAEs run fp16 (diffusers' StableDiffusionPipeline never upcasts them), whatever force_upcast says
    assert component_precision("vae_decoder", "fp16", {"architecture": "sd", "vae_force_upcast": True}, False) == (
        "fp16", "")


def test_sd21_fp16_keeps_attention_scores_fp32(tiny_sd21_dir: Path, tiny_pipeline_dir: Path, tmp_path: Path) -> None:
    """upcast_attention: true (SD 2.x): every fused attention of the UNet runs fp32; SD-1.5 (false): fp16."""
    for name, folder, want in (("sd21", tiny_sd21_dir, F32), ("sd15", tiny_pipeline_dir, F16)):
        out = compile_pipeline(folder, tmp_path / name, CompileConfig(device="cuda", precision="fp16",
                                                                      components=("unet",)))
        entry = raw_manifest(out)["components"]["unet"]
        counts = next(r["counts"] for r in entry["passes"] if r["name"] == "convert_fp16")
        model = onnx.shape_inference.infer_shapes(onnx.load(str(out / entry["onnx"])))
        types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.value_info, *model.graph.input)}
        mha = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
        assert len(mha) == 32
        assert {types[n.input[0]] for n in mha} == {want}, name
        assert counts.get("fp32_attention", 0) == (32 if name == "sd21" else 0)


def test_sd21_tensorrt_fp16_scores_fp32(tiny_sd21_dir: Path, tmp_path: Path) -> None:
    """TensorRT keeps MatMul-Softmax-MatMul: Q.K^T and the Softmax fp32, probabilities x V fp16."""
    from diffusion_trt.passes import PassContext, optimize_model, pipeline_for

    folder = export.check_model_folder(tiny_sd21_dir)
    facts = model_facts(folder)
    spec = specs_for(facts)["unet"]
    profile = ShapeProfile.from_json({"batch": [1, 1, 4], "height": [32, 64, 128], "width": [32, 64, 128]})
    ranges = export.export_ranges(profile)
    models = export.load_models(folder, "fp32", "cpu")
    raw = export.onnx_from_component("unet", models, spec, tmp_path / "unet.onnx", precision="fp32",
                                     profile_ranges=ranges, opset=17, device="cpu")
    ctx = PassContext(component="unet", backend="tensorrt", device="cuda", precision="fp16",
                      options=pass_options(spec, profile, facts))
    model, records = optimize_model(onnx.load(str(raw)), pipeline_for("tensorrt", "cuda", "fp16", "unet"), ctx)
    assert next(r for r in records if r.name == "convert_fp16").counts["fp32_attention"] == 32
    model = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    producer = {o: n for n in model.graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    softmax = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert len(softmax) == 32
    for node in softmax:
        assert producer[node.input[0]].op_type == "MatMul" and types[node.input[0]] == F32
        after = consumers[node.output[0]][0]  # the Cast back to fp16 before probabilities x V
        assert types[node.output[0]] == F32 and after.op_type == "Cast" and types[after.output[0]] == F16

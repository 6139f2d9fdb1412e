"""LoRA layers on dead weights (issue 26): tiny-sdxl ``--refittable`` and a LoRA on text_encoder's last layer.

SDXL reads the penultimate hidden state of ``text_encoder``, so its last encoder layer reaches no output: the export
drops it, the refit map finds its weights in no initializer, and ``load_lora`` refused every ordinary SDXL LoRA
("only 140 of its 144 LoRA layers match"). The compile now records those weights as ``dead``
(``compiler/dead_weights.py``) and ``load_lora`` ignores the LoRA's layers on them. Proof that ignoring them is
exact: the image with those layers equals the image without them, the merged compile (``compile --lora``, which
merges them with diffusers) and diffusers' own pipeline with the whole LoRA fused. CPU fp32.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusion_trt.compiler.dead_weights import dead_weights
from diffusion_trt.compiler.dummy_lora import write_dummy_lora
from diffusion_trt.compiler.pipeline import compile_pipeline
from diffusion_trt.config import CompileConfig
from diffusion_trt.errors import LoraError
from diffusion_trt.runtime import EnginePipeline

pytest.importorskip("peft", reason="the merged compile and the reference merge need peft")

COMPONENTS = ("text_encoder", "text_encoder_2", "unet", "vae_decoder")
CALL: dict[str, Any] = {"prompt": "a watercolor fox", "num_inference_steps": 3, "output_type": "np"}
#: text_encoder's last layer in tiny-sdxl (2 layers; transformers 5 names CLIP weights without ``text_model.``)
LAST = "encoder.layers.1."
LAST_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2")


@pytest.fixture(scope="module")
def sdxl_refittable(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_pipeline(tiny_sdxl_dir, tmp_path_factory.mktemp("artifacts") / "sdxl-refit",
                            CompileConfig(refittable=True, components=COMPONENTS))


@pytest.fixture(scope="module")
def lora_files(tiny_sdxl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``full``: dummy-lora's layers (UNet, both text encoders, every layer; rank 4) plus fc1/fc2 of text_encoder's
    last layer (rank 2); ``live``: the same less every layer on text_encoder's last layer; ``dead_only``: only those."""
    d = tmp_path_factory.mktemp("sdxl-loras")
    write_dummy_lora(tiny_sdxl_dir, d / "dummy.safetensors", rank=4, seed=3)
    tensors = load_file(str(d / "dummy.safetensors"))
    prefix = next(k for k in tensors if k.startswith("text_encoder.")).split("encoder.layers.")[0]
    g = torch.Generator().manual_seed(9)
    base = load_file(str(tiny_sdxl_dir / "text_encoder" / "model.safetensors"))
    for mlp in ("mlp.fc1", "mlp.fc2"):
        shape = next(v.shape for k, v in base.items() if k.endswith(f"{LAST}{mlp}.weight"))
        # rank 2 where the rest has rank 4: diffusers reads every module's rank (rank_pattern), dead ones too
        tensors[f"{prefix}{LAST}{mlp}.lora_A.weight"] = torch.randn(2, shape[1], generator=g) * 0.1
        tensors[f"{prefix}{LAST}{mlp}.lora_B.weight"] = torch.randn(shape[0], 2, generator=g) * 0.1
    dead = {k for k in tensors if k.startswith(f"{prefix}{LAST}")}
    files = {"full": d / "full.safetensors", "live": d / "live.safetensors", "dead_only": d / "dead.safetensors"}
    save_file(tensors, str(files["full"]))
    save_file({k: v for k, v in tensors.items() if k not in dead}, str(files["live"]))
    save_file({k: tensors[k] for k in dead}, str(files["dead_only"]))
    return files


def _image(pipe: EnginePipeline) -> np.ndarray:
    return pipe(**CALL, seed=5, progress=False).images


def test_dummy_lora_covers_both_sdxl_text_encoders(tiny_sdxl_dir: Path, tmp_path: Path) -> None:
    counts = write_dummy_lora(tiny_sdxl_dir, tmp_path / "l.safetensors")
    keys = load_file(str(tmp_path / "l.safetensors"))
    assert set(counts) == {"unet", "text_encoder", "text_encoder_2"} and counts["text_encoder_2"] > 0
    assert sum(1 for k in keys if k.startswith("text_encoder_2.") and "lora_A" in k) == counts["text_encoder_2"]


def test_refit_map_records_the_last_text_encoder_layer_as_dead(sdxl_refittable: Path) -> None:
    import json

    manifest = json.loads((sdxl_refittable / "manifest.json").read_text())
    maps = {c: json.loads((sdxl_refittable / manifest["components"][c]["refit_map"]).read_text())
            for c in ("text_encoder", "text_encoder_2", "unet")}
    dead = maps["text_encoder"]["dead"]
    assert {w.removeprefix("text_model.").removeprefix(LAST).removesuffix(".weight") for w in dead} == set(LAST_LINEARS)
    assert all(LAST in w for w in dead) and not set(dead) & set(maps["text_encoder"]["unmapped"])
    assert not set(dead) & set(maps["text_encoder"]["weights"])
    assert maps["text_encoder_2"]["dead"] == [] and maps["unet"]["dead"] == []  # its last layer feeds text_embeds


def test_dead_weights_are_proven_on_the_torch_module(tiny_sdxl_dir: Path, tiny_pipeline_dir: Path) -> None:
    """The check itself: text_encoder's last layer is dead in SDXL's wrapper, nothing in text_encoder_2's, nothing in
    SD 1.x's text encoder with clip skip compiled in; overwriting the dead weights leaves the outputs bit for bit."""
    from diffusion_trt.compiler import export
    from diffusion_trt.compiler.pipeline import model_facts, specs_for

    def dead_of(folder: Path, comp: str, clip_skip: int = 0) -> tuple[list[str], list[str]]:
        mf = export.check_model_folder(folder)
        models = export.load_models(mf, "fp32", "cpu")
        specs = specs_for(model_facts(mf), clip_skip=clip_skip)
        names = [f"{n}.weight" for n, m in models[comp].named_modules() if isinstance(m, torch.nn.Linear)]
        dead = dead_weights(comp, models, specs[comp], names, precision="fp32",
                            profile_ranges=export.export_ranges(CompileConfig().resolve_profile(64)), device="cpu",
                            architecture=mf.architecture)
        return dead, names

    dead, names = dead_of(tiny_sdxl_dir, "text_encoder")
    assert dead and {w.split(LAST)[-1].removesuffix(".weight") for w in dead} == set(LAST_LINEARS)
    assert all(LAST in w for w in dead) and len(names) > len(dead)
    assert dead_of(tiny_sdxl_dir, "text_encoder_2")[0] == []
    assert dead_of(tiny_pipeline_dir, "text_encoder", clip_skip=1)[0] == []


def test_a_weight_autograd_missed_but_the_outputs_read_is_never_dead(tiny_sdxl_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """The noise check is the proof: were the autograd walk wrong (here: made to reach nothing), the live weights
    it would call dead change the outputs, so none is reported dead (their LoRA layers are then refused as before)
    and every weight is restored."""
    from diffusion_trt.compiler import dead_weights as module
    from diffusion_trt.compiler import export
    from diffusion_trt.compiler.pipeline import model_facts, specs_for

    mf = export.check_model_folder(tiny_sdxl_dir)
    models = export.load_models(mf, "fp32", "cpu")
    before = {n: (p.detach().clone(), p.requires_grad) for n, p in models["text_encoder"].named_parameters()}
    names = [f"{n}.weight" for n, m in models["text_encoder"].named_modules() if isinstance(m, torch.nn.Linear)]
    monkeypatch.setattr(module, "_reached_leaves", lambda outputs: set())
    with caplog.at_level(logging.WARNING, logger="diffusion_trt"):
        dead = dead_weights("text_encoder", models, specs_for(model_facts(mf))["text_encoder"], names,
                            precision="fp32", profile_ranges=export.export_ranges(CompileConfig().resolve_profile(64)),
                            device="cpu", architecture="sdxl")
    assert dead == [] and any("treating none as dead" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(p, before[n][0]) and p.requires_grad is before[n][1]
               for n, p in models["text_encoder"].named_parameters())


def test_sdxl_lora_on_the_last_text_encoder_layer_loads_and_changes_nothing_there(
    sdxl_refittable: Path, lora_files: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Reproduces the refusal ("only N of its M LoRA layers match") and its fix: the whole LoRA loads, one INFO
    line counts the ignored layers, and its image equals the image of the LoRA less those layers exactly."""
    with EnginePipeline.from_artifacts(sdxl_refittable) as pipe:
        base = _image(pipe)
        with caplog.at_level(logging.INFO, logger="diffusion_trt"):
            info = pipe.load_lora(lora_files["full"], 0.7)
        full = _image(pipe)
        pipe.load_lora(lora_files["live"], 0.7)
        live = _image(pipe)
        dead_info = pipe.load_lora(lora_files["dead_only"], 0.7)
        dead_only = _image(pipe)
    lines = [r.getMessage() for r in caplog.records if "layers ignored" in r.getMessage()]
    assert len(lines) == 1 and "6 of its" in lines[0] and "text_encoder 6" in lines[0], lines
    assert info["changed"]["text_encoder"] == 4 and info["changed"]["text_encoder_2"] > 0
    assert np.array_equal(full, live)
    assert float(np.abs(full - base).max()) > 1e-2
    assert dead_info["changed"] == {"text_encoder": 0, "text_encoder_2": 0, "unet": 0}
    assert np.array_equal(dead_only, base)


def test_sdxl_lora_with_dead_layers_equals_the_merged_compile_and_diffusers(
    tiny_sdxl_dir: Path, sdxl_refittable: Path, lora_files: dict[str, Path], tmp_path: Path
) -> None:
    """The whole LoRA merged for real (diffusers' fuse_lora, last layer included): the merged compile within 1e-5,
    diffusers' StableDiffusionXLPipeline within 1e-4 (the SDXL parity contract of
    tests/runtime/test_parity_sd21_sdxl.py)."""
    import diffusers

    merged = compile_pipeline(tiny_sdxl_dir, tmp_path / "merged",
                              CompileConfig(loras=((str(lora_files["full"]), 0.7),), components=COMPONENTS))
    with EnginePipeline.from_artifacts(merged) as pipe:
        want = _image(pipe)
    with EnginePipeline.from_artifacts(sdxl_refittable) as pipe:
        pipe.load_lora(lora_files["full"], 0.7)
        got = _image(pipe)
    assert float(np.abs(got - want).max()) <= 1e-5
    ref = diffusers.StableDiffusionXLPipeline.from_pretrained(tiny_sdxl_dir, local_files_only=True,
                                                             add_watermarker=False)
    ref.set_progress_bar_config(disable=True)
    ref.load_lora_weights(str(lora_files["full"]), adapter_name="full")
    ref.fuse_lora(lora_scale=0.7, adapter_names=["full"])
    theirs = ref(**CALL, generator=torch.Generator("cpu").manual_seed(5)).images
    assert float(np.abs(got - theirs).max()) < 1e-4


def test_keys_matching_nothing_are_still_refused(sdxl_refittable: Path, lora_files: dict[str, Path],
                                                 tmp_path: Path) -> None:
    """Dead layers count as matched, never as an excuse: a layer the model lacks (layer 7 of a 2-layer encoder)
    keeps today's refusal, named, and nothing is half-applied."""
    tensors = load_file(str(lora_files["full"]))
    a = next(k for k in tensors if k.startswith("text_encoder.") and k.endswith("q_proj.lora_A.weight"))
    bogus = a.replace("layers.0.", "layers.7.")
    tensors[bogus] = tensors[a].clone()
    tensors[bogus.replace("lora_A", "lora_B")] = tensors[a.replace("lora_A", "lora_B")].clone()
    save_file(tensors, str(tmp_path / "bogus.safetensors"))
    with EnginePipeline.from_artifacts(sdxl_refittable) as pipe:
        base = _image(pipe)
        with pytest.raises(LoraError, match=r"only \d+ of its \d+ LoRA layers match.*layers\.7\."):
            pipe.load_lora(tmp_path / "bogus.safetensors", 0.7)
        assert np.array_equal(_image(pipe), base)


def test_tensorrt_refit_weights_ignore_dead_layers_too(tiny_sdxl_dir: Path, sdxl_refittable: Path,
                                                       lora_files: dict[str, Path]) -> None:
    """The TensorRT refit path reads the same refit maps (no engine needed for the weights it would refit): the
    whole LoRA gives exactly the initializers of the LoRA less its dead layers."""
    import json

    from diffusion_trt.lora import check_lora_file
    from diffusion_trt.runtime.refit import refit_weights

    manifest = json.loads((sdxl_refittable / "manifest.json").read_text())
    maps = {c: json.loads((sdxl_refittable / manifest["components"][c]["refit_map"]).read_text())
            for c in ("text_encoder", "text_encoder_2", "unet")}
    full = refit_weights(maps, tiny_sdxl_dir, check_lora_file(lora_files["full"], 0.7))
    live = refit_weights(maps, tiny_sdxl_dir, check_lora_file(lora_files["live"], 0.7))
    assert {c: sorted(v) for c, v in full.items()} == {c: sorted(v) for c, v in live.items()}
    assert len(full["text_encoder"]) == 4 and all(
        np.array_equal(full[c][n], live[c][n]) for c in full for n in full[c])


def _kohya_unet(tensors: dict[str, torch.Tensor], layers_per_block: int, sgm: bool) -> dict[str, torch.Tensor]:
    """The UNet attention layers of a peft-key LoRA in kohya keys: diffusers' block names
    (``lora_unet_down_blocks_1_attentions_0_...``) or sd-scripts' SDXL SGM ones (``lora_unet_input_blocks_4_1_...``)."""
    step = layers_per_block + 1
    forms = ((r"down_blocks\.(\d+)\.attentions\.(\d+)\.", lambda b, i: f"input_blocks.{1 + b * step + i}.1."),
             (r"mid_block\.attentions\.0\.", lambda: "middle_block.1."),
             (r"up_blocks\.(\d+)\.attentions\.(\d+)\.", lambda b, i: f"output_blocks.{b * step + i}.1."))
    out = {}
    for key, value in tensors.items():
        module, _, matrix = key.removeprefix("unet.").rpartition(".lora_")
        if not key.startswith("unet.") or "attentions" not in module:
            continue
        for pattern, sgm_name in forms:
            if sgm and (m := re.match(pattern, module)):
                module = sgm_name(*map(int, m.groups())) + module[m.end():]
        name = "lora_unet_" + module.replace(".", "_")
        out[f"{name}.lora_{'down' if matrix.startswith('A') else 'up'}.weight"] = value
        out[f"{name}.alpha"] = torch.tensor(2.0)
    return out


def test_a_kohya_sdxl_lora_in_sgm_block_names_loads_as_in_diffusers_names(
    tiny_sdxl_dir: Path, sdxl_refittable: Path, lora_files: dict[str, Path], tmp_path: Path
) -> None:
    """sd-scripts writes SDXL LoRAs with the SGM UNet's block names (input_blocks / middle_block / output_blocks),
    which diffusers' SDXL loader maps with the UNet's layers_per_block (compile --lora merged them): load_lora on an
    ORT --refittable artifact refused them as 'made for another architecture' (none of its layers matched); they
    give the image of the same LoRA in diffusers' block names, bit for bit."""
    layers_per_block = json.loads((tiny_sdxl_dir / "unet" / "config.json").read_text())["layers_per_block"]
    tensors = load_file(str(lora_files["live"]))
    paths = {}
    for sgm in (False, True):
        paths[sgm] = tmp_path / f"kohya_{'sgm' if sgm else 'diffusers'}.safetensors"
        save_file(_kohya_unet(tensors, layers_per_block, sgm), str(paths[sgm]))
    assert any("input_blocks" in k for k in load_file(str(paths[True])))
    with EnginePipeline.from_artifacts(sdxl_refittable) as pipe:
        base = _image(pipe)
        images = {}
        for sgm, path in paths.items():
            images[sgm] = (pipe.load_lora(path, 0.8)["changed"]["unet"], _image(pipe))
    assert images[True][0] == images[False][0] > 0
    assert np.array_equal(images[True][1], images[False][1]) and not np.array_equal(images[True][1], base)

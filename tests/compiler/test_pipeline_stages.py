"""The stages of compile_pipeline one at a time, where the whole-compile tests on this machine do not reach them
(the refit map is written only for full-TensorRT --refittable builds, which need a GPU)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from diffusion_trt.compiler import export, lora
from diffusion_trt.compiler.pipeline import stage, write_refit_map
from diffusion_trt.errors import ArtifactError, BuildError, ExportError, PassError


def test_the_refit_map_stage_writes_the_map_the_manifest_names(tiny_pipeline_dir: Path, tiny_artifact: Path,
                                                                tmp_path: Path) -> None:
    models = export.load_models(export.check_model_folder(tiny_pipeline_dir), "fp32", "cpu")
    model = onnx.load(str(tiny_artifact / "unet" / "model.onnx"))
    entry = write_refit_map("unet", model, models["unet"], tmp_path)
    assert entry == {"refit_map": "unet/refit_map.json"}
    written = json.loads((tmp_path / "unet" / "refit_map.json").read_text())
    assert written == json.loads(json.dumps(lora.refit_map(model, models["unet"])))
    assert written["weights"]  # the LoRA-targetable weights are mapped to initializers


def test_a_stage_names_itself_and_keeps_or_picks_the_error_class() -> None:
    with pytest.raises(ArtifactError, match=r"^compile failed at manifest: gone$"):
        with stage("manifest"):
            raise ArtifactError("gone")
    cases = [("passes", PassError), ("build", BuildError), ("export", ExportError), ("model check", ExportError)]
    for name, cls in cases:
        with pytest.raises(cls, match=rf"^compile failed at {name} of unet: ValueError: bad$") as e:
            with stage(name, "unet"):
                raise ValueError("bad")
        assert isinstance(e.value.__cause__, ValueError)


def test_each_torch_module_is_released_after_the_last_component_that_exports_it(
        tiny_pipeline_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffusion_trt.compiler import pipeline
    from diffusion_trt.config import CompileConfig

    seen: dict[str, list[str]] = {}
    export_component = pipeline.export_component

    def spy(job, plan, models, staging):  # type: ignore[no-untyped-def]
        seen[plan.name] = sorted(models)  # the modules still loaded when this component is exported
        return export_component(job, plan, models, staging)

    monkeypatch.setattr(pipeline, "export_component", spy)
    pipeline.compile_pipeline(tiny_pipeline_dir, tmp_path / "art",
                              CompileConfig(components=("text_encoder", "unet", "vae_encoder", "vae_decoder")))
    assert seen == {"text_encoder": ["text_encoder", "unet", "vae"], "unet": ["unet", "vae"],
                    "vae_encoder": ["vae"], "vae_decoder": ["vae"]}


def test_the_module_keys_follow_the_export_wrappers() -> None:
    assert export.module_keys("unet_controlnet") == ("unet",)
    assert export.module_keys("vae_encoder") == export.module_keys("vae_decoder") == ("vae",)
    assert export.module_keys("controlnet_canny") == ("controlnet_canny",)
    assert export.module_keys("cond_embed_canny") == ("controlnet_canny",)  # the ControlNet's embedding module
    assert export.module_keys("text_encoder_2") == ("text_encoder_2",)


def test_a_stage_lets_an_interrupt_a_library_wrapped_through() -> None:
    """Ctrl-C during an import that defines a class reaches the compile as ``RuntimeError: Error calling
    __set_name__ ...`` raised from the KeyboardInterrupt (seen: SIGINT 3 s into ``compile``, exit 1 'compile failed at
    load models'); the stage re-raises the KeyboardInterrupt so the CLI exits 130, and still wraps other errors."""

    class Descriptor:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with stage("load models"):
            type("Library", (), {"attr": Descriptor()})
    with pytest.raises(ExportError, match=r"RuntimeError: bad$"):
        with stage("load models"):
            try:
                raise ValueError("inner")
            except ValueError:
                raise RuntimeError("bad") from None


def test_an_export_with_its_weights_in_files_of_their_own_compiles_to_the_same_bytes(
        tiny_pipeline_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.onnx.export writes a model of 2 GB or more (the SD-1.5 and SDXL UNets) as one file per weight; compile
    loads it without them and the passes read each weight from its file (passes/_external.py). Forced here on the
    tiny pipeline: the same graphs and weights come out, byte for byte, as from that export loaded whole (as compile
    loaded it before), with the fp16 range check (which runs the export itself in ONNX Runtime) on every component."""
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data

    from diffusion_trt.compiler import pipeline
    from diffusion_trt.config import CompileConfig

    config = CompileConfig(device="cuda", precision="fp16", components=("text_encoder", "unet", "vae_decoder"))
    real_export, real_load, real_optimize = export.onnx_from_component, pipeline.export_component, \
        pipeline.optimize_component
    external: dict[str, int] = {}

    def as_big_models_are_exported(*args, **kwargs):  # type: ignore[no-untyped-def]
        path = real_export(*args, **kwargs)
        # every tensor in a file (torch: those of 1 KiB or more), so the tiny graphs' norm weights, which torch
        # deduplicates into Identity nodes that the folds evaluate, are in files too
        onnx.save_model(onnx.load(str(path)), str(path), save_as_external_data=True, all_tensors_to_one_file=False,
                        size_threshold=0)
        return path

    def loaded_whole(job, plan, models, staging):  # type: ignore[no-untyped-def]
        model, seconds = real_load(job, plan, models, staging)
        load_external_data_for_model(model, str(staging / ".raw" / plan.name))  # what onnx.load(raw) did
        return model, seconds

    def spy(job, plan, model, external_data_dir=None):  # type: ignore[no-untyped-def]
        external[plan.name] = sum(uses_external_data(t) for t in model.graph.initializer)
        return real_optimize(job, plan, model, external_data_dir)

    monkeypatch.setattr(export, "onnx_from_component", as_big_models_are_exported)
    monkeypatch.setattr(pipeline, "optimize_component", spy)
    with monkeypatch.context() as before:
        before.setattr(pipeline, "export_component", loaded_whole)
        whole = pipeline.compile_pipeline(tiny_pipeline_dir, tmp_path / "whole", config)
    assert not any(external.values())
    split = pipeline.compile_pipeline(tiny_pipeline_dir, tmp_path / "split", config)
    assert all(external[name] > 0 for name in config.components)  # the passes got the weights in their files
    for name in config.components:
        files = sorted(p.relative_to(whole).as_posix() for p in (whole / name).rglob("*") if p.is_file())
        assert files and files == sorted(p.relative_to(split).as_posix() for p in (split / name).rglob("*")
                                         if p.is_file())
        for file in files:
            assert (whole / file).read_bytes() == (split / file).read_bytes(), file
    manifests = [json.loads((a / "manifest.json").read_text())["components"] for a in (whole, split)]
    for name in config.components:
        counts = [[p["counts"] for p in manifest[name]["passes"]] for manifest in manifests]
        assert counts[0] == counts[1]
        assert manifests[0][name]["fp16_check"]["hot"] == manifests[1][name]["fp16_check"]["hot"]


def test_loading_the_models_keeps_transformers_bars_off_and_restores_them(tiny_pipeline_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' "Loading weights" bar would run beside compile's own stage bar: off while the models load,
    as it was after."""
    from transformers import CLIPTextModel
    from transformers.utils import logging as hf_logging

    seen: list[bool] = []
    real = CLIPTextModel.from_pretrained.__func__

    def spy(cls: type, *args: object, **kwargs: object) -> object:
        seen.append(hf_logging.is_progress_bar_enabled())
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(CLIPTextModel, "from_pretrained", classmethod(spy))
    before = hf_logging.is_progress_bar_enabled()
    try:
        hf_logging.enable_progress_bar()
        export.load_models(export.check_model_folder(tiny_pipeline_dir), "fp32", "cpu")
        assert seen == [False] and hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        export.load_models(export.check_model_folder(tiny_pipeline_dir), "fp32", "cpu")
        assert not hf_logging.is_progress_bar_enabled()  # left as it was
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()

"""``compile_pipeline``: the whole chain, top to bottom.

    pipeline folder ──check──► torch modules ──export──► raw ONNX ──passes──► optimized ONNX
        ──build──► engine files ──hash──► manifest.json, all inside a staging folder renamed into place.

A failure at any stage raises a :class:`~diffusion_trt.errors.DiffusionTrtError` naming the stage and
the component, and leaves no half artifact (an existing artifact at the destination stays intact).
"""

from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import importlib.metadata
import json
import logging
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx

from .. import artifacts, lora
from ..config import IMAGE_ALIGNMENT, QUANTIZED_PRECISIONS, TRT_BACKENDS, CompileConfig, ShapeProfile
from ..errors import BuildError, DiffusionTrtError, ExportError, OutputPathError, PassError, RuntimeInputError
from . import build_ort, export, quantize
from .components import ComponentSpec, component_specs, tensor_manifest
from .plan import VAE_COMPONENTS, ComponentPlan, component_precision, plan_components

__all__ = ["VAE_COMPONENTS", "compile_pipeline", "component_precision", "model_facts", "pass_options", "specs_for"]

logger = logging.getLogger(__name__)

_TOOLS = ("diffusion-trt", "torch", "diffusers", "transformers", "onnx", "onnx-graphsurgeon",
          "onnxruntime", "onnxruntime-gpu", "tensorrt", "tensorrt-rtx-cu13-bindings", "tensorrt-rtx-cu13-libs")


def tool_versions() -> dict[str, str]:
    """Installed versions of the tools that shape an artifact (absent ones are left out)."""
    out = {}
    for name in _TOOLS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


@contextlib.contextmanager
def _stage(stage: str, component: str | None = None) -> Iterator[None]:
    """Prefix any failure with the stage (and component) it happened in."""
    where = f"{stage} of {component}" if component else stage
    try:
        yield
    except DiffusionTrtError as e:
        raise type(e)(f"compile failed at {where}: {e}") from e
    except Exception as e:
        cls = {"passes": PassError, "build": BuildError}.get(stage, ExportError)
        raise cls(f"compile failed at {where}: {type(e).__name__}: {e}") from e


def _text_max_length(folder: export.ModelFolder, tokenizer: str, text_encoder: dict[str, Any]) -> int:
    """The tokenizer's ``model_max_length``, capped by the text encoder's positions."""
    tok_cfg_path = folder.path / tokenizer / "tokenizer_config.json"
    tok_cfg = folder.config(tokenizer, "tokenizer_config.json") if tok_cfg_path.is_file() else {}
    max_len = int(tok_cfg.get("model_max_length") or text_encoder.get("max_position_embeddings", 77))
    return min(max_len, int(text_encoder.get("max_position_embeddings", max_len)))


#: SDXL's ``time_ids`` per row: original_size (2) + crops_coords_top_left (2) + target_size (2), the list diffusers'
#: ``StableDiffusionXLPipeline._get_add_time_ids`` builds.
SDXL_TIME_IDS = 6


def _sdxl_facts(folder: export.ModelFolder, unet: dict[str, Any], vae: dict[str, Any], te: dict[str, Any],
                max_len: int) -> dict[str, Any]:
    """SDXL's extra model facts, checked against each other as diffusers' pipeline checks them.

    Raises:
        ExportError: the UNet's added conditioning or cross-attention width does not fit the two text encoders.
    """
    te2 = folder.config("text_encoder_2")
    max_len_2 = _text_max_length(folder, "tokenizer_2", te2)
    if max_len_2 != max_len:
        raise ExportError(f"tokenizer/ pads to {max_len} tokens but tokenizer_2/ to {max_len_2}; SDXL concatenates the "
                          "two encoders' states position by position, so both must match: fix the tokenizer configs")
    hidden, hidden_2 = int(te["hidden_size"]), int(te2["hidden_size"])
    pooled = int(te2.get("projection_dim") or hidden_2)
    cross = unet.get("cross_attention_dim")
    if cross != hidden + hidden_2:
        raise ExportError(f"unet/config.json cross_attention_dim={cross}, but text_encoder ({hidden}) + text_encoder_2 "
                          f"({hidden_2}) give {hidden + hidden_2}: the folder mixes components of different models")
    if unet.get("addition_embed_type") != "text_time":
        raise ExportError(f"unet/config.json addition_embed_type={unet.get('addition_embed_type')!r}; an SDXL base "
                          "UNet has 'text_time' (the pooled text and time_ids conditioning): this UNet is not "
                          "supported")
    time_dim = int(unet.get("addition_time_embed_dim") or 0)
    expected = unet.get("projection_class_embeddings_input_dim")
    if time_dim * SDXL_TIME_IDS + pooled != expected:  # diffusers' _get_add_time_ids check
        raise ExportError(f"unet/config.json projection_class_embeddings_input_dim={expected}, but "
                          f"{SDXL_TIME_IDS} time ids x addition_time_embed_dim {time_dim} + text_encoder_2 "
                          f"projection_dim {pooled} = {time_dim * SDXL_TIME_IDS + pooled}: the UNet and "
                          "text_encoder_2 do not belong together")
    index = json.loads((folder.path / "model_index.json").read_text(encoding="utf-8"))
    facts: dict[str, Any] = {
        "text_encoder_2_hidden_size": hidden_2,
        "text_embeds_size": pooled,
        "time_ids_size": SDXL_TIME_IDS,
        "force_zeros_for_empty_prompt": bool(index.get("force_zeros_for_empty_prompt", True)),
        "vae_force_upcast": bool(vae.get("force_upcast", True)),
    }
    if vae.get("latents_mean") is not None and vae.get("latents_std") is not None:
        # diffusers' SDXL pipeline then decodes latents * std / scaling_factor + mean; the runtime does not (yet)
        raise ExportError("vae/config.json sets latents_mean/latents_std (a VAE with normalised latents); the SDXL "
                          "runtime decodes latents / scaling_factor only: this VAE is not supported yet")
    return facts


def model_facts(folder: export.ModelFolder) -> dict[str, Any]:
    """The numbers the runtime needs about the model, read from the component configs.

    Always: VAE factors, UNet/latent channels, text length and width, default size, ``architecture`` ("sd" or
    "sdxl": which loop the runtime runs), ``prediction_type`` (scheduler config) and ``upcast_attention`` (UNet
    config; SD 2.x). SDXL adds the second text encoder's widths, ``time_ids_size``,
    ``force_zeros_for_empty_prompt`` (model_index.json) and ``vae_force_upcast`` (vae/config.json).

    Raises:
        ExportError: a VAE that does not downsample by 8, or SDXL components that do not fit together.
    """
    unet = folder.config("unet")
    vae = folder.config("vae")
    te = folder.config("text_encoder")
    max_len = _text_max_length(folder, "tokenizer", te)
    vae_scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
    if vae_scale != IMAGE_ALIGNMENT:
        raise ExportError(
            f"the VAE downsamples by {vae_scale}, not {IMAGE_ALIGNMENT}; only SD-1.x-shaped VAEs are supported"
        )
    sample_size = unet.get("sample_size", 64)
    sample_size = sample_size[0] if isinstance(sample_size, list | tuple) else sample_size
    sched = folder.config("scheduler", "scheduler_config.json")
    facts: dict[str, Any] = {
        "vae_scale_factor": vae_scale,
        "vae_scaling_factor": float(vae.get("scaling_factor", 0.18215)),
        "unet_in_channels": int(unet.get("in_channels", 4)),
        "unet_out_channels": int(unet.get("out_channels", 4)),
        "latent_channels": int(vae.get("latent_channels", 4)),
        "text_max_length": max_len,
        "text_hidden_size": int(te["hidden_size"]),
        "default_height": int(sample_size) * vae_scale,
        "default_width": int(sample_size) * vae_scale,
        "architecture": folder.architecture,
        "prediction_type": str(sched.get("prediction_type") or "epsilon"),
        "upcast_attention": bool(unet.get("upcast_attention") or False),
    }
    if folder.architecture == "sdxl":
        facts.update(_sdxl_facts(folder, unet, vae, te, max_len))
    return facts


def specs_for(facts: Mapping[str, Any]) -> dict[str, ComponentSpec]:
    """The component table (:func:`~.components.component_specs`) of a model, from :func:`model_facts`."""
    sdxl: dict[str, Any] = {}
    if facts.get("architecture") == "sdxl":
        sdxl = {"text_hidden_2": facts["text_encoder_2_hidden_size"], "text_embeds": facts["text_embeds_size"],
                "time_ids": facts["time_ids_size"]}
    return component_specs(
        text_hidden=facts["text_hidden_size"],
        text_len=facts["text_max_length"],
        unet_in=facts["unet_in_channels"],
        unet_out=facts["unet_out_channels"],
        latent=facts["latent_channels"],
        **sdxl,
    )


def component_names(requested: Sequence[str], facts: Mapping[str, Any]) -> tuple[str, ...]:
    """The components to build: ``requested``, with SDXL's ``text_encoder_2`` right after ``text_encoder``.

    SDXL's prompt encoding needs both text encoders, so asking for ``text_encoder`` means both.
    """
    names = list(dict.fromkeys(requested))
    if facts.get("architecture") == "sdxl" and "text_encoder" in names and "text_encoder_2" not in names:
        names.insert(names.index("text_encoder") + 1, "text_encoder_2")
    return tuple(names)


def pass_options(spec: ComponentSpec, profile: ShapeProfile, facts: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Per-component ``PassContext.options``.

    * every float input of a spec whose dtype is pinned to "float32" (the UNet ``timestep``, SDXL's ``time_ids``)
      stays fp32 through ``convert_fp16``: the manifest promises that dtype to the runtime;
    * a static profile gives ``specialize_shapes`` the one shape of every input;
    * a UNet whose config says ``upcast_attention: true`` (SD 2.x; ``facts["upcast_attention"]``) keeps its attention
      scores fp32 through ``convert_fp16`` (``convert_fp16_fp32_attention``): diffusers computes Q.K^T and the
      softmax in fp32 for these models, whose scores overflow fp16 (the known black images of SD 2.1 in fp16).
    """
    options: dict[str, Any] = {
        "convert_fp16_fp32_inputs": [t.name for t in spec.inputs if t.dtype == "float32"],
    }
    if facts is not None and spec.name == "unet" and facts.get("upcast_attention"):
        options["convert_fp16_fp32_attention"] = True
    if profile.is_static():
        options["static_shapes"] = {t.name: tensor_manifest(t, "fp32", profile)["opt"] for t in spec.inputs}
    return options


def _quantize_stage(folder: export.ModelFolder, models: dict[str, Any], config: CompileConfig,
                    profile: ShapeProfile, source_hash: str, facts: dict[str, Any],
                    lora_records: Sequence[Mapping[str, Any]] = ()) -> quantize.QuantizeStage:
    """The calibrate -> quantize -> gate stage (compiler/quantize.py) over the loaded fp32 torch modules."""
    from transformers import CLIPTokenizer

    from ..passes import pipeline_for
    from ..passes.base import pass_name
    from .calibrate import Generation

    tokenizer = CLIPTokenizer.from_pretrained(folder.path / "tokenizer", local_files_only=True)
    # calibration runs on the CPU in fp32 (the ORT CPU sessions of the gate read numpy): copy CUDA-loaded modules
    cpu_models = {k: (m if next(m.parameters()).device.type == "cpu" else copy.deepcopy(m).to("cpu"))
                  for k, m in models.items()}
    generation = Generation(cpu_models, tokenizer, folder.config("scheduler", "scheduler_config.json"),
                            facts["vae_scaling_factor"])
    qbackend = "tensorrt" if config.backend in TRT_BACKENDS else config.backend  # the QDQ format both libraries read
    passes = pipeline_for(qbackend, config.device, "fp32", "unet", static=profile.is_static())
    key_facts = {"source_sha256": source_hash, "passes": [pass_name(p) for p in passes],
                 "device": config.device, "onnxruntime": tool_versions().get("onnxruntime", "")}
    if lora_records:  # merged LoRAs change the weights: a cache made without them does not apply
        key_facts["loras"] = [[r["sha256"], r["scale"]] for r in lora_records]
    return quantize.QuantizeStage(generation, config.quantize, config.precision, qbackend,
                                  profile.height.opt, profile.width.opt, key_facts)


def _build_engine(plan: ComponentPlan, files: list[Path], inputs: list[dict[str, Any]], folder: Path,
                  config: CompileConfig) -> dict[str, Any]:
    """The build stage of one component: an ORT model check, or a TensorRT / TensorRT-RTX plan in ``folder``."""
    build = plan.trt_build_config(config.refittable)
    if build is None:
        return build_ort.engine_from_onnx(files[0], config.device)
    from . import build_trt

    cache = Path(config.timing_cache).expanduser() if config.timing_cache else None
    return build_trt.engine_from_onnx(files[0], folder / build_trt.PLAN_NAME, inputs, precision=plan.precision,
                                      build=build, timing_cache_dir=cache)


def check_output_folder(out: Path, model_dir: Path) -> None:
    """Refuse an artifact folder that is, contains or lies inside the model folder (replacing it would delete
    the model).

    Raises:
        OutputPathError: naming both folders and the fix.
    """
    o, m = out.resolve(), model_dir.resolve()
    if o == m or m in o.parents or o in m.parents:
        raise OutputPathError(
            f"output folder {out} overlaps the model folder {model_dir}; write the artifact elsewhere "
            "(e.g. -o artifacts/<name>)"
        )


def compile_pipeline(
    model_dir: str | Path,
    out_dir: str | Path,
    config: CompileConfig | None = None,
    *,
    overwrite: bool = False,
    progress: bool = False,
    lock_timeout: float = 0.0,
) -> Path:
    """Compile a diffusers SD 1.x / 2.x / SDXL pipeline folder into an artifact folder.

    Args:
        model_dir: folder written by ``StableDiffusionPipeline.save_pretrained`` (or ``StableDiffusionXLPipeline``:
            then ``text_encoder_2`` is built with ``text_encoder``, and with ``precision="fp16"`` the VAE components
            stay fp32 unless the VAE is fp16-safe; see :func:`component_precision`).
        out_dir: artifact destination; must not exist unless ``overwrite``.
        config: what to build; ``None`` = ``CompileConfig()`` (ORT, CPU, fp32, the model's default size).
        overwrite: replace an existing artifact (atomically, only once the new one is complete).
        progress: show a progress bar (stderr) over components and stages.
        lock_timeout: seconds to wait while another compile writes ``out_dir`` (0 = fail at once); see
            :func:`~diffusion_trt.artifacts.staging_dir`.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ModelFolderError: the model folder is missing, incomplete or pickled without ``trust_pickle``.
        ExportError, PassError, BuildError: a stage failed (message names the stage and component).
        ArtifactError: ``out_dir`` exists and ``overwrite`` is false, or another compile holds its lock.
        RuntimeInputError: the config asks for an impossible profile, int8/fp8 for an SDXL model, or has a pass
            option that does not exist or has the wrong type (:mod:`diffusion_trt.passes.options`).
    """
    from ..passes import PassContext, pipeline_for
    from ..passes.fp16_check import optimize_fp16_checked
    from .fp16_calibration import calibration_feeds

    config = config or CompileConfig()
    from ..passes.options import check_pass_options

    try:  # unknown keys and wrong types fail here, before any export
        check_pass_options(config.pass_options)
    except ValueError as e:
        raise RuntimeInputError(f"pass option {e}; see each pass's docstring (or --dump-passes)") from None
    quantized = config.quantize.components if config.precision in QUANTIZED_PRECISIONS else ()
    if quantized and config.backend != "tensorrt-rtx":  # TensorRT-RTX: CompileConfig checked its targets
        with _stage("quantization preflight"):  # fp8: the target GPU's compute capability, before any work
            quantize.check_fp8_target(config.precision, config.quantize.target_compute_capability)
    if config.backend in TRT_BACKENDS:
        from . import build_trt

        with _stage("TensorRT preflight"):  # no GPU / library / a precision a target lacks: before any work
            target = build_trt.preflight(config.precision, build_trt.TrtBuildConfig(
                library=config.backend, compute_capabilities=config.compute_capabilities))
        logger.info("TensorRT target: %s for compute capability %s", target.library.display,
                    ", ".join(target.compute_capabilities))
    t_start = time.perf_counter()
    out = Path(out_dir)
    with _stage("LoRA check"):  # missing / non-safetensors / duplicate files fail before any work
        lora_files = lora.check_lora_files(config.loras)
    with _stage("model check"):
        folder = export.check_model_folder(model_dir, trust_pickle=config.trust_pickle)
        check_output_folder(out, folder.path)
        facts = model_facts(folder)
        if quantized and facts["architecture"] == "sdxl":
            raise RuntimeInputError(
                f"precision={config.precision!r} is not supported for SDXL models yet: calibration runs the SD 1.x "
                "prompt encoding and loop; use --precision fp16 (or fp32)"
            )
        if quantized and artifacts.is_inpainting(facts):
            raise RuntimeInputError(
                f"precision={config.precision!r} is not supported for inpainting models yet (UNet with "
                f"{facts['unet_in_channels']} input channels): calibration runs the text-to-image loop; use "
                "--precision fp16 (or fp32)"
            )
        profile: ShapeProfile = config.resolve_profile(facts["default_height"])
        if config.fp16_safe_vae and (facts["architecture"] != "sdxl" or config.precision != "fp16"):
            logger.warning("--fp16-safe-vae: no effect %s (it builds an SDXL VAE in fp16 for --precision fp16)",
                           "on an SD 1.x/2.x model, whose VAE follows --precision already"
                           if facts["architecture"] != "sdxl" else f"with --precision {config.precision}")
    specs = specs_for(facts)
    names = component_names(config.components, facts)
    unknown = [c for c in names if c not in specs]
    if unknown or not names:
        raise RuntimeInputError(f"--components: unknown component(s) {unknown or 'none given'}; choose from "
                                f"{', '.join(specs)}")
    torch_device = export.export_device(config.device)
    static = profile.is_static()
    ranges = export.export_ranges(profile)

    from tqdm.auto import tqdm

    with artifacts.staging_dir(out, overwrite=overwrite, lock_timeout=lock_timeout) as stage:
        with _stage("copy tokenizer and scheduler"):
            shutil.copytree(folder.path / "tokenizer", stage / "tokenizer")
            shutil.copytree(folder.path / "scheduler", stage / "scheduler")
            if facts["architecture"] == "sdxl":
                shutil.copytree(folder.path / "tokenizer_2", stage / "tokenizer_2")
        with _stage("load models"):
            # always fp32 (ComponentPlan.export_dtype): fp16 is made by the convert_fp16 pass (fp32 islands, Casts
            # at the borders) for every backend; TensorRT networks are built strongly typed from those types
            models = export.load_models(folder, "fp32", torch_device)
        with _stage("merge LoRA"):  # diffusers' load_lora_weights + fuse_lora, before export (see lora.py)
            lora_records = lora.merge_loras(models, lora_files)
        with _stage("source hash"):
            source_hash = artifacts.folder_hash(folder.path)
        components: dict[str, Any] = {}
        plans = plan_components(config, facts, names)  # every precision / pipeline / builder decision, once
        qstage = (_quantize_stage(folder, models, config, profile, source_hash, facts, lora_records)
                  if quantized else None)
        bar = tqdm(total=3 * len(names), desc="compile", unit="stage", disable=not progress)
        try:
            for name in names:
                spec, plan = specs[name], plans[name]
                precision = plan.precision
                entry: dict[str, Any] = {"precision": precision, "compile_plan": plan.to_json()}
                if plan.precision_note:
                    logger.info("%s: %s", name, plan.precision_note)
                    entry["precision_note"] = plan.precision_note
                raw = stage / ".raw" / name / "model.onnx"
                bar.set_postfix_str(f"{name}: export")
                t0 = time.perf_counter()
                with _stage("export", name):
                    export.onnx_from_component(
                        name, models, spec, raw,
                        precision=plan.export_dtype, profile_ranges=ranges, opset=config.opset, device=torch_device,
                        architecture=folder.architecture,
                    )
                    model = onnx.load(str(raw))
                entry["export_seconds"] = round(time.perf_counter() - t0, 3)
                bar.update()
                bar.set_postfix_str(f"{name}: passes")
                with _stage("passes", name):
                    ctx = PassContext(
                        component=name,
                        backend=plan.pass_backend,
                        device=config.device,
                        precision=plan.pass_precision,
                        opset=config.opset,
                        dump_dir=Path(config.dump_passes) if config.dump_passes else None,
                        options={**pass_options(spec, profile, facts), **config.pass_options},
                    )
                    passes = pipeline_for(plan.pass_backend, config.device, plan.pass_precision, name, static=static)
                    # fp16: the range check keeps overflowing activations fp32 and refuses a graph it cannot make finite
                    model, records, fp16 = optimize_fp16_checked(model, passes, ctx, calibration_feeds(spec, profile))
                entry["passes"] = [r.to_json() for r in records]
                if fp16 is not None:
                    entry["fp16_check"] = fp16.to_json()
                if config.refittable and name in lora.REFIT_COMPONENTS and name in models:
                    with _stage("refit map", name):  # which initializer holds each LoRA-targetable weight
                        (stage / name).mkdir(parents=True, exist_ok=True)
                        rmap = lora.refit_map(model, models[name])
                        (stage / name / "refit_map.json").write_text(json.dumps(rmap, indent=1))
                        entry["refit_map"] = f"{name}/refit_map.json"
                        if rmap["unmapped"]:
                            logger.info("%s: %d weight(s) not refittable by load_lora (padded or shared): %s", name,
                                        len(rmap["unmapped"]), ", ".join(rmap["unmapped"][:4]))
                bar.update()
                bar.set_postfix_str(f"{name}: build")
                entry["inputs"] = [tensor_manifest(t, precision, profile) for t in spec.inputs]
                if qstage is not None and plan.quantized:
                    with _stage("calibrate and quantize", name):
                        fp32_files = build_ort.save_onnx(model, stage / ".raw" / name / "fp32" / "model.onnx")
                        del model
                        entry["quantization"] = qstage.run(name, fp32_files[0], stage / name / "model.onnx",
                                                           stage / "calibration")
                        entry["quality"] = entry["quantization"].pop("quality")
                with _stage("build", name):
                    if plan.quantized:
                        files = sorted((stage / name).glob("model.onnx*"))
                    else:
                        files = build_ort.save_onnx(model, stage / name / "model.onnx")
                        del model
                    entry["build"] = _build_engine(plan, files, entry["inputs"], stage / name, config)
                    if "plan" in entry["build"]:
                        entry["plan"] = f"{name}/{entry['build']['plan']}"
                        files.append(stage / entry["plan"])
                shutil.rmtree(stage / ".raw" / name, ignore_errors=True)
                bar.update()
                entry["onnx"] = f"{name}/model.onnx"
                entry["files"] = [f.relative_to(stage).as_posix() for f in files]
                entry["outputs"] = [tensor_manifest(t, precision, profile) for t in spec.outputs]
                components[name] = entry
        finally:
            bar.close()
        del models
        shutil.rmtree(stage / ".raw", ignore_errors=True)

        with _stage("manifest"):
            sched_cfg = json.loads((stage / "scheduler" / "scheduler_config.json").read_text())
            files = {
                p.relative_to(stage).as_posix(): artifacts.file_entry(stage, p.relative_to(stage).as_posix())
                for p in sorted(stage.rglob("*"))
                if p.is_file()
            }
            manifest = {
                "schema_version": artifacts.SCHEMA_VERSION,
                "name": out.name,
                "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                "pipeline_class": folder.pipeline_class,
                "source": {"path": str(folder.path.resolve()), "sha256": source_hash},
                "backend": config.backend,
                "device": config.device,
                "precision": config.precision,
                "profile": profile.to_json(),
                "model": facts,
                "scheduler": {"class_name": sched_cfg.get("_class_name"), "config": "scheduler/scheduler_config.json"},
                "tokenizer": "tokenizer",
                **({"tokenizer_2": "tokenizer_2"} if facts["architecture"] == "sdxl" else {}),
                "components": components,
                **({"loras": lora_records} if lora_records else {}),
                "files": files,
                "config": config.to_json(),
                "tools": tool_versions(),
                "compile_seconds": round(time.perf_counter() - t_start, 3),
            }
            if not set(artifacts.REQUIRED_COMPONENTS) <= set(components):
                manifest["partial"] = True  # compile --components: inspect/verify read it, the runtime refuses it
            artifacts.write_manifest(stage, manifest)  # sealed: manifest_sha256 over the rest
    logger.info("compiled %s -> %s in %.1f s", folder.path, out, time.perf_counter() - t_start)
    return out

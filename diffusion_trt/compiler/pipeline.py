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
import hashlib
import importlib.metadata
import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnx

from .. import artifacts
from ..config import IMAGE_ALIGNMENT, QUANTIZED_PRECISIONS, CompileConfig, ShapeProfile
from ..errors import BuildError, DiffusionTrtError, ExportError, PassError
from . import build_ort, export, quantize
from .components import ComponentSpec, component_specs, tensor_manifest

logger = logging.getLogger(__name__)

_TOOLS = ("diffusion-trt", "torch", "diffusers", "transformers", "onnx", "onnx-graphsurgeon",
          "onnxruntime", "onnxruntime-gpu", "tensorrt")


def tool_versions() -> dict[str, str]:
    """Installed versions of the tools that shape an artifact (absent ones are left out)."""
    out = {}
    for name in _TOOLS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def folder_hash(root: Path) -> str:
    """sha256 over the sorted (relative path, file sha256) pairs of every file under ``root``."""
    h = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(artifacts.sha256_file(p).encode())
    return h.hexdigest()


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


def model_facts(folder: export.ModelFolder) -> dict[str, Any]:
    """The numbers the runtime needs about the model, read from the component configs."""
    unet = folder.config("unet")
    vae = folder.config("vae")
    te = folder.config("text_encoder")
    tok_cfg_path = folder.path / "tokenizer" / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    max_len = int(tok_cfg.get("model_max_length") or te.get("max_position_embeddings", 77))
    max_len = min(max_len, int(te.get("max_position_embeddings", max_len)))
    vae_scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
    if vae_scale != IMAGE_ALIGNMENT:
        raise ExportError(
            f"the VAE downsamples by {vae_scale}, not {IMAGE_ALIGNMENT}; only SD-1.x-shaped VAEs are supported"
        )
    sample_size = unet.get("sample_size", 64)
    sample_size = sample_size[0] if isinstance(sample_size, list | tuple) else sample_size
    return {
        "vae_scale_factor": vae_scale,
        "vae_scaling_factor": float(vae.get("scaling_factor", 0.18215)),
        "unet_in_channels": int(unet.get("in_channels", 4)),
        "unet_out_channels": int(unet.get("out_channels", 4)),
        "latent_channels": int(vae.get("latent_channels", 4)),
        "text_max_length": max_len,
        "text_hidden_size": int(te["hidden_size"]),
        "default_height": int(sample_size) * vae_scale,
        "default_width": int(sample_size) * vae_scale,
    }


def pass_options(spec: ComponentSpec, profile: ShapeProfile) -> dict[str, Any]:
    """Per-component ``PassContext.options``.

    * every float input of a spec whose dtype is pinned to "float32" (the UNet ``timestep``) stays fp32 through
      ``convert_fp16``: the manifest promises that dtype to the runtime;
    * a static profile gives ``specialize_shapes`` the one shape of every input.
    """
    options: dict[str, Any] = {
        "convert_fp16_fp32_inputs": [t.name for t in spec.inputs if t.dtype == "float32"],
    }
    if profile.is_static():
        options["static_shapes"] = {t.name: tensor_manifest(t, "fp32", profile)["opt"] for t in spec.inputs}
    return options


def _quantize_stage(folder: export.ModelFolder, models: dict[str, Any], config: CompileConfig,
                    profile: ShapeProfile, source_hash: str, facts: dict[str, Any]) -> quantize.QuantizeStage:
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
    passes = pipeline_for(config.backend, config.device, "fp32", "unet", static=profile.is_static())
    key_facts = {"source_sha256": source_hash, "passes": [pass_name(p) for p in passes],
                 "device": config.device, "onnxruntime": tool_versions().get("onnxruntime", "")}
    return quantize.QuantizeStage(generation, config.quantize, config.precision, config.backend,
                                  profile.height.opt, profile.width.opt, key_facts)


def check_output_folder(out: Path, model_dir: Path) -> None:
    """Refuse an artifact folder that is, contains or lies inside the model folder (replacing it would delete
    the model).

    Raises:
        ArtifactError: naming both folders and the fix.
    """
    o, m = out.resolve(), model_dir.resolve()
    if o == m or m in o.parents or o in m.parents:
        raise artifacts.ArtifactError(
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
    """Compile a diffusers SD 1.x pipeline folder into an artifact folder.

    Args:
        model_dir: folder written by ``StableDiffusionPipeline.save_pretrained``.
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
        RuntimeInputError: the config asks for an impossible profile.
    """
    from ..passes import PassContext, optimize_model, pipeline_for

    config = config or CompileConfig()
    quantized = config.quantize.components if config.precision in QUANTIZED_PRECISIONS else ()
    if quantized:
        with _stage("quantization preflight"):  # fp8: the target GPU's compute capability, before any work
            quantize.check_fp8_target(config.precision, config.quantize.target_compute_capability)
    trt_build = None
    if config.backend == "tensorrt":
        from . import build_trt

        # fp16 is made by convert_fp16 (see passes/pipelines.py), so the network is strongly typed
        trt_build = build_trt.TrtBuildConfig(strongly_typed=True if config.precision == "fp16" else None)
        with _stage("TensorRT preflight"):
            build_trt.preflight(config.precision, trt_build)
    t_start = time.perf_counter()
    out = Path(out_dir)
    with _stage("model check"):
        folder = export.check_model_folder(model_dir, trust_pickle=config.trust_pickle)
        check_output_folder(out, folder.path)
        facts = model_facts(folder)
        profile: ShapeProfile = config.resolve_profile(facts["default_height"])
    specs = component_specs(
        text_hidden=facts["text_hidden_size"],
        text_len=facts["text_max_length"],
        unet_in=facts["unet_in_channels"],
        unet_out=facts["unet_out_channels"],
        latent=facts["latent_channels"],
    )
    unknown = [c for c in config.components if c not in specs]
    if unknown:
        raise ExportError(f"unknown component(s) {unknown}; choose from {', '.join(specs)}")
    torch_device = export.export_device(config.device)
    static = profile.is_static()
    ranges = export.export_ranges(profile)

    from tqdm.auto import tqdm

    with artifacts.staging_dir(out, overwrite=overwrite, lock_timeout=lock_timeout) as stage:
        with _stage("copy tokenizer and scheduler"):
            shutil.copytree(folder.path / "tokenizer", stage / "tokenizer")
            shutil.copytree(folder.path / "scheduler", stage / "scheduler")
        with _stage("load models"):
            # always fp32: fp16 is made by the convert_fp16 pass (fp32 islands, Casts at the borders) for ORT,
            # and by the builder's FP16 flag for TensorRT
            models = export.load_models(folder, "fp32", torch_device)
        with _stage("source hash"):
            source_hash = folder_hash(folder.path)
        components: dict[str, Any] = {}
        # int8/fp8: quantized components are fp32 graphs + QDQ; the others stay fp16 (CUDA) / fp32 (CPU)
        other_precision = ("fp16" if config.device == "cuda" else "fp32") if quantized else config.precision
        qstage = _quantize_stage(folder, models, config, profile, source_hash, facts) if quantized else None
        bar = tqdm(total=3 * len(config.components), desc="compile", unit="stage", disable=not progress)
        try:
            for name in config.components:
                spec = specs[name]
                precision = config.precision if name in quantized else other_precision
                entry: dict[str, Any] = {"precision": precision}
                raw = stage / ".raw" / name / "model.onnx"
                bar.set_postfix_str(f"{name}: export")
                t0 = time.perf_counter()
                with _stage("export", name):
                    export.onnx_from_component(
                        name, models, spec, raw,
                        precision="fp32", profile_ranges=ranges, opset=config.opset, device=torch_device,
                    )
                    model = onnx.load(str(raw))
                entry["export_seconds"] = round(time.perf_counter() - t0, 3)
                bar.update()
                bar.set_postfix_str(f"{name}: passes")
                with _stage("passes", name):
                    ctx = PassContext(
                        component=name,
                        backend=config.backend,
                        device=config.device,
                        precision="fp32" if name in quantized else precision,
                        opset=config.opset,
                        dump_dir=Path(config.dump_passes) if config.dump_passes else None,
                        options=pass_options(spec, profile),
                    )
                    passes = pipeline_for(config.backend, config.device, "fp32" if name in quantized else precision,
                                          name, static=static)
                    model, records = optimize_model(model, passes, ctx)
                entry["passes"] = [r.to_json() for r in records]
                bar.update()
                bar.set_postfix_str(f"{name}: build")
                entry["inputs"] = [tensor_manifest(t, precision, profile) for t in spec.inputs]
                if qstage is not None and name in quantized:
                    with _stage("calibrate and quantize", name):
                        fp32_files = build_ort.save_onnx(model, stage / ".raw" / name / "fp32" / "model.onnx")
                        del model
                        entry["quantization"] = qstage.run(name, fp32_files[0], stage / name / "model.onnx",
                                                           stage / "calibration")
                        entry["quality"] = entry["quantization"].pop("quality")
                with _stage("build", name):
                    if name in quantized:
                        files = sorted((stage / name).glob("model.onnx*"))
                    else:
                        files = build_ort.save_onnx(model, stage / name / "model.onnx")
                        del model
                    if trt_build is None:
                        entry["build"] = build_ort.engine_from_onnx(files[0], config.device)
                    else:
                        plan = stage / name / "model.plan"
                        entry["build"] = build_trt.engine_from_onnx(
                            files[0], plan, entry["inputs"], precision=precision, build=trt_build,
                            timing_cache_dir=Path(config.timing_cache).expanduser() if config.timing_cache else None,
                        )
                        entry["plan"] = f"{name}/model.plan"
                        files.append(plan)
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
                "components": components,
                "files": files,
                "config": config.to_json(),
                "tools": tool_versions(),
                "compile_seconds": round(time.perf_counter() - t_start, 3),
            }
            artifacts.write_manifest(stage, manifest)  # sealed: manifest_sha256 over the rest
    logger.info("compiled %s -> %s in %.1f s", folder.path, out, time.perf_counter() - t_start)
    return out

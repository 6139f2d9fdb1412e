"""``compile_pipeline``: the whole chain, top to bottom, one function per stage.

::

    preflight (pass options, fp8 / TensorRT target) ──► prepare (LoRA files, model folder, profile, components:
    a CompileJob) ──► staging folder: copy_tokenizers, load_sources (fp32 torch modules, LoRAs merged, source hash),
    plan_components (every precision / pipeline / builder decision, compiler/plan.py)
    ──► per component (compile_component): export ──► passes ──► [refit map] ──► [calibrate and quantize] ──► build
    ──► seal (manifest.json over every file) ──► the staging folder renamed into place.

A failure at any stage raises a :class:`~diffusion_trt.errors.DiffusionTrtError` naming the stage and
the component (:func:`stage`), and leaves no half artifact (an existing artifact at the destination stays intact).
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from ..artifact import folder as artifacts
from ..artifact.manifest import lora_source
from ..artifact.values import scheduler_config_problems
from ..config import IMAGE_ALIGNMENT, QUANTIZED_PRECISIONS, Backend, CompileConfig, ShapeProfile
from ..errors import (
    BuildError,
    DiffusionTrtError,
    ExportError,
    ModelFolderError,
    OutputPathError,
    PassError,
    RuntimeInputError,
)
from . import build_ort, controlnet, export, lora, lora_slots, quantize
from .components import ComponentSpec, component_specs, tensor_manifest
from .plan import VAE_COMPONENTS, ComponentPlan, component_precision, plan_components

__all__ = ["VAE_COMPONENTS", "CompileJob", "compile_pipeline", "component_precision", "model_facts", "pass_options",
           "specs_for", "stage"]

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
def stage(name: str, component: str | None = None) -> Iterator[None]:
    """Name the stage (and component) in any failure inside: ``compile failed at export of unet: ...``.

    Raises:
        DiffusionTrtError: the same class, message prefixed; any other exception becomes a PassError ("passes"),
            BuildError ("build") or ExportError (every other stage), chained.
        KeyboardInterrupt: also where a library wrapped it in an ordinary exception (Ctrl-C during an import that
            defines a class: ``RuntimeError: Error calling __set_name__ ...``), so Ctrl-C stays exit 130, not a
            stage failure.
    """
    where = f"{name} of {component}" if component else name
    try:
        yield
    except DiffusionTrtError as e:
        raise type(e)(f"compile failed at {where}: {e}") from e
    except Exception as e:
        interrupt = _wrapped_interrupt(e)
        if interrupt is not None:
            raise interrupt from None
        cls = {"passes": PassError, "build": BuildError}.get(name, ExportError)
        raise cls(f"compile failed at {where}: {type(e).__name__}: {e}") from e


def _wrapped_interrupt(e: BaseException) -> BaseException | None:
    """The KeyboardInterrupt, SystemExit or other non-``Exception`` (the CLI's SIGTERM one) that ``e`` was raised
    from or during, if any (``__cause__`` / ``__context__`` chain, each exception looked at once)."""
    seen: set[int] = set()
    link: BaseException | None = e
    while link is not None and id(link) not in seen:
        if not isinstance(link, Exception):
            return link
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return None


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
        "text_encoder_2_layers": int(te2.get("num_hidden_layers", 32)),
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
        ModelFolderError: a scheduler config the runtime cannot run (a class outside its allow-list, a value that
            class does not accept: :func:`~diffusion_trt.artifact.values.scheduler_config_problems`).
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
    problems = scheduler_config_problems(sched, "scheduler/scheduler_config.json")
    if problems:  # the artifact would carry it: verify and run would refuse what compile wrote
        raise ModelFolderError(
            f"{folder.path}: the runtime cannot run this scheduler config: {'; '.join(problems)}; edit it to a "
            f"scheduler class and values the runtime runs (e.g. _class_name EulerDiscreteScheduler, as diffusers' "
            "Class.from_config(pipe.scheduler.config) swap does)"
        )
    facts: dict[str, Any] = {
        "vae_scale_factor": vae_scale,
        "vae_scaling_factor": float(vae.get("scaling_factor", 0.18215)),
        "unet_in_channels": int(unet.get("in_channels", 4)),
        "unet_out_channels": int(unet.get("out_channels", 4)),
        "latent_channels": int(vae.get("latent_channels", 4)),
        "text_max_length": max_len,
        "text_hidden_size": int(te["hidden_size"]),
        "text_encoder_layers": int(te.get("num_hidden_layers", 12)),
        "default_height": int(sample_size) * vae_scale,
        "default_width": int(sample_size) * vae_scale,
        "architecture": folder.architecture,
        "prediction_type": str(sched.get("prediction_type") or "epsilon"),
        "upcast_attention": bool(unet.get("upcast_attention") or False),
    }
    if folder.architecture == "sdxl":
        facts.update(_sdxl_facts(folder, unet, vae, te, max_len))
    return facts


def specs_for(facts: Mapping[str, Any], prompt_chunks: int = 1, clip_skip: int = 0, embedding_vectors: int = 0
              ) -> dict[str, ComponentSpec]:
    """The component table (:func:`~.components.component_specs`) of a model, from :func:`model_facts`, its UNet
    taking up to ``prompt_chunks`` 77-token chunks and its text encoder giving the states of ``clip_skip`` skipped
    layers and taking ``embedding_vectors`` textual-inversion rows (SDXL: both text encoders; see
    :func:`prompt_chunks_for`, :func:`clip_skip_for`)."""
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
        prompt_chunks=prompt_chunks,
        clip_skip=clip_skip,
        embedding_vectors=embedding_vectors,
        **sdxl,
    )


def clip_skip_for(config: CompileConfig, facts: Mapping[str, Any]) -> int:
    """The clip skips the text encoder serves: ``config.max_clip_skip``, at most its layers less one (logged when
    fewer). SDXL: at most the smaller of its two encoders' layers less one (both serve the same clip skips; c reads
    ``hidden_states[-(c + 2)]``, down to ``hidden_states[0]``, the token embeddings, as diffusers allows)."""
    k = config.max_clip_skip
    layers = int(facts.get("text_encoder_layers", k + 1))
    if facts.get("architecture") == "sdxl":
        layers = min(layers, int(facts.get("text_encoder_2_layers", layers)))
    most = max(0, layers - 1)
    if k > most:  # a warning only when asked for: the default (2) exceeds what a tiny test model has
        logger.log(_level_for(config, "max_clip_skip"), "max_clip_skip=%d: the text encoder has %d layers; clip skip "
                   "goes up to %d", k, most + 1, most)
    return min(k, most)


def _level_for(config: CompileConfig, field: str) -> int:
    """WARNING for a setting the user changed that is cut back (a ``warning:`` line: what was asked is not what is
    built), DEBUG for its default (a default that does not apply is no news)."""
    default = CompileConfig.__dataclass_fields__[field].default
    return logging.DEBUG if getattr(config, field) == default else logging.WARNING


def prompt_chunks_for(config: CompileConfig, profile: ShapeProfile, facts: Mapping[str, Any]) -> int:
    """The prompt chunks the UNet is built for: ``config.max_prompt_chunks``, but 1 for a static profile (one fixed
    shape, one CUDA graph), logged when more were asked. SDXL chunks both encoders alike (:mod:`~..runtime.sdxl`)."""
    k = config.max_prompt_chunks
    why = "a static profile is one fixed shape" if profile.is_static() else None
    if why is None or k == 1:
        return k
    logger.log(_level_for(config, "max_prompt_chunks"), "max_prompt_chunks=%d: the UNet takes 77 tokens only (%s); "
               "prompts are cut at 75 tokens", k, why)
    return 1


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
      softmax in fp32 for these models, whose scores overflow fp16 (the known black images of SD 2.1 in fp16);
    * the image dims are IMAGE_ALIGNMENT x the latent's (``H = 8*h``; ``infer_symbolic_shapes_dim_relations``): a
      ControlNet adds its control image's embedding (from H) to the latent's (h), and its fusions need the two
      dims to be one symbol.
    """
    options: dict[str, Any] = {
        "convert_fp16_fp32_inputs": [t.name for t in spec.inputs if t.dtype == "float32"],
        "infer_symbolic_shapes_dim_relations": {"H": f"{IMAGE_ALIGNMENT}*h", "W": f"{IMAGE_ALIGNMENT}*w"},
    }
    unets = spec.name in ("unet", controlnet.UNET_CONTROLNET) or spec.name.startswith(controlnet.PREFIX)
    if facts is not None and unets and facts.get("upcast_attention"):
        options["convert_fp16_fp32_attention"] = True
    if profile.is_static():
        options["static_shapes"] = {t.name: tensor_manifest(t, "fp32", profile, spec.symbols)["opt"]
                                    for t in spec.inputs}
    return options


def deterministic_pass_options(config: CompileConfig) -> dict[str, Any]:
    """The pass options of ``config.deterministic``: ORT CUDA leaves GroupNorm unfused (see CompileConfig)."""
    if not config.deterministic:
        return {}
    if config.backend is not Backend.ORT or config.device != "cuda":
        logger.warning("--deterministic: no effect with --backend %s --device %s (it leaves ORT CUDA's GroupNorm "
                       "unfused)", config.backend, config.device)
        return {}
    return {"fuse_group_norm_deterministic": True}


def _quantize_stage(folder: export.ModelFolder, models: dict[str, Any], config: CompileConfig,
                    profile: ShapeProfile, source_hash: str, facts: dict[str, Any],
                    lora_records: Sequence[Mapping[str, Any]] = ()) -> quantize.QuantizeStage:
    """The calibrate -> quantize -> gate stage (compiler/quantize/) over the loaded fp32 torch modules."""
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
    qbackend = Backend.TENSORRT if config.backend.is_tensorrt else config.backend  # the QDQ format both libraries read
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
    source_sha256: str | None = None,
    preflight_done: bool = False,
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
            :func:`~diffusion_trt.artifact.folder.staging_dir`.
        source_sha256: ``artifacts.folder_hash(model_dir)`` when the caller has it already (compile_model hashes
            the folder for the compile cache's key); ``None`` = hash it here.
        preflight_done: :func:`preflight` ran already (:func:`check_before_conversion`): not run again.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        ModelFolderError: the model folder is missing, incomplete or pickled without ``trust_pickle``.
        ExportError, PassError, BuildError: a stage failed (message names the stage and component).
        ArtifactError: ``out_dir`` exists and ``overwrite`` is false, or another compile holds its lock.
        RuntimeInputError: the config asks for an impossible profile, int8/fp8 for an SDXL model, or has a pass
            option that does not exist or has the wrong type (:mod:`diffusion_trt.passes.options`).
    """
    config = config or CompileConfig()
    if not preflight_done:
        preflight(config)
    t_start = time.perf_counter()
    job = prepare(model_dir, Path(out_dir), config)
    with artifacts.staging_dir(job.out, overwrite=overwrite, lock_timeout=lock_timeout) as staging:
        copy_tokenizers(job, staging)
        models, lora_records, source_hash = load_sources(job, source_sha256)
        plans = plan_components(config, job.facts, job.names)  # every precision / pipeline / builder decision, once
        qstage = (_quantize_stage(job.folder, models, config, job.profile, source_hash, job.facts, lora_records)
                  if quantized_components(config) else None)
        components = compile_components(job, plans, models, qstage, staging, progress)
        del models
        shutil.rmtree(staging / ".raw", ignore_errors=True)
        seal(job, staging, components, lora_records, source_hash, t_start)
    logger.info("compiled %s -> %s in %.1f s", job.folder.path, job.out, time.perf_counter() - t_start)
    return job.out


# -- before any work: the config, the target, the model --------------------------------------------------------


@dataclass(frozen=True)
class CompileJob:
    """What every stage of one compile reads, checked before the staging folder exists (:func:`prepare`).

    Attributes:
        config: the compile config.
        out: the artifact folder to write.
        folder: the checked model folder.
        facts: :func:`model_facts` of the model (the manifest's ``model``).
        profile: the resolved shape profile.
        specs: the model's component table (:func:`specs_for`).
        names: the components to build, in order (:func:`component_names`).
        lora_files: the checked LoRA files to merge (``lora.check_lora_files``).
        torch_device: where torch traces ("cpu" or "cuda", :func:`~.export.export_device`).
        ranges: the profile's symbol ranges (:func:`~.export.export_ranges`).
        deterministic_options: :func:`deterministic_pass_options` of the config, computed (and its "no effect"
            warning logged) once per compile, not once per component.
    """

    config: CompileConfig
    out: Path
    folder: export.ModelFolder
    facts: dict[str, Any]
    profile: ShapeProfile
    specs: Mapping[str, ComponentSpec]
    names: tuple[str, ...]
    lora_files: Any
    torch_device: str
    ranges: Mapping[str, tuple[int, int, int]]
    deterministic_options: Mapping[str, Any] = field(default_factory=dict)
    controlnets: tuple[controlnet.ControlNetSource, ...] = ()



def quantized_components(config: CompileConfig) -> tuple[str, ...]:
    """The components calibrated and QDQ-quantized: ``config.quantize.components`` for int8/fp8, else none."""
    return tuple(config.quantize.components) if config.precision in QUANTIZED_PRECISIONS else ()


def preflight(config: CompileConfig) -> None:
    """Checks that need neither the model nor any work: pass options, the fp8 target, the TensorRT target.

    Raises:
        RuntimeInputError: a pass option that does not exist or has the wrong type; ``deterministic`` with
            ``fuse_group_norm_deterministic=False``.
        BuildError: fp8 for a GPU older than 8.9, no GPU / library for TensorRT, a precision a target lacks.
    """
    from ..passes.options import check_pass_options

    try:  # unknown keys and wrong types fail here, before any export
        check_pass_options(config.pass_options)
    except ValueError as e:
        raise RuntimeInputError(f"pass option {e}; see each pass's docstring (or --dump-passes)") from None
    if config.deterministic and config.pass_options.get("fuse_group_norm_deterministic", True) is False:
        raise RuntimeInputError(  # the manifest would say deterministic while the GroupNorms are fused
            "--deterministic with --pass-option fuse_group_norm_deterministic=false contradict each other; drop one")
    if quantized_components(config) and config.backend is not Backend.TENSORRT_RTX:  # RTX: CompileConfig checked it
        with stage("quantization preflight"):  # fp8: the target GPU's compute capability, before any work
            quantize.check_fp8_target(config.precision, config.quantize.target_compute_capability)
    if config.backend.is_tensorrt:
        from . import build_trt

        with stage("TensorRT preflight"):  # no GPU / library / a precision a target lacks: before any work
            target = build_trt.preflight(config.precision, build_trt.TrtBuildConfig(
                library=config.backend, compute_capabilities=config.compute_capabilities))
        logger.info("TensorRT target: %s for compute capability %s", target.library.display,
                    ", ".join(target.compute_capabilities))


def prepare(model_dir: str | Path, out: Path, config: CompileConfig) -> CompileJob:
    """Check the LoRA files, the model folder, the output folder, the profile and the components: a :class:`CompileJob`.

    Raises:
        ModelFolderError, OutputPathError, ExportError: as :func:`compile_pipeline` says.
        RuntimeInputError: int8/fp8 for SDXL or inpainting models, an impossible profile, unknown components.
    """
    with stage("LoRA check"):  # missing / non-safetensors / duplicate files fail before any work
        lora_files = lora.check_lora_files(config.loras)
    with stage("model check"):
        folder = export.check_model_folder(model_dir, trust_pickle=config.trust_pickle)
        check_output_folder(out, folder.path)
        facts = model_facts(folder)
        check_quantizable(config, facts)
        profile: ShapeProfile = config.resolve_profile(facts["default_height"])
        _warn_fp16_safe_vae(config, facts)
    specs = specs_for(facts, prompt_chunks_for(config, profile, facts), clip_skip_for(config, facts),
                      config.max_embedding_vectors)
    sources, control_specs = _controlnet_specs(config, folder, specs)
    specs.update(control_specs)
    names = component_names(config.components, facts)
    if control_specs and not any(n in control_specs for n in names):
        names = (*names, *control_specs)  # --controlnet without naming its components in --components: all of them
    names = controlnet.with_embeddings(names, control_specs)  # controlnet_<name> brings its cond_embed_<name>
    unknown = [c for c in names if c not in specs]
    if unknown or not names:
        what = f"unknown component(s) {unknown}" if unknown else "no component given"
        raise RuntimeInputError(f"--components: {what}; choose from {', '.join(specs)}")
    return CompileJob(config, out, folder, facts, profile, specs, names, lora_files,
                      torch_device=export.export_device(config.device), ranges=export.export_ranges(profile),
                      deterministic_options=deterministic_pass_options(config), controlnets=sources)


def _controlnet_specs(config: CompileConfig, folder: export.ModelFolder, specs: Mapping[str, ComponentSpec]
                      ) -> tuple[tuple[controlnet.ControlNetSource, ...], dict[str, ComponentSpec]]:
    """The checked ``config.controlnets`` and the specs of ``unet_controlnet`` and each ``cond_embed_<name>`` and
    ``controlnet_<name>`` (:mod:`.controlnet`); nothing without ControlNets.

    Raises:
        ModelFolderError, RuntimeInputError: as :func:`~.controlnet.check_controlnets`.
    """
    if not config.controlnets:
        return (), {}
    unet_config = folder.config("unet")
    with stage("ControlNet check"):
        sources = controlnet.check_controlnets(config.controlnets, unet_config, folder.path)
    return sources, controlnet.controlnet_specs(specs["unet"], unet_config, sources)


def check_before_conversion(config: CompileConfig, facts: Mapping[str, Any]) -> None:
    """What :func:`prepare` checks that a single file's header already tells (``CheckpointInfo.facts``): the LoRA
    files, int8/fp8 on SDXL or inpainting, the profile against the architecture's default size; so a wrong option
    fails before the checkpoint's conversion, not after it. :func:`prepare` checks all of it again on the converted
    folder.

    Runs :func:`preflight` first and names the stages as :func:`compile_pipeline` does, so the error line is the
    one compiling the converted folder gives (``compile_pipeline(..., preflight_done=True)`` then skips it).

    Raises:
        ModelFolderError, RuntimeInputError, BuildError: as :func:`preflight` and :func:`prepare`.
    """
    preflight(config)
    with stage("LoRA check"):
        lora.check_lora_files(config.loras)
    with stage("model check"):
        check_quantizable(config, facts)
        config.resolve_profile(facts["default_height"])


def check_quantizable(config: CompileConfig, facts: Mapping[str, Any]) -> None:
    """int8/fp8 calibration runs the SD 1.x text-to-image loop: refuse SDXL and inpainting models.

    Raises:
        RuntimeInputError: naming the precision, the model kind and the fix.
    """
    if not quantized_components(config):
        return
    if facts["architecture"] == "sdxl":
        raise RuntimeInputError(
            f"precision={config.precision!r} is not supported for SDXL models yet: calibration runs the SD 1.x "
            "prompt encoding and loop; use --precision fp16 (or fp32)"
        )
    if artifacts.is_inpainting(facts):
        raise RuntimeInputError(
            f"precision={config.precision!r} is not supported for inpainting models yet (UNet with "
            f"{facts['unet_in_channels']} input channels): calibration runs the text-to-image loop; use "
            "--precision fp16 (or fp32)"
        )


def replay_model_warnings(model_dir: Path, config: CompileConfig) -> None:
    """The warnings :func:`prepare` logs about ``config`` on this model (a setting cut back: ``--max-clip-skip``
    beyond the text encoder's layers, ``--max-prompt-chunks`` on a static profile; ``--fp16-safe-vae`` without
    effect), for a compile cache hit, which runs no :func:`prepare` but builds the same artifact: what was asked is
    still not what is built. Reads the component configs only; a folder they cannot be read from says nothing here
    (the entry was compiled from it)."""
    try:
        facts = model_facts(export.check_model_folder(model_dir, trust_pickle=config.trust_pickle))
        profile = config.resolve_profile(facts["default_height"])
    except DiffusionTrtError as e:
        logger.debug("compile cache hit: the model's warnings are not repeated (%s)", e)
        return
    _warn_fp16_safe_vae(config, facts)
    prompt_chunks_for(config, profile, facts)
    clip_skip_for(config, facts)


def _warn_fp16_safe_vae(config: CompileConfig, facts: Mapping[str, Any]) -> None:
    """``--fp16-safe-vae`` only changes an SDXL fp16 build: say so when it has no effect."""
    if config.fp16_safe_vae and (facts["architecture"] != "sdxl" or config.precision != "fp16"):
        logger.warning("--fp16-safe-vae: no effect %s (it builds an SDXL VAE in fp16 for --precision fp16)",
                       "on an SD 1.x/2.x model, whose VAE follows --precision already"
                       if facts["architecture"] != "sdxl" else f"with --precision {config.precision}")


# -- inside the staging folder: the sources ---------------------------------------------------------------------


def copy_tokenizers(job: CompileJob, staging: Path) -> None:
    """Copy the tokenizer(s) and the scheduler config into the artifact as they are, each tokenizer with its
    ``tokenizer.json`` (:func:`ensure_tokenizer_json`)."""
    with stage("copy tokenizer and scheduler"):
        shutil.copytree(job.folder.path / "scheduler", staging / "scheduler")
        for name in ("tokenizer", "tokenizer_2") if job.facts["architecture"] == "sdxl" else ("tokenizer",):
            shutil.copytree(job.folder.path / name, staging / name)
            ensure_tokenizer_json(staging / name)


def ensure_tokenizer_json(folder: Path) -> None:
    """Write ``folder/tokenizer.json`` when the model's tokenizer folder has none (SD-1.5 repositories ship only
    ``vocab.json`` + ``merges.txt``): the ``tokenizers`` BPE that transformers builds for ``CLIPTokenizer`` from
    those files, which the runtime tokenizes with, without importing transformers
    (:mod:`diffusion_trt.runtime.tokenizer`). A folder that has one keeps it (transformers >= 5 loads it)."""
    if (folder / "tokenizer.json").is_file() or not (folder / "vocab.json").is_file():
        return
    from transformers import CLIPTokenizerFast

    tokenizer = CLIPTokenizerFast.from_pretrained(folder, local_files_only=True)
    (folder / "tokenizer.json").write_text(tokenizer.backend_tokenizer.to_str(), encoding="utf-8")


def load_sources(job: CompileJob, source_sha256: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
    """The fp32 torch modules (LoRAs merged), the LoRA records and the model folder's hash (``source_sha256`` when
    given: the caller's :func:`~diffusion_trt.artifact.folder.folder_hash` of the same folder)."""
    with stage("load models"):
        # always fp32 (ComponentPlan.export_dtype): fp16 is made by the convert_fp16 pass (fp32 islands, Casts
        # at the borders) for every backend; TensorRT networks are built strongly typed from those types
        models = export.load_models(job.folder, "fp32", job.torch_device)
        models.update(controlnet.load_controlnets(job.controlnets, job.torch_device))
    with stage("merge LoRA"):  # diffusers' load_lora_weights + fuse_lora, before export (see lora.py)
        lora_records = lora.merge_loras(models, job.lora_files)
    if source_sha256 is not None:
        return models, lora_records, source_sha256
    with stage("source hash"):
        source_hash = artifacts.folder_hash(job.folder.path)
    return models, lora_records, source_hash


# -- one component: export -> passes -> (quantize) -> build -----------------------------------------------------


def compile_components(job: CompileJob, plans: Mapping[str, ComponentPlan], models: dict[str, Any],
                       qstage: quantize.QuantizeStage | None, staging: Path, progress: bool) -> dict[str, Any]:
    """Every component's manifest entry, in ``job.names`` order, with a progress bar over their stages."""
    from tqdm.auto import tqdm

    bar = tqdm(total=3 * len(job.names), desc="compile", unit="stage", disable=not progress)
    last = {key: name for name in job.names for key in export.module_keys(name)}  # the last component reading each
    try:
        return {name: compile_component(job, plans[name], models, qstage, staging, bar,
                                        done_with=() if qstage else tuple(k for k, n in last.items() if n == name))
                for name in job.names}
    finally:
        bar.close()


def release_modules(models: dict[str, Any], keys: Sequence[str]) -> None:
    """Drop the torch modules no later component exports and hand their memory back to the OS.

    Why: every module stayed loaded to the end of the compile, so the VAE decoder's fp16 range check ran beside the
    fp32 UNet's 3.4 GB (SD-1.5; peak 13.4 GB at batch 4 on the H200, 2026-12-01). Their weights are mostly
    safetensors file mappings, unmapped once the last reference goes; ``malloc_trim`` returns the freed heap that
    glibc would otherwise keep (a no-op elsewhere).
    """
    if any(models.pop(k, None) is not None for k in keys):
        trim_heap()


def trim_heap() -> None:
    """Collect garbage and hand the freed heap back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Why: glibc keeps what a component's protos and arrays freed. After the SD-1.5 UNet (its graph freed before the
    build) the process still held 5.9 GB when the VAE decoder's export began, and that export's 3.4 GB came on top:
    the b4 compile's peak, 9.29 GB on the 2-core machine (benchmarks/results/README.md, fifteenth session).
    """
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def compile_component(job: CompileJob, plan: ComponentPlan, models: dict[str, Any],
                      qstage: quantize.QuantizeStage | None, staging: Path, bar: Any,
                      done_with: Sequence[str] = ()) -> dict[str, Any]:
    """One component's manifest entry: export, passes, refit map, quantize (int8/fp8), build; files in ``staging``.
    The modules ``done_with`` are released (:func:`release_modules`) as soon as this component no longer reads them:
    after the export, or after the refit map of a refittable component."""
    name, spec = plan.name, job.specs[plan.name]
    entry: dict[str, Any] = {"precision": plan.precision, "compile_plan": plan.to_json()}
    if plan.precision_note:
        logger.info("%s: %s", name, plan.precision_note)
        entry["precision_note"] = plan.precision_note
    bar.set_postfix_str(f"{name}: export")
    model, entry["export_seconds"] = export_component(job, plan, models, staging)
    source = refit_source(job, name)
    refit = source is not None and source in models
    if not refit:
        release_modules(models, done_with)
    bar.update()
    bar.set_postfix_str(f"{name}: passes")
    model, optimized = optimize_component(job, plan, model, external_data_dir=staging / ".raw" / name)
    entry.update(optimized)
    if refit:
        entry.update(write_refit_map(name, model, models[source], staging, find_dead(job, plan, models)))
        release_modules(models, done_with)
        if job.config.backend is Backend.ORT:  # the mapped weights become graph inputs (see lora_slots.py)
            rmap = json.loads((staging / entry["refit_map"]).read_text())
            share = source if source != name and source in job.names else None  # unet_controlnet: unet's file
            model, slots = lora_slots.write_weight_inputs(name, model, rmap, staging,
                                                          refit_convs=job.config.refit_convs, share_with=share,
                                                          device=job.config.device)
            entry["passes"] = [*entry.get("passes", []), *slots.pop("passes")]  # the pointwise rewrite's record
            entry.update(slots)
            (staging / entry["refit_map"]).write_text(json.dumps(rmap, indent=1))  # the 1x1 Convs' now [C, O]
    bar.update()
    bar.set_postfix_str(f"{name}: build")
    entry["inputs"] = [tensor_manifest(t, plan.precision, job.profile, spec.symbols) for t in spec.inputs]
    saved = save_optimized(plan, model, staging)
    del model  # GBs for a UNet: gone before calibration and the engine build
    trim_heap()
    if plan.quantized:
        assert qstage is not None  # plan.quantized only for quantized_components(config)
        entry.update(quantize_component(qstage, plan, saved[0], staging))
    entry["build"], files = build_component(job, plan, saved, entry["inputs"], staging)
    if "plan" in entry["build"]:
        entry["plan"] = f"{name}/{entry['build']['plan']}"
    shutil.rmtree(staging / ".raw" / name, ignore_errors=True)
    bar.update()
    entry["onnx"] = f"{name}/model.onnx"
    entry["files"] = [f.relative_to(staging).as_posix() for f in files]
    if entry.get("weight_inputs", "").startswith(f"{name}/"):  # not another component's file it shares
        entry["files"].append(entry["weight_inputs"])
    entry["outputs"] = [tensor_manifest(t, plan.precision, job.profile, spec.symbols) for t in spec.outputs]
    return entry


def refit_source(job: CompileJob, name: str) -> str | None:
    """The model (``models`` key) whose weights ``--refittable`` maps for component ``name``, ``None`` when it gets
    no refit map: ``unet`` and the text encoders their own; ``unet_controlnet`` the ``unet``'s, on ONNX Runtime only
    (its weights become inputs like the plain UNet's, so run-time LoRAs reach ControlNet calls; TensorRT's refit
    reads the base weights of ``unet`` and the text encoders from the model folder and refits those engines alone,
    so a TensorRT ``unet_controlnet`` stays constant and the runtime refuses a UNet LoRA for control-image calls)."""
    source = lora_source(name) if job.config.refittable else None
    if source is None or source not in lora.REFIT_COMPONENTS:
        return None
    return source if source == name or job.config.backend is Backend.ORT else None


def export_component(job: CompileJob, plan: ComponentPlan, models: dict[str, Any],
                     staging: Path) -> tuple[onnx.ModelProto, float]:
    """The export stage: the torch module -> raw ONNX (``.raw/<name>/``), loaded without its external data (the
    weights torch writes to files of their own for a model of 2 GB or more stay there: the passes read them one at a
    time, :mod:`diffusion_trt.passes._external`); and the seconds it took.

    Why: loaded whole, the SDXL UNet's 10.3 GB of fp32 weights sat in one protobuf arena beside the torch module's
    (mapped from the safetensors) and then through the passes beside the 5.1 GB of fp16 ones: the passes stage held
    16.4 GB (benchmarks/results/README.md, twentieth session)."""
    raw = staging / ".raw" / plan.name / "model.onnx"
    t0 = time.perf_counter()
    with stage("export", plan.name):
        export.onnx_from_component(
            plan.name, models, job.specs[plan.name], raw,
            precision=plan.export_dtype, profile_ranges=job.ranges, opset=job.config.opset, device=job.torch_device,
            architecture=job.folder.architecture,
        )
        model = onnx.load(str(raw), load_external_data=False)
    return model, round(time.perf_counter() - t0, 3)


def optimize_component(job: CompileJob, plan: ComponentPlan, model: onnx.ModelProto,
                       external_data_dir: Path | None = None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """The passes stage: the plan's pass pipeline (fp16: with the activation range check); the optimized graph and
    the manifest's ``passes`` (and ``fp16_check``). ``external_data_dir``: the export's folder, where the weights of
    ``model`` (loaded without its external data) are read from."""
    from ..passes import PassContext, pipeline_for
    from ..passes.fp16_check import optimize_fp16_checked
    from .fp16_calibration import calibration_feeds, first_sample

    config, name, spec = job.config, plan.name, job.specs[plan.name]
    with stage("passes", name):
        ctx = PassContext(
            component=name,
            backend=plan.pass_backend,
            device=config.device,
            precision=plan.pass_precision,
            opset=config.opset,
            dump_dir=Path(config.dump_passes) if config.dump_passes else None,
            options={**pass_options(spec, job.profile, job.facts), **job.deterministic_options,
                     **config.pass_options},
            external_data_dir=external_data_dir,
        )
        passes = pipeline_for(plan.pass_backend, config.device, plan.pass_precision, name,
                              static=job.profile.is_static())
        # fp16: the range check keeps overflowing activations fp32 and refuses a graph it cannot make finite
        feeds = calibration_feeds(spec, job.profile)
        model, records, fp16 = optimize_fp16_checked(model, passes, ctx, feeds, first_sample(spec, feeds))
    facts: dict[str, Any] = {"passes": [r.to_json() for r in records]}
    if fp16 is not None:
        facts["fp16_check"] = fp16.to_json()
    return model, facts


def write_refit_map(name: str, model: onnx.ModelProto, module: Any, staging: Path,
                    find_dead: Callable[[list[str]], Sequence[str]] | None = None) -> dict[str, str]:
    """Which initializer holds each LoRA-targetable weight (``<name>/refit_map.json``, and which reach no output:
    ``find_dead``, see :func:`~.lora.refit_map`); the manifest's ``refit_map``."""
    with stage("refit map", name):
        (staging / name).mkdir(parents=True, exist_ok=True)
        rmap = lora.refit_map(model, module, find_dead)
        (staging / name / "refit_map.json").write_text(json.dumps(rmap, indent=1))
        if rmap["unmapped"]:
            logger.info("%s: %d weight(s) not refittable by load_lora (padded or shared): %s", name,
                        len(rmap["unmapped"]), ", ".join(rmap["unmapped"][:4]))
        if rmap["dead"]:
            logger.info("%s: %d weight(s) reach no output of the graph (a LoRA's layers on them change nothing; "
                        "load_lora ignores them): %s", name, len(rmap["dead"]), ", ".join(rmap["dead"][:4]))
    return {"refit_map": f"{name}/refit_map.json"}


def find_dead(job: CompileJob, plan: ComponentPlan, models: dict[str, Any]) -> Callable[[list[str]], list[str]]:
    """:func:`~.dead_weights.dead_weights` of ``plan``'s component at its export's inputs (for
    :func:`write_refit_map`)."""
    from .dead_weights import dead_weights

    return lambda names: dead_weights(
        plan.name, models, job.specs[plan.name], names, precision=plan.export_dtype, profile_ranges=job.ranges,
        device=job.torch_device, architecture=job.folder.architecture)


def save_optimized(plan: ComponentPlan, model: onnx.ModelProto, staging: Path) -> list[Path]:
    """Save the optimized graph: a quantized component's fp32 graph goes to ``.raw/<name>/fp32/`` (the quantize
    stage reads it), any other's is the artifact's ``<name>/model.onnx``. Returns the files written."""
    if plan.quantized:
        with stage("calibrate and quantize", plan.name):
            return build_ort.save_onnx(model, staging / ".raw" / plan.name / "fp32" / "model.onnx")
    with stage("build", plan.name):
        return build_ort.save_onnx(model, staging / plan.name / "model.onnx")


def quantize_component(qstage: quantize.QuantizeStage, plan: ComponentPlan, fp32_file: Path,
                       staging: Path) -> dict[str, Any]:
    """The quantize stage: calibrate, write the QDQ graph as ``<name>/model.onnx``, gate; the manifest's
    ``quantization`` and ``quality``."""
    with stage("calibrate and quantize", plan.name):
        quantization = qstage.run(plan.name, fp32_file, staging / plan.name / "model.onnx", staging / "calibration")
        return {"quantization": quantization, "quality": quantization.pop("quality")}


def build_component(job: CompileJob, plan: ComponentPlan, saved: list[Path], inputs: list[dict[str, Any]],
                    staging: Path) -> tuple[dict[str, Any], list[Path]]:
    """The build stage: the engine of ``<name>/model.onnx``; its build facts and the component's files."""
    with stage("build", plan.name):
        files = sorted((staging / plan.name).glob("model.onnx*")) if plan.quantized else list(saved)
        build = _build_engine(plan, files, inputs, staging / plan.name, job.config)
        if "plan" in build:
            files.append(staging / plan.name / build["plan"])
    return build, files


# -- the manifest --------------------------------------------------------------------------------------------------


def seal(job: CompileJob, staging: Path, components: dict[str, Any], lora_records: list[dict[str, Any]],
         source_hash: str, t_start: float) -> None:
    """Write the sealed manifest.json over every file in ``staging`` (``manifest_sha256`` over the rest)."""
    with stage("manifest"):
        manifest = manifest_for(job, staging, components, lora_records, source_hash,
                                round(time.perf_counter() - t_start, 3))
        artifacts.write_manifest(staging, manifest)


def manifest_for(job: CompileJob, staging: Path, components: dict[str, Any], lora_records: list[dict[str, Any]],
                 source_hash: str, compile_seconds: float) -> dict[str, Any]:
    """The manifest of the artifact in ``staging`` (schema :data:`~diffusion_trt.artifact.folder.SCHEMA_VERSION`)."""
    config, facts = job.config, job.facts
    sched_cfg = json.loads((staging / "scheduler" / "scheduler_config.json").read_text())
    files = {
        p.relative_to(staging).as_posix(): artifacts.file_entry(staging, p.relative_to(staging).as_posix())
        for p in sorted(staging.rglob("*"))
        if p.is_file()
    }
    manifest = {
        "schema_version": artifacts.SCHEMA_VERSION,
        "name": job.out.name,
        "created_utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "pipeline_class": job.folder.pipeline_class,
        "source": {"path": str(job.folder.path.resolve()), "sha256": source_hash},
        "backend": config.backend.value,
        "device": config.device,
        "precision": config.precision,
        "profile": job.profile.to_json(),
        "model": facts,
        "scheduler": {"class_name": sched_cfg.get("_class_name"), "config": "scheduler/scheduler_config.json"},
        "tokenizer": "tokenizer",
        **({"tokenizer_2": "tokenizer_2"} if facts["architecture"] == "sdxl" else {}),
        "components": components,
        **({"loras": lora_records} if lora_records else {}),
        "files": files,
        "config": config.to_json(),
        "tools": tool_versions(),
        "compile_seconds": compile_seconds,
    }
    if not set(artifacts.REQUIRED_COMPONENTS) <= set(components):
        manifest["partial"] = True  # compile --components: inspect/verify read it, the runtime refuses it
    return manifest

"""``EnginePipeline``: text-to-image, image-to-image, inpainting and SDXL on a compiled artifact, called like
diffusers' pipelines (``StableDiffusionPipeline``, ``...Img2ImgPipeline``, ``...InpaintPipeline``, ``...XLPipeline``).

::

    from diffusion_trt.runtime import EnginePipeline, save_png

    with EnginePipeline.from_artifacts("artifacts/sd15", scheduler="euler_a") as pipe:
        out = pipe("an astronaut riding a horse", num_inference_steps=30, seed=42)
        save_png(out.images[0], "astronaut.png", out.parameters)

The pipeline owns its engines (opened in ``from_artifacts``, freed by ``close()``). A call is checked once into a
frozen :class:`~.request.Request` (every argument, before anything runs, with messages that name the value and the
fix) and run by the one loop, :func:`~.denoise.generate`; the mode plugs in through the request's
:class:`~.conditioning.Conditioning`. It imports neither ``compiler/`` nor ``passes/``: the artifact folder is all it
needs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from .. import trt_compat
from ..artifact import folder as artifacts
from ..artifact.folder import safe_join
from ..artifact.manifest import (
    CONTROLNET_PREFIX,
    EMBED_PREFIX,
    UNET_CONTROLNET,
    Backend,
    Manifest,
    ModelFacts,
    embedding_shape_problems,
)
from ..artifact.reader import ArtifactReader, ArtifactReplacedError
from ..artifact.values import check_scheduler_config, scheduler_config_problems
from ..errors import ArtifactError, LoraError, RuntimeInputError, names_arguments, names_parameters
from ..lora import LoadedLoras
from . import denoise
from .call_guard import CallGuard, one_call_at_a_time
from .controlnet import (
    DEFAULT_CONTROL_SCALE,
    ControlPlan,
    check_control_components,
    check_lora_reaches_unet_controlnet,
    check_no_control_options,
    control_components,
    control_plan,
)
from .cuda import HostBuffers
from .determinism import compile_time_note, deterministic_torch
from .embeddings import EmbeddingTable, load_embeddings
from .engines.buckets import SizeBuckets, bucket_engines, parse_size_buckets
from .engines.engine import Engine
from .generation_args import GENERATION_ARGS
from .geometry import LatentGeometry
from .image_inputs import ImageRequest
from .latents import Generator, StepCallback, StepEnd
from .loading import (
    CALLER_FIRST_RUN,
    EAGER_COMPONENTS,
    PREIMPORT,
    READ_AHEAD,
    WARM_LOOP,
    OpenTogether,
    start_imports,
    start_reads,
    wants_graph,
)
from .lora_slots import apply_loras, distinct, load_slots, lora_list
from .memory.residency import Residency
from .memory.stages import Stages
from .png import save_png
from .request import (
    OUTPUT_TYPES,
    SDXL_ARGUMENTS,
    Request,
    RequestSpec,
    check_diffusers_only,
    check_generator,
    check_text,
    manifest_profile,
)
from .schedulers import (
    SCHEDULERS,
    build_scheduler,
    make_scheduler,
    name_of,
    scheduler_for,
    short_name,
    start_scheduler_import,
)
from .sdxl import SDXL_COMPONENTS
from .text_embeddings import EmbeddingCache
from .tokenizer import load_tokenizer

__all__ = ["OUTPUT_TYPES", "SDXL_ARGUMENTS", "EnginePipeline", "EnginePipelineOutput", "LoadOptions", "check_text",
           "save_png"]

if TYPE_CHECKING:
    from .engines.ort_engine import PrivateRead

logger = logging.getLogger(__name__)

#: Components the text-to-image loop opens (the VAE encoder is for image-to-image, not loaded here).
TXT2IMG_COMPONENTS: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder")
#: Components opened on first use only: the VAE encoder, by the first image-to-image / inpainting call.
LAZY_COMPONENTS: tuple[str, ...] = ("vae_encoder",)


#: Components whose convolutions run faster in NHWC on CUDA (ORT's ``prefer_nhwc`` lets its layout transformer
#: put Conv and the NHWC GroupNorm kernel in one layout); the text encoder (no Conv) gets slower, so it is left
#: out. Figures: benchmarks/results/README.md, "Figures behind code defaults". The ControlNet engines
#: (``controlnet_<name>``, :func:`runs_nhwc`) and the residual-input UNet are the same layers: until 2026-12-02 they
#: were left NCHW, and on the H200 ``unet_controlnet`` took ~10.5 ms a step against the plain UNet's 6.9 ms, the
#: NCHW UNet's 10.2 ms (``h200-2026-12-02-s9-controlnet-step.json``, ``-ort-offline-nchw.json``). A ControlNet's
#: conditioning embedding (``cond_embed_<name>``, a conv stack over the control image) ran NHWC inside its
#: ``controlnet_<name>`` until it became a component of its own, and keeps that layout (not measured apart).
NHWC_COMPONENTS: frozenset[str] = frozenset({"unet", UNET_CONTROLNET, "vae_decoder", "vae_encoder"})


def runs_nhwc(component: str) -> bool:
    """Whether ``component`` gets ``prefer_nhwc`` on CUDA: :data:`NHWC_COMPONENTS` and every ControlNet engine
    (``controlnet_<name>``, ``cond_embed_<name>``)."""
    return component in NHWC_COMPONENTS or component.startswith((CONTROLNET_PREFIX, EMBED_PREFIX))


#: ORT's attention backend for every CUDA engine: ``sdpa_kernel`` bit 8 = cuDNN flash attention (ORT's
#: AttentionBackend enum, contrib_ops/cpu/bert/attention_common.h). Why: ORT 1.31.1's default pick for the VAE's
#: one-head 512-wide attention, the CUTLASS memory-efficient kernel, fails with "cudaErrorInvalidValue" on the
#: second GPU a process uses (a launch attribute set once per process), which broke data-parallel runs; cuDNN's
#: kernel runs on every device and is as fast or faster. Where cuDNN has no kernel for a shape, ORT falls back to
#: its unfused path. Figures: benchmarks/results/README.md, "Figures behind code defaults".
CUDA_ATTENTION_OPTIONS: dict[str, str] = {"sdpa_kernel": "8"}


#: ``fuse_conv_bias`` (cuDNN's runtime-fused Conv + bias epilogue) is left off for every component: cuDNN compiles
#: those kernels at the first run of each shape. On the H200 (2026-12-03, SD-1.5 fp16, HEURISTIC) the VAE decoder's
#: first run took 1.64-2.03 s with it and 0.15-0.65 s without, at every latent size, and a dynamic artifact's new
#: size cost 5.2 s with it and 1.6-1.8 s without (bench --sizes); without it a warm decode takes 0.6-2 ms more
#: (9.39 -> 10.00 ms at 512x512). Figures: benchmarks/results/README.md, "Figures behind code defaults".


def cuda_layout_options(component: str, device: str, spatial_conv_inputs: bool = False) -> dict[str, str]:
    """Default CUDA provider options of one component (overridden by the caller's ``provider_options``):
    :data:`CUDA_ATTENTION_OPTIONS` for every component, ``prefer_nhwc=1`` where :func:`runs_nhwc` unless the
    engine binds spatial Conv weights as inputs (``spatial_conv_inputs``: the manifest's
    :attr:`~diffusion_trt.artifact.manifest.Component.spatial_conv_inputs`, an ORT ``--refittable --refit-convs``
    artifact); nothing on the CPU. No ``fuse_conv_bias`` (why: the comment above this function). A default
    ``--refittable`` artifact (Linear and 1x1-as-MatMul weight inputs only) keeps NHWC.

    Why no NHWC with spatial Conv weight inputs: ORT's layout transformer transposes a Conv's weight only when it is
    a constant. On the H200 (onnxruntime-gpu 1.31.1, 2026-12-02) the refittable SD-1.5 UNet's first run failed with
    "Input channels C is not equal to kernel channels * group. C: 320 kernel channels: 3" at the first 3x3 Conv (and
    "kernel channels: 1" at a 1x1 one, which compile now writes as a MatMul): the NHWC kernel read the bound
    [O, C, kH, kW] weight as [O, kH, kW, C], at every graph optimisation level."""
    if device != "cuda":
        return {}
    options = dict(CUDA_ATTENTION_OPTIONS)
    if runs_nhwc(component) and not spatial_conv_inputs:
        options["prefer_nhwc"] = "1"
    return options


_NO_REFIT_MAP = ("this TensorRT artifact was built without --refittable (its engines cannot be refitted); recompile "
                 "with `diffusion-trt compile MODEL --backend tensorrt --refittable`, or merge the LoRA with --lora")


def check_refit_target(manifest: Manifest, lora: Any, count: int = 1) -> None:
    """Refuse what :meth:`EnginePipeline.load_lora` refuses from the manifest alone on an artifact without LoRA weight
    inputs (an ORT ``--refittable`` one has them, and takes LoRAs through them): ``lora`` (a checked
    :class:`~diffusion_trt.lora.LoraFile`) merged into it at compile time already, a backend that cannot refit,
    ``count`` LoRAs at once on TensorRT, engines built without ``--refittable``. The CLI runs it before the load.

    Raises:
        LoraError: naming the LoRA and the fix.
    """
    for rec in manifest.loras:
        if rec.sha256 == lora.sha256:
            raise LoraError(
                f"LoRA {lora.path.name} is merged into this artifact already (compile --lora, scale "
                f"{rec.scale}); loading it again would apply it twice. Use an artifact compiled without it"
            )
    backend = manifest.backend
    if backend is not Backend.TENSORRT:
        raise LoraError(
            f"LoRA {lora.path.name}: this {backend!r} artifact was compiled without --refittable (its weights are "
            f"constants of the ONNX Runtime sessions); recompile with `diffusion-trt compile MODEL --refittable`, "
            f"or merge the LoRA at compile time with `diffusion-trt compile MODEL --lora "
            f"{lora.path.name}:{lora.scale:g}`"
        )
    if count > 1:
        raise LoraError("several LoRAs at once: ONNX Runtime --refittable artifacts only; TensorRT refit takes one")
    if not any(c.refit_map for c in manifest.components.values()):
        raise LoraError(_NO_REFIT_MAP)


@dataclass
class EnginePipelineOutput:
    """What :meth:`EnginePipeline.__call__` returns.

    Attributes:
        images: "pil": list of B RGB ``PIL.Image``; "np": float32 array [B, H, W, 3] in [0, 1];
            "pt": float tensor [B, 3, H, W] in [0, 1] on the engine device; "latent": the final latents
            [B, 4, H/8, W/8]. B = prompts x ``num_images_per_prompt``, prompt-major.
        seed: the seed of the CPU generator the latents came from; ``None`` when a generator was passed.
        parameters: the generation parameters (JSON-serialisable), for :func:`save_png`.
        nsfw_content_detected: diffusers' ``StableDiffusionPipelineOutput`` field: always ``None``, as diffusers gives
            for a pipeline without a safety checker (an artifact compiles none; there is nothing to detect with).
    """

    images: Any
    seed: int | None
    parameters: dict[str, Any] = field(default_factory=dict)
    nsfw_content_detected: list[bool] | None = None

    def to_tuple(self, architecture: str = "sd") -> tuple[Any, ...]:
        """What diffusers returns with ``return_dict=False``: ``(images, nsfw_content_detected)`` for SD 1.x/2.x
        (``StableDiffusionPipeline``), ``(images,)`` for SDXL (``StableDiffusionXLPipeline``)."""
        return (self.images,) if architecture == "sdxl" else (self.images, self.nsfw_content_detected)


class EnginePipeline:
    """Stable Diffusion (1.x, 2.x, SDXL) on compiled engines: text-to-image, image-to-image and inpainting, called
    like diffusers' pipelines (see :meth:`__call__`).

    Build it with :meth:`from_artifacts`; the constructor is for engines you made yourself.

    Threads: one call at a time. Like diffusers' pipelines, a pipeline is not thread-safe (its engines reuse their
    buffers, the VAE encoder opens on the first image call); a call (or ``load_lora``, ``unload_lora``,
    ``set_scheduler``, ``engine``, ``close``) made while another one runs, from another thread or from the running
    call's ``callback``,
    is refused at once with :class:`~diffusion_trt.errors.PipelineBusyError` (a ``RuntimeError``) and runs
    nothing; the running call is not disturbed. To call from several threads, put one ``threading.Lock`` around the
    calls (they then run one after the other), or load one pipeline per thread (see :mod:`~.call_guard`).

    Args:
        manifest: the artifact's manifest, typed (:class:`~diffusion_trt.artifact.manifest.Manifest`; its JSON is
            parsed into one).
        engines: at least ``text_encoder``, ``unet``, ``vae_decoder``; the pipeline enters them now (allocating)
            and exits them on :meth:`close`. A ``vae_encoder`` (image-to-image, inpainting) is entered on first use.
        tokenizer: a ``CLIPTokenizer``.
        scheduler_config: the contents of the artifact's ``scheduler_config.json``.
        scheduler: short scheduler name (see :data:`~diffusion_trt.runtime.schedulers.SCHEDULERS`); ``None``
            = the model's own.
        stream: CUDA: the stream the engines were built with; each call runs on it.
        root: the artifact folder, for messages.
        tokenizer_2: SDXL artifacts (``model.architecture == "sdxl"``): the second ``CLIPTokenizer``.
        residency: a VRAM budget's stage context (:class:`~diffusion_trt.runtime.memory.residency.Residency`, made
            by ``from_artifacts(vram_budget=...)``): the pipeline then enters it instead of the text-to-image engines
            (it opens the resident ones now, the others per stage); ``None`` = every engine open now.

    Attributes:
        residency: with a VRAM budget, the plan in force and the engines it opens per stage; ``None`` = all resident.
        stages: the stage context the loop enters (:mod:`~diffusion_trt.runtime.memory.stages`): ``residency``, or
            one that opens nothing (all resident); a :class:`~diffusion_trt.runtime.memory.memory_meter.
            StageMemoryMeter` watches it.
        request_spec: what a call may ask (profile, :class:`~.geometry.LatentGeometry`, architecture).

    Raises:
        ArtifactError: a required engine (SDXL: also ``text_encoder_2``) or ``tokenizer_2`` is missing, or a
            tokenizer disagrees with the manifest.
            Also: a scheduler config whose values are of the wrong type or out of range
            (:func:`~diffusion_trt.artifact.values.scheduler_config_problems`).
        RuntimeInputError: unknown scheduler name.
    """

    residency: Residency | None = None

    def __init__(
        self,
        manifest: Manifest | Mapping[str, Any],
        engines: Mapping[str, Engine],
        tokenizer: Any,
        scheduler_config: Mapping[str, Any],
        *,
        scheduler: str | None = None,
        stream: torch.cuda.Stream | None = None,
        root: str | os.PathLike[str] | None = None,
        tokenizer_2: Any = None,
        residency: Residency | None = None,
    ) -> None:
        self._closed = True  # until the engines are open
        self._call_guard = CallGuard()  # one call at a time (see "Threads" above)
        self.root = Path(root) if root is not None else None
        manifest = manifest if isinstance(manifest, Manifest) else Manifest.from_json(manifest)
        required = txt2img_components(manifest)
        missing = [c for c in required if c not in engines]
        if missing:
            raise ArtifactError(f"EnginePipeline needs the engine(s) {', '.join(missing)}; recompile with them")
        self.manifest = manifest
        self.profile = manifest_profile(self.manifest)
        model = self.manifest.model
        #: "sd" (SD 1.x/2.x) or "sdxl": which loop runs (manifest ``model.architecture``)
        self.architecture = model.architecture
        self.tokenizer, self.tokenizer_2 = tokenizer, tokenizer_2
        _check_tokenizers(model, self.architecture, tokenizer, tokenizer_2)
        self._default_scheduler_class = _scheduler_class_name(self.manifest, scheduler_config)
        # before diffusers allocates anything: values typed, bounded and accepted by the class that is built
        self._scheduler_config = check_scheduler_config(scheduler_config, class_name=self._default_scheduler_class)
        self._scheduler_template: Any = None
        self._scheduler_name = ""
        self.set_scheduler(scheduler)
        self._stream = stream
        self._stack = contextlib.ExitStack()
        self.engines: dict[str, Engine] = {}
        self.residency = residency
        self.stages: Stages = residency if residency is not None else Stages()
        try:
            if residency is None:
                for name in required:
                    self.engines[name] = self._stack.enter_context(engines[name])
            else:  # the resident engines open now, the others when the loop enters their stage
                self.engines = {name: engines[name] for name in required}
                self._stack.enter_context(residency.bind(self.engines))
            unet = self.engines["unet"]
            channels = unet.spec.input("sample").shape[1]  # read only when the manifest lacks unet_in_channels
            self.geometry = LatentGeometry.from_manifest(self.manifest, channels)  # type: ignore[arg-type]
        except BaseException:
            self._stack.close()
            raise
        #: engines entered on first use (see LAZY_COMPONENTS)
        self._lazy: dict[str, Engine] = {n: engines[n] for n in (*LAZY_COMPONENTS, *control_components(list(engines)))
                                         if n in engines}
        self.device: torch.device = unet.device
        #: SDXL: negative_prompt=None gives zero negative embeddings (model_index.json force_zeros_for_empty_prompt)
        self.request_spec = RequestSpec.from_manifest(self.manifest, channels)
        #: negative-prompt embeddings, per (text, engine): most requests share "" (see text_embeddings.EmbeddingCache)
        self.embedding_cache = EmbeddingCache(maxsize=8)
        #: the textual-inversion embeddings :meth:`load_textual_inversion` loaded; ``None`` = none
        self.embeddings: EmbeddingTable | None = None
        #: SDXL: the same embeddings' ``clip_g`` vectors, for ``text_encoder_2`` (``embeddings`` holds ``clip_l``)
        self.embeddings_2: EmbeddingTable | None = None
        #: the LoRA :meth:`load_lora` refitted (``{"file", "sha256", "scale"}``), ``None`` = the compiled weights
        self.lora: dict[str, Any] | None = None
        self._lora_weights: dict[str, dict[str, Any]] = {}  # what the last refit changed, per component
        #: what the LoRA(s) loaded now change, per component: one value whichever backend loaded them (``lora``,
        #: the public record, differs); ``None`` = none loaded
        self._loaded_loras: LoadedLoras | None = None
        #: ORT --refittable: the weight inputs of the UNet / text encoder(s) (runtime/lora_slots.py); {} otherwise
        self._weight_slots: Mapping[str, Any] = {}
        #: TensorRT: the model folder and trust_pickle of the last load_lora (unload_lora refits the base from there)
        self._trt_source: tuple[Path, bool] | None = None
        # "pil"/"np" results land in pinned host buffers kept across calls, copied on a side stream
        self._host_buffers = HostBuffers(pin=self.device.type == "cuda" and torch.cuda.is_available())
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._host_buffers.pin else None
        #: torch's deterministic algorithms around each call (see runtime/determinism.py); from_artifacts sets it
        self.deterministic = False
        self._closed = False

    # -- what a request may ask (read from the manifest once; see request_spec) -------------------------

    @property
    def default_height(self) -> int:
        """The height of a call without one: the profile's opt size, the one the engines were tuned for (the model's
        default size unless compile was given --height/--width or a static profile)."""
        return self.request_spec.default_size[0]

    @property
    def default_width(self) -> int:
        return self.request_spec.default_size[1]

    @property
    def vae_scale_factor(self) -> int:
        return self.geometry.scale_factor

    @property
    def vae_scaling_factor(self) -> float:
        return self.geometry.scaling_factor

    @property
    def unet_in_channels(self) -> int:
        """Channels of the UNet's ``sample`` input: 4, or 9 for an inpainting UNet (latents + mask + masked image)."""
        return self.geometry.unet_in_channels

    @property
    def num_channels_latents(self) -> int:
        """Channels of the latents the scheduler denoises (the VAE's latent channels)."""
        return self.geometry.channels

    @property
    def force_zeros_for_empty_prompt(self) -> bool:
        return self.request_spec.force_zeros_for_empty_prompt

    # -- construction -----------------------------------------------------------------------------------

    @classmethod
    def from_artifacts(
        cls,
        path: str | os.PathLike[str],
        device: str | None = None,
        scheduler: str | None = None,
        verify: bool = True,
        *,
        expect_sha256: str | None = None,
        **options: Any,
    ) -> EnginePipeline:
        """Load a compiled artifact folder and open its engines.

        Every file is read once through one descriptor of the folder (:class:`~diffusion_trt.artifact.reader.
        ArtifactReader`) and the loaders get the bytes that were hashed, so a file swapped meanwhile is never run
        and a folder exchanged meanwhile (``compile --overwrite``) is never mixed with the old one; when the old
        folder is deleted in the middle, the load starts again once, on the new one.

        Args:
            path: the artifact folder (with ``manifest.json``).
            device: "cpu" or "cuda"; ``None`` = the device the artifact was compiled for.
            scheduler: short scheduler name ("euler_a", "dpm++"...); ``None`` = the model's own.
            verify: check the sha256 of every file loaded against the manifest (on the bytes read; seconds for a
                full SD model); ``False`` skips the hashes only: the manifest's schema and seal, the scheduler config's
                values, file sizes, and that no path, ONNX external-data reference or link leads outside the folder
                are always checked.
            expect_sha256: the manifest digest (``manifest_sha256``, see ``diffusion-trt inspect --json``) a
                service trusts: any other artifact is refused, even one correctly resealed after an edit (the seal
                is an unkeyed sha256: it catches accidents, not intent).
            options: the engine and memory options of :class:`LoadOptions` (``device_id``, ``cuda_graph``,
                ``vram_budget``, ``size_buckets``, ``deterministic``...), by name.

        Raises:
            ArtifactError: missing/altered files, a manifest other than ``expect_sha256``, unsafe scheduler config
                values, an unsupported backend, a GPU the artifact's TensorRT library does not support
                (TensorRT-RTX on compute capability 9.0: before any plan is read), an fp16 artifact on CPU, the CUDA
                provider unavailable, or engines inconsistent with the manifest.
            RuntimeInputError: a malformed ``expect_sha256``; unknown ``scheduler``, ``device`` or
                ``cudnn_conv_algo_search``; an argument of the wrong type or range, named with what it takes
                (``path`` no str / ``os.PathLike``; ``verify``, ``deterministic``, ``io_binding``, ``cuda_graph`` no
                bool; ``device_id`` no integer >= 0 or not a CUDA device of this machine; ``intra_op_num_threads``;
                ``provider_options`` no mapping of names to str/int/float/bool; ``runtime_cache_dir``,
                ``memory_facts`` no path; ``vram_request`` not (height, width, batch)); a ``size_buckets`` that is
                no list of sizes; ``runtime_cache_dir`` inside the artifact; a
                malformed ``vram_budget`` or one no plan meets at ``vram_request`` (the message names the smallest
                budget that works).
            TypeError: an unknown option.
        """
        with names_arguments("path", "verify", "expect_sha256", *(f.name for f in dataclasses.fields(LoadOptions))):
            return cls._load(path, device, scheduler, verify, expect_sha256, options)

    @classmethod
    def _load(cls, path: str | os.PathLike[str], device: str | None, scheduler: str | None, verify: bool,
              expect_sha256: str | None, options: dict[str, Any]) -> EnginePipeline:
        """:meth:`from_artifacts`, its arguments named in the errors it raises."""
        root = _artifact_path(path)
        _check_flag("verify", verify, "False skips the sha256 of each file only")
        opts = LoadOptions(device=device, scheduler=scheduler, **options)
        if expect_sha256 is not None and (problem := artifacts.sha256_hex_problem(str(expect_sha256))) is not None:
            raise RuntimeInputError(f"expect_sha256={problem}")  # a malformed pin is the caller's, not the artifact's
        for attempt in (1, 2):
            # schema, seal, pin, paths, sizes, external data and links (never read outside the folder); the
            # hashes are checked on the bytes each loader gets
            reader: ArtifactReader | None = None
            try:
                reader = ArtifactReader.open(root, check_hashes=verify, expect_sha256=expect_sha256)
                pipe = cls._from_reader(reader, opts)
            except ArtifactReplacedError:  # deleted or exchanged meanwhile (compile --overwrite): once more, anew
                if reader is not None:
                    reader.close()
                if attempt == 2:
                    raise
                logger.warning("artifact %s was replaced while it loaded; loading the new one", root)
                continue
            except BaseException:
                if reader is not None:
                    reader.close()
                raise
            pipe._stack.callback(reader.close)  # lazily opened engines read through it
            return pipe
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def _from_reader(cls, reader: ArtifactReader, options: LoadOptions) -> EnginePipeline:
        """:meth:`from_artifacts` on an open reader: every file comes through it (one folder, hashed bytes); the
        text-to-image engines of an ONNX Runtime artifact open side by side while the tokenizers and the scheduler
        config are read (:class:`~.loading.OpenTogether`)."""
        started = time.perf_counter()
        root, manifest = reader.root, reader.manifest
        device = _check_device(root, manifest, options.device)
        if device == "cuda" and not manifest.backend.is_tensorrt:  # while CUDA starts (loading.PREIMPORT)
            start_imports(PREIMPORT)
        reads = _read_ahead(reader, options)  # the engines' bytes from here on, while the rest is checked
        try:
            return cls._open_read(reader, options, device, reads, started)
        except BaseException:
            from .engines.ort_engine import discard_read

            # what no engine took, or every one after a failure: their folders go, and the reads end before the
            # caller closes the reader they read through
            concurrent.futures.wait(reads.values())
            for read in reads.values():
                discard_read(read)
            raise

    @classmethod
    def _open_read(cls, reader: ArtifactReader, options: LoadOptions, device: str,
                   reads: Mapping[str, Future[PrivateRead]], started: float) -> EnginePipeline:
        """:meth:`_from_reader` once the device is known and the engines' reads have started (``reads``, handed to
        their engines); ``started``: when the load began (``time.perf_counter()``), for the load timeline."""
        root, manifest = reader.root, reader.manifest
        _check_device_id(device, options.device_id)
        residency = None
        if options.vram_budget is not None:  # refused here, before anything opens
            from .memory.residency import plan_for_request

            residency = plan_for_request(options.vram_budget, manifest, root, txt2img_components(manifest),
                                         options.vram_request, options.memory_facts)
        scheduler_config = reader.json(manifest.scheduler_config)
        class_name = _scheduler_class_name(manifest, scheduler_config)  # refused here, before any engine opens
        scheduler_for(check_scheduler_config(scheduler_config, class_name=class_name), options.scheduler, class_name)
        # diffusers' import (seconds) on a thread of its own from here on, so that it overlaps the whole load and this
        # thread captures the engines' CUDA graphs as they come (ONNX Runtime keeps them per thread: the caller's
        # first call then replays)
        named = options.scheduler if isinstance(options.scheduler, str) else None
        importing = start_scheduler_import(scheduler_config, named, class_name)
        stream: torch.cuda.Stream | None = None
        if device == "cuda" and torch.cuda.is_available():
            # one stream shared by ONNX Runtime and torch: the loop runs without host syncs
            stream = torch.cuda.Stream(device=torch.device("cuda", options.device_id))
        slots = load_slots(reader, device, options.device_id)  # ORT --refittable: LoRA per request
        engines = _open_engines(reader, device, options, stream, residency, slots, reads)
        together = {n: engines[n] for n in txt2img_components(manifest)} if _opens_together(manifest, residency) else {}
        capture = device == "cuda"  # the static engines' CUDA graphs, on this thread (the one that will replay)
        # the engines eager by default run once on this thread at load, as the graphed ones capture here
        caller_warm = EAGER_COMPONENTS if capture and options.cuda_graph is None else ()
        with OpenTogether(together, warm=capture, caller_first_run=CALLER_FIRST_RUN if capture else (),
                          caller_warm=caller_warm) as opening:
            # the engines load while the rest is read
            tokenizer = load_tokenizer(reader, manifest.tokenizer, "tokenizer")
            tokenizer_2 = None
            if manifest.model.is_sdxl:
                tokenizer_2 = load_tokenizer(reader, manifest.tokenizer_2, "SDXL tokenizer_2")
            if capture and WARM_LOOP and stream is not None:
                _warm_loop(engines, manifest, stream, opening)
            opening.wait(capture=capture)
            importing.join()
            opening.add_marks("scheduler_import", from_s=importing.started_at, to_s=importing.ended_at)
            pipe = cls(manifest, engines, tokenizer, scheduler_config, scheduler=options.scheduler, stream=stream,
                       root=root, tokenizer_2=tokenizer_2, residency=residency)
            # what the load did before the engines started (negative) and after they were ready
            opening.add_marks("caller", load_from_s=started, pipeline_s=time.perf_counter())
        pipe._weight_slots = slots
        pipe.deterministic = bool(options.deterministic)
        logger.info("loaded %s (%s, %s, %s; profile %s; scheduler %s)", root, manifest.backend,
                    manifest.precision, device, manifest.profile_json, pipe.scheduler_name)
        return pipe

    # -- diffusers' pipeline settings -------------------------------------------------------------------

    #: set by :meth:`set_progress_bar_config`
    _progress_disabled: bool = False

    def set_progress_bar_config(self, **kwargs: Any) -> None:
        """diffusers' ``set_progress_bar_config``: ``disable=True`` hides the bar of the calls that do not pass
        ``progress=`` (``False`` shows it again).

        Raises:
            RuntimeInputError: other tqdm options (the bar's look is fixed here), or ``disable`` not a bool.
        """
        other = sorted(set(kwargs) - {"disable"})
        if other:
            raise RuntimeInputError(f"set_progress_bar_config takes disable= only (got {', '.join(other)}); pass "
                                    "disable=True to hide the bar, or progress=False to a call")
        disable = kwargs.get("disable", False)
        _check_flag("disable", disable, "True hides the bar")
        self._progress_disabled = disable

    # -- scheduler --------------------------------------------------------------------------------------

    @one_call_at_a_time("set_scheduler()")
    def set_scheduler(self, name: str | None) -> None:
        """Use scheduler ``name`` (a short name) from now on; ``None`` = the model's own.

        Raises:
            RuntimeInputError: unknown name (the message lists the valid ones) or a missing optional package.
        """
        template = make_scheduler(self._scheduler_config, name, self._default_scheduler_class)
        self._scheduler_template = template
        self._scheduler_name = name.strip().lower() if name is not None else short_name(type(template).__name__)

    @property
    def scheduler_name(self) -> str:
        return self._scheduler_name

    @property
    def scheduler(self) -> Any:
        """A fresh scheduler instance (schedulers are stateful: each call gets its own). Assignable as in diffusers:
        ``pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)``
        (a copy of its class and config is used from then on; :meth:`use_scheduler`)."""
        t = self._scheduler_template
        return build_scheduler(type(t), t.config)

    @scheduler.setter
    def scheduler(self, scheduler: Any) -> None:
        self.use_scheduler(scheduler)

    @one_call_at_a_time("use_scheduler()")
    def use_scheduler(self, scheduler: Any) -> None:
        """diffusers' scheduler swap (``pipe.scheduler = X.from_config(pipe.scheduler.config, ...)``): from now on each
        call runs a fresh scheduler of ``scheduler``'s class and config (its options too: karras sigmas,
        ``timestep_spacing``...). :attr:`scheduler_name` becomes the short name of that class and options, if any.

        Raises:
            RuntimeInputError: not a scheduler of a class the runtime runs (the classes ``scheduler=`` names map to),
                or a config value that class does not accept (naming it).
        """
        cls_name = type(scheduler).__name__
        config = getattr(scheduler, "config", None)
        problems = ([f"{type(scheduler).__name__} is not a diffusers scheduler"] if not isinstance(config, Mapping)
                    else scheduler_config_problems(dict(config), "scheduler.config", cls_name))
        if problems:
            raise RuntimeInputError(f"scheduler={cls_name} cannot run here: {'; '.join(problems)}; assign one of "
                                    f"those classes, or call set_scheduler(NAME) with one of {', '.join(SCHEDULERS)}")
        self._scheduler_template = build_scheduler(type(scheduler), config)
        self._scheduler_name = name_of(cls_name, config)

    # -- LoRA -------------------------------------------------------------------------------------------

    @one_call_at_a_time("load_lora()")
    def load_lora(
        self, path: str | os.PathLike[str] | Sequence[Any], scale: float = 1.0, *,
        model_dir: str | os.PathLike[str] | None = None, trust_pickle: bool = False,
    ) -> dict[str, Any]:
        """Use the compiled (base) weights plus ``scale`` x this LoRA (or several) from now on, without a recompile:
        artifacts compiled with ``--refittable``. Every call starts from the base weights, never from the previous
        LoRA; ``scale=0`` gives the base output; :meth:`unload_lora` goes back to the base.

        ONNX Runtime ``--refittable`` artifacts (:mod:`~diffusion_trt.runtime.lora_slots`): ``path`` may be a list
        of paths, ``"FILE:SCALE"`` strings or ``(path, scale)`` pairs, applied together (``W + sum(scale_i *
        delta_i)``); the base weights come from the artifact (``model_dir`` is not read); the deltas are computed
        on the engines' device and the weight inputs updated in place. Everything is checked before any weight
        changes: a refused LoRA leaves the pipeline as it was. With ``--controlnet``, ``unet_controlnet`` (the UNet
        of control-image calls) binds the plain ``unet``'s weight inputs, so the LoRA reaches those calls too
        (artifacts compiled before that refuse a control-image call while a LoRA changes the UNet). Returns
        ``{"loras": [{"file", "sha256", "scale"}], "changed": {component: weights that now differ from the base}}``
        (0 everywhere when every scale is 0).

        TensorRT ``--refittable`` artifacts: one LoRA, refitted as follows (``unet`` and the text encoder(s);
        ``unet_controlnet`` keeps its weights, so a control-image call is refused while the LoRA changes the UNet).

        How (see :mod:`diffusion_trt.runtime.refit`): the base weights of the UNet and text encoder(s) are read from
        ``model_dir``'s safetensors (checked weight by weight against the artifact's refit maps; no model class is
        loaded), the LoRA's keys are converted with diffusers' own functions and merged as ``compile --lora``'s
        ``load_lora_weights`` + ``fuse_lora(lora_scale=scale)`` merges it (``W + scale * alpha / r * B @ A``), and
        the ONNX initializers whose value changed (and those the previous LoRA changed) are refitted with
        ``tensorrt.Refitter``. Takes seconds (weights read + refit); the CUDA graphs are re-captured on the next call.

        ONNX Runtime artifacts compiled without ``--refittable`` are refused (their weights are constants of the
        session): recompile with ``--refittable``, or merge the LoRA with ``diffusion-trt compile MODEL --lora
        FILE:SCALE``.

        Args:
            path: a ``.safetensors`` LoRA (the LoRA formats diffusers' ``load_lora_weights`` reads; DoRA, LoKr and
                LoRA biases are merged at compile time only).
            scale: its weight, a finite number.
            model_dir: the diffusers folder the artifact was compiled from; default the manifest's ``source.path``.
            trust_pickle: allow its weights as pickle files (``.bin``; unpickling runs arbitrary code), as
                ``compile --trust-pickle``; by default only safetensors are read.

        Returns:
            ``{"file", "sha256", "scale", "refitted": {component: initializers refitted}}``, also kept in :attr:`lora`.

        Raises:
            LoraError: a missing / non-safetensors file or a bad scale; the file merged into the artifact at compile
                time already (applying it again would double it); an artifact built without ``--refittable``;
                several LoRAs on TensorRT; TensorRT: a model folder that is missing or not the artifact's source, a
                LoRA changing weights the engines cannot refit, pickle weights in the model folder without
                ``trust_pickle``; ORT: see :func:`~.lora_slots.apply_loras`.
            PipelineBusyError: a call of this pipeline is running (see "Threads" in the class docstring).
        """
        from ..lora import check_lora_file

        if self._closed:
            raise RuntimeError("EnginePipeline is closed; load it again with EnginePipeline.from_artifacts")
        if self._weight_slots:
            return self._load_lora_inputs(path, scale)
        specs = lora_list(path, scale)
        lora = check_lora_file(*specs[0])
        check_refit_target(self.manifest, lora, len(specs))
        if not any(e.refit_map and c in self.engines for c, e in self.manifest.components.items()):
            raise LoraError(_NO_REFIT_MAP)
        source = model_dir if model_dir is not None else self.manifest.source_path
        if not source:
            raise LoraError("the manifest names no source model folder; pass model_dir= the diffusers folder")
        weights = self._refit_engines(lora, Path(source), trust_pickle)
        self._trt_source = (Path(source), trust_pickle)
        self.lora = {**lora.record({}), "refitted": {c: len(v) for c, v in weights.items()}}
        self.lora.pop("layers")
        self._loaded_loras = LoadedLoras.of([lora], self.lora["refitted"])
        logger.info("LoRA %s (scale %g): refitted %s", lora.path.name, lora.scale, self.lora["refitted"])
        return dict(self.lora)

    def _refit_engines(self, lora: Any, source: Path, trust_pickle: bool) -> dict[str, dict[str, Any]]:
        """TensorRT: refit the engines with refit maps to the base weights of ``source`` plus ``lora`` (a checked
        :class:`~diffusion_trt.lora.LoraFile`; ``None``: the base alone), and those the last refit changed; returns
        the initializers refitted per component (:func:`~.refit.refit_weights`, whose errors it raises)."""
        from .refit import onnx_initializers, refit_weights

        comps = {c: e for c, e in self.manifest.components.items() if e.refit_map and c in self.engines}
        root = self.root or Path(".")
        maps = {c: json.loads(safe_join(root, str(e.refit_map)).read_text(encoding="utf-8"))
                for c, e in comps.items()}
        weights = refit_weights(maps, source, lora, self._lora_weights, trust_pickle=trust_pickle)
        for comp, values in weights.items():
            if values:
                onnx_path = safe_join(root, str(comps[comp].onnx))
                self.engines[comp].refit(  # type: ignore[attr-defined]
                    values, fill_missing=lambda names, p=onnx_path: onnx_initializers(p, names)
                )
        self.embedding_cache.clear()  # the text encoder may have changed
        self._lora_weights = weights
        return weights

    def _load_lora_inputs(self, path: Any, scale: Any) -> dict[str, Any]:
        """:meth:`load_lora` on an ONNX Runtime ``--refittable`` artifact (see :mod:`~.lora_slots`)."""
        from ..lora import LoraFile, check_lora_file

        files = [check_lora_file(p, s, background=True) for p, s in lora_list(path, scale)]
        merged = {rec.sha256: rec for rec in self.manifest.loras}

        def not_merged(loras: Sequence[LoraFile]) -> None:
            for lora in loras:
                if lora.sha256 in merged:
                    raise LoraError(
                        f"LoRA {lora.path.name} is merged into this artifact already (compile --lora, scale "
                        f"{merged[lora.sha256].scale}); loading it again would apply it twice"
                    )

        changed = apply_loras(self._weight_slots, files, not_merged, sdxl=self.manifest.model.is_sdxl)
        self.embedding_cache.clear()  # the text encoder may have changed
        records = [{"file": f.path.name, "sha256": f.sha256, "scale": f.scale} for f in files]
        self._loaded_loras = LoadedLoras.of(files, changed)  # every scale 0: nothing differs from the base
        self.lora = {"loras": records, "changed": dict(self._loaded_loras.changed)}
        logger.info("LoRA %s: %s", " + ".join(f"{f.path.name}:{f.scale:g}" for f in files), self.lora["changed"])
        return dict(self.lora)

    @one_call_at_a_time("unload_lora()")
    def unload_lora(self) -> None:
        """Back to the compiled (base) weights (a no-op when no LoRA is loaded): ONNX Runtime ``--refittable``
        artifacts bind the base tensors again (bit for bit); TensorRT ones refit the base weights of the model folder
        (and ``trust_pickle``) the last :meth:`load_lora` read, without reading its LoRA file again.

        Raises:
            LoraError: as :meth:`load_lora` (TensorRT: the model folder it reads the base weights from).
            PipelineBusyError: a call of this pipeline is running (see "Threads" in the class docstring).
        """
        if not self._weight_slots:
            if self.lora is not None and self._trt_source is not None:
                self._refit_engines(None, *self._trt_source)
                self.lora = self._loaded_loras = None
            return
        for slots in distinct(self._weight_slots):  # unet and unet_controlnet may share theirs
            slots.bind({})
        self.embedding_cache.clear()
        self.lora = self._loaded_loras = None

    @one_call_at_a_time("load_textual_inversion()")
    def load_textual_inversion(self, pretrained_model_name_or_path: str | Path | Sequence[str | Path],
                               token: str | Sequence[str | None] | None = None) -> list[str]:
        """Load textual-inversion embeddings, used by name in later prompts (diffusers' ``load_textual_inversion``
        on local files; A1111's naming: the file stem unless ``token`` is given). See :mod:`~.embeddings` for the
        file forms (``.safetensors``; ``.pt``/``.bin`` through torch's weights-only loader only; SDXL: the
        two-encoder ``clip_l``/``clip_g`` form, each encoder's vectors fed to it).

        Args:
            pretrained_model_name_or_path: one embedding file or a list of them.
            token: the name in prompts, or one per file; ``None`` = each file's stem.

        Returns:
            The names of every embedding loaded so far, in load order.

        Raises:
            RuntimeInputError: an artifact whose text encoder(s) take no embeddings (compiled before), a missing
                or refused file, a file of the other family's form (one-encoder vs SDXL), a vector size that is not
                the text encoder's, a name taken, or the artifact's ``--max-embedding-vectors`` rows full. Nothing is
                loaded then.
            PipelineBusyError: a call of this pipeline is running.
        """
        sdxl = self.architecture == "sdxl"
        tables = load_embeddings((self.embeddings, self.embeddings_2)[: 1 + sdxl],
                                 [self.engines[n] for n in ("text_encoder", "text_encoder_2")[: 1 + sdxl]],
                                 pretrained_model_name_or_path, token, self.root or "this artifact")
        self.embeddings, self.embeddings_2 = tables[0], tables[1] if sdxl else None
        self.embedding_cache.clear()  # a cached negative prompt may name an embedding now
        return [e.name for e in self.embeddings.embeddings]

    @one_call_at_a_time("unload_textual_inversion()")
    def unload_textual_inversion(self) -> None:
        """Forget every loaded embedding (their names are plain text again); a no-op without any."""
        self.embeddings = self.embeddings_2 = None
        self.embedding_cache.clear()

    # -- lifecycle --------------------------------------------------------------------------------------

    @one_call_at_a_time("engine()")
    def engine(self, name: str) -> Engine | None:
        """The open engine ``name``; a lazily opened one (the VAE encoder) is entered now, and so is one a VRAM budget
        opens per stage (other stages' per-stage engines are released first; the next call's end releases it).
        ``None`` if absent."""
        if name in self.engines:
            self.stages.open_component(name)
        return self._engine(name)

    def _engine(self, name: str) -> Engine | None:
        """:meth:`engine` inside a call (which holds the call guard already)."""
        if name not in self.engines and name in self._lazy:
            self.engines[name] = self._stack.enter_context(self._lazy.pop(name))
        return self.engines.get(name)

    @one_call_at_a_time("close()")
    def close(self) -> None:
        """Free every engine (idempotent). Refused (:class:`~diffusion_trt.errors.PipelineBusyError`) while a call
        runs in another thread: its engines would be freed under it."""
        if not getattr(self, "_closed", True):
            self._closed = True
            self._stack.close()
            self.embedding_cache.clear()
            self._host_buffers.clear()

    def __enter__(self) -> EnginePipeline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):
            self.close()

    @property
    def interrupt(self) -> bool:
        """diffusers' ``interrupt``: whether a ``callback_on_step_end`` of the running (or last) call set
        ``pipe._interrupt = True`` to stop its loop."""
        return bool(getattr(self, "_interrupt", False))

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: ``pickle``, ``copy.copy`` and ``copy.deepcopy`` all come here. A pipeline owns open engine
        sessions (and device memory, a CUDA stream, a call guard) that cannot be serialised or shared: a shallow copy
        shared them, and closed them all when it was garbage-collected (the original's next call then failed with
        "engine 'text_encoder' is not open").

        Raises:
            TypeError: always, naming what to do instead.
        """
        raise TypeError(f"an EnginePipeline cannot be pickled or copied (copy.copy / copy.deepcopy): it owns open "
                        f"engines; load another one with EnginePipeline.from_artifacts({str(self.root or '')!r}), or "
                        "send the artifact path to the other process")

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"EnginePipeline({str(self.root or '')!r}, backend={m.backend}, precision={m.precision}, "
            f"device={self.device}, scheduler={self.scheduler_name}, profile={m.profile_json})"
        )

    # -- the call ---------------------------------------------------------------------------------------

    @one_call_at_a_time("a call")
    @names_parameters
    def __call__(
        self,
        prompt: str | Sequence[str] | None = None,
        negative_prompt: str | Sequence[str] | None = None,
        num_inference_steps: int = GENERATION_ARGS["num_inference_steps"].default,
        guidance_scale: float | None = None,
        generator: Generator = None,
        seed: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_images_per_prompt: int = GENERATION_ARGS["num_images_per_prompt"].default,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        progress: bool | None = None,
        callback: StepCallback | None = None,
        eta: float = GENERATION_ARGS["eta"].default,
        image: Any = None,
        strength: float | None = None,
        mask_image: Any = None,
        prompt_2: str | Sequence[str] | None = None,
        negative_prompt_2: str | Sequence[str] | None = None,
        original_size: tuple[int, int] | None = None,
        crops_coords_top_left: tuple[int, int] = (0, 0),
        target_size: tuple[int, int] | None = None,
        negative_original_size: tuple[int, int] | None = None,
        negative_crops_coords_top_left: tuple[int, int] = (0, 0),
        negative_target_size: tuple[int, int] | None = None,
        prompt_syntax: str = "a1111",
        prompt_embeds: torch.Tensor | None = None,
        negative_prompt_embeds: torch.Tensor | None = None,
        pooled_prompt_embeds: torch.Tensor | None = None,
        negative_pooled_prompt_embeds: torch.Tensor | None = None,
        clip_skip: int | None = None,
        control_image: Any = None,
        controlnet: str | Sequence[str] | None = None,
        controlnet_conditioning_scale: float | Sequence[float] | None = None,
        control_guidance_start: float | Sequence[float] = 0.0,
        control_guidance_end: float | Sequence[float] = 1.0,
        guess_mode: bool = False,
        return_dict: bool = True,
        guidance_rescale: float = GENERATION_ARGS["guidance_rescale"].default,
        callback_on_step_end: Any = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        timesteps: Sequence[int] | None = None,
        sigmas: Sequence[float] | None = None,
        **diffusers_only: Any,
    ) -> EnginePipelineOutput | tuple[Any, ...]:
        """Generate images from text, as ``diffusers.StableDiffusionPipeline.__call__``; with ``image`` as
        ``StableDiffusionImg2ImgPipeline``, with ``image`` and ``mask_image`` as ``StableDiffusionInpaintPipeline``.

        Args:
            prompt: one prompt or a list of P prompts; ``None`` with ``prompt_embeds``.
            negative_prompt: ``None`` (= ""), one string for every prompt, or P strings. Ignored when
                ``guidance_scale <= 1`` (no classifier-free guidance).
            num_inference_steps: scheduler steps, >= 1.
            guidance_scale: classifier-free guidance weight, >= 0; CFG runs (doubling the UNet batch) when > 1.
                ``None`` = diffusers' default of the artifact's pipeline class: 7.5 (SD 1.x/2.x), 5.0 (SDXL).
            generator: a ``torch.Generator`` or a list of B of them (as diffusers); excludes ``seed``.
            seed: seeds a CPU ``torch.Generator`` (same image on CPU and CUDA; same image as diffusers with
                ``generator=torch.Generator("cpu").manual_seed(seed)``). With neither ``seed`` nor
                ``generator``, a seed is drawn from torch's global RNG and reported in the output.
            height, width: image size in pixels, multiples of 8 inside the artifact's profile; default the
                profile's opt size (``compile --height/--width``; the model's size when those were not given).
            num_images_per_prompt: N images per prompt; B = P x N >= the profile's min batch; above its max
                batch the request runs in engine-sized chunks (same images as one call for deterministic
                schedulers; see :mod:`~diffusion_trt.runtime.batching` for seeds); a B whose latents (drawn at
                once) and host images exceed the available host memory is refused up front.
            latents: initial noise [B, 4, height/8, width/8] (any float dtype, any device), instead of drawing it.
            output_type: "pil", "np", "pt" or "latent" (see :class:`EnginePipelineOutput`).
            progress: show a tqdm bar over the steps; ``None`` = shown unless
                :meth:`set_progress_bar_config` ``(disable=True)``, as diffusers.
            callback: ``callback(step_index, timestep, latents)`` after each scheduler step (timestep: 0-d CPU
                tensor; latents of the running chunk on the device; once per step of every chunk).
            eta: DDIM's eta (ignored by other schedulers), >= 0.
            image: image-to-image / inpainting: the start image(s): a ``PIL.Image`` (RGB), a float numpy array
                [H, W, 3] / [n, H, W, 3] in [0, 1], a float tensor [3, H, W] / [n, 3, H, W] in [0, 1] (or [-1, 1]),
                or a list of them (see :mod:`~diffusion_trt.runtime.image_inputs`). Its size is the output size
                (multiples of 8 inside the profile; never resized); n must divide the batch.
            strength: in (0, 1]: how much of the image is re-noised (the first ``steps - int(steps * strength)``
                steps are skipped, diffusers' ``get_timesteps``); ``None`` = 0.8 (image-to-image) or 1.0
                (inpainting), diffusers' defaults. Only with ``image``.
            mask_image: inpainting: white (>= 0.5) = repaint, black = keep; a PIL image (any mode, read as
                grayscale: ``convert("L")``, an alpha channel ignored with a warning, as diffusers and ``--mask``),
                numpy array or tensor in [0, 1] of the image's size; one mask or one per image.
                Required by an inpainting artifact (UNet with 9 input channels); with a 4-channel UNet the
                unmasked area is blended back after every step (diffusers' legacy inpainting).
            prompt_2, negative_prompt_2: SDXL: the texts for ``text_encoder_2`` (one string for every prompt, or P
                strings); ``None`` = ``prompt`` / the negative prompt, as diffusers' ``StableDiffusionXLPipeline``.
                For SDXL, ``negative_prompt=None`` means zero negative embeddings when the model's
                ``force_zeros_for_empty_prompt`` is true (SDXL base), not the encoded "".
            original_size, crops_coords_top_left, target_size: SDXL micro-conditioning, (height, width) and
                (top, left) pairs in pixels; the UNet's ``time_ids`` are ``original_size + crops_coords_top_left +
                target_size`` (diffusers' ``_get_add_time_ids``); sizes default to (height, width).
            negative_original_size, negative_crops_coords_top_left, negative_target_size: SDXL: the time ids of the
                negative rows, used only when both sizes are given (else the prompt's), as diffusers.
            prompt_syntax: "a1111" (default): A1111's weights ``(text)`` x1.1, ``[text]`` /1.1, ``(text:1.3)``,
                escapes ``\\(``, and ``BREAK``; "plain": the text as it is
                (:mod:`~diffusion_trt.runtime.prompt_syntax`).
                Either way a prompt longer than 75 tokens is encoded in 75-token chunks, as many as the artifact
                allows (``compile --max-prompt-chunks``; :mod:`~diffusion_trt.runtime.prompt_encoding`); SDXL
                chunks and weights both encoders alike, pooled embeddings from the first chunk
                (:mod:`~diffusion_trt.runtime.sdxl`).
            prompt_embeds: instead of ``prompt``, as diffusers: text embeddings [P, 77 k, D] (any float dtype and
                device; e.g. compel's), k chunks within the artifact's range (``compile --max-prompt-chunks``), D the
                UNet's cross-attention width (SDXL: D1 + D2). Repeated ``num_images_per_prompt`` times.
            negative_prompt_embeds: with ``prompt_embeds``, instead of ``negative_prompt``: the same shape. Without
                it, CFG encodes ``negative_prompt`` ("" by default) cut or padded to k chunks (diffusers pads its
                tokens to ``prompt_embeds.shape[1]``); on SDXL with ``negative_prompt=None`` the negative embeddings
                are zeros (``force_zeros_for_empty_prompt``), as diffusers.
            pooled_prompt_embeds, negative_pooled_prompt_embeds: SDXL, required with ``prompt_embeds`` /
                ``negative_prompt_embeds`` (as diffusers): the pooled ``text_embeds`` [P, E] of ``text_encoder_2``.
            clip_skip: diffusers' ``clip_skip``: the text states ``final_layer_norm(hidden_states[-(clip_skip + 1)])``
                (1 = the penultimate layer, A1111's "Clip skip 2"), for prompts and negative prompts alike (diffusers'
                ``encode_prompt`` gives the negative prompt the last layer); ``None``/0 = the last layer. Up to
                ``compile --max-clip-skip`` (2 by default; the engine's ``clip_skip_states`` output). Not used with
                ``prompt_embeds`` for the prompt. SDXL: as diffusers' SDXL pipeline, ``hidden_states[-(clip_skip + 2)]``
                of both text encoders without the final layer norm (again for the negative prompt too), the pooled
                embeddings unchanged; an SDXL artifact compiled before SDXL clip skip refuses it.
            control_image, controlnet, controlnet_conditioning_scale, control_guidance_start, control_guidance_end,
                guess_mode: ControlNets (an artifact compiled with ``--controlnet``), as diffusers'
                ``StableDiffusionControlNetPipeline``: one control image (or a list, one per ControlNet named in
                ``controlnet``, default the artifact's only one) of the output size, scales (default as diffusers'
                pipeline of the mode: 1.0 text-to-image, 0.8 image-to-image, 0.5 inpainting) and the guidance window
                per ControlNet or for all; see :func:`~diffusion_trt.runtime.controlnet.control_plan`. As in
                diffusers' text-to-image ControlNet pipeline, ``image=`` is the control image when ``controlnet`` is
                given without ``control_image``, ``mask_image`` and ``strength`` (with ``strength`` it is the start
                image, as in diffusers' image-to-image ControlNet pipeline, which takes ``control_image=``).
            guidance_rescale: diffusers' ``guidance_rescale``, >= 0 (0 = off; 0.7 in the paper): with CFG, the guided
                noise prediction rescaled towards the text prediction's std (for zero-terminal-SNR / v-prediction
                models), as ``StableDiffusionPipeline`` / ``StableDiffusionXLPipeline``; in every mode here.
            callback_on_step_end: diffusers' ``callback_on_step_end(pipe, step_index, timestep, callback_kwargs)``
                after each scheduler step (``pipe`` is this pipeline); ``callback_kwargs`` is ``{"latents": ...}``
                and the ``"latents"`` of the dict it returns replace them (:class:`~.latents.StepEnd`). Once per step
                of every chunk, as ``callback`` (which runs after it). Setting ``pipe._interrupt = True`` in it stops
                the loop as diffusers' does (the steps left are skipped, the latents as they are decoded;
                :attr:`interrupt`).
            callback_on_step_end_tensor_inputs: ``["latents"]`` (diffusers' default), the one tensor handed over;
                others (``prompt_embeds``...) are refused.
            timesteps, sigmas: diffusers' custom schedule (one of them, a list), for schedulers whose
                ``set_timesteps`` takes it (euler, heun, dpm++, unipc, ddpm...; others are refused by name);
                ``num_inference_steps`` is then the schedule's length, as diffusers' ``retrieve_timesteps``.
            diffusers_only: diffusers' keywords these engines cannot honour (``cross_attention_kwargs``,
                ``ip_adapter_image``, ``denoising_end``, ``callback_steps``...: :data:`~.request.DIFFUSERS_ONLY`),
                accepted only with a value that asks for nothing (``None``); otherwise refused by name with the reason.
            return_dict: ``False`` returns diffusers' tuple instead of the output object
                (:meth:`EnginePipelineOutput.to_tuple`: ``(images, None)``, SDXL ``(images,)``).

        Returns:
            :class:`EnginePipelineOutput` with ``images``, ``seed``, ``parameters`` and ``nsfw_content_detected``
            (``None``); with ``return_dict=False`` its tuple.

        Raises:
            RuntimeInputError: any argument the engines cannot honour; the message names the value and the fix
                (for images: see :func:`~diffusion_trt.runtime.image_inputs.image_request`).
            RuntimeError: the pipeline was closed.
            PipelineBusyError: another call of this pipeline is running (in another thread, or this call's
                ``callback`` called the pipeline); nothing was run (see "Threads" in the class docstring).
        """
        if self._closed:
            raise RuntimeError("EnginePipeline is closed; load it again with EnginePipeline.from_artifacts")
        check_diffusers_only(diffusers_only)
        self._interrupt = False  # diffusers': a callback_on_step_end sets it to stop the loop
        if progress is None:
            progress = not self._progress_disabled
        check_return_dict(return_dict)
        if (controlnet is not None and control_image is None and image is not None and mask_image is None
                and strength is None):
            control_image, image = image, None  # diffusers' StableDiffusionControlNetPipeline(image=control image)
        request = self.build_request(
            prompt, negative_prompt, num_inference_steps,
            guidance_scale, generator, seed, height, width, num_images_per_prompt, latents, output_type, progress,
            callback, eta, image, strength, mask_image, prompt_2=prompt_2,
            negative_prompt_2=negative_prompt_2, original_size=original_size,
            crops_coords_top_left=crops_coords_top_left, target_size=target_size,
            negative_original_size=negative_original_size,
            negative_crops_coords_top_left=negative_crops_coords_top_left, negative_target_size=negative_target_size,
            prompt_syntax=prompt_syntax, prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
            pooled_prompt_embeds=pooled_prompt_embeds, negative_pooled_prompt_embeds=negative_pooled_prompt_embeds,
            clip_skip=clip_skip, guidance_rescale=guidance_rescale,
            callback_on_step_end=StepEnd.build(self, callback_on_step_end, callback_on_step_end_tensor_inputs),
            timesteps=timesteps, sigmas=sigmas,
        )
        out = self._run(request, control_image, controlnet, controlnet_conditioning_scale, control_guidance_start,
                        control_guidance_end, guess_mode)
        return out if return_dict else out.to_tuple(self.architecture)

    def build_request(self, *args: Any, **kwargs: Any) -> Request:
        """:meth:`~.request.Request.build` on this pipeline's spec and engines: the arguments of :meth:`__call__`
        (without the ControlNet ones), checked; nothing runs.

        Raises:
            RuntimeInputError: as :meth:`__call__`.
        """
        return Request.build(self.request_spec, {**self._lazy, **self.engines}, *args, tokenizer_2=self.tokenizer_2,
                             embeddings_2=self.embeddings_2, **kwargs)

    @one_call_at_a_time("a call")
    def run_request(self, request: Request, **control: Any) -> EnginePipelineOutput:
        """Run a built ``request`` (:meth:`build_request`, or a share of one: :class:`~.parallel.DataParallelPipeline`)
        with the ControlNet arguments of :meth:`__call__`, as :meth:`__call__` runs it.

        Raises:
            RuntimeInputError: a ControlNet argument the engines cannot honour. RuntimeError: closed.
        """
        if self._closed:
            raise RuntimeError("EnginePipeline is closed; load it again with EnginePipeline.from_artifacts")
        return self._run(request, **control)

    def _run(self, request: Request, control_image: Any = None, controlnet: str | Sequence[str] | None = None,
             controlnet_conditioning_scale: float | Sequence[float] | None = None,
             control_guidance_start: float | Sequence[float] = 0.0, control_guidance_end: float | Sequence[float] = 1.0,
             guess_mode: bool = False) -> EnginePipelineOutput:
        """The second half of :meth:`__call__`: the ControlNet plan, the engines opened on first use, the loop."""
        if control_image is None:
            check_no_control_options(controlnet, controlnet_conditioning_scale, control_guidance_start,
                                     control_guidance_end, guess_mode)
        if controlnet_conditioning_scale is None:  # the default of diffusers' ControlNet pipeline of the mode (SDXL's
            # conditioning says "sdxl": its text-to-image default)
            controlnet_conditioning_scale = DEFAULT_CONTROL_SCALE.get(getattr(request.conditioning, "mode", "txt2img"),
                                                                      DEFAULT_CONTROL_SCALE["txt2img"])
        opened = {**self._lazy, **self.engines}  # in the manifest's order, whichever engines are open already (else
        # a call that opened controlnet_b only listed the ControlNets as "b, a" in later messages)
        order = {n: i for i, n in enumerate(self.manifest.components)}
        opened = dict(sorted(opened.items(), key=lambda kv: order.get(kv[0], len(order))))
        control = control_plan(opened, control_image, controlnet,
                               controlnet_conditioning_scale, control_guidance_start, control_guidance_end,
                               guess_mode, request.height, request.width, len(request.prompts))
        if control is not None:
            check_lora_reaches_unet_controlnet(self._loaded_loras)
        if isinstance(request.conditioning, ImageRequest):
            self._engine("vae_encoder")  # opened on first use, after the checks
        if control is not None:  # the ControlNet engines, opened on first use
            control = self._open_control(control)
        images = self._generate(request, control)
        return EnginePipelineOutput(images=images, seed=request.seed, parameters=self._parameters(request))

    def _open_control(self, control: ControlPlan) -> ControlPlan:
        """``control`` on the entered engines (``unet_controlnet``, its ControlNets and their ``cond_embed_<name>``
        entered on first use)."""
        unet = self._engine(control.unet.name)  # inside the call: its guard is held already
        units = tuple(dataclasses.replace(u, engine=self._engine(u.engine.name),
                                          embed=None if u.embed is None else self._engine(u.embed.name))
                      for u in control.units)
        return dataclasses.replace(control, unet=unet, units=units)

    def _generate(self, request: Request, control: ControlPlan | None = None) -> Any:
        """Run ``request`` on this pipeline's stream (and VRAM budget); the images of :func:`.denoise.generate`."""
        if self.residency is not None:  # the budget at this size and batch (refused before anything runs)
            self.residency.begin(request.height, request.width, request.batch)
        stream = self._stream
        caller = torch.cuda.current_stream(self.device) if stream is not None else None
        if stream is not None:
            stream.wait_stream(caller)  # inputs the caller enqueued (latents, generator state) come first
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), \
                deterministic_torch(self.deterministic):
            images = denoise.generate(request, self.loop_engines(request.output_type), self.scheduler, control)
        if self.residency is not None:
            self.residency.end()  # per-stage engines released (after a failed call: by the next one, or close)
        if caller is not None and stream is not None and isinstance(images, torch.Tensor):
            # the caller uses the tensor on its own stream: order it after ours, and tell the allocator
            caller.wait_stream(stream)
            images.record_stream(caller)
        return images

    def loop_engines(self, output_type: str = "pil") -> denoise.LoopEngines:
        """What :func:`.denoise.generate` runs on: this pipeline's engines (no VAE decoder for "latent"), tokenizer,
        reusable buffers and stage context (:attr:`stages`: a VRAM budget opens engines per stage there). With
        :attr:`request_spec`, the loop can be driven directly::

            request = Request.build(pipe.request_spec, pipe.engines, "a fox", num_inference_steps=30, seed=1)
            images = denoise.generate(request, pipe.loop_engines(request.output_type), pipe.scheduler)
        """
        return denoise.LoopEngines(
            text_encoder=self.engines["text_encoder"], unet=self.engines["unet"],
            vae_decoder=None if output_type == "latent" else self.engines["vae_decoder"], tokenizer=self.tokenizer,
            scaling_factor=self.geometry.scaling_factor, embedding_cache=self.embedding_cache,
            embeddings=self.embeddings, host_buffers=self._host_buffers, copy_stream=self._copy_stream,
            stages=self.stages,
        )

    def _parameters(self, request: Request) -> dict[str, Any]:
        """The generation parameters of ``request`` (JSON-serialisable), for :func:`save_png`."""
        given = dict(request.given)
        parameters = {
            "prompt": given.pop("prompt"),
            "negative_prompt": given.pop("negative_prompt"),
            "num_inference_steps": request.num_inference_steps,
            "guidance_scale": request.guidance_scale,
            "scheduler": self.scheduler_name,
            "seed": request.seed,
            "height": request.height,
            "width": request.width,
            "num_images_per_prompt": request.num_images_per_prompt,
            "eta": request.eta,
            "backend": self.manifest.backend.value,
            "precision": self.manifest.precision,
            "device": str(self.device),
        }
        if isinstance(request.conditioning, ImageRequest):
            parameters.update(mode=request.conditioning.mode, strength=request.conditioning.strength)
        parameters.update(given)  # the SDXL arguments given
        return parameters

    def _generator(self, generator: Generator, seed: int | None, batch: int) -> tuple[Generator, int | None]:
        """:func:`~.request.check_generator` (what :class:`~.parallel.DataParallelPipeline` draws its latents with)."""
        return check_generator(generator, seed, batch)


@dataclass(frozen=True)
class LoadOptions:
    """How :meth:`EnginePipeline.from_artifacts` opens an artifact's engines (its keyword options).

    Attributes:
        device: "cpu" or "cuda"; ``None`` = the device the artifact was compiled for.
        scheduler: short scheduler name ("euler_a", "dpm++"...); ``None`` = the model's own.
        device_id: CUDA device ordinal.
        cudnn_conv_algo_search, intra_op_num_threads, io_binding, provider_options: passed to
            :class:`~diffusion_trt.runtime.engines.ort_engine.OrtEngine` (ignored for TensorRT artifacts, which run on
            CUDA only, through :class:`~diffusion_trt.runtime.engines.trt_engine.TrtEngine`).
        cuda_graph: replay each engine as a CUDA graph (ORT: ``enable_cuda_graph`` with engine-owned input
            buffers; TensorRT: captured enqueues). ``None`` = on for CUDA artifacts with a static profile
            (ORT: the engines that run every step, the UNet and ControlNets; the text encoders and VAE, once per
            image, run eager: :data:`~.loading.EAGER_COMPONENTS`) and for every TensorRT artifact; ``True`` = every
            engine (an engine where it cannot work falls back to eager runs with one warning naming the cause).
            TensorRT-RTX: its own capture of static profiles.
        runtime_cache_dir: TensorRT-RTX: the folder of this artifact's runtime-cache files (kernels compiled for
            this GPU on first load, read on later loads); ``None`` =
            ``$XDG_CACHE_HOME/diffusion-trt/runtime-cache/<manifest_sha256[:16]>`` (see
            :mod:`~diffusion_trt.runtime.engines.runtime_cache`). Never inside the (sealed) artifact folder.
        vram_budget: device memory the pipeline may use: bytes or a size string ("8GB", "8GiB", "7.5G",
            "8000MB"); the engines are then opened per stage or kept resident as the plan of
            :mod:`~diffusion_trt.runtime.memory.residency` decides, ORT arenas are capped to it and large images are
            decoded in VAE tiles. ``None`` = no budget (every engine resident, as before).
        vram_request: (height, width, batch) the budget is checked against now; ``None`` sizes (default) = the
            size a call without sizes gets (the profile's opt size), batch 1. Every call is checked again for its own
            size and batch.
        memory_facts: a measured memory facts file (:func:`~diffusion_trt.runtime.memory.plan.load_memory_facts`);
            default the one recorded for this artifact, if any, else estimates.
        deterministic: ORT's ``use_deterministic_compute`` on every session and torch's deterministic algorithms
            in the loop (see :mod:`~diffusion_trt.runtime.determinism` for what it cannot fix); size buckets are
            then made synchronously (a shape's calls all run on one session).
        size_buckets: ORT artifacts with a dynamic profile: serve the UNet and the VAE decoder from static
            sessions specialised per shape (see :mod:`~diffusion_trt.runtime.engines.buckets`): ``"auto"`` (any size, up
            to 4 shapes), a list of sizes (``"512x512,768x768"`` or ``[(512, 512)]``; opened now at the opt
            batch), or ``None`` (off). Ignored, with a warning, for static and TensorRT artifacts.
        graph_optimization_level: ONNX Runtime artifacts: the graph optimisation each session makes when it is created
            ("disable", "basic", "extended", "all"; see
            :data:`~diffusion_trt.runtime.engines.ort_engine.OPTIMIZATION_LEVELS`).
    """

    device: str | None = None
    scheduler: str | None = None
    device_id: int = 0
    cudnn_conv_algo_search: str = "AUTO"
    intra_op_num_threads: int | None = None
    io_binding: bool | None = None
    provider_options: Mapping[str, Any] | None = None
    cuda_graph: bool | None = None
    runtime_cache_dir: str | os.PathLike[str] | None = None
    vram_budget: str | int | None = None
    vram_request: tuple[int | None, int | None, int] | None = None
    memory_facts: str | os.PathLike[str] | None = None
    deterministic: bool = False
    size_buckets: str | Sequence[tuple[int, int]] | SizeBuckets | None = None
    graph_optimization_level: str = "all"

    def __post_init__(self) -> None:
        """Refuse option values of the wrong type or range before anything loads (they failed later as a damaged
        artifact, or were taken as true); ``cudnn_conv_algo_search`` in any case, as the CLI takes it.

        Raises:
            RuntimeInputError: naming the option, the value and what it takes.
        """
        from .engines.ort_engine import CONV_ALGO_SEARCH

        search = self.cudnn_conv_algo_search
        if not isinstance(search, str) or search.upper() not in CONV_ALGO_SEARCH:
            raise RuntimeInputError(f"cudnn_conv_algo_search={search!r} is unknown; use one of "
                                    f"{', '.join(CONV_ALGO_SEARCH)}")
        object.__setattr__(self, "cudnn_conv_algo_search", search.upper())
        threads = self.intra_op_num_threads
        if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 0):
            raise RuntimeInputError(f"intra_op_num_threads={threads!r} must be an integer >= 0 (0: ONNX Runtime's "
                                    "default) or None")
        if not isinstance(self.deterministic, bool):
            raise RuntimeInputError(f"deterministic={self.deterministic!r} must be True or False")
        from .engines.ort_engine import OPTIMIZATION_LEVELS

        if self.graph_optimization_level not in OPTIMIZATION_LEVELS:
            raise RuntimeInputError(f"graph_optimization_level={self.graph_optimization_level!r} is unknown; use one "
                                    f"of {', '.join(OPTIMIZATION_LEVELS)}")
        _check_option_types(self)


def _check_option_types(options: LoadOptions) -> None:
    """:meth:`LoadOptions.__post_init__`'s checks of the options that were taken as they came (``io_binding='no'``
    as true, ``device_id='0'`` failing inside ONNX Runtime, ``provider_options='x'`` as a bare TypeError).

    Raises:
        RuntimeInputError: naming the option, the value and what it takes.
    """
    if options.device is not None and options.device not in ("cpu", "cuda"):
        raise RuntimeInputError(f"device={options.device!r} is not supported; use 'cpu' or 'cuda'")
    device_id = options.device_id
    if not isinstance(device_id, int) or isinstance(device_id, bool) or device_id < 0:
        raise RuntimeInputError(f"device_id={device_id!r} must be an integer >= 0 (a CUDA device ordinal, as "
                                "torch.device('cuda', device_id))")
    _check_flag("io_binding", options.io_binding, "None: on for CUDA, off on the CPU", allow_none=True)
    _check_flag("cuda_graph", options.cuda_graph, "None: on for CUDA artifacts with a static profile and for "
                "TensorRT ones", allow_none=True)
    _check_provider_options(options.provider_options)
    _check_path_or_none("runtime_cache_dir", options.runtime_cache_dir, "a folder")
    _check_path_or_none("memory_facts", options.memory_facts, "a memory facts file")
    _check_vram_request(options.vram_request)
    if options.vram_budget is None and options.vram_request is not None:
        logger.warning("vram_request=%r: no effect without vram_budget", options.vram_request)


def _artifact_path(path: Any) -> Path:
    """``path`` as a :class:`Path`.

    Raises:
        RuntimeInputError: not a str or ``os.PathLike`` of a str, or empty.
    """
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if not isinstance(text, str) or not text:
        raise RuntimeInputError(f"path={path!r} must be the artifact folder (the one with manifest.json), as a str or "
                                "os.PathLike")
    return Path(text)


def check_return_dict(value: Any) -> None:
    """diffusers' ``return_dict`` of a call (:class:`EnginePipeline`, :class:`~.parallel.DataParallelPipeline`),
    checked before any work.

    Raises:
        RuntimeInputError: not a bool.
    """
    _check_flag("return_dict", value, "False returns diffusers' tuple")


def _check_flag(name: str, value: Any, meaning: str, allow_none: bool = False) -> None:
    """Refuse a flag that is not a bool (``'no'`` is true to ``if``)."""
    if isinstance(value, bool) or (allow_none and value is None):
        return
    allowed = "True, False or None" if allow_none else "True or False"
    raise RuntimeInputError(f"{name}={value!r} must be {allowed} ({meaning})")


def _check_path_or_none(name: str, value: Any, what: str) -> None:
    """Refuse a path option that is no str / ``os.PathLike`` of a str, or is empty (``Path('')`` is the current
    folder)."""
    if value is None:
        return
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(text, str) or not text:
        raise RuntimeInputError(f"{name}={value!r} must be the path of {what} (a str or os.PathLike) or None")


def _check_provider_options(value: Any) -> None:
    """Refuse provider options that are not a mapping of option names to plain values (ONNX Runtime reads each value
    as a string)."""
    if value is None:
        return
    plain = (str, int, float, bool)
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, plain)
                                                 for k, v in value.items()):
        raise RuntimeInputError(
            f"provider_options={value!r} must be a mapping of ONNX Runtime CUDA provider option names to values (str, "
            "int, float or bool), e.g. {'arena_extend_strategy': 'kSameAsRequested'}, or None"
        )


def _check_vram_request(value: Any) -> None:
    """Refuse a ``vram_request`` that is not (height, width, batch)."""
    if value is None:
        return

    def count(v: Any, minimum: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= minimum

    ok = (isinstance(value, tuple | list) and len(value) == 3 and all(v is None or count(v, 1) for v in value[:2])
          and count(value[2], 1))
    if not ok:
        raise RuntimeInputError(
            f"vram_request={value!r} must be (height, width, batch): height and width in pixels or None (the "
            "artifact's default size), batch an integer >= 1; e.g. (512, 512, 1), or None"
        )


def _check_device_id(device: str, device_id: int) -> None:
    """Refuse a CUDA ordinal this machine does not have (it failed inside torch or ONNX Runtime)."""
    if device == "cuda" and torch.cuda.is_available() and device_id >= (count := torch.cuda.device_count()):
        raise RuntimeInputError(f"device_id={device_id} but this machine has {count} CUDA device(s); use 0.."
                                f"{count - 1}")


def _scheduler_class_name(manifest: Manifest, scheduler_config: Mapping[str, Any]) -> str:
    """The artifact's scheduler class: the manifest's ``scheduler.class_name``, else the config's ``_class_name``."""
    named = manifest.scheduler_class
    own = scheduler_config.get("_class_name") if isinstance(scheduler_config, Mapping) else None
    return str(named or own or "")


def _check_tokenizers(model: ModelFacts, architecture: str, tokenizer: Any, tokenizer_2: Any) -> None:
    """Refuse tokenizers that are not the ones the artifact was compiled with (and an SDXL one without its second).

    Raises:
        ArtifactError: a ``model_max_length`` other than the manifest's ``text_max_length``; SDXL without
            ``tokenizer_2``.
    """
    text_len = model.text_max_length
    if text_len is not None and tokenizer.model_max_length != text_len:
        raise ArtifactError(
            f"tokenizer model_max_length={tokenizer.model_max_length} but the manifest says text_max_length="
            f"{text_len}; the artifact's tokenizer/ folder is not the one it was compiled with: recompile"
        )
    if architecture != "sdxl":
        return
    if tokenizer_2 is None:
        raise ArtifactError("an SDXL artifact needs tokenizer_2 (its tokenizer_2/ folder): recompile it")
    if text_len is not None and tokenizer_2.model_max_length != text_len:
        raise ArtifactError(
            f"tokenizer_2 model_max_length={tokenizer_2.model_max_length} but the manifest says "
            f"text_max_length={text_len}; the artifact's tokenizer_2/ folder is not the one it was compiled "
            "with: recompile"
        )


def _check_device(root: Path, manifest: Manifest, device: str | None) -> str:
    """The device the artifact runs on: ``device``, or the one it was compiled for.

    Raises:
        ArtifactError: an unknown backend, a TensorRT artifact off CUDA, an fp16 artifact on the CPU.
        RuntimeInputError: a device other than "cpu" / "cuda".
    """
    backend = manifest.backend
    is_trt = backend in trt_compat.LIBRARIES  # any TensorRT library: full TensorRT or TensorRT-RTX
    if backend is not Backend.ORT and not is_trt:
        raise ArtifactError(
            f"artifact {root} was compiled for backend={backend!r}; this runtime runs 'ort', "
            f"{', '.join(repr(b) for b in trt_compat.LIBRARIES)} artifacts: recompile with --backend ort"
        )
    compiled_for = manifest.device
    device = device or compiled_for
    if device not in ("cpu", "cuda"):
        raise RuntimeInputError(f"device={device!r} is not supported; use 'cpu' or 'cuda'")
    if is_trt and device != "cuda":
        raise ArtifactError(
            f"artifact {root} was compiled for backend={backend!r}, whose engines run on CUDA only, but "
            f"device={device!r}; use device='cuda' on a GPU host, or recompile with --backend ort to run on the CPU"
        )
    if device == "cpu" and manifest.precision == "fp16":
        raise ArtifactError(
            f"artifact {root} is fp16, which ONNX Runtime cannot run on CPU; use device='cuda' or recompile "
            "with --precision fp32 --device cpu"
        )
    if device != compiled_for:
        logger.warning(
            "artifact %s was compiled for %s but runs on %s: its graphs were optimised for %s "
            "(recompile with --device %s for best results)", root, compiled_for, device, compiled_for, device)
    return device


def _open_engines(reader: ArtifactReader, device: str, options: LoadOptions, stream: torch.cuda.Stream | None,
                  residency: Residency | None, weight_slots: Mapping[str, Any] | None = None,
                  reads: Mapping[str, Future[PrivateRead]] | None = None) -> dict[str, Engine]:
    """The artifact's engines (unopened, plain engines), as ``options`` and the VRAM plan ``residency`` say (ORT
    arena caps, TensorRT weight-streaming budgets); ``reads``: ORT components' bytes already being read
    (:func:`_read_ahead`), each handed to its engine."""
    manifest = reader.manifest
    backend = manifest.backend
    is_trt = backend.is_tensorrt
    derived = LatentGeometry.from_manifest(manifest).derived_dims
    buckets = parse_size_buckets(options.size_buckets)
    cuda_graph = options.cuda_graph
    if cuda_graph is None:
        cuda_graph = device == "cuda" and (is_trt or manifest.profile.is_static)
    if options.runtime_cache_dir is not None and not (is_trt and trt_compat.LIBRARIES[backend].runtime_config):
        logger.warning("runtime_cache_dir: no effect on a %r artifact (TensorRT-RTX caches its kernels)", backend)
    if options.cudnn_conv_algo_search != "AUTO" and (is_trt or device != "cuda"):
        logger.warning("cudnn_conv_algo_search=%r: no effect on a %r artifact on %s (it picks ONNX Runtime CUDA's "
                       "convolution algorithms)", options.cudnn_conv_algo_search, backend, device)
    engines: dict[str, Engine]
    if is_trt:
        engines = _trt_engines(reader, options.device_id, stream, derived, cuda_graphs=bool(cuda_graph),
                               runtime_cache_dir=options.runtime_cache_dir,
                               weight_streaming=residency.weight_streaming() if residency else None)
        if options.deterministic or buckets is not None:
            logger.warning("deterministic / size_buckets apply to ONNX Runtime artifacts; ignored for TensorRT")
    else:
        if options.deterministic and (note := compile_time_note(manifest, device)) is not None:
            logger.warning("%s", note)
        engines = _ort_engines(reader, device, options, stream, derived, bool(cuda_graph), residency,
                               weight_slots or {}, reads)
        # Synchronous buckets under a VRAM budget (no extra dynamic copy of the weights) and in deterministic mode
        # (a shape's first call would run on the dynamic session and later ones on the static: other kernels, other
        # low bits).
        if buckets is not None and (residency is not None or options.deterministic):
            buckets = dataclasses.replace(buckets, background=False)
        engines = bucket_engines(engines, buckets, manifest, device, options.cuda_graph)
    return engines


def _ort_engines(reader: ArtifactReader, device: str, options: LoadOptions, stream: torch.cuda.Stream | None,
                 derived: Mapping[str, tuple[str, int]], cuda_graph: bool,
                 residency: Residency | None, weight_slots: Mapping[str, Any],
                 reads: Mapping[str, Future[PrivateRead]] | None = None) -> dict[str, Engine]:
    """The ONNX Runtime engines of a verified artifact, with the CUDA provider options of each component (and its
    read from ``reads``, if one started)."""
    from .engines.ort_engine import OrtEngine

    root, manifest = reader.root, reader.manifest
    engines: dict[str, Engine] = {}
    for name in _components_to_open(manifest):
        entry = manifest.components[name]
        if entry.onnx is None:
            raise ArtifactError(f"manifest component {name!r} has no 'onnx' path; recompile the artifact")
        engines[name] = OrtEngine(
            safe_join(root, entry.onnx),
            entry.spec,
            name=name,
            device=device,
            device_id=options.device_id,
            stream=stream,
            cudnn_conv_algo_search=options.cudnn_conv_algo_search,
            io_binding=options.io_binding,
            intra_op_num_threads=options.intra_op_num_threads,
            provider_options={**cuda_layout_options(name, device, entry.spatial_conv_inputs),
                              **(options.provider_options or {}),
                              **(residency.provider_options(name, device) if residency else {})},
            derived=derived,
            cuda_graph=cuda_graph and wants_graph(name, options.cuda_graph),
            source=functools.partial(reader.onnx, entry.onnx),
            read_ahead=(reads or {}).get(name),
            deterministic=options.deterministic,
            graph_optimization_level=options.graph_optimization_level,
            weight_inputs=weight_slots.get(name),
        )
    return engines


def _trt_engines(
    reader: ArtifactReader,
    device_id: int,
    stream: torch.cuda.Stream | None,
    derived: Mapping[str, tuple[str, int]],
    cuda_graphs: bool = True,
    runtime_cache_dir: str | os.PathLike[str] | None = None,
    weight_streaming: Mapping[str, int] | None = None,
) -> dict[str, Engine]:
    """The TensorRT engines of a verified artifact (full TensorRT or TensorRT-RTX, by ``manifest["backend"]``),
    sharing one activation allocation (they run in sequence); ``weight_streaming``: per component, bytes of
    streamable weights kept on the device (a VRAM budget's plan)."""
    from .engines.runtime_cache import runtime_cache_path
    from .engines.trt_engine import SharedActivationMemory, TrtEngine

    root, manifest = reader.root, reader.manifest
    backend = manifest.backend
    cached = trt_compat.LIBRARIES[backend].runtime_config
    shared = SharedActivationMemory(torch.device("cuda", device_id))
    engines: dict[str, Engine] = {}
    for name in _components_to_open(manifest):
        entry = manifest.components[name]
        if entry.plan is None:
            raise ArtifactError(f"manifest component {name!r} has no 'plan' path; recompile the artifact")
        engines[name] = TrtEngine(
            safe_join(root, entry.plan),
            entry.spec,
            name=name,
            device_id=device_id,
            stream=stream,
            shared_memory=shared,
            verify=False,  # the reader checks the bytes it hands over (or was told not to)
            derived=derived,
            cuda_graphs=cuda_graphs,
            source=functools.partial(reader.read, entry.plan),
            backend=backend.value,
            runtime_cache=runtime_cache_path(root, manifest, entry.build, runtime_cache_dir)
            if cached else None,
            **({"weight_streaming_budget": weight_streaming[name]} if weight_streaming and name in weight_streaming
               else {}),
        )
    return engines


def _warm_loop(engines: Mapping[str, Engine], manifest: Manifest, stream: torch.cuda.Stream,
               opening: OpenTogether) -> None:
    """:data:`~.loading.WARM_LOOP`: :func:`~.denoise.warm_loop_kernels` on ``stream`` while the engines open, holding
    the capture lock shared (its allocations must not land inside a capture); its span in the load timeline."""
    from .engines.capture_lock import CAPTURE_LOCK

    unet, vae = engines.get("unet"), engines.get("vae_decoder")
    if unet is None:
        return
    t = time.perf_counter()
    with CAPTURE_LOCK.shared(), torch.cuda.stream(stream):
        done = denoise.warm_loop_kernels(unet.spec, None if vae is None else vae.spec, stream.device,
                                         LatentGeometry.from_manifest(manifest).scaling_factor)
    if done:
        opening.add_marks("caller", loop_warm_from_s=t, loop_warmed_s=time.perf_counter())


def _read_ahead(reader: ArtifactReader, options: LoadOptions) -> dict[str, Future[PrivateRead]]:
    """Start reading the models of the engines ``from_artifacts`` will open side by side (:func:`_opens_together`:
    none for TensorRT or a VRAM budget, whose plan the load makes later), now (:data:`~.loading.READ_AHEAD`,
    :func:`~.loading.start_reads`); none for a component without an ``onnx`` path (its engine refuses it later).

    Raises:
        ArtifactError: a partial artifact that lacks a text-to-image component, before any read."""
    manifest = reader.manifest
    if not READ_AHEAD or options.vram_budget is not None or not _opens_together(manifest, None):
        return {}
    _components_to_open(manifest)
    sources = {name: functools.partial(reader.onnx, onnx) for name in txt2img_components(manifest)
               if (onnx := manifest.components[name].onnx) is not None}
    return start_reads(sources)


def _opens_together(manifest: Manifest, residency: Residency | None) -> bool:
    """Whether ``from_artifacts`` opens the text-to-image engines side by side (:mod:`~.loading`): ONNX Runtime
    artifacts without a VRAM budget (a budget opens engines per stage; TensorRT engines share one activation
    allocation and are opened in turn)."""
    return manifest.backend is Backend.ORT and residency is None


def txt2img_components(manifest: Manifest) -> tuple[str, ...]:
    """The components the text-to-image loop opens: :data:`TXT2IMG_COMPONENTS`, with ``text_encoder_2`` for an SDXL
    artifact (``model.architecture == "sdxl"``; absent = "sd")."""
    return SDXL_COMPONENTS if manifest.model.is_sdxl else TXT2IMG_COMPONENTS


def _components_to_open(manifest: Manifest) -> tuple[str, ...]:
    """The text-to-image components, then the lazily opened ones the artifact has.

    Raises:
        ArtifactError: a partial artifact (``compile --components``) that lacks a text-to-image component; a
            ``controlnet_<name>`` that takes the conditioning embedding without its ``cond_embed_<name>``
            (:func:`~.controlnet.check_control_components`).
    """
    have = manifest.components
    missing = [c for c in txt2img_components(manifest) if c not in have]
    if missing:
        raise ArtifactError(
            f"the artifact has only the component(s) {sorted(have)} and lacks {missing}, which generating images "
            "needs (it was compiled with --components); recompile without --components"
        )
    check_control_components({name: entry.input_names for name, entry in have.items()})
    embedding = embedding_shape_problems({name: entry.spec for name, entry in have.items()})
    if embedding:
        raise ArtifactError(embedding[0])
    return (*txt2img_components(manifest), *(c for c in LAZY_COMPONENTS if c in have), *control_components(list(have)))

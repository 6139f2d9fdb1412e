"""``EnginePipeline``: text-to-image on a compiled artifact, called like diffusers' StableDiffusionPipeline.

::

    from diffusion_trt.runtime import EnginePipeline, save_png

    with EnginePipeline.from_artifacts("artifacts/sd15", scheduler="euler_a") as pipe:
        out = pipe("an astronaut riding a horse", num_inference_steps=30, seed=42)
        save_png(out.images[0], "astronaut.png", out.parameters)

The pipeline owns its engines (opened in ``from_artifacts``, freed by ``close()``) and validates every
argument before anything runs, with messages that name the value and the fix. It imports neither
``compiler/`` nor ``passes/``: the artifact folder is all it needs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from ..artifacts import load_verified, safe_join
from ..config import ShapeProfile, check_image_size
from ..errors import ArtifactError, RuntimeInputError
from . import denoise
from .batching import plan_chunks
from .cuda import HostBuffers
from .denoise import EmbeddingCache, Generator, StepCallback
from .engine import Engine
from .png import save_png
from .schedulers import make_scheduler, short_name

__all__ = ["OUTPUT_TYPES", "EnginePipeline", "EnginePipelineOutput", "save_png"]

logger = logging.getLogger(__name__)

#: Components the text-to-image loop opens (the VAE encoder is for image-to-image, not loaded here).
TXT2IMG_COMPONENTS: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder")
OUTPUT_TYPES: tuple[str, ...] = ("pil", "np", "pt", "latent")
_MAX_SEED = 2**63 - 1


#: Components whose convolutions run faster in NHWC on CUDA (ORT's ``prefer_nhwc`` lets its layout transformer
#: put Conv and the NHWC GroupNorm kernel in one layout). Measured on an H200, SD-1.5 fp16 512x512 static
#: artifact: UNet step 13.1 -> 9.1 ms, VAE decode 14.0 -> 10.5 ms; the text encoder (no Conv) got slower
#: (1.6 -> 2.5 ms), so it is left out. Figures from benchmarks/components.py.
NHWC_COMPONENTS: frozenset[str] = frozenset({"unet", "vae_decoder", "vae_encoder"})


def cuda_layout_options(component: str, device: str) -> dict[str, str]:
    """Default CUDA provider options of one component (overridden by the caller's ``provider_options``)."""
    return {"prefer_nhwc": "1"} if device == "cuda" and component in NHWC_COMPONENTS else {}


@dataclass
class EnginePipelineOutput:
    """What :meth:`EnginePipeline.__call__` returns.

    Attributes:
        images: "pil": list of B RGB ``PIL.Image``; "np": float32 array [B, H, W, 3] in [0, 1];
            "pt": float tensor [B, 3, H, W] in [0, 1] on the engine device; "latent": the final latents
            [B, 4, H/8, W/8]. B = prompts x ``num_images_per_prompt``, prompt-major.
        seed: the seed of the CPU generator the latents came from; ``None`` when a generator was passed.
        parameters: the generation parameters (JSON-serialisable), for :func:`save_png`.
    """

    images: Any
    seed: int | None
    parameters: dict[str, Any] = field(default_factory=dict)


class EnginePipeline:
    """Stable Diffusion 1.x text-to-image on compiled engines.

    Build it with :meth:`from_artifacts`; the constructor is for engines you made yourself.

    Args:
        manifest: the artifact's manifest (``profile``, ``model``, ``scheduler`` and ``components`` are read).
        engines: at least ``text_encoder``, ``unet``, ``vae_decoder``; the pipeline enters them now (allocating)
            and exits them on :meth:`close`.
        tokenizer: a ``CLIPTokenizer``.
        scheduler_config: the contents of the artifact's ``scheduler_config.json``.
        scheduler: short scheduler name (see :data:`~diffusion_trt.runtime.schedulers.SCHEDULERS`); ``None``
            = the model's own.
        stream: CUDA: the stream the engines were built with; each call runs on it.
        root: the artifact folder, for messages.

    Raises:
        ArtifactError: a required engine is missing or the tokenizer disagrees with the manifest.
        RuntimeInputError: unknown scheduler name.
    """

    def __init__(
        self,
        manifest: Mapping[str, Any],
        engines: Mapping[str, Engine],
        tokenizer: Any,
        scheduler_config: Mapping[str, Any],
        *,
        scheduler: str | None = None,
        stream: torch.cuda.Stream | None = None,
        root: str | os.PathLike[str] | None = None,
    ) -> None:
        self._closed = True  # until the engines are open
        self.root = Path(root) if root is not None else None
        missing = [c for c in TXT2IMG_COMPONENTS if c not in engines]
        if missing:
            raise ArtifactError(f"EnginePipeline needs the engine(s) {', '.join(missing)}; recompile with them")
        self.manifest = dict(manifest)
        model = self.manifest.get("model", {})
        try:
            self.profile = ShapeProfile.from_json(self.manifest["profile"])
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(
                f"manifest profile {self.manifest.get('profile')!r} is malformed ({e}); recompile the artifact"
            ) from e
        self.vae_scale_factor = int(model.get("vae_scale_factor", 8))
        self.vae_scaling_factor = float(model.get("vae_scaling_factor", 0.18215))
        self.default_height = int(model.get("default_height", self.profile.height.opt))
        self.default_width = int(model.get("default_width", self.profile.width.opt))
        self.tokenizer = tokenizer
        text_len = model.get("text_max_length")
        if text_len is not None and tokenizer.model_max_length != text_len:
            raise ArtifactError(
                f"tokenizer model_max_length={tokenizer.model_max_length} but the manifest says text_max_length="
                f"{text_len}; the artifact's tokenizer/ folder is not the one it was compiled with: recompile"
            )
        self._scheduler_config = dict(scheduler_config)
        self._default_scheduler_class = self.manifest.get("scheduler", {}).get("class_name") or str(
            scheduler_config.get("_class_name", "")
        )
        self._scheduler_template: Any = None
        self._scheduler_name = ""
        self.set_scheduler(scheduler)
        self._stream = stream
        self._stack = contextlib.ExitStack()
        self.engines: dict[str, Engine] = {}
        try:
            for name in TXT2IMG_COMPONENTS:
                self.engines[name] = self._stack.enter_context(engines[name])
        except BaseException:
            self._stack.close()
            raise
        unet = self.engines["unet"]
        self.device: torch.device = unet.device
        self.num_channels_latents = int(model.get("unet_in_channels", unet.spec.input("sample").shape[1]))
        #: negative-prompt embeddings, per (text, engine): most requests share "" (see denoise.EmbeddingCache)
        self.embedding_cache = EmbeddingCache(maxsize=8)
        # "pil"/"np" results land in pinned host buffers kept across calls, copied on a side stream
        self._host_buffers = HostBuffers(pin=self.device.type == "cuda" and torch.cuda.is_available())
        self._copy_stream = torch.cuda.Stream(device=self.device) if self._host_buffers.pin else None
        self._closed = False

    # -- construction -----------------------------------------------------------------------------------

    @classmethod
    def from_artifacts(
        cls,
        path: str | os.PathLike[str],
        device: str | None = None,
        scheduler: str | None = None,
        verify: bool = True,
        *,
        device_id: int = 0,
        cudnn_conv_algo_search: str = "EXHAUSTIVE",
        intra_op_num_threads: int | None = None,
        io_binding: bool | None = None,
        provider_options: Mapping[str, Any] | None = None,
        cuda_graph: bool | None = None,
    ) -> EnginePipeline:
        """Load a compiled artifact folder and open its engines.

        Args:
            path: the artifact folder (with ``manifest.json``).
            device: "cpu" or "cuda"; ``None`` = the device the artifact was compiled for.
            scheduler: short scheduler name ("euler_a", "dpm++"...); ``None`` = the model's own.
            verify: check every file's sha256 against the manifest before loading (seconds for a full SD
                model); ``False`` skips the hashes only: the manifest's schema and seal, file sizes, and that no
                path, ONNX external-data reference or link leads outside the folder are always checked.
            device_id: CUDA device ordinal.
            cudnn_conv_algo_search, intra_op_num_threads, io_binding, provider_options: passed to
                :class:`~diffusion_trt.runtime.ort_engine.OrtEngine` (ignored for TensorRT artifacts, which run on
                CUDA only, through :class:`~diffusion_trt.runtime.trt_engine.TrtEngine`).
            cuda_graph: replay each engine as a CUDA graph (ORT: ``enable_cuda_graph`` with engine-owned input
                buffers; TensorRT: captured enqueues). ``None`` = on for CUDA artifacts with a static profile
                (ORT) and for every TensorRT artifact; ``True`` where it cannot work falls back to eager runs
                with one warning per engine naming the cause.

        Raises:
            ArtifactError: missing/altered files, an unsupported backend, an fp16 artifact on CPU, the CUDA
                provider unavailable, or engines inconsistent with the manifest.
            RuntimeInputError: unknown ``scheduler`` or ``device``.
        """
        from transformers import CLIPTokenizer

        from .ort_engine import OrtEngine

        root = Path(path)
        # even without hashes: schema, seal, paths, sizes, external data and links (never read outside the folder)
        manifest = load_verified(root, check_hashes=verify)
        backend = manifest.get("backend")
        if backend not in ("ort", "tensorrt"):
            raise ArtifactError(
                f"artifact {root} was compiled for backend={backend!r}; this runtime runs 'ort' and 'tensorrt' "
                "artifacts: recompile with --backend ort"
            )
        compiled_for = manifest.get("device", "cpu")
        device = device or compiled_for
        if device not in ("cpu", "cuda"):
            raise RuntimeInputError(f"device={device!r} is not supported; use 'cpu' or 'cuda'")
        if backend == "tensorrt" and device != "cuda":
            raise ArtifactError(
                f"artifact {root} was compiled for backend='tensorrt', whose engines run on CUDA only, but "
                f"device={device!r}; use device='cuda' on a GPU host, or recompile with --backend ort to run on the CPU"
            )
        if device == "cpu" and manifest.get("precision") == "fp16":
            raise ArtifactError(
                f"artifact {root} is fp16, which ONNX Runtime cannot run on CPU; use device='cuda' or recompile "
                "with --precision fp32 --device cpu"
            )
        if device != compiled_for:
            logger.warning(
                "artifact %s was compiled for %s but runs on %s: its graphs were optimised for %s "
                "(recompile with --device %s for best results)",
                root,
                compiled_for,
                device,
                compiled_for,
                device,
            )

        tok_dir = safe_join(root, str(manifest.get("tokenizer", "tokenizer")))
        try:
            tokenizer = CLIPTokenizer.from_pretrained(tok_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ArtifactError(f"cannot load the tokenizer from {tok_dir} ({e}); recompile the artifact") from e
        sched = manifest.get("scheduler", {})
        sched_path = safe_join(root, str(sched.get("config", "scheduler/scheduler_config.json")))
        try:
            scheduler_config = json.loads(sched_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ArtifactError(f"cannot read the scheduler config {sched_path} ({e}); recompile the artifact") from e

        stream: torch.cuda.Stream | None = None
        if device == "cuda" and torch.cuda.is_available():
            # one stream shared by ONNX Runtime and torch: the loop runs without host syncs
            stream = torch.cuda.Stream(device=torch.device("cuda", device_id))
        scale = int(manifest.get("model", {}).get("vae_scale_factor", 8))
        derived = {"H": ("h", scale), "W": ("w", scale)}
        if cuda_graph is None:
            cuda_graph = device == "cuda" and (
                backend == "tensorrt" or ShapeProfile.from_json(manifest["profile"]).is_static()
            )
        engines: dict[str, Engine]
        if backend == "tensorrt":
            engines = _trt_engines(root, manifest, device_id, stream, derived, cuda_graphs=bool(cuda_graph))
        else:
            engines = {}
            for name in TXT2IMG_COMPONENTS:
                entry = manifest["components"][name]
                if "onnx" not in entry:
                    raise ArtifactError(f"manifest component {name!r} has no 'onnx' path; recompile the artifact")
                engines[name] = OrtEngine(
                    safe_join(root, str(entry["onnx"])),
                    entry,
                    name=name,
                    device=device,
                    device_id=device_id,
                    stream=stream,
                    cudnn_conv_algo_search=cudnn_conv_algo_search,
                    io_binding=io_binding,
                    intra_op_num_threads=intra_op_num_threads,
                    provider_options={**cuda_layout_options(name, device), **(provider_options or {})},
                    derived=derived,
                    cuda_graph=cuda_graph,
                )
        pipe = cls(manifest, engines, tokenizer, scheduler_config, scheduler=scheduler, stream=stream, root=root)
        logger.info(
            "loaded %s (%s, %s, %s; profile %s; scheduler %s)",
            root,
            backend,
            manifest.get("precision"),
            device,
            manifest["profile"],
            pipe.scheduler_name,
        )
        return pipe

    # -- scheduler --------------------------------------------------------------------------------------

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
        """A fresh scheduler instance (schedulers are stateful: each call gets its own)."""
        t = self._scheduler_template
        return type(t).from_config(t.config)

    # -- lifecycle --------------------------------------------------------------------------------------

    def close(self) -> None:
        """Free every engine (idempotent)."""
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

    def __repr__(self) -> str:
        m = self.manifest
        return (
            f"EnginePipeline({str(self.root or '')!r}, backend={m.get('backend')}, precision={m.get('precision')}, "
            f"device={self.device}, scheduler={self.scheduler_name}, profile={m.get('profile')})"
        )

    # -- the call ---------------------------------------------------------------------------------------

    def __call__(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] | None = None,
        num_inference_steps: int = 50,
        guidance_scale: float = 7.5,
        generator: Generator = None,
        seed: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_images_per_prompt: int = 1,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        progress: bool = True,
        callback: StepCallback | None = None,
        eta: float = 0.0,
    ) -> EnginePipelineOutput:
        """Generate images from text, as ``diffusers.StableDiffusionPipeline.__call__``.

        Args:
            prompt: one prompt or a list of P prompts.
            negative_prompt: ``None`` (= ""), one string for every prompt, or P strings. Ignored when
                ``guidance_scale <= 1`` (no classifier-free guidance).
            num_inference_steps: scheduler steps, >= 1.
            guidance_scale: classifier-free guidance weight, >= 0; CFG runs (doubling the UNet batch) when > 1.
            generator: a ``torch.Generator`` or a list of B of them (as diffusers); excludes ``seed``.
            seed: seeds a CPU ``torch.Generator`` (same image on CPU and CUDA; same image as diffusers with
                ``generator=torch.Generator("cpu").manual_seed(seed)``). With neither ``seed`` nor
                ``generator``, a seed is drawn from torch's global RNG and reported in the output.
            height, width: image size in pixels, multiples of 8 inside the artifact's profile; default the
                model's size.
            num_images_per_prompt: N images per prompt; B = P x N >= the profile's min batch; above its max
                batch the request runs in engine-sized chunks (same images as one call for deterministic
                schedulers; see :mod:`~diffusion_trt.runtime.batching` for seeds).
            latents: initial noise [B, 4, height/8, width/8] (any float dtype, any device), instead of drawing it.
            output_type: "pil", "np", "pt" or "latent" (see :class:`EnginePipelineOutput`).
            progress: show a tqdm bar over the steps.
            callback: ``callback(step_index, timestep, latents)`` after each scheduler step (timestep: 0-d CPU
                tensor; latents of the running chunk on the device; once per step of every chunk).
            eta: DDIM's eta (ignored by other schedulers), >= 0.

        Returns:
            :class:`EnginePipelineOutput` with ``images``, ``seed`` and ``parameters``.

        Raises:
            RuntimeInputError: any argument the engines cannot honour; the message names the value and the fix.
            RuntimeError: the pipeline was closed.
        """
        if self._closed:
            raise RuntimeError("EnginePipeline is closed; load it again with EnginePipeline.from_artifacts")
        prompts = _prompt_list("prompt", prompt)
        negatives = _negative_list(negative_prompt, len(prompts))
        steps = _positive_int("num_inference_steps", num_inference_steps, "use e.g. 30 or 50")
        n_per = _positive_int("num_images_per_prompt", num_images_per_prompt, "use 1 or more")
        guidance = _non_negative_float("guidance_scale", guidance_scale, "use e.g. 7.5 (values <= 1 disable CFG)")
        eta = _non_negative_float("eta", eta, "use 0.0 (deterministic DDIM) .. 1.0")
        height = self.default_height if height is None else height
        width = self.default_width if width is None else width
        for name, value, rng in (("height", height, self.profile.height), ("width", width, self.profile.width)):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise RuntimeInputError(f"{name}={value!r} must be an integer number of pixels")
            check_image_size(name, int(value), rng.min, rng.max)
        height, width = int(height), int(width)
        batch = len(prompts) * n_per
        b = self.profile.batch
        if batch < b.min:
            what = f"batch = {len(prompts)} prompt(s) x num_images_per_prompt={n_per} = {batch}"
            raise RuntimeInputError(
                f"{what} is below the engine profile's min batch {b.min} (profile {b.min}..{b.max}); "
                f"ask for more images or recompile with --min-batch-size {batch}"
            )
        # above the profile's max batch: engine-sized chunks, in order (see runtime/batching.py for seeds)
        chunks = plan_chunks(batch, b.min, b.max)
        if output_type not in OUTPUT_TYPES:
            raise RuntimeInputError(f"output_type={output_type!r} is unknown; use one of {', '.join(OUTPUT_TYPES)}")
        generator, seed = self._generator(generator, seed, batch)
        shape = (batch, self.num_channels_latents, height // self.vae_scale_factor, width // self.vae_scale_factor)
        if latents is not None:
            if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
                raise RuntimeInputError(f"latents must be a float torch.Tensor of shape {shape}, got {type(latents)}")
            if tuple(latents.shape) != shape:
                raise RuntimeInputError(
                    f"latents have shape {tuple(latents.shape)}; for batch {batch} at {height}x{width} they must be "
                    f"{shape} (batch, channels, height/{self.vae_scale_factor}, width/{self.vae_scale_factor})"
                )

        stream = self._stream
        caller = torch.cuda.current_stream(self.device) if stream is not None else None
        if stream is not None:
            stream.wait_stream(caller)  # inputs the caller enqueued (latents, generator state) come first
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            result = denoise.text_to_image(
                text_encoder=self.engines["text_encoder"],
                unet=self.engines["unet"],
                vae_decoder=None if output_type == "latent" else self.engines["vae_decoder"],
                tokenizer=self.tokenizer,
                scheduler=self.scheduler,
                prompts=prompts,
                negative_prompts=negatives,
                num_images_per_prompt=n_per,
                height=height,
                width=width,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=generator,
                latents=latents,
                eta=eta,
                num_channels_latents=self.num_channels_latents,
                vae_scale_factor=self.vae_scale_factor,
                vae_scaling_factor=self.vae_scaling_factor,
                output_type=output_type,
                chunks=chunks,
                embedding_cache=self.embedding_cache,
                host_buffers=self._host_buffers,
                copy_stream=self._copy_stream,
                progress=progress,
                callback=callback,
            )
            images = result
        if caller is not None and stream is not None and isinstance(images, torch.Tensor):
            # the caller uses the tensor on its own stream: order it after ours, and tell the allocator
            caller.wait_stream(stream)
            images.record_stream(caller)

        parameters = {
            "prompt": prompt if isinstance(prompt, str) else list(prompts),
            "negative_prompt": negative_prompt
            if negative_prompt is None or isinstance(negative_prompt, str)
            else list(negatives),
            "num_inference_steps": steps,
            "guidance_scale": guidance,
            "scheduler": self.scheduler_name,
            "seed": seed,
            "height": height,
            "width": width,
            "num_images_per_prompt": n_per,
            "eta": eta,
            "backend": self.manifest.get("backend"),
            "precision": self.manifest.get("precision"),
            "device": str(self.device),
        }
        return EnginePipelineOutput(images=images, seed=seed, parameters=parameters)

    def _generator(self, generator: Generator, seed: int | None, batch: int) -> tuple[Generator, int | None]:
        if generator is not None and seed is not None:
            raise RuntimeInputError("pass either seed= or generator=, not both")
        if generator is not None:
            gens = generator if isinstance(generator, list) else [generator]
            if not all(isinstance(g, torch.Generator) for g in gens):
                raise RuntimeInputError(f"generator must be a torch.Generator or a list of them, got {generator!r}")
            if isinstance(generator, list) and len(generator) not in (1, batch):
                raise RuntimeInputError(
                    f"generator is a list of {len(generator)} but the batch is {batch} images; pass one generator "
                    f"or {batch}"
                )
            return generator, None
        if seed is None:
            seed = int(torch.randint(0, _MAX_SEED, (1,)).item())
        elif isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed <= _MAX_SEED:
            raise RuntimeInputError(f"seed={seed!r} must be an integer in 0..{_MAX_SEED}")
        return torch.Generator(device="cpu").manual_seed(int(seed)), int(seed)


def _trt_engines(
    root: Path,
    manifest: Mapping[str, Any],
    device_id: int,
    stream: torch.cuda.Stream | None,
    derived: Mapping[str, tuple[str, int]],
    cuda_graphs: bool = True,
) -> dict[str, Engine]:
    """The TensorRT engines of a verified artifact, sharing one activation allocation (they run in sequence)."""
    from .trt_engine import SharedActivationMemory, TrtEngine

    shared = SharedActivationMemory(torch.device("cuda", device_id))
    engines: dict[str, Engine] = {}
    for name in TXT2IMG_COMPONENTS:
        entry = manifest["components"][name]
        if "plan" not in entry:
            raise ArtifactError(f"manifest component {name!r} has no 'plan' path; recompile the artifact")
        engines[name] = TrtEngine(
            safe_join(root, str(entry["plan"])),
            entry,
            name=name,
            device_id=device_id,
            stream=stream,
            shared_memory=shared,
            verify=False,  # from_artifacts hashed every file already (or was told not to)
            derived=derived,
            cuda_graphs=cuda_graphs,
        )
    return engines


def _prompt_list(name: str, prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    raise RuntimeInputError(f"{name}={prompt!r} must be a string or a non-empty list of strings")


def _negative_list(negative: Any, n: int) -> list[str]:
    if negative is None:
        return [""] * n
    if isinstance(negative, str):
        return [negative] * n
    negatives = _prompt_list("negative_prompt", negative)
    if len(negatives) != n:
        raise RuntimeInputError(
            f"negative_prompt has {len(negatives)} entries but prompt has {n}; pass one string for all prompts "
            f"or {n} strings"
        )
    return negatives


def _positive_int(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise RuntimeInputError(f"{name}={value!r} must be an integer >= 1; {fix}")
    return int(value)


def _non_negative_float(name: str, value: Any, fix: str) -> float:
    number = not isinstance(value, bool) and isinstance(value, int | float | np.number)
    if not number or not math.isfinite(value) or value < 0:
        raise RuntimeInputError(f"{name}={value!r} must be a finite number >= 0; {fix}")
    return float(value)

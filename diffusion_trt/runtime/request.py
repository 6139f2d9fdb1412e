"""A generation request checked once, into a frozen :class:`Request` the loop takes (diffusers' ``check_inputs``).

::

    request = Request.build(spec, engines, prompt="a fox", num_inference_steps=30, seed=1)  # every check, here
    images = denoise.generate(request, loop_engines, scheduler)                             # nothing checked there

:class:`RequestSpec` is what an artifact allows (its shape profile, its :class:`LatentGeometry`, its
architecture); :meth:`Request.build` refuses, with the value and the fix, every argument the engines cannot honour,
in the order :meth:`~.pipeline.EnginePipeline.__call__` documents, and picks the request's
:class:`~.conditioning.Conditioning`: text-to-image, image-to-image, inpainting or SDXL.

Shapes: P prompts, N images per prompt, B = P x N images; latents [B, C, H / f, W / f] with f the geometry's
``scale_factor`` (8 for SD's VAE).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..artifact.manifest import Manifest
from ..config import ShapeProfile
from ..errors import ArtifactError, RuntimeInputError, names_parameters
from .batching import plan_chunks
from .conditioning import Conditioning, TextToImage
from .engines.engine import Engine, EngineSpec
from .finite import check_finite
from .generation_args import GENERATION_ARGS, MAX_SEED, check_arg, default_guidance_scale
from .geometry import LatentGeometry
from .latents import Generator, StepCallback, StepEnd
from .memory.host_memory import check_host_memory
from .prompt_syntax import SYNTAXES, overweight, overweight_problem, parse_prompt
from .schedulers import check_step_count

OUTPUT_TYPES: tuple[str, ...] = ("pil", "np", "pt", "latent")
_MAX_SEED = MAX_SEED


@dataclass(frozen=True)
class RequestSpec:
    """What an artifact allows a request: read from its manifest once, when the pipeline opens.

    Attributes:
        profile: the engines' shape profile (batch, height, width ranges).
        geometry: pixels <-> latents.
        architecture: "sd" (SD 1.x/2.x) or "sdxl".
        force_zeros_for_empty_prompt: SDXL: ``negative_prompt=None`` gives zero negative embeddings.
        latent_dtype: the UNet's ``sample`` dtype, the latents' (what the host-memory check counts when no UNet
            engine is at hand); ``None`` = float32.
        unet_batch: (min, max) rows of the UNet's ``sample`` (its ``B2``: 2 per image with CFG, 1 without); ``None``
            = not checked (the engine's own check refuses it when it runs).
    """

    profile: ShapeProfile
    geometry: LatentGeometry
    architecture: str = "sd"
    force_zeros_for_empty_prompt: bool = True
    latent_dtype: torch.dtype | None = None
    unet_batch: tuple[int, int] | None = None

    @classmethod
    def from_manifest(cls, manifest: Manifest, unet_in_channels: int | None = None) -> RequestSpec:
        """What the artifact of ``manifest`` allows, read from it alone: no engine needs to be open, so a call can be
        checked before anything loads (the CLI's ``run``). ``unet_in_channels``: the UNet engine's, when the
        manifest's model entry lacks them (else its ``sample`` entry's).

        Raises:
            ArtifactError: a malformed profile or UNet entry.
        """
        model = manifest.model
        unet = manifest.component("unet")
        sample = EngineSpec.from_manifest("unet", unet.spec).input("sample") if unet is not None else None
        if unet_in_channels is None and sample is not None and isinstance(sample.shape[1], int):
            unet_in_channels = sample.shape[1]
        return cls(manifest_profile(manifest), LatentGeometry.from_manifest(manifest, unet_in_channels),
                   model.architecture, model.force_zeros_for_empty_prompt,
                   None if sample is None else sample.torch_dtype,
                   None if sample is None else (sample.min[0], sample.max[0]))

    @property
    def default_size(self) -> tuple[int, int]:
        """(height, width) of a call without them: the profile's opt size, the one the engines were tuned for."""
        return int(self.profile.height.opt), int(self.profile.width.opt)

    @property
    def default_guidance_scale(self) -> float:
        """diffusers' default of the artifact's pipeline class: 7.5 (SD 1.x/2.x), 5.0 (SDXL)
        (:data:`~.generation_args.GENERATION_ARGS`)."""
        return default_guidance_scale(self.architecture)


@dataclass(frozen=True)
class Request:
    """One checked call of :meth:`~.pipeline.EnginePipeline.__call__` (built by :meth:`build`).

    Attributes:
        prompts, negative_prompts: P texts each (the negatives are "" where none was given).
        num_images_per_prompt: N.
        num_inference_steps: scheduler steps of the full schedule (image-to-image runs the last ones).
        guidance_scale: CFG weight; > 1 runs classifier-free guidance.
        eta: DDIM's eta.
        height, width: output size in pixels.
        latent_shape: [B, C, h, w].
        generator: a CPU generator seeded with ``seed``, or the caller's generator(s).
        seed: the seed; ``None`` when a generator was passed.
        latents: the caller's initial noise [B, C, h, w], or ``None``.
        output_type: one of :data:`OUTPUT_TYPES`.
        chunks: the image ranges run one after another (engine-sized).
        conditioning: what the mode adds to the loop (:class:`~.conditioning.Conditioning`).
        progress, callback: a tqdm bar over the steps; the per-step callback.
        given: the arguments as given (prompt, negative_prompt, SDXL extras, a clip skip, a plain prompt syntax), for
            the output's parameters.
        prompt_syntax: how prompts are read: "a1111" (weights, ``BREAK``; :mod:`.prompt_syntax`) or "plain".
        prompt_embeds, negative_prompt_embeds: the caller's text embeddings [P, 77 k, D] (then ``prompts`` are P
            empty placeholders), or ``None``.
        pooled_prompt_embeds, negative_pooled_prompt_embeds: SDXL: the caller's pooled ``text_embeds`` [P, E] with
            ``prompt_embeds`` / ``negative_prompt_embeds`` (diffusers' ``pooled_prompt_embeds``), or ``None``.
        clip_skip: 0 (the last layer) or diffusers' ``clip_skip`` (:class:`~.prompt_encoding.PromptReader`).
        guidance_rescale: diffusers' ``guidance_rescale`` (0 = off): the CFG prediction rescaled towards the text
            prediction's std (:func:`~.denoise.rescale_noise_cfg`); only with CFG.
        step_end: diffusers' ``callback_on_step_end``, checked (:class:`~.latents.StepEnd`), or ``None``.
        schedule: diffusers' custom ``timesteps`` / ``sigmas`` as ``("timesteps", values)`` / ``("sigmas", values)``
            (then ``num_inference_steps`` is their count), or ``None`` (the scheduler's own spacing).
    """

    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...]
    num_images_per_prompt: int
    num_inference_steps: int
    guidance_scale: float
    eta: float
    height: int
    width: int
    latent_shape: tuple[int, int, int, int]
    generator: Generator
    seed: int | None
    latents: torch.Tensor | None
    output_type: str
    chunks: tuple[range, ...]
    conditioning: Conditioning
    progress: bool = True
    callback: StepCallback | None = None
    given: Mapping[str, Any] = field(default_factory=dict)
    prompt_syntax: str = "a1111"
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    clip_skip: int = 0
    pooled_prompt_embeds: torch.Tensor | None = None
    negative_pooled_prompt_embeds: torch.Tensor | None = None
    guidance_rescale: float = 0.0
    step_end: StepEnd | None = None
    schedule: tuple[str, tuple[float, ...]] | None = None

    @property
    def batch(self) -> int:
        """B = P x N images."""
        return len(self.prompts) * self.num_images_per_prompt

    @property
    def do_cfg(self) -> bool:
        """Classifier-free guidance runs (``guidance_scale > 1``): the UNet batch is ``[negative; positive]``."""
        return self.guidance_scale > 1.0

    @classmethod
    @names_parameters
    def build(
        cls,
        spec: RequestSpec,
        engines: Mapping[str, Engine],
        prompt: Any,
        negative_prompt: Any = None,
        num_inference_steps: Any = GENERATION_ARGS["num_inference_steps"].default,
        guidance_scale: Any = None,
        generator: Generator = None,
        seed: Any = None,
        height: Any = None,
        width: Any = None,
        num_images_per_prompt: Any = GENERATION_ARGS["num_images_per_prompt"].default,
        latents: Any = None,
        output_type: str = "pil",
        progress: bool = True,
        callback: StepCallback | None = None,
        eta: Any = GENERATION_ARGS["eta"].default,
        image: Any = None,
        strength: Any = None,
        mask_image: Any = None,
        tokenizer_2: Any = None,
        embeddings_2: Any = None,
        prompt_syntax: Any = "a1111",
        prompt_embeds: Any = None,
        negative_prompt_embeds: Any = None,
        pooled_prompt_embeds: Any = None,
        negative_pooled_prompt_embeds: Any = None,
        clip_skip: Any = None,
        guidance_rescale: Any = GENERATION_ARGS["guidance_rescale"].default,
        callback_on_step_end: StepEnd | Any = None,
        timesteps: Any = None,
        sigmas: Any = None,
        **sdxl: Any,
    ) -> Request:
        """Check every argument of :meth:`~.pipeline.EnginePipeline.__call__` (same names, same meaning).

        Args:
            spec: what the artifact allows.
            engines: the pipeline's engines by component (``vae_encoder`` for images, ``text_encoder_2`` for
                SDXL; they may still be unopened).
            tokenizer_2: SDXL's second tokenizer.
            embeddings_2: SDXL: the loaded textual-inversion vectors for ``text_encoder_2``
                (:class:`~.embeddings.EmbeddingTable`), or ``None``.
            prompt_syntax: "a1111" or "plain" (:data:`~.prompt_syntax.SYNTAXES`).
            callback_on_step_end: diffusers' callback, checked with its pipeline (:meth:`~.latents.StepEnd.build`);
                a plain callable is checked here and called with ``pipe=None``.
            timesteps, sigmas: diffusers' custom schedule (:func:`check_schedule`); ``num_inference_steps`` is then
                their count, as diffusers' ``retrieve_timesteps``.
            sdxl: the SDXL arguments (:data:`SDXL_ARGUMENTS`), ``None`` / (0, 0) when not given.

        Raises:
            RuntimeInputError: the first argument the engines cannot honour; the message names the value and the fix.
                A batch whose latents and output images need more host memory than is available is refused here
                (:func:`~.memory.host_memory.check_host_memory`), before anything is drawn.
        """
        skip = _check_clip_skip(spec, engines, clip_skip)
        embeds = _check_prompt_embeds(spec, engines, prompt, negative_prompt, prompt_embeds, negative_prompt_embeds)
        pooled = _check_pooled(spec, engines, embeds, negative_prompt_embeds, pooled_prompt_embeds,
                               negative_pooled_prompt_embeds)
        if spec.architecture == "sdxl":  # (SD artifacts refuse prompt_2 itself, below)
            _check_texts_beside_embeds(sdxl, prompt_embeds, negative_prompt_embeds)
        prompts = prompt_list("prompt", prompt) if embeds is None else [""] * embeds.shape[0]
        if prompt_syntax not in SYNTAXES:
            raise RuntimeInputError(f"prompt_syntax={prompt_syntax!r} is unknown; use one of {', '.join(SYNTAXES)}")
        negatives = negative_list(negative_prompt, len(prompts))
        check_prompt_weights("prompt", prompts, prompt_syntax)
        check_prompt_weights("negative_prompt", negative_prompt, prompt_syntax)
        schedule = check_schedule(timesteps, sigmas)
        steps = check_arg("num_inference_steps", num_inference_steps if schedule is None else len(schedule[1]))
        n_per = check_arg("num_images_per_prompt", num_images_per_prompt)
        if guidance_scale is None:
            guidance_scale = spec.default_guidance_scale
        guidance = check_arg("guidance_scale", guidance_scale)
        eta = check_arg("eta", eta)
        rescale = check_arg("guidance_rescale", guidance_rescale)
        if not isinstance(callback_on_step_end, StepEnd):
            callback_on_step_end = StepEnd.build(None, callback_on_step_end, ("latents",))
        sdxl_given = _sdxl_given(spec, sdxl, image is not None or mask_image is not None)
        for name in ("prompt_2", "negative_prompt_2"):
            check_prompt_weights(name, sdxl.get(name), prompt_syntax)
        batch = len(prompts) * n_per
        conditioning: Conditioning = TextToImage()
        if image is not None or mask_image is not None:
            conditioning = _image_conditioning(spec, engines, image, mask_image, strength, latents, steps, batch,
                                               height, width)
            height, width = conditioning.height, conditioning.width  # type: ignore[attr-defined]
        else:
            _check_text_to_image(spec, strength)
        default_h, default_w = spec.default_size
        height, width = spec.geometry.check_size(default_h if height is None else height,
                                                 default_w if width is None else width, spec.profile)
        if output_type not in OUTPUT_TYPES:
            raise RuntimeInputError(f"output_type={output_type!r} is unknown; use one of {', '.join(OUTPUT_TYPES)}")
        shape, chunks = _check_batch(spec, len(prompts), n_per, height, width, guidance, output_type,
                                     _latent_dtype(spec, engines))
        if callback is not None and not callable(callback):
            raise RuntimeInputError(f"callback={callback!r} is not callable; pass a function (step, timestep, "
                                    "latents) or None")
        if not isinstance(progress, bool):  # "no" would show the bar: any non-empty string is true
            raise RuntimeInputError(f"progress={progress!r} must be True or False")
        generator, seed = check_generator(generator, seed, batch)
        _check_latents(latents, shape, height, width, spec.geometry.scale_factor)
        if spec.architecture == "sdxl":
            from .sdxl import sdxl_conditioning

            conditioning = sdxl_conditioning(
                prompts, negatives, negative_prompt, height, width, engines["text_encoder_2"], tokenizer_2,
                zero_negative=negative_prompt is None and spec.force_zeros_for_empty_prompt,
                embeddings_2=embeddings_2, **_second_texts(sdxl, len(prompts)))
        given = {"prompt": prompt if isinstance(prompt, str) or embeds is not None else list(prompts),
                 "negative_prompt": negative_prompt if negative_prompt is None or isinstance(negative_prompt, str)
                 else list(negatives),
                 **{k: v if isinstance(v, str) else list(v) for k, v in sdxl_given.items()},
                 **({"clip_skip": skip} if skip else {}),
                 **({"guidance_rescale": rescale} if rescale else {}),
                 **({schedule[0]: list(schedule[1])} if schedule else {}),
                 **({"prompt_syntax": prompt_syntax} if prompt_syntax != "a1111" else {})}
        return cls(tuple(prompts), tuple(negatives), n_per, steps, guidance, eta, height, width, shape, generator,
                   seed, latents, output_type, chunks, conditioning, progress, callback, given, prompt_syntax,
                   embeds, negative_prompt_embeds, skip, *pooled, rescale, callback_on_step_end, schedule)


def check_schedule(timesteps: Any, sigmas: Any) -> tuple[str, tuple[float, ...]] | None:
    """diffusers' custom schedule as ``(name, values)``: ``timesteps`` (integers >= 0) or ``sigmas`` (finite numbers
    >= 0), a non-empty list or tuple; ``None`` when neither is given. Whether the scheduler takes it, and values it
    refuses (an order, a bound), are checked when the schedule is set (:func:`~.denoise.set_schedule`).

    Raises:
        RuntimeInputError: both given (as diffusers), or not such a list.
    """
    if timesteps is not None and sigmas is not None:
        raise RuntimeInputError("pass either timesteps= or sigmas=, not both (as diffusers)")
    if timesteps is None and sigmas is None:
        return None
    name, values = ("timesteps", timesteps) if timesteps is not None else ("sigmas", sigmas)
    whole = name == "timesteps"
    kinds = (int, np.integer) if whole else (int, float, np.integer, np.floating)
    fine = isinstance(values, list | tuple) and values and all(
        isinstance(v, kinds) and not isinstance(v, bool) and np.isfinite(v) and v >= 0 for v in values)
    if not fine:
        what = "integers >= 0, e.g. [999, 749, 499, 249]" if whole else "finite numbers >= 0, e.g. [14.6, 3.0, 0.9]"
        raise RuntimeInputError(f"{name}={values!r} must be a non-empty list of {what} (diffusers' custom schedule)")
    return name, tuple(int(v) if whole else float(v) for v in values)


#: Keywords of diffusers' SD / SDXL pipelines that compiled engines cannot honour: name -> (the values that ask for
#: nothing, why not and what to do instead). :func:`check_diffusers_only` refuses any other value by name.
DIFFUSERS_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "cross_attention_kwargs": ((None, {}), "the attention processors are compiled into the engines; for a LoRA scale "
                               "(cross_attention_kwargs={'scale': s}) use load_lora(FILE, s) on a --refittable "
                               "artifact or compile --lora FILE:s"),
    "ip_adapter_image": ((None,), "IP-Adapters are not compiled into artifacts; leave it out"),
    "ip_adapter_image_embeds": ((None,), "IP-Adapters are not compiled into artifacts; leave it out"),
    "denoising_end": ((None, 1, 1.0), "SDXL's base+refiner hand-over is not supported; run the whole schedule "
                      "(leave it out), with output_type='latent' to hand the latents on"),
    "masked_image_latents": ((None,), "pass mask_image= and image= instead"),
    "padding_mask_crop": ((None,), "crop the image and mask yourself before the call (images are never resized here)"),
    "callback_steps": ((None, 1), "callback= runs after every scheduler step here; skip steps inside it, or use "
                       "callback_on_step_end="),
}


def check_diffusers_only(kwargs: Mapping[str, Any], where: str = "EnginePipeline.__call__()") -> None:
    """Refuse, by name, a keyword of diffusers' pipelines that the engines cannot honour (:data:`DIFFUSERS_ONLY`)
    unless its value asks for nothing (``None``...); any other unknown keyword is Python's TypeError.

    Raises:
        TypeError: a keyword no diffusers pipeline of these kinds takes (a typo).
        RuntimeInputError: a :data:`DIFFUSERS_ONLY` keyword with a value that asks for something, naming why and the
            way to get it.
    """
    for name, value in kwargs.items():
        if name not in DIFFUSERS_ONLY:
            raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
        neutral, why = DIFFUSERS_ONLY[name]
        if not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
            raise RuntimeInputError(f"{name}={value!r} is a diffusers argument these engines cannot honour: {why}")


def manifest_profile(manifest: Manifest) -> ShapeProfile:
    """The manifest's shape profile.

    Raises:
        ArtifactError: a malformed profile.
    """
    try:
        return ShapeProfile.from_json(manifest.profile_json)
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(
            f"manifest profile {manifest.profile_json!r} is malformed ({e}); recompile the artifact"
        ) from e


#: Arguments of :meth:`~.pipeline.EnginePipeline.__call__` that only SDXL artifacts take (diffusers' SDXL arguments).
SDXL_ARGUMENTS: tuple[str, ...] = ("prompt_2", "negative_prompt_2", "original_size", "crops_coords_top_left",
                                   "target_size", "negative_original_size", "negative_crops_coords_top_left",
                                   "negative_target_size")


def _second_texts(sdxl: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The SDXL arguments with ``prompt_2`` and ``negative_prompt_2``, where given, as checked lists of ``n`` texts
    (:func:`per_prompt`; raises its :class:`RuntimeInputError`)."""
    texts = {k: per_prompt(k, sdxl[k], n) for k in ("prompt_2", "negative_prompt_2") if sdxl.get(k) is not None}
    return {**sdxl, **texts}


def _sdxl_given(spec: RequestSpec, sdxl: Mapping[str, Any], has_image: bool) -> dict[str, Any]:
    """The SDXL arguments given (a (0, 0) crop counts as not given), refused for SD artifacts and with images."""
    unknown = set(sdxl) - set(SDXL_ARGUMENTS)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(sorted(unknown))}")
    crops = ("crops_coords_top_left", "negative_crops_coords_top_left")
    given = {k: sdxl.get(k) for k in SDXL_ARGUMENTS}
    given = {k: v for k, v in given.items() if v is not None and not (k in crops and _zero_pair(v))}
    if spec.architecture != "sdxl" and given:
        raise RuntimeInputError(
            f"{', '.join(given)} apply to SDXL artifacts only; this one is model.architecture="
            f"{spec.architecture!r} (SD 1.x/2.x): leave them out"
        )
    if spec.architecture == "sdxl" and has_image:
        raise RuntimeInputError(
            "image= / mask_image= (image-to-image, inpainting) are not supported for SDXL artifacts yet; "
            "run text-to-image (no image=) or use an SD 1.x/2.x artifact"
        )
    return given


def _check_clip_skip(spec: RequestSpec, engines: Mapping[str, Engine], clip_skip: Any) -> int:
    """``clip_skip`` as an int the text encoder serves (``None`` = 0).

    Raises:
        RuntimeInputError: not an integer >= 0, more than the engine's ``clip_skip_states`` hold (SDXL: either
            encoder's), or an SDXL artifact compiled without them.
    """
    if clip_skip is None or (not isinstance(clip_skip, bool) and clip_skip == 0):
        return 0
    if isinstance(clip_skip, bool) or not isinstance(clip_skip, int | np.integer) or clip_skip < 0:
        raise RuntimeInputError(f"clip_skip={clip_skip!r} must be None or an integer >= 0 (1 = the penultimate "
                                "layer, A1111's 'Clip skip 2')")
    most = min(next((int(t.shape[1]) for t in engines[name].spec.outputs if t.name == "clip_skip_states"), 0)
               for name in _text_encoders(spec))
    if most == 0 and spec.architecture == "sdxl":
        raise RuntimeInputError("this SDXL artifact's text encoders give no clip-skip states (compiled before SDXL "
                                "clip skip, or with --max-clip-skip 0); recompile it (compile --max-clip-skip 2) to "
                                "use clip_skip, or leave it out")
    if clip_skip > most:
        raise RuntimeInputError(f"clip_skip={clip_skip} is more than this artifact's text encoder serves (up to "
                                f"{most}; compile --max-clip-skip, at most the encoder's layers less one); use "
                                f"0..{most}")
    return int(clip_skip)


def _text_encoders(spec: RequestSpec) -> tuple[str, ...]:
    """The text-encoder components of the artifact's architecture."""
    return ("text_encoder", "text_encoder_2") if spec.architecture == "sdxl" else ("text_encoder",)


def _check_prompt_embeds(spec: RequestSpec, engines: Mapping[str, Engine], prompt: Any, negative_prompt: Any,
                         prompt_embeds: Any, negative_prompt_embeds: Any) -> torch.Tensor | None:
    """``prompt_embeds`` checked as diffusers' ``check_inputs`` checks it (and against the UNet's context range);
    ``None`` when not given.

    Raises:
        RuntimeInputError: both or neither of prompt / prompt_embeds; both negative_prompt and
            negative_prompt_embeds; negative_prompt_embeds without prompt_embeds; not a float tensor [P, 77 k, D] the
            UNet takes, or one holding NaN/Inf; the two of different shapes.
    """
    if prompt is not None and prompt_embeds is not None:
        raise RuntimeInputError("pass either prompt= or prompt_embeds=, not both (as diffusers)")
    if prompt is None and prompt_embeds is None:
        raise RuntimeInputError("prompt=None: pass a string, a non-empty list of strings, or prompt_embeds=")
    if negative_prompt is not None and negative_prompt_embeds is not None:
        raise RuntimeInputError("pass either negative_prompt= or negative_prompt_embeds=, not both (as diffusers)")
    if prompt_embeds is None:
        if negative_prompt_embeds is not None:
            raise RuntimeInputError("negative_prompt_embeds= needs prompt_embeds= (their shapes must match); encode "
                                    "the prompt yourself too, or pass negative_prompt= as text")
        return None
    _check_embeds("prompt_embeds", prompt_embeds, engines["unet"].spec.input("encoder_hidden_states"))
    if negative_prompt_embeds is not None:
        _check_embeds("negative_prompt_embeds", negative_prompt_embeds,
                      engines["unet"].spec.input("encoder_hidden_states"))
        if negative_prompt_embeds.shape != prompt_embeds.shape:
            raise RuntimeInputError(
                f"negative_prompt_embeds has shape {tuple(negative_prompt_embeds.shape)} but prompt_embeds "
                f"{tuple(prompt_embeds.shape)}; they must match (as diffusers): pad the shorter to as many 77-token "
                "chunks")
    return prompt_embeds


def _check_pooled(spec: RequestSpec, engines: Mapping[str, Engine], embeds: torch.Tensor | None, negative: Any,
                  pooled: Any, negative_pooled: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """SDXL's ``pooled_prompt_embeds`` / ``negative_pooled_prompt_embeds``, checked as diffusers' ``check_inputs``
    (each required with its ``*prompt_embeds``) and against the UNet's ``text_embeds`` width.

    Raises:
        RuntimeInputError: given for an SD artifact or without their ``*prompt_embeds``; missing with them on
            SDXL; not a float tensor [P, E] with P the prompt embeddings' rows; holding NaN/Inf (:func:`check_finite`).
    """
    if spec.architecture != "sdxl":
        if pooled is not None or negative_pooled is not None:
            raise RuntimeInputError("pooled_prompt_embeds= / negative_pooled_prompt_embeds= apply to SDXL artifacts "
                                    f"only; this one is model.architecture={spec.architecture!r}")
        return None, None
    for name, value, owner in (("pooled_prompt_embeds", pooled, embeds),
                               ("negative_pooled_prompt_embeds", negative_pooled, negative)):
        if owner is None and value is not None:
            raise RuntimeInputError(f"{name}= needs {name.replace('pooled_', '')}=; pass both or neither")
        if owner is not None and value is None:
            raise RuntimeInputError(f"{name.replace('pooled_', '')}= needs {name}= too on SDXL (as diffusers: the "
                                    "pooled text_embeds of text_encoder_2)")
        if value is not None:
            width = int(engines["unet"].spec.input("text_embeds").shape[1])
            rows = int(embeds.shape[0])  # type: ignore[union-attr]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or tuple(value.shape) != (
                    rows, width):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise RuntimeInputError(f"{name} must be a float torch.Tensor [{rows}, {width}] (prompts, "
                                        f"text_embeds width); got {got}")
            check_finite(name, value)
    return pooled, negative_pooled


def _check_texts_beside_embeds(sdxl: Mapping[str, Any], prompt_embeds: Any, negative_prompt_embeds: Any) -> None:
    """SDXL's ``prompt_2`` / ``negative_prompt_2`` with the embeddings they would be encoded into: refused, as
    diffusers' ``check_inputs`` (the embeddings already hold both encoders' states; the text would be ignored).

    Raises:
        RuntimeInputError: naming both arguments.
    """
    for text, embeds, value in (("prompt_2", "prompt_embeds", prompt_embeds),
                                ("negative_prompt_2", "negative_prompt_embeds", negative_prompt_embeds)):
        if sdxl.get(text) is not None and value is not None:
            raise RuntimeInputError(f"pass either {text}= or {embeds}=, not both (as diffusers): {embeds} holds "
                                    f"both text encoders' states already, so {text} would be ignored")


def _check_embeds(name: str, value: Any, unet_context: Any) -> None:
    """A finite float tensor [P, 77 k, D] inside the UNet's ``encoder_hidden_states`` range (``unet_context``).

    Raises:
        RuntimeInputError: not a float tensor, another shape, or NaN/Inf values (:func:`check_finite`).
    """
    lo, hi, width = int(unet_context.min[1]), int(unet_context.max[1]), int(unet_context.shape[2])
    want = f"a float torch.Tensor [prompts, 77 * k, {width}] with 77 * k in {lo}..{hi}"
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise RuntimeInputError(f"{name} must be {want}; got {type(value).__name__}"
                                f"{'' if not isinstance(value, torch.Tensor) else ' of ' + str(value.dtype)}")
    shape = tuple(value.shape)
    if len(shape) != 3 or shape[0] < 1 or shape[2] != width or not lo <= shape[1] <= hi or shape[1] % lo:
        raise RuntimeInputError(f"{name} has shape {shape}; this artifact takes {want} (longer contexts: compile "
                                "with a larger --max-prompt-chunks)")
    check_finite(name, value)


def _image_conditioning(spec: RequestSpec, engines: Mapping[str, Engine], image: Any, mask_image: Any,
                        strength: Any, latents: Any, steps: int, batch: int, height: Any, width: Any) -> Conditioning:
    """Image-to-image / inpainting: the checked image (and mask) as the request's conditioning."""
    from .image_inputs import image_request

    if latents is not None:
        raise RuntimeInputError(
            "latents= is for text-to-image; with image= the initial latents come from the image and the seed"
        )
    return image_request(image, mask_image, strength, num_inference_steps=steps, batch=batch, height=height,
                         width=width, vae_encoder=engines.get("vae_encoder"), geometry=spec.geometry,
                         profile=spec.profile)


def _check_text_to_image(spec: RequestSpec, strength: Any) -> None:
    """Refuse what needs an image: ``strength``, an inpainting UNet."""
    if strength is not None:
        raise RuntimeInputError(
            f"strength={strength!r} needs image=: it is how much of the start image is re-noised"
        )
    if spec.geometry.unet_in_channels != spec.geometry.channels:
        raise RuntimeInputError(
            f"this artifact's UNet is an inpainting UNet ({spec.geometry.unet_in_channels} input channels: "
            "latents, mask, masked-image latents); pass image= and mask_image="
        )


def _chunks(spec: RequestSpec, prompts: int, n_per: int) -> tuple[range, ...]:
    """Engine-sized chunks of the request, in order (above the profile's max batch; see runtime/batching.py)."""
    batch = prompts * n_per
    b = spec.profile.batch
    if batch < b.min:
        what = f"batch = {prompts} prompt(s) x num_images_per_prompt={n_per} = {batch}"
        raise RuntimeInputError(
            f"{what} is below the engine profile's min batch {b.min} (profile {b.min}..{b.max}); "
            f"ask for more images or recompile with --min-batch-size {batch}"
        )
    return tuple(plan_chunks(batch, b.min, b.max))


_HOST = torch.device("cpu")


@dataclass(frozen=True)
class UnopenedEngine:
    """A component of the manifest that is not opened: what the request checks read of an engine (its name and
    I/O spec; the tensors they prepare stay on the host), so a call can be checked before the load."""

    name: str
    spec: EngineSpec
    device: torch.device = _HOST


def unopened_engines(manifest: Manifest) -> dict[str, UnopenedEngine]:
    """Every component of ``manifest`` as an :class:`UnopenedEngine` (for :func:`check_before_load`).

    Raises:
        ArtifactError: a malformed component entry.
    """
    return {name: UnopenedEngine(name, EngineSpec.from_manifest(name, c.spec))
            for name, c in manifest.components.items()}


@names_parameters
def check_before_load(spec: RequestSpec, prompt: Any, *, num_inference_steps: Any, guidance_scale: Any, seed: Any,
                      height: Any, width: Any, num_images_per_prompt: Any, negative_prompt: Any = None,
                      prompt_syntax: Any = "a1111", output_type: str = "pil",
                      image_given: bool = False, engines: Mapping[str, Any] | None = None, image: Any = None,
                      mask_image: Any = None, strength: Any = None, clip_skip: Any = None,
                      control: Mapping[str, Any] | None = None, scheduler: tuple[str, Mapping[str, Any]] | None = None
                      ) -> None:
    """The checks of :meth:`Request.build` that need no engine, against what the artifact allows (``spec``, e.g.
    :meth:`RequestSpec.from_manifest`): a caller runs them before loading (seconds to minutes) to refuse a call the
    loaded pipeline would refuse anyway. With ``image_given`` and no ``image`` the size is the image's: checked when
    it is read.

    Args:
        negative_prompt, prompt_syntax: with ``prompt``, the texts whose weights are checked
            (:func:`check_prompt_weights`; an unknown syntax is left to :meth:`Request.build`).
        engines: the manifest's components (:func:`unopened_engines`); with them ``clip_skip``, ``image`` /
            ``mask_image`` / ``strength`` and ``control`` (the ControlNet keywords of
            :func:`~.controlnet.control_plan`: ``control_image``, ``controlnet``, ``controlnet_conditioning_scale``,
            ``control_guidance_start``, ``control_guidance_end``, ``guess_mode``) are checked too.
        scheduler: (diffusers class name, config with its overrides) of the scheduler the call runs
            (:func:`~.schedulers.scheduler_for`): steps beyond its training timesteps are refused
            (:func:`~.schedulers.check_step_count`, what the loop's ``set_schedule`` refuses); ``None`` = not checked.

    Raises:
        RuntimeInputError: as :meth:`Request.build`, for the prompts' weights, steps (with ``scheduler``: at most its
            training timesteps), guidance, seed, the size (inside the profile, a
            multiple of the VAE factor), an inpainting UNet without an image, and the batch (host memory first, then
            the profile's batch range, then the UNet's rows with or without CFG); with ``engines``: the clip skip,
            the image, mask and strength, and the ControlNet arguments.
    """
    prompts = prompt_list("prompt", prompt)
    if prompt_syntax in SYNTAXES:
        check_prompt_weights("prompt", prompts, prompt_syntax)
        check_prompt_weights("negative_prompt", negative_prompt, prompt_syntax)
    steps = check_arg("num_inference_steps", num_inference_steps)
    if scheduler is not None:
        check_step_count(steps, *scheduler)
    n_per = check_arg("num_images_per_prompt", num_images_per_prompt)
    guidance = check_arg("guidance_scale", spec.default_guidance_scale if guidance_scale is None else guidance_scale)
    if seed is not None:
        check_arg("seed", seed)
    if engines is not None and all(e in engines for e in _text_encoders(spec)):
        _check_clip_skip(spec, engines, clip_skip)
    if engines is not None and (image is not None or mask_image is not None):
        _sdxl_given(spec, {}, has_image=True)
        conditioning = _image_conditioning(spec, engines, image, mask_image, strength, None, steps,
                                           len(prompts) * n_per, height, width)
        height, width = conditioning.height, conditioning.width  # type: ignore[attr-defined]
    elif image_given:
        return
    else:
        _check_text_to_image(spec, strength)
    default_h, default_w = spec.default_size
    height, width = spec.geometry.check_size(default_h if height is None else height,
                                             default_w if width is None else width, spec.profile)
    _check_batch(spec, len(prompts), n_per, height, width, guidance, output_type, _latent_dtype(spec, {}))
    if engines is not None and control:
        from .controlnet import control_plan

        control_plan(engines, height=height, width=width, prompts=len(prompts), **control)


def _check_batch(spec: RequestSpec, prompts: int, n_per: int, height: int, width: int, guidance: float,
                 output_type: str, latent_dtype: torch.dtype) -> tuple[tuple[int, int, int, int], tuple[range, ...]]:
    """(latent shape, chunks) of a batch of ``prompts`` x ``n_per`` images: refused first when its latents and images
    cannot fit in host memory (so a batch of 10**8 is refused before anything is planned for it), then when the
    profile's batch range or the UNet's rows cannot run it."""
    batch = prompts * n_per
    shape = spec.geometry.latent_shape(batch, height, width)
    check_host_memory(f"batch = {prompts} prompt(s) x num_images_per_prompt={n_per} = {batch} images",
                      shape, latent_dtype, height, width, output_type)
    chunks = _chunks(spec, prompts, n_per)
    _check_unet_batch(spec, chunks, guidance)
    return shape, chunks


def _check_unet_batch(spec: RequestSpec, chunks: Sequence[range], guidance: float) -> None:
    """Refuse chunks whose UNet rows (2 per image with CFG, 1 without) the UNet was not built for: a static profile's
    UNet takes the CFG batch only, so ``guidance_scale <= 1`` cannot run on it."""
    if spec.unet_batch is None:
        return
    lo, hi = spec.unet_batch
    cfg = guidance > 1.0
    for rows in sorted({(2 if cfg else 1) * len(c) for c in chunks}):
        if not lo <= rows <= hi:
            how = "with" if cfg else "without"
            raise RuntimeInputError(
                f"guidance_scale={guidance:g} runs the UNet {how} classifier-free guidance ({rows} rows for "
                f"{rows // (2 if cfg else 1)} image(s)), but this artifact's UNet takes {lo}..{hi} rows (a static "
                f"profile is built for the CFG batch only); use guidance_scale {'<= 1' if cfg else '> 1, e.g. 7.5'}"
                ", or recompile with a batch range (--min-batch-size/--max-batch-size)"
            )


def _latent_dtype(spec: RequestSpec, engines: Mapping[str, Engine]) -> torch.dtype:
    """The dtype the latents are drawn in: the UNet's ``sample`` input (the spec's, float32 without either)."""
    unet = engines.get("unet")
    if unet is not None:
        return unet.spec.input("sample").torch_dtype
    return spec.latent_dtype if spec.latent_dtype is not None else torch.float32


def _check_latents(latents: Any, shape: tuple[int, ...], height: int, width: int, f: int) -> None:
    """The caller's initial noise: ``None``, or a finite float tensor of ``shape``.

    Raises:
        RuntimeInputError: not a float tensor, another shape, or NaN/Inf values (:func:`check_finite`).
    """
    if latents is None:
        return
    if not isinstance(latents, torch.Tensor):
        raise RuntimeInputError(f"latents must be a float torch.Tensor of shape {shape}, got {type(latents).__name__}")
    if not latents.is_floating_point():
        raise RuntimeInputError(f"latents is a {latents.dtype} tensor; pass a float one of shape {shape} "
                                "(e.g. latents.float())")
    if tuple(latents.shape) != shape:
        raise RuntimeInputError(
            f"latents have shape {tuple(latents.shape)}; for batch {shape[0]} at {height}x{width} they must be "
            f"{shape} (batch, channels, height/{f}, width/{f})"
        )
    check_finite("latents", latents)


def check_prompt_weights(name: str, value: Any, syntax: str) -> None:
    """Refuse a text whose attention weights (A1111 syntax: nested brackets multiply) give a token a weight beyond
    ``±``:data:`~.prompt_syntax.MAX_WEIGHT` (why 100: :mod:`.prompt_syntax`), before any engine runs.

    Args:
        name: the argument (``prompt``, ``negative_prompt``...); value: its value, a text or a list of texts
            (anything else, ``None`` included, is left to the checks of its type).
        syntax: "a1111" or "plain" (nothing to check).

    Raises:
        RuntimeInputError: naming the argument (and the index in a list), the token, its weight and the fix.
    """
    texts = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            continue
        heavy = overweight(parse_prompt(text, syntax))
        if heavy is not None:
            where = f"{name}[{i}]" if len(texts) > 1 else name
            raise RuntimeInputError(f"{overweight_problem(where, heavy)}, or prompt_syntax='plain' to read brackets "
                                    "as text")


def check_generator(generator: Generator, seed: Any, batch: int) -> tuple[Generator, int | None]:
    """The request's generator and seed: the caller's generator(s), or a CPU generator seeded with ``seed`` (drawn
    from torch's global RNG when ``None``).

    Raises:
        RuntimeInputError: both given, a non-generator, a list that is neither 1 nor ``batch`` long, a bad seed.
    """
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
    else:
        seed = check_arg("seed", seed)
    return torch.Generator(device="cpu").manual_seed(int(seed)), int(seed)


def prompt_list(name: str, prompt: Any) -> list[str]:
    """``prompt`` as a list of checked texts: a string, or a non-empty list of strings.

    Raises:
        RuntimeInputError: anything else, or a text that is not valid UTF-8 (:func:`check_text`).
    """
    if isinstance(prompt, str):
        return [check_text(name, prompt)]
    if isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
        return [check_text(f"{name}[{i}]" if len(prompt) > 1 else name, p) for i, p in enumerate(prompt)]
    raise RuntimeInputError(f"{name}={prompt!r} must be a string or a non-empty list of strings")


def check_text(name: str, text: str) -> str:
    """``text`` if it is valid Unicode (encodable as UTF-8): what every prompt of :meth:`EnginePipeline.__call__` must
    be (the CLI checks its prompts with it before loading the engines).

    Raises:
        RuntimeInputError: a lone surrogate, e.g. ``"\\udcff"``: how Python passes on command-line bytes that are not
            UTF-8 (``-p $'\\xff'``); the tokenizer would fail on it with a TypeError.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end]
        raw = bytes(ord(c) - 0xDC00 for c in bad if 0xDC80 <= ord(c) <= 0xDCFF)
        what = f"the bytes {raw!r}" if len(raw) == len(bad) else f"{bad!r}"
        raise RuntimeInputError(
            f"{name} is not valid UTF-8 text: {what} at character {e.start}; pass the prompt as UTF-8 (e.g. re-encode "
            "it with iconv -t UTF-8)"
        ) from None
    return text


def _zero_pair(value: Any) -> bool:
    """``value`` is the default (0, 0) crop (any sequence type)."""
    return isinstance(value, Sequence) and not isinstance(value, str) and list(value) == [0, 0]


def per_prompt(name: str, value: Any, n: int) -> list[str]:
    """One string for each of ``n`` prompts: a string for all of them, or a list of ``n``."""
    if isinstance(value, str):
        return [check_text(name, value)] * n
    values = prompt_list(name, value)
    if len(values) != n:
        raise RuntimeInputError(
            f"{name} has {len(values)} entries but prompt has {n}; pass one string for all prompts or a list of {n}"
        )
    return values


def negative_list(negative: Any, n: int) -> list[str]:
    """The negative prompt of each of ``n`` prompts: "" for ``None``, one string for all, or a list of ``n``."""
    if negative is None:
        return [""] * n
    if isinstance(negative, str):
        return [check_text("negative_prompt", negative)] * n
    negatives = prompt_list("negative_prompt", negative)
    if len(negatives) != n:
        raise RuntimeInputError(
            f"negative_prompt has {len(negatives)} entries but prompt has {n}; pass one string for all prompts "
            f"or a list of {n}"
        )
    return negatives


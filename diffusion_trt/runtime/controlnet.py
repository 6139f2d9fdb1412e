"""ControlNets at run time: the checked request (:class:`ControlPlan`) and the residuals of each step.

An artifact compiled with ``--controlnet`` has ``unet_controlnet`` (the UNet with the residual inputs) and, per
ControlNet, ``cond_embed_<name>`` (control image -> its conditioning embedding) and ``controlnet_<name>`` (see
``compiler/controlnet.py``). A call with control images runs each ``cond_embed_<name>`` once per chunk of rows, then
the loop on ``unet_controlnet`` and, before each UNet step, every ControlNet whose factor is not 0 at that step on the
chunk's embedding, summing their residuals (diffusers' ``MultiControlNetModel``); calls without control images run
the plain ``unet``.

Artifacts compiled before the split have no ``cond_embed_<name>``: their ``controlnet_<name>`` takes the image
(input ``controlnet_cond``) and embeds it at every step, as before. Which kind a ControlNet is comes from its
engine's input names (``controlnet_cond`` or ``controlnet_cond_embedding``), per ControlNet (``add-controlnet`` into
an old artifact gives a new-style ControlNet beside old ones). A ``controlnet_<name>`` that takes the embedding
without its ``cond_embed_<name>`` in the artifact is an :class:`~diffusion_trt.errors.ArtifactError`
(:func:`check_control_components`, before any engine opens).

Step for step as diffusers' ``StableDiffusionControlNetPipeline.__call__`` (0.3x-0.4x):

* control image: ``VaeImageProcessor(do_convert_rgb=True, do_normalize=False).preprocess`` (float [n, 3, H, W] in
  [0, 1]), of the output size (never resized), one image for all B images or one per prompt (each repeated
  ``num_images_per_prompt`` times), doubled for classifier-free guidance (CFG) unless ``guess_mode``;
* ``keep[i] = 1 - (i / T < start or (i + 1) / T > end)`` per ControlNet (T steps), its factor
  ``scale * keep[i]``; a ControlNet at factor 0 is not run (its residuals would be exactly 0);
* ``guess_mode`` with CFG: the ControlNets see only the conditional half (``scheduler.scale_model_input(latents)``,
  the positive embeddings) and the unconditional rows get zero residuals; the residual factors ramp
  ``logspace(-1, 0, R) * factor`` (diffusers' ``ControlNetModel`` in guess mode).

Shapes: control image [B2, 3, H, W] and embedding [B2, C0, h, w] (C0 = the ControlNet's ``block_out_channels[0]``,
h = H / 8) in the engines' float dtype; residual ``i`` [B2, C_i, ceil(h / k_i), ceil(w / k_i)] in the UNet's.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..artifact.manifest import CONTROL_COND as COND
from ..artifact.manifest import CONTROL_EMBEDDING as EMBEDDING
from ..artifact.manifest import CONTROLNET_PREFIX as PREFIX
from ..artifact.manifest import EMBED_PREFIX, UNET_CONTROLNET, control_component_problems
from ..config import is_real_number
from ..errors import ArtifactError, RuntimeInputError
from ..lora import LoadedLoras
from .cuda import nvtx_range
from .engines.engine import Engine
from .finite import check_finite
from .float_range import finite_in_float32
from .image_inputs import check_control_image, image_rows_and_size

logger = logging.getLogger(__name__)

#: ``controlnet_conditioning_scale``'s default per mode, as diffusers' ControlNet pipelines (txt2img, Img2Img, Inpaint)
DEFAULT_CONTROL_SCALE: dict[str, float] = {"txt2img": 1.0, "img2img": 0.8, "inpaint": 0.5}


def controlnet_names(components: Sequence[str]) -> tuple[str, ...]:
    """The ControlNet names (``controlnet_<name>`` -> ``name``) among an artifact's components, in order."""
    return tuple(c[len(PREFIX):] for c in components if c.startswith(PREFIX))


def control_components(components: Sequence[str]) -> tuple[str, ...]:
    """The components a ControlNet call opens (``unet_controlnet``, every ``cond_embed_<name>`` and
    ``controlnet_<name>``) present in ``components``; none without ``unet_controlnet``."""
    if UNET_CONTROLNET not in components:
        return ()
    return (UNET_CONTROLNET, *(c for c in components if c.startswith((EMBED_PREFIX, PREFIX))))


def takes_embedding(input_names: Sequence[str]) -> bool:
    """Whether a ``controlnet_<name>`` of these inputs takes the conditioning embedding (``controlnet_cond_embedding``,
    compiled after the split) rather than the control image (``controlnet_cond``, before)."""
    return EMBEDDING in input_names


def check_control_components(inputs: Mapping[str, Sequence[str]]) -> None:
    """Refuse an artifact whose ``controlnet_<name>`` takes the embedding but which has no ``cond_embed_<name>``
    (:func:`~diffusion_trt.artifact.manifest.control_component_problems`, which ``verify`` reports too).

    Args:
        inputs: each component's input names, by component (the manifest's).

    Raises:
        ArtifactError: naming the ControlNet, the missing component and the fix.
    """
    problems = control_component_problems(inputs)
    if problems:
        raise ArtifactError(problems[0])


def check_lora_reaches_unet_controlnet(loaded: LoadedLoras | None) -> None:
    """Refuse a call with a control image while the run-time LoRA(s) ``loaded`` (what
    :meth:`EnginePipeline.load_lora` loaded, as one value for both backends) change the plain ``unet`` but not
    ``unet_controlnet``, the UNet such a call runs, so the image
    would be the base model's (plus the LoRA's text encoder part) with no word said. That is an ONNX Runtime artifact
    compiled with ``--refittable --controlnet`` before ``unet_controlnet`` took weight inputs (its manifest entry has
    no ``weight_inputs``, so :func:`~.lora_slots.load_slots` gives it none and no weight of it changes), or a
    TensorRT one (refit reaches ``unet`` and the text encoders only). Artifacts compiled since bind the LoRA in
    ``unet_controlnet`` too, and pass; so do a LoRA of the text encoder only, and one at scale 0.

    Raises:
        RuntimeInputError: naming the LoRA(s) and the fixes.
    """
    if loaded is None or not loaded.changed.get("unet") or loaded.changed.get(UNET_CONTROLNET):
        return
    raise RuntimeInputError(
        f"the LoRA {', '.join(loaded.files)} loaded at run time changes the UNet, but a call with a control image "
        f"runs {UNET_CONTROLNET}, whose weights this artifact keeps constant (an ONNX Runtime artifact compiled with "
        "--refittable --controlnet before unet_controlnet took the LoRA weights as inputs, or a TensorRT one): the "
        "image would not have the LoRA; recompile it with --refittable --controlnet (ONNX Runtime), merge the LoRA at "
        "compile time (compile MODEL --lora FILE:SCALE --controlnet ...), or unload it (unload_lora(), run without "
        "--lora) for ControlNet calls")


def _as_list(value: Any, n: int, what: str) -> list[Any]:
    """One value for every ControlNet, or a list of exactly ``n``."""
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise RuntimeInputError(f"{what} has {len(value)} values for {n} ControlNet(s); pass one value, or one "
                                    "per ControlNet")
        return list(value)
    return [value] * n


def _finite(value: Any, what: str, example: float) -> float:
    """``value`` as a float, refused unless a number :func:`~.float_range.finite_in_float32` (the scales multiply
    float32 and fp16 residuals on the device; the message suggests ``example``)."""
    if not is_real_number(value) or not finite_in_float32(float(value)):
        raise RuntimeInputError(f"{what}={value!r} is not a finite float32 number; pass e.g. {example}")
    return float(value)


@dataclass(frozen=True)
class ControlUnit:
    """One ControlNet of a call: its engine, control image [n, 3, H, W] (its dtype, device), factor and window.

    Attributes:
        embed: the ``cond_embed_<name>`` engine (the image -> ``controlnet_cond_embedding``, run once per chunk), or
            ``None`` for a ControlNet compiled before the split, whose ``engine`` takes the image ``controlnet_cond``.
    """

    name: str
    engine: Engine
    image: torch.Tensor
    scale: float
    start: float
    end: float
    embed: Engine | None = None

    def keep(self, i: int, steps: int) -> float:
        """diffusers' ``controlnet_keep[i]``: 0.0 outside [start, end] of the schedule, else 1.0."""
        return 1.0 - float(i / steps < self.start or (i + 1) / steps > self.end)


@dataclass(frozen=True)
class ControlPlan:
    """The checked ControlNet part of a call (:func:`control_plan`): the residual UNet, the units, guess mode.

    Attributes:
        unet: the ``unet_controlnet`` engine the loop runs instead of ``unet``.
        units: the ControlNets, in the order given.
        guess_mode: diffusers' guess mode (see the module docstring).
        residual_names: the UNet's residual inputs, down blocks then mid.
    """

    unet: Engine
    units: tuple[ControlUnit, ...]
    guess_mode: bool
    residual_names: tuple[str, ...]

    def warn_idle(self, steps: int) -> None:
        """Warn of each ControlNet whose guidance window holds none of the ``steps`` denoising steps (e.g. start 0.6,
        end 0.9 over 2 steps): it would run on no step, so the image is the one without it, which nothing said."""
        for u in self.units:
            if not any(u.keep(i, steps) for i in range(steps)):
                logger.warning("ControlNet %r acts on no step: its window control_guidance_start=%g .. "
                               "control_guidance_end=%g holds none of the %d steps the scheduler runs (step i counts "
                               "when i/%d >= start and (i+1)/%d <= end, as in diffusers); widen the window or run "
                               "more steps", u.name, u.start, u.end, steps, steps, steps)

    def rows(self, rows: range, batch: int, num_images_per_prompt: int, do_cfg: bool) -> ChunkControl:
        """The ControlNet conditioning of one chunk of rows (of ``batch`` images): each control image, doubled for
        CFG unless guess mode, and for a split ControlNet its embedding, computed here once for the chunk's steps.

        The embedding is a copy of the ``cond_embed_<name>`` output buffer, in the ControlNet's input dtype (the
        buffer's next run, for another unit of the same ControlNet or the next chunk, overwrites it while the steps
        still read the copy): [B2, C0, h, w], B2 = 2 x the chunk's images with CFG (not in guess mode), else 1 x."""
        conds: list[dict[str, torch.Tensor]] = []
        for u in self.units:
            img = u.image
            reps = batch if img.shape[0] == 1 else num_images_per_prompt
            img = img.repeat_interleave(reps, dim=0)[rows.start: rows.stop]
            img = torch.cat([img, img]) if do_cfg and not self.guess_mode else img
            if u.embed is None:  # compiled before the split: the ControlNet embeds the image at every step
                conds.append({COND: img})
                continue
            with nvtx_range(f"cond_embed {u.name}", u.embed.device):
                out = u.embed.run({COND: img})[EMBEDDING]
                conds.append({EMBEDDING: out.to(u.engine.spec.input(EMBEDDING).torch_dtype, copy=True)})
        return ChunkControl(self, tuple(conds), do_cfg)


@dataclass(frozen=True)
class ChunkControl:
    """A :class:`ControlPlan` for one chunk: per unit its conditioning feed (``{"controlnet_cond_embedding":
    [B2, C0, h, w]}``, or ``{"controlnet_cond": [B2, 3, H, W]}`` for a ControlNet compiled before the split; B2 = b in
    guess mode), and the residuals of each step."""

    plan: ControlPlan
    conds: tuple[Mapping[str, torch.Tensor], ...]
    do_cfg: bool
    #: ``conditioning_scale`` feeds by (factor, n, device), made once per chunk instead of once a step and ControlNet
    #: (an allocation and a fill kernel each); never written to, so the engines may keep reading them.
    _factor_feeds: dict[tuple[float, int, str], torch.Tensor] = field(default_factory=dict, compare=False,
                                                                       repr=False)

    def residuals(self, i: int, steps: int, latent_model_input: torch.Tensor, latents: torch.Tensor,
                  scheduler: Any, t: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                  added_inputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The UNet's residual inputs at step ``i`` of ``steps`` (fresh tensors or ControlNet output buffers,
        read by the UNet before the next step).

        Args:
            latent_model_input: the UNet's sample [B2, 4, h, w] (CFG-doubled, scheduler-scaled).
            latents: the chunk's latents [b, 4, h, w] (guess mode's ControlNet input).
            timestep: the UNet's float32 timestep feed [B2].
            prompt_embeds: [B2, 77, D].
            added_inputs: SDXL: the UNet's ``text_embeds`` [B2, E] and ``time_ids`` [B2, 6], which the ControlNets
                take too (diffusers' ``StableDiffusionXLControlNetPipeline``); ``None`` for SD 1.x/2.x.
        """
        guess = self.plan.guess_mode and self.do_cfg
        if guess:
            sample = scheduler.scale_model_input(latents, t) if hasattr(scheduler, "scale_model_input") else latents
            embeds, ts = prompt_embeds.chunk(2)[1], timestep[: latents.shape[0]]
            added = {k: v.chunk(2)[1] for k, v in (added_inputs or {}).items()}
        else:
            sample, embeds, ts = latent_model_input, prompt_embeds, timestep
            added = dict(added_inputs or {})
        total: list[torch.Tensor] | None = None
        names = self.plan.residual_names
        for unit, cond in zip(self.plan.units, self.conds, strict=True):
            factor = unit.scale * unit.keep(i, steps)
            if factor == 0.0:
                continue
            out = unit.engine.run({
                "sample": sample.to(unit.engine.spec.input("sample").torch_dtype), "timestep": ts,
                "encoder_hidden_states": embeds, **added, **cond,
                "conditioning_scale": self._factors(factor, len(names), sample.device),
            })
            res = [out[n] for n in names]
            if guess:
                res = [torch.cat([torch.zeros_like(r), r]) for r in res]
            total = res if total is None else [a + b for a, b in zip(total, res, strict=True)]
        if total is None:  # every ControlNet at factor 0: the residuals diffusers adds are exactly zero
            return self._zeros(latent_model_input)
        return dict(zip(names, total, strict=True))

    def _factors(self, factor: float, n: int, device: torch.device) -> torch.Tensor:
        """The per-residual factors [n] float32: ``factor``, or in guess mode ``logspace(-1, 0, n) * factor``; one
        tensor per factor for the chunk (read only)."""
        key = (factor, n, str(device))
        feed = self._factor_feeds.get(key)
        if feed is None:
            if self.plan.guess_mode:
                feed = torch.logspace(-1, 0, n, device=device) * factor
            else:
                feed = torch.full((n,), factor, dtype=torch.float32, device=device)
            self._factor_feeds[key] = feed
        return feed

    def _zeros(self, sample: torch.Tensor) -> dict[str, torch.Tensor]:
        spec = self.plan.unet.spec
        b, h, w = sample.shape[0], sample.shape[2], sample.shape[3]
        out = {}
        for n in self.plan.residual_names:
            info = spec.input(n)
            dims = [b if k == 0 else _dim(d, h, w) for k, d in enumerate(info.shape)]
            out[n] = torch.zeros(dims, dtype=info.torch_dtype, device=sample.device)
        return out


def _dim(d: int | str, h: int, w: int) -> int:
    if isinstance(d, int):
        return d
    base, _, k = d.partition("/")
    size = h if base == "h" else w
    return -(-size // int(k)) if k else size


def check_no_control_options(controlnet: Any, controlnet_conditioning_scale: Any, control_guidance_start: Any,
                             control_guidance_end: Any, guess_mode: Any) -> None:
    """Refuse ControlNet arguments of a call without ``control_image`` (they would be ignored: no ControlNet runs),
    as ``run`` refuses ``--guess-mode`` or ``--control-guidance-*`` without ``--controlnet``. Given means other than
    the defaults (``None``, ``None``, 0.0, 1.0, False).

    Raises:
        RuntimeInputError: naming the first such argument and the fix.
    """
    given = [name for name, value, default in (
        ("controlnet", controlnet, None), ("controlnet_conditioning_scale", controlnet_conditioning_scale, None),
        ("control_guidance_start", control_guidance_start, 0.0), ("control_guidance_end", control_guidance_end, 1.0),
        ("guess_mode", guess_mode, False)) if not (value is default or (default is not None and value == default))]
    if given:
        raise RuntimeInputError(f"{given[0]}= was given without control_image=, so no ControlNet would run and it "
                                "would be ignored; pass one control image per ControlNet, or drop it")


def control_plan(engines: Mapping[str, Engine], control_image: Any, controlnet: str | Sequence[str] | None,
                 controlnet_conditioning_scale: float | Sequence[float], control_guidance_start: Any,
                 control_guidance_end: Any, guess_mode: bool, height: int, width: int,
                 prompts: int) -> ControlPlan | None:
    """Check the ControlNet arguments of a call into a :class:`ControlPlan` (``None`` without control images).

    Args:
        engines: the pipeline's engines (``unet_controlnet`` and ``controlnet_<name>`` among them).
        control_image: one image, or a list of one image per ControlNet; each a PIL image, float numpy array
            [H, W, 3] or tensor [3, H, W] / [n, 3, H, W] in [0, 1] (n = 1 or the number of prompts), of the output size.
        controlnet: the ControlNet name(s) to use, in the order of the images; ``None`` = the artifact's only one.
        controlnet_conditioning_scale, control_guidance_start, control_guidance_end: one value or one per ControlNet
            (finite; 0 <= start < end <= 1).
        guess_mode: diffusers' guess mode.
        height, width: the output size in pixels; prompts: the number of prompts P.

    Raises:
        RuntimeInputError: an artifact without ControlNets, an unknown name, more control images than ControlNets,
            a control image of another size or batch, a non-finite scale, a bad guidance window.
        ArtifactError: a ControlNet that takes the embedding without its ``cond_embed_<name>`` engine; ControlNet
            components without ``unet_controlnet``, or a ``cond_embed_<name>`` without any ``controlnet_<name>``.
    """
    have = controlnet_names(list(engines))
    if control_image is None:
        return None
    parts = [n for n in engines if n.startswith((PREFIX, EMBED_PREFIX))]
    if parts and (UNET_CONTROLNET not in engines or not have):
        # compiled with --controlnet, but not whole (--components, a copy or a manifest that lost a component): the
        # artifact is at fault, not the call, and "compile it with --controlnet" would not be the fix
        lacks = UNET_CONTROLNET if UNET_CONTROLNET not in engines else PREFIX + parts[0][len(EMBED_PREFIX):]
        raise ArtifactError(f"the artifact has the ControlNet component(s) {', '.join(parts)} but no {lacks}, which "
                            "a call with a control image needs; it is incomplete (compiled with --components, or a "
                            "partial copy): recompile it with --controlnet and without --components")
    if not have or UNET_CONTROLNET not in engines:
        raise RuntimeInputError("this artifact has no ControlNet; compile it with --controlnet [NAME=]FOLDER")
    names = _names(controlnet, have)
    images = control_image if isinstance(control_image, list) and len(names) > 1 else [control_image]
    if len(images) != len(names):
        raise RuntimeInputError(f"{len(images)} control images for {len(names)} ControlNet(s) ({', '.join(names)}); "
                                "pass one control image per ControlNet")
    scales = [_finite(s, "controlnet_conditioning_scale", 1.0) for s in
              _as_list(controlnet_conditioning_scale, len(names), "controlnet_conditioning_scale")]
    starts = [_finite(s, "control_guidance_start", 0.0) for s in
              _as_list(control_guidance_start, len(names), "control_guidance_start")]
    ends = [_finite(s, "control_guidance_end", 1.0) for s in
            _as_list(control_guidance_end, len(names), "control_guidance_end")]
    for s, e in zip(starts, ends, strict=True):
        if not 0.0 <= s < e <= 1.0:
            raise RuntimeInputError(f"control_guidance_start={s} and control_guidance_end={e}: need 0 <= start < end "
                                    "<= 1")
    if not isinstance(guess_mode, bool):
        raise RuntimeInputError(f"guess_mode={guess_mode!r} must be True or False")
    units = tuple(_unit(engines[PREFIX + n], _embed_engine(engines, n), n, img, sc, s, e, height, width, prompts)
                  for n, img, sc, s, e in zip(names, images, scales, starts, ends, strict=True))
    unet = engines[UNET_CONTROLNET]
    residuals = tuple(t.name for t in unet.spec.inputs if "residual" in t.name)
    return ControlPlan(unet, units, guess_mode, residuals)


def _names(controlnet: str | Sequence[str] | None, have: Sequence[str]) -> list[str]:
    if controlnet is None:
        if len(have) > 1:
            raise RuntimeInputError(f"this artifact has {len(have)} ControlNets ({', '.join(have)}); name the one(s) "
                                    "to use with controlnet= (--controlnet NAME)")
        return list(have)
    if not (isinstance(controlnet, str) or (isinstance(controlnet, list | tuple)
                                            and all(isinstance(n, str) for n in controlnet))):
        raise RuntimeInputError(f"controlnet={controlnet!r} must be a ControlNet's name or a list of names (a str, "
                                f"or a list of str); this artifact has {', '.join(have) or 'none'}")
    names = [controlnet] if isinstance(controlnet, str) else list(controlnet)
    if not names:  # else "1 control images for 0 ControlNet(s) ()", whatever the images
        raise RuntimeInputError(f"controlnet={controlnet!r} names no ControlNet; name the one(s) to use, of "
                                f"{', '.join(have)}")
    unknown = [n for n in names if n not in have]
    if unknown:
        raise RuntimeInputError(f"ControlNet {unknown[0]!r} is not in this artifact; it has {', '.join(have)}")
    return names


def _embed_engine(engines: Mapping[str, Engine], name: str) -> Engine | None:
    """``cond_embed_<name>`` for a ControlNet that takes the embedding; ``None`` for one that takes the image.

    Raises:
        ArtifactError: the ControlNet takes the embedding and there is no ``cond_embed_<name>`` engine.
    """
    engine = engines[PREFIX + name]
    if not takes_embedding(engine.spec.input_names):
        return None
    check_control_components({n: e.spec.input_names for n, e in engines.items()
                              if n in (PREFIX + name, EMBED_PREFIX + name)})
    return engines[EMBED_PREFIX + name]


def _unit(engine: Engine, embed: Engine | None, name: str, image: Any, scale: float, start: float, end: float,
          height: int, width: int, prompts: int) -> ControlUnit:
    """One checked ControlNet: its image preprocessed as diffusers' control image processor does, in the dtype and
    on the device of the engine that takes it (``embed``, else ``engine``).

    Raises:
        RuntimeInputError: the image is not the output's size, there are neither 1 nor ``prompts`` of them, it
            holds NaN/Inf or values outside [0, 1] (an array or tensor; :func:`~.finite.check_finite`), or it is a
            PIL image that converting to RGB would change silently (:func:`~.image_inputs.check_control_image`).
    """
    from diffusers.image_processor import VaeImageProcessor

    n, h, w = image_rows_and_size(image, "control_image")
    if (h, w) != (height, width):
        raise RuntimeInputError(f"control image for {name!r} is {w}x{h} (WxH) but the output is {width}x{height}; "
                                "a control image is never resized (diffusers resizes it, and takes its size when no "
                                f"height/width is given): resize it to the output size, or (without image=) pass "
                                f"height={h}, width={w}")
    if n not in (1, prompts):
        raise RuntimeInputError(f"{n} control images for {name!r} and {prompts} prompt(s); pass one image, or one "
                                "per prompt")
    check_control_image(image, f"control_image (ControlNet {name!r})")
    tensor = VaeImageProcessor(do_convert_rgb=True, do_normalize=False).preprocess(image, height=h, width=w)
    if tensor.ndim != 4 or tensor.shape[1] != 3:
        # else the engine refused it after the text encoder ran, naming its CFG-doubled batch and its own input
        raise RuntimeInputError(f"control image for {name!r} has {tensor.shape[1] if tensor.ndim == 4 else '?'} "
                                "channels; a ControlNet takes an RGB image (3 channels: [H, W, 3] numpy, "
                                "[3, H, W] or [n, 3, H, W] tensor, or a PIL image)")
    check_finite(f"control_image (ControlNet {name!r})", tensor)
    taker = embed if embed is not None else engine
    info = taker.spec.input(COND)
    return ControlUnit(name, engine, tensor.to(device=taker.device, dtype=info.torch_dtype), scale, start, end,
                       embed=embed)

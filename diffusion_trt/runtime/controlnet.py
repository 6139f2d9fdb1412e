"""ControlNets at run time: the checked request (:class:`ControlPlan`) and the residuals of each step.

An artifact compiled with ``--controlnet`` has ``unet_controlnet`` (the UNet with the residual inputs) and one
``controlnet_<name>`` engine per ControlNet (see ``compiler/controlnet.py``). A call with control images runs the
loop on ``unet_controlnet`` and, before each UNet step, every ControlNet whose factor is not 0 at that step, summing
their residuals (diffusers' ``MultiControlNetModel``); calls without control images run the plain ``unet``.

Step for step as diffusers' ``StableDiffusionControlNetPipeline.__call__`` (0.3x-0.4x):

* control image: ``VaeImageProcessor(do_convert_rgb=True, do_normalize=False).preprocess`` (float [n, 3, H, W] in
  [0, 1]), of the output size (never resized), one image for all B images or one per prompt (each repeated
  ``num_images_per_prompt`` times), doubled for classifier-free guidance (CFG) unless ``guess_mode``;
* ``keep[i] = 1 - (i / T < start or (i + 1) / T > end)`` per ControlNet (T steps), its factor
  ``scale * keep[i]``; a ControlNet at factor 0 is not run (its residuals would be exactly 0);
* ``guess_mode`` with CFG: the ControlNets see only the conditional half (``scheduler.scale_model_input(latents)``,
  the positive embeddings) and the unconditional rows get zero residuals; the residual factors ramp
  ``logspace(-1, 0, R) * factor`` (diffusers' ``ControlNetModel`` in guess mode).

Shapes: residual ``i`` [B2, C_i, ceil(h / k_i), ceil(w / k_i)] in the UNet's float dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import RuntimeInputError
from .engines.engine import Engine
from .finite import check_finite
from .float_range import finite_in_float32
from .image_inputs import image_rows_and_size

logger = logging.getLogger(__name__)

PREFIX = "controlnet_"
UNET_CONTROLNET = "unet_controlnet"
#: ``controlnet_conditioning_scale``'s default per mode, as diffusers' ControlNet pipelines (txt2img, Img2Img, Inpaint)
DEFAULT_CONTROL_SCALE: dict[str, float] = {"txt2img": 1.0, "img2img": 0.8, "inpaint": 0.5}


def controlnet_names(components: Sequence[str]) -> tuple[str, ...]:
    """The ControlNet names (``controlnet_<name>`` -> ``name``) among an artifact's components, in order."""
    return tuple(c[len(PREFIX):] for c in components if c.startswith(PREFIX))


def control_components(components: Sequence[str]) -> tuple[str, ...]:
    """The components a ControlNet call opens (``unet_controlnet`` and every ``controlnet_<name>``) present in
    ``components``; none without ``unet_controlnet``."""
    if UNET_CONTROLNET not in components:
        return ()
    return (UNET_CONTROLNET, *(c for c in components if c.startswith(PREFIX)))


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
    if isinstance(value, bool) or not isinstance(value, int | float) or not finite_in_float32(float(value)):
        raise RuntimeInputError(f"{what}={value!r} is not a finite float32 number; pass e.g. {example}")
    return float(value)


@dataclass(frozen=True)
class ControlUnit:
    """One ControlNet of a call: its engine, control image [n, 3, H, W] (its dtype, device), factor and window."""

    name: str
    engine: Engine
    image: torch.Tensor
    scale: float
    start: float
    end: float

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

    def rows(self, rows: range, batch: int, num_images_per_prompt: int, do_cfg: bool) -> ChunkControl:
        """The images of one chunk of rows (of ``batch`` images), doubled for CFG unless guess mode."""
        images = []
        for u in self.units:
            img = u.image
            reps = batch if img.shape[0] == 1 else num_images_per_prompt
            img = img.repeat_interleave(reps, dim=0)[rows.start: rows.stop]
            images.append(torch.cat([img, img]) if do_cfg and not self.guess_mode else img)
        return ChunkControl(self, tuple(images), do_cfg)


@dataclass(frozen=True)
class ChunkControl:
    """A :class:`ControlPlan` for one chunk: the images per unit, and the residuals of each step."""

    plan: ControlPlan
    images: tuple[torch.Tensor, ...]
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
        for unit, image in zip(self.plan.units, self.images, strict=True):
            factor = unit.scale * unit.keep(i, steps)
            if factor == 0.0:
                continue
            out = unit.engine.run({
                "sample": sample.to(unit.engine.spec.input("sample").torch_dtype), "timestep": ts,
                "encoder_hidden_states": embeds, **added, "controlnet_cond": image,
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
    """
    have = controlnet_names(list(engines))
    if control_image is None:
        return None
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
    units = tuple(_unit(engines[PREFIX + n], n, img, sc, s, e, height, width, prompts)
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
    names = [controlnet] if isinstance(controlnet, str) else list(controlnet)
    unknown = [n for n in names if n not in have]
    if unknown:
        raise RuntimeInputError(f"ControlNet {unknown[0]!r} is not in this artifact; it has {', '.join(have)}")
    return names


def _unit(engine: Engine, name: str, image: Any, scale: float, start: float, end: float, height: int, width: int,
          prompts: int) -> ControlUnit:
    """One checked ControlNet: its image preprocessed as diffusers' control image processor does.

    Raises:
        RuntimeInputError: the image is not the output's size, there are neither 1 nor ``prompts`` of them, or it
            holds NaN/Inf (an array or tensor; :func:`~.finite.check_finite`).
    """
    from diffusers.image_processor import VaeImageProcessor

    n, h, w = image_rows_and_size(image, "control_image")
    if (h, w) != (height, width):
        raise RuntimeInputError(f"control image for {name!r} is {w}x{h} (WxH) but the output is {width}x{height}; "
                                "resize it to the output size")
    if n not in (1, prompts):
        raise RuntimeInputError(f"{n} control images for {name!r} and {prompts} prompt(s); pass one image, or one "
                                "per prompt")
    tensor = VaeImageProcessor(do_convert_rgb=True, do_normalize=False).preprocess(image, height=h, width=w)
    check_finite(f"control_image (ControlNet {name!r})", tensor)
    info = engine.spec.input("controlnet_cond")
    return ControlUnit(name, engine, tensor.to(device=engine.device, dtype=info.torch_dtype), scale, start, end)

"""The initial latents of a request and the types the loop's callers pass for them: :func:`prepare_latents`,
:data:`Generator` (diffusers' ``generator=``) and :data:`StepCallback` (``callback=``, called with the latents after
every step).

Split from :mod:`.denoise` so that the modes (:mod:`.conditioning`, :mod:`.image_inputs`) and the request
(:mod:`.request`) need not import the loop that imports them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import RuntimeInputError

#: ``callback(step_index, timestep, latents)``: called after every scheduler step with the timestep (0-d CPU
#: tensor) and the latents [b, 4, h, w] of the running chunk on the engine device (called once per step of
#: every chunk). Reading the latents on the host syncs the device.
StepCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
Generator = torch.Generator | list[torch.Generator] | None

#: The names diffusers' ``StableDiffusionPipeline._callback_tensor_inputs`` lists that :class:`StepEnd` does not
#: hand over: the loop's text embeddings are the CFG batch of the running chunk, fixed for the whole loop.
_NOT_HANDED_OVER = ("prompt_embeds", "negative_prompt_embeds", "add_text_embeds", "add_time_ids",
                    "negative_pooled_prompt_embeds", "negative_add_time_ids")


@dataclass(frozen=True)
class StepEnd:
    """diffusers' ``callback_on_step_end``: ``fn(pipe, step_index, timestep, {"latents": latents})`` after every
    scheduler step; the ``"latents"`` of the dict it returns (if any) replace the latents, as in diffusers.

    Only ``"latents"`` is handed over (diffusers' default ``callback_on_step_end_tensor_inputs``); a step of every
    chunk calls it once with that chunk's latents [b, C, h, w] (as ``callback``). As in diffusers, the callback may
    set ``pipe._interrupt = True`` to stop the loop: the remaining steps (of every chunk) are skipped and the latents
    as they are decoded (:attr:`interrupted`).
    """

    fn: Callable[..., Any]
    pipe: Any

    @classmethod
    def build(cls, pipe: Any, fn: Any, tensor_inputs: Any) -> StepEnd | None:
        """The checked callback (``None`` for ``fn=None``); ``tensor_inputs`` as diffusers takes it (a diffusers
        ``PipelineCallback`` brings its own ``tensor_inputs``, which win, as in diffusers).

        Raises:
            RuntimeInputError: ``fn`` not callable, or tensor inputs other than ``"latents"`` (naming them).
        """
        if fn is not None and not callable(fn):
            raise RuntimeInputError(f"callback_on_step_end={fn!r} is not callable; pass a function (pipe, step, "
                                    "timestep, callback_kwargs) -> dict, or None")
        inputs = getattr(fn, "tensor_inputs", tensor_inputs)
        if isinstance(inputs, str) or not isinstance(inputs, Sequence) or not all(isinstance(k, str) for k in inputs):
            raise RuntimeInputError(f"callback_on_step_end_tensor_inputs={inputs!r} must be a list of names, e.g. "
                                    "['latents']")
        other = [k for k in inputs if k != "latents"]
        if other:
            why = ("the text embeddings are fixed for the whole loop here"
                   if all(k in _NOT_HANDED_OVER for k in other) else "unknown names")
            raise RuntimeInputError(f"callback_on_step_end_tensor_inputs has {other}: only ['latents'] is handed to "
                                    f"callback_on_step_end ({why}); use ['latents']")
        return None if fn is None else cls(fn, pipe)

    @property
    def interrupted(self) -> bool:
        """Whether the callback set diffusers' ``pipe._interrupt`` (the pipeline clears it when a call starts)."""
        return bool(getattr(self.pipe, "_interrupt", False))

    def __call__(self, step: int, timestep: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The latents after the callback: its returned ``"latents"`` (same shape), else ``latents``.

        Raises:
            RuntimeInputError: it returned something other than a dict (or ``None``), keys other than "latents", or
                latents of another shape.
        """
        out = self.fn(self.pipe, step, timestep, {"latents": latents})
        if out is None:
            return latents
        if not isinstance(out, dict) or set(out) - {"latents"}:
            got = sorted(out) if isinstance(out, dict) else type(out).__name__
            raise RuntimeInputError(f"callback_on_step_end returned {got}; return a dict with at most 'latents' "
                                    "(the one tensor input handed over)")
        new = out.get("latents", latents)
        if not isinstance(new, torch.Tensor) or new.shape != latents.shape:
            got = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
            raise RuntimeInputError(f"callback_on_step_end returned latents {got}; return a tensor of the shape it "
                                    f"was given, {tuple(latents.shape)}")
        return new.to(device=latents.device, dtype=latents.dtype)


def prepare_latents(
    scheduler: Any,
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    generator: Generator,
    latents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Initial latents [B, C, h, w]: ``randn_tensor`` (seed-compatible with diffusers) times ``init_noise_sigma``."""
    from diffusers.utils.torch_utils import randn_tensor

    if latents is None:
        latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
    else:
        latents = latents.to(device=device, dtype=dtype)
    return latents * scheduler.init_noise_sigma

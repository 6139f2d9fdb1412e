"""The arguments of a generation, declared once: name, type, default per pipeline kind, bounds.

Every front builds its call from this table: the Python API (:meth:`~.request.Request.build`, and so
:meth:`~.pipeline.EnginePipeline.__call__` and :class:`~.parallel.DataParallelPipeline`), the CLI's ``run`` (its
option defaults) and serving (the defaults ``diffusion-trt serve`` and ``export-triton`` hand to
:func:`~diffusion_trt.serve.triton_model.parse_request`)::

    GENERATION_ARGS["guidance_scale"].default_for("sdxl")            # 5.0, diffusers' StableDiffusionXLPipeline
    GENERATION_ARGS["num_inference_steps"].default_for("sd", front=True)   # 30: the CLI's and serve's
    check_arg("num_inference_steps", 0)                              # RuntimeInputError: ... must be an integer >= 1

Pipeline kinds are the manifest's ``model.architecture``: "sd" (SD 1.x/2.x) and "sdxl". What depends on the
artifact beyond these (sizes inside the profile and multiples of the VAE factor, the batch range, guidance on a
UNet built for the CFG batch only) is checked by :class:`~.request.RequestSpec`, before any engine loads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import RuntimeInputError
from .float_range import FLOAT32_MAX

ARCHITECTURES: tuple[str, ...] = ("sd", "sdxl")
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class GenerationArg:
    """One argument of a generation.

    Attributes:
        name: the keyword of :meth:`~.pipeline.EnginePipeline.__call__` (diffusers' name).
        type: ``int``, ``float`` or ``str``.
        default: the Python API's default (diffusers'); ``None`` = decided per call (the profile's opt size, a
            drawn seed, no negative prompt).
        per_architecture: a default per pipeline kind, overriding ``default`` (guidance: 7.5 SD, 5.0 SDXL).
        front_default: the default of the CLI's ``run`` and of serving, where it differs from the API's (they run
            30 steps, seed 0); ``None`` = the API's.
        minimum, maximum: inclusive bounds (``None`` = unbounded); ints and floats only.
        fix: the example the refusal message ends with.
        cli: the ``run`` option; serve: the serving request field (``None`` = not offered there).
    """

    name: str
    type: type
    default: Any = None
    per_architecture: Mapping[str, Any] = field(default_factory=dict)
    front_default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    fix: str = ""
    cli: str | None = None
    serve: str | None = None

    def default_for(self, architecture: str = "sd", front: bool = False) -> Any:
        """The default for a pipeline of ``architecture``; ``front``: the CLI's and serving's."""
        if front and self.front_default is not None:
            return self.front_default
        return self.per_architecture.get(architecture, self.default)


GENERATION_ARGS: dict[str, GenerationArg] = {a.name: a for a in (
    GenerationArg("prompt", str, cli="--prompt", serve="prompt"),
    GenerationArg("negative_prompt", str, cli="--negative-prompt", serve="negative_prompt"),
    GenerationArg("num_inference_steps", int, 50, front_default=30, minimum=1, fix="use e.g. 30 or 50",
                  cli="--steps", serve="steps"),
    GenerationArg("guidance_scale", float, 7.5, {"sd": 7.5, "sdxl": 5.0}, minimum=0,
                  fix="use e.g. 7.5 (values <= 1 disable CFG)", cli="--guidance", serve="guidance_scale"),
    GenerationArg("seed", int, None, front_default=0, minimum=0, maximum=MAX_SEED, cli="--seed", serve="seed"),
    GenerationArg("height", int, cli="--height", serve="height"),
    GenerationArg("width", int, cli="--width", serve="width"),
    GenerationArg("num_images_per_prompt", int, 1, minimum=1, fix="use 1 or more", cli="--batch-size"),
    GenerationArg("eta", float, 0.0, minimum=0, fix="use 0.0 (deterministic DDIM) .. 1.0"),
    GenerationArg("guidance_rescale", float, 0.0, minimum=0, fix="use 0.0 (off) .. 1.0, e.g. 0.7"),
)}


def default_guidance_scale(architecture: str) -> float:
    """diffusers' default guidance of the pipeline class of ``architecture``: 7.5 (SD 1.x/2.x), 5.0 (SDXL)."""
    return float(GENERATION_ARGS["guidance_scale"].default_for(architecture))


def serve_defaults(architecture: str) -> dict[str, Any]:
    """The defaults of a serving request (``pipeline.json``'s ``defaults``, keyed by the serve field names) for an
    artifact of ``architecture``: ``{"negative_prompt": "", "seed": 0, "steps": 30, "guidance_scale": ...}``."""
    out: dict[str, Any] = {"negative_prompt": ""}  # the request tensor is text: "" (= no negative prompt for SD)
    for name in ("seed", "num_inference_steps", "guidance_scale"):
        arg = GENERATION_ARGS[name]
        out[str(arg.serve)] = arg.default_for(architecture, front=True)
    return out


def check_arg(name: str, value: Any) -> Any:
    """``value`` of the numeric argument ``name``, type- and bounds-checked against :data:`GENERATION_ARGS`.

    Returns:
        ``int(value)`` or ``float(value)``.

    Raises:
        RuntimeInputError: not a number of the argument's type (bool is none), not finite (floats: or beyond
            float32), or out of bounds; the message names the value and the fix.
    """
    arg = GENERATION_ARGS[name]
    if arg.type is int and arg.maximum is not None:
        whole = not isinstance(value, bool) and isinstance(value, int | np.integer)
        if not whole or not arg.minimum <= value <= arg.maximum:
            raise RuntimeInputError(f"{name}={value!r} must be an integer in {arg.minimum:g}..{arg.maximum}")
        return int(value)
    if arg.type is int:
        return positive_int(name, value, arg.fix)
    return non_negative_float(name, value, arg.fix)


def positive_int(name: str, value: Any, fix: str) -> int:
    """``value`` as an int >= 1; RuntimeInputError naming it and ``fix`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise RuntimeInputError(f"{name}={value!r} must be an integer >= 1; {fix}")
    return int(value)


def non_negative_float(name: str, value: Any, fix: str) -> float:
    """``value`` as a finite float >= 0 that float32 holds (:data:`~.float_range.FLOAT32_MAX`: ``guidance_scale=1e39``
    scales the noise prediction to inf, a black image); RuntimeInputError naming it and ``fix`` otherwise."""
    number = not isinstance(value, bool) and isinstance(value, int | float | np.number)
    if not number or not math.isfinite(value) or value < 0:
        raise RuntimeInputError(f"{name}={value!r} must be a finite number >= 0; {fix}")
    if value > FLOAT32_MAX:
        raise RuntimeInputError(f"{name}={value!r} is beyond float32 (at most {FLOAT32_MAX:.4g}): on the engines' "
                                f"tensors it is inf; {fix}")
    return float(value)

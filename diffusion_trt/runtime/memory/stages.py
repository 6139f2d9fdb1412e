"""The stage context the denoising loop enters, so residency is visible where it happens (demoDiffusion's
``with model_memory_manager(["unet"])``)::

    with stages.stage("text"):                 # 2. encode prompt
        ...text_encoder.run(...)
    for chunk in request.chunks:
        with stages.stage("unet", ("unet",)):  # 3. denoise
            ...unet.run(...)
        with stages.stage("vae") as vae:       # 4. decode: whole, or in tiles when the plan says so
            ...(vae.tiled_vae or vae_decoder).run(...)

Stages, in the order a request runs them (:data:`~.plan.STAGES`): "text" (the text encoder(s)), "unet" (the UNet;
a call's ControlNets run inside it), "vae" (the VAE decoder). A request in chunks enters "unet" and "vae" once per
chunk.

:class:`Stages` is the context of a pipeline without a VRAM budget: every engine is open for the pipeline's
lifetime, so entering a stage opens and releases nothing. A budget's :class:`~.residency.Residency` subclasses it:
entering a stage opens the stage's engines the loop names (releasing the other stages' per-stage engines first,
just before one opens) and its "vae" stage hands the loop the tiled decoder when the plan tiles. The engines stay
plain engines: no proxy opens them on first use.

Hooks (:class:`StageHook`) see every stage entered and left: the per-stage device meter
(:class:`~.memory_meter.StageMemoryMeter`) is one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .plan import STAGES

if TYPE_CHECKING:
    from .vae_tiling import TiledVaeDecoder

logger = logging.getLogger(__name__)


def stage_of(component: str) -> str | None:
    """"text", "unet" or "vae" for a text-to-image component; ``None`` for others (the VAE encoder, ControlNets)."""
    return next((s for s, comps in STAGES if component in comps), None)


def stage_components(stage: str) -> tuple[str, ...]:
    """The components of ``stage`` (:data:`~.plan.STAGES`).

    Raises:
        ValueError: an unknown stage name (a programming error: the loop names its stages).
    """
    for name, comps in STAGES:
        if name == stage:
            return comps
    raise ValueError(f"unknown stage {stage!r}; the stages are {', '.join(s for s, _ in STAGES)}")


class StageHook(Protocol):
    """Told about every stage the loop enters (all three calls happen on the loop's thread)."""

    def stage_entered(self, stage: str) -> None:
        """After the other stages' engines were released, before this stage's engines open."""

    def stage_opened(self, stage: str) -> None:
        """After this stage's engines are open, before the loop runs them."""

    def stage_left(self, stage: str) -> None:
        """After the loop's last engine run of the stage (also when it raised)."""


@dataclass(frozen=True)
class Stage:
    """What ``with stages.stage(name) as stage:`` gives the loop.

    Attributes:
        name: "text", "unet" or "vae".
        tiled_vae: the "vae" stage of a plan that tiles: the decoder to run instead of the VAE decoder engine
            (:class:`~.vae_tiling.TiledVaeDecoder`, the same ``run`` contract); ``None`` = decode whole.
    """

    name: str
    tiled_vae: TiledVaeDecoder | None = None


class Stages:
    """The stages of a pipeline whose engines are all open for its lifetime (no VRAM budget): entering a stage opens
    and releases nothing; :attr:`hooks` still see each stage.

    Attributes:
        hooks: :class:`StageHook` objects told about each stage (added and removed by their owners, e.g.
            :meth:`~.memory_meter.StageMemoryMeter.watch`).
    """

    def __init__(self) -> None:
        self.hooks: list[StageHook] = []

    @contextlib.contextmanager
    def stage(self, name: str, components: Collection[str] | None = None) -> Iterator[Stage]:
        """Enter stage ``name`` to run ``components`` (default: the stage's own, :data:`~.plan.STAGES`; the loop
        names the UNet it runs, ``unet_controlnet`` with ControlNets).

        Yields:
            the :class:`Stage` (its decode choice for "vae").

        Raises:
            ValueError: an unknown stage name. Whatever opening an engine raises (an altered file:
                ``ArtifactError``).
        """
        wanted = tuple(components) if components is not None else stage_components(name)
        self._open(name, wanted)
        try:
            yield self._stage(name)
        finally:
            for hook in self.hooks:
                hook.stage_left(name)

    def open_component(self, component: str) -> None:
        """Make ``component`` usable outside a call (``EnginePipeline.engine``): nothing to do when all are open."""

    def _open(self, stage: str, components: tuple[str, ...]) -> None:
        """Release what the stage needs released, tell the hooks, open ``components``, tell the hooks again."""
        for hook in self.hooks:
            hook.stage_entered(stage)
        for hook in self.hooks:
            hook.stage_opened(stage)

    def _stage(self, name: str) -> Stage:
        return Stage(name)

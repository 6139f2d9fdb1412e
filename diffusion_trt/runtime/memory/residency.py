"""Running a pipeline inside a VRAM budget: the facts of an artifact's engines, the plan (:mod:`.plan`), and the
stage context (:class:`Residency`) that opens engines per stage and releases them.

``EnginePipeline.from_artifacts(..., vram_budget="8GB")`` builds a :class:`VramBudget` from the manifest, plans for
the request size it is given (``vram_request``; default the size a call without sizes gets, the profile's opt size,
batch 1) and refuses there,
before any engine opens, a budget no plan meets. Each call re-plans for its own size and batch (figures are cached;
a request the budget cannot meet is refused before anything runs) and switches plans where needed.

The loop enters each stage (``with stages.stage("unet", ("unet",)):``, :mod:`.stages`); under a budget that is a
:class:`Residency`: entering the pipeline opens the resident engines only; entering a stage opens that stage's
per-stage engines, after releasing every open per-stage engine of another stage (one stage's engines at a time:
text encoder(s) -> UNet -> VAE); the pipeline releases them all at the end of each call. A request larger than the
engines' batch runs chunk after chunk, so the UNet and the VAE alternate: each chunk then reopens them. The "vae"
stage decodes in tiles (:mod:`.vae_tiling`) when the plan in force says so. The engines stay plain engines: an
:class:`EngineSlot` only keeps their books (open or not, opens, seconds spent opening).

Settings fixed when an engine is created stay with it when a later call switches plans: an ORT session's arena cap
(``gpu_mem_limit``, from the plan at load) and a TensorRT engine's weight-streaming budget. Reopening a per-stage
engine reads (and, with ``verify``, hashes) its file again through the artifact reader, and ORT re-optimises the
graph: that is most of what a per-stage plan costs per request (``bench --vram-budget`` measures it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from ...artifact.folder import safe_join
from ...artifact.manifest import Backend, Component, Manifest
from ..engines.engine import Engine
from ..geometry import LatentGeometry
from .plan import (
    DEFAULT_OVERHEAD_BYTES,
    EngineMemory,
    ResidencyPlan,
    engine_rows,
    estimated_activations,
    load_memory_facts,
    ort_arena_options,
    ort_engine_memory,
    parse_size,
    plan_residency,
    request_shape,
)
from .stages import Stage, Stages, stage_of
from .vae_tiling import TiledVaeDecoder

logger = logging.getLogger(__name__)


@dataclass
class VramBudget:
    """An artifact's engines measured against a budget.

    Attributes:
        budget: bytes; manifest: the artifact's manifest; root: its folder.
        components: the text-to-image components planned for.
        facts: recorded measurements (:func:`~.plan.load_memory_facts`; ``{}`` = none: estimates only).
        overhead: non-engine bytes per stage (recorded, else :data:`~.plan.DEFAULT_OVERHEAD_BYTES`, estimated).
        tile: VAE tile size in latent pixels (the profile's opt latent size: 64 for a 512x512 SD artifact).
    """

    budget: int
    manifest: Manifest
    root: Path
    components: tuple[str, ...]
    facts: Mapping[str, Any] = field(default_factory=dict)
    overhead: int = DEFAULT_OVERHEAD_BYTES
    tile: int = 64
    _cache: dict[tuple[int, int, int], ResidencyPlan] = field(default_factory=dict)

    @classmethod
    def from_manifest(cls, budget: str | int, manifest: Manifest, root: Path, components: tuple[str, ...],
                      facts_file: str | Path | None = None) -> VramBudget:
        """Raises: RuntimeInputError: a malformed budget (the accepted forms are named) or facts file."""
        size = parse_size(budget)
        facts = load_memory_facts(facts_file, manifest)
        scale = LatentGeometry.from_manifest(manifest).scale_factor
        tile = min(manifest.profile.opt_size) // scale
        overhead = int(facts.get("overhead_bytes") or DEFAULT_OVERHEAD_BYTES)
        return cls(size, manifest, root, components, facts, overhead, max(tile, 1))

    @property
    def backend(self) -> Backend:
        return self.manifest.backend

    def engine_memory(self, height: int, width: int, batch: int) -> dict[str, EngineMemory]:
        """Each component's facts at ``height`` x ``width``, ``batch`` images (CFG assumed: 2x UNet rows)."""
        tile_px = self.tile * LatentGeometry.from_manifest(self.manifest).scale_factor
        tiled = height > tile_px or width > tile_px
        batch = min(batch, self.manifest.profile.batch.max)  # one chunk at a time
        out: dict[str, EngineMemory] = {}
        for name in self.components:
            entry = self.manifest.components[name]
            fp32 = entry.precision == "fp32"
            rows = engine_rows(name, batch, cfg=True)
            tile = (min(height, tile_px), min(width, tile_px)) if tiled and name == "vae_decoder" else None
            if entry.plan is not None:  # TensorRT: weights ~ plan bytes until the engine is read (device_memory_size)
                out[name] = self._trt_memory(name, entry, rows, height, width, fp32, tile)
            else:
                out[name] = ort_engine_memory(name, safe_join(self.root, str(entry.onnx)), rows=rows,
                                              height=height, width=width, fp32=fp32, facts=self.facts, tile=tile)
        return out

    def _trt_memory(self, name: str, entry: Component, rows: int, height: int, width: int, fp32: bool,
                    tile: tuple[int, int] | None) -> EngineMemory:
        rec = (self.facts.get("engines") or {}).get(name, {})
        size = self.manifest.file_size(str(entry.plan))
        weights = int(rec.get("weights_bytes") or size)
        wsrc = "measured" if rec.get("weights_bytes") else "estimated: plan file bytes"
        acts = rec.get("activations") or []
        act = max((int(a["bytes"]) for a in acts), default=None)  # TensorRT: the profiles' max, one figure
        if act is None:
            act, asrc = estimated_activations(name, rows, height, width, fp32), "estimated: per-pixel rule"
        else:
            asrc = "tensorrt: get_device_memory_size_for_profile_v2 (recorded at load)"
        tiled = estimated_activations(name, rows, *tile, fp32) if tile is not None else None
        return EngineMemory(name, weights, act, wsrc, asrc, int(rec.get("streamable_bytes") or 0), tiled)

    def plan(self, height: int, width: int, batch: int) -> ResidencyPlan:
        """The plan for one request (cached per shape).

        Raises:
            RuntimeInputError: no plan fits (figures and the smallest budget in the message).
        """
        key = (int(height), int(width), int(batch))
        if key not in self._cache:
            self._cache[key] = plan_residency(
                self.engine_memory(*key), self.budget, shared_activations=self.backend.is_tensorrt,
                overhead=self.overhead, what=request_shape(*key),
                overhead_source=f"measured on {self.facts.get('device')}" if self.facts.get("overhead_bytes")
                else "estimated",
            )
        return self._cache[key]

    def provider_options(self, plan: ResidencyPlan, component: str) -> dict[str, str]:
        """ORT CUDA provider options sizing ``component``'s arena to the plan (``{}`` for components not planned)."""
        limit = plan.arena_limits.get(component)
        return ort_arena_options(limit) if limit is not None else {}


def plan_for_request(
    vram_budget: str | int,
    manifest: Manifest,
    root: Path,
    components: tuple[str, ...],
    request: tuple[int | None, int | None, int] | None = None,
    facts_file: str | Path | None = None,
) -> Residency:
    """The budget's plan for ``request`` = (height, width, batch); ``None`` sizes = the size a call without sizes gets
    (the profile's opt size: :attr:`~diffusion_trt.artifact.manifest.Profile.opt_size`; ``request=None``: that size,
    batch 1), so a budget accepted here is not refused by the first call.

    Raises:
        RuntimeInputError: a malformed budget, a facts file of another artifact, or a budget no plan meets.
    """
    budget = VramBudget.from_manifest(vram_budget, manifest, root, components, facts_file)
    height, width, batch = request if request is not None else (None, None, 1)
    opt_height, opt_width = manifest.profile.opt_size
    height, width = int(height or opt_height), int(width or opt_width)
    plan = budget.plan(height, width, batch)
    logger.info("vram budget: %s for %s", plan.describe(), request_shape(height, width, batch))
    return Residency(budget, plan)


class EngineSlot:
    """One planned component's engine under a budget: its stage, whether it is open, and what opening it cost.
    Bookkeeping only: the loop runs the engine itself, not through this.

    Attributes:
        engine: the engine (plain: ``OrtEngine``, ``TrtEngine``, a size-bucket engine); stage: "text", "unet" or
            "vae"; opens: how often it was opened; open_seconds: the time those opens took.
    """

    def __init__(self, engine: Engine, stage: str) -> None:
        self.engine = engine
        self.stage = stage
        self.opens = 0
        self.open_seconds = 0.0
        self._open = False

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def is_open(self) -> bool:
        return self._open

    def open(self) -> None:
        """Enter the engine (its session or context and device memory); no-op when open."""
        if self._open:
            return
        t0 = time.perf_counter()
        self.engine.__enter__()
        self.open_seconds += time.perf_counter() - t0
        self.opens += 1
        self._open = True
        logger.debug("%s: opened for the %s stage (%.2f s)", self.name, self.stage, time.perf_counter() - t0)

    def release(self) -> None:
        """Exit the engine (its session / context and its device memory); idempotent."""
        if self._open:
            self._open = False
            device = self.engine.device
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # queued kernels may still use its buffers
            self.engine.__exit__(None, None, None)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # our IO buffers of it go back to the driver, not to torch's cache


class Residency(Stages):
    """The plan in force, as the stage context the loop enters (:class:`~.stages.Stages`): entering a stage opens the
    planned engines the loop names, after releasing the other stages' per-stage engines (only when one of them is
    about to open); resident engines open with the pipeline and stay. Its "vae" stage gives the loop the tiled
    decoder when the plan tiles.

    Lifecycle: :meth:`bind` the pipeline's (unopened) engines, enter it with the pipeline (opens the resident ones),
    :meth:`begin` / :meth:`end` around each call, exit it when the pipeline closes (releases every engine).

    Attributes:
        budget: the :class:`VramBudget`; plan: the plan in force; staged: each planned component's
            :class:`EngineSlot`; tiled: the tiled VAE decoder over the VAE decoder engine (used when the plan tiles).
    """

    def __init__(self, budget: VramBudget, plan: ResidencyPlan) -> None:
        super().__init__()
        self.budget = budget
        self.plan = plan
        self.staged: dict[str, EngineSlot] = {}
        self.tiled: TiledVaeDecoder | None = None

    def provider_options(self, component: str, device: str) -> dict[str, str]:
        """ORT CUDA provider options for ``component`` under the plan in force (``{}`` on the CPU)."""
        return self.budget.provider_options(self.plan, component) if device == "cuda" else {}

    def weight_streaming(self) -> dict[str, int]:
        """TensorRT: per component, bytes of STREAMABLE weights to keep on the device (``weight_streaming_budget_v2``)
        under the plan; the plan counts all weights, so the non-streamable part is taken off."""
        out: dict[str, int] = {}
        for name, kept in self.plan.weight_streaming.items():
            e = self.plan.engines[name]
            out[name] = max(0, kept - (e.weights - e.streamable))
        return out

    def bind(self, engines: Mapping[str, Engine]) -> Residency:
        """Take the pipeline's unopened engines: a slot for each planned component (:func:`~.stages.stage_of`), and
        the tiled decoder over the VAE decoder; others (VAE encoder, ControlNets) are not planned. Returns ``self``."""
        for name, engine in engines.items():
            stage = stage_of(name)
            if stage is not None:
                self.staged[name] = EngineSlot(engine, stage)
        if "vae_decoder" in engines:
            scale = LatentGeometry.from_manifest(self.budget.manifest).scale_factor
            self.tiled = TiledVaeDecoder(engines["vae_decoder"], self.budget.tile, scale)
        return self

    def __enter__(self) -> Residency:
        """Open the resident engines (the per-stage ones open when the loop enters their stage)."""
        try:
            for slot in self.staged.values():
                if slot.name in self.plan.resident:
                    slot.open()
        except BaseException:
            self.release_all()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release_all()

    def _open(self, stage: str, components: tuple[str, ...]) -> None:
        closed = [self.staged[c] for c in components if c in self.staged and not self.staged[c].is_open]
        if closed:
            self._release_others(stage, closed[0].name)
        for hook in self.hooks:
            hook.stage_entered(stage)
        for slot in closed:
            slot.open()
        for hook in self.hooks:
            hook.stage_opened(stage)

    def _stage(self, name: str) -> Stage:
        return Stage(name, tiled_vae=self.tiled if name == "vae" and self.plan.vae_tiled else None)

    def _release_others(self, stage: str, opening: str) -> None:
        """Before an engine of ``stage`` opens: release the per-stage engines of other stages."""
        for other in self.staged.values():
            if other.is_open and other.stage != stage and other.name not in self.plan.resident:
                logger.debug("releasing %s (%s stage) before %s opens", other.name, other.stage, opening)
                other.release()

    def open_component(self, component: str) -> None:
        """Open a planned ``component`` outside a call (``EnginePipeline.engine``), releasing the other stages'
        per-stage engines first; it stays open until the next call ends. Others: nothing to do."""
        slot = self.staged.get(component)
        if slot is not None and not slot.is_open:
            self._release_others(slot.stage, component)
            slot.open()

    def begin(self, height: int, width: int, batch: int) -> ResidencyPlan:
        """Plan the request (raises RuntimeInputError when the budget cannot meet it); switch plans if needed."""
        plan = self.budget.plan(height, width, batch)
        if plan is not self.plan:
            if plan.label != self.plan.label:
                logger.info("vram budget: %s for %s", plan.describe(), request_shape(height, width, batch))
            self.plan = plan
        return plan

    def end(self) -> None:
        """After a request: release every per-stage engine."""
        for s in self.staged.values():
            if s.name not in self.plan.resident:
                s.release()

    def release_all(self) -> None:
        for s in self.staged.values():
            s.release()


def memory_summary(root: Path, manifest: Manifest) -> dict[str, Any]:
    """``inspect``'s memory facts: each text-to-image engine's weights and activations at the profile's opt and
    max shapes (batch, height, width; CFG rows for the UNet and text encoders), with their sources.

    ORT: weights = initializer bytes (estimated) unless measured; activations measured (recorded by
    ``benchmarks/gpu_vram.py``) or the per-pixel estimate, since ORT offers no activation figure before a run.
    TensorRT: weights = plan bytes (estimated) unless recorded; activations ``device_memory_size_v2`` recorded at
    load, else estimated (reading them needs TensorRT and the GPU).

    Returns:
        ``{"facts": str, "overhead_bytes": int, "shapes": {"opt": "BxHxW", "max": "BxHxW"},
        "components": {name: {"opt": EngineMemory.to_json(), "max": ...}}}``.
    """
    from ..sdxl import SDXL_COMPONENTS
    from .plan import facts_path

    comps = SDXL_COMPONENTS if manifest.model.is_sdxl else ("text_encoder", "unet", "vae_decoder")
    budget = VramBudget.from_manifest(1, manifest, Path(root), tuple(c for c in comps if c in manifest.components))
    prof = manifest.profile
    shapes = {"opt": (prof.height.opt, prof.width.opt, prof.batch.opt),
              "max": (prof.height.max, prof.width.max, prof.batch.max)}
    out: dict[str, Any] = {}
    for key, (h, w, b) in shapes.items():
        for name, mem in budget.engine_memory(h, w, b).items():
            out.setdefault(name, {})[key] = mem.to_json()
    path = facts_path(manifest)
    return {
        "facts": f"measured, recorded in {path}" if budget.facts else "none recorded (activations estimated; "
                 "measure with benchmarks/gpu_vram.py)",
        "overhead_bytes": budget.overhead,
        "shapes": {k: f"{b}x{h}x{w}" for k, (h, w, b) in shapes.items()},
        "components": out,
    }

"""Running a pipeline inside a VRAM budget: the facts of an artifact's engines, the plan (:mod:`.plan`), and the
engines opened per stage and released.

``EnginePipeline.from_artifacts(..., vram_budget="8GB")`` builds a :class:`VramBudget` from the manifest, plans for
the request size it is given (``vram_request``; default the size a call without sizes gets, the profile's opt size,
batch 1) and refuses there,
before any engine opens, a budget no plan meets. Each call re-plans for its own size and batch (figures are cached;
a request the budget cannot meet is refused before anything runs) and switches plans where needed.

Per-stage engines are wrapped in :class:`StagedEngine`: entering the pipeline does not open them; their first
``run`` opens them, after releasing every open per-stage engine of another stage (one stage's engines at a time:
text encoder(s) -> UNet -> VAE); the pipeline releases them all at the end of each call. A request larger than the
engines' batch runs chunk after chunk, so the UNet and the VAE alternate: each chunk then reopens them.

Settings fixed when an engine is created stay with it when a later call switches plans: an ORT session's arena cap
(``gpu_mem_limit``, from the plan at load) and a TensorRT engine's weight-streaming budget. Reopening a per-stage
engine reads (and, with ``verify``, hashes) its file again through the artifact reader, and ORT re-optimises the
graph: that is most of what a per-stage plan costs per request (``bench --vram-budget`` measures it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from ...artifact.folder import safe_join
from ...artifact.manifest import Backend, Component, Manifest
from ..engines.engine import Engine, EngineProxy
from ..geometry import LatentGeometry
from .plan import (
    DEFAULT_OVERHEAD_BYTES,
    STAGES,
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
from .vae_tiling import TiledVaeDecoder

logger = logging.getLogger(__name__)


def stage_of(component: str) -> str | None:
    """"text", "unet" or "vae" for a text-to-image component; ``None`` for others (the VAE encoder)."""
    return next((s for s, comps in STAGES if component in comps), None)


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


class StagedEngine(EngineProxy):
    """An :class:`~..engines.engine.Engine` proxy that opens its engine on first ``run`` and closes it on
    :meth:`release`.

    Args:
        engine: the engine (closed); stage: "text", "unet" or "vae"; manager: the :class:`Residency` that
            releases other stages' engines before this one opens.

    Not thread-safe (as the engines).
    """

    def __init__(self, engine: Engine, stage: str, manager: Residency) -> None:
        super().__init__(engine)
        self.stage = stage
        self._manager = manager
        self._open = False
        self.opens = 0
        self.open_seconds = 0.0

    @property
    def is_open(self) -> bool:
        return self._open

    def __enter__(self) -> StagedEngine:
        if self.name in self._manager.plan.resident:
            self.acquire()  # resident: open with the pipeline; per-stage: opened by the first run
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def validate(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, int]:
        return self._engine.validate(feeds)

    def acquire(self, on_released: Callable[[], None] | None = None) -> None:
        """Open the engine (releasing the other stages' per-stage engines first); no-op when open.

        ``on_released`` is called between the release and the open (a memory meter switches stages there)."""
        if self._open:
            if on_released is not None:
                on_released()
            return
        self._manager.entering(self)
        if on_released is not None:
            on_released()
        t0 = time.perf_counter()
        self._engine.__enter__()
        self.open_seconds += time.perf_counter() - t0
        self.opens += 1
        self._open = True
        logger.debug("%s: opened for the %s stage (%.2f s)", self.name, self.stage, time.perf_counter() - t0)

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.acquire()
        return self._engine.run(feeds)

    def release(self) -> None:
        """Close the engine (its session / context and its device memory); idempotent."""
        if self._open:
            self._open = False
            device = self._engine.device
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # queued kernels may still use its buffers
            self._engine.__exit__(None, None, None)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # our IO buffers of it go back to the driver, not to torch's cache


class Residency:
    """The plan in force and the per-stage engines it opens and releases.

    Attributes:
        budget: the :class:`VramBudget`; plan: the plan in force; staged: per-stage engine proxies by name.
    """

    def __init__(self, budget: VramBudget, plan: ResidencyPlan) -> None:
        self.budget = budget
        self.plan = plan
        self.staged: dict[str, StagedEngine] = {}
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

    def wrap(self, engines: Mapping[str, Engine]) -> dict[str, Engine]:
        """Every planned component as a :class:`StagedEngine` (resident ones are opened on the first call and kept);
        the VAE decoder under a :class:`TiledVaeDecoder` when the plan tiles. Others are returned as they are."""
        out: dict[str, Engine] = dict(engines)
        for name, engine in engines.items():
            stage = stage_of(name)
            if stage is None:
                continue
            staged = StagedEngine(engine, stage, self)
            self.staged[name] = staged
            out[name] = staged  # type: ignore[assignment]
        if "vae_decoder" in out:
            scale = LatentGeometry.from_manifest(self.budget.manifest).scale_factor
            self.tiled = TiledVaeDecoder(out["vae_decoder"], self.budget.tile, scale)
            out["vae_decoder"] = _Switch(self.tiled, out["vae_decoder"], self)  # type: ignore[assignment]
        return out

    def entering(self, engine: StagedEngine) -> None:
        """Before ``engine`` opens: release the per-stage engines of other stages."""
        for other in self.staged.values():
            if other is not engine and other.is_open and other.stage != engine.stage \
                    and other.name not in self.plan.resident:
                logger.debug("releasing %s (%s stage) before %s opens", other.name, other.stage, engine.name)
                other.release()

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


class _Switch(EngineProxy):
    """The VAE decoder as the plan wants it: tiled (:class:`TiledVaeDecoder`) or whole."""

    def __init__(self, tiled: TiledVaeDecoder, whole: Engine, residency: Residency) -> None:
        super().__init__(whole)
        self._tiled, self._whole, self._residency = tiled, whole, residency

    def _current(self) -> Any:
        return self._tiled if self._residency.plan.vae_tiled else self._whole

    def __enter__(self) -> _Switch:
        self._whole.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._whole.__exit__(exc_type, exc, tb)

    def validate(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, int]:
        return self._whole.validate(feeds)

    def acquire(self, on_released: Callable[[], None] | None = None) -> None:
        self._whole.acquire(on_released)  # type: ignore[attr-defined]

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return self._current().run(feeds)


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

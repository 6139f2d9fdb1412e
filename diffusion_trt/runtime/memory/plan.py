"""A VRAM budget: sizes, per-engine memory facts, and the residency plan that fits a request into the budget.

Three pieces, all plain data (no GPU needed, so they are tested on the CPU):

* :func:`parse_size` reads a budget the way people write one ("8GB", "8GiB", "7.5G", "8000MB", bytes).
* :class:`EngineMemory` is one engine's memory at a request's shape: the bytes its **weights** hold while it is
  open, and its **activation** (scratch) bytes while it runs, each with where the figure came from
  (``estimated`` from initializer bytes or a per-pixel rule, ``measured`` on a GPU, or read from ``tensorrt``).
* :func:`plan_residency` picks, from the fastest plan down, the first that fits:

  ========================  ==========================================================================
  ``all_resident``          every engine open for the pipeline's lifetime (what runs without a budget)
  ``text_encoder_offloaded`` UNet and VAE stay; the text encoder(s) are opened per request and released
  ``unet_resident``         only the UNet stays; text encoder(s) and VAE are opened per stage
  ``per_stage``             nothing stays: each stage opens its engine(s) and releases them after
  ========================  ==========================================================================

  each first with the whole-image VAE decode, then with the tiled decode (:mod:`.vae_tiling`), which is cheaper
  than reopening an engine (a few extra VAE tiles vs. a session load). TensorRT engines built with weight
  streaming get a last resort: ``per_stage`` with part of their weights left on the host. A budget no plan meets
  raises :class:`~diffusion_trt.errors.RuntimeInputError` naming every figure and the smallest budget that works.

The memory model (bytes, per stage s = text, unet, vae; "open(s)" = the resident engines plus those of stage s)::

    peak(s) = overhead + sum(weights of open(s)) + activations(s)
    activations(s) = sum(activations of open(s))   ONNX Runtime: each session keeps its own arena after a run
                   = max(activations of all engines) TensorRT: one activation buffer shared by every engine
                                                     (engines/trt_engine.py SharedActivationMemory; it never shrinks)

``overhead`` is what the process holds before any engine opens: the CUDA context, cuDNN/cuBLAS handles and
their workspaces, the latents and embeddings. :data:`DEFAULT_OVERHEAD_BYTES` is an ESTIMATE, not a measurement of
ours (a CUDA context with cuDNN and cuBLAS loaded is commonly reported at a few hundred MiB; it varies with the
driver, the GPU and the libraries); ``benchmarks/gpu_vram.py`` measures it on the GPU and records it with the memory
facts, which then replace this default (``overhead=``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ...artifact.manifest import Manifest
from ...errors import RuntimeInputError

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20

#: Units :func:`parse_size` accepts (case-insensitive): with an "i" binary (IEC), without decimal (SI), as
#: IEC 80000-13 and Kubernetes quantities read them ("8G" = "8GB" = 8 * 10**9 bytes, "8GiB" = 8 * 2**30).
SIZE_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10, "ki": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20, "mi": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30, "gi": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40, "ti": 2**40,
}
SIZE_FORMS = '"8GB" (10**9 bytes), "8GiB" (2**30 bytes), "7.5G", "8000MB", "7680MiB" or a byte count "8589934592"'
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")

#: Estimated bytes the process holds besides the engines (CUDA context, cuDNN/cuBLAS, latents); see the module doc.
#: One measurement, rounded up (benchmarks/results/README.md, "Figures behind code defaults"); other GPUs and drivers
#: differ.
DEFAULT_OVERHEAD_BYTES = 768 * MiB

#: Pipeline stages in the order a request runs them, and the components each opens.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("text", ("text_encoder", "text_encoder_2")),
    ("unet", ("unet",)),
    ("vae", ("vae_decoder",)),
)
#: Residency plans, fastest first: (name, components that stay resident; ``None`` = all).
PLANS: tuple[tuple[str, frozenset[str] | None], ...] = (
    ("all_resident", None),
    ("text_encoder_offloaded", frozenset({"unet", "vae_decoder"})),
    ("unet_resident", frozenset({"unet"})),
    ("per_stage", frozenset()),
)

#: Activation ESTIMATE when nothing was measured: bytes per output pixel (H x W) per batch row the engine runs,
#: for fp16 engines (fp32: twice). Scaled from one measurement of SD-1.5 fp16 512x512 with ONNX Runtime's CUDA
#: provider (arena growth + cuDNN workspace + CUDA-graph pool), with a 25 % margin (benchmarks/results/README.md,
#: "Figures behind code defaults"). The encoder is taken as half the decoder (unmeasured).
#: Recorded facts (:func:`load_memory_facts`) replace these.
ESTIMATE_BYTES_PER_PIXEL_ROW: dict[str, int] = {
    "vae_decoder": 4096,
    "vae_encoder": 2048,
    "unet": 1024,
}
#: Activation ESTIMATE for the text encoders (no pixel dependence), per batch row: 77 tokens x width x a few
#: live tensors is well under this; ORT's arena grows in chunks of at least 1 MiB.
ESTIMATE_TEXT_BYTES_PER_ROW = 32 * MiB

FACTS_SCHEMA = "diffusion-trt/memory/1"


def parse_size(value: str | int) -> int:
    """Bytes from a size as people write it.

    Args:
        value: an int (bytes) or a string: a number (decimals allowed) and an optional unit from
            :data:`SIZE_UNITS`, e.g. "8GB", "8GiB", "7.5G", "8000MB", "8589934592".

    Returns:
        The size in bytes (int, rounded down), > 0.

    Raises:
        RuntimeInputError: not a size, an unknown unit, or not > 0; the message lists the accepted forms.
    """
    if isinstance(value, bool):
        raise RuntimeInputError(f"vram budget {value!r} is not a size; use {SIZE_FORMS}")
    if isinstance(value, int):
        number, unit = float(value), ""
    else:
        m = _SIZE_RE.match(str(value))
        if m is None or m.group(2).lower() not in SIZE_UNITS:
            raise RuntimeInputError(f"vram budget {value!r} is not a size; use {SIZE_FORMS}")
        number, unit = float(m.group(1)), m.group(2).lower()
    size = int(number * SIZE_UNITS[unit])
    if size <= 0:
        raise RuntimeInputError(f"vram budget {value!r} must be more than 0 bytes; use {SIZE_FORMS}")
    return size


def fmt_bytes(n: int | float) -> str:
    """``6442450944`` -> ``"6.00 GiB"`` (binary units, 2 decimals; MiB below 1 GiB)."""
    if abs(n) >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB" if abs(n) >= 10 * MiB else f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class EngineMemory:
    """One engine's device memory at one request shape.

    Attributes:
        name: component name ("text_encoder", "unet", "vae_decoder"...).
        weights: bytes its weights hold on the device while it is open.
        activations: bytes of scratch it needs while it runs at the request's shape (ORT: its arena beyond the
            weights; TensorRT: ``device_memory_size`` of the profile).
        weights_source, activations_source: where each figure comes from, one phrase ("estimated: initializer
            bytes", "measured on NVIDIA H200 at 1x512x512", "tensorrt: device_memory_size_v2", ...).
        streamable: TensorRT weight streaming: bytes of ``weights`` that may stay on the host
            (``engine.streamable_weights_size``); 0 = none.
        tiled_activations: the VAE decoder's activations when it decodes one tile instead of the whole image;
            ``None`` = tiling does not apply (not the VAE, or the image is one tile).
    """

    name: str
    weights: int
    activations: int
    weights_source: str = "estimated"
    activations_source: str = "estimated"
    streamable: int = 0
    tiled_activations: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "weights_bytes": self.weights, "weights_source": self.weights_source,
            "activations_bytes": self.activations, "activations_source": self.activations_source,
            "streamable_bytes": self.streamable, "tiled_activations_bytes": self.tiled_activations,
        }


@dataclass(frozen=True)
class ResidencyPlan:
    """Which engines stay open and which are opened per stage, and what that needs.

    Attributes:
        name: one of :data:`PLANS` ("all_resident", "text_encoder_offloaded", "unet_resident", "per_stage").
        resident: components open for the pipeline's lifetime.
        per_stage: components opened when their stage starts and released when it ends.
        vae_tiled: decode the image tile by tile (:mod:`.vae_tiling`).
        stage_peaks: predicted peak device bytes per stage ("text", "unet", "vae").
        budget: the budget, bytes; overhead: the non-engine bytes counted in every stage.
        arena_limits: ONNX Runtime engines: the ``gpu_mem_limit`` (bytes) each session's arena gets: the budget
            minus everything else open at the same time in its stages.
        weight_streaming: TensorRT engines streamed from the host: bytes of weights kept on the device
            (``engine.weight_streaming_budget_v2``); empty = no streaming.
        engines: the facts the plan was made from.
        candidates: every plan considered, fastest first: ``(label, peak bytes)``.
    """

    name: str
    resident: frozenset[str]
    per_stage: tuple[str, ...]
    vae_tiled: bool
    stage_peaks: dict[str, int]
    budget: int
    overhead: int
    arena_limits: dict[str, int] = field(default_factory=dict)
    weight_streaming: dict[str, int] = field(default_factory=dict)
    engines: dict[str, EngineMemory] = field(default_factory=dict)
    candidates: tuple[tuple[str, int], ...] = ()

    @property
    def peak(self) -> int:
        """The predicted peak over all stages, bytes."""
        return max(self.stage_peaks.values())

    @property
    def label(self) -> str:
        """``name`` plus "+ tiled VAE" / "+ weight streaming" where they apply."""
        return _label(self.name, self.vae_tiled, bool(self.weight_streaming))

    def stage_of(self, component: str) -> str | None:
        """The stage ("text", "unet", "vae") a component belongs to; ``None`` for others (the VAE encoder)."""
        return next((s for s, comps in STAGES if component in comps), None)

    def describe(self) -> str:
        """One line: the plan, its peaks per stage and the budget."""
        peaks = ", ".join(f"{s} {fmt_bytes(b)}" for s, b in self.stage_peaks.items())
        return f"{self.label}: peak {fmt_bytes(self.peak)} of {fmt_bytes(self.budget)} ({peaks})"

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.name, "label": self.label, "resident": sorted(self.resident),
            "per_stage": list(self.per_stage), "vae_tiled": self.vae_tiled, "budget_bytes": self.budget,
            "overhead_bytes": self.overhead, "stage_peaks_bytes": dict(self.stage_peaks),
            "arena_limits_bytes": dict(self.arena_limits), "weight_streaming_bytes": dict(self.weight_streaming),
            "engines": {n: e.to_json() for n, e in self.engines.items()},
            "candidates": [{"plan": label, "peak_bytes": b} for label, b in self.candidates],
        }


def _label(name: str, tiled: bool, streaming: bool) -> str:
    return name + (" + tiled VAE" if tiled else "") + (" + weight streaming" if streaming else "")


def _stage_peaks(
    engines: Mapping[str, EngineMemory],
    resident: frozenset[str],
    tiled: bool,
    shared_activations: bool,
    overhead: int,
    weights: Mapping[str, int],
) -> tuple[dict[str, int], dict[str, set[str]]]:
    """Peak bytes per stage and the engines open in each (see the module docstring for the model)."""
    def act(e: EngineMemory) -> int:
        return e.tiled_activations if tiled and e.tiled_activations is not None else e.activations

    peaks: dict[str, int] = {}
    open_at: dict[str, set[str]] = {}
    shared = max((act(e) for e in engines.values()), default=0)
    for stage, comps in STAGES:
        present = [c for c in comps if c in engines]
        if not present:
            continue
        open_now = (set(resident) & set(engines)) | set(present)
        open_at[stage] = open_now
        w = sum(weights[c] for c in open_now)
        a = shared if shared_activations else sum(act(engines[c]) for c in open_now)
        peaks[stage] = overhead + w + a
    return peaks, open_at


def plan_residency(
    engines: Mapping[str, EngineMemory],
    budget: int,
    *,
    shared_activations: bool = False,
    overhead: int = DEFAULT_OVERHEAD_BYTES,
    overhead_source: str = "estimated",
    what: str = "",
) -> ResidencyPlan:
    """The fastest residency plan whose every stage fits ``budget``.

    Args:
        engines: facts for the text-to-image components (``text_encoder`` [, ``text_encoder_2``], ``unet``,
            ``vae_decoder``) at the request's shape.
        budget: device bytes the pipeline may use, > 0.
        shared_activations: TensorRT (one activation buffer for all engines) instead of ONNX Runtime (one arena
            per session).
        overhead: non-engine bytes counted in every stage (:data:`DEFAULT_OVERHEAD_BYTES`, an estimate).
        overhead_source: where ``overhead`` comes from, for the message ("estimated", "measured on ...").
        what: the request, for messages ("512x512, batch 1").

    Returns:
        The plan (:class:`ResidencyPlan`), with ORT arena limits / TensorRT weight-streaming budgets set.

    Raises:
        RuntimeInputError: no plan fits; the message gives each engine's figures with their sources, the
            smallest plan's stage peaks, and the smallest budget that works.
    """
    weights = {n: e.weights for n, e in engines.items()}
    tileable = any(e.tiled_activations is not None for e in engines.values())
    candidates: list[tuple[str, int]] = []
    best: ResidencyPlan | None = None
    for name, keep in PLANS:
        resident = frozenset(engines) if keep is None else keep & frozenset(engines)
        for tiled in (False, True) if tileable else (False,):
            peaks, open_at = _stage_peaks(engines, resident, tiled, shared_activations, overhead, weights)
            candidates.append((_label(name, tiled, False), max(peaks.values())))
            if best is None and max(peaks.values()) <= budget:
                best = _finish(name, resident, tiled, peaks, open_at, engines, budget, overhead,
                               shared_activations, weights, {})
    # last resort: per stage, tiled, with streamable TensorRT weights left on the host as far as needed
    streamable = {n: e.streamable for n, e in engines.items() if e.streamable > 0}
    if streamable:
        stream_w = {n: weights[n] - streamable.get(n, 0) for n in engines}
        peaks, open_at = _stage_peaks(engines, frozenset(), tileable, shared_activations, overhead, stream_w)
        candidates.append((_label("per_stage", tileable, True), max(peaks.values())))
        if best is None and max(peaks.values()) <= budget:
            kept = _streaming_budgets(engines, budget, tileable, shared_activations, overhead, weights, streamable)
            real_w = {n: kept.get(n, weights[n]) for n in engines}
            peaks, open_at = _stage_peaks(engines, frozenset(), tileable, shared_activations, overhead, real_w)
            best = _finish("per_stage", frozenset(), tileable, peaks, open_at, engines, budget, overhead,
                           shared_activations, real_w, kept)
    if best is not None:
        return replace(best, candidates=tuple(candidates))
    smallest_label, smallest = min(candidates, key=lambda c: c[1])
    facts = "; ".join(
        f"{n}: weights {fmt_bytes(e.weights)} ({e.weights_source}), activations {fmt_bytes(e.activations)}"
        + (f" / {fmt_bytes(e.tiled_activations)} tiled" if e.tiled_activations is not None else "")
        + f" ({e.activations_source})"
        + (f", {fmt_bytes(e.streamable)} streamable" if e.streamable else "")
        for n, e in engines.items()
    )
    raise RuntimeInputError(
        f"vram budget {fmt_bytes(budget)} ({budget} bytes) is below what this artifact needs"
        f"{' at ' + what if what else ''}: the smallest plan, {smallest_label}, peaks at {fmt_bytes(smallest)} "
        f"({smallest} bytes, incl. {fmt_bytes(overhead)} CUDA context and buffers, {overhead_source}). "
        f"Figures: {facts}. "
        f"Use --vram-budget {math.ceil(smallest / MiB)}MiB or more, or a smaller image size or batch"
    )


def _streaming_budgets(
    engines: Mapping[str, EngineMemory],
    budget: int,
    tiled: bool,
    shared_activations: bool,
    overhead: int,
    weights: Mapping[str, int],
    streamable: Mapping[str, int],
) -> dict[str, int]:
    """Per streamed engine, the weight bytes kept on the device: as many as its stage's headroom allows."""
    kept: dict[str, int] = {}
    for name, can in streamable.items():
        others = {n: (weights[n] - streamable.get(n, 0)) for n in engines}
        others[name] = 0
        peaks, _ = _stage_peaks(engines, frozenset(), tiled, shared_activations, overhead, others)
        stage = next(s for s, comps in STAGES if name in comps)
        room = budget - peaks[stage]
        kept[name] = max(weights[name] - can, min(weights[name], room))
    return kept


def _finish(
    name: str,
    resident: frozenset[str],
    tiled: bool,
    peaks: dict[str, int],
    open_at: Mapping[str, set[str]],
    engines: Mapping[str, EngineMemory],
    budget: int,
    overhead: int,
    shared_activations: bool,
    weights: Mapping[str, int],
    streaming: dict[str, int],
) -> ResidencyPlan:
    """The plan record, with each ORT session's arena limit: the budget minus all else open in its stages."""
    limits: dict[str, int] = {}
    if not shared_activations:
        for n, e in engines.items():
            own = weights[n] + (e.tiled_activations if tiled and e.tiled_activations is not None else e.activations)
            limits[n] = min(budget - (peaks[s] - own) for s, comps in open_at.items() if n in comps)
    per_stage = tuple(c for _, comps in STAGES for c in comps if c in engines and c not in resident)
    return ResidencyPlan(name, resident, per_stage, tiled, peaks, budget, overhead, limits, streaming,
                         dict(engines))


# -- facts ---------------------------------------------------------------------------------------------------


def onnx_initializer_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of an ONNX model's initializers (inline and external), without loading external data.

    This is the ESTIMATE of an ORT session's weight memory: ORT places every initializer on the device once;
    constant folding at session creation may add a few more (usually smaller than what it removes).

    Raises:
        ArtifactError: the file is missing or not a readable ONNX model.
    """
    import onnx
    from onnx import helper

    from ...artifact.folder import read_onnx_structure

    model = read_onnx_structure(path)
    total = 0
    graphs = [model.graph]
    while graphs:
        g = graphs.pop()
        for t in g.initializer:
            ext = {e.key: e.value for e in t.external_data}
            if t.data_location == onnx.TensorProto.EXTERNAL and "length" in ext:
                total += int(ext["length"])
            else:
                itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                total += math.prod(t.dims) * itemsize
        for node in g.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    graphs.append(a.g)
    return total


def estimated_activations(component: str, rows: int, height: int, width: int, fp32: bool) -> int:
    """The per-pixel ESTIMATE (:data:`ESTIMATE_BYTES_PER_PIXEL_ROW`) of ``component``'s activation bytes when it
    runs ``rows`` batch rows at an output of ``height`` x ``width`` pixels."""
    scale = 2 if fp32 else 1
    if component.startswith("text_encoder"):
        return ESTIMATE_TEXT_BYTES_PER_ROW * rows * scale
    per = ESTIMATE_BYTES_PER_PIXEL_ROW.get(component, 512)
    return per * rows * height * width * scale


def facts_path(manifest: Manifest) -> Path:
    """Where measured memory facts of an artifact are recorded: ``$DIFFUSION_TRT_CACHE`` (default
    ``~/.cache/diffusion-trt``) ``/memory/<manifest_sha256>.json`` (keyed by the sealed manifest, so facts never
    outlive the artifact they were measured on; the artifact folder itself stays as compiled)."""
    root = Path(os.environ.get("DIFFUSION_TRT_CACHE", "~/.cache/diffusion-trt")).expanduser()
    return root / "memory" / f"{manifest.seal or 'unsealed'}.json"


def load_memory_facts(path: str | os.PathLike[str] | None, manifest: Manifest) -> dict[str, Any]:
    """Recorded measurements for this artifact (``{}`` when none): ``path``, or :func:`facts_path`.

    Format (``schema`` :data:`FACTS_SCHEMA`)::

        {"schema": "diffusion-trt/memory/1", "manifest_sha256": str, "device": str, "overhead_bytes": int|null,
         "engines": {name: {"weights_bytes": int, "activations": [{"rows": int, "height": int, "width": int,
                                                                    "bytes": int}]}}}

    ``rows`` = batch rows the engine ran, ``height``/``width`` = the image's pixels (text encoders: 1 and 1, their
    activations do not depend on the image); a figure at another shape is scaled linearly in rows x pixels.

    Raises:
        RuntimeInputError: ``path`` was given and is unreadable, or holds facts of another artifact.
    """
    p = Path(path) if path is not None else facts_path(manifest)
    if not p.is_file():
        if path is not None:
            raise RuntimeInputError(f"memory facts file {p} does not exist; record it with benchmarks/gpu_vram.py")
        return {}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeInputError(f"memory facts file {p} is unreadable ({e}); record it again") from e
    if data.get("schema") != FACTS_SCHEMA or data.get("manifest_sha256") != manifest.seal:
        if path is not None:
            raise RuntimeInputError(
                f"memory facts file {p} is for artifact manifest {data.get('manifest_sha256')!r}, not this one "
                f"({manifest.seal!r}); record facts for this artifact"
            )
        return {}
    return data


def record_memory_facts(path: str | os.PathLike[str], manifest: Manifest, device: str,
                        engines: Mapping[str, Mapping[str, Any]], overhead: int | None = None) -> Path:
    """Merge measured figures into the facts file at ``path`` (see :func:`load_memory_facts` for the format):
    ``engines`` = ``{name: {"weights_bytes": int|None, "activations": [{"rows", "height", "width", "bytes"}]}}``.
    Returns ``path``."""
    p = Path(path)
    old = {}
    if p.is_file():
        try:
            old = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            old = {}
    if old.get("manifest_sha256") != manifest.seal:
        old = {}
    merged: dict[str, Any] = dict(old.get("engines", {}))
    for name, rec in engines.items():
        entry = dict(merged.get(name, {}))
        if rec.get("weights_bytes") is not None:
            entry["weights_bytes"] = int(rec["weights_bytes"])
        acts = {(a["rows"], a["height"], a["width"]): a for a in entry.get("activations", [])}
        for a in rec.get("activations", []):
            acts[(a["rows"], a["height"], a["width"])] = {k: int(a[k]) for k in ("rows", "height", "width", "bytes")}
        entry["activations"] = sorted(acts.values(), key=lambda a: (a["rows"], a["height"], a["width"]))
        merged[name] = entry
    data = {"schema": FACTS_SCHEMA, "manifest_sha256": manifest.seal, "device": device,
            "overhead_bytes": overhead if overhead is not None else old.get("overhead_bytes"), "engines": merged}
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(data, indent=2), encoding="utf-8")
    return p


def _measured_activation(rec: Mapping[str, Any], rows: int, height: int, width: int) -> tuple[int, str] | None:
    """A recorded activation figure at this shape, or scaled linearly in rows x pixels from the nearest one."""
    acts = rec.get("activations") or []
    if not acts:
        return None
    want = rows * height * width
    best = min(acts, key=lambda a: abs(math.log(max(a["rows"] * a["height"] * a["width"], 1) / max(want, 1))))
    at = f"{best['rows']}x{best['height']}x{best['width']}"
    have = best["rows"] * best["height"] * best["width"]
    if have == want:
        return int(best["bytes"]), f"measured at {at}"
    return int(best["bytes"] * want / have), f"scaled from measured at {at} (rows x pixels)"


def engine_rows(component: str, batch: int, cfg: bool) -> int:
    """Batch rows a component runs for a request of ``batch`` images: the UNet and text encoders run the CFG
    batch (2x), the VAE one row per image."""
    return batch * (2 if cfg and (component == "unet" or component.startswith("text_encoder")) else 1)


def ort_engine_memory(
    component: str,
    onnx_path: str | os.PathLike[str],
    *,
    rows: int,
    height: int,
    width: int,
    fp32: bool,
    facts: Mapping[str, Any],
    tile: tuple[int, int] | None = None,
) -> EngineMemory:
    """Facts for one ORT engine at a request: weights from initializer bytes (ESTIMATED) or recorded
    (MEASURED); activations recorded (MEASURED, scaled) or from the per-pixel rule (ESTIMATED).

    Args:
        rows: batch rows the engine runs (:func:`engine_rows`); height, width: the image, pixels.
        fp32: the engine's precision is fp32 (estimates double).
        facts: :func:`load_memory_facts`'s result.
        tile: VAE decoder: the tile's (height, width) in pixels when tiling applies.
    """
    rec = (facts.get("engines") or {}).get(component, {})
    if component.startswith("text_encoder"):  # no pixel dependence: recorded (and looked up) at 1x1
        height = width = 1
        tile = None
    if rec.get("weights_bytes") is not None:
        weights, wsrc = int(rec["weights_bytes"]), f"measured on {facts.get('device', 'a GPU')}"
    else:
        weights, wsrc = onnx_initializer_bytes(onnx_path), "estimated: initializer bytes"
    measured = _measured_activation(rec, rows, height, width)
    if measured is not None:
        act, asrc = measured
    else:
        act, asrc = estimated_activations(component, rows, height, width, fp32), "estimated: per-pixel rule"
    tiled = None
    if tile is not None:
        m = _measured_activation(rec, rows, *tile)
        tiled = m[0] if m is not None else estimated_activations(component, rows, tile[0], tile[1], fp32)
    return EngineMemory(component, weights, act, wsrc, asrc, 0, tiled)


def ort_arena_options(limit: int) -> dict[str, str]:
    """CUDA provider options that cap one ORT session's arena at ``limit`` bytes and grow it by what is asked
    (``kSameAsRequested``), not by powers of two (``kNextPowerOfTwo``, ORT's default, overshoots a budget by up to
    2x). Source: ONNX Runtime CUDA execution provider docs, "gpu_mem_limit" and "arena_extend_strategy"."""
    return {"gpu_mem_limit": str(max(int(limit), 0)), "arena_extend_strategy": "kSameAsRequested"}


def request_shape(plan_height: int, plan_width: int, batch: int) -> str:
    """``"512x512, batch 1"`` for messages."""
    return f"{plan_height}x{plan_width}, batch {batch}"

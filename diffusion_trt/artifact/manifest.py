"""The typed, frozen view of ``manifest.json``: parsed once, right after the JSON Schema check and the seal.

Readers outside ``artifact/`` use these attributes, never the manifest's keys: a fact is named once here (with the
default the runtime gives it when an older artifact lacks it), and backends are a :class:`Backend`, not strings.
The compiler still writes manifests as plain JSON (``artifact.folder.write_manifest``).

``Manifest.from_json`` trusts its input to be schema-valid (:func:`~diffusion_trt.artifact.folder.read_manifest` and
:class:`~diffusion_trt.artifact.reader.ArtifactReader` check first); a key the schema leaves optional gets the default
documented on its attribute. The defaults of required keys only serve partial manifests written by hand (tests).
"""

from __future__ import annotations

import copy
import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: ControlNet component and tensor names, defined here once: the compiler writes them into artifacts, the runtime and
#: ``verify`` read them back (``compiler/controlnet.py``, ``runtime/controlnet.py``).
#: ``controlnet_<name>``: ControlNet ``<name>``, the residuals from the latent and its conditioning.
CONTROLNET_PREFIX = "controlnet_"
#: ``cond_embed_<name>``: ControlNet ``<name>``'s conditioning embedding, a component of its own (after the split).
EMBED_PREFIX = "cond_embed_"
#: The UNet with the ControlNet residuals as inputs (the plain ``unet`` has none).
UNET_CONTROLNET = "unet_controlnet"
#: The control image input (``cond_embed_<name>``'s; a ``controlnet_<name>``'s compiled before the split).
CONTROL_COND = "controlnet_cond"
#: ``cond_embed_<name>``'s output, ``controlnet_<name>``'s input (compiled after the split).
CONTROL_EMBEDDING = "controlnet_cond_embedding"


def lora_source(component: str) -> str | None:
    """The model a LoRA file names for ``component``'s weights (its keys' ``unet.`` / ``text_encoder.`` prefix):
    the component itself for ``unet``, ``text_encoder`` and ``text_encoder_2``, ``unet`` for ``unet_controlnet``
    (the same UNet with the ControlNet residuals as inputs); ``None`` for components no LoRA changes."""
    if component in ("unet", "text_encoder", "text_encoder_2"):
        return component
    return "unet" if component == UNET_CONTROLNET else None


class Backend(enum.StrEnum):
    """The engine library an artifact was built for; ``.value`` is what ``manifest.json`` holds.

    A ``str`` enum that prints as its value (``str``, ``format`` and ``repr`` give ``ort`` / ``'ort'``), so messages
    and JSON written from it read as they did when backends were strings.
    """

    ORT = "ort"
    TENSORRT = "tensorrt"
    TENSORRT_RTX = "tensorrt-rtx"

    @property
    def is_tensorrt(self) -> bool:
        """Either TensorRT library (full TensorRT or TensorRT-RTX): plans, CUDA only."""
        return self is not Backend.ORT

    def __repr__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class SizeRange:
    """``[min, opt, max]`` of one profile dimension (images per call, or pixels)."""

    min: int
    opt: int
    max: int

    @property
    def is_static(self) -> bool:
        """One value only (min == max)."""
        return self.min == self.max

    def to_list(self) -> list[int]:
        return [self.min, self.opt, self.max]


@dataclass(frozen=True)
class Profile:
    """The image-level profile every engine was built for: batch (images per call), height and width (pixels)."""

    batch: SizeRange
    height: SizeRange
    width: SizeRange

    @property
    def is_static(self) -> bool:
        """Every dimension has one value: the engines run one shape."""
        return all(r.is_static for r in (self.batch, self.height, self.width))

    @property
    def opt_size(self) -> tuple[int, int]:
        """(height, width) in pixels a call without sizes gets: the opt size, the one the engines were tuned for."""
        return self.height.opt, self.width.opt

    def to_json(self) -> dict[str, list[int]]:
        return {"batch": self.batch.to_list(), "height": self.height.to_list(), "width": self.width.to_list()}


@dataclass(frozen=True)
class ModelFacts:
    """The manifest's ``model``: facts of the compiled pipeline. ``None`` = not recorded (older artifacts); the
    users' defaults apply then (``LatentGeometry``: 4 channels, factor 8, scaling 0.18215)."""

    vae_scale_factor: int = 8
    text_max_length: int | None = None
    default_height: int | None = None
    default_width: int | None = None
    vae_scaling_factor: float | None = None
    unet_in_channels: int | None = None
    unet_out_channels: int | None = None
    latent_channels: int | None = None
    text_hidden_size: int | None = None
    #: "sd" (SD 1.x/2.x) or "sdxl": which loop runs; absent = "sd"
    architecture: str = "sd"
    prediction_type: str | None = None
    upcast_attention: bool | None = None
    text_encoder_2_hidden_size: int | None = None
    text_embeds_size: int | None = None
    time_ids_size: int | None = None
    #: SDXL: ``negative_prompt=None`` gives zero negative embeddings; absent = True (diffusers' default)
    force_zeros_for_empty_prompt: bool = True
    vae_force_upcast: bool | None = None

    @property
    def is_sdxl(self) -> bool:
        return self.architecture == "sdxl"

    @property
    def is_inpainting(self) -> bool:
        """More UNet input channels than latent channels (SD inpainting: 9 = 4 latents + 1 mask + 4 masked)."""
        return (self.unet_in_channels or 4) != (self.latent_channels or 4)


@dataclass(frozen=True)
class FileEntry:
    """One listed file: its sha256 (hex) and size in bytes."""

    sha256: str
    size: int


@dataclass(frozen=True)
class Component:
    """One compiled component (``components.<name>``).

    Attributes:
        name: ``unet``, ``text_encoder``, ``controlnet_canny``...
        precision: its precision ("fp32", "fp16", "int8"...); the artifact's when the entry has none.
        onnx, plan, refit_map, weight_inputs: artifact paths (``None`` when absent); files: every file of it.
        build: the backend's build facts (``BuildFacts`` JSON for a plan), read-only; ``{}`` when absent.
        spatial_conv_inputs: ORT ``--refittable``: some weight input is a spatial (3x3, strided...) Conv's weight
            (``--refit-convs``), so the engine cannot run NHWC on CUDA (:mod:`diffusion_trt.compiler.lora_slots`);
            the spatial Conv weights of the refit map are constants otherwise. An artifact with ``weight_inputs``
            compiled before the key existed had every Conv weight an input: True. False without ``weight_inputs``.
        spec: the entry as JSON (read-only), what the engines parse their I/O contract from
            (``EngineSpec.from_manifest``).
    """

    name: str
    precision: str
    onnx: str | None
    plan: str | None
    refit_map: str | None
    weight_inputs: str | None
    files: tuple[str, ...]
    build: Mapping[str, Any]
    spec: Mapping[str, Any] = field(repr=False)
    spatial_conv_inputs: bool = False

    @property
    def input_names(self) -> tuple[str, ...]:
        """The component's ONNX / engine input names, in manifest order (``components.<name>.inputs``): e.g. a
        ``controlnet_<name>`` takes ``controlnet_cond_embedding`` when compiled with its ``cond_embed_<name>``,
        ``controlnet_cond`` (the image) before that split."""
        return tuple(str(t["name"]) for t in self.spec.get("inputs", ()))

    @property
    def dtypes(self) -> dict[str, str]:
        """Tensor name -> manifest dtype ("float32"...) of every input and output, in manifest order."""
        return {t["name"]: t["dtype"] for t in [*self.spec.get("inputs", ()), *self.spec.get("outputs", ())]}


@dataclass(frozen=True)
class LoraRecord:
    """A LoRA merged at compile time (``loras[i]``): file name, sha256 of its bytes, scale, layers per component."""

    file: str
    sha256: str
    scale: float
    layers: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    """A parsed, schema-valid ``manifest.json`` (see ``data/manifest.schema.json`` for each key).

    Attributes:
        name: artifact folder name at compile time.
        backend: :class:`Backend`; device: "cpu" or "cuda" (compiled for); precision: the artifact's precision.
        profile: :class:`Profile`; model: :class:`ModelFacts`.
        scheduler_class: ``scheduler.class_name`` (``None``: the config's ``_class_name``);
            scheduler_config: its config file (default ``scheduler/scheduler_config.json``).
        tokenizer, tokenizer_2: tokenizer folders (``tokenizer_2``: SDXL; default ``tokenizer_2``).
        components: name -> :class:`Component`, in the manifest's order; files: path -> :class:`FileEntry`.
        loras: merged LoRAs; source_path: the compiled folder (informational), ``None`` when not recorded;
            source_sha256: ``folder_hash`` of that folder (or the single file's sha256), ``None`` when not recorded.
        pipeline_class: the diffusers class of the source pipeline, ``None`` when not recorded.
        deterministic: compiled with ``--deterministic`` or ``fuse_group_norm_deterministic=true`` (no atomicAdd
            GroupNorm kernels).
        partial: compiled with ``--components`` (cannot make images); seal: ``manifest_sha256`` (``None`` unsealed).
    """

    name: str
    created_utc: str
    backend: Backend
    device: str
    precision: str
    profile: Profile
    model: ModelFacts
    scheduler_class: str | None
    scheduler_config: str
    tokenizer: str
    tokenizer_2: str
    components: Mapping[str, Component]
    files: Mapping[str, FileEntry]
    loras: tuple[LoraRecord, ...]
    source_path: str | None
    source_sha256: str | None
    pipeline_class: str | None
    deterministic: bool
    partial: bool
    seal: str | None
    _json: Mapping[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Manifest:
        """The typed view of a schema-valid manifest (see the module docstring on defaults)."""
        config = data.get("config") or {}
        options = config.get("pass_options") or {}
        precision = str(data.get("precision", "fp32"))
        sched = data.get("scheduler") or {}
        return cls(
            name=str(data.get("name", "")),
            created_utc=str(data.get("created_utc", "")),
            backend=Backend(data.get("backend", "ort")),
            device=str(data.get("device", "cpu")),
            precision=precision,
            profile=_profile(data.get("profile")),
            model=_model(data.get("model") or {}),
            scheduler_class=sched.get("class_name") or None,
            scheduler_config=str(sched.get("config", "scheduler/scheduler_config.json")),
            tokenizer=str(data.get("tokenizer", "tokenizer")),
            tokenizer_2=str(data.get("tokenizer_2", "tokenizer_2")),
            components=MappingProxyType({n: _component(n, e, precision)
                                         for n, e in (data.get("components") or {}).items()}),
            files=MappingProxyType({rel: FileEntry(str(e["sha256"]), int(e["size"]))
                                    for rel, e in (data.get("files") or {}).items()}),
            loras=tuple(LoraRecord(str(r.get("file", "")), str(r.get("sha256", "")), float(r.get("scale", 1.0)),
                                   MappingProxyType(dict(r.get("layers") or {})))
                        for r in data.get("loras") or ()),
            source_path=(data.get("source") or {}).get("path") or None,
            source_sha256=(data.get("source") or {}).get("sha256") or None,
            pipeline_class=data.get("pipeline_class"),
            deterministic=config.get("deterministic") is True or options.get("fuse_group_norm_deterministic") is True,
            partial=data.get("partial") is True,
            seal=data.get("manifest_sha256"),
            _json=copy.deepcopy(dict(data)),
        )

    @classmethod
    def read(cls, root: str | os.PathLike[str]) -> Manifest:
        """:func:`~diffusion_trt.artifact.folder.read_manifest` (schema and seal checked), typed.

        Raises:
            ArtifactError: as ``read_manifest``.
        """
        from .folder import read_manifest

        return cls.from_json(read_manifest(root))

    def to_json(self) -> dict[str, Any]:
        """A private copy of the manifest's JSON (for ``inspect`` and for amending a manifest in the compiler)."""
        return copy.deepcopy(dict(self._json))

    @property
    def config_json(self) -> dict[str, Any]:
        """A copy of the ``CompileConfig`` JSON that made the artifact (``config``; ``{}`` when absent)."""
        return copy.deepcopy(dict(self._json.get("config") or {}))

    @property
    def model_json(self) -> dict[str, Any]:
        """A copy of the manifest's ``model`` as written (every key, also those :class:`ModelFacts` does not name),
        for the facts a server publishes."""
        return copy.deepcopy(dict(self._json.get("model") or {}))

    @property
    def compile_seconds(self) -> float | None:
        """Seconds the compile (or the compile cache's copy) took, as the manifest writes it; ``None`` when absent."""
        return self._json.get("compile_seconds")

    @property
    def profile_json(self) -> dict[str, list[int]]:
        """The profile as the manifest writes it (``{"batch": [min, opt, max], ...}``), for messages and logs."""
        return self.profile.to_json()

    def component(self, name: str) -> Component | None:
        """The component ``name`` ("unet", "controlnet_canny"...), ``None`` when the artifact has none of that name."""
        return self.components.get(name)

    def file_size(self, rel: str) -> int:
        """Bytes of the listed file ``rel``; 0 when it is not listed."""
        entry = self.files.get(rel)
        return entry.size if entry is not None else 0


def _range(value: Any, default: tuple[int, int, int]) -> SizeRange:
    lo, opt, hi = value if isinstance(value, list | tuple) and len(value) == 3 else default
    return SizeRange(int(lo), int(opt), int(hi))


def _profile(data: Any) -> Profile:
    data = data if isinstance(data, Mapping) else {}
    return Profile(_range(data.get("batch"), (1, 1, 1)), _range(data.get("height"), (512, 512, 512)),
                   _range(data.get("width"), (512, 512, 512)))


_MODEL_FIELDS = frozenset(ModelFacts.__dataclass_fields__)


def _model(data: Mapping[str, Any]) -> ModelFacts:
    return ModelFacts(**{k: v for k, v in data.items() if k in _MODEL_FIELDS})


def _component(name: str, entry: Mapping[str, Any], precision: str) -> Component:
    def path(key: str) -> str | None:
        value = entry.get(key)
        return str(value) if value is not None else None

    return Component(name=name, precision=str(entry.get("precision", precision)), onnx=path("onnx"), plan=path("plan"),
                     refit_map=path("refit_map"), weight_inputs=path("weight_inputs"),
                     files=tuple(str(f) for f in entry.get("files") or ()),
                     build=MappingProxyType(dict(entry.get("build") or {})),
                     spec=MappingProxyType(copy.deepcopy(dict(entry))),
                     spatial_conv_inputs=entry.get("spatial_conv_inputs",
                                                   entry.get("weight_inputs") is not None) is True)


def control_component_problems(inputs: Mapping[str, Sequence[str]]) -> list[str]:
    """What a ControlNet artifact lacks: a ``controlnet_<name>`` that takes ``controlnet_cond_embedding`` (compiled
    with its conditioning embedding as a component of its own) needs ``cond_embed_<name>``, which computes that input
    from the control image. One message per such ControlNet (cause, and the fix); ``[]`` when complete. A
    ``controlnet_<name>`` compiled before that split takes the image (``controlnet_cond``) and needs none.

    Args:
        inputs: each component's input names (``components.<name>.inputs``), by component name.
    """
    problems = []
    for component, names in inputs.items():
        if not component.startswith(CONTROLNET_PREFIX) or CONTROL_EMBEDDING not in names:
            continue
        name = component[len(CONTROLNET_PREFIX):]
        if EMBED_PREFIX + name not in inputs:
            problems.append(
                f"{component} takes {CONTROL_EMBEDDING} but the artifact has no {EMBED_PREFIX}{name}, which "
                f"computes it from the control image; the artifact is incomplete: recompile it with --controlnet, or "
                f"run add-controlnet ARTIFACT MODEL {name}=FOLDER --replace")
    return problems


def embedding_shape_problems(components: Mapping[str, Any]) -> list[str]:
    """Where ``cond_embed_<name>``'s output ``controlnet_cond_embedding`` is not the shape ``controlnet_<name>`` takes
    (e.g. C0 = 8 against 16): both are compiled together from one ControlNet, so a mismatch is
    a hand-made or mixed artifact, which ran the text encoder and ``cond_embed_<name>`` before an engine refused it.
    One message per such ControlNet; ``[]`` when they agree (or either side is absent or malformed: other checks say).

    Args:
        components: the manifest's ``components`` (JSON), by component name.
    """
    def tensor(entry: Any, key: str) -> Mapping[str, Any] | None:
        items = entry.get(key) if isinstance(entry, Mapping) else None
        found = [t for t in items if isinstance(t, Mapping) and t.get("name") == CONTROL_EMBEDDING] \
            if isinstance(items, list) else []
        return found[0] if found else None

    problems = []
    for component, entry in components.items():
        if not component.startswith(EMBED_PREFIX):
            continue
        name = component[len(EMBED_PREFIX):]
        out, taken = tensor(entry, "outputs"), tensor(components.get(CONTROLNET_PREFIX + name), "inputs")
        if out is None or taken is None:
            continue
        got, want = out.get("shape"), taken.get("shape")  # the dtype may differ: the runtime casts the feed
        if got != want:
            problems.append(
                f"{component} gives {CONTROL_EMBEDDING} {got} but {CONTROLNET_PREFIX}{name} takes {want}; the two "
                f"are not from one ControlNet: run add-controlnet ARTIFACT MODEL {name}=FOLDER --replace, or "
                "recompile with --controlnet")
    return problems


def amend_source(manifest: dict[str, Any], **fields: Any) -> None:
    """Update the ``source`` record of a manifest's JSON before it is (re)sealed, in place: the fields given replace
    their keys, the others stay (``path`` of a cached artifact's new model folder, ``single_file``, ``hub``). The one
    place outside the typed :class:`Manifest` where a manifest's keys are touched by name."""
    manifest["source"] = {**manifest.get("source", {}), **fields}

"""The build facts of a TensorRT / TensorRT-RTX plan: :class:`BuildFacts`, typed, frozen and versioned.

::

    compiler/build_trt.engine_from_onnx ──BuildFacts.to_json()──► manifest.json ``components.<name>.build``
        ──BuildFacts.from_json()──► runtime (trt_engine, runtime_cache), verify, trt_compat's host checks, inspect

The JSON form is the manifest's ``build`` object, key for key as it has always been written (the schema's
``trt_component`` / ``rtx_component`` require some of them; existing artifacts stay readable). The version,
:data:`FACTS_VERSION`, is not written into that object: a manifest without ``facts_version`` holds version 1, and
:meth:`BuildFacts.from_json` refuses a newer one. An ONNX Runtime component's ``build`` is a different, two-key
object (``providers``, ``test_loaded``; ``compiler/build_ort.py``).

Imports nothing but the errors: the runtime, ``verify`` and the compiler all import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ArtifactError

#: The layout of :class:`BuildFacts`; a change to its keys or their meaning raises it.
FACTS_VERSION = 1


@dataclass(frozen=True)
class BuildFacts:
    """What the build stage records about one plan (the manifest's ``components.<name>.build``).

    Attributes:
        engine, library: "tensorrt" or "tensorrt-rtx" (both the same: ``engine`` is the older name).
        tensorrt: the library's version that built the plan ("10.8.0.43", "1.7.1.116").
        gpu: the build GPU's name; ``None`` for a TensorRT-RTX build on a machine without one.
        compute_capability: the build GPU's ("9.0"); ``None`` for TensorRT-RTX (see ``compute_capabilities``).
        compute_capabilities: the GPUs the plan runs on: TensorRT-RTX's targets; full TensorRT: the build GPU's.
        precision: the component's precision ("fp32", "fp16", "bf16", "int8", "fp8").
        flags: the builder precision flags set (empty for strongly typed networks).
        strongly_typed: the network was built strongly typed (types from the graph).
        has_qdq: the graph carries QuantizeLinear/DequantizeLinear nodes.
        builder_optimization_level: the level the builder ran at (0..5).
        workspace_bytes: the WORKSPACE pool limit, bytes; ``None`` = TensorRT's default.
        refittable: built with ``BuilderFlag.REFIT``.
        profiles: the optimization profiles in TensorRT order, ``{"kind", "inputs": {name: {"min", "opt", "max"}}}``.
        num_layers: layers of the parsed network.
        build_seconds: seconds ``build_serialized_network`` took.
        plan: the plan's file name inside the component folder ("model.plan").
        plan_sha256, plan_bytes: the plan file's hash and size (checked before it is deserialised).
        timing_cache: ``{"file", "loaded", "saved", "ignored"}`` of the timing cache the build used.
        runtime_cache: TensorRT-RTX: the runtime cache's file name (kept outside the artifact); else ``None``.
        config: the ``TrtBuildConfig`` it was built with (``TrtBuildConfig.to_json``).
    """

    engine: str
    library: str
    tensorrt: str
    gpu: str | None
    compute_capability: str | None
    compute_capabilities: tuple[str, ...]
    precision: str
    flags: tuple[str, ...]
    strongly_typed: bool
    has_qdq: bool
    builder_optimization_level: int | None
    workspace_bytes: int | None
    refittable: bool
    profiles: tuple[Mapping[str, Any], ...]
    num_layers: int
    build_seconds: float
    plan: str
    plan_sha256: str
    plan_bytes: int
    timing_cache: Mapping[str, Any]
    runtime_cache: str | None
    config: Mapping[str, Any]

    def __post_init__(self) -> None:
        for name in ("compute_capabilities", "flags", "profiles"):
            object.__setattr__(self, name, tuple(getattr(self, name)))

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``build`` object (lists for the sequences; same keys, same order as ever)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("compute_capabilities", "flags"):
            data[name] = list(data[name])
        data["profiles"] = [dict(p) for p in self.profiles]
        data["timing_cache"] = dict(self.timing_cache)
        data["config"] = dict(self.config)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "the manifest's build facts") -> BuildFacts:
        """Parse a manifest's ``build`` object; keys this version does not know are ignored.

        Raises:
            ArtifactError: not an object, a missing key (named), a ``facts_version`` newer than
                :data:`FACTS_VERSION`, or a value of the wrong type (named with its value).
        """
        if not isinstance(data, Mapping):
            raise ArtifactError(f"{where}: expected a JSON object, got {type(data).__name__}; recompile the artifact")
        version = data.get("facts_version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FACTS_VERSION:
            raise ArtifactError(f"{where}: facts_version={version!r}, this diffusion-trt reads 1..{FACTS_VERSION}: "
                                "upgrade diffusion-trt or recompile the artifact")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data]
        if missing:
            raise ArtifactError(f"{where} lack {', '.join(map(repr, missing))}; recompile the artifact with this "
                                "diffusion-trt version")
        values = {f.name: data[f.name] for f in dataclasses.fields(cls)}
        for name, kinds in _TYPES.items():
            value = values[name]
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                wanted = " or ".join(k.__name__ for k in kinds)
                raise ArtifactError(f"{where}: {name}={value!r}, expected {wanted}; recompile the artifact")
        return cls(**values)


_OPT_STR = (str, type(None))
_OPT_INT = (int, type(None))
#: JSON types per field, checked by :meth:`BuildFacts.from_json`.
_TYPES: dict[str, tuple[type, ...]] = {
    "engine": (str,), "library": (str,), "tensorrt": (str,), "gpu": _OPT_STR, "compute_capability": _OPT_STR,
    "compute_capabilities": (list, tuple), "precision": (str,), "flags": (list, tuple), "strongly_typed": (bool,),
    "has_qdq": (bool,), "builder_optimization_level": _OPT_INT, "workspace_bytes": _OPT_INT, "refittable": (bool,),
    "profiles": (list, tuple), "num_layers": (int,), "build_seconds": (int, float), "plan": (str,),
    "plan_sha256": (str,), "plan_bytes": (int,), "timing_cache": (Mapping,), "runtime_cache": _OPT_STR,
    "config": (Mapping,),
}

#: The keys of the manifest's ``build`` object of a plan, in the order they are written.
BUILD_FACT_KEYS: Sequence[str] = tuple(f.name for f in dataclasses.fields(BuildFacts))

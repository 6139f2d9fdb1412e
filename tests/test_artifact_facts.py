"""BuildFacts: the typed build facts of a plan, as the manifest's ``components.<name>.build`` holds them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diffusion_trt.artifact.facts import BUILD_FACT_KEYS, FACTS_VERSION, BuildFacts
from diffusion_trt.errors import ArtifactError

#: a tensorrt-rtx component's build facts, as build_trt.engine_from_onnx writes them (key order included)
FACTS: dict[str, Any] = {
    "engine": "tensorrt-rtx",
    "library": "tensorrt-rtx",
    "tensorrt": "1.7.1.116",
    "gpu": None,
    "compute_capability": None,
    "compute_capabilities": ["8.6", "8.9"],
    "precision": "fp16",
    "flags": [],
    "strongly_typed": True,
    "has_qdq": False,
    "builder_optimization_level": 3,
    "workspace_bytes": None,
    "refittable": False,
    "profiles": [{"kind": "dynamic", "inputs": {"x": {"min": [1, 4], "opt": [2, 4], "max": [8, 4]}}}],
    "num_layers": 1,
    "build_seconds": 0.25,
    "plan": "model.plan",
    "plan_sha256": "ab" * 32,
    "plan_bytes": 1234,
    "timing_cache": {"file": None, "loaded": False, "saved": False, "ignored": "TensorRT-RTX builds without timing"},
    "runtime_cache": "unet.runtime-cache",
    "config": {"library": "tensorrt-rtx", "compute_capabilities": ["8.6", "8.9"]},
}


def test_round_trip_is_byte_identical_json() -> None:
    facts = BuildFacts.from_json(FACTS)
    assert facts.compute_capabilities == ("8.6", "8.9") and facts.plan_bytes == 1234 and facts.gpu is None
    assert json.dumps(facts.to_json()) == json.dumps(FACTS)  # same keys, same order, same values
    assert tuple(FACTS) == BUILD_FACT_KEYS and FACTS_VERSION == 1


def test_a_missing_key_is_named() -> None:
    partial = {k: v for k, v in FACTS.items() if k not in ("plan_sha256", "profiles")}
    with pytest.raises(ArtifactError, match=r"lack 'profiles', 'plan_sha256'; recompile"):
        BuildFacts.from_json(partial, "engine 'unet'")


def test_wrong_types_and_a_newer_version_are_refused() -> None:
    with pytest.raises(ArtifactError, match=r"plan_bytes='1234', expected int"):
        BuildFacts.from_json({**FACTS, "plan_bytes": "1234"})
    with pytest.raises(ArtifactError, match=r"num_layers=True, expected int"):
        BuildFacts.from_json({**FACTS, "num_layers": True})
    with pytest.raises(ArtifactError, match=r"facts_version=2, this diffusion-trt reads 1\.\.1"):
        BuildFacts.from_json({**FACTS, "facts_version": 2})
    with pytest.raises(ArtifactError, match="expected a JSON object"):
        BuildFacts.from_json([])  # type: ignore[arg-type]
    assert BuildFacts.from_json({**FACTS, "facts_version": 1, "later_key": 0}).to_json() == FACTS


def test_frozen() -> None:
    facts = BuildFacts.from_json(FACTS)
    with pytest.raises(AttributeError):
        facts.plan = "other.plan"  # type: ignore[misc]


def test_the_trt_engine_takes_the_typed_facts(tmp_path: Path) -> None:
    from diffusion_trt.runtime.engines.trt_engine import TrtEngine
    from tests.runtime.test_trt_engine import UNET_ENTRY

    engine = TrtEngine(tmp_path / "model.plan", UNET_ENTRY, name="unet", build=BuildFacts.from_json(FACTS),
                       backend="tensorrt-rtx")
    assert engine._build == FACTS  # kept in the manifest's JSON form, which the host checks read

"""CompileConfig's backend: the one ``Backend`` enum inside, the same plain strings in JSON and messages."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from diffusion_trt.artifact import folder as artifacts
from diffusion_trt.artifact.manifest import Backend
from diffusion_trt.compiler.plan import plan_components
from diffusion_trt.compiler.quantize import QuantizeSpec
from diffusion_trt.config import CompileConfig, split_scale
from diffusion_trt.errors import RuntimeInputError

#: The strings manifest.json held for each backend before CompileConfig.backend was the enum.
OLD_LITERALS = {Backend.ORT: "ort", Backend.TENSORRT: "tensorrt", Backend.TENSORRT_RTX: "tensorrt-rtx"}
#: Test ids (an id "tensorrt" would read as the `tensorrt` marker, skipped without TensorRT).
IDS = ["ort", "full-trt", "rtx"]


def _strings(value: Any) -> list[Any]:
    """Every string in a JSON-like value, keys included."""
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def _config(backend: str | Backend) -> CompileConfig:
    return CompileConfig(backend=backend, device="cpu" if backend == "ort" else "cuda")


@pytest.mark.parametrize("given", [*OLD_LITERALS.values(), *Backend], ids=[f"{i}-{k}" for k in ("str", "enum")
                                                                         for i in IDS])
def test_backend_is_parsed_once_into_the_enum(given: str | Backend) -> None:
    config = _config(given)
    assert type(config.backend) is Backend and config.backend is Backend(given)
    assert CompileConfig.from_json(config.to_json()) == config
    assert type(CompileConfig().backend) is Backend and CompileConfig().backend is Backend.ORT


@pytest.mark.parametrize("backend", list(Backend), ids=IDS)
def test_config_and_plan_json_hold_the_plain_strings_of_before(backend: Backend) -> None:
    """StrEnum members dump as their value, but the JSON the compiler writes holds exact ``str`` (no enum object
    reaches manifest.json), and its canonical bytes (the seal's input) are those of the old literals."""
    config = _config(backend)
    data = config.to_json()
    assert type(data["backend"]) is str and data["backend"] == OLD_LITERALS[backend]
    plan = plan_components(config, {"architecture": "sd"}, ["unet"])["unet"].to_json()
    assert type(plan["engine"]) is str and plan["engine"] == OLD_LITERALS[backend]
    assert type(plan["passes"]["backend"]) is str and plan["passes"]["backend"] == ("ort" if backend == "ort"
                                                                                      else "tensorrt")
    settings = QuantizeSpec("int8", Backend.TENSORRT if backend.is_tensorrt else backend).settings()  # quantization
    assert type(settings["backend"]) is str and settings["backend"] == plan["passes"]["backend"]
    for value in (data, plan, settings):
        assert all(type(s) is str for s in _strings(value))
    old = {**data, "backend": OLD_LITERALS[backend]}
    assert artifacts.canonical_json(data) == artifacts.canonical_json(old)
    assert json.dumps(data, indent=1) == json.dumps(old, indent=1)


def test_tiny_artifact_manifest_reads_the_plain_backend(tiny_artifact) -> None:  # type: ignore[no-untyped-def]
    raw = (tiny_artifact / "manifest.json").read_text(encoding="utf-8")
    manifest = json.loads(raw)
    assert manifest["backend"] == "ort" and manifest["config"]["backend"] == "ort"
    assert manifest["components"]["unet"]["compile_plan"]["engine"] == "ort"
    assert '"backend": "ort"' in raw


@pytest.mark.parametrize("bad", ["onnx", "ORT", "TensorRT", "", 3, None])
def test_an_unknown_backend_is_refused_with_the_known_ones(bad: Any) -> None:
    with pytest.raises(RuntimeInputError) as e:
        CompileConfig(backend=bad)
    assert str(e.value) == f"backend={bad!r} is not supported; use one of ort, tensorrt, tensorrt-rtx"


def test_refit_convs_is_in_the_json_only_when_set() -> None:
    """--refit-convs (ORT --refittable with spatial Conv weights as inputs): a config without it writes the JSON of
    before (manifests, compile cache keys), one with it round-trips."""
    assert "refit_convs" not in CompileConfig(refittable=True).to_json()
    config = CompileConfig(refittable=True, refit_convs=True)
    assert config.to_json()["refit_convs"] is True and CompileConfig.from_json(config.to_json()) == config
    with pytest.raises(RuntimeInputError, match="refit_convs='yes' must be True or False"):
        CompileConfig(refittable=True, refit_convs="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "kwargs", "expected"), [
    ("canny", {}, ("canny", "", 0.5)),
    ("canny:0.8", {}, ("canny", "0.8", 0.8)),
    (":0.8", {}, ("", "0.8", 0.8)),
    ("C:/loras/a:0.3", {"at_last": True}, ("C:/loras/a", "0.3", 0.3)),
    ("a:b:0.3", {}, ("a", "b:0.3", math.nan)),  # the first ':' without at_last
    ("a:1_0", {}, ("a", "1_0", math.nan)),  # float() reads 1_0 as 10
    ("style:", {"empty_is_default": True}, ("style", "", 0.5)),
])
def test_split_scale(text: str, kwargs: dict[str, bool], expected: tuple[str, str, float]) -> None:
    name, scale_text, scale = split_scale(text, 0.5, **kwargs)
    assert (name, scale_text) == expected[:2]
    assert scale == expected[2] or (math.isnan(scale) and math.isnan(expected[2]))


@pytest.mark.parametrize("text", ["a:", "a:lots", "a:nan", "a: "])
def test_split_scale_gives_nan_for_what_is_not_a_number(text: str) -> None:
    """NaN (or a float's own nan/inf) for the caller's one finiteness check, never an exception."""
    assert not math.isfinite(split_scale(text, 1.0)[2])

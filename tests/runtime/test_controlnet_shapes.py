"""The ``h/k`` symbols of the ControlNet residuals: ceil(h / k), in the engine spec and the compile profile."""

from __future__ import annotations

import math

import pytest

from diffusion_trt.compiler.components import symbol_ranges
from diffusion_trt.config import Range, ShapeProfile
from diffusion_trt.errors import ArtifactError
from diffusion_trt.runtime.engines.engine import EngineSpec


def _t(name: str, shape: list[object]) -> dict[str, object]:
    return {"name": name, "dtype": "float32", "shape": shape, "min": [1 if isinstance(d, str) else d for d in shape],
            "opt": [2 if isinstance(d, str) else d for d in shape], "max": [64 if isinstance(d, str) else d
                                                                           for d in shape]}


@pytest.mark.parametrize(("h", "w"), [(8, 8), (9, 5), (1, 1), (17, 64)])
def test_output_shapes_are_ceil_divisions(h: int, w: int) -> None:
    spec = EngineSpec.from_manifest("controlnet_a", {"inputs": [_t("sample", ["B2", 4, "h", "w"])],
                                                     "outputs": [_t("r", ["B2", 4, "h/8", "w/2"])]})
    assert spec.output_shapes({"B2": 2, "h": h, "w": w})["r"] == (2, 4, math.ceil(h / 8), math.ceil(w / 2))


def test_an_unbound_base_is_refused() -> None:
    with pytest.raises(ArtifactError, match="has dim 'q/2' that no input determines"):
        EngineSpec.from_manifest("x", {"inputs": [_t("sample", ["B2", 4, "h", "w"])],
                                       "outputs": [_t("r", ["B2", 4, "q/2", "w"])]})


def test_profile_ranges_of_the_downsampled_symbols() -> None:
    ranges = symbol_ranges(ShapeProfile(batch=Range(1, 1, 4), height=Range(40, 64, 136), width=Range(64, 64, 64)))
    assert ranges["h"] == (5, 8, 17)
    assert ranges["h/2"] == (3, 4, 9) and ranges["h/4"] == (2, 2, 5) and ranges["h/8"] == (1, 1, 3)
    assert ranges["w/8"] == (1, 1, 1)

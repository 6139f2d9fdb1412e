"""save_png writes the generation parameters as JSON in the PNG text chunk "parameters"."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffusion_trt.errors import RuntimeInputError
from diffusion_trt.runtime.png import read_png_parameters, save_png


def image() -> Image.Image:
    return Image.fromarray(np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3))


def test_round_trip(tmp_path: Path) -> None:
    params = {
        "prompt": "un chat très mignon, 猫",
        "negative_prompt": None,
        "num_inference_steps": 30,
        "guidance_scale": 7.5,
        "seed": 2**63 - 1,
        "scheduler": "euler_a",
        "artifact": tmp_path,  # not JSON: written with str()
    }
    path = save_png(image(), tmp_path / "sub" / "out.png", params)
    assert path == tmp_path / "sub" / "out.png"
    with Image.open(path) as im:
        assert im.text["parameters"].startswith("{")
        assert np.array_equal(np.asarray(im), np.asarray(image()))
    assert read_png_parameters(path) == {**params, "artifact": str(tmp_path)}
    assert [p.name for p in path.parent.iterdir()] == ["out.png"]  # no temporary file left behind


def test_without_parameters(tmp_path: Path) -> None:
    path = save_png(image(), tmp_path / "plain.png")
    assert read_png_parameters(path) is None


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(RuntimeInputError, match=r"ndarray.*output_type='pil'"):
        save_png(np.zeros((8, 8, 3), np.uint8), tmp_path / "a.png", {})
    with pytest.raises(RuntimeInputError, match=r"does not end in \.png; use e\.g\. a\.png"):
        save_png(image(), tmp_path / "a.jpg", {})

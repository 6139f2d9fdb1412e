"""Scales from Python (ControlNet conditioning scale and guidance window, LoRA scale): NumPy scalars are numbers."""

from __future__ import annotations

import numpy as np
import pytest

from diffusion_trt.config import is_real_number
from diffusion_trt.errors import LoraError, RuntimeInputError
from diffusion_trt.lora import check_scale
from diffusion_trt.runtime.controlnet import _finite


@pytest.mark.parametrize("value", [1, 0.8, np.float32(0.8), np.float64(0.8), np.int64(2), np.float16(0.5)])
def test_ints_floats_and_numpy_scalars_are_scales(value: object) -> None:
    """np.float32 is no Python float: `np.float32(0.8)` from an array was refused as "not a finite float32 number"."""
    assert is_real_number(value)
    assert _finite(value, "controlnet_conditioning_scale", 1.0) == pytest.approx(float(value))  # type: ignore[arg-type]
    assert check_scale(value) == pytest.approx(float(value))  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, np.bool_(True), "0.8", None, 1 + 0j, np.array([0.8])])
def test_bools_strings_and_arrays_are_not(value: object) -> None:
    assert not is_real_number(value)
    with pytest.raises(RuntimeInputError, match=r"controlnet_conditioning_scale=.* is not a finite float32 number"):
        _finite(value, "controlnet_conditioning_scale", 1.0)
    with pytest.raises(LoraError, match=r"LoRA scale=.* must be a finite number"):
        check_scale(value)


@pytest.mark.parametrize("value", [np.float32("nan"), np.float64("inf"), 1e39])
def test_non_finite_numpy_scalars_are_refused(value: object) -> None:
    with pytest.raises(RuntimeInputError, match="is not a finite float32 number"):
        _finite(value, "controlnet_conditioning_scale", 1.0)

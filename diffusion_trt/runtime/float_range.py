"""The range of the float32 tensors that caller-given numbers (scales, prompt weights, guidance) end up in.

Standard library only: ``prompt_syntax`` imports it, and ``export-triton`` copies both files beside the Triton
pipeline model, where no diffusion-trt package is installed (``serve/triton_repo.py``).
"""

from __future__ import annotations

import math

#: The largest finite float32 (``torch.finfo(torch.float32).max``): a number beyond it, finite as a Python float, is
#: inf once it is a float32 tensor's value on the engines' side.
FLOAT32_MAX = 3.4028234663852886e38


def finite_in_float32(value: float) -> bool:
    """Whether ``value`` is finite and within float32's range (a scale of 1e39 is finite, and overflows on the
    device)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX

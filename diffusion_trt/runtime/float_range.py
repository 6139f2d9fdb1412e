"""The range of the float32 tensors that caller-given numbers (scales, prompt weights, guidance) end up in.

Standard library only: ``prompt_syntax`` imports it, and ``export-triton`` copies both files beside the Triton
pipeline model, where no diffusion-trt package is installed (``serve/triton_repo.py``).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

#: The largest finite float32 (``torch.finfo(torch.float32).max``): a number beyond it, finite as a Python float, is
#: inf once it is a float32 tensor's value on the engines' side.
FLOAT32_MAX = 3.4028234663852886e38


def finite_in_float32(value: float) -> bool:
    """Whether ``value`` is finite and within float32's range (a scale of 1e39 is finite, and overflows on the
    device)."""
    return math.isfinite(value) and abs(value) <= FLOAT32_MAX


def is_real_number(value: Any) -> bool:
    """Whether ``value`` is a real number a caller may pass as a scale: an int, a float or a NumPy scalar of either
    (``numbers.Real``; ``np.float32`` is no ``float``), not a bool (``True`` is an int to Python, never a scale;
    ``np.bool_`` is no ``numbers.Real``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


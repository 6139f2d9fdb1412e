"""The deterministic mode (``EnginePipeline.from_artifacts(..., deterministic=True)``, CLI ``--deterministic``).

What it switches on:

* ONNX Runtime: ``SessionOptions.use_deterministic_compute = True`` on every session. ORT's CUDA kernels that
  have a deterministic variant use it then (e.g. reductions leave their atomics-based fast path).
* torch, for our own ops in the loop (CFG combine, ``scheduler.step`` on the GPU):
  ``torch.use_deterministic_algorithms(True, warn_only=True)`` and ``torch.backends.cudnn.deterministic``, only
  while a call runs (the caller's settings are restored after it). ``warn_only``: an op without a deterministic
  implementation warns (naming itself) instead of failing the image.

What it cannot switch: kernels that ignore ``use_deterministic_compute``. ORT's GroupNorm / SkipGroupNorm contrib
kernels (``GroupNormNHWCSumKernel``, contrib_ops/cuda/diffusion/group_norm_impl_kernel.cuh) add the per-block sums
of a group with ``atomicAdd`` in whatever order the blocks finish, so the UNet's and the VAE's norms may differ in
the last bits from call to call; ``benchmarks/determinism.py`` measures each component twice on the same inputs to
tell which ones do on a given GPU (it also runs single GroupNorm, SkipGroupNorm, MultiHeadAttention, Conv and
MatMul nodes). cuDNN's forward convolutions and its flash-attention forward kernel (``sdpa_kernel=8``, the
runtime's default) are expected to be deterministic for a fixed algorithm (not measured yet: the script says);
with ``EXHAUSTIVE`` search the algorithm is fixed per session and shape after the first call, but another process
may pick another one: use ``cudnn_conv_algo_search="HEURISTIC"`` too for images equal across processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def deterministic_torch(enabled: bool) -> Iterator[None]:
    """Inside: torch's deterministic algorithms (warn-only) and cuDNN's deterministic mode; restored on exit."""
    if not enabled:
        yield
        return
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic = before[2]
        torch.backends.cudnn.benchmark = before[3]

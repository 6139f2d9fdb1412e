"""The deterministic mode (``EnginePipeline.from_artifacts(..., deterministic=True)``, CLI ``--deterministic``).

What it switches on:

* ONNX Runtime: ``SessionOptions.use_deterministic_compute = True`` on every session. ORT's CUDA kernels that
  have a deterministic variant use it then (e.g. reductions leave their atomics-based fast path).
* torch, for our own ops in the loop (CFG combine, ``scheduler.step`` on the GPU):
  ``torch.use_deterministic_algorithms(True, warn_only=True)`` and ``torch.backends.cudnn.deterministic``, only
  while a call runs (the caller's settings are restored after it). ``warn_only``: an op without a deterministic
  implementation warns (naming itself) instead of failing the image.

What it cannot switch at run time: kernels that ignore ``use_deterministic_compute``. ORT's GroupNorm /
SkipGroupNorm contrib kernels (``GroupNormNHWCSumKernel``, contrib_ops/cuda/diffusion/group_norm_impl_kernel.cuh)
add the per-block sums of a group with ``atomicAdd`` in whatever order the blocks finish, so the UNet's and the
VAE's norms may differ in the last bits from call to call; ``benchmarks/determinism.py`` measures each component
twice on the same inputs to tell which ones do on a given GPU (it also runs single GroupNorm, SkipGroupNorm,
MultiHeadAttention, Conv and MatMul nodes). cuDNN's forward convolutions and its flash-attention forward kernel
(``sdpa_kernel=8``, the runtime's default) were bit-stable over 4 runs on an H200, as were MatMul and the text
encoder, while GroupNorm and SkipGroupNorm differed by up to 0.0039
(``benchmarks/results/h200-2026-12-01-s4-determinism.json``); with ``EXHAUSTIVE`` search the algorithm is fixed per
session and shape after the first call, but another process may pick another one: use
``cudnn_conv_algo_search="HEURISTIC"`` too for images equal across processes.

The GroupNorm kernels are chosen at compile time: ``compile --deterministic`` (``CompileConfig.deterministic``)
leaves ORT CUDA's GroupNorm unfused (the InstanceNormalization form torch exports). Measured on an H200
(``benchmarks/norm_probe.py``, ``benchmarks/results/h200-2026-12-01-s6-*.json``): that form gave identical outputs
over 8 runs where the fused kernel differed every run by up to 0.0039, and the tiny pipeline's identical calls
differed by 0 (0.00195 without it); it costs 0.068 vs 0.044 ms per norm at the SD-1.5 UNet's largest shape. On an
H100 (``h100-2026-12-07-s26-*.json``) the whole mode cost 0.486 vs 0.378 s an image (SD-1.5, 512x512, 50 steps;
UNet step 9.37 vs 7.33 ms, VAE decode 21.1 vs 10.5 ms), of which the unfused norms explain 0.35 ms of the UNet
step (``benchmarks/groupnorm_forms.py``; no other form of ORT's ops measured faster); the rest is not yet split
between the SkipGroupNorm fusions the mode gives up and ``use_deterministic_compute`` on the other kernels.
:func:`compile_time_note` says when an artifact lacks it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..artifact.manifest import Backend, Manifest


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


def compile_time_note(manifest: Manifest, device: str) -> str | None:
    """Why ``deterministic=True`` cannot make this artifact's calls identical, or ``None``.

    Args:
        manifest: the artifact's manifest (its ``backend``, ``device`` and ``deterministic``: ``config.deterministic``
            or ``config.pass_options.fuse_group_norm_deterministic``).
        device: the device the engines run on, "cpu" or "cuda".

    Returns:
        One line for a warning: an ONNX Runtime artifact compiled for CUDA without ``--deterministic`` (nor
        ``--pass-option fuse_group_norm_deterministic=true``) and run on CUDA: its fused GroupNorm / SkipGroupNorm
        kernels sum with atomicAdd; ``None`` otherwise (an artifact compiled for the CPU has no fused GroupNorm).
    """
    if device != "cuda" or manifest.backend is not Backend.ORT or manifest.device != "cuda" or manifest.deterministic:
        return None
    return ("deterministic: this artifact was compiled without --deterministic, so its fused GroupNorm kernels (ORT "
            "contrib, atomicAdd sums) may still change the last bits of an image from call to call; recompile with "
            "`diffusion-trt compile ... --deterministic` for identical images")

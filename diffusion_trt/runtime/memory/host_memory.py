"""Host (CPU) memory a request needs before it runs, against what this machine has available.

A request's initial latents are drawn in one go, [B, C, h, w] with the caller's generator (what keeps the images
equal to one diffusers call; runtime/batching.py), and its "pil" / "np" images land in one host buffer [B, H, W, 3]
that is then copied out to the caller. A batch too large for the host is refused up front by
:func:`check_host_memory` (called by :meth:`~..request.Request.build`), not deep inside ``randn_tensor`` after the
engines loaded.

The figure is a lower bound: only those allocations are counted (not the text embeddings, nor "pt" / "latent"
results, which live on the device), so a request that fits is never refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ...errors import RuntimeInputError
from .plan import fmt_bytes

#: Bytes per pixel of the host output images: the buffer (uint8 "pil", float32 "np") and the caller's copy of it
#: (the PIL images, or ``host.copy()``: the buffer is reused by the next call); none for "pt" / "latent".
OUTPUT_BYTES_PER_PIXEL: dict[str, int] = {"pil": 3 * 1 * 2, "np": 3 * 4 * 2, "pt": 0, "latent": 0}


def available_host_bytes() -> int | None:
    """Bytes of host memory a new allocation can get now, or ``None`` where this cannot be read.

    Linux: ``MemAvailable`` of /proc/meminfo (free plus reclaimable page cache), capped by what a cgroup v2 limit
    leaves (``memory.max - memory.current``: a container's limit); elsewhere ``os.sysconf``'s free pages.
    """
    available = _meminfo_available()
    if available is None:
        available = _sysconf_free()
    limit = _cgroup_left()
    if limit is not None:
        available = limit if available is None else min(available, limit)
    return available


def _meminfo_available(path: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _sysconf_free() -> int | None:
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def _cgroup_left(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((root / "memory.current").read_text()), 0)
    except (OSError, ValueError):
        return None


def request_host_bytes(latent_shape: tuple[int, int, int, int], latent_dtype: torch.dtype, height: int, width: int,
                       output_type: str) -> tuple[int, int]:
    """(latents, images): host bytes of a request's initial latents [B, C, h, w] in ``latent_dtype`` and of its
    output images [B, H, W, 3] (:data:`OUTPUT_BYTES_PER_PIXEL`); ``height``, ``width`` in pixels."""
    batch = latent_shape[0]
    latents = batch * latent_shape[1] * latent_shape[2] * latent_shape[3] * torch.empty((), dtype=latent_dtype).itemsize
    return latents, batch * height * width * OUTPUT_BYTES_PER_PIXEL.get(output_type, 0)


def check_host_memory(what: str, latent_shape: tuple[int, int, int, int], latent_dtype: torch.dtype, height: int,
                      width: int, output_type: str, available: int | None = None) -> None:
    """Refuse a request whose latents and output images cannot fit in host memory.

    Args:
        what: the batch as the caller asked for it, for the message (e.g. "batch = 1 prompt(s) x
            num_images_per_prompt=100000000 = 100000000 images").
        latent_shape, latent_dtype, height, width, output_type: as :func:`request_host_bytes`.
        available: bytes available; ``None`` = :func:`available_host_bytes` (no check where that is unknown).

    Raises:
        RuntimeInputError: the bytes needed exceed those available; names both and the largest batch that fits.
    """
    if available is None:
        available = available_host_bytes()
    latents, images = request_host_bytes(latent_shape, latent_dtype, height, width, output_type)
    if available is None or latents + images <= available:
        return
    batch = latent_shape[0]
    fits = available * batch // (latents + images)
    fix = (f"ask for at most {fits} images per call and call again" if fits >= 1 else
           "even one image does not fit: free host memory or ask for a smaller size")
    image_part = f" and {fmt_bytes(images)} for its output images ({output_type!r})" if images else ""
    raise RuntimeInputError(
        f"{what} at {width}x{height} (WxH) needs at least {fmt_bytes(latents + images)} of host memory: "
        f"{fmt_bytes(latents)} for its latents (drawn for the whole call at once){image_part}, but "
        f"{fmt_bytes(available)} is available; {fix}"
    )

"""Peak memory of a run: torch's allocator peaks and the device's used memory (``cudaMemGetInfo``); CUDA only."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch


def memory_start(devices: Sequence[torch.device]) -> None:
    """Reset torch's peak memory statistics of the CUDA ``devices`` (creating their allocators first)."""
    for d in devices:
        if d.type == "cuda":
            torch.cuda.init()  # the allocator of a device is created lazily; resetting it before raises
            with torch.cuda.device(d):
                torch.empty(1, device=d)  # make sure this device's allocator exists
            torch.cuda.reset_peak_memory_stats(d)



def memory_read(devices: Sequence[torch.device]) -> dict[str, float | None]:
    """``memory_mb`` of a run, MiB summed over the CUDA ``devices``; all ``None`` without CUDA."""
    cuda = [d for d in devices if d.type == "cuda"]
    if not cuda:
        return {"torch_peak_allocated": None, "torch_peak_reserved": None, "device_used": None}
    mib = 1024.0**2
    used = 0.0
    for d in cuda:
        free, total = torch.cuda.mem_get_info(d)
        used += total - free
    return {
        "torch_peak_allocated": sum(torch.cuda.max_memory_allocated(d) for d in cuda) / mib,
        "torch_peak_reserved": sum(torch.cuda.max_memory_reserved(d) for d in cuda) / mib,
        "device_used": used / mib,
    }



def free_memory() -> None:
    """Collect garbage and return torch's cached CUDA blocks (between systems)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

"""CUDA helpers of the runtime: NVTX ranges, pinned host buffers reused across calls, and the device->host
image copy on a copy stream.

Everything here also works on the CPU (no CUDA build of torch needed): NVTX ranges become no-ops, host
buffers are plain (unpinned) tensors and "copies" are direct writes, so the same code paths are tested in CI.

Ordering on CUDA (no host sync until the caller needs the bytes)::

    compute stream:  ... VAE decode -> uint8 convert (fresh tensor) ---.
                                                           event/wait  v
    copy stream:                                 pinned[rows].copy_(uint8, non_blocking=True)
    host:            HostImageSink.finish() waits on the copy stream's event, then reads the pinned buffer
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def nvtx_range(name: str, device: torch.device | None = None) -> Iterator[None]:
    """An NVTX range (visible in Nsight Systems) around the block when ``device`` is a CUDA device; else nothing.

    ``torch.cuda.nvtx.range_push``/``range_pop`` cost about a microsecond and never synchronise.
    """
    if device is None or device.type != "cuda":
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


class HostBuffers:
    """Host tensors allocated once per (shape, dtype) and reused: pinned (page-locked) when ``pin`` is true.

    Pinned memory makes ``copy_(..., non_blocking=True)`` from the GPU a real asynchronous DMA; allocating it
    (``cudaHostAlloc``) is slow, so buffers are kept. At most ``max_entries`` shapes are kept (least recently
    used dropped first).

    **A buffer is handed out again by the next :meth:`get` of the same shape**: the caller copies out what it
    keeps before then (the pipeline converts to PIL / copies to numpy before returning). Thread-safe.

    Args:
        pin: allocate pinned memory (needs a CUDA build of torch and a GPU); ``False`` for CPU pipelines.
        max_entries: how many distinct (shape, dtype) buffers to keep, >= 1.
    """

    def __init__(self, pin: bool, max_entries: int = 4) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries} must be >= 1")
        self.pin = bool(pin)
        self.max_entries = max_entries
        self._buffers: OrderedDict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.allocations = 0  # how many buffers were allocated (a test / diagnostics counter)

    def get(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The host buffer of ``shape`` and ``dtype`` (uninitialised on first use; old contents after)."""
        key = (tuple(int(d) for d in shape), dtype)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is not None:
                self._buffers.move_to_end(key)
                return buf
            buf = torch.empty(key[0], dtype=dtype, pin_memory=self.pin)
            self.allocations += 1
            self._buffers[key] = buf
            while len(self._buffers) > self.max_entries:
                self._buffers.popitem(last=False)
            logger.debug("allocated %s host buffer %s %s", "pinned" if self.pin else "plain", key[0], dtype)
            return buf

    def clear(self) -> None:
        with self._lock:
            self._buffers.clear()


def images_uint8(image: torch.Tensor) -> torch.Tensor:
    """VAE output [B, 3, H, W] (about [-1, 1], any float dtype) -> uint8 [B, H, W, 3], on the tensor's device.

    Bit-identical to diffusers' ``VaeImageProcessor.postprocess(output_type="pil")``: denormalise and clamp in
    the image dtype, then ``float32 * 255``, round half to even, cast (numpy and torch round alike).
    Returns a fresh contiguous tensor.
    """
    unit = (image * 0.5 + 0.5).clamp(0, 1)
    return unit.float().mul_(255).round_().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def images_float(image: torch.Tensor) -> torch.Tensor:
    """VAE output [B, 3, H, W] -> float32 [B, H, W, 3] in [0, 1] (diffusers' ``output_type="np"``); fresh tensor."""
    return (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().contiguous()


class HostImageSink:
    """Collects per-chunk device tensors into one host buffer; the copies overlap the next chunk's compute.

    Args:
        shape: the whole result's shape, rows first (``[B, H, W, 3]``).
        dtype: uint8 ("pil") or float32 ("np").
        buffers: where the host buffer comes from (pinned on CUDA).
        device: the device the chunks live on.
        copy_stream: CUDA: the side stream the device->host copies run on; ``None`` = the current stream.

    Use: :meth:`write` each chunk (returns at once on CUDA), then :meth:`finish` once (waits for the copies).
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        buffers: HostBuffers,
        device: torch.device,
        copy_stream: Any = None,
    ) -> None:
        self.device = device
        self.host = buffers.get(shape, dtype)
        self._copy_stream = copy_stream if device.type == "cuda" else None
        self._pending = False

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Copy ``rows`` [n, ...] (a fresh tensor on :attr:`device`) into host rows ``start .. start + n``.

        On CUDA the copy is queued on the copy stream after the current stream's work (an event wait, no host
        sync); ``rows`` is kept alive for the allocator by ``record_stream``.
        """
        dst = self.host[start : start + rows.shape[0]]
        if self.device.type != "cuda":
            dst.copy_(rows)
            return
        compute = torch.cuda.current_stream(self.device)
        stream = self._copy_stream or compute
        if stream != compute:
            stream.wait_stream(compute)  # the conversion kernels that made `rows` come first
            rows.record_stream(stream)  # `rows` is freed on the compute stream: not reused before the copy ends
        with torch.cuda.stream(stream):
            dst.copy_(rows, non_blocking=True)
        self._pending = True

    def finish(self) -> torch.Tensor:
        """Wait for every queued copy (an event on the copy stream); return the host buffer (reused later!)."""
        if self._pending:
            stream = self._copy_stream or torch.cuda.current_stream(self.device)
            event = torch.cuda.Event()
            event.record(stream)
            event.synchronize()
            self._pending = False
        return self.host


def to_pil(images: np.ndarray) -> list[Any]:
    """uint8 [B, H, W, 3] -> list of RGB ``PIL.Image`` (Pillow copies RGB arrays, so the buffer may be reused)."""
    from PIL import Image

    return [Image.fromarray(a) for a in images]

"""Tiled VAE decoding: the image decoded latent tile by latent tile and blended on the device, as diffusers'
``AutoencoderKL.tiled_decode`` (diffusers 0.3x-0.42, ``enable_tiling()``) does it.

The reference (``diffusers/models/autoencoders/autoencoder_kl.py``), with T = ``tile_latent_min_size`` latent
pixels, s = the VAE scale factor (8) and f = ``tile_overlap_factor`` (0.25)::

    stride      = int(T * (1 - f))            latent pixels between tile starts (48 for T = 64)
    blend       = int(T * s * f)              image rows/columns blended between neighbours (128)
    row_limit   = T * s - blend               image rows/columns each tile keeps (384)
    tiles start at 0, stride, 2*stride, ... < latent size; the last ones are clipped at the edge
    raster order, in place: blend_v(tile above, tile), then blend_h(tile left, tile), keep [:row_limit, :row_limit]
    blend_v(a, b, e): e = min(a rows, b rows, blend); b[y] = a[-e + y] * (1 - y / e) + b[y] * (y / e), y < e

A compiled VAE decoder engine only runs latent sizes inside its profile; diffusers' clipped edge tiles (e.g. 32
latent pixels after a 64 tile) fall outside a static 512x512 engine. So there are two layouts:

* ``"diffusers"``: exactly the tiles above (chosen when every tile fits the engine): equals diffusers' tiled decode
  on the same weights (tests/runtime/test_vae_tiling.py: within 1e-4 on the tiny pipeline, fp32);
* ``"full_tiles"``: every tile full size; the last start is moved back to ``size - T`` (so it overlaps its
  neighbour more), and the blend between two tiles is the same linear ramp over ``min(blend, overlap)`` image
  rows where they overlap geometrically. Each tile keeps the rows up to where the next one starts.

Memory: the engine only ever runs at the tile shape, so its activations are those of one tile (an ORT arena grows
to the largest shape it ran); the decoded tiles (about (1/(1-f))^2 = 1.8x the image) are kept until blended, as
diffusers keeps them.

Who tiles: under a VRAM budget whose plan tiles, the "vae" stage the loop enters hands it a :class:`TiledVaeDecoder`
over the VAE decoder engine (:class:`~.stages.Stage`), which it runs instead of the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..engines.engine import Engine

logger = logging.getLogger(__name__)

Layout = Literal["diffusers", "full_tiles"]
#: diffusers' ``AutoencoderKL.tile_overlap_factor``.
DEFAULT_OVERLAP = 0.25


@dataclass(frozen=True)
class AxisTiles:
    """The tiles along one axis (rows or columns).

    Attributes:
        starts, sizes: each tile's first latent pixel and its size in latent pixels.
        blend: per tile, image pixels blended with the previous tile (0 for the first).
        offset: per tile, where in the previous tile (image pixels) the blended region starts.
        keep: per tile, image pixels kept from its start.
    """

    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    blend: tuple[int, ...]
    offset: tuple[int, ...]
    keep: tuple[int, ...]


def axis_tiles(length: int, tile: int, scale: int, overlap: float, layout: Layout) -> AxisTiles:
    """Tiles along an axis of ``length`` latent pixels (see the module docstring for both layouts).

    Args:
        length: latent pixels along the axis; tile: tile size in latent pixels (>= 1); scale: image pixels per
            latent pixel; overlap: diffusers' ``tile_overlap_factor`` in [0, 1).
    """
    stride = max(int(tile * (1 - overlap)), 1)
    blend_px = int(tile * scale * overlap)
    if layout == "diffusers":
        starts = list(range(0, length, stride))
        sizes = [min(tile, length - s) for s in starts]
        row_limit = tile * scale - blend_px
        blends, offsets, keeps = [0], [0], [min(row_limit, sizes[0] * scale)]
        for k in range(1, len(starts)):
            e = min(sizes[k - 1] * scale, sizes[k] * scale, blend_px)
            blends.append(e)
            offsets.append(sizes[k - 1] * scale - e)  # diffusers blends with a[-e + y]
            keeps.append(min(row_limit, sizes[k] * scale))
        return AxisTiles(tuple(starts), tuple(sizes), tuple(blends), tuple(offsets), tuple(keeps))
    if length <= tile:
        return AxisTiles((0,), (length,), (0,), (0,), (length * scale,))
    starts = []
    for s in range(0, length, stride):
        s = min(s, length - tile)
        if starts and s <= starts[-1]:
            break
        starts.append(s)
        if s == length - tile:
            break
    sizes = [tile] * len(starts)
    blends, offsets = [0], [0]
    for k in range(1, len(starts)):
        overlap_px = (starts[k - 1] + tile - starts[k]) * scale
        blends.append(min(blend_px, overlap_px))
        offsets.append((starts[k] - starts[k - 1]) * scale)
    keeps = [(starts[k + 1] - starts[k]) * scale for k in range(len(starts) - 1)] + [tile * scale]
    return AxisTiles(tuple(starts), tuple(sizes), tuple(blends), tuple(offsets), tuple(keeps))


def _ramp(e: int, like: torch.Tensor) -> torch.Tensor:
    """diffusers' weights y / e, y = 0..e-1, computed in float64 as Python does, then in ``like``'s dtype."""
    return (torch.arange(e, dtype=torch.float64) / e).to(device=like.device, dtype=like.dtype)


def _blend(a: torch.Tensor, b: torch.Tensor, e: int, offset: int, dim: int) -> None:
    """In place: ``b``'s first ``e`` rows (``dim`` 2) / columns (``dim`` 3) = a ramp from ``a``'s from ``offset``."""
    if e <= 0:
        return
    shape = [1, 1, 1, 1]
    shape[dim] = e
    w = _ramp(e, b).view(shape)
    a_part = a.narrow(dim, offset, e)
    b_part = b.narrow(dim, 0, e)
    b_part.copy_(a_part * (1 - w) + b_part * w)


def tiled_decode(
    decode: Callable[[torch.Tensor], torch.Tensor],
    z: torch.Tensor,
    *,
    tile: int,
    scale: int = 8,
    overlap: float = DEFAULT_OVERLAP,
    layout: Layout = "diffusers",
) -> torch.Tensor:
    """Decode latents ``z`` [B, C, h, w] tile by tile with ``decode`` and blend the tiles.

    Args:
        decode: latents tile [B, C, th, tw] -> image tile [B, 3, th*scale, tw*scale]; its result is modified in
            place (clone an engine's reused output buffer before returning it).
        tile: tile size in latent pixels (diffusers' ``tile_latent_min_size``; 64 for SD at 512x512).
        scale: image pixels per latent pixel (the VAE scale factor, 8).
        overlap: diffusers' ``tile_overlap_factor``, in [0, 1).
        layout: "diffusers" (diffusers' tiles, clipped at the edges) or "full_tiles" (see the module docstring).

    Returns:
        The image [B, 3, h*scale, w*scale] on ``z``'s device, in ``decode``'s output dtype.
    """
    rows = axis_tiles(z.shape[2], tile, scale, overlap, layout)
    cols = axis_tiles(z.shape[3], tile, scale, overlap, layout)
    decoded: list[list[torch.Tensor]] = []
    for r0, rs in zip(rows.starts, rows.sizes, strict=True):
        decoded.append([decode(z[:, :, r0 : r0 + rs, c0 : c0 + cs]) for c0, cs in zip(cols.starts, cols.sizes,
                                                                                        strict=True)])
    out_rows = []
    for i, row in enumerate(decoded):
        parts = []
        for j, t in enumerate(row):
            if i > 0:
                _blend(decoded[i - 1][j], t, rows.blend[i], rows.offset[i], 2)
            if j > 0:
                _blend(row[j - 1], t, cols.blend[j], cols.offset[j], 3)
            parts.append(t[:, :, : rows.keep[i], : cols.keep[j]])
        out_rows.append(torch.cat(parts, dim=3))
    return torch.cat(out_rows, dim=2)


def fits(engine: Engine, input_name: str, z_shape: Sequence[int], tiles_h: AxisTiles, tiles_w: AxisTiles) -> bool:
    """Every tile shape of the layout lies inside the engine's profile for ``input_name``."""
    info = engine.spec.input(input_name)
    return all(
        info.min[2] <= th <= info.max[2] and info.min[3] <= tw <= info.max[3]
        for th in set(tiles_h.sizes) for tw in set(tiles_w.sizes)
    ) and info.min[0] <= z_shape[0] <= info.max[0]


class TiledVaeDecoder:
    """A VAE decoder engine run tile by tile: what the "vae" stage of a plan that tiles hands the loop
    (:class:`~.stages.Stage`), in place of the engine. Not an engine (no with-block): it runs an open ``engine``.

    ``run({"latent_sample": z})`` returns ``{"sample": image}`` like the engine; latents no larger than one tile
    (both sides <= ``tile``) go to the engine whole, as diffusers does. The layout is "diffusers" when every tile
    fits the engine's profile, else "full_tiles" (logged once).

    Args:
        engine: the VAE decoder engine (input ``latent_sample`` [B, 4, h, w], output ``sample`` [B, 3, H, W]).
        tile: tile size in latent pixels, inside the engine's profile (e.g. the profile's opt latent size).
        scale: the VAE scale factor; overlap: diffusers' ``tile_overlap_factor``.

    Attributes:
        last_layout: the layout of the last tiled run; ``None`` before one.

    The returned image is a fresh tensor (not the engine's buffer).
    """

    def __init__(self, engine: Engine, tile: int, scale: int = 8, overlap: float = DEFAULT_OVERLAP) -> None:
        self.engine = engine
        self.tile = int(tile)
        self.scale = int(scale)
        self.overlap = float(overlap)
        self.last_layout: Layout | None = None

    @property
    def name(self) -> str:
        return self.engine.name

    def layout_for(self, z_shape: Sequence[int]) -> Layout | None:
        """The layout for latents of ``z_shape``; ``None`` = one tile (decoded whole)."""
        if z_shape[2] <= self.tile and z_shape[3] <= self.tile:
            return None
        for layout in ("diffusers", "full_tiles"):
            rows = axis_tiles(z_shape[2], self.tile, self.scale, self.overlap, layout)  # type: ignore[arg-type]
            cols = axis_tiles(z_shape[3], self.tile, self.scale, self.overlap, layout)  # type: ignore[arg-type]
            if fits(self.engine, "latent_sample", z_shape, rows, cols):
                return layout  # type: ignore[return-value]
        return "full_tiles"  # the engine refuses a bad tile with its own message

    def run(self, feeds: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Decode ``feeds["latent_sample"]`` [B, 4, h, w]; returns ``{"sample": [B, 3, h*scale, w*scale]}``."""
        z = feeds["latent_sample"]
        layout = self.layout_for(tuple(z.shape))
        if layout is None:
            return {"sample": self.engine.run({"latent_sample": z})["sample"].clone()}
        if layout != self.last_layout:
            logger.info("%s: tiled decode of %s latents in %d-pixel tiles (%s layout)", self.name, tuple(z.shape),
                        self.tile, layout)
        self.last_layout = layout

        def decode(t: torch.Tensor) -> torch.Tensor:
            return self.engine.run({"latent_sample": t.contiguous()})["sample"].clone()

        return {"sample": tiled_decode(decode, z, tile=self.tile, scale=self.scale, overlap=self.overlap,
                                       layout=layout)}

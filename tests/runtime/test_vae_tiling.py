"""Tiled VAE decode: the tile layouts, equality with diffusers' ``AutoencoderKL.tiled_decode`` on the tiny
pipeline's VAE, and the seams against the untiled decode (reported, not hidden)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from diffusion_trt.runtime.memory.vae_tiling import TiledVaeDecoder, axis_tiles, tiled_decode

logger = logging.getLogger(__name__)


def test_axis_tiles_diffusers_layout_is_diffusers_arithmetic() -> None:
    t = axis_tiles(128, 64, 8, 0.25, "diffusers")  # SD at 1024: starts 0, 48, 96; the last one clipped
    assert t.starts == (0, 48, 96) and t.sizes == (64, 64, 32)
    assert t.blend == (0, 128, 128) and t.keep == (384, 384, 256)
    assert sum(t.keep) == 1024


def test_axis_tiles_full_tiles_never_clips() -> None:
    t = axis_tiles(128, 64, 8, 0.25, "full_tiles")
    assert t.starts == (0, 48, 64) and set(t.sizes) == {64}
    assert sum(t.keep) == 1024 and t.blend == (0, 128, 128)
    assert t.offset == (0, 384, 128)  # geometric: where the next tile starts inside the previous one
    one = axis_tiles(40, 64, 8, 0.25, "full_tiles")
    assert one.starts == (0,) and one.sizes == (40,) and one.keep == (320,)


def test_full_tiles_of_a_constant_decode_blend_to_the_constant() -> None:
    z = torch.zeros(1, 4, 20, 28)

    def decode(t: torch.Tensor) -> torch.Tensor:
        return torch.ones(t.shape[0], 3, t.shape[2] * 8, t.shape[3] * 8)

    out = tiled_decode(decode, z, tile=8, layout="full_tiles")
    assert out.shape == (1, 3, 160, 224)
    assert torch.allclose(out, torch.ones_like(out))


@pytest.fixture(scope="module")
def tiny_vae(tiny_pipeline_dir: Path) -> torch.nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL.from_pretrained(tiny_pipeline_dir / "vae").eval()


def _latents() -> torch.Tensor:
    return torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0))  # 128x128: the profile's max


def test_tiled_decode_equals_diffusers_tiled_decode_in_torch(tiny_vae: torch.nn.Module) -> None:
    """Our blending over diffusers' own decoder = diffusers' tiled_decode (the blending alone)."""
    z = _latents()
    tiny_vae.enable_tiling()
    with torch.no_grad():
        ref = tiny_vae.decode(z).sample
        ours = tiled_decode(lambda t: tiny_vae.decode(t).sample.clone(), z, tile=tiny_vae.tile_latent_min_size)
    tiny_vae.disable_tiling()
    assert tiny_vae.tile_latent_min_size == 8 and tiny_vae.tile_sample_min_size == 64
    assert (ours - ref).abs().max().item() < 1e-6


def test_engine_tiled_decode_matches_diffusers_and_reports_seams(tiny_artifact: Path,
                                                                 tiny_vae: torch.nn.Module) -> None:
    """The tiny artifact's VAE decoder engine (ORT CPU, fp32) run per tile = diffusers' tiled decode within 1e-4;
    the seams against the untiled engine decode are measured and reported."""
    import json

    from diffusion_trt.runtime.engines.ort_engine import OrtEngine

    manifest = json.loads((tiny_artifact / "manifest.json").read_text())
    entry = manifest["components"]["vae_decoder"]
    z = _latents()
    with OrtEngine(tiny_artifact / entry["onnx"], entry, name="vae_decoder") as engine:
        tiled = TiledVaeDecoder(engine, tile=8)
        assert tiled.layout_for(z.shape) == "diffusers"  # clipped 4-latent edge tiles fit the 4..16 profile
        ours = tiled.run({"latent_sample": z})["sample"]
        whole = engine.run({"latent_sample": z})["sample"].clone()
        full = tiled_decode(lambda t: engine.run({"latent_sample": t.contiguous()})["sample"].clone(), z, tile=8,
                            layout="full_tiles")
    tiny_vae.enable_tiling()
    with torch.no_grad():
        ref_tiled = tiny_vae.decode(z).sample
    tiny_vae.disable_tiling()
    with torch.no_grad():
        ref_whole = tiny_vae.decode(z).sample
    vs_diffusers = (ours - ref_tiled).abs().max().item()
    seams = (ours - whole).abs().max().item()
    seams_full = (full - whole).abs().max().item()
    diffusers_seams = (ref_tiled - ref_whole).abs().max().item()
    # random weights: the tiny VAE's output spans far more than [-1, 1], so seams are large in absolute terms
    logger.warning("tiny VAE 128x128 tiled decode (tile 8 latent, overlap 0.25): max |ours - diffusers tiled| = %.2e; "
                   "max |tiled - untiled|: ours %.3f (full_tiles %.3f), diffusers %.3f; untiled range +-%.2f",
                   vs_diffusers, seams, seams_full, diffusers_seams, whole.abs().max().item())
    assert vs_diffusers < 1e-4
    assert (whole - ref_whole).abs().max().item() < 1e-4
    # seams are tiling's own, not ours: the same as diffusers' tiled-vs-untiled difference
    assert abs(seams - diffusers_seams) < 1e-4
    assert full.shape == whole.shape and torch.isfinite(full).all() and seams_full > 0

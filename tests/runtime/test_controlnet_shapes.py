"""The ``h/k`` symbols of the ControlNet residuals: ceil(h / k), in the engine spec and the compile profile."""

from __future__ import annotations

import math

import pytest
import torch

from diffusion_trt.compiler.components import symbol_ranges
from diffusion_trt.config import Range, ShapeProfile
from diffusion_trt.errors import ArtifactError
from diffusion_trt.runtime.controlnet import ControlPlan, ControlUnit
from diffusion_trt.runtime.engines.engine import EngineSpec


def _t(name: str, shape: list[object]) -> dict[str, object]:
    return {"name": name, "dtype": "float32", "shape": shape, "min": [1 if isinstance(d, str) else d for d in shape],
            "opt": [2 if isinstance(d, str) else d for d in shape], "max": [64 if isinstance(d, str) else d
                                                                           for d in shape]}


@pytest.mark.parametrize(("h", "w"), [(8, 8), (9, 5), (1, 1), (17, 64)])
def test_output_shapes_are_ceil_divisions(h: int, w: int) -> None:
    spec = EngineSpec.from_manifest("controlnet_a", {"inputs": [_t("sample", ["B2", 4, "h", "w"])],
                                                     "outputs": [_t("r", ["B2", 4, "h/8", "w/2"])]})
    assert spec.output_shapes({"B2": 2, "h": h, "w": w})["r"] == (2, 4, math.ceil(h / 8), math.ceil(w / 2))


def test_an_unbound_base_is_refused() -> None:
    with pytest.raises(ArtifactError, match="has dim 'q/2' that no input determines"):
        EngineSpec.from_manifest("x", {"inputs": [_t("sample", ["B2", 4, "h", "w"])],
                                       "outputs": [_t("r", ["B2", 4, "q/2", "w"])]})


def test_profile_ranges_of_the_downsampled_symbols() -> None:
    ranges = symbol_ranges(ShapeProfile(batch=Range(1, 1, 4), height=Range(40, 64, 136), width=Range(64, 64, 64)))
    assert ranges["h"] == (5, 8, 17)
    assert ranges["h/2"] == (3, 4, 9) and ranges["h/4"] == (2, 2, 5) and ranges["h/8"] == (1, 1, 3)
    assert ranges["w/8"] == (1, 1, 1)


class _RecordingEngine:
    """A ControlNet (and residual UNet) stand-in: records its feeds, returns ones for each residual."""

    def __init__(self, names: list[str], embedding: bool = False) -> None:
        residuals = [_t(n, ["B2", 4, "h", "w"]) for n in names]
        cond = [_t("controlnet_cond_embedding", ["B2", 4, "h", "w"])] if embedding else []
        self.spec = EngineSpec.from_manifest("controlnet_a", {
            "inputs": [_t("sample", ["B2", 4, "h", "w"]), *cond, *residuals], "outputs": residuals})
        self.names = names
        self.feeds: list[dict] = []

    def run(self, feeds: dict) -> dict:
        self.feeds.append(feeds)
        return {n: torch.ones(2, 4, 3, 3) for n in self.names}


@pytest.mark.parametrize("guess_mode", [False, True])
def test_the_scale_feed_is_made_once_per_chunk_not_once_a_step(guess_mode: bool) -> None:
    """Issue 25: ``conditioning_scale`` was a new tensor (an allocation and a fill kernel) at every step."""
    names = ["down_block_residual_0", "mid_block_residual"]
    engine = _RecordingEngine(names)
    unit = ControlUnit("a", engine, torch.zeros(1, 3, 24, 24), scale=0.5, start=0.0, end=0.5)
    chunk = ControlPlan(engine, (unit,), guess_mode, tuple(names)).rows(range(0, 1), 1, 1, do_cfg=True)
    sample, latents = torch.zeros(2, 4, 3, 3), torch.zeros(1, 4, 3, 3)
    for i in range(4):  # steps 2 and 3 are outside [0, 0.5]: the ControlNet does not run
        chunk.residuals(i, 4, sample, latents, object(), torch.tensor(1.0), torch.ones(2), torch.zeros(2, 77, 8))
    scales = [f["conditioning_scale"] for f in engine.feeds]
    assert len(scales) == 2 and scales[0] is scales[1]
    want = torch.logspace(-1, 0, 2) * 0.5 if guess_mode else torch.full((2,), 0.5)
    torch.testing.assert_close(scales[0], want, rtol=0, atol=0)


class _EmbedEngine:
    """A ``cond_embed_<name>`` stand-in: counts its runs, returns a fresh embedding each time (a buffer it reuses)."""

    def __init__(self) -> None:
        self.spec = EngineSpec.from_manifest("cond_embed_a", {
            "inputs": [_t("controlnet_cond", ["B2", 3, "H", "W"])],
            "outputs": [_t("controlnet_cond_embedding", ["B2", 4, "h", "w"])]})
        self.name, self.device, self.images = "cond_embed_a", torch.device("cpu"), []
        self._buffer = torch.zeros(2, 4, 3, 3)

    def run(self, feeds: dict) -> dict:
        self.images.append(feeds["controlnet_cond"])
        self._buffer.fill_(float(len(self.images)))  # overwritten by the next run, as engine buffers are
        return {"controlnet_cond_embedding": self._buffer}


def test_the_embedding_is_computed_once_per_chunk_and_fed_at_every_step() -> None:
    """Issue 25: ``cond_embed_<name>`` runs once per chunk of rows; every step of the chunk feeds its output (a copy:
    the next chunk's run overwrites the engine's buffer) to ``controlnet_<name>`` as ``controlnet_cond_embedding``."""
    names = ["down_block_residual_0", "mid_block_residual"]
    engine, embed = _RecordingEngine(names, embedding=True), _EmbedEngine()
    image = torch.arange(2 * 3 * 24 * 24, dtype=torch.float32).reshape(2, 3, 24, 24)
    unit = ControlUnit("a", engine, image, scale=1.0, start=0.0, end=1.0, embed=embed)
    plan = ControlPlan(engine, (unit,), False, tuple(names))
    sample, latents = torch.zeros(2, 4, 3, 3), torch.zeros(1, 4, 3, 3)
    chunks = [plan.rows(range(k, k + 1), 2, 1, do_cfg=True) for k in range(2)]  # two chunks of one image
    assert len(embed.images) == 2  # once per chunk, before any step
    for k, chunk in enumerate(chunks):
        torch.testing.assert_close(embed.images[k], torch.cat([image[k:k + 1]] * 2))  # doubled for CFG
        for i in range(3):
            chunk.residuals(i, 3, sample, latents, object(), torch.tensor(1.0), torch.ones(2), torch.zeros(2, 77, 8))
    assert len(embed.images) == 2  # not once a step
    feeds = engine.feeds
    assert len(feeds) == 6 and all("controlnet_cond" not in f for f in feeds)
    got = [float(f["controlnet_cond_embedding"].max()) for f in feeds]
    assert got == [1.0] * 3 + [2.0] * 3  # chunk 0 kept its own embedding after chunk 1's run
    assert all(f["controlnet_cond_embedding"] is feeds[3 * (k // 3)]["controlnet_cond_embedding"]
               for k, f in enumerate(feeds))


def test_an_unsplit_controlnet_takes_the_image_at_every_step() -> None:
    """A ControlNet compiled before the split (no ``cond_embed_<name>``): the image, as ``controlnet_cond``."""
    names = ["down_block_residual_0", "mid_block_residual"]
    engine = _RecordingEngine(names)
    unit = ControlUnit("a", engine, torch.ones(1, 3, 24, 24), scale=1.0, start=0.0, end=1.0)
    chunk = ControlPlan(engine, (unit,), False, tuple(names)).rows(range(0, 1), 1, 1, do_cfg=True)
    chunk.residuals(0, 1, torch.zeros(2, 4, 3, 3), torch.zeros(1, 4, 3, 3), object(), torch.tensor(1.0),
                    torch.ones(2), torch.zeros(2, 77, 8))
    (feed,) = engine.feeds
    assert "controlnet_cond_embedding" not in feed and feed["controlnet_cond"].shape == (2, 3, 24, 24)

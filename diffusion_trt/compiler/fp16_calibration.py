"""Calibration inputs for the fp16 range check of ``compile`` (:mod:`diffusion_trt.passes.fp16_check`).

One batch per component at the profile's *min* shape (batch, height, width): cheap on a CPU (the check runs the
fp32 graph with every activation read back) and representative of the values, which depend on the content
more than on the image size. The exported graph, which the check runs where the fused one cannot (an ort-cuda
compile on a CPU machine), gets the batch's first sample only (:func:`first_sample`): every SD component computes
each sample alone, so the extra rows bought no new kind of value and cost their activations' memory (a static
512x512 batch-4 VAE decoder: 21 GB on the 2-core machine). The values follow what the loop feeds each component:

    sample / latent_sample   N(0, 1) latents (the UNet's first step sees scaled noise, the VAE decoder latents
                             already divided by the scaling factor)
    timestep                 999 (the first step: the largest time embedding)
    encoder_hidden_states,   N(0, 1) (CLIP's hidden states are of that scale outside a few channels)
    text_embeds
    time_ids (SDXL)          (H, W, 0, 0, H, W) at the min size
    input_ids                random token ids in [0, 1000) (the tiny vocabularies have 1000 tokens)
    sample (VAE encoder)     uniform in [-1, 1] (an image)
"""

from __future__ import annotations

import numpy as np

from ..config import ShapeProfile
from .components import ComponentSpec

#: The symbols of a batch dim (:mod:`.components`): images per call, and the rows of a CFG batch.
BATCH_SYMBOLS = frozenset({"B", "B2"})


def calibration_feeds(spec: ComponentSpec, profile: ShapeProfile, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """One feed dict for ``spec``'s inputs at ``profile``'s min shape (float32 / int64 arrays)."""
    rng = np.random.default_rng(seed)
    ranges = spec.ranges(profile)
    feed: dict[str, np.ndarray] = {}
    for t in spec.inputs:
        shape = [d if isinstance(d, int) else ranges[d][0] for d in t.shape]
        dtype = t.resolved_dtype("fp32")
        if dtype == "int64":
            feed[t.name] = rng.integers(0, 1000, shape).astype(np.int64)
        elif t.name == "timestep":
            feed[t.name] = np.full(shape, 999.0, dtype=np.float32)
        elif t.name == "time_ids":
            h, w = ranges["H"][0], ranges["W"][0]
            row = np.array([h, w, 0, 0, h, w], dtype=np.float32)[: shape[1]]
            feed[t.name] = np.broadcast_to(row, shape).copy()
        elif spec.name == "vae_encoder":
            feed[t.name] = rng.uniform(-1, 1, shape).astype(np.float32)
        else:
            feed[t.name] = rng.standard_normal(shape).astype(np.float32)
    return [feed]


def first_sample(spec: ComponentSpec, feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``feeds`` with each batch-dim input (first dim in :data:`BATCH_SYMBOLS`) cut to its first row; the others
    as they are. With one input (the VAE decoder's ``latent_sample``) that row is the batch-1 profile's feed."""
    batched = {t.name for t in spec.inputs if t.shape and t.shape[0] in BATCH_SYMBOLS}
    return [{name: value[:1] if name in batched else value for name, value in feed.items()} for feed in feeds]

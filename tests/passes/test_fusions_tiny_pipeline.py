"""The fusion passes on the real tiny SD export (SD-1.5 structure at toy widths): op counts and ORT parity.

The tiny UNet (diffusion_trt.compiler.dummy, arch "tiny") has the SD-1.5 layout: 4 levels, 2 resnets per down
block, 3 per up block, 3 cross-attention levels, 1 transformer block per attention, 8 groups. Expected sites:
  GroupNorm: resnets (4*2 down + 2 mid + 4*3 up = 22) x 2 norms = 44, + 16 Transformer2DModel norms
             (3*2 down + 1 mid + 3*3 up), + conv_norm_out = 61; with SiLU after: the 44 resnet norms + conv_norm_out.
  LayerNorm: 3 per BasicTransformerBlock x 16 = 48, already LayerNormalization in torch's opset-17 export.
  GEGLU / GELU: 1 per block = 16 (erf form).
VAE decoder (1 resnet per block + 1): mid 2 resnets x 2 + mid attention 1 + up 4*2 resnets x 2 + conv_norm_out = 22.
CLIP (2 layers, quick_gelu): 2 QuickGelu, 5 LayerNormalization (2 per layer + final) already fused.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest

from diffusion_trt.passes import Pass, PassContext, optimize_model
from diffusion_trt.passes.fuse_geglu import fuse_geglu
from diffusion_trt.passes.fuse_gelu import fuse_gelu
from diffusion_trt.passes.fuse_group_norm import fuse_group_norm
from diffusion_trt.passes.fuse_layer_norm import fuse_layer_norm
from tests import graphs

#: The fusion order proposed for pipelines.py: fuse_geglu before fuse_gelu (it takes the GELU inside GEGLU).
FUSIONS: tuple[Pass, ...] = (fuse_layer_norm, fuse_group_norm, fuse_geglu, fuse_gelu)
COMPONENTS = ("text_encoder", "unet", "vae_decoder")


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Inputs for a tiny export; symbolic dims at an odd latent size (5x6), batch 2 (B2) / 1 (B)."""
    rng = np.random.default_rng(0)
    dims = {"B2": 2, "B": 1, "h": 5, "w": 6, "H": 40, "W": 48}
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else dims[d.dim_param]
                 for d in value.type.tensor_type.shape.dim]
        if value.name == "input_ids":
            feeds[value.name] = rng.integers(0, 49408, shape).astype(np.int64)
        elif value.name == "timestep":
            feeds[value.name] = np.full(shape, 981.0, np.float32)
        else:
            feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto, backend: str, device: str) -> tuple[onnx.ModelProto, dict[str, dict[str, int]]]:
    ctx = PassContext(component="x", backend=backend, device=device, precision="fp32")
    out, records = optimize_model(model, FUSIONS, ctx)
    return out, {r.name: r.counts for r in records}


EXPECTED = {  # (component, target) -> the counts that fired; every other count is 0
    ("unet", "ort-cpu"): {"fuse_group_norm": {"skipped_for_target": 61}, "fuse_geglu": {"skipped_for_target": 16},
                          "fuse_gelu": {"Gelu": 16}},
    ("unet", "tensorrt"): {"fuse_group_norm": {"GroupNormalization": 61}, "fuse_geglu": {"skipped_for_target": 16},
                           "fuse_gelu": {"Gelu": 16}},
    ("unet", "ort-cuda"): {"fuse_group_norm": {"GroupNorm": 61, "with_silu": 45, "Transpose": 122},
                           # the tiny widths (128) are not BiasSplitGelu kernel widths: rejected, GELU fused alone
                           "fuse_geglu": {"rejected": 16}, "fuse_gelu": {"Gelu": 16}},
    ("vae_decoder", "ort-cpu"): {"fuse_group_norm": {"skipped_for_target": 22}},
    ("vae_decoder", "tensorrt"): {"fuse_group_norm": {"GroupNormalization": 22}},
    # 8 channels in 8 groups (1 per group) at the first level: ORT's CUDA kernel needs an even number
    ("vae_decoder", "ort-cuda"): {"fuse_group_norm": {"GroupNorm": 17, "with_silu": 17, "Transpose": 34,
                                                      "rejected": 5}},
    ("text_encoder", "ort-cpu"): {"fuse_gelu": {"QuickGelu": 2}},
    ("text_encoder", "tensorrt"): {"fuse_gelu": {"skipped_for_target": 2}},
    ("text_encoder", "ort-cuda"): {"fuse_gelu": {"QuickGelu": 2}},
}
TARGETS = {"ort-cpu": ("ort", "cpu"), "ort-cuda": ("ort", "cuda"), "tensorrt": ("tensorrt", "cuda")}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("component", COMPONENTS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_counts_and_parity(tiny_onnx: Callable[[str, bool], onnx.ModelProto], component: str, target: str,
                           static: bool) -> None:
    """The same counts on the dynamic and the static export (raw TorchScript export + infer_shapes, no folding:
    fixture ``tiny_onnx`` of tests/passes/conftest.py)."""
    model = tiny_onnx(component, static)
    if component == "unet":  # sanity of the architecture before fusing
        ops = graphs.op_counts(model)
        assert (ops["InstanceNormalization"], ops["LayerNormalization"], ops["Erf"]) == (61, 48, 16)
    out, counts = _run(model, *TARGETS[target])
    fired = {name: {k: v for k, v in c.items() if v} for name, c in counts.items()}
    assert {name: c for name, c in fired.items() if c} == EXPECTED[(component, target)]
    if target == "ort-cuda":  # contrib GroupNorm / BiasSplitGelu have CUDA kernels only: structure here
        onnx.checker.check_model(out)
        return
    onnx.checker.check_model(out, full_check=True)
    feeds = _feeds(model)
    (want,), (got,) = graphs.run(model, feeds), graphs.run(out, feeds)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)  # issue 3: component parity on CPU at 1e-4

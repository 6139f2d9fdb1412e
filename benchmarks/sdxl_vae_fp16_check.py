"""Does the fp16 range check find the SDXL VAE's fp16 overflow on its own? (CPU, seconds.)

    python benchmarks/sdxl_vae_fp16_check.py --out benchmarks/results/cpu-2core-2026-12-01-sdxl-vae-fp16-check.json

The VAE is the real SDXL VAE config (stabilityai/stable-diffusion-xl-base-1.0 vae/config.json, as
diffusion_trt.compiler.dummy ships it) scaled down 4x in width (block_out_channels 32/64/128/128, 32 groups), with
random weights, exported as ``compile`` exports vae_decoder, and run through the same call ``compile`` makes in its
passes stage: ``optimize_fp16_checked(model, pipeline_for("tensorrt", "cuda", "fp16", ...), ctx,
calibration_feeds(spec, profile))``.

Random weights do not overflow (initialisation keeps activations O(1)). The real SDXL VAE's overflow is
activations of the decoder's last up blocks that the GroupNorm after them normalises away (the fp16-fix VAE
scales those weights down without changing the output). ``--peak P`` reproduces that mechanism: it multiplies
the weight and bias of ``decoder.up_blocks[-1].resnets[0].conv1`` by K = P / (its fp32 |max| on the calibration
input); ``norm2`` (a GroupNorm) follows that conv
alone, so the fp32 output is unchanged (up to GroupNorm's eps) while the conv's activations are K times larger.
Three runs: scale 1 (no overflow expected), scale K with the check, scale K with the check off (the NaN graph
the check prevents).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peak", type=float, default=2e5,
                    help="|max| the scaled conv's output should reach (the real SDXL VAE's reach ~1e5..1e6)")
    ap.add_argument("--size", type=int, default=128, help="image height = width (pixels)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from diffusers import AutoencoderKL

    from diffusion_trt.compiler import export
    from diffusion_trt.compiler.components import component_specs, symbol_ranges
    from diffusion_trt.compiler.dummy import _CONFIGS
    from diffusion_trt.compiler.fp16_calibration import calibration_feeds
    from diffusion_trt.config import Range, ShapeProfile
    from diffusion_trt.errors import PassError
    from diffusion_trt.passes import PassContext, pipeline_for
    from diffusion_trt.passes._ort import activation_peaks, open_session
    from diffusion_trt.passes.fp16_check import optimize_fp16_checked

    config = {**_CONFIGS["sdxl"]["vae"], "block_out_channels": (32, 64, 128, 128), "sample_size": args.size}
    torch.manual_seed(0)
    vae = AutoencoderKL(**config).eval()
    spec = component_specs(text_hidden=32, text_len=77, unet_in=4, unet_out=4, latent=4)["vae_decoder"]
    size = Range(args.size, args.size, args.size)
    profile = ShapeProfile(batch=Range(1, 1, 1), height=size, width=size)
    feeds = calibration_feeds(spec, profile)
    conv = vae.decoder.up_blocks[-1].resnets[0].conv1
    seen: list[float] = []
    hook = conv.register_forward_hook(lambda m, i, o: seen.append(float(o.abs().max())))
    with torch.no_grad():
        vae.decode(torch.from_numpy(feeds[0]["latent_sample"]))
    hook.remove()
    k = args.peak / seen[0]
    runs = []
    for scale, check in ((1.0, True), (k, True), (k, False)):
        with torch.no_grad():
            conv.weight.mul_(scale)
            conv.bias.mul_(scale)
        with tempfile.TemporaryDirectory() as tmp:
            raw = export.onnx_from_component("vae_decoder", {"vae": vae}, spec, Path(tmp) / "model.onnx",
                                             precision="fp32", profile_ranges=symbol_ranges(profile), opset=17,
                                             device="cpu")
            model = onnx.load(str(raw))
        with torch.no_grad():
            conv.weight.div_(scale)
            conv.bias.div_(scale)
        ctx = PassContext(component="vae_decoder", backend="tensorrt", device="cuda", precision="fp16",
                          options={"convert_fp16_range_check": check})
        fp32_out = open_session(model).run(feeds[0])["sample"]
        t0 = time.perf_counter()
        row: dict = {"scale": scale, "range_check": check}
        try:
            fp16, _, result = optimize_fp16_checked(model, pipeline_for("tensorrt", "cuda", "fp16", "vae"),
                                                          ctx, feeds)
        except PassError as err:
            row["refused"] = str(err)
        else:
            out = open_session(fp16).run(feeds[0])["sample"].astype(np.float32)
            row["fp16_output_finite"] = bool(np.all(np.isfinite(out)))
            row["fp16_max_abs_vs_fp32"] = float(np.nanmax(np.abs(out - fp32_out)))
            row["fp16_nan_fraction"] = float(np.mean(~np.isfinite(out)))
            row["check"] = result.to_json() if result is not None else None
            # every tensor read back in its fp16 type (what TensorRT stores): where the unchecked graph overflows
            peaks, _ = activation_peaks(fp16, feeds)
            row["fp16_nonfinite_tensors"] = sorted(n for n, v in peaks.items() if not np.isfinite(v))[:10]
        row["fp32_output_max_abs"] = float(np.max(np.abs(fp32_out)))
        row["seconds"] = round(time.perf_counter() - t0, 2)
        runs.append(row)
        print(json.dumps(row)[:600], file=sys.stderr)
    data = {"what": "SDXL VAE config scaled 4x down, random weights; fp16 range check of compile's passes stage",
            "unscaled_conv_peak": seen[0], "target_peak": args.peak,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
            "scaled_conv": "decoder.up_blocks[-1].resnets[0].conv1 (weight and bias; norm2 GroupNorm follows)",
            "image_size": args.size, "target": "tensorrt/fp16 (standard ops: runs on the CPU provider)",
            "torch": torch.__version__, "onnx": onnx.__version__, "runs": runs}
    if args.out is not None:
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

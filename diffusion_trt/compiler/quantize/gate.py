"""The quality gate: the quantized graph against fp32 on held-out data (ONNX Runtime CPU), refused below
:class:`Thresholds` unless the user accepts the loss."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import QualityGateError
from ..calibrate import CapturedData, Generation, LoopSettings, ort_unet_fn

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Thresholds:
    """Quality-gate thresholds (defaults are what a usable int8 SD-1.x UNet reaches; see the docs below).

    Attributes:
        min_cosine: lowest allowed per-step cosine similarity between the quantized and the fp32 UNet's noise
            prediction on held-out inputs (worst step). Default 0.98: published int8 SD UNets keep ~0.99+.
        min_psnr: lowest allowed PSNR (dB) of the final held-out image vs fp32, worst prompt. Default 20 dB:
            the same composition, visible texture noise at most (the error compounds over the whole loop).
    """

    min_cosine: float = 0.98
    min_psnr: float = 20.0


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two arrays, flattened, in float64 (1.0 when both are all zero)."""
    x, y = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    den = float(np.linalg.norm(x) * np.linalg.norm(y))
    return 1.0 if den == 0.0 else float(np.dot(x, y) / den)


def psnr(a: np.ndarray, b: np.ndarray, peak: float = 1.0) -> float:
    """PSNR in dB of two images in [0, peak] (``inf`` when identical; reported as 99.0)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0.0 else min(99.0, 10.0 * math.log10(peak * peak / mse))


def cpu_session(path: Path, threads: int | None = None) -> Any:
    """An ONNX Runtime CPU session (full graph optimization: QDQ fuses into int8 kernels, as at run time)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def measure_quality(
    component: str,
    fp32_path: Path,
    quant_path: Path,
    reference: CapturedData,
    generation: Generation | None,
    prompts: Sequence[str],
    settings: LoopSettings,
) -> dict[str, Any]:
    """Compare the quantized graph with fp32 on held-out data (ONNX Runtime CPU for both graphs).

    UNet: per captured step, cosine similarity of the noise predictions of the fp32 and the quantized graph on
    the same held-out input; then every held-out prompt generated again with the quantized UNet, PSNR of its
    final image against the fp32 one (``reference.images``). VAE decoder: cosine and PSNR of the decoded images.

    Returns:
        ``{"cosine_min", "cosine_mean", "cosine_per_step", "psnr_min_db", "psnr_mean_db", "held_out_prompts",
        "steps", "seconds"}``.
    """
    t0 = time.perf_counter()
    ref_sess, q_sess = cpu_session(fp32_path), cpu_session(quant_path)
    feeds = reference.feeds[component]
    out_name = "noise_pred" if component == "unet" else "sample"
    cos = []
    for f in feeds:
        a = ref_sess.run([out_name], dict(f))[0]
        b = q_sess.run([out_name], dict(f))[0]
        cos.append(cosine(a, b))
    if component == "unet":
        assert generation is not None
        quant = generation.run(prompts, settings, ort_unet_fn(q_sess), decode=True)
        psnrs = [psnr(a, b) for a, b in zip(reference.images, quant.images, strict=True)]
    else:
        psnrs = []
        for f in feeds:
            a = ref_sess.run([out_name], dict(f))[0]
            b = q_sess.run([out_name], dict(f))[0]
            psnrs.append(psnr(np.clip(a * 0.5 + 0.5, 0, 1), np.clip(b * 0.5 + 0.5, 0, 1)))
    return {
        "cosine_min": round(min(cos), 6),
        "cosine_mean": round(float(np.mean(cos)), 6),
        "cosine_per_step": [round(c, 6) for c in cos],
        "psnr_min_db": round(min(psnrs), 3),
        "psnr_mean_db": round(float(np.mean(psnrs)), 3),
        "held_out_prompts": len(prompts),
        "steps": settings.to_json(),
        "seconds": round(time.perf_counter() - t0, 3),
    }


def quality_gate(component: str, figures: dict[str, Any], thresholds: Thresholds, accept_quality_loss: bool) -> None:
    """Refuse (raise) when a figure is below its threshold, unless ``accept_quality_loss``; record the verdict.

    Adds ``thresholds``, ``passed`` and ``accepted_quality_loss`` to ``figures``.

    Raises:
        QualityGateError: naming the figure, its value, the threshold and the flags that change the outcome.
    """
    failures = []
    if figures["cosine_min"] < thresholds.min_cosine:
        failures.append(f"worst per-step cosine similarity {figures['cosine_min']:.4f} < --min-cosine "
                        f"{thresholds.min_cosine}")
    if figures["psnr_min_db"] < thresholds.min_psnr:
        failures.append(f"worst final-image PSNR {figures['psnr_min_db']:.2f} dB < --min-psnr {thresholds.min_psnr} dB")
    figures["thresholds"] = {"min_cosine": thresholds.min_cosine, "min_psnr_db": thresholds.min_psnr}
    figures["passed"] = not failures
    figures["accepted_quality_loss"] = bool(failures) and accept_quality_loss
    if failures and not accept_quality_loss:
        raise QualityGateError(
            f"quality gate: the quantized {component} is too far from fp32 on {figures['held_out_prompts']} held-out "
            f"prompts: {'; '.join(failures)}. Nothing was written. Pass --accept-quality-loss to write it anyway, or "
            "calibrate on more data (--calibration-size, --calibration-steps), exclude more layers "
            "(--quantize-exclude), or try --calibration-method entropy/percentile"
        )
    if failures:
        logger.warning("%s: quality below threshold, written anyway (--accept-quality-loss): %s",
                       component, "; ".join(failures))

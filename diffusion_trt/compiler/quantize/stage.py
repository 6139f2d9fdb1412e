"""The compile stage: calibrate -> quantize -> gate for the components of one compile (:class:`QuantizeStage`)."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..calibrate import CapturedData, Generation, LoopSettings
from .calibrator import LoopCalibrator
from .exclusions import DEFAULT_EXCLUDE
from .gate import Thresholds, measure_quality, quality_gate
from .qdq import quantize_onnx
from .spec import QuantizeSpec

logger = logging.getLogger(__name__)

#: Prompts denoised together by the calibration loops (UNet batch 2 * CALIBRATION_BATCH with CFG); see
#: ``Generation.run(batch_size=...)``; part of the cache key (a larger batch changes float rounding). 1: on the
#: 2-core CPU host the augmented SD-1.5 graph (ORT, no graph optimizations, as ORT's calibrators run it) took
#: 32.1 s per prompt and UNet call at batch 4 vs 25.6 s at batch 2 (both at load ~4.3) and peaked at 20.7 GiB RSS
#: instead of 14.0 GiB (benchmarks/results/README.md); the torch UNet is ~10 % faster per image at batch 4.
CALIBRATION_BATCH = 1


class QuantizeStage:
    """Calibrate -> quantize -> gate for the components of one compile, sharing the captured data.

    Calibration feeds are captured once, on the first cache miss (all components from the same loops): the UNet's
    ranges come from the loop its own fp32 graph drives (:class:`LoopCalibrator`, one UNet run per step), the VAE
    decoder's from the final latents of that loop (or of the torch UNet's loop when the UNet's ranges came from the
    cache, or with SmoothQuant, which needs the feeds themselves). The held-out reference once, on the first gate.

    Args:
        generation: the fp32 torch modules, tokenizer and scheduler (:class:`~.calibrate.Generation`).
        config: the ``QuantizeConfig`` (see diffusion_trt/config.py).
        precision, backend: "int8"/"fp8"; "ort"/"tensorrt".
        height, width: calibration image size (the profile's opt size).
        key_facts: more things the ranges depend on (model hash, pass pipeline, tool versions).
    """

    def __init__(self, generation: Generation, config: Any, precision: str, backend: str, height: int, width: int,
                 key_facts: Mapping[str, Any]) -> None:
        from ..calibrate import prompts_sha256, read_prompts, select_prompts

        self.generation = generation
        self.config = config
        self.spec = QuantizeSpec(
            precision=precision, backend=backend, method=config.method,
            exclude=DEFAULT_EXCLUDE if config.exclude is None else tuple(config.exclude),
            smooth_quant_alpha=config.smooth_quant_alpha,
        )
        self.prompts = select_prompts(read_prompts(config.prompts), config.size)
        self.settings = LoopSettings(steps=config.steps, seed=config.seed, height=height, width=width)
        self.batch_size = CALIBRATION_BATCH
        # the UNet is calibrated through the loop its own fp32 graph drives (LoopCalibrator), prompts in batches
        self.key_facts = {**key_facts, "prompts_sha256": prompts_sha256(self.prompts), "size": config.size,
                          **{f"loop_{k}": v for k, v in self.settings.to_json().items()},
                          "loop_batch_size": self.batch_size, "loop_unet": "onnx"}
        self.thresholds = Thresholds(config.min_cosine, config.min_psnr)
        from ..calibrate import HELD_OUT_PROMPTS

        self.held_out = list(HELD_OUT_PROMPTS[: config.held_out])
        self._data: CapturedData | None = None
        self._reference: CapturedData | None = None
        self.capture_seconds = 0.0

    def _feeds(self, component: str) -> list[dict[str, np.ndarray]]:
        """The captured feeds of ``component`` (the torch loop runs once if no loop ran yet: SmoothQuant, or a VAE
        decoder calibrated after a UNet cache hit)."""
        if self._data is None:
            t0 = time.perf_counter()
            logger.info("calibration: %d prompts x %d steps (seed %d, %dx%d, torch UNet)", len(self.prompts),
                        self.settings.steps, self.settings.seed, self.settings.width, self.settings.height)
            self._data = self.generation.run(self.prompts, self.settings, batch_size=self.batch_size)
            self.capture_seconds = time.perf_counter() - t0
        return self._data.feeds[component]

    def _loop_ranges(self, graph: Path, method: Any, out: Path) -> None:
        """Calibrate the UNet graph through the denoising loop it drives itself (:class:`LoopCalibrator`); the
        feeds the loop saw are kept for the components after it (the VAE decoder's) and for the record."""
        t0 = time.perf_counter()
        logger.info("calibration: %d prompts x %d steps (seed %d, %dx%d, the fp32 UNet graph through ONNX Runtime, "
                    "%d prompts per UNet call)", len(self.prompts), self.settings.steps, self.settings.seed,
                    self.settings.width, self.settings.height, self.batch_size)
        with tempfile.TemporaryDirectory(prefix="dtrt-calib-") as tmp:
            loop = LoopCalibrator(graph, method, Path(tmp))
            try:
                self._data = self.generation.run(
                    self.prompts, self.settings, loop.unet_fn, batch_size=self.batch_size,
                    final_latents="vae_decoder" in self.config.components, on_capture=loop.fold,
                )
                loop.save(out)
            finally:
                loop.close()
        self.capture_seconds = time.perf_counter() - t0

    def run(self, component: str, fp32_path: Path, out_path: Path, cache_out: Path) -> dict[str, Any]:
        """Quantize ``fp32_path`` into ``out_path``, store the cache in ``cache_out``, measure and gate.

        Returns:
            The manifest's ``quantization`` entry, ``quality`` included.

        Raises:
            QualityGateError: below a threshold without ``accept_quality_loss``.
        """
        loop = component == "unet" and self.spec.smooth_quant_alpha is None
        facts = quantize_onnx(fp32_path, out_path, self.spec, lambda: self._feeds(component),
                              cache_settings=self.key_facts, cache_in=self.config.cache, cache_out=cache_out,
                              component=component, calibrate=self._loop_ranges if loop else None)
        calibration = facts["calibration"]
        if not calibration["reused"] and self._data is not None:
            calibration["samples"] = len(self._data.feeds[component])
        calibration.update({"prompts_sha256": self.key_facts["prompts_sha256"], "seed": self.settings.seed,
                            "size": self.config.size, "steps": self.settings.steps,
                            "loop": "onnx" if loop else "torch", "batch_size": self.batch_size,
                            "capture_seconds": round(self.capture_seconds, 3)})
        self._share_cache(component, cache_out, facts)
        if self._reference is None:
            self._reference = self.generation.run(self.held_out, self.settings, decode=True)
        figures = measure_quality(component, fp32_path, out_path, self._reference, self.generation, self.held_out,
                                  self.settings)
        facts["quality"] = figures
        logger.info("%s %s quality: cosine min %.4f mean %.4f, PSNR min %.2f dB (%d held-out prompts)",
                    component, self.spec.precision, figures["cosine_min"], figures["cosine_mean"],
                    figures["psnr_min_db"], len(self.held_out))
        quality_gate(component, figures, self.thresholds, self.config.accept_quality_loss)
        return facts

    def _share_cache(self, component: str, cache_out: Path, facts: dict[str, Any]) -> None:
        """A ``--calibration-cache`` folder without this cache receives a copy (so later compiles reuse it)."""
        loc = self.config.cache
        if loc is None or facts["calibration"]["reused"]:
            return
        p = Path(loc).expanduser()
        if p.is_file() or p.suffix == ".json" or (p / "manifest.json").exists():
            return
        p.mkdir(parents=True, exist_ok=True)
        for name in (f"{component}.json", f"{component}.ranges.json"):
            shutil.copyfile(cache_out / name, p / name)
        logger.info("%s: calibration cache written to %s", component, p)

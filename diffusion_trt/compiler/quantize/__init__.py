"""Explicit int8 / fp8 quantization (QDQ graphs) with ONNX Runtime's calibrators, a cache and a quality gate.

::

    fp32 optimized ONNX ──name nodes──► ──exclusions (structural)──► onnxruntime.quantization.quantize_static
        (QuantFormat.QDQ, per-channel symmetric weights, per-tensor activations, calibrated on captured feeds)
        ──► QDQ ONNX (TensorRT consumes it directly; ORT CPU fuses it into int8 kernels)
        ──► quality gate (ORT CPU: per-step cosine of the noise prediction, final-image PSNR) ──► or refuse

One job per module:

* :mod:`.exclusions`  the nodes left float (:data:`DEFAULT_EXCLUDE`, found from the graph's structure).
* :mod:`.spec`        :class:`QuantizeSpec`, the ONNX Runtime types per precision and backend, SmoothQuant's check.
* :mod:`.calibrator`  tensor ranges: :func:`calibrate_ranges` over captured feeds, :class:`LoopCalibrator` in the loop.
* :mod:`.cache`       the calibration cache (key, lookup, write).
* :mod:`.qdq`         :func:`quantize_onnx`: fp32 graph -> QDQ graph.
* :mod:`.gate`        the quality gate (:func:`measure_quality`, :func:`quality_gate`, :class:`Thresholds`).
* :mod:`.fp8`         fp8's compute-capability check, before any calibration.
* :mod:`.stage`       :class:`QuantizeStage`: calibrate -> quantize -> gate for the components of one compile.
"""

from .cache import CACHE_FORMAT, cache_key, find_cache, write_cache
from .calibrator import CALIBRATION_CHUNK, LoopCalibrator, calibrate_ranges
from .exclusions import DEFAULT_EXCLUDE, EXCLUDE_CATEGORIES, QUANTIZED_OP_TYPES, name_nodes, sensitive_nodes
from .fp8 import check_fp8_target
from .gate import Thresholds, cosine, cpu_session, measure_quality, psnr, quality_gate
from .qdq import _fp8_nan_check_once as _fp8_nan_check_once  # re-exported for tests/compiler/test_quantize.py
from .qdq import quantize_onnx
from .spec import (
    CALIBRATION_METHODS,
    SMOOTH_QUANT_MODULE,
    QuantizeSpec,
    onnx_precision_types,
    smooth_quant_available,
    smooth_quant_unavailable,
)
from .stage import CALIBRATION_BATCH, QuantizeStage

__all__ = [
    "CACHE_FORMAT", "CALIBRATION_BATCH", "CALIBRATION_CHUNK", "CALIBRATION_METHODS", "DEFAULT_EXCLUDE",
    "EXCLUDE_CATEGORIES", "QUANTIZED_OP_TYPES", "SMOOTH_QUANT_MODULE", "LoopCalibrator", "QuantizeSpec",
    "QuantizeStage", "Thresholds", "cache_key", "calibrate_ranges", "check_fp8_target", "cosine", "cpu_session",
    "find_cache", "measure_quality", "name_nodes", "onnx_precision_types", "psnr", "quality_gate", "quantize_onnx",
    "sensitive_nodes", "smooth_quant_available", "smooth_quant_unavailable", "write_cache",
]

"""What quantization does to one component (:class:`QuantizeSpec`) and the ONNX Runtime types it maps to.

Activations: per-tensor. For TensorRT, symmetric int8 (zero point 0: what TensorRT's explicit quantization
takes). For ONNX Runtime CPU, asymmetric uint8 activations with int8 weights (ORT's recommended "U8S8" for x86).
fp8: E4M3 weights and activations (``QuantType.QFLOAT8E4M3FN``) with ORT's ``Distribution`` calibrator, the only
one ORT accepts for float8; TensorRT only, and only for compute capability >= 8.9 (:mod:`.fp8`, checked by the
caller before any calibration).

SmoothQuant: ``onnxruntime.quantization`` implements it (``extra_options={"SmoothQuant": True,
"SmoothQuantAlpha": a}``) by importing Intel Neural Compressor's ONNX Runtime adaptor
(:data:`SMOOTH_QUANT_MODULE`); it then smooths every MatMul whose input comes from a foldable op (attention
projections and feed-forward layers in the UNet). That adaptor ships with neural-compressor 2.x through 3.7.1 only
(3.8 removed it; ``pip install neural-compressor`` gets 3.10 without it), and every one of those releases requires
numpy<2, so it cannot be installed beside this project's numpy 2 environment; see :func:`smooth_quant_unavailable`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from ...artifact.manifest import Backend
from ...errors import RuntimeInputError
from .exclusions import DEFAULT_EXCLUDE, QUANTIZED_OP_TYPES

CALIBRATION_METHODS: tuple[str, ...] = ("minmax", "entropy", "percentile")


def onnx_precision_types(precision: str, backend: str) -> tuple[Any, Any, bool]:
    """(activation QuantType, weight QuantType, symmetric activations) for a product precision and backend."""
    from onnxruntime.quantization import QuantType

    if precision == "fp8":
        return QuantType.QFLOAT8E4M3FN, QuantType.QFLOAT8E4M3FN, True
    if precision == "int8":
        if backend == Backend.TENSORRT:
            return QuantType.QInt8, QuantType.QInt8, True
        return QuantType.QUInt8, QuantType.QInt8, False
    raise RuntimeInputError(f"precision={precision!r} is not a quantized precision; use int8 or fp8")


#: What ``onnxruntime.quantization.quantize_static`` imports for SmoothQuant (neural-compressor 2.x..3.7.1).
SMOOTH_QUANT_MODULE = "neural_compressor.adaptor.ox_utils.smooth_quant"


def smooth_quant_unavailable() -> str | None:
    """Why ``onnxruntime.quantization``'s SmoothQuant cannot run here, or ``None`` when it can.

    Imports :data:`SMOOTH_QUANT_MODULE` (and with it neural-compressor, seconds) when the package is installed.
    """
    if importlib.util.find_spec("neural_compressor") is None:
        return "Intel Neural Compressor (neural-compressor) is not installed"
    try:
        importlib.import_module(SMOOTH_QUANT_MODULE)
    except Exception as e:  # noqa: BLE001 - any import failure means the same to the caller
        from importlib.metadata import PackageNotFoundError, version

        try:
            have = f"neural-compressor {version('neural-compressor')}"
        except PackageNotFoundError:
            have = "the installed neural_compressor"
        return f"{have} cannot import {SMOOTH_QUANT_MODULE} ({type(e).__name__}: {e})"
    return None


def smooth_quant_available() -> bool:
    """Whether ``onnxruntime.quantization``'s SmoothQuant can run here (see :func:`smooth_quant_unavailable`)."""
    return smooth_quant_unavailable() is None


@dataclass(frozen=True)
class QuantizeSpec:
    """What :func:`quantize_onnx` does to one component.

    Attributes:
        precision: "int8" or "fp8".
        backend: ``Backend.ORT`` or ``Backend.TENSORRT`` (or their values; chooses the activation type, see the
            module docstring).
        method: "minmax", "entropy" or "percentile" (int8); fp8 always uses ORT's "distribution".
        per_channel: per-output-channel weight scales.
        exclude: exclusion categories and/or node names (module docstring).
        smooth_quant_alpha: SmoothQuant migration strength in [0, 1]; ``None`` = off.
    """

    precision: str
    backend: str
    method: str = "minmax"
    per_channel: bool = True
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    smooth_quant_alpha: float | None = None

    def settings(self) -> dict[str, Any]:
        act, weight, sym = onnx_precision_types(self.precision, self.backend)
        return {"precision": self.precision, "backend": str(self.backend), "method": self._method_name(),
                "per_channel": self.per_channel, "activation_type": act.name, "weight_type": weight.name,
                "symmetric_activations": sym, "smooth_quant_alpha": self.smooth_quant_alpha,
                "op_types": list(QUANTIZED_OP_TYPES)}

    def _method_name(self) -> str:
        return "distribution" if self.precision == "fp8" else self.method

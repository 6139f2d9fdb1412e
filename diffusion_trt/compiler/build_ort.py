"""The ONNX Runtime "engine": the optimized ONNX file, checked and test-loaded for its provider.

ONNX Runtime builds its kernels when a session starts, so for this backend the artifact ships the
optimized graph itself. What this stage adds is the guarantee that the file loads: ``onnx.checker`` on
the saved file (path-based, so it works past protobuf's 2 GB limit) and a session created with the
target provider where this machine has it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import onnx

from ..errors import BuildError
from ..passes.onnx_files import save_onnx_file

logger = logging.getLogger(__name__)

#: A model with at least this many bytes of weights keeps them in ``model.onnx.data`` beside it. Protobuf refuses
#: messages over 2 GiB, but the reason for a low threshold is loading (issue 28): the loader then parses a graph of a
#: few MB instead of a 1.7 GB protobuf (the SD-1.5 fp16 UNet), verifies the weights on several threads by chunk
#: (:mod:`~diffusion_trt.artifact.digests`) and hands them to ONNX Runtime from memory without another copy. The
#: tiny test models stay inline.
EXTERNAL_DATA_THRESHOLD_BYTES = 64 << 20
EXTERNAL_DATA_NAME = "model.onnx.data"


def initializer_bytes(model: onnx.ModelProto) -> int:
    """Bytes of weight data held in the model (raw_data and typed fields, approximately)."""
    total = 0
    for t in model.graph.initializer:
        if t.raw_data:
            total += len(t.raw_data)
        else:
            total += 4 * (len(t.float_data) + len(t.int32_data)) + 8 * (len(t.int64_data) + len(t.double_data))
    return total


def save_onnx(model: onnx.ModelProto, path: Path) -> list[Path]:
    """Save ``model`` to ``path``; weights go to ``model.onnx.data`` beside it when they reach
    :data:`EXTERNAL_DATA_THRESHOLD_BYTES` (64 MiB).

    Returns:
        The files written (the .onnx file first).
    """
    return save_onnx_file(model, path, external=initializer_bytes(model) >= EXTERNAL_DATA_THRESHOLD_BYTES,
                          location=EXTERNAL_DATA_NAME)


def providers_for(device: str) -> list[str]:
    """ONNX Runtime execution providers for a device: CUDA falls back to nothing (we want to know)."""
    return ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]


def engine_from_onnx(path: Path, device: str, test_load: bool = True) -> dict[str, Any]:
    """Check a saved ONNX file and, if the provider is present here, load it in an ORT session.

    Args:
        path: the optimized ``model.onnx``.
        device: "cpu" or "cuda".
        test_load: create a session to prove the file loads (skipped, with a warning, when this
            machine lacks the provider, e.g. compiling for CUDA on a CPU-only host).

    Returns:
        Manifest facts: ``{"providers": [...], "test_loaded": bool}``.

    Raises:
        BuildError: the checker or ONNX Runtime rejects the file.
    """
    try:
        onnx.checker.check_model(str(path))
    except Exception as e:
        raise BuildError(f"{path} fails onnx.checker: {e}") from e
    providers = providers_for(device)
    loaded = False
    if test_load:
        import onnxruntime as ort

        if all(p in ort.get_available_providers() for p in providers):
            so = ort.SessionOptions()
            so.log_severity_level = 3
            # ORT_DISABLE_ALL: we only prove the file loads; the real session optimizes at run time
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            try:
                ort.InferenceSession(str(path), so, providers=providers)
            except Exception as e:
                raise BuildError(f"ONNX Runtime cannot load {path} with {providers}: {e}") from e
            loaded = True
        else:
            logger.warning(
                "%s not available here (have %s): %s was not test-loaded",
                providers,
                ort.get_available_providers(),
                path.name,
            )
    return {"providers": providers, "test_loaded": loaded}

"""TensorRT memory facts read from a deserialised engine, and weight streaming (TensorRT >= 10.0).

Imported by :mod:`.trt_engine` only (needs nothing but the engine object; no ``import tensorrt`` here). Sources:
TensorRT Python API, ``ICudaEngine``: ``device_memory_size_v2`` / ``get_device_memory_size_for_profile_v2``
(activation bytes an execution context needs, per optimization profile; with weight streaming they include the
streaming scratch), ``streamable_weights_size`` (bytes of weights that may stay on the host: 0 unless the plan was
built with ``BuilderFlag.WEIGHT_STREAMING``), ``weight_streaming_budget_v2`` (bytes of streamable weights kept on
the device; set before creating execution contexts), ``get_weight_streaming_automatic_budget()``.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ArtifactError
from ...trt_compat import assign

logger = logging.getLogger(__name__)


def engine_memory_facts(engine: Any) -> dict[str, Any]:
    """What an engine says about its memory, in bytes (absent attributes of older TensorRT are ``None``).

    Returns:
        ``{"device_memory_bytes": int|None, "device_memory_per_profile_bytes": [int], "streamable_weights_bytes":
        int|None, "weight_streaming_budget_bytes": int|None}``.
    """
    def get(*attrs: str) -> int | None:  # the first attribute the engine has; a real 0 stays 0
        for attr in attrs:
            value = getattr(engine, attr, None)
            if isinstance(value, int):
                return int(value)
        return None

    per_profile = []
    fn = getattr(engine, "get_device_memory_size_for_profile_v2", None)
    if fn is not None:
        per_profile = [int(fn(p)) for p in range(int(getattr(engine, "num_optimization_profiles", 1)))]
    return {
        "device_memory_bytes": get("device_memory_size_v2", "device_memory_size"),
        "device_memory_per_profile_bytes": per_profile,
        "streamable_weights_bytes": get("streamable_weights_size"),
        "weight_streaming_budget_bytes": get("weight_streaming_budget_v2"),
    }


def apply_weight_streaming(engine: Any, budget: int | None, where: str, trt_logger: Any = None,
                           display: str = "TensorRT") -> None:
    """Keep at most ``budget`` bytes of the engine's streamable weights on the device; ``None`` = leave as built.

    Args:
        trt_logger: the library's logger (:func:`~diffusion_trt.trt_compat.make_trt_logger`): an error it gets while
            the budget is set means the budget was refused.
        display: the library's name in messages.

    Raises:
        ArtifactError: a budget for a plan without streamable weights (built without weight streaming) or a
            TensorRT without ``weight_streaming_budget_v2``, or one the library refuses (it logs an error or keeps
            the old budget; :func:`~diffusion_trt.trt_compat.assign`).
    """
    if budget is None:
        return
    streamable = getattr(engine, "streamable_weights_size", None)
    if not streamable or not hasattr(engine, "weight_streaming_budget_v2"):
        raise ArtifactError(
            f"{where}: a weight-streaming budget of {budget} bytes was asked for, but this plan has no streamable "
            "weights (built without BuilderFlag.WEIGHT_STREAMING, or TensorRT < 10.1); rebuild with "
            "TrtBuildConfig(weight_streaming=True), or give a budget the plan fits without streaming"
        )
    value = max(0, min(int(budget), int(streamable)))
    refused = assign(engine, "weight_streaming_budget_v2", value, trt_logger)
    if refused is not None:
        raise ArtifactError(
            f"{where}: {display} refused a weight-streaming budget of {value} bytes (of {int(streamable)} streamable: "
            f"{refused}); give another budget, or none"
        )
    logger.info("%s: weight streaming keeps %.0f of %.0f MiB of streamable weights on the device", where,
                value / 2**20, int(streamable) / 2**20)

"""The runtime: run a compiled artifact's engines in the Stable Diffusion loop.

Imports neither ``compiler/`` nor ``passes/``; heavy modules (torch, onnxruntime, diffusers) load on first
use of a name below::

    from diffusion_trt.runtime import EnginePipeline, save_png
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engines.engine import Engine, EngineSpec
    from .engines.ort_engine import OrtEngine
    from .parallel import DataParallelPipeline, parse_devices
    from .pipeline import EnginePipeline, EnginePipelineOutput
    from .png import read_png_parameters, save_png
    from .schedulers import SCHEDULERS, scheduler_names
    from .text_embeddings import EmbeddingCache

__all__ = [
    "SCHEDULERS",
    "DataParallelPipeline",
    "EmbeddingCache",
    "Engine",
    "EnginePipeline",
    "EnginePipelineOutput",
    "EngineSpec",
    "OrtEngine",
    "parse_devices",
    "read_png_parameters",
    "save_png",
    "scheduler_names",
]

_WHERE = {
    "Engine": "engines.engine",
    "EngineSpec": "engines.engine",
    "OrtEngine": "engines.ort_engine",
    "DataParallelPipeline": "parallel",
    "parse_devices": "parallel",
    "EmbeddingCache": "text_embeddings",
    "EnginePipeline": "pipeline",
    "EnginePipelineOutput": "pipeline",
    "read_png_parameters": "png",
    "save_png": "png",
    "SCHEDULERS": "schedulers",
    "scheduler_names": "schedulers",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)

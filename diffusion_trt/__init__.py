"""diffusion-trt: compile diffusers Stable Diffusion pipelines to ONNX Runtime / TensorRT engines and run them.

``from diffusion_trt import EnginePipeline`` (the diffusers convention: the main class at the top level) imports the
runtime on first use only, so ``import diffusion_trt`` (and the CLI's ``--help``) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runtime import DataParallelPipeline, EnginePipeline, EnginePipelineOutput

__all__ = ["DataParallelPipeline", "EnginePipeline", "EnginePipelineOutput"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import runtime

        return getattr(runtime, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

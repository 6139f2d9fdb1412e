"""Graph passes: ONNX graph -> ONNX graph rewrites (onnx, onnx-graphsurgeon and numpy only).

    model, records = optimize_model(model, pipeline_for("tensorrt", "cuda", "fp16", "unet"), ctx)
"""

from .base import Pass, PassContext, PassManager, PassRecord, PassResult, optimize_model
from .pipelines import pipeline_for

__all__ = ["Pass", "PassContext", "PassManager", "PassRecord", "PassResult", "optimize_model", "pipeline_for"]

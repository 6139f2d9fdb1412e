"""The engines: the :class:`~.engine.Engine` protocol (:mod:`.engine`) and its two implementations, ONNX Runtime
(:mod:`.ort_engine`, with size buckets in :mod:`.buckets`) and TensorRT / TensorRT-RTX (:mod:`.trt_engine`, its
memory facts and weight streaming in :mod:`.trt_memory`, its kernel cache file in :mod:`.runtime_cache`).

Nothing is imported here: import the module you need (``from diffusion_trt.runtime.engines.ort_engine import
OrtEngine``).
"""

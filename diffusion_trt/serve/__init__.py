"""Serving: ``serve`` (a live Triton server through PyTriton) and ``export-triton`` (a model repository).

Nothing here is imported by the rest of the package; PyTriton and tritonclient are optional
(``pip install 'diffusion-trt[serve]'``) and imported only inside the functions that need them.
"""

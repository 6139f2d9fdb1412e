"""The artifact folder and everything read from it: layout, ``manifest.json`` (schema, seal, the typed
:class:`~diffusion_trt.artifact.manifest.Manifest`), the one-descriptor reader, untrusted JSON values, build facts,
chunk digests, ``verify`` and ``inspect``'s summary.

Imports no torch, diffusers or compiler code: the runtime and ``verify`` use it.
"""

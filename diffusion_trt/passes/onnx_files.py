"""Writing an ONNX model to a file: the graph in ``.onnx``, its weights inline or in one external data file.

Why: an ONNX model is one protobuf message, and protobuf refuses to serialize or parse a message of 2 GiB or more
(``2**31 - 1`` bytes, its signed 32-bit size limit); an SD 1.5 UNet in fp32 is 3.4 GB. ONNX's answer is external
data (https://onnx.ai/onnx/repo-docs/ExternalData.html): each large tensor's bytes go to a file beside the model
and the tensor keeps only ``location``/``offset``/``length`` entries, paths relative to the ``.onnx`` file's folder.
"""

from __future__ import annotations

from pathlib import Path

import onnx

#: Tensors smaller than this (bytes) stay inline in the ``.onnx`` file even when the weights go external (onnx's
#: own default for ``size_threshold``: shape constants and scalars stay readable without the data file).
TENSOR_INLINE_BYTES = 1024


def save_onnx_file(model: onnx.ModelProto, path: str | Path, *, external: bool,
                   location: str | None = None) -> list[Path]:
    """Write ``model`` to ``path``, creating its folder; with ``external`` its weights to one data file beside it.

    Args:
        model: The model. With ``external`` onnx rewrites its tensors in place into external-data references (the
            caller's proto then points at the data file; it is not a copy).
        path: The ``.onnx`` file to write.
        external: Write every initializer and constant attribute tensor of :data:`TENSOR_INLINE_BYTES` (1 KiB) or
            more to the data file, smaller ones inline. ``False`` writes one self-contained file; the caller decides
            by size (the model must then stay below protobuf's 2 GiB limit; callers switch at 64 MiB..1.8 GB).
        location: The data file's name, relative to ``path``'s folder; default ``<path's name>.data``
            (``unet.onnx`` -> ``unet.onnx.data``). All tensors go to this one file, in graph order.

    Returns:
        The files written: ``[path]``, or ``[path, data file]`` with ``external``.

    Raises:
        ValueError: From onnx, for a model of 2 GiB or more with ``external=False``.
        OSError: The folder or a file cannot be written.

    A data file already at ``path.parent / location`` is removed first: onnx appends tensors to an existing file,
    which would leave the old bytes in it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not external:
        onnx.save_model(model, str(path))
        return [path]
    location = location or path.name + ".data"
    data = path.parent / location
    data.unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=TENSOR_INLINE_BYTES)
    return [path, data]

"""PNG output with the generation parameters embedded, so an image carries what it takes to reproduce it.

The parameters are one JSON object in the PNG text chunk ``parameters`` (the key A1111 and ComfyUI read),
written by :func:`save_png` and read back by :func:`read_png_parameters`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..artifact.folder import atomic_file
from ..errors import RuntimeInputError

logger = logging.getLogger(__name__)

PARAMETERS_KEY = "parameters"


def save_png(image: Any, path: str | os.PathLike[str], params: Mapping[str, Any] | None = None) -> Path:
    """Write ``image`` as PNG with ``params`` as JSON in the text chunk ``parameters``.

    The file appears atomically (temporary file then rename): a reader never sees half an image.

    Args:
        image: a ``PIL.Image.Image`` (e.g. one of ``EnginePipeline(...).images``).
        path: destination; parent folders are created.
        params: JSON-serialisable generation parameters (values that are not, such as paths, are written
            with ``str``).

    Returns:
        The path written.

    Raises:
        RuntimeInputError: ``image`` is not a PIL image or ``path`` does not end in ``.png``.
    """
    from PIL import Image, PngImagePlugin

    if not isinstance(image, Image.Image):
        raise RuntimeInputError(
            f"save_png got a {type(image).__name__}; pass a PIL.Image (call the pipeline with output_type='pil')"
        )
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise RuntimeInputError(f"save_png path {str(path)!r} does not end in .png; use e.g. {path.stem}.png")
    info = PngImagePlugin.PngInfo()
    if params is not None:
        info.add_text(PARAMETERS_KEY, json.dumps(dict(params), ensure_ascii=False, default=str))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, hidden=True) as f:
        image.save(f, format="PNG", pnginfo=info)
    logger.debug("wrote %s", path)
    return path


def read_png_parameters(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The parameters :func:`save_png` embedded in ``path``; ``None`` when the PNG has none (or not as JSON)."""
    from PIL import Image

    with Image.open(path) as im:
        text = getattr(im, "text", {}).get(PARAMETERS_KEY)
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None

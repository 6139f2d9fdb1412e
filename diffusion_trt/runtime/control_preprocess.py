"""Control-image preprocessing: the conditions made from a photo before a ControlNet reads it.

Only Canny edges for now (``run --control-preprocess canny``), with OpenCV's ``cv2.Canny`` as the diffusers ControlNet
examples make them; other conditions (depth, pose, line art) arrive as ready images.
"""

from __future__ import annotations

from typing import Any

from ..errors import RuntimeInputError

#: cv2.Canny's hysteresis thresholds of the diffusers ControlNet examples.
CANNY_LOW, CANNY_HIGH = 100, 200


def canny(image: Any, low: int = CANNY_LOW, high: int = CANNY_HIGH) -> Any:
    """The Canny edge map of an RGB ``PIL.Image`` as an RGB ``PIL.Image`` of the same size (edges 255, else 0).

    Raises:
        RuntimeInputError: OpenCV is not installed (naming the extra to install).
    """
    try:
        import cv2
    except ImportError:
        raise RuntimeInputError("--control-preprocess canny needs OpenCV; pip install -e '.[control]' "
                                "(opencv-python-headless)") from None
    import numpy as np
    from PIL import Image

    edges = cv2.Canny(np.asarray(image.convert("RGB")), low, high)
    return Image.fromarray(np.repeat(edges[:, :, None], 3, axis=2))

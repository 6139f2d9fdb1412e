"""``serve`` of an artifact compiled with ``--controlnet``: a request's ControlNet and control image.

Two optional request inputs, bound only when the artifact has ControlNets:

    controlnet     BYTES [1]  ``NAME`` or ``NAME:SCALE`` (scale finite, default 1.0 as diffusers' text-to-image
                              ControlNet pipeline); default the artifact's only ControlNet
    control_image  BYTES [1]  a PNG or JPEG file, base64-encoded (a ``data:image/...;base64,`` prefix is accepted), of
                              the output size (height x width, never resized), converted to RGB

The checks are ``run``'s (``--controlnet NAME[:SCALE] --control-image FILE``): a ControlNet without its image, an
unknown name (the known ones listed), a scale that is not finite, an image of another size; each is one line,
400 / INVALID_ARGUMENT. A request with a control image runs on ``unet_controlnet`` plus that ControlNet; requests
batch together only with the same ControlNet and scale (each keeps its own image).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import split_scale
from ..runtime.float_range import finite_in_float32
from ..runtime.image_inputs import declares_transparency, exif_upright, is_wide_mode
from .loras import one_text
from .triton_model import RequestError

#: The request inputs' names.
NAME_FIELD, IMAGE_FIELD = "controlnet", "control_image"
FIELDS = (NAME_FIELD, IMAGE_FIELD)
#: The base64 text of one control image at most (checked before the request reaches this process, too).
MAX_IMAGE_BYTES = 16 << 20
_FORMATS = ("PNG", "JPEG")


@dataclass(frozen=True)
class ControlRequest:
    """One request's ControlNet: its name, conditioning scale and image (float32 [3, H, W] in [0, 1], RGB)."""

    name: str
    scale: float
    image: np.ndarray = field(repr=False, compare=False)

    @property
    def key(self) -> tuple[str, float]:
        """What requests batched together must share."""
        return self.name, self.scale


class ControlNets:
    """The ControlNets a server offers (the artifact's ``controlnet_<name>`` components).

    Args:
        names: the artifact's ControlNet names (``runtime.controlnet.controlnet_names``).
    """

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def resolve(self, data: dict[str, Any], height: int, width: int) -> ControlRequest | None:
        """Pop the ``controlnet`` / ``control_image`` inputs from a request's tensors (absent or ``None``: not sent)
        and check them for an output of ``height`` x ``width`` pixels; ``None`` without a control image.

        Raises:
            RequestError: as the module docstring says, naming the field and the fix.
        """
        spec, encoded = data.pop(NAME_FIELD, None), data.pop(IMAGE_FIELD, None)
        text = one_text(NAME_FIELD, spec, "send it as text") if spec is not None else ""
        if encoded is None:
            if text:
                raise RequestError(NAME_FIELD, f"controlnet={text!r} was sent without control_image; send the "
                                   "control image (base64 PNG/JPEG of the output size) with it")
            return None
        name, scale = self._name_and_scale(text)
        image = one_text(IMAGE_FIELD, encoded, "send it as base64 text")
        return ControlRequest(name, scale, _image(image, name, height, width))

    def _name_and_scale(self, text: str) -> tuple[str, float]:
        name, scale_text, scale = split_scale(text, 1.0)
        if not name:
            if len(self.names) > 1:
                have = ", ".join(self.names)
                raise RequestError(NAME_FIELD, f"this server has {len(self.names)} ControlNets ({have}); name the "
                                   "one to use in controlnet (NAME or NAME:SCALE)")
            name = self.names[0]
        if name not in self.names:
            raise RequestError(NAME_FIELD, f"ControlNet {name!r} is not in this artifact; it has "
                               f"{', '.join(self.names)}")
        if not finite_in_float32(scale):
            raise RequestError(NAME_FIELD, f"controlnet={text!r}: the scale {scale_text!r} is not a finite number in "
                               f"float32's range; use e.g. {name}:0.8")
        return name, scale


def _image(text: str, name: str, height: int, width: int) -> np.ndarray:
    """The base64 control image as float32 [3, H, W] in [0, 1], upright (its EXIF orientation applied, as ``run``
    reads files), checked against the output size before decoding its pixels (a small file cannot unpack into a huge
    image; either way round, since the orientation may turn it a quarter) and again once upright."""
    from PIL import Image, UnidentifiedImageError

    if len(text) > MAX_IMAGE_BYTES:
        raise RequestError(IMAGE_FIELD, f"control_image has {len(text)} bytes of base64; at most {MAX_IMAGE_BYTES} "
                           "are accepted")
    if text.startswith("data:") and "," in text:
        text = text.partition(",")[2]
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(IMAGE_FIELD, "control_image is not base64; send the PNG/JPEG file's bytes base64-encoded "
                           "(standard alphabet)") from None
    try:
        img = Image.open(io.BytesIO(raw), formats=_FORMATS)
    except (UnidentifiedImageError, OSError):
        raise RequestError(IMAGE_FIELD, "control_image is not a PNG or JPEG file; send one, base64-encoded") from None
    if img.size not in ((width, height), (height, width)):  # from the header; its EXIF orientation may turn it
        raise _wrong_size(name, img.width, img.height, width, height)
    if declares_transparency(img):
        raise RequestError(IMAGE_FIELD, f"control_image has transparency (mode {img.mode}), which would be dropped "
                           "silently; flatten it onto a background and send it without alpha (RGB PNG or JPEG)")
    if is_wide_mode(img.mode):
        raise RequestError(IMAGE_FIELD, f"control_image is a {img.mode} (16-bit) image, whose values converting it "
                           "to RGB would clip to 0..255 (a depth map turns white); send an 8-bit PNG or JPEG")
    try:
        img = exif_upright(img)  # as run reads --control-image files (a phone's portrait photo is stored on its side)
        rgb = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
    except (OSError, ValueError) as e:
        raise RequestError(IMAGE_FIELD, f"control_image could not be decoded ({e}); send a whole PNG/JPEG") from None
    if img.size != (width, height):  # upright, the other way round
        raise _wrong_size(name, img.width, img.height, width, height)
    return np.ascontiguousarray(rgb.transpose(2, 0, 1))


def _wrong_size(name: str, w: int, h: int, width: int, height: int) -> RequestError:
    return RequestError(IMAGE_FIELD, f"control image for {name!r} is {w}x{h} (WxH) but the output is "
                                     f"{width}x{height}; resize it to the output size")


def stacked(requests: Sequence[ControlRequest]) -> Mapping[str, Any]:
    """The ``EnginePipeline`` keywords of a batch sharing one ControlNet and scale: each request's image as one row of
    ``control_image`` [n, 3, H, W] (float32 in [0, 1]), in order."""
    import torch

    first = requests[0]
    return {"controlnet": first.name, "controlnet_conditioning_scale": first.scale,
            "control_image": torch.from_numpy(np.stack([r.image for r in requests]))}

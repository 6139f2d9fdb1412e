"""``serve --lora-dir DIR``: the LoRAs a request may name, allow-listed at start-up.

Every ``*.safetensors`` file directly in ``DIR`` is checked once when the server starts (safetensors, LoRA keys,
sha256: :func:`~diffusion_trt.lora.check_lora_file`) and is known by its file name without the suffix. A request's
optional ``lora`` input (BYTES) is ``NAME`` or ``NAME:SCALE`` (scale 1.0 by default, finite, at most
:data:`MAX_ABS_SCALE` in magnitude); an empty string or no input means the base model. Names are looked up in the
list made at start-up only: a request never names a path, and a file added later is not served until a restart.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..config import split_scale
from ..errors import LoraError
from ..lora import LORA_SUFFIX, check_lora_file
from .triton_model import RequestError

#: The ``lora`` request input's name.
FIELD = "lora"
#: Largest |scale| a request may ask (beyond it a LoRA overflows the weights it changes; diffusers users stay in 0..2).
MAX_ABS_SCALE = 4.0


class LoraLibrary:
    """The allow-listed LoRAs of ``serve``.

    Args:
        folder: the ``--lora-dir`` folder.

    Raises:
        LoraError: ``folder`` is not a folder, holds no ``.safetensors`` file, or one of them is no LoRA.
    """

    def __init__(self, folder: str | Path) -> None:
        root = Path(folder)
        if not root.is_dir():
            raise LoraError(f"--lora-dir {root} is not a folder; pass the folder holding the .safetensors LoRAs")
        files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() == LORA_SUFFIX)
        if not files:
            raise LoraError(f"--lora-dir {root} holds no .safetensors file; put the LoRAs to serve there")
        self.paths: dict[str, Path] = {p.stem: check_lora_file(p).path for p in files}

    def resolve(self, value: Any) -> tuple[str, float] | None:
        """A request's ``lora`` tensor (absent: ``None``) as ``(path, scale)``, or ``None`` for the base model.

        Raises:
            RequestError: not one BYTES value of UTF-8, an unknown name (the message lists the known ones), or a
                scale that is not a finite number within +-:data:`MAX_ABS_SCALE`.
        """
        if value is None:
            return None
        text = one_text(FIELD, value, "send the LoRA's name as UTF-8")
        if not text:
            return None
        name, _, scale = split_scale(text, 1.0, empty_is_default=True)
        if name not in self.paths:
            known = ", ".join(sorted(self.paths)[:20])
            raise RequestError(FIELD, f"lora={name!r} is not one of the LoRAs this server offers ({known}); send one "
                               "of these names, NAME:SCALE, or no lora for the base model")
        if not math.isfinite(scale) or abs(scale) > MAX_ABS_SCALE:
            raise RequestError(FIELD, f"lora={text!r}: the scale must be a number in -{MAX_ABS_SCALE:g}.."
                               f"{MAX_ABS_SCALE:g}, e.g. {name}:0.8")
        return str(self.paths[name]), scale


def one_text(where: str, value: Any, fix: str) -> str:
    """The one UTF-8 string (stripped) of the BYTES request tensor ``where``.

    Raises:
        RequestError: not one BYTES value, or not UTF-8 (the message ends with ``fix``).
    """
    array = np.asarray(value)
    if array.size != 1 or array.dtype.kind not in "OSU":
        raise RequestError(where, f"{where} must be one BYTES value (shape [1]), got {array.dtype} "
                           f"{list(array.shape)}")
    item = array.reshape(-1)[0]
    if isinstance(item, bytes | np.bytes_):
        try:
            return bytes(item).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise RequestError(where, f"{where} is not valid UTF-8; {fix}") from None
    return str(item).strip()

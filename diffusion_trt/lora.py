"""LoRA files: ``FILE[:scale]`` arguments and file checks, shared by ``compile --lora`` and ``load_lora``.

A LoRA is read from ``.safetensors`` only (a pickle runs code when loaded), must hold tensors with ``lora`` in their
names, and is identified by its sha256 (the manifest records ``{"file", "sha256", "scale", "layers"}`` per merged
LoRA). Merging at compile time is :mod:`diffusion_trt.compiler.lora`; the refit weights of ``load_lora`` are
:mod:`diffusion_trt.runtime.refit`. This module imports neither (a serving host reads LoRA files with it).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .config import is_real_number, split_scale
from .errors import LoraError

logger = logging.getLogger(__name__)

LORA_SUFFIX = ".safetensors"
#: The safetensors header key holding diffusers' LoRA adapter config (``LORA_ADAPTER_METADATA_KEY``): a JSON object.
LORA_METADATA_KEY = "lora_adapter_metadata"


@dataclass(frozen=True)
class LoraFile:
    """A checked LoRA file.

    Attributes:
        path: the file.
        scale: the LoRA's weight (diffusers' ``lora_scale``); 0 merges nothing.
        digest: the file's hex sha256, or its computation on a thread (``check_lora_file(background=True)``);
            read it as :attr:`sha256`.
    """

    path: Path
    scale: float
    digest: str | Future[str]

    @property
    def sha256(self) -> str:
        """Hex sha256 of the file (waiting for it when it is being computed on a thread)."""
        return self.digest if isinstance(self.digest, str) else self.digest.result()

    def record(self, layers: dict[str, int]) -> dict[str, Any]:
        """The manifest entry: file name, sha256, scale and the layers merged per component."""
        return {"file": self.path.name, "sha256": self.sha256, "scale": self.scale, "layers": layers}


@dataclass(frozen=True)
class LoadedLoras:
    """What the run-time LoRA(s) loaded now do to a pipeline's engines, the same value for both ways of loading
    them (ONNX Runtime weight inputs, TensorRT refit), whose records differ (``EnginePipeline.lora``).

    Attributes:
        files: the LoRA file names, in load order.
        changed: component -> how many of its weights now differ from the base; 0 everywhere when every scale is 0
            (the weights bound or refitted then equal the base).
    """

    files: tuple[str, ...]
    changed: Mapping[str, int]

    @classmethod
    def of(cls, files: Sequence[LoraFile], changed: Mapping[str, int]) -> LoadedLoras:
        """From the checked files and what loading them changed per component (bound other than the base, or
        refitted)."""
        zero = all(f.scale == 0 for f in files)
        return cls(tuple(f.path.name for f in files), MappingProxyType({c: 0 if zero else int(n)
                                                                      for c, n in changed.items()}))


def looks_like_lora(keys: Iterable[Any]) -> bool:
    """Whether tensor names are a LoRA's (kohya ``lora_unet_*`` / ``lora_te_*``, diffusers' ``.lora.down``, peft's
    ``lora_A``): the files compile's single-file check and the embedding reader name as a LoRA, with the fix."""
    return any("lora_" in str(k) or ".lora." in str(k) for k in keys)


def parse_lora_arg(text: str) -> tuple[str, float]:
    """Split a ``FILE[:scale]`` argument into (file, scale); no ``:scale`` means 1.0.

    Only the text after the last ``:`` is a scale, and only when the whole argument does not end in
    ``.safetensors`` (so ``C:/loras/a.safetensors`` is a path).

    Raises:
        LoraError: no file (``''``, ``:0.8``); a scale that is not a finite number (``a.safetensors:strong``,
            ``a.safetensors:``) or beyond float32 (``a.safetensors:1e39``, refused by every backend).
    """
    if text.lower().endswith(LORA_SUFFIX) or ":" not in text:
        path, scale_text, scale = text, "", 1.0
    else:
        path, scale_text, scale = split_scale(text, 1.0, at_last=True)
    if not path.strip():
        raise LoraError(f"--lora {text!r} names no file; pass FILE or FILE:SCALE, e.g. style.safetensors:0.8")
    if not math.isfinite(scale):
        raise LoraError(
            f"--lora {text!r}: {scale_text!r} is not a scale; use FILE or FILE:SCALE with a finite number, "
            f"e.g. {path}:0.8"
        )
    if not _fits_float32(scale):  # compile's merge and run's weights are float32 at most: inf there
        raise LoraError(f"--lora {text!r}: scale {scale:g} is beyond float32 (at most 3.403e+38); use a "
                        f"scale such as {path}:0.8")
    return path, scale


def check_scale(scale: Any) -> float:
    """``scale`` as a finite float.

    Raises:
        LoraError: not a finite number.
    """
    if not is_real_number(scale) or not math.isfinite(scale):
        raise LoraError(f"LoRA scale={scale!r} must be a finite number, e.g. 0.8 (0 = the base model's output)")
    return float(scale)


# Where ``check_lora_file(background=True)`` hashes (made on first use): a switch of ``load_lora`` hashes the file
# (~0.1 s for a 151 MB rank-64 SD-1.5 LoRA at ~1.5 GB/s) while its deltas are computed; hashlib releases the GIL.
@functools.cache
def _hashing() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(4, thread_name_prefix="diffusion-trt-lora-sha256")


def lora_sha256(path: Path) -> str:
    """Hex sha256 of the LoRA file ``path``, computed once per version of the file in a process: kept under its
    ``os.stat`` identity (device, inode, size, mtime and ctime in ns; any write changes the ctime), as A1111 keeps
    its hashes by mtime. A switch back to a LoRA used before then reads no file to hash it (151 MB: ~0.1 s of a
    switch on the H200, issue 26).

    Raises:
        OSError: the file cannot be read.
    """
    st = path.stat()
    return _sha256_of_version(str(path.resolve()), (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                                                     st.st_ctime_ns))


@functools.lru_cache(maxsize=256)
def _sha256_of_version(path: str, version: tuple[int, ...]) -> str:
    from .artifact.folder import sha256_file

    return sha256_file(path)


def check_lora_file(path: str | Path, scale: Any = 1.0, *, background: bool = False) -> LoraFile:
    """Check that ``path`` is a readable safetensors file holding LoRA tensors; hash it (:func:`lora_sha256`; on a
    thread with ``background``: :attr:`LoraFile.sha256` then waits for the digest).

    Raises:
        LoraError: missing, a folder, not ``.safetensors`` (pickled LoRAs run code when loaded), not a valid
            safetensors file, or no tensor with ``lora`` in its name; a bad ``scale``.
    """
    scale = check_scale(scale)
    if not str(path).strip():  # Path("") is ".", a folder: that message would name a path nobody gave
        raise LoraError(f"LoRA path {str(path)!r} is empty; pass the path of a .safetensors LoRA")
    p = Path(path)
    if not p.exists():
        raise LoraError(f"LoRA file {p} does not exist; pass the path of a .safetensors LoRA")
    if not p.is_file():
        raise LoraError(f"LoRA path {p} is a folder; pass the .safetensors file inside it")
    if p.suffix.lower() != LORA_SUFFIX:
        raise LoraError(
            f"LoRA file {p} is not a .safetensors file; LoRAs are read from safetensors only (loading a pickle "
            "file runs arbitrary code): convert it with safetensors.torch.save_file"
        )
    keys = safetensors_keys(p)
    if not any("lora" in k.lower() for k in keys):
        sample = ", ".join(keys[:3]) or "none"
        raise LoraError(
            f"LoRA file {p} holds no LoRA tensors (no key contains 'lora'; keys: {sample}); it is not a LoRA"
        )
    return LoraFile(p, scale, _hashing().submit(lora_sha256, p) if background else lora_sha256(p))


def safetensors_keys(path: Path) -> list[str]:
    """Tensor names of a safetensors file (reads the header only).

    Raises:
        LoraError: not a valid safetensors file; its header's ``lora_adapter_metadata`` (diffusers' adapter config)
            is not a JSON object.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            keys, raw = list(f.keys()), (f.metadata() or {}).get(LORA_METADATA_KEY)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError / OSError / ValueError
        raise LoraError(f"LoRA file {path} is not a valid safetensors file ({type(e).__name__}: {e})") from None
    if raw is not None:
        adapter_metadata(path, raw)
    return keys


def adapter_metadata(path: Path, raw: str) -> dict[str, Any]:
    """The header's ``lora_adapter_metadata`` text of the LoRA file ``path``, parsed (``{"unet.r": 4, ...}``).

    Raises:
        LoraError: not JSON, or JSON other than an object (diffusers would fail on it with a JSONDecodeError or an
            AttributeError).
    """
    try:
        value = json.loads(raw)
    except ValueError as e:
        value = e
    if not isinstance(value, dict):
        raise LoraError(f"LoRA file {path}: its header's {LORA_METADATA_KEY!r} is not a JSON object of adapter "
                        f"settings ({str(value)[:80]}); the file is damaged: drop that header entry or re-save the "
                        "LoRA")
    return value


def error_summary(e: BaseException, lines: int = 2, chars: int = 400) -> str:
    """The first ``lines`` non-empty lines of an error message on one line, at most ``chars`` long (for a LoRA of
    another architecture, peft lists every mismatched tensor or missing module: hundreds of lines or names; diffusers'
    key conversion puts the keys it could not rename after a blank line). The caller logs the whole message at
    DEBUG."""
    text = [line.strip() for line in str(e).splitlines() if line.strip()]
    head = " ".join(text[:lines])
    if len(text) <= lines and len(head) <= chars:
        return head
    return f"{head[:chars]} ... (cut; the whole message is logged at DEBUG: diffusion-trt -v)"


def check_lora_files(specs: Any) -> list[LoraFile]:
    """Check every ``(path, scale)`` of ``CompileConfig.loras`` before any work; refuse a file given twice.

    Raises:
        LoraError: see :func:`check_lora_file`; the same file (by sha256) twice.
    """
    files = [check_lora_file(path, scale) for path, scale in specs]
    refuse_repeats(files, "--lora ")
    return files


def refuse_repeats(files: Sequence[LoraFile], prefix: str = "LoRA ") -> None:
    """Refuse a file given twice in ``files`` (by sha256: a copy under another name too); ``prefix`` starts the
    message (``"--lora "`` for the command line).

    Raises:
        LoraError: naming both paths and the fix.
    """
    seen: dict[str, Path] = {}
    for f in files:
        if f.sha256 in seen:
            raise LoraError(f"{prefix}{f.path} is the same file as {seen[f.sha256]} (sha256 {f.sha256[:12]}); give "
                            "each LoRA once with the sum of the scales")
        seen[f.sha256] = f.path


def _fits_float32(value: float) -> bool:
    """Whether ``value`` is a float32 (``struct``'s "f" packing refuses one beyond its range: inf on the engines'
    side). Standard library, as ``runtime/float_range.py``, which this shared part may not import."""
    try:
        struct.pack("<f", value)
    except OverflowError:
        return False
    return True

"""Frozen configuration objects; each one round-trips through JSON and is saved in manifest.json.

``None`` in a field means "the default", resolved by :meth:`CompileConfig.resolve` against the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import RuntimeInputError

Backend = Literal["ort", "tensorrt"]
Device = Literal["cpu", "cuda"]
Precision = Literal["fp32", "fp16"]

BACKENDS: tuple[str, ...] = ("ort", "tensorrt")
DEVICES: tuple[str, ...] = ("cpu", "cuda")
PRECISIONS: tuple[str, ...] = ("fp32", "fp16")

#: Image sizes must be multiples of this: the SD VAE downsamples by 2**3 (three stride-2 stages).
IMAGE_ALIGNMENT = 8


def nearest_multiples(value: int, multiple: int) -> tuple[int, int]:
    """Return the multiples of ``multiple`` just below and just above ``value`` (below >= multiple)."""
    below = max(multiple, value // multiple * multiple)
    above = below + multiple if below <= value else below
    return below, above


def check_image_size(name: str, value: int, lo: int | None = None, hi: int | None = None) -> None:
    """Raise :class:`RuntimeInputError` unless ``value`` is a multiple of 8 inside ``[lo, hi]``.

    Args:
        name: "height" or "width", used in the message.
        value: size in pixels.
        lo, hi: the engine profile's range in pixels, when known.
    """
    rng = f" (engine profile allows {lo}..{hi})" if lo is not None and hi is not None else ""
    if value % IMAGE_ALIGNMENT != 0 or value <= 0:
        below, above = nearest_multiples(max(value, 1), IMAGE_ALIGNMENT)
        raise RuntimeInputError(
            f"{name}={value} is not a positive multiple of {IMAGE_ALIGNMENT}; use {below} or {above}{rng}"
        )
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise RuntimeInputError(
            f"{name}={value} is outside the engine profile {lo}..{hi}; "
            f"use a size in that range or recompile with --min-{name}/--max-{name}"
        )


@dataclass(frozen=True)
class Range:
    """A min/opt/max triple, the shape of one dimension in an optimization profile."""

    min: int
    opt: int
    max: int

    def __post_init__(self) -> None:
        if not 0 < self.min <= self.opt <= self.max:
            raise RuntimeInputError(
                f"range min={self.min} opt={self.opt} max={self.max} must satisfy 0 < min <= opt <= max"
            )

    def __contains__(self, value: object) -> bool:
        return isinstance(value, int) and self.min <= value <= self.max

    def to_list(self) -> list[int]:
        return [self.min, self.opt, self.max]

    @classmethod
    def from_list(cls, values: list[int]) -> Range:
        return cls(*values)


@dataclass(frozen=True)
class ShapeProfile:
    """The image-level shape range every engine of an artifact is built for.

    Attributes:
        batch: images per prompt call (the UNet sees ``2 * batch`` with classifier-free guidance).
        height, width: image size in pixels; latents are ``size // 8``.
    """

    batch: Range
    height: Range
    width: Range

    def __post_init__(self) -> None:
        for name in ("height", "width"):
            r: Range = getattr(self, name)
            for v in r.to_list():
                check_image_size(f"{name} profile value", v)

    def to_json(self) -> dict[str, list[int]]:
        return {"batch": self.batch.to_list(), "height": self.height.to_list(), "width": self.width.to_list()}

    @classmethod
    def from_json(cls, data: dict[str, list[int]]) -> ShapeProfile:
        return cls(**{k: Range.from_list(v) for k, v in data.items()})

    def is_static(self) -> bool:
        return all(r.min == r.max for r in (self.batch, self.height, self.width))


@dataclass(frozen=True)
class CompileConfig:
    """What ``diffusion-trt compile`` was asked to do.

    Attributes:
        backend: "ort" (ONNX Runtime) or "tensorrt".
        device: "cpu" or "cuda": where the engines will run (and where export runs).
        precision: "fp32" or "fp16" weights and activations. fp16 requires ``device="cuda"`` for ORT.
        opset: ONNX opset of the exported graphs (>= 17: LayerNormalization).
        height, width, batch_size: the optimal ("opt") shape; ``None`` = the model's default size
            (``unet.config.sample_size * 8``) and batch 1.
        min_*/max_*: profile bounds; ``None`` = half / double the opt size, batch 1..max(4, opt).
        components: which components to export, in order.
        trust_pickle: allow ``.bin``/``.ckpt`` weights (unpickling runs arbitrary code).
        dump_passes: folder to write the graph after each pass, or ``None``.
        timing_cache: TensorRT only: folder of timing caches shared by builds (one file per TensorRT version
            and compute capability); ``None`` = none.
    """

    backend: str = "ort"
    device: str = "cpu"
    precision: str = "fp32"
    opset: int = 17
    height: int | None = None
    width: int | None = None
    batch_size: int = 1
    min_height: int | None = None
    max_height: int | None = None
    min_width: int | None = None
    max_width: int | None = None
    min_batch_size: int = 1
    max_batch_size: int | None = None
    components: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder", "vae_encoder")
    trust_pickle: bool = False
    dump_passes: str | None = None
    timing_cache: str | None = "~/.cache/diffusion-trt/timing-cache"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, allowed in (("backend", BACKENDS), ("device", DEVICES), ("precision", PRECISIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise RuntimeInputError(f"{name}={value!r} is not supported; use one of {', '.join(allowed)}")
        if self.opset < 17:
            raise RuntimeInputError(f"opset={self.opset} is too old; use 17 or newer (LayerNormalization)")
        if self.precision == "fp16" and self.device == "cpu":
            raise RuntimeInputError(
                "precision='fp16' with device='cpu' is not supported: ONNX Runtime's CPU provider has "
                "no fp16 kernels for most UNet ops; use --precision fp32 or --device cuda"
            )
        if self.backend == "tensorrt" and self.device != "cuda":
            raise RuntimeInputError(f"backend='tensorrt' runs on CUDA only, not device={self.device!r}; "
                                    "use --device cuda or --backend ort")
        if self.batch_size < 1:
            raise RuntimeInputError(f"batch_size={self.batch_size} must be >= 1")

    def resolve_profile(self, default_size: int) -> ShapeProfile:
        """Fill the ``None`` bounds from the model's default image size (pixels)."""

        def rng(opt: int | None, lo: int | None, hi: int | None, name: str) -> Range:
            opt = opt or default_size
            check_image_size(name, opt)
            lo = lo if lo is not None else max(IMAGE_ALIGNMENT, opt // 2 // IMAGE_ALIGNMENT * IMAGE_ALIGNMENT)
            hi = hi if hi is not None else opt * 2
            check_image_size(f"min-{name}", lo)
            check_image_size(f"max-{name}", hi)
            if not lo <= opt <= hi:
                raise RuntimeInputError(
                    f"{name}={opt} is outside --min-{name} {lo} .. --max-{name} {hi}; widen the range"
                )
            return Range(lo, opt, hi)

        max_batch = self.max_batch_size if self.max_batch_size is not None else max(4, self.batch_size)
        if not self.min_batch_size <= self.batch_size <= max_batch:
            raise RuntimeInputError(
                f"batch_size={self.batch_size} is outside --min-batch-size {self.min_batch_size} .. "
                f"--max-batch-size {max_batch}; widen the range"
            )
        return ShapeProfile(
            batch=Range(self.min_batch_size, self.batch_size, max_batch),
            height=rng(self.height, self.min_height, self.max_height, "height"),
            width=rng(self.width, self.min_width, self.max_width, "width"),
        )

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["components"] = list(self.components)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompileConfig:
        data = dict(data)
        data["components"] = tuple(data.get("components", cls.components))
        return cls(**data)

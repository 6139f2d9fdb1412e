"""Frozen configuration objects; each one round-trips through JSON and is saved in manifest.json.

``None`` in a field means "the default", resolved by :meth:`CompileConfig.resolve` against the model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .artifact.manifest import Backend  # the one backend type (manifest, CompileConfig); importable from here too
from .errors import RuntimeInputError, names_arguments

Device = Literal["cpu", "cuda"]
Precision = Literal["fp32", "fp16", "int8", "fp8"]

#: ``--backend`` values, in the order messages list them (``Backend.is_tensorrt``: the two that build TensorRT plans;
#: trt_compat.LIBRARIES says how they differ).
BACKENDS: tuple[str, ...] = tuple(b.value for b in Backend)
DEVICES: tuple[str, ...] = ("cpu", "cuda")
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8", "fp8")
#: Precisions made by calibration + QDQ insertion (compiler/calibrate.py, compiler/quantize/).
QUANTIZED_PRECISIONS: tuple[str, ...] = ("int8", "fp8")

#: Image sizes must be multiples of this: the SD VAE downsamples by 2**3 (three stride-2 stages).
IMAGE_ALIGNMENT = 8
#: Largest image side a compile profile may hold (pixels): SD 1.x/2.x/SDXL are trained at 512..1024, and far larger
#: sizes export for minutes before the engines fail to fit in memory.
MAX_IMAGE_SIZE = 4096
#: Largest batch (images per engine call) a compile profile may hold; ``run`` splits larger requests into chunks.
MAX_BATCH_SIZE = 64
#: The most 77-token prompt chunks a UNet may be compiled for (``--max-prompt-chunks``): 8 x 75 = 600 tokens.
MAX_PROMPT_CHUNKS = 8
#: The most text-encoder layers ``--max-clip-skip`` may skip (SD's CLIP has 12 / 23 layers).
MAX_CLIP_SKIP = 11
#: The most textual-inversion rows a text encoder takes (``CompileConfig.max_embedding_vectors``).
MAX_EMBEDDING_VECTORS = 1024
#: Opsets compile exports: 17 (LayerNormalization) up to the newest that torch.onnx's TorchScript exporter
#: (``dynamo=False``, compiler/export.py) writes.
MIN_OPSET, MAX_OPSET = 17, 20


def is_real_number(value: Any) -> bool:
    """Whether ``value`` is a real number a caller may pass as a scale: an int, a float or a NumPy scalar of either
    (``numbers.Real``; ``np.float32`` is no ``float``), not a bool (``True`` is an int to Python, never a scale;
    ``np.bool_`` is no ``numbers.Real``)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def split_scale(text: str, default: float, *, at_last: bool = False, empty_is_default: bool = False
                ) -> tuple[str, str, float]:
    """Split a ``NAME:SCALE`` argument (``--controlnet``/``--lora`` of run and compile, serve's ``controlnet`` and
    ``lora`` inputs) into ``(name, scale_text, scale)``; each caller checks the range and words its own message.

    Args:
        text: ``NAME`` or ``NAME:SCALE``.
        default: the scale without ``:``.
        at_last: split at the last ``:`` (a FILE may hold one, ``C:/loras/a``); else at the first.
        empty_is_default: ``NAME:`` gets ``default`` (else NaN, as any scale that is not a number).

    Returns:
        the name ("" for ``:0.5``), the text after the ``:`` ("" without one) and the scale as a float: ``default``
        without ``:``, NaN where the text is not a number, ``1_0`` included (so one finiteness check refuses both);
        never raises.
    """
    name, sep, scale_text = text.rpartition(":") if at_last else text.partition(":")
    if not sep:
        return text, "", default
    if not scale_text and empty_is_default:
        return name, scale_text, default
    if "_" in scale_text:  # float() reads 1_0 as 10 (Python's digit grouping): not a number as typed
        return name, scale_text, math.nan
    try:
        return name, scale_text, float(scale_text)
    except ValueError:
        return name, scale_text, math.nan


def nearest_multiples(value: int, multiple: int) -> tuple[int, int]:
    """Return the multiples of ``multiple`` just below and just above ``value`` (below >= multiple)."""
    below = max(multiple, value // multiple * multiple)
    above = below + multiple if below <= value else below
    return below, above


def _min_above_max(name: str, lo: int, hi: int, lo_given: bool, hi_given: bool, lo_default: str,
                   hi_default: str) -> str:
    """The message of a profile whose min bound is above its max: "swap them" only when both were given; else which
    bound was the default and what to give instead. ``name``: "height", "width" or "batch_size"."""
    if lo_given and hi_given:
        return f"min_{name}={lo} is larger than max_{name}={hi}; swap them"
    if lo_given:
        return (f"min_{name}={lo} is larger than the default max_{name}={hi} ({hi_default}); give max_{name}={lo} "
                f"or more, or min_{name}={hi} or less")
    return (f"max_{name}={hi} is smaller than the default min_{name}={lo} ({lo_default}); give min_{name}={hi} "
            f"or less, or max_{name}={lo} or more")


def check_image_size(name: str, value: int, lo: int | None = None, hi: int | None = None, *,
                     multiple: int = IMAGE_ALIGNMENT) -> None:
    """Raise :class:`RuntimeInputError` unless ``value`` is a multiple of ``multiple`` inside ``[lo, hi]``.

    The runtime checks a request's size through
    :meth:`~diffusion_trt.runtime.request.LatentGeometry.check_size` (``multiple`` = the artifact's
    ``vae_scale_factor``); this checks compile profiles too.

    Args:
        name: "height" or "width", used in the message.
        value: size in pixels.
        lo, hi: the engine profile's range in pixels, when known.
        multiple: the VAE's downsampling factor (8 for SD).
    """
    rng = f" (engine profile allows {lo}..{hi})" if lo is not None and hi is not None else ""
    if value <= 0:
        raise RuntimeInputError(
            f"{name}={value} must be a positive multiple of {multiple}; use e.g. {lo if lo else 512}{rng}"
        )
    if value % multiple != 0:
        below, above = nearest_multiples(max(value, 1), multiple)
        if lo is not None and hi is not None:  # 300 in a 32..128 profile: "use 296 or 304" named two more refusals
            below, above = min(max(below, lo), hi), min(max(above, lo), hi)
        use = f"{below} or {above}" if below != above else str(below)
        raise RuntimeInputError(f"{name}={value} is not a positive multiple of {multiple}; use {use}{rng}")
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise RuntimeInputError(
            f"{name}={value} is outside the engine profile {lo}..{hi}; "
            f"use a size in that range or recompile with --min-{name}/--max-{name}"
        )


def snap_image_size(value: int, lo: int | None = None, hi: int | None = None) -> int:
    """The valid image size nearest ``value`` (pixels): what ``--snap`` uses instead of rejecting it.

    Valid = a positive multiple of :data:`IMAGE_ALIGNMENT` inside ``[lo, hi]`` when given (``lo``/``hi`` are
    themselves multiples, as every profile's are). A tie (700 -> 696 or 704) rounds down, as diffusers'
    ``VaeImageProcessor`` does. This and :func:`check_image_size` are the image-size alignment policy; the
    channel alignment of the graphs is ``passes/align_shapes.py``.
    """
    below, above = nearest_multiples(max(value, 1), IMAGE_ALIGNMENT)
    snapped = value if value % IMAGE_ALIGNMENT == 0 and value > 0 else (
        below if value - below <= above - value else above)
    if lo is not None:
        snapped = max(snapped, lo)
    if hi is not None:
        snapped = min(snapped, hi)
    return snapped


def _field_names(config: Any) -> tuple[str, ...]:
    """The field names of the dataclass ``config``: what its messages name (:func:`~.errors.names_arguments`)."""
    return tuple(f.name for f in dataclasses.fields(config))


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
class QuantizeConfig:
    """How ``--precision int8|fp8`` calibrates and quantizes (see compiler/calibrate.py, compiler/quantize/).

    Attributes:
        components: the components quantized; the others stay fp32 (CPU) / fp16 (CUDA). "unet" and/or
            "vae_decoder".
        prompts: "builtin" (the bundled 64 prompts) or a text file, one prompt a line.
        size: calibration prompts N (one image each, CFG batch 2).
        steps: UNet inputs captured per prompt K, spread over the schedule.
        seed: latents of prompt i come from seed + i.
        method: ONNX Runtime calibrator: "minmax", "entropy" or "percentile" (fp8 always uses "distribution").
        exclude: nodes left unquantized: categories and/or node names; ``None`` = the documented default
            (compiler/quantize/exclusions.py: first/last conv, time embedding, attention scores, softmax,
            normalization).
        smooth_quant_alpha: SmoothQuant strength in [0, 1]; ``None`` = off (needs neural-compressor).
        cache: a calibration cache to reuse (a ``<component>.json`` file, or a folder / artifact holding one);
            a folder without one receives the new cache. ``None`` = none (the artifact always stores its own).
        held_out: held-out prompts the quality gate generates (1..4).
        min_cosine, min_psnr: quality-gate thresholds (worst step cosine; worst final-image PSNR, dB).
        accept_quality_loss: write the artifact even when the gate fails (the figures stay in the manifest).
        target_compute_capability: fp8: the GPU the plan is for, e.g. "9.0"; ``None`` = this machine's GPU.
    """

    components: tuple[str, ...] = ("unet",)
    prompts: str = "builtin"
    size: int = 32
    steps: int = 8
    seed: int = 0
    method: str = "minmax"
    exclude: tuple[str, ...] | None = None
    smooth_quant_alpha: float | None = None
    cache: str | None = None
    held_out: int = 2
    min_cosine: float = 0.98
    min_psnr: float = 20.0
    accept_quality_loss: bool = False
    target_compute_capability: str | None = None

    def __post_init__(self) -> None:
        bad = [c for c in self.components if c not in ("unet", "vae_decoder")]
        if bad or not self.components:
            raise RuntimeInputError(f"quantize components {list(self.components)}: choose from unet, vae_decoder")
        if self.size < 1 or self.steps < 1:
            raise RuntimeInputError(
                f"--calibration-size {self.size} and --calibration-steps {self.steps} must both be >= 1"
            )
        if not 1 <= self.held_out <= 4:
            raise RuntimeInputError(f"held_out={self.held_out} must be in 1..4 (the bundled held-out prompts)")
        if self.method not in ("minmax", "entropy", "percentile"):
            raise RuntimeInputError(f"--calibration-method {self.method!r}: use minmax, entropy or percentile")

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["components"] = list(self.components)
        data["exclude"] = None if self.exclude is None else list(self.exclude)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> QuantizeConfig:
        data = dict(data)
        data["components"] = tuple(data.get("components", cls.components))
        if data.get("exclude") is not None:
            data["exclude"] = tuple(data["exclude"])
        return cls(**data)


_SIZE_FIELDS = ("height", "width", "min_height", "max_height", "min_width", "max_width")
_BATCH_FIELDS = ("batch_size", "min_batch_size", "max_batch_size")


@dataclass(frozen=True)
class CompileConfig:
    """What ``diffusion-trt compile`` was asked to do.

    Attributes:
        backend: a :class:`~diffusion_trt.artifact.manifest.Backend`: ``ORT`` (ONNX Runtime), ``TENSORRT`` (full
            TensorRT, built on the GPU it runs on) or ``TENSORRT_RTX`` (TensorRT for RTX: built on any machine, GPU or
            not, for :attr:`compute_capabilities`). The strings "ort", "tensorrt" and "tensorrt-rtx" are accepted
            and parsed into it once, here (another value: ``RuntimeInputError``); ``to_json`` writes the string.
        device: "cpu" or "cuda": where the engines will run (and where export runs when it has a GPU).
        precision: "fp32" or "fp16" weights and activations. fp16 requires ``device="cuda"`` for ORT.
        opset: ONNX opset of the exported graphs, :data:`MIN_OPSET`..:data:`MAX_OPSET` (17: LayerNormalization).
        height, width, batch_size: the optimal ("opt") shape; ``None`` = the model's default size
            (``unet.config.sample_size * 8``) and batch 1.
        min_*/max_*: profile bounds; ``None`` = half / double the opt size (at most :data:`MAX_IMAGE_SIZE`),
            batch 1..max(4, opt). Sizes above :data:`MAX_IMAGE_SIZE` and batches above :data:`MAX_BATCH_SIZE` are
            refused.
        components: which components to export, in order (an SDXL model adds ``text_encoder_2`` after
            ``text_encoder``: its prompt encoding needs both).
        fp16_safe_vae: SDXL with ``precision="fp16"``: build the VAE in fp16 too. By default an SDXL VAE stays fp32
            (it overflows in fp16) unless its vae/config.json says ``force_upcast: false``; set this for an fp16-safe
            VAE whose config does not say so. No effect on SD 1.x/2.x models (their VAEs run fp16).
        trust_pickle: allow ``.bin``/``.ckpt`` weights (unpickling runs arbitrary code).
        dump_passes: folder to write the graph after each pass, or ``None``.
        timing_cache: TensorRT only: folder of timing caches shared by builds (one file per TensorRT version
            and compute capability); ``None`` = none.
        quantize: calibration and QDQ settings, used when ``precision`` is "int8" or "fp8" (int8: ORT CPU or
            TensorRT; fp8: TensorRT on compute capability >= 8.9).
        loras: LoRAs merged into the weights before export, in order: ``(safetensors path, scale)`` pairs (see
            :mod:`diffusion_trt.lora`); the manifest records each file's name, sha256 and scale.
        refittable: LoRAs swappable at run time (``EnginePipeline.load_lora``, ``run --lora``): a refit map per UNet
            and text encoder, and TensorRT: refittable engines (``BuilderFlag.REFIT``); ONNX Runtime: the
            LoRA-targetable weights as graph inputs bound per run (:mod:`diffusion_trt.compiler.lora_slots`): Linear
            and 1x1 Conv weights, so the UNet keeps its NHWC Conv kernels on CUDA.
        refit_convs: ONNX Runtime with ``refittable`` only: the spatial (3x3, strided...) Conv weights become graph
            inputs too, for LoCon / LyCORIS LoRAs on ResNet convs; those engines run NCHW on CUDA (slower: ORT's NHWC
            Convs need constant weights, :mod:`diffusion_trt.compiler.lora_slots`). Saved in the manifest only when
            set.
        compute_capabilities: TensorRT-RTX only: the GPUs the plans are built for, e.g. ``("8.6", "8.9", "12.0")``, or
            ``("current",)`` for this machine's GPU; ``None`` = TensorRT-RTX's portable set (8.0, 8.6, 8.9, 12.0;
            ``trt_compat.LIBRARIES``). fp8 needs every target >= 8.9.
        deterministic: ORT CUDA only: leave GroupNorm unfused (``fuse_group_norm_deterministic``): ORT's GroupNorm
            and SkipGroupNorm kernels add partial sums with atomicAdd, so two identical calls differ by up to
            ~1/255 (H200, ``benchmarks/results/h200-2026-12-01-s4-determinism.json``); the runtime's
            ``deterministic=True`` switches the rest (the tiny pipeline's identical calls then differ by 0 on an
            H200, ``h200-2026-12-01-s6-tiny-deterministic.json``). Costs speed: 0.068 vs 0.044 ms per norm at the
            SD-1.5 UNet's largest shape (``h200-2026-12-01-s6-norm-probe.json``); end to end 0.486 vs 0.378 s an
            image (H100, SD-1.5 512x512, 50 steps, ``h100-2026-12-07-s26-bench-*.json``). Other targets: no effect
            (logged).
        max_prompt_chunks: the UNet's ``encoder_hidden_states`` takes 77 * k tokens for k = 1..this
            (1..:data:`MAX_PROMPT_CHUNKS`): long prompts in 75-token chunks (``runtime/prompt_encoding.py``). 1 = the
            UNet takes 77 tokens only (the artifact of before). With k > 1 the sequence axis is the profile dim ``S``
            (min = opt = 77, max = 77 k): TensorRT tunes its kernels at 77 and ``--size-buckets`` gives each
            (size, k) its own static CUDA-graph session, so one-chunk prompts run as before. A static profile keeps
            77 (logged): it is one fixed shape (one CUDA graph). SDXL chunks both text encoders alike
            (``runtime/sdxl.py``).
        max_clip_skip: the text encoder also gives the states that ``clip_skip`` = 1..this take (one
            extra output of the one engine, ``clip_skip_states``; at most its layers less one); 0 = none (the
            text encoder of before). SDXL: both text encoders, at most the smaller one's layers less one.
        max_embedding_vectors: rows of the text encoder's ``embedding_vectors`` input, the most
            textual-inversion vectors one pipeline loads at once (``run --embedding``; EasyNegative has 8,
            ng_deepnegative_v1_75t 75); 0 = no such input (the text encoder of before, which refuses embeddings).
            Costs nothing per run but a [N, D] input. SDXL: both text encoders (the clip_l / clip_g vectors).
        controlnets: ``(name, folder)`` pairs: each diffusers ControlNetModel folder becomes the components
            ``cond_embed_<name>`` (its control-image embedding) and ``controlnet_<name>``, and the UNet is compiled
            a second time with the residual inputs as ``unet_controlnet`` (see
            :mod:`diffusion_trt.compiler.controlnet`). Saved in the manifest only when given (an artifact without
            ControlNets is as before).
        pass_options: ``PassContext.options`` for every component, over the ones compile derives itself (each
            pass's docstring lists the options it reads, e.g. ``{"pack_qkv": True}``,
            ``{"fuse_attention_emit": "none"}``); for experiments and A/B timings (``--pass-option``).
    """

    backend: Backend = Backend.ORT
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
    fp16_safe_vae: bool = False
    trust_pickle: bool = False
    dump_passes: str | None = None
    timing_cache: str | None = "~/.cache/diffusion-trt/timing-cache"
    pass_options: dict[str, Any] = field(default_factory=dict)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    loras: tuple[tuple[str, float], ...] = ()
    refittable: bool = False
    refit_convs: bool = False
    compute_capabilities: tuple[str, ...] | None = None
    deterministic: bool = False
    max_prompt_chunks: int = 3
    max_clip_skip: int = 2
    max_embedding_vectors: int = 128
    controlnets: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        with names_arguments(*_field_names(self)):  # the CLI names these by its options
            self._check()

    def _check(self) -> None:
        with contextlib.suppress(ValueError):  # a value that is no Backend is refused below, where it always was
            object.__setattr__(self, "backend", Backend(self.backend))
        self._check_types()
        if not 1 <= self.max_prompt_chunks <= MAX_PROMPT_CHUNKS:
            raise RuntimeInputError(f"max_prompt_chunks={self.max_prompt_chunks} must be in 1..{MAX_PROMPT_CHUNKS} "
                                    "(chunks of 75 prompt tokens); use e.g. 3")
        if not 0 <= self.max_clip_skip <= MAX_CLIP_SKIP:
            raise RuntimeInputError(f"max_clip_skip={self.max_clip_skip} must be in 0..{MAX_CLIP_SKIP} (layers skipped "
                                    "from the end of the text encoder); use e.g. 2")
        if not 0 <= self.max_embedding_vectors <= MAX_EMBEDDING_VECTORS:
            raise RuntimeInputError(f"max_embedding_vectors={self.max_embedding_vectors} must be in "
                                    f"0..{MAX_EMBEDDING_VECTORS} (textual-inversion rows); use e.g. 128")
        if self.compute_capabilities is not None:
            object.__setattr__(self, "compute_capabilities", tuple(str(c) for c in self.compute_capabilities))
        if self.refittable and self.backend is Backend.TENSORRT_RTX:
            from .trt_compat import rtx_refit_refusal

            raise RuntimeInputError(rtx_refit_refusal("backend"))
        if self.refit_convs and not self.refittable:
            raise RuntimeInputError(
                "refit_convs=True needs refittable=True: it makes the spatial Conv weights of a refittable ONNX "
                "Runtime artifact graph inputs too; add refittable=True"
            )
        if self.refit_convs and self.backend is not Backend.ORT:
            raise RuntimeInputError(
                f"refit_convs=True is for backend='ort' only, not backend={self.backend!r}: a refittable TensorRT "
                "artifact refits every weight already; drop refit_convs=True"
            )
        if self.refittable and self.loras:
            raise RuntimeInputError(
                "refittable=True with LoRAs merged at compile time: a refittable artifact keeps the base "
                "weights (load_lora refits from them every time); merge none and load them per run "
                "(EnginePipeline.load_lora, run --lora), or drop refittable=True"
            )
        if self.refittable and self.precision in QUANTIZED_PRECISIONS:
            raise RuntimeInputError(
                f"refittable=True with precision={self.precision!r}: refitting quantized (QDQ) weights is not "
                "supported; use precision='fp16', or merge the LoRA at compile time instead of refittable=True"
            )
        if not isinstance(self.backend, Backend):
            raise RuntimeInputError(f"backend={self.backend!r} is not supported; use one of {', '.join(BACKENDS)}")
        for name, allowed in (("device", DEVICES), ("precision", PRECISIONS)):
            value = getattr(self, name)
            if value not in allowed:
                raise RuntimeInputError(f"{name}={value!r} is not supported; use one of {', '.join(allowed)}")
        if self.opset < MIN_OPSET:
            raise RuntimeInputError(f"opset={self.opset} is too old; use {MIN_OPSET} or newer (LayerNormalization)")
        if self.opset > MAX_OPSET:
            raise RuntimeInputError(f"opset={self.opset} is newer than torch.onnx's exporter writes; use "
                                    f"{MIN_OPSET}..{MAX_OPSET}")
        for name, limit, unit in (*((n, MAX_IMAGE_SIZE, " px") for n in _SIZE_FIELDS),
                                  *((n, MAX_BATCH_SIZE, "") for n in _BATCH_FIELDS)):
            value = getattr(self, name)
            if value is not None and value > limit:
                raise RuntimeInputError(f"{name}={value} is above the limit of {limit}{unit}; use {limit} or less")
        if self.precision == "fp16" and self.device == "cpu":
            raise RuntimeInputError(
                "precision='fp16' with device='cpu' is not supported: ONNX Runtime's CPU provider has "
                "no fp16 kernels for most UNet ops; use precision='fp32' or device='cuda'"
            )
        if self.backend.is_tensorrt and self.device != "cuda":
            raise RuntimeInputError(f"backend={self.backend!r} runs on CUDA only, not device={self.device!r}; "
                                    "use device='cuda' or backend='ort'")
        self._check_rtx()
        for name in ("batch_size", "min_batch_size", "max_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise RuntimeInputError(f"{name}={value} must be >= 1")
        if self.precision == "int8" and self.backend is Backend.ORT and self.device != "cpu":
            raise RuntimeInputError("precision='int8' with backend='ort' runs on the CPU provider only; use "
                                    "device='cpu', or backend='tensorrt' for int8 on CUDA")
        if self.precision == "fp8" and not self.backend.is_tensorrt:
            raise RuntimeInputError("precision='fp8' is for TensorRT only (ONNX Runtime has no fp8 kernels for these "
                                    "ops); use backend='tensorrt-rtx' (or backend='tensorrt') with device='cuda', or "
                                    "precision='int8'")

    def _check_rtx(self) -> None:
        """TensorRT-RTX rules: compute-capability targets it has, no int8 QDQ, fp8 only for targets >= 8.9."""
        from .trt_compat import resolve_rtx_targets

        if self.compute_capabilities is not None and self.backend is not Backend.TENSORRT_RTX:
            raise RuntimeInputError(
                f"compute_capabilities={list(self.compute_capabilities)} are TensorRT-RTX build targets, but "
                f"backend={self.backend!r} builds for the GPU it runs on; use backend='tensorrt-rtx', or "
                "compute_capabilities=None"
            )
        if self.backend is not Backend.TENSORRT_RTX:
            return
        if self.precision == "int8":
            raise RuntimeInputError(
                "precision='int8' with backend='tensorrt-rtx': TensorRT-RTX has int8 only as weight-only GEMM "
                "quantization, not the int8 QDQ activations this compile makes; use precision='fp8' (targets >= 8.9) "
                "or precision='fp16', or backend='ort' with device='cpu' for int8"
            )
        targets = resolve_rtx_targets(self.compute_capabilities, current=None)
        if self.precision == "fp8":
            old = [t for t in targets if t != "current" and tuple(map(int, t.split("."))) < (8, 9)]
            if old:
                raise RuntimeInputError(
                    f"precision='fp8' needs every target GPU to be compute capability >= 8.9 (Ada Lovelace or "
                    f"Blackwell), but the targets include {', '.join(old)}; pass compute_capabilities=('8.9', '12.0') "
                    "(or precision='fp16' for 8.0/8.6 GPUs)"
                )

    def resolve_profile(self, default_size: int) -> ShapeProfile:
        """Fill the ``None`` bounds from the model's default image size (pixels)."""
        with names_arguments(*_field_names(self)):
            return self._resolve_profile(default_size)

    def _resolve_profile(self, default_size: int) -> ShapeProfile:
        def rng(opt: int | None, lo: int | None, hi: int | None, name: str) -> Range:
            opt = default_size if opt is None else opt  # 0 is a value to refuse, not "the default"
            lo_given, hi_given = lo is not None, hi is not None
            check_image_size(name, opt)
            lo = lo if lo is not None else max(IMAGE_ALIGNMENT, opt // 2 // IMAGE_ALIGNMENT * IMAGE_ALIGNMENT)
            hi = hi if hi is not None else min(opt * 2, max(opt, MAX_IMAGE_SIZE))
            check_image_size(f"min_{name}", lo)
            check_image_size(f"max_{name}", hi)
            if lo > hi:
                raise RuntimeInputError(_min_above_max(name, lo, hi, lo_given, hi_given, f"{name}/2", f"2 x {name}"))
            if not lo <= opt <= hi:
                raise RuntimeInputError(
                    f"{name}={opt} is outside min_{name}={lo} .. max_{name}={hi}; widen the range"
                )
            return Range(lo, opt, hi)

        max_batch = self.max_batch_size if self.max_batch_size is not None else max(4, self.batch_size)
        if self.min_batch_size > max_batch:
            raise RuntimeInputError(_min_above_max("batch_size", self.min_batch_size, max_batch, True,
                                                   self.max_batch_size is not None, "", "max(4, batch_size)"))
        if not self.min_batch_size <= self.batch_size <= max_batch:
            raise RuntimeInputError(
                f"batch_size={self.batch_size} is outside min_batch_size={self.min_batch_size} .. "
                f"max_batch_size={max_batch}; widen the range"
            )
        return ShapeProfile(
            batch=Range(self.min_batch_size, self.batch_size, max_batch),
            height=rng(self.height, self.min_height, self.max_height, "height"),
            width=rng(self.width, self.min_width, self.max_width, "width"),
        )

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["backend"] = self.backend.value  # the plain string: manifest.json reads as before the enum
        data["components"] = list(self.components)
        data["quantize"] = self.quantize.to_json()
        data["loras"] = [[str(p), float(s)] for p, s in self.loras]
        data["compute_capabilities"] = list(self.compute_capabilities) if self.compute_capabilities else None
        if self.controlnets:
            data["controlnets"] = [[str(n), str(p)] for n, p in self.controlnets]
        else:
            del data["controlnets"]  # an artifact without ControlNets keeps today's manifest
        if not self.refit_convs:
            del data["refit_convs"]  # likewise (and the compile cache keys of every other config)
        return data

    def _check_types(self) -> None:
        """Refuse values of the wrong type before the range checks (``height="64"`` failed there with a TypeError;
        ``components="unet"`` was read as the components u, n, e, t; ``deterministic="no"`` as true).

        Raises:
            RuntimeInputError: naming the field, the value and the type it takes.
        """
        for name in ("opset", "min_batch_size", "batch_size", *_SIZE_FIELDS, "max_batch_size", "max_prompt_chunks",
                     "max_clip_skip", "max_embedding_vectors"):
            value = getattr(self, name)
            if (value is not None or name in ("opset", "batch_size", "min_batch_size", "max_prompt_chunks",
                                                   "max_clip_skip", "max_embedding_vectors")) and \
                    (isinstance(value, bool) or not isinstance(value, int)):
                raise RuntimeInputError(f"{name}={value!r} must be an integer")
        for name in ("components", "compute_capabilities"):
            value = getattr(self, name)
            if isinstance(value, str):
                raise RuntimeInputError(f"{name}={value!r} must be a tuple of strings, e.g. ({value!r},)")
        for name in ("fp16_safe_vae", "trust_pickle", "refittable", "refit_convs", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise RuntimeInputError(f"{name}={getattr(self, name)!r} must be True or False")
        if not isinstance(self.pass_options, Mapping):
            raise RuntimeInputError(f"pass_options={self.pass_options!r} must be a dict, e.g. {{'pack_qkv': True}}")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CompileConfig:
        data = dict(data)
        data["components"] = tuple(data.get("components", cls.components))
        if isinstance(data.get("quantize"), dict):
            data["quantize"] = QuantizeConfig.from_json(data["quantize"])
        data["loras"] = tuple((str(p), float(s)) for p, s in data.get("loras", ()))
        data["controlnets"] = tuple((str(n), str(p)) for n, p in data.get("controlnets", ()))
        return cls(**data)

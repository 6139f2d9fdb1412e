"""Image-to-image and inpainting inputs: checks, preprocessing, strength, VAE encoding and the initial latents.

Step for step as diffusers 0.42 (same seed, scheduler and steps -> same images):

* image-to-image: ``StableDiffusionImg2ImgPipeline`` (``diffusers/pipelines/stable_diffusion/
  pipeline_stable_diffusion_img2img.py``): ``get_timesteps`` (strength -> first step), ``prepare_latents``
  (VAE-encode, *sample* the latent distribution with the generator, times ``vae.config.scaling_factor``, then
  ``scheduler.add_noise`` at the first timestep);
* inpainting: ``StableDiffusionInpaintPipeline`` (``pipeline_stable_diffusion_inpaint.py``): ``prepare_latents``
  (pure noise times ``init_noise_sigma`` at strength 1), ``prepare_mask_latents`` (the mask resized to the latent
  size, the masked image ``image * (mask < 0.5)`` VAE-encoded) and, in the loop, either the 9-channel UNet input
  ``cat([latents, mask, masked_image_latents])`` (inpainting checkpoints) or, for a 4-channel UNet, the blend
  ``(1 - mask) * add_noise(image_latents, noise, t_next) + mask * latents`` after every step.

Images and masks are read by diffusers' own ``VaeImageProcessor`` (``diffusers/image_processor.py``), so they are
accepted as diffusers accepts them: a ``PIL.Image``, a float numpy array [H, W, C] / [N, H, W, C] in [0, 1], a
float torch tensor [C, H, W] / [N, C, H, W] in [0, 1] (or [-1, 1]), or a list of them; a mask may also be
single-channel ([H, W], [N, H, W], ...); a PIL mask of any mode is read as its grayscale (:func:`mask_to_grayscale`:
alpha ignored, as diffusers), whether passed as ``mask_image=`` or as a file; image files are read by
:func:`read_image_file` (the CLI's ``--image`` / ``--mask``). Unlike diffusers, nothing is resized: an image whose
size is not a multiple of 8, a mask of another size, or values outside the expected range are refused with the fix.

Shapes: ``n`` images given, ``B`` images generated (prompts x images per prompt; ``B % n == 0``, rows tiled
as diffusers does), ``H``/``W`` pixels, ``h = H / 8``, ``w = W / 8``.
"""

from __future__ import annotations

import logging
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import MAX_IMAGE_SIZE
from ..errors import RuntimeInputError
from .conditioning import PreparedLatents, TextToImage
from .engines.engine import Engine, run_rows
from .latents import Generator

if TYPE_CHECKING:
    from .geometry import LatentGeometry

logger = logging.getLogger(__name__)

#: diffusers' defaults: StableDiffusionImg2ImgPipeline strength=0.8, StableDiffusionInpaintPipeline strength=1.0.
DEFAULT_IMG2IMG_STRENGTH = 0.8
DEFAULT_INPAINT_STRENGTH = 1.0


def _kind(x: Any) -> str:
    from PIL import Image

    if isinstance(x, Image.Image):
        return "pil"
    if isinstance(x, np.ndarray):
        return "np"
    if isinstance(x, torch.Tensor):
        return "pt"
    return type(x).__name__


def _item_nhw(x: Any, name: str, mask: bool) -> tuple[int, int, int]:
    """(rows, H, W) of one image-like, read the way diffusers' VaeImageProcessor.preprocess reads it."""
    kind = _kind(x)
    if kind == "pil":
        return 1, x.height, x.width
    if kind not in ("np", "pt"):
        raise RuntimeInputError(
            f"{name} is a {kind}; pass a PIL.Image, a numpy array, a torch tensor or a list of them (as diffusers)"
        )
    shape = tuple(x.shape)
    if not mask:
        _refuse_swapped_channels(name, kind, shape)
    if kind == "np":
        if x.dtype == np.uint8:
            raise RuntimeInputError(
                f"{name} is a uint8 numpy array; diffusers reads numpy images as floats in [0, 1]: pass "
                "np.asarray(img, dtype=np.float32) / 255, or the PIL image"
            )
        # numpy: [H, W, C] or [N, H, W, C]; a mask may also be [H, W] or [N, H, W] (single channel)
        if x.ndim == 4:
            return shape[0], shape[1], shape[2]
        if x.ndim == 3 and not (mask and shape[-1] != 1):
            return 1, shape[0], shape[1]
        if x.ndim == 3:  # a mask [N, H, W]
            return shape[0], shape[1], shape[2]
        if x.ndim == 2 and mask:
            return 1, shape[0], shape[1]
    else:
        if not x.is_floating_point():
            raise RuntimeInputError(
                f"{name} is a {x.dtype} tensor; pass floats in [0, 1] (e.g. tensor.float() / 255), as diffusers"
            )
        # torch: [C, H, W] or [N, C, H, W]; a mask may also be [H, W] or [N, H, W]
        if x.ndim == 4:
            return shape[0], shape[2], shape[3]
        if x.ndim == 3:
            return (shape[0] if mask else 1), shape[1], shape[2]
        if x.ndim == 2 and mask:
            return 1, shape[0], shape[1]
    layout = "[H, W], [N, H, W] or [N, H, W, 1]" if mask and kind == "np" else "[H, W] or [N, 1, H, W]" if mask else (
        "[H, W, 3] or [N, H, W, 3]" if kind == "np" else "[3, H, W] or [N, 3, H, W]")
    raise RuntimeInputError(f"{name} has shape {list(shape)}; a {kind} {'mask' if mask else 'image'} is {layout}")


_CHANNELS = (1, 3, 4)


def _refuse_swapped_channels(name: str, kind: str, shape: tuple[int, ...]) -> None:
    """Refuse an image whose channels sit where diffusers' VaeImageProcessor does not read them: numpy is channels-last
    ([H, W, C], [N, H, W, C]; it transposes to NCHW itself), torch channels-first ([C, H, W], [N, C, H, W]). A numpy
    (3, 512, 512) would otherwise read as a 3x512 image of 512 channels (a confusing size message).

    Raises:
        RuntimeInputError: naming the layout found and the transpose that fixes it.
    """
    if len(shape) not in (3, 4):
        return
    lead = shape[-3]  # C of [C, H, W] / [N, C, H, W]; H of [H, W, C] / [N, H, W, C]
    if kind == "np" and lead in _CHANNELS and shape[-1] not in _CHANNELS:
        axes = "(1, 2, 0)" if len(shape) == 3 else "(0, 2, 3, 1)"
        layout = "[H, W, 3]" if len(shape) == 3 else "[N, H, W, 3]"
        raise RuntimeInputError(
            f"{name} looks channels-first {shape}; numpy images are channels-last {layout} (as diffusers reads them): "
            f"pass np.transpose(image, {axes}), or torch.from_numpy(image) (torch images are channels-first)"
        )
    if kind == "pt" and shape[-1] in _CHANNELS and lead not in _CHANNELS:
        axes = "(2, 0, 1)" if len(shape) == 3 else "(0, 3, 1, 2)"
        layout = "[3, H, W]" if len(shape) == 3 else "[N, 3, H, W]"
        raise RuntimeInputError(
            f"{name} looks channels-last {shape}; torch images are channels-first {layout} (as diffusers reads them): "
            f"pass image.permute{axes}"
        )


def mask_to_grayscale(mask: Any, name: str = "mask_image") -> Any:
    """A PIL mask as inpainting reads it, the one rule of ``mask_image=`` and ``--mask FILE``: diffusers' mask
    processor (``VaeImageProcessor(do_convert_grayscale=True)``: ``mask.convert("L")``), the grayscale of its colour,
    white = repaint. An alpha channel (RGBA, LA, a PNG's transparent colour) is ignored, as diffusers ignores it,
    with a warning when it is not opaque everywhere: transparency does not mark what is repainted, white does.

    Args:
        mask: a ``PIL.Image`` of any mode.
        name: the mask's name for the warning (``mask_image``, the file).

    Returns:
        A new ``PIL.Image`` in mode "L" (decoded: the file ``mask`` was read from may be closed).
    """
    if _has_transparency(mask):
        logger.warning("%s has transparency (mode %s), which is ignored: the mask is the grayscale of its colour "
                       "(white = repaint, as diffusers reads masks); flatten it first if the transparent part is "
                       "what should be repainted", name, mask.mode)
    import warnings

    with warnings.catch_warnings():  # Pillow: "Palette images with Transparency ... should be converted to RGBA"
        warnings.simplefilter("ignore", UserWarning)
        return mask.convert("L")


#: PIL modes with an alpha band: ``convert("RGB")`` drops it.
ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")


def declares_transparency(im: Any) -> bool:
    """A PIL image opened from a file declares transparency in its header (no pixel decoded): an alpha band
    (:data:`ALPHA_MODES`) or a transparent colour (PNG tRNS)."""
    return im.mode in ALPHA_MODES or "transparency" in im.info


def is_wide_mode(mode: str) -> bool:
    """A PIL mode of 16/32-bit integer or float values (``I``, ``I;16*``, ``F``), which ``convert("RGB")`` clips to
    0..255."""
    return mode in ("I", "F") or mode.startswith("I;")


def _has_transparency(im: Any) -> bool:
    """``im`` has an alpha channel that is not opaque everywhere, or a transparent colour (PNG tRNS)."""
    if "transparency" in im.info:
        return True
    alpha = next((b for b in ("A", "a") if b in im.getbands()), None)
    return alpha is not None and im.getchannel(alpha).getextrema()[0] < 255


def read_image_file(path: str | os.PathLike[str], mode: str, max_hw: tuple[int, int] | None = None) -> Any:
    """Open an image file as a PIL image in ``mode`` ("RGB" for an image, "L" for a mask; CLI ``--image`` /
    ``--mask``).

    The size in the file's header is checked against ``max_hw`` (height, width: the artifact profile's largest;
    default :data:`~diffusion_trt.config.MAX_IMAGE_SIZE` squared) before a pixel is decoded, so a decompression bomb
    (a small file whose header claims 100000x100000) costs nothing. The EXIF orientation is applied, as diffusers'
    ``load_image`` applies it (a phone's portrait photo is stored on its side). 16-bit grayscale (PIL modes "I;16*",
    and "I" holding 0..65535) is scaled to 8 bits (``v / 257``) first: a plain ``convert`` clips it to 255 (a white
    image). Images with transparency are refused, as ``EnginePipeline`` refuses RGBA: dropping the alpha channel
    would silently change the picture. A mask ("L") is read by :func:`mask_to_grayscale`, the rule of
    ``mask_image=``: its alpha is ignored (with a warning), as diffusers ignores it.

    Raises:
        RuntimeInputError: the file is not an image Pillow can read, is larger than ``max_hw``, is an image (not a
            mask) with transparency, holds 32-bit values outside 0..65535, or is a float image (mode F).
    """
    import warnings

    from PIL import Image, UnidentifiedImageError

    max_h, max_w = max_hw or (MAX_IMAGE_SIZE, MAX_IMAGE_SIZE)
    try:
        with warnings.catch_warnings():  # the size is checked below, against the profile: no Pillow warning line
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im_file = Image.open(path)
        with im_file as im:
            # from the header: nothing is decoded yet (reading a PNG's EXIF would decode it); either way round,
            # as its EXIF orientation may turn it a quarter, which is checked once it is decoded (bounded now)
            width, height = im.size
            if not (height <= max_h and width <= max_w) and not (width <= max_h and height <= max_w):
                raise _too_large(path, width, height, max_w, max_h)
            if mode != "L" and declares_transparency(im):
                raise RuntimeInputError(
                    f"{str(path)!r} has transparency (mode {im.mode}), which would be dropped silently; flatten it "
                    "onto a background first and save it without alpha (RGB PNG or JPEG)")
            im = exif_upright(im)
            if im.height > max_h or im.width > max_w:  # upright, it does not fit
                raise _too_large(path, im.width, im.height, max_w, max_h)
            if im.mode == "I" or im.mode.startswith("I;16"):
                values = np.asarray(im).astype(np.int64)
                if values.size and (values.min() < 0 or values.max() > 65535):
                    raise RuntimeInputError(
                        f"{str(path)!r} is a 32-bit integer image with values in [{values.min()}, {values.max()}]; "
                        "save it as an 8- or 16-bit PNG")
                im = Image.fromarray(((values + 128) // 257).astype(np.uint8))  # 16 -> 8 bits ("L"), rounded
            elif im.mode == "F":  # convert clips the floats to 0..255: a [0, 1] depth map turns black
                raise RuntimeInputError(
                    f"{str(path)!r} is a 32-bit float image (mode F), whose values have no fixed range; save it as "
                    "an 8- or 16-bit PNG")
            return mask_to_grayscale(im, repr(str(path))) if mode == "L" else im.convert(mode)
    except Image.DecompressionBombError as e:  # Pillow's own refusal, at open: a header claiming > 2 x its limit
        raise RuntimeInputError(
            f"{str(path)!r} claims more pixels than any artifact profile allows ({e}); it looks like a "
            f"decompression bomb: pass a real image of at most {max_w}x{max_h} (WxH)") from None
    except (UnidentifiedImageError, OSError) as e:
        raise RuntimeInputError(f"cannot read {str(path)!r} as an image ({e}); pass a PNG or JPEG file") from None


def check_control_image(image: Any, name: str = "control_image") -> None:
    """Refuse a ControlNet image that diffusers' control image processor (``VaeImageProcessor(do_convert_rgb=True,
    do_normalize=False)``) would read as another picture without a word: an array or tensor outside [0, 1] (it is
    not rescaled: 0..255 values reach the ControlNet 255 times too strong, [-1, 1] ones with negative pixels), a PIL
    image whose ``convert("RGB")`` drops transparency or clips 16/32-bit and float values to 0..255 (a 16-bit depth
    map turns white). 8-bit modes (``L``, ``P`` without transparency, ``CMYK``...) convert as they do in diffusers.

    Raises:
        RuntimeInputError: naming the image (and its index in a list), what was found and the fix.
    """
    check_range(name, image, 0.0, 1.0, "a ControlNet reads control images in [0, 1] (e.g. array / 255)")
    items = image if isinstance(image, list) else [image]
    for i, x in enumerate(items):
        if _kind(x) != "pil":
            continue
        what = f"{name}[{i}]" if len(items) > 1 else name
        if _has_transparency(x):
            raise RuntimeInputError(
                f"{what} has transparency (mode {x.mode}), which converting it to RGB would drop silently (transparent "
                "pixels keep whatever colour they hold, often black); flatten it onto a background first, e.g. "
                "Image.alpha_composite(Image.new('RGBA', im.size, 'white'), im).convert('RGB')")
        if is_wide_mode(x.mode):
            raise RuntimeInputError(
                f"{what} is a {x.mode} (16/32-bit or float) image, which converting it to RGB would clip to 0..255 "
                "(a 16-bit depth map turns white); pass it as a float array in [0, 1] (e.g. np.asarray(im) / 65535 "
                "for 16 bits), or convert it to 8 bits first")


#: What Pillow raises for a damaged EXIF block (its parser's struct, key and value errors).
_EXIF_ERRORS = (ValueError, TypeError, KeyError, SyntaxError, struct.error)


def _too_large(path: str | os.PathLike[str], width: int, height: int, max_w: int, max_h: int) -> RuntimeInputError:
    return RuntimeInputError(
        f"{str(path)!r} is {width}x{height} (WxH), larger than the {max_w}x{max_h} the artifact's profile allows; "
        "resize it into the profile (or recompile with --max-height/--max-width)")


def exif_upright(im: Any) -> Any:
    """``im`` (a PIL image opened from a file) the way viewers show it: its EXIF orientation applied
    (``ImageOps.exif_transpose``, as diffusers' ``load_image`` reads files), so a phone's portrait photo is not read
    lying on its side; a damaged EXIF block leaves it as stored. Decodes the pixels."""
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(im) or im
    except _EXIF_ERRORS:  # a damaged EXIF block: read as stored (a damaged picture is an OSError: not read)
        return im


def image_rows_and_size(image: Any, name: str = "image", mask: bool = False) -> tuple[int, int, int]:
    """The number of images ``n`` and their size (H, W) in pixels, as diffusers' processor would read them.

    Args:
        image: a PIL image, numpy array, torch tensor or a non-empty list of them (all the same size).
        name: "image" or "mask_image", for messages.
        mask: read single-channel layouts as a mask.

    Raises:
        RuntimeInputError: an unsupported type, layout or dtype, an empty list, or images of different sizes.
    """
    items = image if isinstance(image, list) else [image]
    if not items:
        raise RuntimeInputError(f"{name} is an empty list; pass at least one image")
    sizes = [_item_nhw(x, f"{name}[{i}]" if len(items) > 1 else name, mask) for i, x in enumerate(items)]
    hw = {s[1:] for s in sizes}
    if len(hw) > 1:
        raise RuntimeInputError(
            f"the {name} list holds images of different sizes {sorted(hw)} (H, W); resize them to one size"
        )
    return sum(s[0] for s in sizes), sizes[0][1], sizes[0][2]


def preprocess_image(image: Any, vae_scale_factor: int = 8) -> torch.Tensor:
    """An image batch as the VAE encoder takes it: float32 [n, 3, H, W] in [-1, 1] on the CPU.

    diffusers' ``VaeImageProcessor(vae_scale_factor).preprocess`` (``diffusers/image_processor.py``): PIL ->
    /255, numpy [0, 1] -> tensor, then ``2x - 1`` unless the values are already below 0 ([-1, 1] tensors).
    Call :func:`image_rows_and_size` and :meth:`~.geometry.LatentGeometry.check_size` first (the processor would
    resize silently).

    Raises:
        RuntimeInputError: not 3 channels (e.g. RGBA, or 4-channel latents), or values outside [-1, 1].
    """
    from diffusers.image_processor import VaeImageProcessor

    check_range("image", image, -1.0, 1.0, "scale it to [0, 1] (diffusers' range)")
    items = image if isinstance(image, list) else [image]
    if _kind(items[0]) == "pil":
        modes = {x.mode for x in items}
        if modes - {"RGB"}:
            raise RuntimeInputError(f"image mode {sorted(modes)}; convert it with image.convert('RGB')")
    out = VaeImageProcessor(vae_scale_factor=vae_scale_factor).preprocess(image)
    if out.shape[1] != 3:
        raise RuntimeInputError(
            f"image has {out.shape[1]} channels; pass RGB images (3 channels; latents are not accepted)"
        )
    return out.float()


def preprocess_mask(mask_image: Any, height: int, width: int, vae_scale_factor: int = 8) -> torch.Tensor:
    """A mask batch: float32 [m, 1, H, W] of 0 (keep) and 1 (repaint) on the CPU.

    diffusers' mask processor of ``StableDiffusionInpaintPipeline.__init__``: ``VaeImageProcessor(do_normalize=
    False, do_binarize=True, do_convert_grayscale=True)``: grayscale, [0, 1], then ``>= 0.5 -> 1`` else 0. PIL masks
    go through :func:`mask_to_grayscale` first (the same ``convert("L")``, with its warning for an ignored alpha).

    Raises:
        RuntimeInputError: values outside [0, 1].
    """
    from diffusers.image_processor import VaeImageProcessor

    check_range("mask_image", mask_image, 0.0, 1.0, "pass a mask in [0, 1] (white = repaint)")
    if isinstance(mask_image, list):
        mask_image = [mask_to_grayscale(m) if _kind(m) == "pil" else m for m in mask_image]
    elif _kind(mask_image) == "pil":
        mask_image = mask_to_grayscale(mask_image)
    proc = VaeImageProcessor(
        vae_scale_factor=vae_scale_factor, do_normalize=False, do_binarize=True, do_convert_grayscale=True
    )
    return proc.preprocess(mask_image, height=height, width=width).float()


def check_range(name: str, image: Any, lo: float, hi: float, fix: str) -> None:
    """Refuse an array or tensor image (or mask) holding NaN/Inf (:func:`~.finite.check_finite`) or values outside
    [``lo``, ``hi``], the message ending with ``fix``.

    Raises:
        RuntimeInputError: naming ``name`` (with the index in a list) and the values.
    """
    from .finite import check_finite

    items = image if isinstance(image, list) else [image]
    for i, x in enumerate(items):
        kind = _kind(x)
        if kind not in ("np", "pt"):
            continue
        a = torch.as_tensor(np.asarray(x)) if kind == "np" else x.detach()
        check_finite(f"{name}[{i}]" if len(items) > 1 else name, a)
        if a.numel():
            xmin, xmax = float(a.min()), float(a.max())
            if xmin < lo - 1e-3 or xmax > hi + 1e-3:  # finite: check_finite above
                raise RuntimeInputError(f"{name} has values in [{xmin:g}, {xmax:g}], outside [{lo:g}, {hi:g}]; {fix}")


def check_strength(strength: Any, num_inference_steps: int) -> float:
    """``strength`` as a float in (0, 1] that leaves at least one denoising step.

    diffusers' ``get_timesteps`` runs ``min(int(num_inference_steps * strength), num_inference_steps)`` steps.

    Raises:
        RuntimeInputError: not a number, outside (0, 1], or ``int(steps * strength) == 0``.
    """
    number = not isinstance(strength, bool) and isinstance(strength, int | float | np.number)
    if not number or not math.isfinite(strength) or not 0 < strength <= 1:
        raise RuntimeInputError(
            f"strength={strength!r} must be a number in (0, 1]: how much of the image is re-noised "
            "(1 = all of it, e.g. 0.8 for image-to-image)"
        )
    strength = float(strength)
    if min(int(num_inference_steps * strength), num_inference_steps) < 1:
        need = math.ceil(1 / strength)
        raise RuntimeInputError(
            f"strength={strength:g} with num_inference_steps={num_inference_steps} leaves "
            f"int({num_inference_steps} * {strength:g}) = 0 denoising steps; raise it to e.g. "
            f"strength={least_strength(num_inference_steps):g} or num_inference_steps={need}"
        )
    return strength


def least_strength(num_inference_steps: int) -> float:
    """The smallest strength of two decimals (at most 1) that leaves ``num_inference_steps`` one denoising step."""
    return min(math.ceil(100 / num_inference_steps) / 100, 1.0)


def strength_start(num_inference_steps: int, strength: float) -> int:
    """Index of the first of ``num_inference_steps`` steps that runs: ``t_start`` of diffusers' ``get_timesteps``
    (``pipeline_stable_diffusion_img2img.py``): ``num_inference_steps - min(int(steps * strength), steps)``."""
    init_timestep = min(int(num_inference_steps * strength), num_inference_steps)
    return max(num_inference_steps - init_timestep, 0)


def encode_image_latents(
    vae_encoder: Engine,
    images: torch.Tensor,
    generator: Generator,
    scaling_factor: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``scaling_factor * retrieve_latents(vae.encode(images), generator)`` in diffusers' sample mode.

    The engine returns the latent distribution's parameters (mean, logvar) [n, 8, h, w]; like
    ``DiagonalGaussianDistribution.sample`` (``diffusers/models/autoencoders/vae.py``) the logvar is clamped to
    [-30, 20] and the sample is ``mean + exp(logvar / 2) * randn_tensor(mean.shape, generator)``.

    Args:
        images: [n, 3, H, W] in [-1, 1], any device (moved to the engine's).
        generator: one generator, or a list whose first n entries draw row by row (as diffusers' per-image loop).
        dtype: the latents' dtype (the noise is drawn in it, as diffusers draws in the VAE's dtype).

    Returns:
        Latents [n, 4, h, w] of ``dtype`` on the engine device (a fresh tensor).
    """
    from diffusers.utils.torch_utils import randn_tensor

    device = vae_encoder.device
    info = vae_encoder.spec.input("sample")
    params = run_rows(vae_encoder, "sample", images.to(device=device, dtype=info.torch_dtype), "latent_parameters")
    mean, logvar = params.to(dtype).chunk(2, dim=1)
    std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
    if isinstance(generator, list):
        generator = generator[: mean.shape[0]]
    sample = mean + std * randn_tensor(mean.shape, generator=generator, device=device, dtype=dtype)
    return scaling_factor * sample


def _tile(x: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows repeated as a block up to ``batch`` (diffusers: ``torch.cat([x] * (batch // n))`` / ``x.repeat``)."""
    return x if x.shape[0] == batch else x.repeat(batch // x.shape[0], *([1] * (x.ndim - 1)))


@dataclass(frozen=True)
class ImageRequest(TextToImage):
    """A checked image-to-image or inpainting request (built by :func:`image_request`): the base of the two modes,
    whose :meth:`prepare` differs.

    Attributes:
        image: [n, 3, H, W] float32 in [-1, 1] (CPU).
        mask: [m, 1, H, W] float32 of {0, 1} (CPU; m = 1 or n), or ``None`` for image-to-image.
        strength: in (0, 1].
        vae_encoder: the engine that encodes images.
        scaling_factor: ``vae.config.scaling_factor``.
        unet_in_channels: 4, or 9 for an inpainting UNet.
    """

    image: torch.Tensor
    mask: torch.Tensor | None
    strength: float
    vae_encoder: Engine
    scaling_factor: float
    unet_in_channels: int

    @property
    def height(self) -> int:
        return int(self.image.shape[2])

    @property
    def width(self) -> int:
        return int(self.image.shape[3])

    def start(self, scheduler: Any, num_inference_steps: int, timesteps: torch.Tensor) -> tuple[torch.Tensor, int]:
        """diffusers' ``get_timesteps``: the timesteps from ``t_start * order`` on, and that begin index, which
        schedulers with ``set_begin_index`` are given (this one now; fresh ones per chunk by the caller).

        Args:
            timesteps: the full schedule as a CPU tensor (after ``set_timesteps``).
        """
        begin = strength_start(num_inference_steps, self.strength) * int(getattr(scheduler, "order", 1))
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(begin)
        return timesteps[begin:], begin

    def _encode(self, image: torch.Tensor, generator: Generator, dtype: torch.dtype) -> torch.Tensor:
        return encode_image_latents(self.vae_encoder, image, generator, self.scaling_factor, dtype)


@dataclass(frozen=True)
class ImageToImage(ImageRequest):
    """Image-to-image, diffusers' ``StableDiffusionImg2ImgPipeline``."""

    mode = "img2img"

    def prepare(self, scheduler: Any, timesteps: torch.Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype,
                device: torch.device, generator: Generator, latents: torch.Tensor | None = None) -> PreparedLatents:
        """``prepare_latents``: the image's latents (VAE-encoded, sampled), noised to the first timestep.

        Args:
            scheduler: after :meth:`start`.
            timesteps: the timesteps that run (CPU), from :meth:`start`.
            shape: latents [B, 4, h, w].
            dtype: latents dtype (the UNet's ``sample`` dtype).
            generator: one generator or a list of B.
            latents: unused (refused with ``image=``).

        Returns:
            :class:`~.conditioning.PreparedLatents` with B rows on ``device``.
        """
        from diffusers.utils.torch_utils import randn_tensor

        batch = shape[0]
        generator, per_row = _generators(generator, batch)
        t0 = timesteps[:1].to(device).repeat(batch)
        image = self.image.to(device)
        if per_row:  # the images are tiled to B first, then encoded row by row with generator[i]
            init = self._encode(_tile(image, batch), generator, dtype)
        else:
            init = _tile(self._encode(image, generator, dtype), batch)
        noise = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        return PreparedLatents(latents=scheduler.add_noise(init, noise, t0))


@dataclass(frozen=True)
class Inpainting(ImageRequest):
    """Inpainting, diffusers' ``StableDiffusionInpaintPipeline`` (9-channel inpainting UNet, or the 4-channel
    blend after every step)."""

    mode = "inpaint"

    def prepare(self, scheduler: Any, timesteps: torch.Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype,
                device: torch.device, generator: Generator, latents: torch.Tensor | None = None) -> PreparedLatents:
        """``prepare_latents`` then ``prepare_mask_latents``, drawn in diffusers' order (arguments as
        :meth:`ImageToImage.prepare`)."""
        from diffusers.utils.torch_utils import randn_tensor

        assert self.mask is not None
        batch = shape[0]
        generator, _ = _generators(generator, batch)
        t0 = timesteps[:1].to(device).repeat(batch)
        image = self.image.to(device)
        strength_max = self.strength == 1.0
        image_latents = None
        if self.unet_in_channels == 4 or not strength_max:  # _encode_vae_image: generator[i] for image row i
            image_latents = _tile(self._encode(image, generator, dtype), batch)
        noise = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        if strength_max:
            latents = noise * scheduler.init_noise_sigma
        else:
            latents = scheduler.add_noise(image_latents, noise, t0)
        mask = self.mask.to(device)
        masked_image = image * (mask < 0.5)
        small = torch.nn.functional.interpolate(mask, size=(shape[2], shape[3])).to(dtype)
        masked_latents = self._encode(masked_image, generator, dtype)
        cond = PreparedLatents(latents=latents, mask=_tile(small, batch))
        if self.unet_in_channels == 9:
            cond.masked_image_latents = _tile(masked_latents, batch)
        else:
            cond.image_latents, cond.noise = image_latents, noise
        return cond


def _generators(generator: Generator, batch: int) -> tuple[Generator, bool]:
    """(the generator(s) to draw with, whether there is one per row): a list of other than B uses its first."""
    per_row = isinstance(generator, list) and len(generator) == batch
    if isinstance(generator, list) and not per_row:
        generator = generator[0]
    return generator, per_row


def image_request(
    image: Any,
    mask_image: Any,
    strength: Any,
    *,
    num_inference_steps: int,
    batch: int,
    height: int | None,
    width: int | None,
    vae_encoder: Engine | None,
    geometry: LatentGeometry,
    profile: Any,
) -> ImageRequest:
    """Check an image-to-image / inpainting call and preprocess its image and mask.

    Args:
        image, mask_image: image-likes (see the module docstring); ``mask_image`` ``None`` = image-to-image.
        strength: in (0, 1]; ``None`` = diffusers' default (0.8 image-to-image, 1.0 inpainting).
        num_inference_steps: the steps of the full schedule.
        batch: images generated B; the n images given must divide it.
        height, width: ``None``, or the image's own size (images are never resized).
        vae_encoder: the artifact's VAE encoder engine (``None`` when it has none).
        geometry: the artifact's latent geometry (its ``unet_in_channels``: 4, or 9 for an inpainting UNet, which
            needs ``mask_image``).
        profile: the artifact's :class:`~diffusion_trt.config.ShapeProfile`.

    Raises:
        RuntimeInputError: every input the engines cannot honour: a bad type, layout, range or size (not a multiple
            of 8, outside the profile), ``height``/``width`` other than the image's, a mask of another size or
            count, an image count that does not divide the batch, a bad ``strength``, an inpainting UNet without a
            mask, or an artifact without a VAE encoder.
    """
    unet_in_channels, vae_scale_factor = geometry.unet_in_channels, geometry.scale_factor
    if image is None:
        raise RuntimeInputError("mask_image= needs image=: the image to inpaint (the mask marks what to repaint)")
    if unet_in_channels not in (4, 9):
        raise RuntimeInputError(
            f"the artifact's UNet takes {unet_in_channels} input channels; image-to-image and inpainting need 4 "
            "(StableDiffusionImg2ImgPipeline) or 9 (an inpainting checkpoint)"
        )
    if unet_in_channels == 9 and mask_image is None:
        raise RuntimeInputError(
            "this artifact's UNet is an inpainting UNet (9 input channels: latents, mask, masked-image latents); "
            "pass mask_image= (white = repaint) with image="
        )
    if vae_encoder is None:
        raise RuntimeInputError(
            "the artifact has no vae_encoder component, which image-to-image and inpainting need; recompile it with "
            "the default components (text_encoder, unet, vae_decoder, vae_encoder)"
        )
    if strength is None:
        strength = DEFAULT_IMG2IMG_STRENGTH if mask_image is None else DEFAULT_INPAINT_STRENGTH
    strength = check_strength(strength, num_inference_steps)
    n, h, w = image_rows_and_size(image, "image")
    for what, given, own in (("height", height, h), ("width", width, w)):
        if given is not None and given != own:
            raise RuntimeInputError(
                f"{what}={given} but the image is {w}x{h} (WxH); with image= the size is the image's: drop "
                f"{what}= or resize the image (it is never resized here)"
            )
    geometry.check_size(h, w, profile, image="image")
    if batch % n:
        raise RuntimeInputError(
            f"{n} images were given for {batch} images to generate; pass 1 image, or a number that divides {batch} "
            "(the images are repeated as a block, as diffusers does)"
        )
    pixels = preprocess_image(image, vae_scale_factor)
    mask = None
    if mask_image is not None:
        m, mh, mw = image_rows_and_size(mask_image, "mask_image", mask=True)
        if (mh, mw) != (h, w):
            raise RuntimeInputError(
                f"mask_image is {mw}x{mh} (WxH) but the image is {w}x{h}; pass a mask of the image's size"
            )
        if m not in (1, n):
            raise RuntimeInputError(f"{m} masks for {n} images; pass one mask, or one per image")
        mask = preprocess_mask(mask_image, h, w, vae_scale_factor)
    mode = ImageToImage if mask is None else Inpainting
    return mode(pixels, mask, strength, vae_encoder, geometry.scaling_factor, unet_in_channels)


__all__: Sequence[str] = (
    "DEFAULT_IMG2IMG_STRENGTH",
    "DEFAULT_INPAINT_STRENGTH",
    "ImageRequest",
    "ImageToImage",
    "Inpainting",
    "check_strength",
    "encode_image_latents",
    "image_request",
    "mask_to_grayscale",
    "preprocess_image",
    "preprocess_mask",
    "read_image_file",
    "strength_start",
)

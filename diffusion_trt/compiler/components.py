"""Per-component I/O specification: tensor names, dtypes, symbolic shapes and their profile ranges.

One table serves the exporter (input/output names, dynamic axes), the manifest (shape ranges the
runtime validates against) and, later, TensorRT optimization profiles (min/opt/max per input).

Symbolic dims:
    ``B``   images per call (profile ``batch``); ``B2`` = the UNet/text-encoder batch, 2*B with
            classifier-free guidance (CFG) and B without, so its range is ``[min_B, 2*max_B]``.
    ``H``/``W`` image size in pixels; ``h``/``w`` = latent size = H/8, W/8.
    ``S``   the UNet's context length with long prompts: 77 * k tokens, k = 1..``max_prompt_chunks`` (its range is
            the component's own, :attr:`ComponentSpec.symbols`: (77, 77, 77 * max)); the text encoder always
            takes CLIP's 77 positions (``tokenizer.model_max_length``), and so does a UNet compiled for one chunk.
    ``h/k`` ``w/k`` (k = 2, 4, 8) the latent size after k-fold stride-2 downsampling, ``ceil(h / k)``: the UNet's
            ControlNet residuals (see :mod:`.controlnet`).

SDXL (``StableDiffusionXLPipeline``) has its own table: two text encoders whose penultimate hidden states are
concatenated into the UNet's ``encoder_hidden_states``, the second one's pooled projection as the UNet's
``text_embeds``, and the ``time_ids`` (see :func:`component_specs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import IMAGE_ALIGNMENT, ShapeProfile

#: The downsampling factors of the ``h/k`` / ``w/k`` symbols (a UNet of 4 levels halves the latents 3 times).
DOWNSAMPLED_FACTORS: tuple[int, ...] = (2, 4, 8)


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output.

    Attributes:
        name: ONNX tensor name.
        dtype: "float32", "float16" or "int64"; "float" means the component's precision.
        shape: dims, each an int or one of the symbols of this module's docstring.
    """

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def resolved_dtype(self, precision: str) -> str:
        if self.dtype == "float":
            return "float16" if precision == "fp16" else "float32"
        return self.dtype

    def dynamic_axes(self) -> dict[int, str]:
        return {i: d for i, d in enumerate(self.shape) if isinstance(d, str)}


@dataclass(frozen=True)
class ComponentSpec:
    """I/O of one exported component (see :func:`component_specs`).

    Attributes:
        symbols: (min, opt, max) of the symbols that do not follow the image profile (``S``), by name.
    """

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    symbols: tuple[tuple[str, tuple[int, int, int]], ...] = ()

    def ranges(self, profile: ShapeProfile) -> dict[str, tuple[int, int, int]]:
        """min/opt/max of every symbol of this component: :func:`symbol_ranges` and :attr:`symbols`."""
        return {**symbol_ranges(profile), **dict(self.symbols)}


def component_specs(
    *,
    text_hidden: int,
    text_len: int,
    unet_in: int,
    unet_out: int,
    latent: int,
    text_hidden_2: int | None = None,
    text_embeds: int | None = None,
    time_ids: int = 6,
    prompt_chunks: int = 1,
    clip_skip: int = 0,
    embedding_vectors: int = 0,
) -> dict[str, ComponentSpec]:
    """The component table, sized from the model's configs: SD 1.x/2.x, or SDXL when ``text_hidden_2`` is given.

    Args:
        text_hidden: hidden size of the (first) text encoder (768 for SD 1.x and SDXL, 1024 for SD 2.x).
        text_len: tokenizer max length (77).
        unet_in: UNet input channels (4; 9 for inpainting checkpoints).
        unet_out: UNet output channels (4).
        latent: VAE latent channels (4).
        text_hidden_2: SDXL: hidden size of ``text_encoder_2`` (1280); ``None`` = an SD 1.x/2.x table.
        text_embeds: SDXL: ``text_encoder_2.config.projection_dim`` (1280), the pooled ``text_embeds`` width.
        time_ids: SDXL: the number of ``time_ids`` per row (6: original size, crop top-left, target size).
        prompt_chunks: the UNet's ``encoder_hidden_states`` takes 77 * k tokens for k up to this; > 1
            makes its sequence axis the symbol ``S`` (``CompileConfig.max_prompt_chunks``).
        clip_skip: C > 0 adds the text encoder output ``clip_skip_states`` [B2, C, S, D] (diffusers' ``clip_skip=c``
            for c = 1..C; CompileConfig.max_clip_skip): SD 1.x/2.x, row c-1 the final-layer-normed
            ``hidden_states[-(c + 1)]``; SDXL, on both text encoders, row c-1 ``hidden_states[-(c + 2)]`` without
            the final layer norm (``StableDiffusionXLPipeline.encode_prompt``).
        embedding_vectors: N > 0 adds the text encoder input ``embedding_vectors`` [B2, N, text_hidden] (SDXL: to
            both text encoders, ``text_encoder_2``'s [B2, N, text_hidden_2]): each text row's textual-inversion
            vectors, that its token ids -N..-1 look up (row id + N; ids >= 0 read the model's own token table), see
            :mod:`diffusion_trt.runtime.embeddings` (CompileConfig.max_embedding_vectors). Batched like
            ``input_ids``: every input shares the batch symbol (Triton's dynamic batching, one profile dimension).

    SDXL, as diffusers' ``StableDiffusionXLPipeline.encode_prompt``: each text encoder runs with
    ``output_hidden_states=True`` and gives ``hidden_states[-2]`` (the penultimate layer, before the final layer
    norm) as ``penultimate_hidden_state``; ``text_encoder_2`` (``CLIPTextModelWithProjection``) also gives the
    projected pooled output ``text_embeds`` [B2, text_embeds]. The UNet reads ``encoder_hidden_states`` =
    concat(penultimate states, dim=-1) [B2, S, text_hidden + text_hidden_2], ``text_embeds`` and ``time_ids``
    [B2, time_ids] (float32: pixel sizes up to 4096 must stay exact; they feed a sinusoidal embedding).
    """
    if text_hidden_2 is not None:
        return _sdxl_specs(text_hidden, text_len, unet_in, unet_out, latent, text_hidden_2,
                           text_embeds if text_embeds is not None else text_hidden_2, time_ids, prompt_chunks,
                           clip_skip, embedding_vectors)
    context, symbols = _context(text_len, prompt_chunks)
    return {
        "text_encoder": ComponentSpec(
            "text_encoder",
            inputs=(TensorSpec("input_ids", "int64", ("B2", text_len)),
                    *_vectors_input(embedding_vectors, text_hidden)),
            outputs=(TensorSpec("last_hidden_state", "float", ("B2", text_len, text_hidden)),
                     *_skipped_output(clip_skip, text_len, text_hidden)),
        ),
        "unet": ComponentSpec(
            "unet",
            inputs=(
                TensorSpec("sample", "float", ("B2", unet_in, "h", "w")),
                TensorSpec("timestep", "float32", ("B2",)),
                TensorSpec("encoder_hidden_states", "float", ("B2", context, text_hidden)),
            ),
            outputs=(TensorSpec("noise_pred", "float", ("B2", unet_out, "h", "w")),),
            symbols=symbols,
        ),
        **_vae_specs(latent),
    }


def _context(text_len: int, prompt_chunks: int) -> tuple[int | str, tuple[tuple[str, tuple[int, int, int]], ...]]:
    """The UNet's context length (77, or the symbol ``S`` for k > 1 chunks) and its :attr:`ComponentSpec.symbols`."""
    if prompt_chunks == 1:
        return text_len, ()
    return "S", (("S", (text_len, text_len, text_len * prompt_chunks)),)


def _skipped_output(clip_skip: int, text_len: int, hidden: int) -> tuple[TensorSpec, ...]:
    """The text encoder's ``clip_skip_states`` [B2, C, S, D] output, none for C = 0."""
    return (TensorSpec("clip_skip_states", "float", ("B2", clip_skip, text_len, hidden)),) if clip_skip else ()


def _vectors_input(rows: int, hidden: int) -> tuple[TensorSpec, ...]:
    """The text encoder's ``embedding_vectors`` [B2, N, D] input, none for N = 0."""
    return (TensorSpec("embedding_vectors", "float", ("B2", rows, hidden)),) if rows else ()


def _vae_specs(latent: int) -> dict[str, ComponentSpec]:
    return {
        "vae_decoder": ComponentSpec(
            "vae_decoder",
            inputs=(TensorSpec("latent_sample", "float", ("B", latent, "h", "w")),),
            outputs=(TensorSpec("sample", "float", ("B", 3, "H", "W")),),
        ),
        "vae_encoder": ComponentSpec(
            "vae_encoder",
            inputs=(TensorSpec("sample", "float", ("B", 3, "H", "W")),),
            outputs=(TensorSpec("latent_parameters", "float", ("B", 2 * latent, "h", "w")),),
        ),
    }


def _sdxl_specs(text_hidden: int, text_len: int, unet_in: int, unet_out: int, latent: int, text_hidden_2: int,
                text_embeds: int, time_ids: int, prompt_chunks: int = 1, clip_skip: int = 0,
                embedding_vectors: int = 0) -> dict[str, ComponentSpec]:
    """SDXL's table (see :func:`component_specs`)."""
    context, symbols = _context(text_len, prompt_chunks)
    return {
        "text_encoder": ComponentSpec(
            "text_encoder",
            inputs=(TensorSpec("input_ids", "int64", ("B2", text_len)),
                    *_vectors_input(embedding_vectors, text_hidden)),
            outputs=(TensorSpec("penultimate_hidden_state", "float", ("B2", text_len, text_hidden)),
                     *_skipped_output(clip_skip, text_len, text_hidden)),
        ),
        "text_encoder_2": ComponentSpec(
            "text_encoder_2",
            inputs=(TensorSpec("input_ids", "int64", ("B2", text_len)),
                    *_vectors_input(embedding_vectors, text_hidden_2)),
            outputs=(
                TensorSpec("text_embeds", "float", ("B2", text_embeds)),
                TensorSpec("penultimate_hidden_state", "float", ("B2", text_len, text_hidden_2)),
                *_skipped_output(clip_skip, text_len, text_hidden_2),
            ),
        ),
        "unet": ComponentSpec(
            "unet",
            inputs=(
                TensorSpec("sample", "float", ("B2", unet_in, "h", "w")),
                TensorSpec("timestep", "float32", ("B2",)),
                TensorSpec("encoder_hidden_states", "float", ("B2", context, text_hidden + text_hidden_2)),
                TensorSpec("text_embeds", "float", ("B2", text_embeds)),
                TensorSpec("time_ids", "float32", ("B2", time_ids)),
            ),
            outputs=(TensorSpec("noise_pred", "float", ("B2", unet_out, "h", "w")),),
            symbols=symbols,
        ),
        **_vae_specs(latent),
    }


def symbol_ranges(profile: ShapeProfile) -> dict[str, tuple[int, int, int]]:
    """min/opt/max of every symbolic dim for an image-level profile.

    ``B2`` (the CFG batch) spans ``[min_B, 2*max_B]`` so an engine also serves guidance <= 1; a static profile
    (min == max everywhere) pins it to ``2*B``: a static engine is built for the CFG batch only.
    """
    b, hh, ww = profile.batch, profile.height, profile.width
    a = IMAGE_ALIGNMENT
    b2_min = 2 * b.opt if profile.is_static() else b.min
    ranges = {
        "B": (b.min, b.opt, b.max),
        "B2": (b2_min, 2 * b.opt, 2 * b.max),
        "H": (hh.min, hh.opt, hh.max),
        "W": (ww.min, ww.opt, ww.max),
        "h": (hh.min // a, hh.opt // a, hh.max // a),
        "w": (ww.min // a, ww.opt // a, ww.max // a),
    }
    for base in ("h", "w"):
        for k in DOWNSAMPLED_FACTORS:
            ranges[f"{base}/{k}"] = tuple(-(-d // k) for d in ranges[base])  # type: ignore[assignment]
    return ranges


def tensor_manifest(spec: TensorSpec, precision: str, profile: ShapeProfile,
                    symbols: tuple[tuple[str, tuple[int, int, int]], ...] = ()) -> dict[str, Any]:
    """Manifest entry of one tensor: name, dtype, symbolic shape and concrete min/opt/max shapes (``symbols``: its
    component's own ranges, :attr:`ComponentSpec.symbols`)."""
    ranges = {**symbol_ranges(profile), **dict(symbols)}
    shapes: dict[str, list[int]] = {"min": [], "opt": [], "max": []}
    for d in spec.shape:
        for i, key in enumerate(("min", "opt", "max")):
            shapes[key].append(d if isinstance(d, int) else ranges[d][i])
    return {"name": spec.name, "dtype": spec.resolved_dtype(precision), "shape": list(spec.shape), **shapes}

"""Load a diffusers SD 1.x / 2.x / SDXL pipeline folder offline and export each component to ONNX.

This is the only module of the package that touches diffusers/transformers model classes and
``torch.onnx``. It uses the TorchScript-based exporter (``dynamo=False``): its graphs keep the op
patterns the fusion passes match (e.g. GroupNorm as Reshape/InstanceNormalization/Reshape/Mul/Add), and
it exports the SD-1.5 UNet in seconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..artifact import folder as artifacts
from ..artifact.manifest import CONTROLNET_PREFIX, EMBED_PREFIX, UNET_CONTROLNET
from ..errors import ExportError, ModelFolderError
from .components import ComponentSpec, symbol_ranges
from .single_file import check_complete, root_cause

logger = logging.getLogger(__name__)

#: Sub-folders a StableDiffusionPipeline folder must have, and the file each must hold.
REQUIRED_SUBFOLDERS: dict[str, str] = {
    "text_encoder": "config.json",
    "tokenizer": "",
    "unet": "config.json",
    "vae": "config.json",
    "scheduler": "scheduler_config.json",
}
_WEIGHT_FOLDERS = ("text_encoder", "unet", "vae")
_PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")
# StableDiffusionImg2ImgPipeline / StableDiffusionInpaintPipeline folders hold the same components (an inpainting
# checkpoint's UNet takes 9 input channels); the runtime does text-to-image, image-to-image and inpainting on any.
SUPPORTED_PIPELINES = ("StableDiffusionPipeline", "StableDiffusionXLPipeline", "StableDiffusionImg2ImgPipeline",
                       "StableDiffusionInpaintPipeline")
#: Pipeline classes whose folders hold more than :data:`REQUIRED_SUBFOLDERS`: sub-folder -> (required file, why).
EXTRA_SUBFOLDERS: dict[str, dict[str, tuple[str, str]]] = {
    "StableDiffusionXLPipeline": {
        "text_encoder_2": ("config.json", "SDXL has a second text encoder (OpenCLIP-bigG)"),
        "tokenizer_2": ("", "SDXL has a second tokenizer"),
    },
}
#: Pipeline class -> architecture recorded in the manifest (``model.architecture``), which picks the runtime loop.
ARCHITECTURES: dict[str, str] = {"StableDiffusionXLPipeline": "sdxl"}


@dataclass(frozen=True)
class ModelFolder:
    """A checked pipeline folder.

    Attributes:
        path: the folder.
        pipeline_class: ``_class_name`` of model_index.json.
        pickled: weight folders whose weights exist only as pickle files (allowed by ``trust_pickle``).
    """

    path: Path
    pipeline_class: str
    pickled: tuple[str, ...]

    @property
    def architecture(self) -> str:
        """"sdxl" for a StableDiffusionXLPipeline folder, else "sd" (SD 1.x and 2.x share one loop)."""
        return ARCHITECTURES.get(self.pipeline_class, "sd")

    def config(self, sub: str, name: str = "config.json") -> dict[str, Any]:
        """``sub/name`` parsed.

        Raises:
            ModelFolderError: the file is not a JSON object (naming it).
        """
        return artifacts.read_json_object(self.path / sub / name)


def check_model_folder(path: str | Path, trust_pickle: bool = False) -> ModelFolder:
    """Check that ``path`` is a complete SD 1.x / 2.x / SDXL diffusers folder whose weights are safe to load.

    Raises:
        ModelFolderError: the folder, model_index.json, a component folder, its config or its weights
            are missing; the pipeline class is not supported; or weights are pickle files and
            ``trust_pickle`` is false (unpickling runs arbitrary code).
    """
    root = Path(path)
    if root.exists() and not root.is_dir():
        raise ModelFolderError(
            f"{root} is a file, not a folder; pass the pipeline folder (the one with model_index.json)"
        )
    if not root.is_dir():
        raise ModelFolderError(
            f"model folder {root} does not exist; pass a folder written by StableDiffusionPipeline.save_pretrained "
            "(or make one with `diffusion-trt dummy-pipeline`)"
        )
    if (root / "manifest.json").is_file() and not (root / "model_index.json").is_file():
        raise ModelFolderError(_artifact_as_source(root))
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise ModelFolderError(
            f"{root} has no model_index.json; it is not a diffusers pipeline folder "
            "(save one with StableDiffusionPipeline.save_pretrained)"
        )
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ModelFolderError(f"{index_path} is not valid JSON ({e}); re-save the pipeline") from None
    cls = index.get("_class_name", "")
    if cls not in SUPPORTED_PIPELINES:
        raise ModelFolderError(
            f"{root} holds a {cls or 'unnamed'} pipeline; this version compiles {', '.join(SUPPORTED_PIPELINES)} only"
        )
    for sub, required in REQUIRED_SUBFOLDERS.items():
        d = root / sub
        if not d.is_dir():
            raise ModelFolderError(f"{root} is incomplete: the {sub}/ folder is missing; re-save the whole pipeline")
        if required and not (d / required).is_file():
            raise ModelFolderError(f"{root} is incomplete: {sub}/{required} is missing; re-save the whole pipeline")
    extra = EXTRA_SUBFOLDERS.get(cls, {})
    for sub, (required, why) in extra.items():
        d = root / sub
        if not d.is_dir():
            raise ModelFolderError(
                f"{root} is incomplete: the {sub}/ folder is missing ({why}; model_index.json names a {cls}); "
                "re-save the whole pipeline"
            )
        if required and not (d / required).is_file():
            raise ModelFolderError(f"{root} is incomplete: {sub}/{required} is missing ({why}); re-save the whole "
                                   "pipeline")
    pickled = []
    # the extra folders with a config.json are models and hold weights (as text_encoder, unet and vae do)
    for sub in (*_WEIGHT_FOLDERS, *(k for k, (required, _) in extra.items() if required == "config.json")):
        files = [p for p in (root / sub).iterdir() if p.is_file()]
        weights = [p for p in files if p.suffix == ".safetensors"]
        for path in weights:
            check_complete(path)
        if weights:
            continue
        pickles = [p.name for p in files if p.suffix in _PICKLE_SUFFIXES]
        if not pickles:
            raise ModelFolderError(
                f"{root} is incomplete: {sub}/ has no weights (*.safetensors); re-save the whole pipeline"
            )
        if not trust_pickle:
            raise ModelFolderError(
                f"{sub}/{pickles[0]} is a pickle file and loading it runs arbitrary code; convert the pipeline to "
                "safetensors (save_pretrained(..., safe_serialization=True)) or pass --trust-pickle if you trust "
                "its source"
            )
        pickled.append(sub)
    return ModelFolder(root, cls, tuple(pickled))


def _artifact_as_source(root: Path) -> str:
    """The message for a compiled artifact passed as the model folder (naming its source and merged LoRAs)."""
    from ..artifact.manifest import Manifest

    try:  # not schema-checked: a message, not a load (Manifest.from_json gives absent keys their defaults)
        manifest = Manifest.from_json(json.loads((root / "manifest.json").read_text(encoding="utf-8")))
        source, loras = manifest.source_path, manifest.loras
    except (OSError, ValueError, TypeError, KeyError, AttributeError):  # unreadable, or no manifest: no facts to name
        source, loras = None, ()
    msg = (f"{root} is a compiled artifact (it has manifest.json), not a diffusers pipeline folder; compile from "
           f"the model folder it was made from{f' ({source})' if source else ''}")
    if loras:
        merged = ", ".join(f"{r.file} (scale {r.scale})" for r in loras)
        msg += (f". Its weights have the LoRA(s) {merged} merged already: pass them again with --lora to rebuild "
                "the same model, never on top of these weights")
    return msg


class _TextEncoder(torch.nn.Module):
    """(input_ids[B2,S] int64[, embedding_vectors[B2,N,D]]) -> last_hidden_state[B2,S,D]; with ``clip_skip`` C > 0 also
    clip_skip_states[B2,C,S,D], row c-1 = ``final_layer_norm(hidden_states[-(c + 1)])``: diffusers' ``clip_skip=c``
    (``StableDiffusionPipeline.encode_prompt``), for c = 1..C, from the one engine.

    With ``embedding_vectors`` (``vectors`` N > 0) a token id in -N..-1 reads row ``id + N`` of its text row's
    vectors instead of the token table (textual inversion, :class:`_TokenRows`); ids >= 0 are looked up as before,
    bit for bit.
    """

    def __init__(self, text_encoder: torch.nn.Module, clip_skip: int = 0, vectors: int = 0) -> None:
        super().__init__()
        self.text_encoder = text_encoder
        self.clip_skip = clip_skip
        # transformers 5's CLIPTextModel holds the final layer norm itself; 4.x under .text_model
        inner = getattr(text_encoder, "text_model", text_encoder)
        self.final_layer_norm = inner.final_layer_norm
        self.embeddings = inner.embeddings
        self.vectors = vectors

    def forward(self, input_ids: torch.Tensor, embedding_vectors: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        with _token_rows(self.embeddings, embedding_vectors if self.vectors else None):
            return self._encode(input_ids)

    def _encode(self, input_ids: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not self.clip_skip:
            return self.text_encoder(input_ids, return_dict=False)[0]
        out = self.text_encoder(input_ids, output_hidden_states=True)
        skipped = [self.final_layer_norm(out.hidden_states[-(c + 1)]) for c in range(1, self.clip_skip + 1)]
        return out.last_hidden_state, torch.stack(skipped, dim=1)


class _TokenRows(torch.nn.Module):
    """A token-embedding lookup that reads ids -N..-1 of text row b from ``vectors[b]`` [N, D] (row id + N) and ids
    >= 0 from the model's ``table``: a Gather, a GatherElements and a Where, nothing the size of the vocabulary
    copied per run."""

    def __init__(self, table: torch.nn.Embedding, vectors: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.vectors = vectors

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        n = self.vectors.shape[1]
        base = self.table(input_ids.clamp(min=0))
        rows = (input_ids + n).clamp(min=0, max=n - 1).unsqueeze(-1).expand(-1, -1, self.vectors.shape[2])
        extra = torch.gather(self.vectors, 1, rows)  # [B2, S, D]: extra[b, s] = vectors[b, rows[b, s]]
        return torch.where((input_ids < 0).unsqueeze(-1), extra.to(base.dtype), base)


class _TextEncoderPenultimate(torch.nn.Module):
    """SDXL: (input_ids[B2,S] int64[, embedding_vectors[B2,N,D]]) -> penultimate_hidden_state[B2,S,D] =
    ``hidden_states[-2]``; with ``clip_skip`` C > 0 also clip_skip_states[B2,C,S,D], row c-1 = ``hidden_states[-(c +
    2)]``.

    As diffusers' ``StableDiffusionXLPipeline.encode_prompt``: ``clip_skip=None`` takes the output of the
    last-but-one encoder layer, ``clip_skip=c`` the one c layers before it, both without the final layer norm. The
    last layer is dead code in the export and is dropped. ``embedding_vectors`` as :class:`_TextEncoder`'s.
    """

    def __init__(self, text_encoder: torch.nn.Module, clip_skip: int = 0, vectors: int = 0) -> None:
        super().__init__()
        self.text_encoder = text_encoder
        self.clip_skip = clip_skip
        self.vectors = vectors
        self.embeddings = getattr(text_encoder, "text_model", text_encoder).embeddings

    def forward(self, input_ids: torch.Tensor, embedding_vectors: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        with _token_rows(self.embeddings, embedding_vectors if self.vectors else None):
            out = self.text_encoder(input_ids, output_hidden_states=True)
        return _penultimate_outputs(out.hidden_states, self.clip_skip)


class _TextEncoderWithProjection(_TextEncoderPenultimate):
    """SDXL ``text_encoder_2``: (input_ids[B2,S][, embedding_vectors[B2,N,D]]) -> (text_embeds[B2,P],
    penultimate_hidden_state[B2,S,D][, clip_skip_states[B2,C,S,D]]), the states as :class:`_TextEncoderPenultimate`.

    ``text_embeds`` is ``CLIPTextModelWithProjection``'s output 0: the final-layer-normed state at the EOS token
    times the text projection (diffusers' ``pooled_prompt_embeds``, whatever the clip skip).
    """

    def forward(self, input_ids: torch.Tensor, embedding_vectors: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, ...]:
        with _token_rows(self.embeddings, embedding_vectors if self.vectors else None):
            out = self.text_encoder(input_ids, output_hidden_states=True)
        states = _penultimate_outputs(out.hidden_states, self.clip_skip)
        return (out.text_embeds, *(states if isinstance(states, tuple) else (states,)))


@contextlib.contextmanager
def _token_rows(embeddings: torch.nn.Module, vectors: torch.Tensor | None) -> Iterator[None]:
    """Inside the block, ``embeddings``' token lookup reads ids < 0 from ``vectors`` (:class:`_TokenRows`); ``None``
    = the model's own lookup. Restored on exit."""
    if vectors is None:
        yield
        return
    table = embeddings.token_embedding
    embeddings.token_embedding = _TokenRows(table, vectors)
    try:
        yield
    finally:
        embeddings.token_embedding = table


def _penultimate_outputs(hidden_states: Sequence[torch.Tensor], clip_skip: int
                         ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """SDXL's ``hidden_states[-2]``, and with ``clip_skip`` C > 0 the stack of ``hidden_states[-(c + 2)]``, c = 1..C,
    on axis 1."""
    if not clip_skip:
        return hidden_states[-2]
    return hidden_states[-2], torch.stack([hidden_states[-(c + 2)] for c in range(1, clip_skip + 1)], dim=1)


class _UNetXL(torch.nn.Module):
    """SDXL: (sample, timestep[B2] fp32, encoder_hidden_states[B2,S,D1+D2], text_embeds[B2,P], time_ids[B2,6] fp32)
    -> noise_pred[B2,4,h,w]; ``text_embeds``/``time_ids`` are diffusers' ``added_cond_kwargs``."""

    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                text_embeds: torch.Tensor, time_ids: torch.Tensor) -> torch.Tensor:
        added = {"text_embeds": text_embeds, "time_ids": time_ids}
        return self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added, return_dict=False)[0]


class _UNet(torch.nn.Module):
    """(sample[B2,C,h,w], timestep[B2] fp32, encoder_hidden_states[B2,S,D]) -> noise_pred[B2,4,h,w]."""

    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(
        self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        return self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]


class _VaeDecoder(torch.nn.Module):
    """(latent_sample[B,4,h,w], already divided by the scaling factor) -> sample[B,3,H,W] in [-1, 1]."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latent_sample, return_dict=False)[0]


class _VaeEncoder(torch.nn.Module):
    """(sample[B,3,H,W] in [-1, 1]) -> latent_parameters[B,8,h,w] = (mean, logvar); the runtime samples."""

    def __init__(self, vae: torch.nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        h = self.vae.encoder(sample)
        if self.vae.quant_conv is not None:
            h = self.vae.quant_conv(h)
        return h


def module_keys(component: str) -> tuple[str, ...]:
    """The keys of :func:`load_models`' dict (and of the loaded ControlNets) that exporting ``component`` reads:
    ``unet`` and ``unet_controlnet`` read ``"unet"``, both VAE halves ``"vae"``, a ControlNet its own name and its
    ``cond_embed_<name>`` the ControlNet's (``controlnet_<name>``)."""
    if component in ("vae_decoder", "vae_encoder"):
        return ("vae",)
    if component == UNET_CONTROLNET:
        return ("unet",)
    if component.startswith(EMBED_PREFIX):
        return (CONTROLNET_PREFIX + component[len(EMBED_PREFIX):],)
    return (component,)


def _wrap(component: str, models: dict[str, Any], architecture: str = "sd", clip_skip: int = 0, vectors: int = 0,
          spec: ComponentSpec | None = None) -> torch.nn.Module:
    if architecture == "sdxl":
        if component == "text_encoder":
            return _TextEncoderPenultimate(models["text_encoder"], clip_skip, vectors)
        if component == "text_encoder_2":
            return _TextEncoderWithProjection(models["text_encoder_2"], clip_skip, vectors)
        if component == "unet":
            return _UNetXL(models["unet"])
    from . import controlnet

    wrapped = controlnet.wrap(component, models, architecture, spec)  # unet_controlnet, cond_embed_/controlnet_<name>
    if wrapped is not None:
        return wrapped
    if component == "text_encoder":
        return _TextEncoder(models["text_encoder"], clip_skip, vectors)
    if component == "unet":
        return _UNet(models["unet"])
    if component == "vae_decoder":
        return _VaeDecoder(models["vae"])
    if component == "vae_encoder":
        return _VaeEncoder(models["vae"])
    known = "text_encoder, text_encoder_2 (SDXL), unet, vae_decoder, vae_encoder"
    raise ExportError(f"unknown component {component!r} for a {architecture!r} pipeline; known: {known}")


def export_device(target: str) -> str:
    """The torch device to trace on: CUDA when the engines target it and this machine has it, else CPU.

    Export is always fp32, so tracing on the CPU gives the same graph; a CUDA-targeted compile works on a
    machine without a GPU (slower, and the engines are not test-loaded).
    """
    if target == "cuda" and torch.cuda.is_available():
        return "cuda"
    if target == "cuda":
        logger.warning("no CUDA device here: exporting on the CPU for a CUDA target")
    return "cpu"


def load_models(folder: ModelFolder, precision: str, device: str) -> dict[str, Any]:
    """Load text encoder(s), UNet and VAE offline (``local_files_only``) in eval mode on ``device``.

    An SDXL folder also gives ``text_encoder_2`` (``CLIPTextModelWithProjection``).

    Args:
        precision: "fp32" or "fp16" (``torch.float16`` weights).
        device: torch device string ("cpu", "cuda").
    """
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    dtype = torch.float16 if precision == "fp16" else torch.float32
    kw: dict[str, Any] = {"local_files_only": True, "torch_dtype": dtype}
    models: dict[str, Any] = {}
    todo: list[tuple[str, Any, str]] = [
        ("text_encoder", CLIPTextModel, "text_encoder"),
        ("unet", UNet2DConditionModel, "unet"),
        ("vae", AutoencoderKL, "vae"),
    ]
    if folder.architecture == "sdxl":
        todo.insert(1, ("text_encoder_2", CLIPTextModelWithProjection, "text_encoder_2"))
    with _without_transformers_bars():  # compile's own stage bar says what loads
        for name, cls, sub in todo:
            use_st = sub not in folder.pickled
            try:
                if cls in (CLIPTextModel, CLIPTextModelWithProjection):
                    # eager attention: traces to plain MatMul/Softmax that every backend parses
                    m = cls.from_pretrained(folder.path / sub, use_safetensors=use_st, attn_implementation="eager",
                                            **kw)
                else:
                    m = cls.from_pretrained(folder.path, subfolder=sub, use_safetensors=use_st, **kw)
            except OSError as e:  # diffusers' "Unable to load weights from checkpoint file", from safetensors' error
                why = root_cause(e)
                raise ModelFolderError(f"could not load {sub}/ from {folder.path}: {str(e).strip()} "
                                       f"({type(why).__name__}: {str(why)[:300]}); the file is damaged: re-download "
                                       "or re-save the pipeline") from e
            except Exception as e:
                raise ModelFolderError(f"could not load {sub}/ from {folder.path}: {e}") from e
            models[name] = m.to(device).eval()
    return models


@contextlib.contextmanager
def _without_transformers_bars() -> Iterator[None]:
    """transformers' own progress bars (its "Loading weights" bar per text encoder) off for the block, as they were
    after it."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def sample_inputs(spec: ComponentSpec, precision: str, ranges: dict[str, tuple[int, int, int]], device: str) -> tuple:
    """Example inputs at the profile's opt shape, for tracing."""

    args = []
    opt = {k: v[1] for k, v in ranges.items()}
    if spec.name in ("unet", UNET_CONTROLNET):
        # Trace at a latent size that is not a multiple of 2**num_upsamplers: diffusers then forwards
        # each skip connection's size to its Upsample2D (F.interpolate(size=...)), which traces to a
        # shape-driven Resize. Traced at a multiple of 8 it would freeze scale_factor=2 and every
        # latent size that is not a multiple of 8 (image sizes not multiples of 64) would fail.
        for base in ("h", "w"):
            opt[base] = opt[base] + 1 if opt[base] % 2 == 0 else opt[base]
        # the ControlNet residuals at that size: h/k = ceil(h / k)
        opt.update({k: -(-opt[k.partition("/")[0]] // int(k.partition("/")[2])) for k in opt if "/" in k})
    for t in spec.inputs:
        shape = [d if isinstance(d, int) else opt[d] for d in t.shape]
        dtype = t.resolved_dtype(precision)
        if dtype == "int64":
            args.append(torch.randint(0, 1000, shape, dtype=torch.int64, device=device))
        elif t.name == "timestep":
            args.append(torch.full(shape, 500.0, dtype=torch.float32, device=device))
        elif t.name == "time_ids":  # SDXL: original size, crop top-left, target size (values do not shape the graph)
            h, w = ranges["H"][1], ranges["W"][1]
            row = torch.tensor([h, w, 0, 0, h, w], dtype=torch.float32, device=device)
            args.append(row[: shape[1]].expand(shape[0], -1).contiguous())
        else:
            args.append(torch.randn(shape, dtype=getattr(torch, dtype), device=device))
    return tuple(args)


def onnx_from_component(
    component: str,
    models: dict[str, Any],
    spec: ComponentSpec,
    out_path: Path,
    *,
    precision: str,
    profile_ranges: dict[str, tuple[int, int, int]],
    opset: int,
    device: str,
    architecture: str = "sd",
) -> Path:
    """Export one component to ``out_path`` (an ONNX file; weights may land beside it as external data).

    Args:
        architecture: "sd" or "sdxl" (:attr:`ModelFolder.architecture`): picks the wrappers of SDXL's text encoders
            and UNet (see :func:`~diffusion_trt.compiler.components.component_specs`).

    Raises:
        ExportError: torch.onnx failed; the message names the component and the cause.
    """

    clip_skip = next((int(t.shape[1]) for t in spec.outputs if t.name == "clip_skip_states"), 0)
    vectors = next((int(t.shape[1]) for t in spec.inputs if t.name == "embedding_vectors"), 0)
    module = _wrap(component, models, architecture, clip_skip, vectors, spec)
    args = sample_inputs(spec, precision, {**profile_ranges, **dict(spec.symbols)}, device)
    dynamic_axes = {t.name: t.dynamic_axes() for t in (*spec.inputs, *spec.outputs)}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", category=torch.jit.TracerWarning)
            warnings.simplefilter("ignore", category=DeprecationWarning)
            warnings.simplefilter("ignore", category=UserWarning)  # "Constant folding - Only steps=1 ..."
            torch.onnx.export(
                module,
                args,
                str(out_path),
                input_names=[t.name for t in spec.inputs],
                output_names=[t.name for t in spec.outputs],
                dynamic_axes=dynamic_axes,
                opset_version=opset,
                do_constant_folding=True,
                dynamo=False,
            )
    except Exception as e:
        raise ExportError(f"exporting {component} to ONNX failed: {type(e).__name__}: {e}") from e
    return out_path


def export_ranges(profile: Any) -> dict[str, tuple[int, int, int]]:
    """Symbol ranges of :mod:`components` for a :class:`~diffusion_trt.config.ShapeProfile`."""
    return symbol_ranges(profile)

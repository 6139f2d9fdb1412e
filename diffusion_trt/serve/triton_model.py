"""Triton Python-backend model: the text-to-image loop over the engine models, called through BLS.

``diffusion-trt export-triton`` copies this file verbatim as ``<prefix>pipeline/1/model.py``; on the Triton
host it imports **nothing from diffusion-trt** (the repository must run on a stock Triton server), only
numpy, torch, diffusers (schedulers, ``randn_tensor``) and transformers (``CLIPTokenizer``), which the
Python backend's environment must provide, and the three files export-triton copies beside it into ``prompts/``:
the runtime's ``float_range.py``, ``prompt_syntax.py`` and ``prompt_encoding.py`` (standalone: torch and the standard
library; tests/test_triton_export.py loads them alone), loaded by
path (:func:`prompt_encoding`) so prompts are read exactly as ``EnginePipeline`` reads them. The same request rules
serve ``diffusion-trt serve``, which imports the pure helpers below (:func:`parse_request`, :func:`to_uint8_images`,
:data:`DEFAULT_LIMITS`).

Request (one image per request; Triton batches the engines' calls, not this model's):
    prompt            BYTES [1]   required, UTF-8, at most ``max_prompt_chars`` characters
    negative_prompt   BYTES [1]   optional, default ""
    seed              INT64 [1]   optional, default 0; same image as ``EnginePipeline(seed=seed)``
    steps             INT32 [1]   optional, 1..``max_steps``
    guidance_scale    FP32  [1]   optional, 0..``max_guidance``; CFG when > 1
    height, width     INT32 [1]   optional, multiples of the VAE factor inside the engines' profile
Response:
    image             UINT8 [H, W, 3]

The loop, numbered as in ``diffusion_trt/runtime/denoise.py``, reproduces diffusers' StableDiffusionPipeline
for the same seed and scheduler: 1. encode prompt ([negative; positive], long and weighted prompts in 75-token
chunks as the runtime, :func:`encode_prompts`), 2. prepare latents (``randn_tensor`` from a CPU generator),
3. denoise (scheduler ``scale_model_input`` / ``step``, CFG), 4. decode (``latents / scaling_factor``) and convert
to uint8 as ``round(clamp(x / 2 + 0.5, 0, 1) * 255)``.
"""

from __future__ import annotations

import copy
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

#: Bounds on one request, so no request can exhaust the server's memory or hold it for long. The exported
#: ``pipeline.json`` and ``diffusion-trt serve`` may narrow them; the engines' profile bounds height/width.
DEFAULT_LIMITS: dict[str, float] = {
    "max_prompt_chars": 2000,
    "max_steps": 150,
    "max_guidance": 50.0,
}
#: The SD 1.x/2.x defaults of a request whose ``config`` has none: a copy (this file imports nothing from diffusion-trt)
#: of ``runtime.generation_args.serve_defaults("sd")``, which tests/test_triton_export.py holds it to; ``serve`` and
#: ``export-triton`` write the artifact's own defaults into ``config["defaults"]`` (SDXL: guidance 5.0).
DEFAULTS: dict[str, Any] = {"negative_prompt": "", "seed": 0, "steps": 30, "guidance_scale": 7.5}
#: Request tensors: name -> (numpy dtype kind(s) accepted, Triton type name for messages).
FIELDS: dict[str, tuple[str, str]] = {
    "prompt": ("OSU", "BYTES"),
    "negative_prompt": ("OSU", "BYTES"),
    "seed": ("iu", "INT64"),
    "steps": ("iu", "INT32"),
    "guidance_scale": ("f", "FP32"),
    "height": ("iu", "INT32"),
    "width": ("iu", "INT32"),
}
MAX_SEED = 2**63 - 1
#: The folder beside model.py that export-triton copies the runtime's prompt modules into.
PROMPT_MODULES = "prompts"
#: The package name the copies are loaded under (their relative import of ``.prompt_syntax`` resolves inside it).
_PROMPT_PACKAGE = "_diffusion_trt_prompts"

#: ``infer(model_name, inputs, output_name) -> output``: one engine call (BLS on Triton, anything in tests).
Infer = Callable[[str, Mapping[str, np.ndarray], str], np.ndarray]


class RequestError(ValueError):
    """A request field the pipeline cannot honour; ``field`` names it and the message says the fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field = field


def _scalar(name: str, value: np.ndarray | None) -> Any:
    """The one element of a request tensor, checked against the field's dtype."""
    kinds, triton_type = FIELDS[name]
    array = np.asarray(value)
    if array.dtype.kind not in kinds:
        raise RequestError(name, f"{name} must be {triton_type}, got {array.dtype}; send one {triton_type} value")
    if array.size != 1:
        raise RequestError(name, f"{name} must hold one value, got shape {list(array.shape)}; send shape [1]")
    item = array.reshape(-1)[0]
    if array.dtype.kind in "OS":
        if isinstance(item, bytes | np.bytes_):
            try:
                return bytes(item).decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(
                    name, f"{name} is not valid UTF-8 ({e.reason} at byte {e.start}); send the text as UTF-8"
                ) from None
        if not isinstance(item, str):
            raise RequestError(name, f"{name} must be BYTES, got {type(item).__name__}")
        return item
    if array.dtype.kind == "U":
        return str(item)
    return item.item()


def parse_request(inputs: Mapping[str, np.ndarray | None], config: Mapping[str, Any]) -> dict[str, Any]:
    """Validate one request's tensors into ``{"prompt", "negative_prompt", "seed", "steps", "guidance_scale",
    "height", "width"}``.

    Args:
        inputs: tensor name -> array (absent or ``None`` = not sent). Unknown names are refused.
        config: ``pipeline.json``: ``limits``, ``defaults``, ``profile`` (its opt height/width are the default
            size) and ``model`` (``vae_scale_factor``).

    Raises:
        RequestError: naming the field, the value and the fix.
    """
    unknown = sorted(set(inputs) - set(FIELDS))
    if unknown:
        raise RequestError(unknown[0], f"{unknown[0]} is not an input of this model; send only {', '.join(FIELDS)}")
    limits = {**DEFAULT_LIMITS, **config.get("limits", {})}
    defaults = {**DEFAULTS, **config.get("defaults", {})}
    model, profile = config["model"], config["profile"]
    values = {name: _scalar(name, v) for name, v in inputs.items() if v is not None}
    if "prompt" not in values:
        raise RequestError("prompt", "prompt is required (BYTES, shape [1])")
    out: dict[str, Any] = {}
    for name in ("prompt", "negative_prompt"):
        text = values.get(name, defaults.get(name, ""))
        if len(text) > limits["max_prompt_chars"]:
            raise RequestError(
                name, f"{name} has {len(text)} characters; at most {int(limits['max_prompt_chars'])} are accepted "
                "(the engines read at most the UNet's --max-prompt-chunks x 75 CLIP tokens anyway)"
            )
        heavy = prompt_syntax().overweight(prompt_syntax().parse_prompt(text, "a1111"))
        if heavy is not None:  # the runtime's bound (prompt_syntax.MAX_WEIGHT), checked before any engine runs
            raise RequestError(name, prompt_syntax().overweight_problem(name, heavy))
        out[name] = text
    seed = values.get("seed", defaults["seed"])
    if not 0 <= seed <= MAX_SEED:
        raise RequestError("seed", f"seed={seed} must be in 0..{MAX_SEED}")
    out["seed"] = int(seed)
    steps = values.get("steps", min(defaults["steps"], limits["max_steps"]))
    if not 1 <= steps <= limits["max_steps"]:
        raise RequestError("steps", f"steps={steps} must be in 1..{int(limits['max_steps'])}; use e.g. 30")
    out["steps"] = int(steps)
    guidance = float(values.get("guidance_scale", defaults["guidance_scale"]))
    if not math.isfinite(guidance) or not 0 <= guidance <= limits["max_guidance"]:
        raise RequestError(
            "guidance_scale",
            f"guidance_scale={guidance} must be in 0..{limits['max_guidance']:g}; use e.g. 7.5 (<= 1 disables CFG)",
        )
    out["guidance_scale"] = guidance
    scale = int(model.get("vae_scale_factor", 8))
    for name in ("height", "width"):
        lo, _opt, hi = profile[name]
        value = values.get(name, _opt)  # the profile's opt size, as EnginePipeline
        if value % scale or not lo <= value <= hi:
            raise RequestError(
                name, f"{name}={value} must be a multiple of {scale} in {lo}..{hi} (the engines' profile); "
                f"use {min(max(lo, round(value / scale) * scale), hi)}"
            )
        out[name] = int(value)
    return out


def to_uint8_images(sample: np.ndarray) -> np.ndarray:
    """VAE output [B, 3, H, W] in about [-1, 1] -> uint8 [B, H, W, 3], as diffusers' "pil" postprocess."""
    x = np.clip(np.asarray(sample, dtype=np.float32) * 0.5 + 0.5, 0.0, 1.0)
    return np.round(x.transpose(0, 2, 3, 1) * 255.0).astype(np.uint8)


def _np_dtype(name: str) -> Any:
    return {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}[name]


def prompt_encoding(here: str | Path | None = None) -> Any:
    """The runtime's ``prompt_encoding`` module, loaded by path: from ``prompts/`` beside this file (the copy
    export-triton makes), else from the package's ``runtime/`` folder (this file inside diffusion-trt). Loaded once
    per process, as the package :data:`_PROMPT_PACKAGE`."""
    name = f"{_PROMPT_PACKAGE}.prompt_encoding"
    if name not in sys.modules:
        folder = Path(here if here is not None else __file__).resolve().parent
        folder = folder / PROMPT_MODULES if (folder / PROMPT_MODULES).is_dir() else folder.parent / "runtime"
        package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(_PROMPT_PACKAGE, None,
                                                                                 is_package=True))
        package.__path__ = [str(folder)]
        sys.modules[_PROMPT_PACKAGE] = package
    return importlib.import_module(name)


def prompt_syntax(here: str | Path | None = None) -> Any:
    """The runtime's ``prompt_syntax`` module, loaded by path as :func:`prompt_encoding` loads its sibling."""
    prompt_encoding(here)
    return importlib.import_module(f"{_PROMPT_PACKAGE}.prompt_syntax")


def encode_prompts(texts: list[str], tokenizer: Any, config: Mapping[str, Any], infer: Infer) -> np.ndarray:
    """Text embeddings [T, 77 k, D] of ``texts``, as the runtime's ``encode_prompt_embeds`` makes them: A1111 syntax,
    75-token chunks (at most ``config["max_prompt_chunks"]``, more cut with a warning), one text-encoder pass over
    every chunk (in pieces of ``config["text_encoder_rows"]``), each chunk's states weighted and rescaled, every text
    padded to the largest k with an empty chunk's states."""
    import torch

    pe = prompt_encoding()
    reader = pe.PromptReader(tokenizer, "a1111", int(config.get("max_prompt_chunks", 1)))
    chunks = [reader.chunks(t) for t in texts]
    pe.warn_truncated(texts, chunks, set(texts[:-1]), reader)
    k = max(c.chunks for c in chunks)
    short = any(c.chunks < k for c in chunks)  # padded with the states of an empty chunk, run as the last row
    ids = torch.cat([c.ids for c in chunks] + ([reader.empty_chunk()] if short else [])).numpy()
    states = torch.from_numpy(_text_encoder_rows(ids, config, infer))
    rows, start = [], 0
    for c in chunks:
        z = states[start : start + c.chunks]
        start += c.chunks
        rows.append(pe.pad_chunks(pe.apply_weights(z, c.weights) if c.weighted else z, k, states[-1]).float())
    return torch.stack(rows).numpy()


def _text_encoder_rows(ids: np.ndarray, config: Mapping[str, Any], infer: Infer) -> np.ndarray:
    """``last_hidden_state`` [N, 77, D] of the token rows ``ids`` [N, 77], in calls of the engine's batch range
    (rows repeated up to its minimum); zero ``embedding_vectors`` where the engine takes them (no id < 0)."""
    lo, hi = config.get("text_encoder_rows", [1, len(ids)])
    dtype = config["dtypes"]["text_encoder"].get("embedding_vectors")
    parts = []
    for start in range(0, len(ids), hi):
        piece = ids[start : start + hi]
        rows = len(piece)
        piece = np.concatenate([piece, np.repeat(piece[-1:], max(0, lo - rows), axis=0)])
        feeds = {"input_ids": np.ascontiguousarray(piece)}
        if config.get("embedding_vectors"):  # textual-inversion rows: unused (no id < 0), zeros
            feeds["embedding_vectors"] = np.zeros([len(piece), *config["embedding_vectors"]], _np_dtype(dtype))
        parts.append(np.array(infer(config["models"]["text_encoder"], feeds, "last_hidden_state"))[:rows])
    return np.concatenate(parts)


def text_to_image(params: Mapping[str, Any], config: Mapping[str, Any], tokenizer: Any, scheduler: Any,
                  infer: Infer) -> np.ndarray:
    """Run one request (validated by :func:`parse_request`) through the engine models; uint8 [H, W, 3].

    Args:
        config: ``pipeline.json`` (model facts, engine model names, tensor dtypes).
        tokenizer: a ``CLIPTokenizer``; scheduler: a fresh diffusers scheduler (stateful: one per request).
        infer: calls one engine model.
    """
    import torch
    from diffusers.utils.torch_utils import randn_tensor

    names, dtypes, model = config["models"], config["dtypes"], config["model"]
    do_cfg = params["guidance_scale"] > 1.0
    # 1. encode prompt: [negative; positive] with CFG, long and weighted prompts as the runtime reads them
    texts = [params["negative_prompt"], params["prompt"]] if do_cfg else [params["prompt"]]
    embeds = encode_prompts(texts, tokenizer, config, infer)
    embeds = embeds.astype(_np_dtype(dtypes["unet"]["encoder_hidden_states"]))
    # 2. prepare latents (timesteps first, like diffusers)
    scheduler.set_timesteps(params["steps"], device="cpu")
    timesteps = scheduler.timesteps
    scale = int(model["vae_scale_factor"])
    shape = (1, int(model["unet_in_channels"]), params["height"] // scale, params["width"] // scale)
    sample_dtype = _np_dtype(dtypes["unet"]["sample"])
    torch_dtype = torch.float16 if sample_dtype == np.float16 else torch.float32
    generator = torch.Generator(device="cpu").manual_seed(params["seed"])
    latents = randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=torch_dtype)
    latents = latents * scheduler.init_noise_sigma
    step_params = set(inspect.signature(scheduler.step).parameters)
    extra = {k: v for k, v in (("eta", 0.0), ("generator", generator)) if k in step_params}
    # 3. denoise
    for t in timesteps:
        model_input = torch.cat([latents] * 2) if do_cfg else latents
        model_input = scheduler.scale_model_input(model_input, t)
        feeds = {
            "sample": model_input.numpy().astype(sample_dtype),
            "timestep": np.full((embeds.shape[0],), float(t), dtype=np.float32),
            "encoder_hidden_states": embeds,
        }
        noise = torch.from_numpy(np.array(infer(names["unet"], feeds, "noise_pred"))).to(torch_dtype)
        if do_cfg:
            uncond, text = noise.chunk(2)
            noise = uncond + params["guidance_scale"] * (text - uncond)
        latents = scheduler.step(noise, t, latents, **extra, return_dict=False)[0]
    # 4. decode
    latent_dtype = _np_dtype(dtypes["vae_decoder"]["latent_sample"])
    scaled = (latents / float(model["vae_scaling_factor"])).numpy().astype(latent_dtype)
    image = infer(names["vae_decoder"], {"latent_sample": scaled}, "sample")
    return to_uint8_images(image)[0]


def load_pipeline_assets(model_dir: str | Path) -> tuple[dict[str, Any], Any, Any]:
    """``(pipeline.json, CLIPTokenizer, scheduler template)`` from this model's version folder."""
    import diffusers
    from transformers import CLIPTokenizer

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "pipeline.json").read_text(encoding="utf-8"))
    tokenizer = CLIPTokenizer.from_pretrained(str(model_dir / "tokenizer"), local_files_only=True)
    sched_cfg = json.loads((model_dir / "scheduler_config.json").read_text(encoding="utf-8"))
    scheduler_cls = getattr(diffusers, sched_cfg.get("_class_name", "PNDMScheduler"))
    return config, tokenizer, scheduler_cls.from_config(sched_cfg)


def _client_error(pb_utils: Any, error: RequestError) -> Any:
    """A ``TritonError`` with code INVALID_ARG (Triton answers HTTP 400 / gRPC INVALID_ARGUMENT); a Python backend
    older than codes (before 23.09) gets the default code."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None)
    message = " ".join(str(error).split())
    return pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)


class TritonPythonModel:
    """The Triton Python-backend entry points (``initialize``, ``execute``, ``finalize``)."""

    def initialize(self, args: dict[str, str]) -> None:
        model_dir = Path(args["model_repository"]) / args["model_version"]
        self.config, self.tokenizer, self.scheduler = load_pipeline_assets(model_dir)

    def _infer(self, model_name: str, inputs: Mapping[str, np.ndarray], output_name: str) -> np.ndarray:
        import triton_python_backend_utils as pb_utils

        request = pb_utils.InferenceRequest(
            model_name=model_name,
            requested_output_names=[output_name],
            inputs=[pb_utils.Tensor(name, np.ascontiguousarray(value)) for name, value in inputs.items()],
        )
        response = request.exec()
        if response.has_error():
            raise RuntimeError(f"{model_name}: {response.error().message()}")
        return pb_utils.get_output_tensor_by_name(response, output_name).as_numpy()

    def execute(self, requests: list[Any]) -> list[Any]:
        import triton_python_backend_utils as pb_utils

        responses = []
        for request in requests:
            try:
                inputs = {}
                for name in FIELDS:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = None if tensor is None else tensor.as_numpy()
                params = parse_request(inputs, self.config)
                scheduler = copy.deepcopy(self.scheduler)  # stateful: a fresh one per request, the config read once
                image = text_to_image(params, self.config, self.tokenizer, scheduler, self._infer)
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("image", image)]))
            except RequestError as e:  # the client's error: INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT), one line
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=_client_error(pb_utils, e)))
            except RuntimeError as e:  # an engine model's call failed (its one-line error): INTERNAL (500)
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))))
        return responses

    def finalize(self) -> None:
        self.tokenizer = None

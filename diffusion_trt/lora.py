"""LoRA files: ``FILE[:scale]`` arguments, file checks, and merging into the torch modules before export.

``diffusion-trt compile MODEL --lora FILE[:scale]`` (repeatable) merges each LoRA into the exported weights,
with diffusers' own code, one after another in command-line order (:func:`merge_loras`):

1. ``pipeline.load_lora_weights(FILE, adapter_name=...)`` (``diffusers/loaders/lora_pipeline.py``,
   ``StableDiffusionLoraLoaderMixin``; ``StableDiffusionXLLoraLoaderMixin`` for SDXL): every format diffusers reads
   (diffusers/peft keys, kohya ``lora_unet_*``/``lora_te_*`` with ``.alpha``...), converted by diffusers;
2. ``pipeline.fuse_lora(lora_scale=scale, adapter_names=[...])``: peft's merge, ``W += scale * (alpha / r) * B @ A``
   for every layer the LoRA targets (UNet and text encoder(s));
3. ``pipeline.unload_lora_weights()``: the plain modules again, fused weights kept.

The manifest records every merged LoRA (``"loras": [{"file", "sha256", "scale", "layers"}]``), so that a LoRA
is never applied twice (``EnginePipeline.load_lora`` refuses a file merged already).

This module imports torch, diffusers and peft only inside the functions that need them; the parsing and file
checks are used by the runtime too.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import LoraError

logger = logging.getLogger(__name__)

LORA_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class LoraFile:
    """A checked LoRA file.

    Attributes:
        path: the file.
        scale: the LoRA's weight (diffusers' ``lora_scale``); 0 merges nothing.
        sha256: hex digest of the file.
    """

    path: Path
    scale: float
    sha256: str

    def record(self, layers: dict[str, int]) -> dict[str, Any]:
        """The manifest entry: file name, sha256, scale and the layers merged per component."""
        return {"file": self.path.name, "sha256": self.sha256, "scale": self.scale, "layers": layers}


def parse_lora_arg(text: str) -> tuple[str, float]:
    """Split a ``FILE[:scale]`` argument into (file, scale); no ``:scale`` means 1.0.

    Only the text after the last ``:`` is a scale, and only when the whole argument does not end in
    ``.safetensors`` (so ``C:/loras/a.safetensors`` is a path).

    Raises:
        LoraError: a scale that is not a finite number (``a.safetensors:strong``, ``a.safetensors:``, ``:nan``).
    """
    if text.lower().endswith(LORA_SUFFIX) or ":" not in text:
        return text, 1.0
    path, _, scale_text = text.rpartition(":")
    try:
        scale = float(scale_text)
    except ValueError:
        scale = math.nan
    if not path or not math.isfinite(scale):
        raise LoraError(
            f"--lora {text!r}: {scale_text!r} is not a scale; use FILE or FILE:SCALE with a finite number, "
            f"e.g. {path or 'style.safetensors'}:0.8"
        )
    return path, scale


def check_scale(scale: Any) -> float:
    """``scale`` as a finite float.

    Raises:
        LoraError: not a finite number.
    """
    number = not isinstance(scale, bool) and isinstance(scale, int | float)
    if not number or not math.isfinite(scale):
        raise LoraError(f"LoRA scale={scale!r} must be a finite number, e.g. 0.8 (0 = the base model's output)")
    return float(scale)


def check_lora_file(path: str | Path, scale: Any = 1.0) -> LoraFile:
    """Check that ``path`` is a readable safetensors file holding LoRA tensors; hash it.

    Raises:
        LoraError: missing, a folder, not ``.safetensors`` (pickled LoRAs run code when loaded), not a valid
            safetensors file, or no tensor with ``lora`` in its name; a bad ``scale``.
    """
    from .artifacts import sha256_file

    scale = check_scale(scale)
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
    return LoraFile(p, scale, sha256_file(p))


def safetensors_keys(path: Path) -> list[str]:
    """Tensor names of a safetensors file (reads the header only).

    Raises:
        LoraError: not a valid safetensors file.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            return list(f.keys())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError / OSError / ValueError
        raise LoraError(f"LoRA file {path} is not a valid safetensors file ({type(e).__name__}: {e})") from None


def check_lora_files(specs: Any) -> list[LoraFile]:
    """Check every ``(path, scale)`` of ``CompileConfig.loras`` before any work; refuse a file given twice.

    Raises:
        LoraError: see :func:`check_lora_file`; the same file (by sha256) twice.
    """
    files = [check_lora_file(path, scale) for path, scale in specs]
    seen: dict[str, Path] = {}
    for f in files:
        if f.sha256 in seen:
            raise LoraError(
                f"--lora {f.path} is the same file as {seen[f.sha256]} (sha256 {f.sha256[:12]}); give each LoRA once "
                "with the sum of the scales"
            )
        seen[f.sha256] = f.path
    return files


def _require_peft() -> None:
    from diffusers.utils import USE_PEFT_BACKEND

    if not USE_PEFT_BACKEND:
        raise LoraError(
            "merging LoRAs needs diffusers' PEFT backend (peft >= 0.17 and transformers > 4.45): "
            "pip install 'diffusion-trt[lora]' (or pip install peft)"
        )


def _lora_host(models: dict[str, Any]) -> Any:
    """A diffusers pipeline object around the loaded modules (its LoRA mixin does the loading and fusing)."""
    import diffusers

    if models.get("text_encoder_2") is not None:
        return diffusers.StableDiffusionXLPipeline(
            vae=models["vae"], text_encoder=models["text_encoder"], text_encoder_2=models["text_encoder_2"],
            tokenizer=None, tokenizer_2=None, unet=models["unet"], scheduler=None,
        )
    return diffusers.StableDiffusionPipeline(
        vae=models.get("vae"), text_encoder=models.get("text_encoder"), tokenizer=None, unet=models["unet"],
        scheduler=None, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def lora_layer_count(module: Any, adapter: str) -> int:
    """Layers of ``module`` that carry the peft adapter ``adapter`` (after ``load_lora_weights``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sum(1 for m in module.modules() if isinstance(m, BaseTunerLayer) and adapter in getattr(m, "lora_A", {}))


def merge_loras(models: dict[str, Any], loras: list[LoraFile]) -> list[dict[str, Any]]:
    """Merge ``loras`` into the torch modules in ``models`` (in place), one after another; see the module docstring.

    Args:
        models: ``unet``, ``text_encoder``, ``vae`` (and ``text_encoder_2`` for SDXL) torch modules, fp32.
        loras: checked files (:func:`check_lora_files`).

    Returns:
        The manifest records (:meth:`LoraFile.record`), in order.

    Raises:
        LoraError: peft is missing; diffusers cannot read the file (its message quoted); the file's keys match no
            layer of the UNet or text encoder(s) (a LoRA for another architecture); or fewer layers took the LoRA
            than it has (partly another architecture).
    """
    if not loras:
        return []
    _require_peft()
    host = _lora_host(models)
    components = [c for c in ("unet", "text_encoder", "text_encoder_2") if models.get(c) is not None]
    records = []
    for i, lora in enumerate(loras):
        adapter = f"diffusion_trt_lora_{i}"
        state, _ = type(host).lora_state_dict(str(lora.path))
        expected = sum(1 for k in state if _is_down_key(k))
        try:
            with _diffusers_logs_at_debug():
                host.load_lora_weights(str(lora.path), adapter_name=adapter)
        except (ValueError, KeyError, RuntimeError, TypeError) as e:
            logger.debug("load_lora_weights(%s) failed:\n%s", lora.path, e)
            raise LoraError(
                f"LoRA file {lora.path}: diffusers could not load it into this model ({_summary(e)}); was it made for "
                "another architecture (SD 1.x / 2.x / SDXL)?"
            ) from e
        layers = {c: lora_layer_count(models[c], adapter) for c in components}
        if not any(layers.values()):
            raise LoraError(
                f"LoRA file {lora.path}: none of its {expected} LoRA layers matches a layer of this model's "
                f"{' or '.join(components)} (keys like {next(iter(state), '?')!r}); it was made for another "
                "architecture"
            )
        if expected and sum(layers.values()) < expected:
            raise LoraError(
                f"LoRA file {lora.path}: only {sum(layers.values())} of its {expected} LoRA layers match layers of "
                "this model; it was made for another architecture (merging part of it would give neither model)"
            )
        host.fuse_lora(components=[c for c, n in layers.items() if n], lora_scale=lora.scale, adapter_names=[adapter])
        host.unload_lora_weights()
        _check_finite(models, [c for c, n in layers.items() if n], lora)
        logger.info("merged LoRA %s (scale %g): %s", lora.path.name, lora.scale,
                    ", ".join(f"{c} {n} layers" for c, n in layers.items() if n))
        records.append(lora.record({c: n for c, n in layers.items() if n}))
    return records


def _check_finite(models: dict[str, Any], components: list[str], lora: LoraFile) -> None:
    """Refuse a merge that left NaN/Inf in a weight (a broken file, or a scale that overflows fp32): the engines
    would only ever give black images.

    Raises:
        LoraError: naming the first non-finite parameter.
    """
    import torch

    for component in components:
        for name, param in models[component].named_parameters():
            if not bool(torch.isfinite(param).all()):
                raise LoraError(
                    f"LoRA file {lora.path} at scale {lora.scale:g} leaves NaN/Inf in {component}.{name}: the file "
                    "holds non-finite values or the scale is too large; check the file, or use a smaller scale"
                )


@contextlib.contextmanager
def _diffusers_logs_at_debug() -> Iterator[None]:
    """Silence diffusers' own log lines (it logs the error it then raises, and warnings per key prefix) unless this
    module logs at DEBUG (``-v``): the error is reported once, by the caller."""
    diffusers_logger = logging.getLogger("diffusers")
    level = diffusers_logger.level
    if not logger.isEnabledFor(logging.DEBUG):
        diffusers_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        diffusers_logger.setLevel(level)


def _summary(e: BaseException, lines: int = 2, chars: int = 400) -> str:
    """The first ``lines`` non-empty lines of an error message on one line, at most ``chars`` long (for a LoRA of
    another architecture, peft lists every mismatched tensor or missing module: hundreds of lines or names)."""
    text = [line.strip() for line in str(e).splitlines() if line.strip()]
    head = " ".join(text[:lines])
    if len(text) <= lines and len(head) <= chars:
        return head
    return f"{head[:chars]} ... (cut; the whole message is logged at DEBUG: diffusion-trt -v)"


def _is_down_key(key: str) -> bool:
    """One key per LoRA layer in diffusers' converted state dicts: the down (A) matrix."""
    return key.endswith(("lora_A.weight", "lora.down.weight", "lora_down.weight", "lora_linear_layer.down.weight"))


# -- TensorRT refit: swapping LoRAs in refittable engines (compile --backend tensorrt --refittable) --------------
#
# At compile time, refit_map() ties every Linear / Conv2d weight of the UNet and text encoder(s) (the layers a LoRA
# changes) to the ONNX initializer TensorRT built it from, by value: the same tensor, its transpose (Linear exported
# as MatMul), in the initializer's dtype (fp16 after convert_fp16). EnginePipeline.load_lora then loads the base
# weights from the model folder the artifact was compiled from (checked against the map's sha256 of every weight),
# merges the LoRA with diffusers exactly as compile --lora does (merge_loras), and refits the initializers whose
# value changed, plus those the previous LoRA changed (back to base): always base + this LoRA, never on top.

#: Components whose weights a LoRA changes, in the order diffusers loads them.
REFIT_COMPONENTS: tuple[str, ...] = ("unet", "text_encoder", "text_encoder_2")
REFIT_MAP_FORMAT = 1


def _array_key(arr: Any) -> str:
    """sha256 over dtype, shape and bytes: equal keys = equal tensors."""
    import hashlib

    import numpy as np

    a = np.ascontiguousarray(arr)
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def _as_initializer(weight: Any, transpose: bool, dtype: str) -> Any:
    """A torch weight as the ONNX initializer holds it (numpy, transposed for MatMul, in the graph's dtype)."""
    import numpy as np
    import torch

    w = weight.detach().to("cpu", dtype=torch.float32)
    w = w.T if transpose else w
    return np.ascontiguousarray(w.numpy().astype(np.dtype(dtype)))


def refit_map(model: Any, module: Any) -> dict[str, Any]:
    """Which ONNX initializer of ``model`` holds each Linear / Conv2d weight of ``module`` (see above).

    Args:
        model: the optimized ``onnx.ModelProto`` TensorRT builds from (weights in memory).
        module: the torch module it was exported from (``unet``, ``text_encoder``...).

    Returns:
        ``{"format": 1, "weights": {"<module path>.weight": {"initializer", "transpose", "dtype", "sha256"}},
        "unmapped": [weights found in no initializer, or in one shared with another weight]}``.
    """
    import torch
    from onnx import TensorProto, numpy_helper

    dtypes = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16"}
    by_key: dict[str, str] = {}
    graph_dtypes = set()
    for init in model.graph.initializer:
        if init.data_type in dtypes and len(init.dims) >= 2:
            by_key.setdefault(_array_key(numpy_helper.to_array(init)), init.name)
            graph_dtypes.add(dtypes[init.data_type])
    weights: dict[str, dict[str, Any]] = {}
    unmapped: list[str] = []
    claimed: dict[str, str] = {}
    for name, m in module.named_modules():
        if not isinstance(m, torch.nn.Linear | torch.nn.Conv2d):
            continue
        wname = f"{name}.weight"
        found = None
        for dtype in sorted(graph_dtypes):
            for transpose in (False, True) if m.weight.ndim == 2 else (False,):
                key = _array_key(_as_initializer(m.weight, transpose, dtype))
                if key in by_key:
                    found = {"initializer": by_key[key], "transpose": transpose, "dtype": dtype, "sha256": key}
                    break
            if found:
                break
        if found is None:
            unmapped.append(wname)
        elif found["initializer"] in claimed:  # two weights with equal values: refitting one would change both
            unmapped += [wname, claimed[found["initializer"]]]
            weights.pop(claimed[found["initializer"]], None)
        else:
            claimed[found["initializer"]] = wname
            weights[wname] = found
    return {"format": REFIT_MAP_FORMAT, "weights": weights, "unmapped": sorted(set(unmapped))}


#: Weight files that are pickles: loading one runs arbitrary code (compile refuses them without --trust-pickle).
PICKLE_SUFFIXES = (".bin", ".ckpt", ".pt", ".pth", ".pkl")


def _weights_are_safetensors(folder: Path, trust_pickle: bool) -> bool:
    """Whether ``folder`` (a component of a diffusers folder) is loaded from safetensors: True when it has any; else
    its weights are pickles, allowed only with ``trust_pickle`` (the rule of ``compile --trust-pickle``).

    Raises:
        LoraError: pickle weights without ``trust_pickle``, naming the file and the fix.
    """
    files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    if any(p.suffix == ".safetensors" for p in files):
        return True
    pickles = [p for p in files if p.suffix in PICKLE_SUFFIXES]
    if pickles and not trust_pickle:
        raise LoraError(
            f"{pickles[0]} is a pickle file and loading it runs arbitrary code; convert the model folder to "
            "safetensors (save_pretrained(..., safe_serialization=True)) or pass trust_pickle=True "
            "(load_lora(..., trust_pickle=True)) if you trust its source"
        )
    return not pickles  # no weights at all: let from_pretrained name what is missing


def load_base_modules(model_dir: Path, components: Any, *, trust_pickle: bool = False) -> dict[str, Any]:
    """The UNet and text encoder(s) of a diffusers folder, fp32 on the CPU (what compile exported).

    Args:
        model_dir: the diffusers folder.
        components: "unet", "text_encoder", "text_encoder_2".
        trust_pickle: allow ``.bin``/``.ckpt`` weights where a component has no safetensors (unpickling runs
            arbitrary code), as ``compile --trust-pickle``.

    Raises:
        LoraError: the folder or a component cannot be loaded, or its weights are pickles and ``trust_pickle`` is
            false.
    """
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    classes = {"unet": UNet2DConditionModel, "text_encoder": CLIPTextModel,
               "text_encoder_2": CLIPTextModelWithProjection}
    models: dict[str, Any] = {}
    for comp in components:
        use_st = _weights_are_safetensors(Path(model_dir) / comp, trust_pickle)
        try:
            if comp == "unet":
                m = UNet2DConditionModel.from_pretrained(model_dir, subfolder="unet", local_files_only=True,
                                                         use_safetensors=use_st)
            else:
                m = classes[comp].from_pretrained(Path(model_dir) / comp, local_files_only=True,
                                                  use_safetensors=use_st)
        except (OSError, ValueError) as e:
            raise LoraError(
                f"cannot load {comp}/ from the model folder {model_dir} ({e}); load_lora needs the diffusers folder "
                "the artifact was compiled from: pass model_dir="
            ) from e
        models[comp] = m.eval()
    models["vae"] = None
    return models


def refit_weights(
    maps: dict[str, dict[str, Any]],
    model_dir: Path,
    lora: LoraFile,
    previous: dict[str, dict[str, Any]] | None = None,
    *,
    trust_pickle: bool = False,
) -> dict[str, dict[str, Any]]:
    """The initializer values that turn the refittable engines into base + ``lora`` (see above).

    Args:
        maps: component -> its refit map (:func:`refit_map`).
        model_dir: the diffusers folder the artifact was compiled from.
        lora: the checked LoRA file and scale.
        previous: what the last call returned (its initializers go back to base if this LoRA leaves them).
        trust_pickle: allow pickle weights in ``model_dir`` (see :func:`load_base_modules`).

    Returns:
        component -> {initializer name: numpy array in the initializer's dtype and layout}.

    Raises:
        LoraError: the folder's weights are not the artifact's (a weight's sha256 differs from the map's), are
            pickles without ``trust_pickle``, or merging failed (see :func:`merge_loras`).
    """
    import torch

    models = load_base_modules(model_dir, list(maps), trust_pickle=trust_pickle)
    for comp, rmap in maps.items():
        params = dict(models[comp].named_parameters())
        for wname, e in rmap["weights"].items():
            if wname not in params or _array_key(_as_initializer(params[wname], e["transpose"], e["dtype"])) != e[
                "sha256"
            ]:
                raise LoraError(
                    f"the model folder {model_dir} is not the one the artifact was compiled from: its {comp} weight "
                    f"{wname} differs from the engine's; pass model_dir= the original diffusers folder"
                )
    unmapped = {(c, w): p.detach().clone() for c, rmap in maps.items()
                for w, p in models[c].named_parameters() if w in set(rmap.get("unmapped", []))}
    with torch.no_grad():
        merge_loras(models, [lora])
    for (comp, wname), base in unmapped.items():
        if not torch.equal(dict(models[comp].named_parameters())[wname], base):
            raise LoraError(
                f"LoRA file {lora.path} changes the {comp} weight {wname}, which the engine cannot refit (the graph "
                "passes padded it, or it shares its values with another weight); merge this LoRA at compile time "
                "with --lora instead"
            )
    out: dict[str, dict[str, Any]] = {}
    for comp, rmap in maps.items():
        params = dict(models[comp].named_parameters())
        before = set((previous or {}).get(comp, {}))
        weights = {}
        for wname, e in rmap["weights"].items():
            arr = _as_initializer(params[wname], e["transpose"], e["dtype"])
            if e["initializer"] in before or _array_key(arr) != e["sha256"]:
                weights[e["initializer"]] = arr
        out[comp] = weights
    return out


def onnx_initializers(path: Path, names: Any) -> dict[str, Any]:
    """Initializers ``names`` of the ONNX file ``path`` as numpy arrays (external data read for those only)."""
    import onnx
    from onnx import numpy_helper

    wanted = set(names)
    model = onnx.load(str(path), load_external_data=False)
    return {
        t.name: numpy_helper.to_array(t, base_dir=str(path.parent)) for t in model.graph.initializer if t.name in wanted
    }

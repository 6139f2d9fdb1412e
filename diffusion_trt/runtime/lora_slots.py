"""LoRA per request on ONNX Runtime artifacts: weights as graph inputs, ``W + sum(scale * B @ A)`` on the device.

An artifact compiled with ``--backend ort --refittable`` has the Linear and 1x1 Conv weights of its UNet and text
encoder as graph inputs (with ``--refit-convs`` also the spatial Conv weights;
:mod:`diffusion_trt.compiler.lora_slots`), their base values in ``<component>/lora_base.safetensors`` and, in
``refit_map.json``, which torch weight each input holds (name, transpose, dtype). A :class:`WeightSlots` per
component owns the tensors the engine binds on every run (ORT IO binding by pointer; numpy views on the plain CPU
path); ``unet_controlnet`` (``--refittable --controlnet``) shares the plain ``unet``'s, its inputs named as
``unet``'s and its manifest entry naming ``unet/lora_base.safetensors`` (:func:`load_slots`), and a LoRA's ``unet.``
layers apply to both (:attr:`WeightSlots.source`):

* no LoRA: the base tensors are bound; nothing is computed, nothing copied (a pointer per weight per run);
* ``load_lora``: for every weight the LoRAs target, ``base + sum_i(scale_i * alpha_i / r_i * B_i @ A_i)`` is computed
  with torch on the engine's device (:func:`~.lora_deltas.lora_deltas`, the same arithmetic as diffusers + peft's
  ``fuse_lora``) and written into the bound tensors in place on CUDA (a captured CUDA graph replays the same
  addresses, so no re-capture), or bound instead of the base on the CPU; every weight is computed and checked
  before any bound tensor changes, so a refused LoRA leaves the previous state whole;
* ``unload_lora``: the base values again (copied back on CUDA, re-bound on the CPU): bit for bit the base image;
* a LoRA layer on a weight the refit map knows but the artifact keeps constant (a 3x3 Conv of a default
  ``--refittable`` artifact: LoCon / LyCORIS conv layers) is refused, naming the layer and the fix
  (``--refittable --refit-convs``, or ``compile --lora``), before anything is bound;
* a LoRA layer on a weight no output of the graph reads (the refit map's ``dead``: SDXL's last ``text_encoder``
  layer, whose output SDXL never uses; :mod:`diffusion_trt.compiler.dead_weights`) is ignored with one INFO line: it
  changes nothing (the merged compile gives the same image), so it is neither bound nor counted as unmatched.

Why the spatial Conv weights are constants by default: ORT's NHWC Convs (``prefer_nhwc=1``, the UNet's default on
CUDA) transpose constant weights only; with every Conv weight an input the SD-1.5 UNet failed on the H200
(onnxruntime-gpu 1.31.1, 2026-12-02) with "Input channels C is not equal to kernel channels * group. C: 320 kernel
channels: 3", so such an engine runs NCHW (slower). With Linear and 1x1 weights only (the 1x1 Convs compiled as
MatMuls) the engine keeps NHWC: the usual A1111 / kohya LoRA (attention, proj, ff, text encoder) costs nothing per
step. The manifest's ``spatial_conv_inputs`` says which kind an artifact is
(``runtime.pipeline.cuda_layout_options`` reads it).

Why this mechanism (issue 26), and not the alternatives:

* ORT's LoRA adapters (``onnxruntime.AdapterFormat`` + ``RunOptions.add_active_adapter``) feed low-rank branches
  per run: ORT documents that they do not apply to runs with IO binding, which the CUDA path always uses, and the
  branches need ``B @ (A @ x)`` nodes in the graph at a fixed rank (a compile-time rank limit, extra kernels per
  layer per step: the step with a LoRA could not be 1.0x the base step).
* ``SessionOptions.add_initializer`` overrides need a new session per LoRA: for a UNet, seconds of graph
  optimisation and twice the memory while it builds (the 200 ms switch goal is out of reach).
* Initializers that are also graph inputs (ONNX's overridable initializers) would keep the base inside the session,
  but ORT's IO binding refuses to bind them (``Failed to find NodeArg``).

With weights as inputs a step with a LoRA runs the very kernels the base step runs, on other weight values
(same cost); a switch is one delta GEMM per targeted layer on the device plus an in-place copy; there is no rank
limit (any rank merges into a full weight). The price: ORT cannot constant-fold or pre-pack these weights (on the
CPU provider MatMul prepacking of constant weights is lost; on CUDA no pass of ours depends on them being
constants), and on CUDA the base values stay on the host (pinned) besides the bound device copy.
``benchmarks/lora_switch.py`` measures switch time and step cost on a GPU.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..artifact.manifest import lora_source
from ..errors import ArtifactError, LoraError
from ..lora import LoraFile, refuse_repeats
from .lora_deltas import lora_deltas

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Slot:
    """One weight input: the torch weight it holds and how (``transpose``: Linear exported as MatMul, ``[in, out]``;
    ``pointwise``: a 1x1 Conv ``[O, C, 1, 1]`` held as the ``[C, O]`` matrix of a channels-last MatMul,
    ``W[:, :, 0, 0].T``: :mod:`diffusion_trt.compiler.pointwise_convs`). Both false when the map lacks them (maps
    written before ``pointwise`` existed bound a 1x1 Conv's weight as ``[O, C, 1, 1]``: still read so)."""

    torch_name: str
    input_name: str
    transpose: bool
    pointwise: bool = False

    def torch_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The torch weight's shape, from the bound input's."""
        if not self.transpose:
            return input_shape
        return (*input_shape[::-1], *((1, 1) if self.pointwise else ()))


def _map_slots(refit_map: Mapping[str, Any]) -> list[_Slot]:
    return [_Slot(w, e["initializer"], bool(e.get("transpose", False)), bool(e.get("pointwise", False)))
            for w, e in refit_map["weights"].items()]


def refit_signature(refit_map: Mapping[str, Any]) -> tuple[frozenset[_Slot], frozenset[str]]:
    """What binding a set of weight inputs by ``refit_map`` means: each torch weight's input name and layout, and
    the weights no output reads. Two components may share a :class:`WeightSlots` only when theirs are equal."""
    return frozenset(_map_slots(refit_map)), frozenset(refit_map.get("dead", ()))


class WeightSlots(Mapping[str, torch.Tensor]):
    """The weight inputs of one component: input name -> the tensor its engine binds (the live mapping the engine
    reads at every run; see ``OrtEngine(weight_inputs=...)``).

    Args:
        component: "unet", "text_encoder"... (the first component binding these tensors: ``unet_controlnet`` binds
            ``unet``'s when its manifest entry names ``unet``'s ``lora_base.safetensors``, :func:`load_slots`).
        refit_map: the component's ``refit_map.json`` (``{"weights": {torch name: {"initializer", "transpose",
            "dtype", ...}}}``).
        base: input name -> base value (CPU tensor, the graph's dtype and layout), from ``lora_base.safetensors``.
        device: where the engine runs; on CUDA the bound tensors are device copies and ``base`` is pinned.
        spatial_conv_inputs: the manifest's fact (:attr:`~diffusion_trt.artifact.manifest.Component.
            spatial_conv_inputs`): every weight of the map is an input. False: the map's weights that ``base`` lacks
            are the spatial Conv weights the artifact keeps constant (:attr:`constants`).
        source: the model whose layers a LoRA file names for these weights (its keys' prefix: ``unet`` for
            ``unet_controlnet``); ``None`` = :func:`~diffusion_trt.artifact.manifest.lora_source` of ``component``.

    Raises:
        LoraError: ``spatial_conv_inputs`` and the map names an input ``base`` lacks (an artifact made by another
            version: recompile).
    """

    def __init__(self, component: str, refit_map: Mapping[str, Any], base: Mapping[str, torch.Tensor],
                 device: torch.device, spatial_conv_inputs: bool = True, source: str | None = None) -> None:
        self.component = component
        #: the LoRA keys' component these weights are (``unet``, ``text_encoder``, ``text_encoder_2``)
        self.source = source or lora_source(component) or component
        self.device = device
        slots = _map_slots(refit_map)
        missing = [s for s in slots if s.input_name not in base]
        if missing and spatial_conv_inputs:
            raise LoraError(f"{component}: lora_base.safetensors lacks the weight input {missing[0].input_name!r}; "
                            "recompile")
        #: torch weight names the refit map knows but the engine keeps constant (a LoRA may not change them)
        self.constants = frozenset(s.torch_name for s in missing)
        #: torch weight names no output reads (the map's ``dead``; absent from maps written before it: none)
        self.dead = frozenset(refit_map.get("dead", ()))
        self._slots = [s for s in slots if s.input_name in base]
        #: what a refit map must say for another component to bind these very tensors (:func:`load_slots`;
        #: :func:`refit_signature` of ``refit_map``)
        self.signature = (frozenset(slots), self.dead)
        cuda = device.type == "cuda"
        self._base = {s.input_name: base[s.input_name].pin_memory() if cuda else base[s.input_name]
                      for s in self._slots}
        self._live = {n: t.to(device) if cuda else t for n, t in self._base.items()}
        self._changed: set[str] = set()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._live[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def torch_shapes(self) -> dict[str, torch.Tensor]:
        """torch weight name -> an empty tensor of its torch shape on the device (what :func:`lora_deltas` reads)."""
        out = {}
        for s in self._slots:
            out[s.torch_name] = torch.empty(s.torch_shape(tuple(self._base[s.input_name].shape)), device="meta")
        return out

    def merged(self, deltas: Sequence[Mapping[str, torch.Tensor]], what: str) -> dict[str, torch.Tensor]:
        """input name -> ``base + sum(deltas)`` in the input's dtype and layout, on the device, for every weight a
        delta touches; nothing bound changes. Each delta has the torch weight's shape (fp32; ``[O, C, 1, 1]`` for a 1x1
        Conv, ``up @ down`` as peft's ``get_delta_weight``); a ``transpose`` slot adds ``delta.flatten(1).T``
        (``[in, out]``; a ``pointwise`` one ``[C, O]``, the 1x1 dims squeezed), summed in fp32 and cast once.

        Raises:
            LoraError: NaN/Inf in a merged weight (``what`` names the LoRAs in the message).
        """
        out, finite = {}, []
        for s in self._slots:
            parts = [d[s.torch_name] for d in deltas if s.torch_name in d]
            if not parts:
                continue
            base = self._base[s.input_name].to(self.device, torch.float32, non_blocking=True)
            total = torch.stack([p.to(self.device) for p in parts]).sum(0)
            value = (base + (total.flatten(1).T if s.transpose else total)).to(self._base[s.input_name].dtype)
            finite.append((s, torch.isfinite(value).all()))  # in the engine's dtype: fp16 overflows at 65504
            out[s.input_name] = value.contiguous()
        if finite and not bool(torch.stack([ok for _, ok in finite]).all()):  # one device sync for all the weights
            bad = next(s for s, ok in finite if not bool(ok))
            raise LoraError(f"{what} leaves NaN/Inf in {self.component}.{bad.torch_name} (in its "
                            f"{str(out[bad.input_name].dtype).removeprefix('torch.')} weights): the file holds "
                            "non-finite values or the scale is too large; check the file, or use a smaller scale")
        return out

    def bind(self, values: Mapping[str, torch.Tensor]) -> None:
        """Bind ``values`` (from :meth:`merged`) and the base everywhere else (in place on CUDA, between two device
        syncs: runs queued on the pipeline's stream still read the old values, the next run reads the new ones)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        for name in self._changed - set(values):
            self._set(name, self._base[name])
        for name, value in values.items():
            self._set(name, value)
        self._changed = set(values)
        if cuda:
            torch.cuda.synchronize(self.device)

    def _set(self, name: str, value: torch.Tensor) -> None:
        if self.device.type == "cuda":
            self._live[name].copy_(value, non_blocking=True)
        else:
            self._live[name] = value


def load_slots(reader: Any, device: str, device_id: int = 0) -> dict[str, WeightSlots]:
    """The :class:`WeightSlots` of every component with ``weight_inputs`` in the manifest (read through ``reader``,
    an :class:`~diffusion_trt.artifact.reader.ArtifactReader`: hashed bytes); empty for any other artifact.

    Components whose entries name the same ``weight_inputs`` file share one :class:`WeightSlots` (the same bound
    tensors): ``unet_controlnet`` compiled with ``--refittable`` binds ``unet``'s, its weight inputs renamed to
    ``unet``'s at compile time (:func:`~diffusion_trt.compiler.lora_slots.write_weight_inputs`), so a LoRA is merged
    once for both UNets and the base is held once.

    Raises:
        ArtifactError: a component names another's ``weight_inputs`` but its refit map ties other inputs or layouts
            to them (a hand-made or mixed artifact: recompile).
        LoraError: as :class:`WeightSlots`.
    """
    import json

    from safetensors.torch import load as load_safetensors

    dev = torch.device("cuda", device_id) if device == "cuda" else torch.device("cpu")
    out: dict[str, WeightSlots] = {}
    by_file: dict[str, WeightSlots] = {}
    for name, entry in reader.manifest.components.items():
        if entry.weight_inputs is None:
            continue
        rmap = json.loads(bytes(reader.read(str(entry.refit_map))))
        shared = by_file.get(entry.weight_inputs)
        if shared is not None:
            if refit_signature(rmap) != shared.signature or (lora_source(name) or name) != shared.source:
                raise ArtifactError(
                    f"{name} binds {entry.weight_inputs} ({shared.component}'s base weights) but its refit map "
                    f"{entry.refit_map} ties other weights or layouts to them; the artifact is damaged or mixed: "
                    "recompile it")
            out[name] = shared
            continue
        # safetensors takes bytes only: a file of CHUNK_BYTES or more arrives as a memoryview (one copy here)
        out[name] = by_file[entry.weight_inputs] = WeightSlots(
            name, rmap, load_safetensors(bytes(reader.read(entry.weight_inputs))), dev, entry.spatial_conv_inputs)
    return out


def lora_list(path: Any, scale: Any) -> list[tuple[Any, Any]]:
    """``load_lora``'s argument as ``[(path, scale), ...]``: one path with ``scale``, or a list of paths,
    ``"FILE:SCALE"`` strings and ``(path, scale)`` pairs (those without a scale get ``scale``).

    Raises:
        LoraError: an empty list, or an item that is none of these.
    """
    from ..lora import parse_lora_arg

    if isinstance(path, str | Path):
        return [(path, scale)]
    items = list(path) if isinstance(path, list | tuple) else None
    if not items:
        raise LoraError(f"load_lora({path!r}): give a .safetensors path, or a list of paths / (path, scale) pairs")
    out: list[tuple[Any, Any]] = []
    for item in items:
        if isinstance(item, tuple) and len(item) == 2:
            out.append(item)
        elif isinstance(item, Path):
            out.append((item, scale))
        elif isinstance(item, str):
            p, s = parse_lora_arg(item)
            out.append((p, s if ":" in item and not item.lower().endswith(".safetensors") else scale))
        else:
            raise LoraError(f"load_lora: {item!r} is neither a path nor a (path, scale) pair")
    return out


def apply_loras(slots: Mapping[str, WeightSlots], loras: Sequence[LoraFile],
                check: Callable[[Sequence[LoraFile]], None] | None = None, *, sdxl: bool = False) -> dict[str, int]:
    """Bind base + every LoRA of ``loras`` in every component of ``slots``; all checked before anything is bound.

    A LoRA's layers are read per model (:attr:`WeightSlots.source`: its ``unet.`` keys apply to ``unet`` and to
    ``unet_controlnet`` alike) and merged once per set of bound tensors (components sharing one :class:`WeightSlots`
    get the same values). The deltas are computed first, so the files' sha256 (``check_lora_file(background=True)``)
    is computed meanwhile; the checks that need it (the same file twice, ``check``) come after, still before anything
    is bound.

    Args:
        slots: component -> its weight inputs (:func:`load_slots`).
        loras: the checked files, with their scales.
        check: the caller's own refusal of ``loras`` (raising ``LoraError``), run before anything is bound.
        sdxl: an SDXL artifact: kohya keys in SGM block names (``lora_unet_input_blocks_4_1_...``, sd-scripts' SDXL
            LoRAs) are mapped to the UNet's as diffusers' SDXL loader maps them (:func:`sgm_unet_config`).

    Returns:
        component -> weights that now differ from the base (a count for every component of ``slots``).

    Raises:
        LoraError: a LoRA matching no layer, or only part of them (naming the first that matches none; layers on
            dead weights count as matched and are ignored), a layer on
            a weight the artifact keeps constant (naming it and the fix), a variant that is not ``W + delta`` (DoRA,
            LoKr, LoRA bias), NaN/Inf after the merge; the same file twice; what ``check`` raises.
    """
    unique = distinct(slots)
    groups: dict[str, list[WeightSlots]] = {}
    for s in unique:
        groups.setdefault(s.source, []).append(s)
    # per model: the union of the weights its components bind; a layer refused if constant in any of them, ignored
    # only where no component reads it
    shapes = {src: {w: t for s in group for w, t in s.torch_shapes().items()} for src, group in groups.items()}
    constants = {src: frozenset().union(*(s.constants for s in group)) for src, group in groups.items()}
    dead = {src: frozenset.intersection(*(s.dead for s in group)) for src, group in groups.items()}
    unet_config = sgm_unet_config([*shapes.get("unet", ()), *constants.get("unet", ()), *dead.get("unet", ())]
                                  ) if sdxl else None
    deltas = [lora_deltas(lora, shapes, unet_config, device=unique[0].device, constants=constants, dead=dead)
              for lora in loras]
    refuse_repeats(loras)
    if check is not None:
        check(loras)
    what = " + ".join(f"LoRA {lora.path.name} at scale {lora.scale:g}" for lora in loras)
    values = {id(s): s.merged([d.get(s.source, {}) for d in deltas], what) for s in unique}
    for s in unique:  # nothing failed: bind
        s.bind(values[id(s)])
    return {c: len(values[id(s)]) for c, s in slots.items()}


def sgm_unet_config(weights: Sequence[str]) -> Any:
    """What diffusers' ``_maybe_map_sgm_blocks_to_diffusers`` reads of the UNet's config (``layers_per_block``: the
    resnets of ``down_blocks.0``), from the UNet's torch weight names (the refit map's; the artifact holds no
    ``config.json``); ``None`` when they name no such resnet (no UNet)."""
    from types import SimpleNamespace

    found = [int(m[1]) for w in weights if (m := re.match(r"down_blocks\.0\.resnets\.(\d+)\.", w))]
    return SimpleNamespace(layers_per_block=max(found) + 1) if found else None


def distinct(slots: Mapping[str, WeightSlots]) -> list[WeightSlots]:
    """The :class:`WeightSlots` of ``slots`` once each (components may share one), in order."""
    return list({id(s): s for s in slots.values()}.values())

"""Dead weights: torch weights of a component that no output of its exported graph depends on.

SDXL reads ``hidden_states[-2]`` of its first text encoder (diffusers' ``encode_prompt``), so the last encoder
layer of ``text_encoder`` reaches no output of the artifact (``text_encoder_2``'s does: its pooled ``text_embeds``
are computed from the last hidden state). Whatever reaches no output is dropped by the ONNX export and the
dead-node pass, so the refit map finds those weights in no initializer. A LoRA trained on them (kohya and diffusers
train every text-encoder layer) changes nothing the artifact computes, so ``load_lora`` may
ignore those layers instead of refusing the LoRA as "partly another architecture".

:func:`dead_weights` decides it on the torch module itself, at the export's sample inputs and with the export's
wrapper (:func:`~diffusion_trt.compiler.export.onnx_from_component`'s outputs, clip skip included):

1. autograd: only the candidate weights require grad; one forward records which of them the outputs reach (a
   walk of the autograd graph, no backward);
2. proof: the unreached ones are overwritten with noise and the forward repeated: every output must be bit for bit
   the same (on CUDA within 1e-6 relative), else none is reported dead (never silently wrong: their LoRA layers
   are then refused as today).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch

from . import export
from .components import ComponentSpec

logger = logging.getLogger(__name__)


def dead_weights(component: str, models: dict[str, Any], spec: ComponentSpec, candidates: Collection[str], *,
                 precision: str, profile_ranges: Mapping[str, tuple[int, int, int]], device: str,
                 architecture: str = "sd") -> list[str]:
    """The weights of ``candidates`` (parameter names of ``models[component]``, e.g. the refit map's unmapped
    ones) that no output of the exported ``component`` depends on (see the module docstring).

    Args:
        component: "unet", "text_encoder" or "text_encoder_2" (a key of ``models``).
        models: the loaded torch modules (:func:`~diffusion_trt.compiler.export.load_models`).
        spec: the component's spec (its outputs, clip skip and embedding inputs, as the export read them).
        candidates: parameter names to test; names the module lacks are ignored.
        precision, profile_ranges, device, architecture: as :func:`~diffusion_trt.compiler.export.
            onnx_from_component` (the sample inputs and wrapper of the export).

    Returns:
        The dead ones, sorted; empty when the noise check finds an output that depends on one of them.
    """
    params = dict(models[component].named_parameters())
    watched = {n: params[n] for n in candidates if n in params}
    if not watched:
        return []
    clip_skip = next((int(t.shape[1]) for t in spec.outputs if t.name == "clip_skip_states"), 0)
    vectors = next((int(t.shape[1]) for t in spec.inputs if t.name == "embedding_vectors"), 0)
    module = export._wrap(component, models, architecture, clip_skip, vectors)
    args = export.sample_inputs(spec, precision, {**profile_ranges, **dict(spec.symbols)}, device)
    flags = {n: p.requires_grad for n, p in params.items()}
    try:
        for n, p in params.items():
            p.requires_grad_(n in watched)
        # the graph is walked, never back-propagated: no activation is kept for a backward (a UNet's would be GBs)
        with (torch.inference_mode(False), torch.enable_grad(),
              torch.autograd.graph.saved_tensors_hooks(lambda _: None, lambda _: None)):
            outputs = _tensors(module(*args))
            reached = _reached_leaves(outputs)
        dead = sorted(n for n, p in watched.items() if id(p) not in reached)
        for p in params.values():
            p.requires_grad_(False)
        del outputs
        if dead and not _outputs_unchanged(module, args, [params[n] for n in dead]):
            logger.warning("%s: %d weight(s) reach no output by autograd but change one when perturbed; treating "
                           "none as dead", component, len(dead))
            return []
    finally:
        for n, p in params.items():
            p.requires_grad_(flags[n])
    return dead


def _tensors(out: Any) -> list[torch.Tensor]:
    """The output tensors of a wrapper's forward (one tensor or a tuple of them)."""
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit on the CPU; on CUDA within 1e-6 relative (two runs of one kernel may sum in another order). A
    weight that matters moves the outputs by far more: it is overwritten with noise as large as its largest entry."""
    if torch.equal(a, b):
        return True
    return a.is_cuda and a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max())))


def _reached_leaves(outputs: Iterable[torch.Tensor]) -> set[int]:
    """``id`` of every leaf tensor (parameter) the autograd graphs of ``outputs`` reach."""
    seen: set[Any] = set()
    leaves: set[int] = set()
    todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
    leaves |= {id(t) for t in outputs if t.grad_fn is None and t.requires_grad}
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):  # AccumulateGrad: a leaf
            leaves.add(id(fn.variable))
        todo.extend(nxt for nxt, _ in fn.next_functions)
    return leaves


def _outputs_unchanged(module: torch.nn.Module, args: tuple, dead: list[torch.nn.Parameter]) -> bool:
    """Whether the forward gives the same outputs (:func:`_same`) with every ``dead`` weight overwritten by noise
    (restored after)."""
    saved = [p.detach().clone() for p in dead]
    try:
        with torch.no_grad():
            want = _tensors(module(*args))
            for p in dead:
                p.copy_(torch.randn_like(p) * (p.abs().max() + 1))
            again = _tensors(module(*args))
        return len(again) == len(want) and all(_same(a, b) for a, b in zip(again, want, strict=True))
    finally:
        with torch.no_grad():
            for p, s in zip(dead, saved, strict=True):
                p.copy_(s)

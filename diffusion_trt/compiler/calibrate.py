"""Calibration data for int8/fp8 quantization: the UNet's and VAE decoder's real inputs from real denoising loops.

::

    prompts ──tokenize + text encoder──► embeddings ──denoise (fp32 torch UNet, seed, CFG)──► latents
                      captured at K timesteps: (sample, timestep, encoder_hidden_states)  -> UNet feeds
                      captured after the last step: latents / scaling_factor              -> VAE decoder feeds

Which pipeline runs: diffusers' own ``StableDiffusionPipeline`` (one call per group of prompts,
``output_type="latent"``), built from the fp32 **torch** modules the compiler has already loaded (text encoder, VAE,
tokenizer; the same objects, no copy) and the model folder's scheduler config. Its UNet is :class:`PipelineUNet`,
a module that runs a :data:`UNetFn` and records the UNet's inputs at the captured steps; the early stop after the
last captured step is the pipeline's own interrupt flag (``callback_on_step_end``). The runtime's loop feeds the UNet
alike (the runtime parity tests, ``tests/runtime/``), and this path gave the calibration data of the earlier one (the
runtime's loop driven through an engine adapter) bit for bit on the tiny arch.
Why not an fp32 artifact through ``EnginePipeline``: the compile would need a second full export first; the torch
modules are exact fp32 and already in memory. The UNet is a callable (:data:`UNetFn`), so the quality gate
(:mod:`.quantize`) runs the very same loop with an ONNX Runtime session of the quantized graph instead, and the
UNet's calibration runs it with the fp32 graph being calibrated (``quantize.LoopCalibrator``: one UNet run per
step gives both the next latents and the tensor statistics, instead of a torch run now and a replay later).

Cost (SD-1.5, 512x512, 2-core CPU): every UNet call is one fp32 batch-2 UNet run of ~11 s on a quiet machine, and a
loop cannot skip steps (step k's input needs steps 0..k-1). ``run(final_latents=False)`` stops after the last
captured step; ``batch_size`` runs several prompts per UNet call.

Determinism: the latents of prompt ``i`` come from ``torch.Generator("cpu").manual_seed(seed + i)``; the loop has
no other randomness (schedulers with noise, e.g. Euler ancestral, draw from that generator too). Same prompts,
seed and settings give the same feeds bit for bit on the same machine and library versions, so the same scales.

Shapes: one image per prompt with CFG (``guidance_scale > 1``): UNet feeds ``sample [2, C, h, w]``,
``timestep [2]`` float32, ``encoder_hidden_states [2, 77, D]``; VAE feeds ``latent_sample [1, 4, h, w]``.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import RuntimeInputError

logger = logging.getLogger(__name__)

#: ``--calibration-prompts builtin``: the bundled list, ``diffusion_trt/data/calibration_prompts.txt`` (64 prompts).
BUILTIN = "builtin"
_BUILTIN_FILE = "calibration_prompts.txt"

#: Prompts the quality gate generates with (never used for calibration: held out by construction).
HELD_OUT_PROMPTS: tuple[str, ...] = (
    "a lonely pagoda on a cliff above the clouds, Chinese ink painting",
    "a pixel art harbor town at dusk with fishing boats",
    "a photograph of a golden retriever running through shallow water",
    "a still life of pomegranates and a brass teapot, oil on canvas",
)

#: ``unet_fn(sample [B2,C,h,w], timestep [B2] float32, encoder_hidden_states [B2,S,D]) -> noise_pred [B2,C,h,w]``.
UNetFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def read_prompts(source: str | Path) -> list[str]:
    """The prompts of ``source``: :data:`BUILTIN` or a UTF-8 text file, one prompt a line.

    Blank lines and lines starting with ``#`` are skipped.

    Raises:
        RuntimeInputError: the file does not exist or holds no prompt.
    """
    if str(source) == BUILTIN:
        text = importlib.resources.files("diffusion_trt.data").joinpath(_BUILTIN_FILE).read_text(encoding="utf-8")
        where = f"the builtin list ({_BUILTIN_FILE})"
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise RuntimeInputError(
                f"--calibration-prompts {str(source)!r} is not a file; pass a text file with one prompt per line "
                f"or '{BUILTIN}'"
            )
        text = path.read_text(encoding="utf-8")
        where = str(path)
    prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise RuntimeInputError(f"{where} holds no prompt (one per line; '#' starts a comment)")
    return prompts


def select_prompts(prompts: Sequence[str], size: int) -> list[str]:
    """The first ``size`` prompts, cycling through the list when it is shorter (a warning says so)."""
    if size < 1:
        raise RuntimeInputError(f"--calibration-size {size} must be >= 1")
    if size > len(prompts):
        logger.warning("calibration: %d prompts asked, the list has %d: cycling through it", size, len(prompts))
    return [prompts[i % len(prompts)] for i in range(size)]


def prompts_sha256(prompts: Sequence[str]) -> str:
    """sha256 of the prompts joined by newlines (what the calibration cache is keyed by)."""
    return hashlib.sha256("\n".join(prompts).encode("utf-8")).hexdigest()


def capture_indices(num_steps: int, k: int) -> list[int]:
    """``k`` step indices spread evenly over a ``num_steps`` schedule, first and last included (sorted, unique)."""
    if k < 1 or num_steps < 1:
        raise RuntimeInputError(f"--calibration-steps {k} must be >= 1 (schedule of {num_steps} steps)")
    k = min(k, num_steps)
    return sorted({round(float(x)) for x in np.linspace(0, num_steps - 1, k)})


@dataclass(frozen=True)
class LoopSettings:
    """How each calibration / held-out image is generated.

    Attributes:
        steps: capture this many UNet calls per prompt, spread over the schedule.
        schedule_steps: scheduler steps per image; ``None`` = ``steps`` (every UNet call is captured: the
            cheapest loop whose captured inputs span the whole schedule).
        seed: latents of prompt ``i`` come from seed ``seed + i``.
        guidance_scale: classifier-free guidance; > 1 batches [negative; positive] as the runtime does.
        height, width: image size in pixels (the profile's opt size).
    """

    steps: int
    schedule_steps: int | None = None
    seed: int = 0
    guidance_scale: float = 7.5
    height: int = 512
    width: int = 512

    @property
    def num_inference_steps(self) -> int:
        return self.schedule_steps or self.steps

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "schedule_steps": self.num_inference_steps, "seed": self.seed,
                "guidance_scale": self.guidance_scale, "height": self.height, "width": self.width}


@dataclass
class CapturedData:
    """What the loops saw, as numpy feeds keyed by ONNX input name (component -> list of feeds).

    Attributes:
        feeds: ``{"unet": [{"sample", "timestep", "encoder_hidden_states"}, ...], "vae_decoder": [...]}``.
        images: final images [1, 3, H, W] float32 in [0, 1], one per prompt (held-out runs only).
        noise_preds: the UNet's output for each UNet feed, in the same order (held-out runs only).
    """

    feeds: dict[str, list[dict[str, np.ndarray]]] = field(default_factory=lambda: {"unet": [], "vae_decoder": []})
    images: list[np.ndarray] = field(default_factory=list)
    noise_preds: list[np.ndarray] = field(default_factory=list)


def torch_unet_fn(unet: torch.nn.Module) -> UNetFn:
    """A :data:`UNetFn` over a diffusers ``UNet2DConditionModel`` (fp32, no grad)."""

    def run(sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return unet(sample, timestep, encoder_hidden_states, return_dict=False)[0]

    return run


def ort_unet_fn(session: Any) -> UNetFn:
    """A :data:`UNetFn` over an ONNX Runtime session of a UNet graph (CPU, numpy I/O)."""

    def run(sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        feeds = {"sample": sample.numpy(), "timestep": timestep.numpy(),
                 "encoder_hidden_states": encoder_hidden_states.numpy()}
        return torch.from_numpy(session.run(["noise_pred"], feeds)[0])

    return run


class PipelineUNet(torch.nn.Module):
    """The UNet diffusers' ``StableDiffusionPipeline`` calls: it runs a :data:`UNetFn` (the fp32 torch UNet or an
    ORT session) and records what the pipeline feeds it at the captured steps.

    The pipeline calls ``unet(sample [B2, C, h, w], t, encoder_hidden_states=[B2, S, D], ...)`` with ``t`` the
    scheduler's 0-d timestep; the :data:`UNetFn` and the recorded feeds get it as ``timestep`` [B2] float32, as the
    runtime feeds its engines. Each prompt of a group gets its own feeds, in prompt order: with CFG the pipeline's
    UNet batch is ``[negative x g; positive x g]``, so prompt ``j``'s rows are ``j`` and ``g + j``
    (``[negative; positive]``, the layout of a batch-1 call).

    Args:
        unet_fn: the UNet to run (CPU tensors in, CPU tensor out).
        config: the torch UNet's ``config`` (the pipeline reads ``in_channels``, ``sample_size``...).
        wanted: the step indices whose UNet inputs are captured.
        group: prompts denoised together (g).
        keep_outputs: also record the UNet's output (before the CFG combine) at captured steps.
        on_capture: called right after each UNet call at a captured step.
    """

    def __init__(self, unet_fn: UNetFn, config: Any, wanted: set[int], group: int, *, keep_outputs: bool = False,
                 on_capture: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.config = config
        self.dtype, self.device = torch.float32, torch.device("cpu")
        self._fn, self._wanted, self._group = unet_fn, wanted, group
        self._keep_outputs, self._on_capture = keep_outputs, on_capture
        self.step = 0
        self.feeds: list[list[dict[str, np.ndarray]]] = [[] for _ in range(group)]
        self.outputs: list[list[np.ndarray]] = [[] for _ in range(group)]

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                **_: Any) -> tuple[torch.Tensor]:
        """One UNet call: ``(noise_pred [B2, C, h, w],)``; at a captured step its inputs are recorded."""
        timestep = timestep.to(torch.float32).expand(sample.shape[0]).contiguous()
        noise_pred = self._fn(sample, timestep, encoder_hidden_states)
        if self.step in self._wanted:
            g = self._group
            for j in range(g):
                rows = [j, g + j] if sample.shape[0] == 2 * g else [j]
                self.feeds[j].append({"sample": sample[rows].numpy().copy(), "timestep": timestep[rows].numpy().copy(),
                                      "encoder_hidden_states": encoder_hidden_states[rows].numpy().copy()})
                if self._keep_outputs:
                    self.outputs[j].append(noise_pred[rows].numpy().copy())
            if self._on_capture is not None:
                self._on_capture()
        self.step += 1
        return (noise_pred,)


class Generation:
    """The fp32 text encoder, VAE, tokenizer and scheduler a loop needs, with the UNet passed per run.

    Args:
        models: ``{"text_encoder": CLIPTextModel, "unet": UNet2DConditionModel, "vae": AutoencoderKL}`` (fp32, CPU).
        tokenizer: the model's ``CLIPTokenizer``.
        scheduler_config: contents of ``scheduler/scheduler_config.json``.
        vae_scaling_factor: ``vae.config.scaling_factor`` (0.18215 for SD 1.x).
    """

    def __init__(self, models: Mapping[str, Any], tokenizer: Any, scheduler_config: Mapping[str, Any],
                 vae_scaling_factor: float) -> None:
        self.models = models
        self.tokenizer = tokenizer
        self.scheduler_config = dict(scheduler_config)
        self.vae_scaling_factor = vae_scaling_factor


    def decode(self, latent_sample: torch.Tensor) -> np.ndarray:
        """Images [B, 3, H, W] float32 in [0, 1] from VAE inputs (latents already divided by the scaling factor)."""
        with torch.no_grad():
            image = self.models["vae"].decode(latent_sample, return_dict=False)[0]
        return (image * 0.5 + 0.5).clamp(0, 1).float().numpy()

    def run(
        self,
        prompts: Sequence[str],
        settings: LoopSettings,
        unet_fn: UNetFn | None = None,
        *,
        keep_outputs: bool = False,
        decode: bool = False,
        batch_size: int = 1,
        final_latents: bool = True,
        on_capture: Callable[[], None] | None = None,
    ) -> CapturedData:
        """Generate one image per prompt and capture the UNet inputs at the chosen steps.

        Args:
            prompts: P prompts; prompt ``i`` uses seed ``settings.seed + i``.
            unet_fn: the UNet to denoise with; ``None`` = the fp32 torch UNet.
            keep_outputs: also keep the UNet's output per captured feed (``CapturedData.noise_preds``).
            decode: also decode each final latent with the fp32 VAE (``CapturedData.images``).
            batch_size: prompts denoised together: one UNet call of batch ``2 * batch_size`` (CFG) per step
                instead of ``batch_size`` calls of batch 2 (fewer, larger calls: ~15 % less time per image for the
                SD-1.5 UNet on a 2-core CPU). Each prompt keeps its own generator, and the feeds are still captured
                per prompt, in prompt order: the same feeds as ``batch_size=1`` up to the float rounding of a larger
                batch (bit-identical for ``batch_size=1``).
            final_latents: run every loop to its end for the VAE decoder feeds. ``False`` stops each loop after its
                last captured step (the UNet feeds are the same; the UNet calls after it are skipped) and captures
                no VAE decoder feed; ``decode`` implies ``True``.
            on_capture: called right after each UNet call at a captured step (e.g. to fold the tensor statistics
                of that call into calibration ranges; see :class:`~.quantize.LoopCalibrator`).

        Returns:
            The captured feeds (UNet: ``len(prompts) * K``; VAE decoder: ``len(prompts)`` when the loops run to
            their end), in prompt order.

        Raises:
            RuntimeInputError: ``batch_size`` < 1.
        """
        if batch_size < 1:
            raise RuntimeInputError(f"calibration batch_size={batch_size} must be >= 1")
        out = CapturedData()
        t_start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            group = list(prompts[first:first + batch_size])
            latents, unet, calls = self._denoise_group(
                group, first, settings, unet_fn, keep_outputs=keep_outputs, final_latents=final_latents or decode,
                on_capture=on_capture)
            for j in range(len(group)):
                out.feeds["unet"].extend(unet.feeds[j])
                out.noise_preds.extend(unet.outputs[j])
                if final_latents or decode:
                    # 4. what the VAE decoder sees
                    latent_sample = latents[j : j + 1] / self.vae_scaling_factor
                    out.feeds["vae_decoder"].append({"latent_sample": latent_sample.numpy().copy()})
                    if decode:
                        out.images.append(self.decode(latent_sample))
            logger.debug("loop: prompts %d..%d of %d done, %d UNet calls each, %.1f s so far", first + 1,
                         first + len(group), len(prompts), calls, time.perf_counter() - t_start)
        return out


    def _denoise_group(
        self, group: Sequence[str], first: int, settings: LoopSettings, unet_fn: UNetFn | None, *,
        keep_outputs: bool, final_latents: bool, on_capture: Callable[[], None] | None,
    ) -> tuple[torch.Tensor, PipelineUNet, int]:
        """The prompts ``group`` (prompt ``first + j`` seeded ``seed + first + j``) denoised together by diffusers'
        ``StableDiffusionPipeline``; returns (final latents [g, C, h, w], the UNet recorder, UNet calls)."""
        from diffusers import StableDiffusionPipeline

        from ..runtime.schedulers import make_scheduler

        wanted = set(capture_indices(settings.num_inference_steps, settings.steps))
        unet = PipelineUNet(unet_fn or torch_unet_fn(self.models["unet"]), self.models["unet"].config, wanted,
                            len(group), keep_outputs=keep_outputs, on_capture=on_capture)
        pipe = StableDiffusionPipeline(
            vae=self.models["vae"], text_encoder=self.models["text_encoder"], tokenizer=self.tokenizer, unet=unet,
            scheduler=make_scheduler(self.scheduler_config), safety_checker=None, feature_extractor=None,
            requires_safety_checker=False)
        pipe.set_progress_bar_config(disable=True)

        def stop_after_last_capture(pipe: Any, i: int, t: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            pipe._interrupt = pipe._interrupt or i >= max(wanted)  # the pipeline's early stop: later steps skipped
            return {}

        generators = [torch.Generator(device="cpu").manual_seed(settings.seed + first + j) for j in range(len(group))]
        latents = pipe(list(group), height=settings.height, width=settings.width,
                       num_inference_steps=settings.num_inference_steps, guidance_scale=settings.guidance_scale,
                       generator=generators[0] if len(generators) == 1 else generators, output_type="latent",
                       callback_on_step_end=None if final_latents else stop_after_last_capture,
                       return_dict=False)[0]
        return latents, unet, unet.step

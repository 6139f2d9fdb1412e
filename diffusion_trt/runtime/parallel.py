"""Data-parallel text-to-image over several GPUs of one host: one :class:`EnginePipeline` per device.

::

    with DataParallelPipeline.from_artifacts("artifacts/sd15-fp16", devices=parse_devices("0,1")) as pipe:
        out = pipe("a lighthouse at dusk", num_images_per_prompt=8, seed=1)   # 4 images per GPU

A request is checked once, into one :class:`~.request.Request` (:meth:`EnginePipeline.build_request` on the first
device), and its B images are split into contiguous, balanced shares (:func:`~.batching.split_across`, each share
runnable by the profile; :func:`share_request`, nothing rebuilt), one thread per device runs its share, and the
results are concatenated in image order. Seeds: the latents of all B images are drawn once, on the CPU, exactly as
one :class:`EnginePipeline` call would draw them, and sliced per device, so deterministic schedulers (pndm, ddim,
euler, dpm++...) give the same images on 1 or N devices. Schedulers that draw noise in ``step`` (euler_a, ddpm,
dpm++_sde...) get, with one seed, one generator per device seeded from the request's generator (deterministic for a
given seed and device count); pass a list of B generators to make them device-count independent.

Threads: ONNX Runtime and torch release the GIL while the GPUs work, and each device has its own CUDA stream.
ORT captures CUDA graphs in ``cudaStreamCaptureModeGlobal``, during which *no* thread may allocate CUDA
memory: so :meth:`DataParallelPipeline.warm_up` runs every device's capture calls one device after another
before any parallel work (the constructor calls it when a pipeline uses CUDA graphs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import numpy as np
import torch

from ..errors import RuntimeInputError
from .batching import per_image, plan_chunks, split_across
from .conditioning import TextToImage
from .latents import StepEnd
from .pipeline import EnginePipeline, EnginePipelineOutput, check_return_dict
from .request import Request
from .sdxl import SdxlConditioning

logger = logging.getLogger(__name__)

_MAX_SEED = 2**63 - 1
#: The ControlNet arguments of EnginePipeline.__call__: each device plans its share's ControlNets itself.
CONTROL_ARGUMENTS: tuple[str, ...] = ("control_image", "controlnet", "controlnet_conditioning_scale",
                                      "control_guidance_start", "control_guidance_end", "guess_mode")


def parse_devices(value: str | Sequence[int] | None, available: int | None = None) -> list[int]:
    """CUDA device ordinals from ``--devices``: "0,1", "cuda:0,cuda:1", "all", or a sequence of ints.

    Args:
        value: the option's value; ``None`` or "" means "not given" (returns []).
        available: how many CUDA devices this host has; ``None`` = ask torch.

    Returns:
        Distinct ordinals in the given order.

    Raises:
        RuntimeInputError: a non-integer or negative entry, a duplicate, an ordinal this host lacks, or no CUDA
            device at all; the message names the value and the fix.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    count = torch.cuda.device_count() if available is None else available
    shown = value if isinstance(value, str) else ",".join(map(str, value))
    if count == 0:
        raise RuntimeInputError(
            f"--devices {shown}: this host has no CUDA device (torch {torch.__version__} sees none); drop "
            "--devices to run on one device, or use a GPU host with a CUDA build of torch"
        )
    if isinstance(value, str) and value.strip().lower() == "all":
        return list(range(count))
    items = [p.strip() for p in value.split(",")] if isinstance(value, str) else list(value)
    out: list[int] = []
    for item in items:
        text = str(item).removeprefix("cuda:") if isinstance(item, str) else item
        try:
            ordinal = int(text) if not isinstance(text, bool) else None
        except (TypeError, ValueError):
            ordinal = None
        if ordinal is None or ordinal < 0 or (isinstance(text, str) and not text.isdigit()):
            raise RuntimeInputError(
                f"--devices {shown}: {item!r} is not a CUDA device index; use comma-separated indices like 0,1 "
                f"(this host has {count}: 0..{count - 1}) or 'all'"
            )
        if ordinal >= count:
            raise RuntimeInputError(
                f"--devices {shown}: device {ordinal} does not exist; this host has {count} CUDA device(s), "
                f"0..{count - 1} (see nvidia-smi; CUDA_VISIBLE_DEVICES renumbers them)"
            )
        if ordinal in out:
            raise RuntimeInputError(f"--devices {shown}: device {ordinal} is listed twice; list each device once")
        out.append(ordinal)
    return out


def merge_outputs(parts: Sequence[Any], output_type: str, device: torch.device | None = None) -> Any:
    """Concatenate per-device results in order: lists ("pil"), arrays ("np"), tensors ("pt"/"latent").

    Tensors are moved to ``device`` (default the first part's) before concatenation.
    """
    if output_type == "pil":
        return [image for part in parts for image in part]
    if output_type == "np":
        return np.concatenate(list(parts))
    target = device or parts[0].device
    return torch.cat([p.to(target) for p in parts])


class DataParallelPipeline:
    """Several :class:`EnginePipeline` (one per CUDA device) called as one; see the module docstring.

    Args:
        pipes: open pipelines of the same artifact, normally one per device; owned (closed by :meth:`close`).
        warm_up: run :meth:`warm_up` now (default: when any engine uses CUDA graphs).

    Not thread-safe itself: one call at a time (it runs its own threads).
    """

    def __init__(self, pipes: Sequence[EnginePipeline], warm_up: bool | None = None) -> None:
        if not pipes:
            raise RuntimeInputError("DataParallelPipeline needs at least one pipeline (one per device)")
        self.pipes = list(pipes)
        self.devices = [p.device for p in self.pipes]  # two pipelines may share a device (and CPU tests do)
        # One thread per pipeline, for its whole life: ONNX Runtime's CUDA provider keeps per-thread state (cuBLAS /
        # cuDNN handles, the captured CUDA graph), so an engine warmed up and captured on one thread must replay
        # on that thread. A shared pool handed a device's work to whichever thread was free, and a capture on a
        # fresh thread failed in cublasCreate: CUBLAS_STATUS_NOT_INITIALIZED (benchmarks/results/README.md, "Figures
        # behind code defaults").
        self._threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"diffusion-trt-device{k}")
                         for k in range(len(self.pipes))]
        self._closed = False
        # size-bucket engines (engines/buckets.py) capture lazily: warm their default size up one device at a time too
        uses_graphs = any(getattr(e, "cuda_graph", False) or hasattr(e, "specialised_shapes")
                          for p in self.pipes for e in p.engines.values())
        if warm_up if warm_up is not None else uses_graphs:
            self.warm_up()

    @classmethod
    def from_artifacts(
        cls, path: str | os.PathLike[str], devices: Sequence[int], **kwargs: Any
    ) -> DataParallelPipeline:
        """One :meth:`EnginePipeline.from_artifacts` per device ordinal (``device="cuda"``, ``device_id=d``).

        The artifact is hashed once (``verify`` applies to the first device only). Extra ``kwargs`` go to every
        :meth:`EnginePipeline.from_artifacts`.

        Raises:
            RuntimeInputError: ``devices`` empty; as :meth:`EnginePipeline.from_artifacts` otherwise.
        """
        if not devices:
            raise RuntimeInputError("devices is empty; pass CUDA device indices, e.g. [0, 1]")
        verify = kwargs.pop("verify", True)
        pipes: list[EnginePipeline] = []
        try:
            for k, d in enumerate(devices):
                pipes.append(
                    EnginePipeline.from_artifacts(path, device="cuda", device_id=d, verify=verify and k == 0, **kwargs)
                )
        except BaseException:
            for p in pipes:
                p.close()
            raise
        return cls(pipes)

    @property
    def profile(self) -> Any:
        return self.pipes[0].profile

    def warm_up(self, num_inference_steps: int = 2) -> None:
        """Run every device's first calls (CUDA graph warm-up and capture, cuDNN autotuning) one device at a time,
        each on the pipeline's own thread (the one its later calls run on).

        Two calls of ``num_inference_steps`` steps at the default size and the profile's opt batch: ORT
        captures an engine's graph on its second run, so every engine in CUDA-graph mode is captured (by default
        the UNet; the text encoder and VAE run eager: :data:`~.loading.EAGER_COMPONENTS`).
        Calls at other shapes later (dynamic artifacts) run eagerly anyway: ORT graphs need static profiles.
        """
        def warm(pipe: EnginePipeline) -> None:
            batch = pipe.profile.batch.opt
            with torch.cuda.device(pipe.device) if pipe.device.type == "cuda" else contextlib.nullcontext():
                for _ in range(2):
                    pipe(
                        "",
                        num_inference_steps=num_inference_steps,
                        num_images_per_prompt=batch,
                        seed=0,
                        output_type="np",  # runs the VAE decoder too: every engine captures here
                        progress=False,
                    )
                if pipe.device.type == "cuda":
                    torch.cuda.synchronize(pipe.device)

        for k, pipe in enumerate(self.pipes):  # one device at a time, each on the thread that will run it
            self._threads[k].submit(warm, pipe).result()
        logger.info("warmed up %d device(s): %s", len(self.pipes), ", ".join(map(str, self.devices)))

    def __call__(
        self,
        prompt: str | Sequence[str],
        negative_prompt: str | Sequence[str] | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | list[torch.Generator] | None = None,
        seed: int | None = None,
        latents: torch.Tensor | None = None,
        output_type: str = "pil",
        height: int | None = None,
        width: int | None = None,
        **kwargs: Any,
    ) -> EnginePipelineOutput | tuple[Any, ...]:
        """Like :meth:`EnginePipeline.__call__`, the B images split across the devices.

        ``progress`` and ``callback`` are per device (``progress`` defaults to off). "pt"/"latent" results are
        gathered on the first device.

        Raises:
            RuntimeInputError: as :meth:`EnginePipeline.__call__`, or a batch no split can run.
            RuntimeError: closed.
        """
        if self._closed:
            raise RuntimeError("DataParallelPipeline is closed; load it again")
        if any(kwargs.get(k) is not None for k in ("image", "mask_image", "strength")):
            raise RuntimeInputError(
                "image-to-image and inpainting run on one device: use EnginePipeline (CLI: drop --devices)"
            )
        control = {k: kwargs.pop(k) for k in CONTROL_ARGUMENTS if k in kwargs}
        return_dict = kwargs.pop("return_dict", True)
        check_return_dict(return_dict)
        step_end = StepEnd.build(self, kwargs.pop("callback_on_step_end", None),
                                 kwargs.pop("callback_on_step_end_tensor_inputs", ("latents",)))
        self._interrupt = False  # diffusers': the callback sets it to stop the loop (of every device)
        if step_end is not None:
            kwargs["callback_on_step_end"] = step_end  # called with this pipeline, per device as callback
        first = self.pipes[0]
        # one request, checked once, then split: each device runs its share of the images
        request = first.build_request(prompt, negative_prompt, generator=generator, seed=seed,
                                      num_images_per_prompt=num_images_per_prompt, latents=latents,
                                      output_type=output_type, height=height, width=width,
                                      **{"progress": False, **kwargs})
        b = first.profile.batch
        shares = split_across(request.batch, len(self.pipes), b.min, b.max)
        gens = request.generator
        if latents is None:
            latents = _request_latents(first, request)
        per_image_gens = isinstance(gens, list) and len(gens) == request.batch and request.batch > 1
        step_gens = _step_generators(gens, len(shares), per_image_gens)

        def work(k: int) -> EnginePipelineOutput:
            rows = shares[k]
            pipe = self.pipes[k]
            g = gens[rows.start : rows.stop] if per_image_gens else step_gens[k]  # type: ignore[index]
            share = share_request(request, rows, g, latents[rows.start : rows.stop], pipe)
            with torch.cuda.device(pipe.device) if pipe.device.type == "cuda" else contextlib.nullcontext():
                return pipe.run_request(share, **control)

        futures = [self._threads[k].submit(work, k) for k in range(len(shares))]
        results = [f.result() for f in futures]
        images = merge_outputs([r.images for r in results], output_type, self.devices[0])
        parameters = {
            **first._parameters(request),  # the whole request's (each share's are its own images')
            "devices": [str(d) for d in self.devices[: len(shares)]],
            "device_shares": [len(r) for r in shares],
        }
        out = EnginePipelineOutput(images=images, seed=request.seed, parameters=parameters)
        return out if return_dict else out.to_tuple(first.architecture)

    def close(self) -> None:
        """Close every pipeline and the thread pool (idempotent)."""
        if not self._closed:
            self._closed = True
            for thread in self._threads:
                thread.shutdown(wait=True)
            for p in self.pipes:
                p.close()

    def __enter__(self) -> DataParallelPipeline:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DataParallelPipeline(devices={[str(d) for d in self.devices]}, {self.pipes[0]!r})"


def _request_latents(pipe: EnginePipeline, request: Request) -> torch.Tensor:
    """The noise of all B images [B, C, h, w], drawn as one :class:`EnginePipeline` call draws it (CPU generator,
    the UNet's sample dtype; :meth:`Request.build` checked that it fits in host memory)."""
    from diffusers.utils.torch_utils import randn_tensor

    dtype = pipe.engines["unet"].spec.input("sample").torch_dtype
    return randn_tensor(request.latent_shape, generator=request.generator, device=torch.device("cpu"), dtype=dtype)


def share_request(request: Request, rows: range, generator: Any, latents: torch.Tensor,
                  pipe: EnginePipeline) -> Request:
    """The images ``rows`` of ``request`` as a request of their own for ``pipe`` (one device): one prompt per image
    (prompt-major, as the whole), their ``latents`` and ``generator``, engine-sized chunks of the share, and the
    conditioning on ``pipe``'s engines (SDXL: its ``text_encoder_2``). Nothing is checked again.

    Raises:
        RuntimeInputError: a conditioning that runs on one device only (image-to-image, inpainting).
    """
    n = request.num_images_per_prompt
    sl = slice(rows.start, rows.stop)

    def images(embeds: torch.Tensor | None) -> torch.Tensor | None:
        return None if embeds is None else embeds.repeat_interleave(n, dim=0)[sl]

    b = pipe.profile.batch
    return dataclasses.replace(
        request, prompts=tuple(per_image(request.prompts, n)[sl]),
        negative_prompts=tuple(per_image(request.negative_prompts, n)[sl]), num_images_per_prompt=1,
        latent_shape=(len(rows), *request.latent_shape[1:]), generator=generator, latents=latents,
        chunks=tuple(plan_chunks(len(rows), b.min, b.max)), conditioning=_share_conditioning(request, sl, pipe),
        prompt_embeds=images(request.prompt_embeds), negative_prompt_embeds=images(request.negative_prompt_embeds),
        pooled_prompt_embeds=images(request.pooled_prompt_embeds),
        negative_pooled_prompt_embeds=images(request.negative_pooled_prompt_embeds))


def _share_conditioning(request: Request, sl: slice, pipe: EnginePipeline) -> Any:
    """The request's conditioning for images ``sl`` on ``pipe``: text-to-image as it is; SDXL with one second-encoder
    text per image and ``pipe``'s ``text_encoder_2``."""
    cond = request.conditioning
    if isinstance(cond, SdxlConditioning):
        n = request.num_images_per_prompt
        return dataclasses.replace(cond, text_encoder_2=pipe.engines["text_encoder_2"],
                                   prompts_2=per_image(cond.prompts_2, n)[sl],
                                   negative_prompts_2=per_image(cond.negative_prompts_2, n)[sl])
    if type(cond) is not TextToImage:
        raise RuntimeInputError(f"{cond.mode} runs on one device: use EnginePipeline (CLI: drop --devices)")
    return cond


def _step_generators(gens: Any, devices: int, per_image_gens: bool) -> list[Any]:
    """One generator per device for schedulers that draw noise in ``step()``, seeded from the request's (``None``
    entries with one generator per image, or none)."""
    step_gens: list[Any] = []
    for _ in range(devices):
        if per_image_gens or gens is None:
            step_gens.append(None)
        else:
            g = gens[0] if isinstance(gens, list) else gens
            sub = int(torch.randint(0, _MAX_SEED, (1,), generator=g).item())
            step_gens.append(torch.Generator().manual_seed(sub))
    return step_gens

"""Data-parallel text-to-image over several GPUs of one host: one :class:`EnginePipeline` per device.

::

    with DataParallelPipeline.from_artifacts("artifacts/sd15-fp16", devices=parse_devices("0,1")) as pipe:
        out = pipe("a lighthouse at dusk", num_images_per_prompt=8, seed=1)   # 4 images per GPU

A request's B images are split into contiguous, balanced shares (:func:`~.batching.split_across`, each share
runnable by the profile), one thread per device runs its share, and the results are concatenated in image
order. Seeds: the latents of all B images are drawn once, on the CPU, exactly as one :class:`EnginePipeline`
call would draw them, and sliced per device, so deterministic schedulers (pndm, ddim, euler, dpm++...) give
the same images on 1 or N devices. Schedulers that draw noise in ``step`` (euler_a, ddpm, dpm++_sde...) get,
with one seed, one generator per device seeded from the request's generator (deterministic for a given seed
and device count); pass a list of B generators to make them device-count independent.

Threads: ONNX Runtime and torch release the GIL while the GPUs work, and each device has its own CUDA stream.
ORT captures CUDA graphs in ``cudaStreamCaptureModeGlobal``, during which *no* thread may allocate CUDA
memory: so :meth:`DataParallelPipeline.warm_up` runs every device's capture calls one device after another
before any parallel work (the constructor calls it when a pipeline uses CUDA graphs).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

import numpy as np
import torch

from ..errors import RuntimeInputError
from .batching import per_image, split_across
from .memory.host_memory import check_host_memory
from .pipeline import EnginePipeline, EnginePipelineOutput
from .request import negative_list, prompt_list

logger = logging.getLogger(__name__)

_MAX_SEED = 2**63 - 1


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
        captures an engine's graph on its second run, so text encoder, UNet and VAE decoder are all captured.
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
    ) -> EnginePipelineOutput:
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
        first = self.pipes[0]
        prompts = prompt_list("prompt", prompt)
        negatives = negative_list(negative_prompt, len(prompts))
        if (
            isinstance(num_images_per_prompt, bool)
            or not isinstance(num_images_per_prompt, int)
            or (num_images_per_prompt < 1)
        ):
            raise RuntimeInputError(f"num_images_per_prompt={num_images_per_prompt!r} must be an integer >= 1")
        batch = len(prompts) * num_images_per_prompt
        image_prompts = per_image(prompts, num_images_per_prompt)
        image_negatives = per_image(negatives, num_images_per_prompt)
        b = first.profile.batch
        shares = split_across(batch, len(self.pipes), b.min, b.max)

        height = first.default_height if height is None else height
        width = first.default_width if width is None else width
        gens, seed = first._generator(generator, seed, batch)
        if latents is None:
            latents = _request_latents(first, batch, int(height), int(width), gens, output_type)
        per_image_gens = isinstance(gens, list) and len(gens) == batch and batch > 1
        step_gens = _step_generators(gens, len(shares), per_image_gens)

        def work(k: int) -> EnginePipelineOutput:
            rows = shares[k]
            pipe = self.pipes[k]
            g = gens[rows.start : rows.stop] if per_image_gens else step_gens[k]  # type: ignore[index]
            with torch.cuda.device(pipe.device) if pipe.device.type == "cuda" else contextlib.nullcontext():
                return pipe(
                    image_prompts[rows.start : rows.stop],
                    # None stays None: SDXL's force_zeros_for_empty_prompt tells None from "" (SD: the same)
                    negative_prompt=None if negative_prompt is None else image_negatives[rows.start : rows.stop],
                    num_images_per_prompt=1,
                    generator=g,
                    latents=latents[rows.start : rows.stop],
                    output_type=output_type,
                    height=height,
                    width=width,
                    **{"progress": False, **kwargs},
                )

        futures = [self._threads[k].submit(work, k) for k in range(len(shares))]
        results = [f.result() for f in futures]
        images = merge_outputs([r.images for r in results], output_type, self.devices[0])
        parameters = {
            **results[0].parameters,
            "prompt": prompt if isinstance(prompt, str) else list(prompts),
            "negative_prompt": negative_prompt
            if negative_prompt is None or isinstance(negative_prompt, str)
            else list(negatives),
            "num_images_per_prompt": num_images_per_prompt,
            "seed": seed,
            "devices": [str(d) for d in self.devices[: len(shares)]],
            "device_shares": [len(r) for r in shares],
        }
        return EnginePipelineOutput(images=images, seed=seed, parameters=parameters)

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


def _request_latents(pipe: EnginePipeline, batch: int, height: int, width: int, generator: Any,
                     output_type: str) -> torch.Tensor:
    """The noise of all B images [B, C, h, w], drawn as one :class:`EnginePipeline` call draws it (CPU generator,
    the UNet's sample dtype); refused first when it and the images do not fit in host memory (as Request.build)."""
    from diffusers.utils.torch_utils import randn_tensor

    shape = pipe.geometry.latent_shape(batch, height, width)
    dtype = pipe.engines["unet"].spec.input("sample").torch_dtype
    check_host_memory(f"batch = {batch} images", shape, dtype, height, width, output_type)
    return randn_tensor(shape, generator=generator, device=torch.device("cpu"), dtype=dtype)


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

"""ControlNet cost: 0, 1 and 2 ControlNets, ours next to diffusers eager and diffusers with a CUDA-graph UNet.

For each count n it measures, in one process on the same weights and seed:

* ``step_ms``: one denoising step's network work (median of --step-iters, synchronised wall clock): ours = the
  ControlNet engines then ``unet_controlnet`` (n >= 1) or the plain ``unet`` (n = 0); diffusers = its ControlNets
  then its UNet (with residuals), eager or with the UNet replayed from a CUDA graph (ControlNets eager, as users run
  them). An artifact compiled after the conditioning-embedding split feeds each ``controlnet_<name>`` the embedding
  its ``cond_embed_<name>`` made once (as the runtime does, once per call); an older artifact's ControlNets take
  the image and embed it at every step;
* ours, n >= 1: ``controlnet_ms`` (the n ControlNet engines of one step alone, median), ``controlnet_share_of_unet``
  (``controlnet_ms`` over n plain ``unet`` steps: issue 25's goal is <= 0.35 per ControlNet) and, for split
  artifacts, ``cond_embed_ms`` (the n ``cond_embed_<name>`` runs of one call: a one-off cost per generation, not per
  step) and ``split: true``;
* ``e2e_ms``: one whole generation (median of --e2e-iters): ``EnginePipeline(...)`` vs diffusers'
  ``StableDiffusionControlNetPipeline`` (``StableDiffusionPipeline`` for n = 0);
* ``step_cost_vs_0``: each count's step time over the same system's step time without ControlNets;
* ``parity``: max abs difference of our image from diffusers' eager image (same seed through a CPU generator, same
  control images; float images in [0, 1]); the issue's goal on the GPU in fp16 is <= 4/255.

Usage (the GPU host; the artifact compiled with two ControlNets, named a and b):

    diffusion-trt dummy-pipeline --arch sd15 models/sd15
    diffusion-trt dummy-controlnet --arch sd15 models/sd15-cn-a
    diffusion-trt dummy-controlnet --arch sd15 --seed 1 models/sd15-cn-b
    diffusion-trt compile models/sd15 -o artifacts/sd15-cn --backend tensorrt-rtx --precision fp16 \\
        --controlnet a=models/sd15-cn-a --controlnet b=models/sd15-cn-b
    python benchmarks/controlnet_step.py models/sd15 artifacts/sd15-cn models/sd15-cn-a models/sd15-cn-b \\
        --json benchmarks/results/h200-controlnet.json

A benchmark, not a test (tests/test_controlnet_benchmark.py runs it on the tiny arch on the CPU to keep it working).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], Any], device: str, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 3)


class GraphedResidualUNet:
    """A diffusers UNet's forward replayed from one CUDA graph per shape, residual kwargs included (diffusion_trt's
    bench GraphedUNet runs calls with ``down_block_additional_residuals`` eagerly)."""

    def __init__(self, unet: Any) -> None:
        self.unet, self._eager, self._graphs, self._pool = unet, unet.forward, {}, None
        unet.forward = self

    def __call__(self, sample: torch.Tensor, timestep: Any, encoder_hidden_states: torch.Tensor, *args: Any,
                 down_block_additional_residuals: Any = None, mid_block_additional_residual: Any = None,
                 return_dict: bool = True, **kwargs: Any) -> Any:
        if args or any(v is not None for v in kwargs.values()):
            raise ValueError("GraphedResidualUNet: unexpected UNet arguments")
        timestep = torch.as_tensor(timestep, device=sample.device).reshape(-1).expand(sample.shape[0])
        inputs = [sample, timestep, encoder_hidden_states, *(down_block_additional_residuals or ()),
                  *(() if mid_block_additional_residual is None else (mid_block_additional_residual,))]
        key = tuple((tuple(t.shape), t.dtype) for t in inputs)
        if key not in self._graphs:
            self._graphs[key] = self._capture(inputs, down_block_additional_residuals is not None)
        graph, static, out = self._graphs[key]
        for s, t in zip(static, inputs, strict=True):
            s.copy_(t)
        graph.replay()
        result = out.clone()
        return (result,) if not return_dict else type("Out", (), {"sample": result})()

    def _capture(self, inputs: list[torch.Tensor], residuals: bool) -> tuple[Any, list[torch.Tensor], torch.Tensor]:
        static = [t.clone() for t in inputs]

        def forward() -> torch.Tensor:
            kw = ({"down_block_additional_residuals": tuple(static[3:-1]), "mid_block_additional_residual": static[-1]}
                  if residuals else {})
            return self._eager(static[0], static[1], static[2], return_dict=False, **kw)[0]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward()
        self._pool = graph.pool()
        return graph, static, out


def control_images(n: int, size: tuple[int, int], seed: int = 0) -> list[Any]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)) for _ in range(n)]


class OursStep(NamedTuple):
    """Our artifact's engine work (:func:`ours_step`): ``step`` (one denoising step: the ControlNets then
    ``unet_controlnet``, or the plain ``unet``), ``controlnets`` (the step's ControlNets alone), ``embed`` (the
    once-per-call ``cond_embed_<name>`` runs; ``None`` for an artifact compiled before the split, or n = 0) and
    ``split`` (whether the ControlNets take the embedding)."""

    step: Callable[[], Any]
    controlnets: Callable[[], Any]
    embed: Callable[[], Any] | None
    split: bool


def ours_step(pipe: Any, names: list[str], size: tuple[int, int], device: str) -> OursStep:
    """:class:`OursStep` of the ControlNets ``names`` at ``size`` (CFG batch 2, random inputs).

    A split artifact's ``controlnet_<name>`` takes ``controlnet_cond_embedding`` [2, C0, h, w], made here once by
    ``cond_embed_<name>`` from the control image (as the runtime does once per call); an unsplit one takes
    ``controlnet_cond`` [2, 3, H, W], the image.
    """
    h, w = size[0] // 8, size[1] // 8
    dt = pipe.engine("unet").spec.input("sample").torch_dtype
    dev = pipe.device
    feeds = {"sample": torch.randn(2, 4, h, w, device=dev, dtype=dt),
             "timestep": torch.full((2,), 500.0, device=dev),
             "encoder_hidden_states": torch.randn(2, 77, pipe.engine("unet").spec.input(
                 "encoder_hidden_states").shape[2], device=dev, dtype=dt)}
    if not names:
        unet = pipe.engine("unet")
        return OursStep(lambda: unet.run(feeds), lambda: None, None, False)
    unet = pipe.engine("unet_controlnet")
    nets = [pipe.engine(f"controlnet_{n}") for n in names]
    embeds = [pipe.engine(f"cond_embed_{n}") if "controlnet_cond_embedding" in net.spec.input_names else None
              for n, net in zip(names, nets, strict=True)]
    cond = torch.rand(2, 3, *size, device=dev, dtype=(embeds[0] or nets[0]).spec.input("controlnet_cond").torch_dtype)
    n_res = sum("residual" in t.name for t in unet.spec.inputs)
    scale = torch.ones(n_res, device=dev)

    def embed() -> list[dict[str, torch.Tensor]]:  # once per call in the runtime (runtime/controlnet.py)
        return [{"controlnet_cond": cond} if e is None else
                {"controlnet_cond_embedding": e.run({"controlnet_cond": cond})["controlnet_cond_embedding"].clone()}
                for e in embeds]

    conds = embed()

    def controlnets() -> dict[str, torch.Tensor] | None:
        total: dict[str, torch.Tensor] | None = None
        for net, c in zip(nets, conds, strict=True):
            out = net.run({**feeds, **c, "conditioning_scale": scale})
            total = dict(out) if total is None else {k: total[k] + out[k] for k in total}
        return total

    def step() -> Any:
        return unet.run({**feeds, **(controlnets() or {})})
    split = any(e is not None for e in embeds)
    return OursStep(step, controlnets, embed if split else None, split)


def diffusers_step(unet: Any, controlnets: list[Any], size: tuple[int, int], dtype: torch.dtype,
                   device: str) -> Callable[[], Any]:
    h, w = size[0] // 8, size[1] // 8
    sample = torch.randn(2, 4, h, w, device=device, dtype=dtype)
    t = torch.tensor(500, device=device)
    ehs = torch.randn(2, 77, unet.config.cross_attention_dim, device=device, dtype=dtype)
    cond = torch.rand(2, 3, *size, device=device, dtype=dtype)

    @torch.no_grad()
    def step() -> Any:
        if not controlnets:
            return unet(sample, t, ehs, return_dict=False)
        down = mid = None
        for cn in controlnets:
            d, m = cn(sample, t, ehs, controlnet_cond=cond, return_dict=False)
            down = d if down is None else [a + b for a, b in zip(down, d, strict=True)]
            mid = m if mid is None else mid + m
        return unet(sample, t, ehs, down_block_additional_residuals=down, mid_block_additional_residual=mid,
                    return_dict=False)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("artifact_dir", type=Path, help="compiled with --controlnet a=CN_A --controlnet b=CN_B")
    ap.add_argument("controlnet_dirs", type=Path, nargs=2, help="the ControlNet folders a and b (for diffusers)")
    ap.add_argument("--json", type=Path, required=True, help="where the results go")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--height", type=int, default=512)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--counts", default="0,1,2")
    ap.add_argument("--step-iters", type=int, default=30)
    ap.add_argument("--e2e-iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    print(json.dumps(run(args), indent=1))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import diffusers

    from diffusion_trt.runtime import EnginePipeline

    dev, size = args.device, (args.height, args.width)
    dtype = torch.float16 if dev == "cuda" else torch.float32
    counts = [int(c) for c in args.counts.split(",")]
    names = ["a", "b"]
    cns = [diffusers.ControlNetModel.from_pretrained(p, torch_dtype=dtype).to(dev).eval() for p in args.controlnet_dirs]
    base = diffusers.StableDiffusionPipeline.from_pretrained(args.model_dir, torch_dtype=dtype, safety_checker=None,
                                                            requires_safety_checker=False).to(dev)
    base.set_progress_bar_config(disable=True)
    results: list[dict[str, Any]] = []
    gen = dict(prompt="an ink painting of mountains above a river, guohua style", num_inference_steps=args.steps,
               height=args.height, width=args.width)
    ours_images: dict[int, np.ndarray] = {}
    with EnginePipeline.from_artifacts(args.artifact_dir, device=dev) as pipe:
        for n in counts:
            images = control_images(n, size)
            kw = {} if n == 0 else {"control_image": images if n > 1 else images[0], "controlnet": names[:n]}
            step = ours_step(pipe, names[:n], size, dev)
            row: dict[str, Any] = {"system": "ours", "controlnets": n,
                                   "step_ms": median_ms(step.step, dev, args.warmup, args.step_iters)}
            if n:
                row["split"] = step.split
                row["controlnet_ms"] = median_ms(step.controlnets, dev, args.warmup, args.step_iters)
                if step.embed is not None:
                    row["cond_embed_ms"] = median_ms(step.embed, dev, args.warmup, args.step_iters)
            row["e2e_ms"] = median_ms(lambda kw=kw: pipe(**gen, **kw, seed=0, progress=False), dev, 1,
                                      args.e2e_iters)
            results.append(row)
            ours_images[n] = pipe(**gen, **kw, generator=torch.Generator("cpu").manual_seed(0), output_type="np",
                                  progress=False).images
    for system in ("diffusers_eager", "diffusers_cuda_graph"):
        if system == "diffusers_cuda_graph" and dev != "cuda":
            results += [{"system": system, "controlnets": n, "status": "skipped", "reason": "needs CUDA"}
                        for n in counts]
            continue
        graphed = GraphedResidualUNet(base.unet) if system == "diffusers_cuda_graph" else None
        for n in counts:
            ref = base if n == 0 else diffusers.StableDiffusionControlNetPipeline(
                **{k: v for k, v in base.components.items() if k in (
                    "vae", "text_encoder", "tokenizer", "unet", "scheduler", "safety_checker", "feature_extractor")},
                controlnet=cns[0] if n == 1 else diffusers.MultiControlNetModel(cns[:n]),
                requires_safety_checker=False)
            ref.set_progress_bar_config(disable=True)
            images = control_images(n, size)
            kw = {} if n == 0 else {"image": images if n > 1 else images[0]}
            results.append({"system": system, "controlnets": n,
                            "step_ms": median_ms(diffusers_step(base.unet, cns[:n], size, dtype, dev), dev,
                                                 args.warmup, args.step_iters),
                            "e2e_ms": median_ms(lambda ref=ref, kw=kw: ref(**gen, **kw, generator=torch.Generator(
                                "cpu").manual_seed(0)), dev, 1, args.e2e_iters)})
            if system == "diffusers_eager":  # parity: the same seed and control images, images in [0, 1]
                want = ref(**gen, **kw, generator=torch.Generator("cpu").manual_seed(0), output_type="np").images
                results.append({"system": "parity", "controlnets": n, "max_abs_vs_diffusers_eager": round(float(
                    np.abs(np.asarray(ours_images[n], np.float32) - np.asarray(want, np.float32)).max()), 5),
                    "goal": round(4 / 255, 5)})
        if graphed is not None:
            del base.unet.forward
    _ratios(results)
    config = {k: ([str(p) for p in v] if isinstance(v, list) else str(v) if isinstance(v, Path) else v)
              for k, v in vars(args).items() if k != "json"}
    out = {"config": config,
           "torch": torch.__version__, "diffusers": diffusers.__version__,
           "gpu": torch.cuda.get_device_name() if dev == "cuda" else None, "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    return out


def _ratios(results: list[dict[str, Any]]) -> None:
    """``step_cost_vs_0`` (step time over the same system's without ControlNets), ``controlnet_share_of_unet`` (ours:
    the ControlNets' time over n plain UNet steps) and ``e2e_speedup_vs_<system>``."""
    by = {(r["system"], r["controlnets"]): r for r in results if "step_ms" in r}
    for (system, n), r in by.items():
        zero = by.get((system, 0))
        if zero is not None:
            r["step_cost_vs_0"] = round(r["step_ms"] / zero["step_ms"], 3)
            if "controlnet_ms" in r:
                r["controlnet_share_of_unet"] = round(r["controlnet_ms"] / (n * zero["step_ms"]), 3)
        if system == "ours":
            for other in ("diffusers_eager", "diffusers_cuda_graph"):
                if (other, n) in by:
                    r[f"e2e_speedup_vs_{other}"] = round(by[(other, n)]["e2e_ms"] / r["e2e_ms"], 3)


if __name__ == "__main__":
    main()

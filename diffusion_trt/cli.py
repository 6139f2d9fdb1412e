"""Command line: ``diffusion-trt compile | run | dummy-pipeline``.

Thin on purpose: every command parses options, sets up logging and progress bars, and calls one library
function. Heavy imports (torch, diffusers, onnxruntime) happen inside the commands, so ``--help`` is fast.
Any :class:`~diffusion_trt.errors.DiffusionTrtError` becomes one ``error: ...`` line and its exit code.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .errors import DiffusionTrtError

logger = logging.getLogger("diffusion_trt")


def _setup_logging(verbose: int) -> None:
    level = logging.DEBUG if verbose >= 1 else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s"))
    root = logging.getLogger("diffusion_trt")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    if not verbose:
        # third-party chatter (transformers/diffusers warnings about optional extras) hides our lines
        for name in ("transformers", "diffusers"):
            logging.getLogger(name).setLevel(logging.ERROR)


def _handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DiffusionTrtError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(e.exit_code)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("-v", "--verbose", count=True, help="Debug logs (pass rejections, per-stage timings).")
@click.version_option(package_name="diffusion-trt")
def main(verbose: int) -> None:
    """Compile Stable Diffusion pipelines to ONNX Runtime / TensorRT engines and run them.

    \b
    Quick start (CPU, a tiny random-weight pipeline):
      diffusion-trt dummy-pipeline --arch tiny models/tiny
      diffusion-trt compile models/tiny -o artifacts/tiny
      diffusion-trt run artifacts/tiny --prompt "an ink painting of a mountain" -o out.png
    """
    _setup_logging(verbose)


@main.command("dummy-pipeline")
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(["tiny", "sd15"]), default="tiny", show_default=True,
              help="tiny: a few-MB SD-shaped pipeline for tests; sd15: the true SD-1.5 architecture (~4 GB).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty OUT_DIR.")
@_handle_errors
def dummy_pipeline(out_dir: Path, arch: str, seed: int, overwrite: bool) -> None:
    """Write a diffusers StableDiffusionPipeline folder with seeded random weights.

    It stands in for a trained checkpoint (none can be downloaded here): same configs, same CLIP
    tokenizer, same code paths.

    \b
    Examples:
      diffusion-trt dummy-pipeline models/tiny
      diffusion-trt dummy-pipeline --arch sd15 --seed 1 models/sd15
    """
    from .compiler.dummy import write_dummy_pipeline

    path = write_dummy_pipeline(out_dir, arch=arch, seed=seed, overwrite=overwrite)
    click.echo(str(path))


@main.command("compile")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Artifact folder [default: artifacts/<model folder name>].")
@click.option("--backend", type=click.Choice(["ort", "tensorrt"]), default="ort", show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the engines will run (export runs there too).")
@click.option("--precision", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True)
@click.option("--height", type=int, default=None, help="Optimal image height [default: the model's].")
@click.option("--width", type=int, default=None, help="Optimal image width [default: the model's].")
@click.option("--batch-size", type=int, default=1, show_default=True, help="Optimal images per call.")
@click.option("--min-height", type=int, default=None, help="[default: height/2]")
@click.option("--max-height", type=int, default=None, help="[default: 2*height]")
@click.option("--min-width", type=int, default=None, help="[default: width/2]")
@click.option("--max-width", type=int, default=None, help="[default: 2*width]")
@click.option("--min-batch-size", type=int, default=1, show_default=True)
@click.option("--max-batch-size", type=int, default=None, help="[default: max(4, batch-size)]")
@click.option("--opset", type=int, default=17, show_default=True)
@click.option("--trust-pickle", is_flag=True, help="Allow .bin/.ckpt weights (unpickling runs arbitrary code).")
@click.option("--dump-passes", type=click.Path(file_okay=False), default=None,
              help="Write the graph after each pass into this folder.")
@click.option("--timing-cache", type=click.Path(file_okay=False), default="~/.cache/diffusion-trt/timing-cache",
              show_default=True, help="TensorRT: folder of timing caches reused across builds.")
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact (only once the new one is complete).")
@_handle_errors
def compile_cmd(model_dir: Path, out_dir: Path | None, overwrite: bool, **options: Any) -> None:
    """Export MODEL_DIR (a diffusers pipeline folder) to ONNX, optimize it and build engines.

    Writes an artifact folder with one engine per component and a manifest.json (file hashes,
    shapes, passes, tool versions). A failed compile leaves nothing behind.

    \b
    Examples:
      diffusion-trt compile models/tiny -o artifacts/tiny
      diffusion-trt compile models/sd15 -o artifacts/sd15-fp16 --device cuda --precision fp16
      diffusion-trt compile models/sd15 -o artifacts/sd15 --min-height 256 --max-height 768
    """
    from .compiler.pipeline import compile_pipeline
    from .config import CompileConfig

    out_dir = out_dir or Path("artifacts") / Path(model_dir).resolve().name
    from tqdm.contrib.logging import logging_redirect_tqdm

    config = CompileConfig(**options)
    with logging_redirect_tqdm(loggers=[logger]):
        path = compile_pipeline(model_dir, out_dir, config, overwrite=overwrite, progress=True)
    _print_pass_table(path)
    click.echo(f"artifact: {path}")


def _print_pass_table(path: Path) -> None:
    from .artifacts import read_manifest

    manifest = read_manifest(path)
    click.echo("pass counts (non-zero):", err=True)
    for name, entry in manifest["components"].items():
        parts = []
        for rec in entry.get("passes", []):
            counts = ", ".join(f"{k}={v}" for k, v in rec.get("counts", {}).items() if v)
            if counts:
                parts.append(f"{rec['name']}({counts})")
        click.echo(f"  {name:<13} {'; '.join(parts) or 'no change'}", err=True)


@main.command("run")
@click.argument("artifact_dir", type=click.Path(path_type=Path))
@click.option("-p", "--prompt", required=True, help="Text prompt.")
@click.option("-n", "--negative-prompt", default=None, help="Negative prompt [default: empty].")
@click.option("--steps", type=int, default=30, show_default=True, help="Denoising steps.")
@click.option("--guidance", type=float, default=7.5, show_default=True,
              help="Classifier-free guidance scale; <= 1 disables CFG.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--height", type=int, default=None, help="[default: the artifact's opt height]")
@click.option("--width", type=int, default=None, help="[default: the artifact's opt width]")
@click.option("--batch-size", type=int, default=1, show_default=True, help="Images for the prompt.")
@click.option("--scheduler", default=None, help="Scheduler short name, e.g. ddim, euler, dpm++ [default: the model's].")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="[default: the artifact's]")
@click.option("-o", "--output", "out", type=click.Path(dir_okay=False, path_type=Path), default=Path("out.png"),
              show_default=True, help="PNG path; with several images, -1, -2 ... are appended.")
@_handle_errors
def run_cmd(artifact_dir: Path, prompt: str, negative_prompt: str | None, steps: int, guidance: float, seed: int,
            height: int | None, width: int | None, batch_size: int, scheduler: str | None, device: str | None,
            out: Path) -> None:
    """Generate images from a compiled ARTIFACT_DIR.

    \b
    Examples:
      diffusion-trt run artifacts/tiny --prompt "a guohua landscape" -o out.png
      diffusion-trt run artifacts/sd15-fp16 -p "pixel-art castle" --steps 50 --scheduler euler --seed 7
    """
    from .runtime.pipeline import EnginePipeline, save_png

    with EnginePipeline.from_artifacts(artifact_dir, device=device, scheduler=scheduler) as pipe:
        result = pipe(
            prompt=prompt,
            negative_prompt=negative_prompt,
            num_inference_steps=steps,
            guidance_scale=guidance,
            seed=seed,
            height=height,
            width=width,
            num_images_per_prompt=batch_size,
            progress=True,
        )
        params = {**result.parameters, "artifact": str(artifact_dir)}
    paths = []
    for i, image in enumerate(result.images):
        path = out if i == 0 else out.with_name(f"{out.stem}-{i}{out.suffix}")
        save_png(image, path, {**params, "index": i})
        paths.append(path)
    for path in paths:
        click.echo(f"image: {path}")


if __name__ == "__main__":
    main()

"""Command line: ``diffusion-trt compile | optimize | run | bench | inspect | verify | export-triton | serve``...

Thin on purpose: every command parses options, sets up logging and progress bars, and calls one library
function. Heavy imports (torch, diffusers, onnxruntime) happen inside the commands, so ``--help`` is fast.
Any :class:`~diffusion_trt.errors.DiffusionTrtError` becomes one ``error: ...`` line and its exit code.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import functools
import json
import logging
import math
import re
import shlex
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from .artifact.manifest import Backend, Manifest  # dataclasses: light
from .artifact.values import printable  # re and json: light
from .compiler.dummy import ARCHS  # a tuple of names: dummy.py imports torch/diffusers only when called
from .errors import DiffusionTrtError
from .runtime.generation_args import GENERATION_ARGS, MAX_SEED  # a table: numpy only
from .runtime.schedulers import scheduler_names  # a table of names: diffusers is imported only when one is built

logger = logging.getLogger("diffusion_trt")

#: --scheduler's help: every name (lms needs scipy: the schedulers extra).
SCHEDULER_HELP = (f"Scheduler, one of {', '.join(scheduler_names())} (lms needs scipy: "
                  "pip install 'diffusion-trt[schedulers]')")

#: Seeds: what torch.Generator.manual_seed takes without overflow (as the runtime checks).
SEED = click.IntRange(0, MAX_SEED)


class FiniteFloat(click.FloatRange):
    """A float option that must be a finite number, with optional bounds (as :class:`click.FloatRange`).

    Click's ``float`` takes ``nan`` and ``inf``, and NaN passes every bound of a FloatRange (each comparison is
    false): ``compile --min-cosine nan`` wrote an artifact whose manifest is not JSON. Here they fail as any bad value
    does: one ``error:`` line naming the option and the fix (its default where it has one), exit 2.
    """

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            bounds = f" ({self._describe_range()})" if self.min is not None or self.max is not None else ""
            default = getattr(param, "default", None)
            example = f", e.g. {default:g} (the default)" if isinstance(default, int | float) else ""
            self.fail(f"{value!r} is not a finite number; use a finite one{bounds}{example}", param, ctx)
        return super().convert(number, param, ctx)

    def _describe_range(self) -> str:
        """Click's range text for ``--help`` ("x<=None" without bounds: nothing then)."""
        return "" if self.min is None and self.max is None else super()._describe_range()


class PathArg(click.Path):
    """A path option or argument that refuses an empty value (an unset shell variable, exit 2 naming it): click reads
    ``''`` as ``Path('')``, the current folder, which ``run --runtime-cache ''`` then used as the cache folder,
    ``inspect ''`` as the artifact, and ``run -o ''`` refused as "'.' does not end in .png"."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("'' is empty; give a path", param, ctx)
        return super().convert(value, param, ctx)


def _run_default(name: str) -> Any:
    """``run``'s default of generation argument ``name`` (runtime/generation_args.py: the CLI's and serve's)."""
    return GENERATION_ARGS[name].default_for(front=True)


class _CliFormatter(logging.Formatter):
    """Our log lines as they are, warnings with the ``warning:`` prefix README.md promises."""

    def format(self, record: logging.LogRecord) -> str:
        text = printable(super().format(record), newlines=True)  # a log line may quote an artifact's file names
        if record.levelno != logging.WARNING:
            return text
        # the library's warnings name its arguments (cudnn_conv_algo_search='EXHAUSTIVE'): as the command's options
        return f"warning: {_typed_names(text, None, click.get_current_context(silent=True))}"


def _progress_enabled() -> bool:
    """Progress bars only on a terminal: in a log file or pipe their carriage returns garble the log lines."""
    return sys.stderr.isatty()


#: Library warnings that say nothing a user of this CLI can act on (the CLI only; the library filters nothing).
_QUIET_WARNINGS = (
    (r".*torch_dtype.*", None),  # transformers/diffusers: `torch_dtype` is deprecated, use `dtype`
    (r".*torchvision.*", None),  # image processors falling back to PIL without torchvision
    (r".*local_dir_use_symlinks.*", None),  # huggingface_hub, called so by diffusers' single-file loading
    (r".*", "accelerate"),
    (r".*", "torchvision"),
)


def _quiet_libraries() -> None:
    """Keep transformers/diffusers/accelerate chatter (optional extras, deprecations) and their progress bars off
    the CLI's output (``-v`` shows them). Their loggers read the verbosity from the environment when first used,
    so it is set here, before any of them is imported."""
    import os
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if not _progress_enabled():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")  # tqdm >= 4.66 reads it: transformers' and diffusers' bars
    for message, module in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module or "")
    for name in ("transformers", "diffusers", "accelerate", "torchvision"):
        logging.getLogger(name).setLevel(logging.ERROR)


#: ``--cudnn-algo-search`` of each command: a one-shot ``run`` pays EXHAUSTIVE's timing of every convolution on its
#: first call (SD-1.5 static 512, H200: +1.0 s first call for a 2 % faster UNet step, i.e. ~8 ms over 30 steps), a
#: long-lived ``bench`` earns it back (benchmarks/results/README.md, "Figures behind code defaults").
ALGO_SEARCH_DEFAULT = {"run": "HEURISTIC", "bench": "AUTO"}


def _runtime_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The engine options ``run`` and ``bench`` share (issue 19), passed on as ``EnginePipeline.from_artifacts``
    keywords ``cudnn_conv_algo_search``, ``deterministic``, ``size_buckets``; ``command`` picks the default search
    (:data:`ALGO_SEARCH_DEFAULT`)."""
    return functools.partial(_add_runtime_options, algo_default=ALGO_SEARCH_DEFAULT[command])


def _add_runtime_options(fn: Callable[..., Any], algo_default: str) -> Callable[..., Any]:
    why = {"HEURISTIC": "the default here: one-shot runs gain more from a fast first call than from a 2 % faster "
                        "step", "AUTO": "the default here: a benchmark measures the steady state"}[algo_default]
    for option in reversed((
        click.option("--cudnn-algo-search", "cudnn_conv_algo_search",
                     type=click.Choice(["AUTO", "EXHAUSTIVE", "HEURISTIC", "DEFAULT"], case_sensitive=False),
                     default=algo_default, show_default=True,
                     help="ORT CUDA only (elsewhere a warning says it has no effect): how cuDNN picks convolution "
                          "algorithms. EXHAUSTIVE: times each one per new shape (slow first call, ~1 s more for "
                          "SD-1.5 at 512x512, for a 2 % faster UNet step); HEURISTIC: cuDNN's heuristics, no timing "
                          f"({why if algo_default == 'HEURISTIC' else 'the fastest first call'}); DEFAULT: one fixed "
                          "algorithm (IMPLICIT_PRECOMP_GEMM); AUTO: EXHAUSTIVE for static artifacts, HEURISTIC for "
                          f"dynamic ones{' (' + why + ')' if algo_default == 'AUTO' else ''}."),
        click.option("--deterministic", is_flag=True,
                     help="ORT use_deterministic_compute + torch deterministic algorithms; an ORT CUDA artifact "
                          "also needs compile --deterministic (its fused GroupNorm is not deterministic: a warning "
                          "says so). Cost: compare with bench."),
        click.option("--size-buckets", default=None, metavar="auto|HxW[,HxW...]|off",
                     help="Dynamic ORT artifacts: static sessions per size (listed ones opened at load). A new "
                          "size runs at once on the dynamic session while its static one is made in the background "
                          "(not under --vram-budget or --deterministic, where the first call at it waits). off: none "
                          "(the default; an empty value is refused)."),
    )):
        fn = option(fn)
    return fn


def _setup_logging(verbose: int) -> None:
    level = logging.DEBUG if verbose >= 1 else logging.INFO
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CliFormatter("%(levelname)s %(name)s: %(message)s" if verbose else "%(message)s"))
    root = logging.getLogger("diffusion_trt")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    if not verbose:
        _quiet_libraries()


#: Exit codes (the top-level --help and README.md list them; errors.py maps each error class to one).
EXIT_CODES_HELP = """\b
Exit codes:
  0  success
  1  unexpected error, or a compile stage failed (export, passes, build)
  2  bad input or usage: options, model folder, LoRA, images, an output path that exists or cannot be written
  3  the artifact is missing, damaged or incompatible with this machine (verify found problems)
  4  a quantized build failed the quality gate (--accept-quality-loss writes it anyway)
  130  interrupted (Ctrl-C); a compile leaves no half-written artifact
  143  terminated (SIGTERM); a compile or run cleans up as for Ctrl-C"""

#: errno -> the fix for an OS error on a path the user gave.
_OS_ERROR_FIXES = {
    errno.EEXIST: "a file stands where a folder is needed; choose another path",
    errno.ENOTDIR: "part of the path is a file, not a folder; choose another path",
    errno.EISDIR: "it is a folder; pass a file path",
    errno.EACCES: "no permission; choose a writable location or fix the permissions",
    errno.EPERM: "no permission; choose a writable location or fix the permissions",
    errno.EROFS: "choose a location on a writable file system",
    errno.ENOSPC: "the disk is full; free space or choose another location",
    errno.ENOENT: "check the path",
}


def _os_error_message(e: OSError) -> str:
    """One line for an OS error: the path, the cause and the fix."""
    where = f"{e.filename}: " if e.filename else ""
    return f"{where}{e.strerror or e}; {_OS_ERROR_FIXES.get(e.errno or 0, 'check the path and its permissions')}"


class Terminated(BaseException):
    """SIGTERM arrived (see :func:`_terminate_like_interrupt`): unwinds like KeyboardInterrupt, so every ``with``
    block cleans up (the staging folder is deleted, the lock released); exit 143 (128 + SIGTERM)."""


#: Seconds between tries to raise a deferred :class:`Terminated` (see :func:`_sigterm_handler`).
_TERMINATE_RETRY_S = 0.05


def _swallows_exceptions(frame: Any) -> bool:
    """Whether an exception raised in ``frame`` would be lost: Python ignores what a weakref callback or the import
    machinery's module-lock callback raises ("Exception ignored in: <function _get_module_lock.<locals>.cb>", seen
    when SIGTERM landed during an import 3 s into a compile, which then ran on to exit 0)."""
    return frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                  or frame.f_code.co_name == "__del__")


def _sigterm_handler(signum: int, frame: Any) -> None:
    """Raise :class:`Terminated` here, or, where Python would swallow it (:func:`_swallows_exceptions`), again from
    a SIGALRM a moment later (a second SIGTERM kills at once either way)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _swallows_exceptions(frame):
        signal.signal(signal.SIGALRM, _sigterm_handler)
        signal.setitimer(signal.ITIMER_REAL, _TERMINATE_RETRY_S)
        return
    raise Terminated(f"signal {signal.SIGTERM if signum == signal.SIGALRM else signum}")


@contextlib.contextmanager
def _terminate_like_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM unwinds the stack like Ctrl-C instead of killing the process where it stands
    (which left a hidden ``.NAME.staging-*`` folder of the size of the artifact behind); restored afterwards."""
    try:
        previous = signal.signal(signal.SIGTERM, _sigterm_handler)
        previous_alarm = signal.getsignal(signal.SIGALRM)
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGALRM, previous_alarm)


def _handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a DiffusionTrtError into one ``error:`` line and its exit code, and an OSError (a path that cannot be
    created, read or written: a file in the way, no permission, disk full) into one line and exit 2; Ctrl-C exits
    130 (the shell's convention for SIGINT)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DiffusionTrtError as e:
            message = _as_typed(str(e), e, click.get_current_context(silent=True))
            click.echo(f"error: {printable(message, newlines=True)}", err=True)  # it may quote what an artifact says
            sys.exit(e.exit_code)
        except OSError as e:
            logger.debug("%s", type(e).__name__, exc_info=True)
            click.echo(f"error: {_os_error_message(e)}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:  # after the context managers cleaned up (staging folders, locks)
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Terminated:  # SIGTERM, raised by _terminate_like_interrupt's handler; cleaned up likewise
            click.echo("terminated", err=True)
            sys.exit(143)

    return wrapper


#: Python API names that a command's option feeds under another name (the option's own parameter name is matched
#: first): the generation arguments' ``run`` options (runtime/generation_args.py), and these.
_API_FLAGS: dict[str, str] = {
    **{a.name: a.cli for a in GENERATION_ARGS.values() if a.cli},
    "runtime_cache_dir": "--runtime-cache",
    "image": "--image",
    "mask_image": "--mask",
}
#: ``name=value`` in a message: a name, then a value as ``repr`` writes it (bool, None, number, quoted string, a flat
#: list or tuple); not inside a longer word, an option (``--pass-option pack_qkv=true``) or a path. Or an argument
#: named without a value: ``name=`` (``drop height=``), or a bare ``snake_case`` name (``mask_image is 32x32``); a bare
#: one-word name (``image``, ``strength``) is prose, left alone.
_ARG_VALUE = re.compile(
    r"(?<![\w./-])([a-z_][a-z0-9_]*)=(True|False|None|nan|-?inf|-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|'[^'\\]*'|\"[^\"\\]*\"|"
    r"\[[^\[\]()]*\]|\([^\[\]()]*\))(?!\w)"
    r"|(?<![\w./=-])([a-z_][a-z0-9_]*)=(?=[\s,;:)]|$)|(?<![\w./=-])([a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w=/-]|\.\w)"
)


def _as_typed(message: str, error: BaseException, ctx: click.Context | None) -> str:
    """``message`` with each ``name=value`` of an argument the error names (:attr:`DiffusionTrtError.arguments`, of
    the first error along its ``__cause__`` chain that names any: a stage wrapper re-raises with a prefix) written as
    the option of this command that sets it, as the user typed it: ``refit_convs=True`` -> ``--refit-convs``,
    ``backend='ort'`` -> ``--backend ort``, ``compute_capabilities=('8.9', '12.0')`` -> ``--compute-capability
    8.9,12.0``; a flag's ``False`` / an option's ``None`` -> ``no --flag``; ``mask_image`` / ``height=`` (no value)
    -> ``--mask`` / ``--height``. Names no option of the command sets stay as they are. The one place where the
    library's spelling (the Python API's) becomes the command line's."""
    names: frozenset[str] = frozenset()
    seen: set[int] = set()
    e: BaseException | None = error
    while not names and e is not None and id(e) not in seen:
        seen.add(id(e))
        names = getattr(e, "arguments", frozenset())
        e = e.__cause__
    return _typed_names(message, names, ctx) if names else message


def _typed_names(message: str, names: frozenset[str] | None, ctx: click.Context | None) -> str:
    """:func:`_as_typed` for the argument ``names`` (``None``: any option of the command, for a warning)."""
    if ctx is None:
        return message
    options = {p.name: p for p in ctx.command.params if isinstance(p, click.Option)}
    by_flag = {o: p for p in options.values() for o in p.opts}

    def option_of(name: str) -> click.Option | None:
        if names is not None and name not in names:
            return None
        return options.get(name) or by_flag.get(_API_FLAGS.get(name, ""))

    def typed(m: re.Match[str]) -> str:
        name, text = m.group(1), m.group(2)
        option = option_of(name or m.group(3) or m.group(4))
        if option is None:
            return m.group(0)
        if text is None:  # named without a value
            return max(option.opts, key=len)
        try:
            value = text if text in ("nan", "inf", "-inf") else ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return m.group(0)
        flag = max(option.opts, key=len)
        if option.is_flag and isinstance(value, bool):
            if value:
                return flag
            return option.secondary_opts[0] if option.secondary_opts else f"no {flag}"
        if value is None:
            return f"no {flag}"
        if isinstance(value, list | tuple) and option.multiple:
            return " ".join(f"{flag} {shlex.quote(str(v))}" for v in value)
        if isinstance(value, list | tuple):
            value = ",".join(str(v) for v in value)
        return f"{flag} {shlex.quote(str(value))}"

    return _ARG_VALUE.sub(typed, message)


def _backend(ctx: click.Context, param: click.Parameter, value: str) -> Backend:
    """``--backend``: the :class:`Backend` of the value ``click.Choice`` accepted (an unknown one: exit 2 there)."""
    return Backend(value)


def _vram_budget(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--vram-budget``: checked here (exit 2 naming the accepted forms), parsed again by the runtime."""
    if value is None:
        return None
    from .errors import RuntimeInputError
    from .runtime.memory.plan import parse_size

    try:
        parse_size(value)
    except RuntimeInputError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    return value


def _devices(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--devices``: an empty value (an unset shell variable) is refused (exit 2), not taken for one device."""
    if value is not None and not value.strip():
        raise click.BadParameter(f"{value!r} is empty; give CUDA devices, e.g. 0,1 or all, or drop --devices to run "
                                 "on one device", ctx=ctx, param=param)
    return value


def _sha256_hex(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``--expect-sha256``: 64 hex digits, or a usage error (exit 2) before the artifact is read."""
    from .artifact.folder import sha256_hex_problem

    problem = None if value is None else sha256_hex_problem(value)
    if problem is not None:
        raise click.BadParameter(problem, ctx=ctx, param=param)
    return value


VRAM_BUDGET_HELP = ("Device memory the pipeline may use, e.g. 8GB (10^9 bytes), 8GiB, 7.5G, 8000MB or bytes: engines "
                    "are kept resident or opened per stage to fit, ORT arenas capped, large images VAE-tiled; a budget "
                    "no plan meets is refused up front naming the smallest that works.")


class _OneLineError(click.ClickException):
    """A click error (a usage error: a missing or malformed option, an unknown command...) shown as ONE ``error:``
    line, as every wrong input is (README "Exit codes"), then, for a usage error, where the help is; same exit code
    (2 for usage errors). click's own format is three lines: ``Usage: ...``, ``Try ...``, ``Error: ...``."""

    def __init__(self, error: click.ClickException) -> None:
        super().__init__(error.format_message())
        self.exit_code = error.exit_code
        ctx = getattr(error, "ctx", None)
        self.hint = f"try '{ctx.command_path} --help'" if ctx is not None else None

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", file=file, err=True)
        if self.hint is not None:
            click.echo(self.hint, file=file, err=True)


@contextlib.contextmanager
def _one_line_click_errors() -> Iterator[None]:
    """Re-raise a click error as :class:`_OneLineError` (not the bare ``diffusion-trt``, whose error is the help)."""
    try:
        yield
    except (_OneLineError, click.exceptions.NoArgsIsHelpError):
        raise
    except click.ClickException as e:
        raise _OneLineError(e) from None


class _Cli(click.Group):
    """The ``diffusion-trt`` group: click errors of the group's and every command's options as one ``error:`` line.

    Parsing happens in :meth:`make_context` (the group's options) and :meth:`invoke` (the command's name, its options,
    its ``click.UsageError``/``click.BadParameter``), so both are wrapped; click's ``main`` then shows the error.
    """

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with _one_line_click_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        with _one_line_click_errors():
            return super().invoke(ctx)


@click.group(cls=_Cli, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
             epilog=EXIT_CODES_HELP)
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
@click.argument("out_dir", type=PathArg(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice(ARCHS), default="tiny", show_default=True,
              help="tiny: a few-MB SD-shaped pipeline for tests; sd15 / sd21 / sdxl: the true SD-1.5 (~4 GB), SD-2.1 "
                   "(768x768, v-prediction, ~5 GB) and SDXL-base (1024x1024, two text encoders, ~14 GB) architectures; "
                   "tiny-sd21 / tiny-sdxl: their structures at toy widths; sd15-inpaint / tiny-sd15-inpaint: the "
                   "SD-1.5 inpainting UNet (9 input channels), true size / toy widths.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty OUT_DIR.")
@_handle_errors
def dummy_pipeline(out_dir: Path, arch: str, seed: int, overwrite: bool) -> None:
    """Write a diffusers StableDiffusionPipeline (StableDiffusionXLPipeline for sdxl) folder with seeded random weights.

    It stands in for a trained checkpoint (none can be downloaded here): same configs, same CLIP
    tokenizer, same code paths.

    \b
    Examples:
      diffusion-trt dummy-pipeline models/tiny
      diffusion-trt dummy-pipeline --arch sd15 --seed 1 models/sd15
      diffusion-trt dummy-pipeline --arch tiny-sdxl models/tiny-sdxl
    """
    from .compiler.dummy import write_dummy_pipeline

    path = write_dummy_pipeline(out_dir, arch=arch, seed=seed, overwrite=overwrite)
    click.echo(str(path))


@main.command("dummy-lora")
@click.argument("model_dir", type=PathArg(file_okay=False, path_type=Path))
@click.argument("out", type=PathArg(dir_okay=False, path_type=Path))
@click.option("--rank", type=click.IntRange(min=1, max=1024), default=4, show_default=True, help="LoRA rank.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random matrices.")
@click.option("--overwrite", is_flag=True, help="Replace OUT if it exists.")
@_handle_errors
def dummy_lora(model_dir: Path, out: Path, rank: int, seed: int, overwrite: bool) -> None:
    """Write a seeded random LoRA (diffusers keys) for the pipeline folder MODEL_DIR to OUT (.safetensors): on the
    attention projections of its UNet and text encoder, for trying `run --lora` / `compile --lora`.

    \b
    Examples:
      diffusion-trt dummy-lora models/tiny ink.safetensors
      diffusion-trt dummy-lora models/sd15 style.safetensors --rank 64 --seed 3
    """
    from .compiler.dummy_lora import write_dummy_lora

    _refuse_inside_artifact(out, None, "output file", "OUT", _SEALED_FILE)
    _refuse_inside_model(out, model_dir, "output file", "OUT")  # --overwrite OUT=MODEL/unet/*.safetensors: its UNet
    _refuse_missing_folder(out, "OUT")  # as run -o: a typo'd folder is not made silently
    _check_writable_file(out, "OUT", ".safetensors")
    if not overwrite:
        _refuse_existing_outputs(out, 1, "OUT")  # a positional argument: there is no -o to choose
    counts = write_dummy_lora(model_dir, out, rank=rank, seed=seed)
    click.echo(f"lora: {out} ({', '.join(f'{c} {n} layers' for c, n in counts.items())})")
@main.command("dummy-controlnet")
@click.argument("out_dir", type=PathArg(file_okay=False, path_type=Path))
@click.option("--arch", type=click.Choice([a for a in ARCHS if "inpaint" not in a]), default="tiny",
              show_default=True, help="The base architecture (as dummy-pipeline's --arch).")
@click.option("--seed", type=SEED, default=0, show_default=True,
              help="Seed of the random weights (the same seed as dummy-pipeline's starts from its UNet).")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty OUT_DIR.")
@_handle_errors
def dummy_controlnet(out_dir: Path, arch: str, seed: int, overwrite: bool) -> None:
    """Write a diffusers ControlNetModel folder with seeded random weights (ControlNetModel.from_unet of the
    architecture's UNet, its zero-initialised projections drawn at random so it changes the images).

    \b
    Examples:
      diffusion-trt dummy-controlnet models/tiny-cn
      diffusion-trt dummy-controlnet --arch sd15 --seed 1 models/sd15-cn
    """
    from .compiler.dummy_controlnet import write_dummy_controlnet

    click.echo(str(write_dummy_controlnet(out_dir, arch=arch, seed=seed, overwrite=overwrite)))


@main.command("add-controlnet")
@click.argument("artifact_dir", type=PathArg(path_type=Path))
@click.argument("model_dir", type=PathArg(path_type=Path))
@click.argument("controlnets", nargs=-1, required=True, metavar="[NAME=]FOLDER|FILE.safetensors...")
@click.option("--replace", is_flag=True, help="Swap a ControlNet the artifact has already.")
@_handle_errors
def add_controlnet_cmd(artifact_dir: Path, model_dir: Path, controlnets: tuple[str, ...], replace: bool) -> None:
    """Add ControlNets to ARTIFACT_DIR (compiled with --controlnet, so it has unet_controlnet) without rebuilding the
    UNet: each is compiled with the artifact's own settings as cond_embed_NAME and controlnet_NAME and the manifest
    is resealed.

    MODEL_DIR is the diffusers folder the artifact was compiled from (checked by its sha256).

    \b
    Examples:
      diffusion-trt add-controlnet artifacts/tiny-cn models/tiny depth=models/tiny-depth
      diffusion-trt add-controlnet artifacts/tiny-cn models/tiny canny=models/tiny-canny-v2 --replace
    """
    from .compiler.controlnet import parse_controlnet_arg
    from .compiler.controlnet_add import add_controlnets

    pairs = tuple(parse_controlnet_arg(x) for x in controlnets)
    from tqdm.contrib.logging import logging_redirect_tqdm

    with _terminate_like_interrupt(), logging_redirect_tqdm(loggers=[logger]):
        path = add_controlnets(artifact_dir, model_dir, pairs, replace=replace, progress=_progress_enabled())
    click.echo(f"artifact: {path}")


@main.command("compile")
@click.argument("model_dir", type=PathArg(path_type=Path))
@click.option("--revision", default=None,
              help="With a Hugging Face model id (org/name): the branch, tag or commit [default: main].")
@click.option("--variant", default=None, help="With a model id: the weights variant to read, e.g. fp16.")
@click.option("-o", "--output", "out_dir", type=PathArg(file_okay=False, path_type=Path), default=None,
              help="Artifact folder [default: artifacts/<model folder name>].")
@click.option("--backend", type=click.Choice([b.value for b in Backend]), default=Backend.ORT.value, callback=_backend,
              show_default=True,
              help="ort: ONNX Runtime; tensorrt: full TensorRT (built on the GPU it runs on); tensorrt-rtx: TensorRT "
                   "for RTX (built on any machine, even without a GPU, for --compute-capability).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where the engines will run (export runs there too when it has a GPU) [default: cpu; cuda for the "
                   "TensorRT backends].")
@click.option("--components", default=None, metavar="NAME[,NAME...]",
              help="Build only these components (text_encoder, unet, vae_decoder, vae_encoder; SDXL adds "
                   "text_encoder_2 with text_encoder; with --controlnet also unet_controlnet, cond_embed_NAME and "
                   "controlnet_NAME, which brings its cond_embed_NAME) [default: all].")
@click.option("--compute-capability", "compute_capabilities", default=None, metavar="CC[,CC...]|current",
              help="tensorrt-rtx: the GPUs to build for, e.g. 8.6,8.9,12.0 (RTX 30xx, 40xx, 50xx), or 'current' "
                   "for this machine's GPU [default: TensorRT-RTX's portable set 8.0,8.6,8.9,12.0].")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8", "fp8"]), default="fp32", show_default=True,
              help="int8: ORT CPU or TensorRT; fp8: TensorRT on compute capability >= 8.9. Both calibrate the UNet "
                   "(see --calibration-*) and gate its quality against fp32.")
@click.option("--calibration-prompts", default="builtin", show_default=True,
              help="int8/fp8: 'builtin' (64 bundled prompts) or a text FILE, one prompt a line.")
@click.option("--calibration-size", type=click.IntRange(min=1), default=32, show_default=True,
              help="int8/fp8: calibration prompts N (one image each).")
@click.option("--calibration-steps", type=click.IntRange(min=1), default=8, show_default=True,
              help="int8/fp8: UNet inputs captured per prompt K, spread over the schedule.")
@click.option("--calibration-seed", type=SEED, default=0, show_default=True, help="int8/fp8: seed of the latents.")
@click.option("--calibration-method", type=click.Choice(["minmax", "entropy", "percentile"]), default="minmax",
              show_default=True, help="int8: ONNX Runtime calibrator (fp8 always uses 'distribution').")
@click.option("--calibration-cache", type=PathArg(), default=None,
              help="int8/fp8: reuse a calibration cache (FILE, or a DIR / artifact holding one) when the settings "
                   "match; a DIR without one receives the new cache.")
@click.option("--quantize-vae", is_flag=True, help="int8/fp8: quantize the VAE decoder too.")
@click.option("--quantize-exclude", default=None,
              help="int8/fp8: comma-separated categories and/or node names left unquantized, 'none' for none "
                   "[default: first_conv,last_conv,time_embedding,attention_scores,softmax,normalization].")
@click.option("--smooth-quant-alpha", type=FiniteFloat(0, 1), default=None,
              help="int8/fp8: SmoothQuant with this alpha (needs neural-compressor) [default: off].")
@click.option("--min-cosine", type=FiniteFloat(min=0, max=1), default=0.98, show_default=True,
              help="Quality gate: worst per-step cosine similarity of the quantized UNet vs fp32.")
@click.option("--min-psnr", type=FiniteFloat(), default=20.0, show_default=True,
              help="Quality gate: worst final-image PSNR (dB) vs fp32 on held-out prompts.")
@click.option("--accept-quality-loss", is_flag=True, help="Write a quantized artifact even below the quality gate.")
@click.option("--target-compute-capability", default=None,
              help="fp8: compute capability of the target GPU, e.g. 9.0 [default: this machine's GPU].")
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
@click.option("--max-clip-skip", type=int, default=2, show_default=True,
              help="The text encoder (SDXL: both) also serves run --clip-skip 1..N (one extra output; 0..11, at "
                   "most its layers less one; 0 = the text encoder of before).")
@click.option("--max-embedding-vectors", type=int, default=128, show_default=True,
              help="The text encoder (SDXL: both) takes up to N textual-inversion vectors (run --embedding; 0..1024; "
                   "0 = the text encoder of before, which refuses embeddings).")
@click.option("--max-prompt-chunks", type=int, default=3, show_default=True,
              help="Long prompts: the UNet takes up to N chunks of 75 tokens (1..8; 1 = 77 tokens, the artifact of "
                   "before). A static profile keeps 1.")
@click.option("--trust-pickle", is_flag=True, help="Allow .bin/.ckpt weights (unpickling runs arbitrary code).")
@click.option("--lora", "loras", multiple=True, metavar="FILE[:SCALE]",
              help="Merge a LoRA (.safetensors, diffusers or kohya format) into the weights before export, scale "
                   "default 1; repeatable, merged in order. Recorded in the manifest.")
@click.option("--controlnet", "controlnets", multiple=True, metavar="[NAME=]FOLDER|FILE.safetensors",
              help="Add a diffusers ControlNetModel folder, or a single-file ControlNet (A1111/LDM layout, its config "
                   "from FILE.yaml or a config.json beside it), as the components cond_embed_NAME (its control-image "
                   "embedding, run once per call) and controlnet_NAME (NAME default: the folder's or file's name), "
                   "and the UNet with ControlNet residual inputs as unet_controlnet (the "
                   "plain unet stays); repeatable.")
@click.option("--refittable", is_flag=True,
              help="LoRAs per request without a rebuild (run --lora, EnginePipeline.load_lora): TensorRT: refittable "
                   "engines; ONNX Runtime: the UNet/text-encoder Linear and 1x1 Conv weights become graph inputs "
                   "(attention, proj, ff, text-encoder LoRAs; the UNet keeps NHWC on CUDA).")
@click.option("--refit-convs", is_flag=True,
              help="With --refittable on ONNX Runtime: the 3x3 (spatial) Conv weights become graph inputs too, for "
                   "LoCon/LyCORIS conv LoRAs; those engines run NCHW on CUDA, slower.")
@click.option("--fp16-safe-vae", is_flag=True,
              help="SDXL, --precision fp16: build the VAE in fp16 too (only for an fp16-safe VAE, e.g. "
                   "sdxl-vae-fp16-fix). By default it stays fp32 unless vae/config.json says force_upcast: false.")
@click.option("--deterministic", is_flag=True,
              help="ORT CUDA: leave GroupNorm unfused (ORT's GroupNorm kernel is not run-to-run deterministic); "
                   "run with --deterministic too. Elsewhere no effect (a warning says so). Slower: SD-1.5 512x512, "
                   "H100, 50 steps: 0.486 vs 0.378 s an image.")
@click.option("--dump-passes", type=PathArg(file_okay=False), default=None,
              help="Write the graph after each pass into this folder.")
@click.option("--pass-option", "pass_options", multiple=True, metavar="KEY=VALUE",
              help="An option for the passes (PassContext.options; each pass's docstring lists its own), e.g. "
                   "pack_qkv=true or fuse_attention_emit=none (the keys: diffusion_trt/passes/options.py); VALUE is "
                   "read as JSON when it parses. Repeatable.")
@click.option("--timing-cache", type=PathArg(file_okay=False), default="~/.cache/diffusion-trt/timing-cache",
              show_default=True, help="TensorRT: folder of timing caches reused across builds.")
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact (only once the new one is complete).")
@click.option("--lock-timeout", type=FiniteFloat(min=0), default=0, show_default=True,
              help="Seconds to wait while another compile writes the same folder (0 = fail at once).")
@click.option("--snap", is_flag=True, help="Snap image sizes that are not multiples of 8 to the nearest one (logged).")
@click.option("--prediction-type", type=click.Choice(["auto", "epsilon", "v_prediction"]), default="auto",
              show_default=True,
              help="Single-file checkpoints: what the UNet predicts. auto: v_prediction for SD 2.x (the 768-v "
                   "releases; the weights cannot tell 768-v from 512-base), epsilon for SD 2.x inpainting, SD 1.x "
                   "and SDXL.")
@click.option("--no-cache", is_flag=True, help="Compile from scratch; neither read nor fill the compile cache.")
@click.option("--cache-dir", type=PathArg(path_type=Path), default=None,
              help="Compile cache folder [default: $DIFFUSION_TRT_CACHE, else $XDG_CACHE_HOME/diffusion-trt/compile, "
                   "else ~/.cache/diffusion-trt/compile].")
@click.option("--cache-max-gb", type=FiniteFloat(min=0, min_open=True), default=20.0, show_default=True,
              help="Size bound of the compile cache; least recently used artifacts are evicted beyond it.")
@_handle_errors
def compile_cmd(model_dir: Path, out_dir: Path | None, overwrite: bool, snap: bool, lock_timeout: float,
                prediction_type: str, no_cache: bool, cache_dir: Path | None, cache_max_gb: float,
                revision: str | None, variant: str | None, **options: Any) -> None:
    """Export MODEL_DIR (a diffusers pipeline folder, one A1111/ComfyUI .safetensors checkpoint, or a Hugging Face
    model id org/name, read from the local cache with HF_HUB_OFFLINE=1) to ONNX, optimize it and build engines.

    Writes an artifact folder with one engine per component and a manifest.json (file hashes,
    shapes, passes, tool versions). A failed compile leaves nothing behind. A single file (SD 1.x, SD 2.x,
    SDXL base, SD 1.x/2.x inpainting) is identified from its keys and shapes and converted offline with the
    architecture configs shipped here. An identical earlier compile (same weights, LoRAs, options, tool
    versions and machine) is reused from the compile cache; the manifest's "cache" says so.

    \b
    Examples:
      diffusion-trt compile models/tiny -o artifacts/tiny
      diffusion-trt compile models/sd15 -o artifacts/sd15-fp16 --device cuda --precision fp16
      diffusion-trt compile models/sd15 -o artifacts/sd15-rtx --backend tensorrt-rtx --precision fp16
      diffusion-trt compile models/sd15 -o artifacts/sd15-4090 --backend tensorrt-rtx --precision fp8 \
          --compute-capability 8.9 --calibration-size 8
      diffusion-trt compile models/sd15 -o artifacts/sd15 --min-height 256 --max-height 768
      diffusion-trt compile models/tiny -o artifacts/tiny-int8 --precision int8 --calibration-size 8
      diffusion-trt compile models/sd15 -o artifacts/sd15-ink --lora ink.safetensors:0.8 --lora detail.safetensors
      diffusion-trt compile style.safetensors -o artifacts/style
      diffusion-trt compile sd21-768.safetensors -o artifacts/sd21 --prediction-type v_prediction
      diffusion-trt compile models/tiny -o artifacts/tiny-cn --controlnet canny=models/tiny-cn
    """
    from .compiler.frontend import compile_model
    from .config import CompileConfig

    out_dir = out_dir or Path("artifacts") / (Path(model_dir).stem if Path(model_dir).is_file()
                                              else Path(model_dir).resolve().name)
    from .artifact.folder import enclosing_artifact

    around = enclosing_artifact(out_dir.expanduser().resolve().parent)  # -o ART/sub: an artifact sealed into another
    if around is not None:
        _refuse_inside_artifact(out_dir, around, "output folder", "-o", _SEALED_FILE)
    cache = _compile_cache(no_cache, cache_dir, cache_max_gb, out_dir, Path(model_dir))
    from tqdm.contrib.logging import logging_redirect_tqdm

    if snap:
        for key in ("height", "width", "min_height", "max_height", "min_width", "max_width"):
            options[key] = _snap(key, options[key])
    _warn_unused_compile_options(options)
    quantize = _quantize_config(options)  # pops the int8/fp8 options first
    from .lora import parse_lora_arg

    options["loras"] = tuple(parse_lora_arg(x) for x in options["loras"])
    from .compiler.controlnet import parse_controlnet_arg

    options["controlnets"] = tuple(parse_controlnet_arg(x) for x in options["controlnets"])
    options["pass_options"] = _parse_pass_options(options["pass_options"])
    if options["device"] is None:
        options["device"] = "cuda" if options["backend"].is_tensorrt else "cpu"
    if options["components"] is None:
        del options["components"]
    else:
        options["components"] = tuple(c.strip() for c in options["components"].split(",") if c.strip())
    if options["compute_capabilities"] is not None:
        options["compute_capabilities"] = tuple(c.strip() for c in options["compute_capabilities"].split(",")
                                                if c.strip())
    if options["dump_passes"] is not None:  # the graphs are written after export: check the folder now
        _refuse_inside_artifact(Path(options["dump_passes"]), out_dir, "dump folder", "--dump-passes")
        _refuse_inside_model(Path(options["dump_passes"]), Path(model_dir), "dump folder", "--dump-passes")
        _check_writable_dir(Path(options["dump_passes"]), "--dump-passes")
    config = CompileConfig(**options, quantize=quantize)
    with _terminate_like_interrupt(), logging_redirect_tqdm(loggers=[logger]):
        path = compile_model(model_dir, out_dir, config, cache=cache, prediction_type=prediction_type,
                             overwrite=overwrite, progress=_progress_enabled(), lock_timeout=lock_timeout,
                             revision=revision, variant=variant)
    _print_pass_table(path)
    click.echo(f"artifact: {path}")


def _compile_cache(no_cache: bool, cache_dir: Path | None, max_gb: float, out_dir: Path, model_dir: Path) -> Any:
    """The CompileCache of ``--cache-dir`` / the environment, or ``None`` with ``--no-cache``.

    Raises:
        click.BadParameter: the cache folder cannot be created or written (naming it, and where it came from), or
            it is or lies inside the artifact folder ``out_dir`` (which is sealed) or the model folder ``model_dir``.
    """
    if no_cache:
        unused = _given(("cache_dir", "cache_max_gb"))
        if unused:
            logger.warning("%s: no effect with --no-cache", " ".join(unused))
        return None
    from .compiler.cache import ENV_DIR, CompileCache, default_cache_dir

    root = cache_dir.expanduser() if cache_dir is not None else default_cache_dir()
    flag = "--cache-dir" if cache_dir is not None else f"--cache-dir (default from ${ENV_DIR} or $XDG_CACHE_HOME; or " \
        "pass --no-cache)"
    _refuse_inside_artifact(root, out_dir, "cache folder", flag)
    _refuse_inside_model(root, model_dir, "cache folder", flag)
    _check_writable_dir(root, flag)
    return CompileCache(root, max_bytes=int(max_gb * (1 << 30)))


def _refuse_inside_artifact(folder: Path, out_dir: Path | None, what: str, flag: str,
                            why: str = "is sealed and replaced whole; choose a folder outside it") -> None:
    """Refuse a path of ours that is or lies inside the artifact folder ``out_dir`` (the one the command reads or
    writes), or inside any other artifact folder (found by its sealed manifest,
    :func:`~diffusion_trt.artifact.folder.enclosing_artifact`): a folder compile writes (the compile cache, the pass
    dumps) would be sealed in (verify fails) or, with --overwrite, deleted with the old artifact; a file run or bench
    writes (``-o``, ``--json``, ``--plot``) would be one the sealed manifest does not list (``why``).

    Raises:
        click.BadParameter: naming the path and the artifact folder.
    """
    from .artifact.folder import enclosing_artifact

    f = folder.expanduser().resolve()
    o = out_dir.expanduser().resolve() if out_dir is not None else None
    if o is None or not (f == o or o in f.parents):
        out_dir = o = enclosing_artifact(f)
    if out_dir is not None and o is not None:
        named = str(out_dir) if out_dir.is_absolute() else f"{out_dir} ({o})"
        raise click.BadParameter(f"the {what} {folder} lies inside the artifact folder {named}, which {why}",
                                 param_hint=flag)


def _refuse_inside_model(folder: Path, model_dir: Path, what: str, flag: str) -> None:
    """Refuse a folder compile writes (the compile cache, the pass dumps), or a file (``dummy-lora OUT``), that is or
    lies inside the model folder: its files become part of the model's weights hash, so an identical recompile missed
    the cache every time (the cache growing inside the model), and ``verify --source`` said the weights differ from
    the ones compiled; ``dummy-lora MODEL MODEL/unet/diffusion_pytorch_model.safetensors --overwrite`` replaced the
    model's UNet weights by the LoRA.

    Raises:
        click.BadParameter: naming the path and the model folder.
    """
    if not (model_dir / "model_index.json").is_file():  # a single file, a model id or no model: nothing to spoil
        return
    f, m = folder.expanduser().resolve(), model_dir.resolve()
    if f == m or m in f.parents:
        raise click.BadParameter(f"the {what} {folder} lies inside the model folder {model_dir}, whose files are "
                                 "hashed as the model's weights; choose a folder outside it", param_hint=flag)


#: ``why`` of :func:`_refuse_inside_artifact` for a file run or bench writes.
_SEALED_FILE = ("is sealed: its manifest lists every file, and verify reports any other; write it outside the "
                "artifact folder")


def _parse_pass_options(items: tuple[str, ...]) -> dict[str, Any]:
    """``("pack_qkv=false", "fuse_attention_emit=none")`` -> ``{"pack_qkv": False, "fuse_attention_emit": "none"}``."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{item!r} is not KEY=VALUE (e.g. pack_qkv=false)", param_hint="--pass-option")
        try:
            parsed[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            parsed[key.strip()] = value
    return parsed


#: compile options that only int8/fp8 builds read.
_QUANTIZE_OPTIONS = ("calibration_prompts", "calibration_size", "calibration_steps", "calibration_seed",
                     "calibration_method", "calibration_cache", "quantize_vae", "quantize_exclude",
                     "smooth_quant_alpha", "min_cosine", "min_psnr", "accept_quality_loss", "target_compute_capability")


def _given(names: tuple[str, ...]) -> list[str]:
    """The options among ``names`` (parameter names) set on the command line, as ``--flags``."""
    ctx = click.get_current_context()
    return [f"--{n.replace('_', '-')}" for n in names
            if ctx.get_parameter_source(n) not in (None, click.core.ParameterSource.DEFAULT)]


def _warn_unused_compile_options(options: dict[str, Any]) -> None:
    """One warning line per compile option given where it has no effect (the build goes on)."""
    from .config import QUANTIZED_PRECISIONS

    precision, backend = options["precision"], options["backend"]
    unused = _given(_QUANTIZE_OPTIONS) if precision not in QUANTIZED_PRECISIONS else []
    if unused:
        logger.warning("%s: no effect with --precision %s (calibration and quantization options apply to int8/fp8)",
                       " ".join(unused), precision)
    if backend is not Backend.TENSORRT and _given(("timing_cache",)):
        logger.warning("--timing-cache: no effect with --backend %s (it caches full TensorRT's kernel timings; "
                       "TensorRT-RTX times no kernels at build)", backend)
    if options.get("refittable") and options.get("controlnets") and backend is not Backend.ORT:
        logger.warning("--refittable with --controlnet: on --backend %s run-time LoRAs reach unet and the text "
                       "encoders, not unet_controlnet (the UNet a call with a control image runs), so such a call is "
                       "refused while a LoRA changes the UNet; for ControlNet calls merge the LoRA with --lora "
                       "FILE:SCALE, or compile for --backend ort, whose unet_controlnet takes them", backend)
    if backend is Backend.TENSORRT_RTX and _given(("target_compute_capability",)):
        logger.warning("--target-compute-capability: no effect with --backend tensorrt-rtx (the plans are built for "
                       "--compute-capability)")


def _quantize_config(options: dict[str, Any]) -> Any:
    """Pop the int8/fp8 options out of ``options`` into a QuantizeConfig."""
    from .config import QuantizeConfig

    exclude = options.pop("quantize_exclude")
    if exclude is not None:
        exclude = () if exclude.strip().lower() == "none" else tuple(x.strip() for x in exclude.split(",") if x.strip())
    return QuantizeConfig(
        components=("unet", "vae_decoder") if options.pop("quantize_vae") else ("unet",),
        prompts=options.pop("calibration_prompts"),
        size=options.pop("calibration_size"),
        steps=options.pop("calibration_steps"),
        seed=options.pop("calibration_seed"),
        method=options.pop("calibration_method"),
        cache=options.pop("calibration_cache"),
        exclude=exclude,
        smooth_quant_alpha=options.pop("smooth_quant_alpha"),
        min_cosine=options.pop("min_cosine"),
        min_psnr=options.pop("min_psnr"),
        accept_quality_loss=options.pop("accept_quality_loss"),
        target_compute_capability=options.pop("target_compute_capability"),
    )


def _snap(name: str, value: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    """``--snap``: the nearest valid image size (config.snap_image_size), logged when it differs."""
    from .config import snap_image_size
    from .errors import RuntimeInputError

    if value is None:
        return None
    if value < 1:  # snapping -8 to the profile's smallest size would hide a typo
        raise RuntimeInputError(f"--{name.replace('_', '-')} {value} must be positive (--snap rounds a size to a "
                                f"multiple of 8, it does not replace one below 1); use e.g. {lo or 512}")
    snapped = snap_image_size(value, lo, hi)
    if snapped != value:
        logger.warning("--snap: %s %d -> %d (multiples of 8%s)", name.replace("_", "-"), value, snapped,
                       f", profile {lo}..{hi}" if lo is not None else "")
    return snapped


def _read_image(path: Path, flag: str, mode: str, max_hw: tuple[int, int] | None = None) -> Any:
    """``--image`` / ``--mask``: the file as a PIL image in ``mode`` (:func:`~.runtime.image_inputs.read_image_file`).

    Raises:
        click.BadParameter: naming ``flag``, with the reason the runtime gives.
    """
    from .errors import RuntimeInputError
    from .runtime.image_inputs import read_image_file

    try:
        return read_image_file(path, mode, max_hw)
    except RuntimeInputError as e:
        raise click.BadParameter(str(e), param_hint=flag) from None


def _profile_max_hw(manifest: Manifest) -> tuple[int, int]:
    """The largest (height, width) of the artifact's profile, to refuse a too-large image before it is decoded."""
    return manifest.profile.height.max, manifest.profile.width.max


def _read_manifest(artifact_dir: Path) -> tuple[Manifest | None, DiffusionTrtError | None]:
    """``run``'s one read of the artifact's typed manifest (schema and seal checked), or the reason it failed: raised
    only where a fact is needed before loading (``from_artifacts`` says what is wrong with the artifact otherwise)."""
    try:
        return Manifest.read(artifact_dir), None
    except DiffusionTrtError as e:
        return None, e


def _warn_vram_budget_on_cpu(vram_budget: str | None, device: str | None, artifact_dir: Path) -> None:
    """One ``warning:`` line when ``--vram-budget`` is given for a CPU run (``device``, or unset: the device the
    artifact was compiled for): the budget plans GPU memory, and nothing caps or measures host RAM; the plan still
    applies (and refuses a budget below its smallest). An unreadable manifest warns nothing (loading reports it)."""
    if vram_budget is None:
        return
    if device is None:
        manifest, _ = _read_manifest(artifact_dir)
        device = manifest.device if manifest is not None else None
    if device == "cpu":
        # not "no effect": the plan (a CUDA context counted) still picks the engines kept open, and refuses a budget
        # below its smallest plan
        logger.warning("--vram-budget %s on the CPU plans as for a GPU (CUDA context included) and does not cap host "
                       "RAM (not measured): it only picks which engines stay open between stages; drop it, or run on "
                       "CUDA (--device cuda)", vram_budget)


def _needed(read: tuple[Manifest | None, DiffusionTrtError | None]) -> Manifest:
    """The manifest :func:`_read_manifest` read, or its failure raised."""
    manifest, problem = read
    if manifest is None:
        raise problem  # type: ignore[misc]
    return manifest


def _check_writable_file(path: Path, flag: str, suffix: str | None) -> None:
    """Refuse an output path that cannot be written, before any work.

    Raises:
        click.BadParameter: wrong suffix, or a parent folder that cannot be created or written.
    """
    if suffix is not None and path.suffix.lower() != suffix:
        raise click.BadParameter(f"{str(path)!r} does not end in {suffix}; use e.g. out{suffix}", param_hint=flag)
    _check_writable_dir(path.parent if str(path.parent) else Path("."), flag)


def _refuse_missing_folder(path: Path, flag: str) -> None:
    """Refuse an output file whose folder does not exist (``run -o``: ``image.save`` in diffusers and PIL raises
    there too), naming the first missing folder, instead of creating the folders of a mistyped path.

    Raises:
        click.BadParameter: naming the missing folder and the fix.
    """
    folder = path.parent if str(path.parent) else Path(".")
    if folder.exists():
        return  # a folder, or a file that _check_writable_dir names
    missing = folder
    while not missing.parent.exists() and missing.parent != missing:
        missing = missing.parent
    if not missing.parent.is_dir():
        return  # a file on the way: _check_writable_dir says so
    raise click.BadParameter(f"the folder {missing} does not exist; create it first (mkdir -p {folder}) or choose "
                             "another path", param_hint=flag)


def _check_writable_dir(folder: Path, flag: str) -> None:
    """Create ``folder`` (and its parents) if needed and refuse it when that fails or it is not writable.

    Raises:
        click.BadParameter: naming the folder, the cause and the fix.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        fix = _OS_ERROR_FIXES.get(e.errno or 0, "choose another path")
        raise click.BadParameter(f"cannot create the folder {folder} ({e.strerror}); {fix}", param_hint=flag) from None
    try:  # a file made and removed, not os.access: root passes that everywhere (/proc, an NFS root_squash mount)
        _probe_writable(folder)
    except OSError as e:  # ENOENT here: a folder that holds no new files (/proc), not a path to check
        fix = _OS_ERROR_FIXES.get(e.errno or 0, "choose another path") if e.errno != errno.ENOENT else \
            "choose another path"
        raise click.BadParameter(f"the folder {folder} is not writable ({e.strerror}); {fix}", param_hint=flag) \
            from None


def _check_output_file(path: Path, flag: str, example: str) -> None:
    """Refuse, before any work, a file that is written only at the end (``bench --json/--plot``): a folder, a path
    under a file, in a folder that does not exist (as ``run -o``: a mistyped folder is not made), or a place where no
    file can be created or written. Changes nothing: an existing file is opened for appending and closed (not
    truncated), a probe file in the folder is removed at once.

    Raises:
        OutputPathError: naming the flag, the path, the cause and the fix (exit 2).
    """
    from .errors import OutputPathError

    if path.is_dir():
        raise OutputPathError(f"{flag} {path} is a folder; pass a file path, e.g. {path / example}")
    chain = (path, *path.parents)
    at = next((i for i, p in enumerate(chain) if p.exists()), len(chain))
    folder = chain[at] if at < len(chain) else Path(".")
    if folder != path and not folder.is_dir():
        raise OutputPathError(f"{flag} {path}: {folder} is a file, not a folder; choose another path")
    if at > 1:  # the file's folder is missing: chain[at - 1] is the first missing one
        raise OutputPathError(f"{flag} {path}: the folder {chain[at - 1]} does not exist; create it first (mkdir -p "
                              f"{path.parent}) or choose another path")
    try:
        _probe_writable(path if folder == path else folder)
    except OSError as e:
        where = f"cannot write {path}" if folder == path else f"cannot create a file in {folder}"
        raise OutputPathError(f"{flag} {path}: {where} ({e.strerror}); "
                              f"{_OS_ERROR_FIXES.get(e.errno or 0, 'choose another path')}") from None


def _probe_writable(target: Path) -> None:
    """Open an existing file for appending (no truncation, no write), or create and remove a probe file in a folder.

    Raises:
        OSError: the file or folder cannot be written.
    """
    import os
    import tempfile

    if not target.is_dir():
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))  # a FIFO without reader: ENXIO
        return
    fd, probe = tempfile.mkstemp(dir=target, prefix=".diffusion-trt-probe-")
    os.close(fd)
    os.unlink(probe)


def _write_output_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (checked by :func:`_check_output_file`; its folder made again if it was removed
    while the benchmark ran, so that the result is not lost)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _output_path(out: Path, index: int) -> Path:
    """``run``'s PNG of image ``index``: ``-o`` itself for the first, then ``OUT-1.png``, ``OUT-2.png`` ..."""
    return out if index == 0 else out.with_name(f"{out.stem}-{index}{out.suffix}")


def _refuse_existing_outputs(out: Path, count: int, flag: str = "-o") -> None:
    """Refuse a ``run`` whose ``count`` PNGs (:func:`_output_path`; ``optimize``'s one OUTPUT: ``count=1``) would
    replace files that exist (without ``--overwrite``). Lists the folder once, so ``--batch-size 100000000`` costs
    no 10^8 checks.

    Raises:
        OutputPathError: naming the first existing file (and how many), and the fix.
    """
    from .errors import OutputPathError

    existing = _existing_outputs(out, count)
    if len(existing) == 1:
        raise OutputPathError(f"{existing[0]} already exists; pass --overwrite to replace it, or choose another {flag}")
    if existing:
        raise OutputPathError(f"{existing[0]} and {len(existing) - 1} more of the {count} PNGs this run writes already "
                              f"exist; pass --overwrite to replace them, or choose another {flag}")


def _existing_outputs(out: Path, count: int) -> list[Path]:
    """The paths among the ``count`` PNGs of a run (:func:`_output_path`) that exist, the folder listed once."""
    import os
    import re

    existing = [out] if os.path.lexists(out) else []
    if count > 1 and out.parent.is_dir():
        sibling = re.compile(rf"{re.escape(out.stem)}-([1-9]\d*){re.escape(out.suffix)}")
        for entry in sorted(os.listdir(out.parent)):
            m = sibling.fullmatch(entry)
            if m and int(m.group(1)) < count:
                existing.append(out.parent / entry)
    return existing


def _refuse_folders_among_outputs(out: Path, count: int) -> None:
    """``run --overwrite``: refuse, before the run, a folder where one of its PNGs goes (``-o a.png`` with a folder
    ``a-1.png``): no PNG replaces a folder, and the run failed after denoising, with a.png written, naming the
    temporary file it had made (``.a-1.png.XXXX.tmp: Is a directory``).

    Raises:
        OutputPathError: naming the folder and the fix.
    """
    from .errors import OutputPathError

    folders = [p for p in _existing_outputs(out, count) if p.is_dir() and not p.is_symlink()]
    if folders:
        raise OutputPathError(f"{folders[0]} is a folder, where this run writes a PNG; --overwrite replaces files "
                              "only: move the folder or choose another -o")


def _print_pass_table(path: Path) -> None:
    from .artifact.summary import pass_table

    click.echo("pass counts (non-zero):", err=True)
    for line in pass_table(Manifest.read(path)):
        click.echo(f"  {line}", err=True)


@main.command("optimize")
@click.argument("source", type=PathArg(path_type=Path))
@click.option("-o", "--output", type=PathArg(dir_okay=False, path_type=Path), required=True,
              help="Optimized .onnx to write (weights beside it in OUTPUT.data when > ~1.8 GB).")
@click.option("--target", type=click.Choice(["ort-cuda", "ort-cpu", "tensorrt"]), default="ort-cuda",
              show_default=True, help="Which engine the graph is for: picks the fusions' emitted ops.")
@click.option("--precision", type=click.Choice(["fp32", "fp16"]), default="fp32", show_default=True,
              help="fp16: convert_fp16 with the activation range check (overflowing tensors stay fp32).")
@click.option("--dump-passes", type=PathArg(), default=None,
              help="Write the graph before the first pass and after each pass into this folder.")
@click.option("--pass-option", "pass_options", multiple=True, metavar="KEY=VALUE",
              help="Per-pass option (JSON value), e.g. fuse_attention_emit=none; repeatable.")
@click.option("--check", is_flag=True,
              help="Run original and optimized graphs in ONNX Runtime; report max abs / cosine per output and "
                   "exit 1 (OUTPUT not written) when one fails: cosine < 0.999, or max abs over 0.05 x the output's "
                   "scale for fp16 (0.001 x for fp32), or inf/NaN where the original's is finite.")
@click.option("--inputs", type=PathArg(dir_okay=False, path_type=Path), default=None,
              help="An .npz with one array per graph input (fp16 calibration and --check); default: random.")
@click.option("--shape", "shapes", multiple=True, metavar="NAME:DxDx..",
              help="Dims of a random input, e.g. sample:1x4x64x64 (unknown dims are otherwise 1); repeatable.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random inputs.")
@click.option("--json", "json_path", type=PathArg(dir_okay=False, path_type=Path), default=None,
              help="Also write the counts, fp16 islands and parity as JSON here.")
@click.option("--overwrite", is_flag=True, help="Replace an existing OUTPUT (and its external-data file).")
@_handle_errors
def optimize_cmd(source: Path, output: Path, target: str, precision: str, dump_passes: str | None,
                 pass_options: tuple[str, ...], check: bool, inputs: Path | None, shapes: tuple[str, ...],
                 seed: int, json_path: Path | None, overwrite: bool) -> None:
    """Optimize any ONNX file SOURCE for an engine: the pass pipeline of compile, on one graph.

    \b
    Examples:
      diffusion-trt optimize unet.onnx -o unet.opt.onnx --target tensorrt --precision fp16 --check
      diffusion-trt optimize model.onnx -o out.onnx --target ort-cpu --shape x:1x3x48x320 --check
      diffusion-trt optimize model.onnx -o out.onnx --pass-option fuse_attention_emit=none --dump-passes dump/
    """
    from .errors import ModelFileError
    from .optimize import check_verdict, format_table, optimize_file, parse_shape

    if not click.get_current_context().find_root().params.get("verbose"):  # the table says it all once
        logging.getLogger("diffusion_trt.passes.base").setLevel(logging.WARNING)

    if output.suffix.lower() != ".onnx":
        raise click.BadParameter(f"{str(output)!r} does not end in .onnx; use e.g. out.onnx", param_hint="--output")
    if _same_file(output, Path(source)):
        raise click.BadParameter(f"{str(output)!r} is the input file; write the result elsewhere",
                                 param_hint="--output")
    _refuse_clashing_outputs(Path(source), output, json_path, Path(dump_passes) if dump_passes else None)
    for path, flag, what in ((output, "--output", "output file"), (json_path, "--json", "output file"),
                             (dump_passes, "--dump-passes", "dump folder")):
        if path is not None:  # as run -o: a file the sealed manifest does not list fails verify
            _refuse_inside_artifact(Path(path), None, what, flag, _SEALED_FILE)
    if not overwrite:  # as run -o: nothing is replaced unless asked
        _refuse_existing_outputs(output, 1)
    _check_writable_dir(output.parent if str(output.parent) else Path("."), "--output")
    if json_path is not None:  # before the passes: a failure after them left OUTPUT written and exited 2
        _check_output_file(json_path, "--json", "passes.json")  # as bench --json: a mistyped folder is not made
    if dump_passes is not None:
        if Path(dump_passes).is_file():
            raise click.BadParameter(f"{dump_passes!r} is a file; give a folder (created if needed), e.g. dump/",
                                     param_hint="--dump-passes")
        _check_writable_dir(Path(dump_passes), "--dump-passes")
    if inputs is not None and not inputs.is_file():
        raise click.BadParameter(f"{str(inputs)!r} does not exist; pass an .npz written by numpy.savez",
                                 param_hint="--inputs")
    if inputs is not None and shapes:
        raise click.BadParameter("--shape sets the dims of random inputs; with --inputs the arrays give them: "
                                 "drop one of the two", param_hint="--shape")
    try:
        parsed = [parse_shape(item) for item in shapes]
    except ModelFileError as e:  # its message starts with --shape: not "Invalid value for --shape: --shape ..."
        raise click.UsageError(str(e)) from None
    shape_map = dict(parsed)
    if len(shape_map) < len(parsed):  # the last one won, silently
        twice = next(name for name in shape_map if sum(n == name for n, _ in parsed) > 1)
        raise click.BadParameter(f"{twice!r} is given more than once; give each input one --shape",
                                 param_hint="--shape")
    result = optimize_file(source, output, target=target, precision=precision,
                           dump_dir=Path(dump_passes) if dump_passes else None,
                           pass_options=_parse_pass_options(pass_options), check=check, inputs=inputs,
                           shapes=shape_map, seed=seed)
    click.echo(format_table(result), err=True)
    if json_path is not None:
        _write_output_file(json_path, json.dumps(result.to_json(), indent=1) + "\n")
    check_verdict(result)  # --check failed: OUTPUT removed, exit 1
    click.echo(f"wrote: {', '.join(str(f) for f in result.files)}")


def _refuse_clashing_outputs(source: Path, output: Path, json_path: Path | None, dump_dir: Path | None) -> None:
    """optimize: ``--json`` / ``--dump-passes`` naming the input or ``--output`` (the JSON was written over the input
    model, or over OUTPUT after "wrote: OUTPUT"; a dump folder made where OUTPUT goes failed the run after the passes).

    Raises:
        click.BadParameter: naming the flag, the path and what it clashes with (exit 2).
    """
    for path, flag in ((json_path, "--json"), (dump_dir, "--dump-passes")):
        if path is None:
            continue
        for other, what in ((source, "the input file"), (output, "the --output file")):
            if _same_file(path, other):
                raise click.BadParameter(f"{str(path)!r} is {what}; give {flag} a path of its own", param_hint=flag)


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` name one file: the same path once links are resolved, or a hard link of it (``-o`` a
    hard link of the input was written over in place: the input was lost)."""
    import os

    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


@main.command("run")
@click.argument("artifact_dir", type=PathArg(path_type=Path))
@click.option("-p", "--prompt", required=True, help="Text prompt.")
@click.option("-n", "--negative-prompt", default=None,
              help="Negative prompt [default: none: SD uses the empty prompt's embedding, SDXL zeros, as diffusers "
                   "does; -n '' gives SDXL the empty prompt's embedding instead].")
@click.option("--prompt-syntax", type=click.Choice(["a1111", "plain"]), default="a1111", show_default=True,
              help="a1111: (text) x1.1, [text] /1.1, (text:1.3), \\( \\) escapes, BREAK starts a 75-token chunk; "
                   "plain: the prompt as it is. Long prompts run in 75-token chunks either way (up to the artifact's "
                   "compile --max-prompt-chunks).")
@click.option("--clip-skip", type=click.IntRange(min=0), default=None,
              help="Text states from N layers before the last, then the final layer norm (diffusers' clip_skip; "
                   "1 = A1111's 'Clip skip 2'; SDXL: N layers before its penultimate one, no layer norm); up to "
                   "the artifact's compile --max-clip-skip [default: the last].")
@click.option("--embedding", "embeddings", multiple=True, type=PathArg(path_type=Path), metavar="FILE",
              help="A textual-inversion embedding (.safetensors; .pt through torch's weights-only loader; SDXL: "
                   "the clip_l/clip_g form), written by its file name in the prompts, e.g. -n 'easynegative, "
                   "lowres'; repeatable.")
@click.option("--steps", type=click.IntRange(min=1), default=_run_default("num_inference_steps"), show_default=True,
              help="Denoising steps.")
@click.option("--guidance", type=float, default=None,
              help="Classifier-free guidance scale; <= 1 disables CFG [default: "
                   f"{GENERATION_ARGS['guidance_scale'].default_for('sd')}; "
                   f"{GENERATION_ARGS['guidance_scale'].default_for('sdxl')} for SDXL, as diffusers].")
@click.option("--seed", type=SEED, default=_run_default("seed"), show_default=True)
@click.option("--height", type=int, default=None, help="[default: the artifact's opt height]")
@click.option("--width", type=int, default=None, help="[default: the artifact's opt width]")
@click.option("--batch-size", type=int, default=_run_default("num_images_per_prompt"), show_default=True,
              help="Images for the prompt.")
@click.option("--scheduler", default=None, help=f"{SCHEDULER_HELP} [default: the model's].")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="[default: the artifact's]")
@click.option("--snap", is_flag=True, help="Snap --height/--width to the nearest size the artifact allows (logged).")
@click.option("--devices", default=None, callback=_devices,
              help="CUDA devices, e.g. 0,1 or all: data-parallel, the images split across them [default: one].")
@click.option("--cuda-graph/--no-cuda-graph", default=None,
              help="Replay engines as CUDA graphs; --cuda-graph: every engine [default: on for static CUDA artifacts "
                   "and TensorRT; ONNX Runtime: the UNet and ControlNets, the text encoder and VAE eager].")
@click.option("--runtime-cache", "runtime_cache", type=PathArg(file_okay=False, path_type=Path), default=None,
              help="TensorRT-RTX: folder of the artifact's runtime cache (kernels compiled for this GPU on first load) "
                   "[default: ~/.cache/diffusion-trt/runtime-cache/<manifest sha256[:16]>].")
@click.option("-o", "--output", "out", type=PathArg(dir_okay=False, path_type=Path), default=Path("out.png"),
              show_default=True,
              help="PNG path; with several images, -1, -2 ... are appended; existing files are refused (--overwrite).")
@click.option("--overwrite", is_flag=True, help="Replace PNGs that exist at -o (and its -1, -2 ... siblings).")
@click.option("--image", "image_path", type=PathArg(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Image-to-image: the start image (its size is the output size, a multiple of 8).")
@click.option("--strength", type=float, default=None,
              help="With --image: how much of it is re-noised, in (0, 1] [default: 0.8; 1.0 with --mask].")
@click.option("--mask", "mask_path", type=PathArg(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Inpainting, with --image: white = repaint, black = keep (read as grayscale, alpha ignored, as "
                   "diffusers; the image's size).")
@click.option("--vram-budget", default=None, callback=_vram_budget, metavar="SIZE", help=VRAM_BUDGET_HELP)
@click.option("--lora", "loras", multiple=True, metavar="FILE[:SCALE]",
              help="A LoRA for this run (repeatable; scale 1.0 by default) on an artifact compiled with --refittable: "
                   "no recompile (ONNX Runtime: several at once; TensorRT: one).")
@click.option("--controlnet", "controlnets", multiple=True, metavar="NAME[:SCALE]",
              help="A ControlNet of the artifact (compile --controlnet) and its conditioning scale (default as "
                   "diffusers: 1.0; 0.8 with --image, 0.5 with --mask); "
                   "repeatable, paired in order with --control-image.")
@click.option("--control-image", "control_images", multiple=True,
              type=PathArg(exists=True, dir_okay=False, path_type=Path),
              help="The control image of each --controlnet, of the output size (RGB; never resized); one alone, "
                   "without --controlnet, is for the artifact's only ControlNet.")
@click.option("--control-preprocess", type=click.Choice(["none", "canny"]), default="none", show_default=True,
              help="canny: make each control image a Canny edge map first (OpenCV: pip install -e '.[control]').")
@click.option("--control-guidance-start", type=FiniteFloat(), default=0.0, show_default=True,
              help="Fraction of the steps before the ControlNets act.")
@click.option("--control-guidance-end", type=FiniteFloat(), default=1.0, show_default=True,
              help="Fraction of the steps after which the ControlNets stop.")
@click.option("--guess-mode", is_flag=True, help="diffusers' guess mode (ControlNets on the conditional rows only).")
@_runtime_options("run")
@_handle_errors
def run_cmd(artifact_dir: Path, prompt: str, negative_prompt: str | None, prompt_syntax: str, clip_skip: int | None,
            embeddings: tuple[Path, ...], steps: int,
            guidance: float | None, seed: int,
            height: int | None, width: int | None, batch_size: int, scheduler: str | None, device: str | None,
            snap: bool, devices: str | None, cuda_graph: bool | None, runtime_cache: Path | None, out: Path,
            overwrite: bool, image_path: Path | None, strength: float | None, mask_path: Path | None,
            vram_budget: str | None, loras: tuple[str, ...], controlnets: tuple[str, ...],
            control_images: tuple[Path, ...], control_preprocess: str, control_guidance_start: float,
            control_guidance_end: float, guess_mode: bool, **engine_options: Any) -> None:
    """Generate images from a compiled ARTIFACT_DIR: from text, or from an image (--image), or inpaint (--mask);
    with ControlNets (--controlnet NAME[:SCALE] --control-image FILE, each pair in order).

    \b
    Examples:
      diffusion-trt run artifacts/tiny --prompt "a guohua landscape" -o out.png
      diffusion-trt run artifacts/sd15-fp16 -p "pixel-art castle" --steps 50 --scheduler euler --seed 7
      diffusion-trt run artifacts/sd15-fp16 -p "a koi pond" --batch-size 8 --devices 0,1
      diffusion-trt run artifacts/sd15 -p "an oil painting" --image photo.png --strength 0.6
      diffusion-trt run artifacts/sd15-inpaint -p "a red door" --image house.png --mask door.png
      diffusion-trt run artifacts/sdxl-fp16 -p "a lighthouse" --vram-budget 8GB
      diffusion-trt run artifacts/tiny-refittable -p "a fox" --lora ink.safetensors:0.8 --lora detail.safetensors
      diffusion-trt run artifacts/tiny -p "(ink wash:1.3) mountains, [fog] BREAK a red sun" -n "(blurry)"
      diffusion-trt run artifacts/tiny -p "a guohua landscape" --clip-skip 1
      diffusion-trt run artifacts/tiny -p "a fox" -n "easynegative, lowres" --embedding easynegative.safetensors
      diffusion-trt run artifacts/tiny-cn -p "an ink painting" --controlnet canny:0.8 --control-image edges.png
    """
    from .lora import check_lora_file, parse_lora_arg
    from .runtime.pipeline import check_text, save_png

    for name, text in (("prompt", prompt), ("negative_prompt", negative_prompt)):
        if text is not None:
            check_text(name, text)  # bytes that are not UTF-8 fail here, not in the tokenizer after the load
    if mask_path is not None and image_path is None:
        raise click.UsageError("--mask needs --image: the image to inpaint (the mask marks what to repaint)")
    if strength is not None and image_path is None:
        raise click.UsageError("--strength needs --image: it is how much of the start image is re-noised")
    if image_path is not None and devices is not None:
        raise click.UsageError("--image runs on one device; drop --devices (or use --device cuda)")
    if negative_prompt is not None and guidance is not None and guidance <= 1:
        logger.warning("--negative-prompt: no effect with --guidance %g (guidance <= 1 turns classifier-free guidance "
                       "off, and the negative prompt only acts through it)", guidance)
    if scheduler is not None:  # a typo fails before the engines load
        from .runtime.schedulers import resolve_scheduler

        resolve_scheduler(scheduler)
    read = _read_manifest(artifact_dir)
    _warn_vram_budget_on_cpu(vram_budget, "cuda" if devices is not None else device, artifact_dir)
    engine_options = _one_shot_search(_check_engine_options(engine_options), read[0], device)
    lora_specs = [parse_lora_arg(x) for x in loras]
    for path, scale in lora_specs:  # a missing / pickled / malformed file fails before the engines load
        check_lora_file(path, scale)
    if lora_specs and len(_parse_devices(devices, device)) >= 2:
        raise click.UsageError("--lora runs on one device; drop --devices (or give one device)")
    if lora_specs and read[0] is not None and not any(c.weight_inputs for c in read[0].components.values()):
        from .runtime.pipeline import check_refit_target

        # no LoRA weight inputs (not ORT --refittable): refused now if it cannot take one, not after the load
        check_refit_target(read[0], check_lora_file(*lora_specs[0]), len(lora_specs))
    if embeddings:
        from .runtime.embeddings import check_embedding_file

        sdxl = read[0].model.is_sdxl if read[0] is not None else None
        for path in embeddings:  # a missing / pickled / malformed file fails before the engines load
            check_embedding_file(path, sdxl)
        _check_embeddings_before_load(read, embeddings, artifact_dir, (prompt, negative_prompt), prompt_syntax)
        if len(_parse_devices(devices, device)) >= 2:
            raise click.UsageError("--embedding runs on one device; drop --devices (or give one device)")
    max_hw = _profile_max_hw(_needed(read)) if image_path is not None else None
    image = _read_image(image_path, "--image", "RGB", max_hw) if image_path is not None else None
    mode = "inpaint" if mask_path is not None else "img2img" if image_path is not None else "txt2img"
    control = _control_arguments(read, controlnets, control_images, control_preprocess,
                                 control_guidance_start, control_guidance_end, guess_mode, mode)
    if control and devices is not None:
        raise click.UsageError("--controlnet runs on one device; drop --devices (or use --device cuda)")
    mask = _read_image(mask_path, "--mask", "L", max_hw) if mask_path is not None else None
    _needed(read)  # an artifact that cannot be read is the first thing to fix, before -o (e.g. an out.png left there)
    _refuse_inside_artifact(out, artifact_dir, "output file", "-o", _SEALED_FILE)
    _refuse_missing_folder(out, "-o")  # as PIL's image.save and diffusers: a typo'd folder is not made silently
    _check_writable_file(out, "-o", ".png")  # before minutes of denoising, not after
    if overwrite:
        _refuse_folders_among_outputs(out, batch_size)
    else:
        _refuse_existing_outputs(out, batch_size)
    if snap and (height is not None or width is not None):
        profile = _needed(read).profile
        height = _snap("height", height, profile.height.min, profile.height.max)
        width = _snap("width", width, profile.width.min, profile.width.max)
    elif snap:
        logger.warning("--snap: no effect without --height/--width (it rounds those to sizes the artifact allows%s)",
                       "; an --image is never resized" if image is not None else "")
    device_list = _parse_devices(devices, device)
    if vram_budget is not None and len(device_list) >= 2:
        raise click.UsageError("--vram-budget plans one device; drop --devices or give one device")
    budget = {} if vram_budget is None else {"vram_budget": vram_budget, "vram_request": (height, width, batch_size)}
    _check_before_load(read, prompt, num_inference_steps=steps, guidance_scale=guidance, seed=seed,
                       height=height, width=width, num_images_per_prompt=batch_size, negative_prompt=negative_prompt,
                       prompt_syntax=prompt_syntax, image_given=image is not None,
                       image=image, mask_image=mask, strength=strength, clip_skip=clip_skip, control=control,
                       scheduler=_run_scheduler(read, artifact_dir, scheduler))
    from tqdm.contrib.logging import logging_redirect_tqdm

    # log lines (a truncated prompt...) go through tqdm.write: they never cut the step bar on a terminal; SIGTERM
    # unwinds like Ctrl-C (the weights' private folders in $TMPDIR go)
    with _terminate_like_interrupt(), logging_redirect_tqdm(loggers=[logger]), \
            _open_pipeline(artifact_dir, device, scheduler, device_list, cuda_graph, runtime_cache_dir=runtime_cache,
                           **budget, **engine_options) as pipe:
        if lora_specs:
            pipe.load_lora(lora_specs)
        if embeddings:
            pipe.load_textual_inversion(list(embeddings))
        result = pipe(
            prompt=prompt,
            negative_prompt=negative_prompt,
            num_inference_steps=steps,
            guidance_scale=guidance,
            seed=seed,
            height=height,
            width=width,
            num_images_per_prompt=batch_size,
            prompt_syntax=prompt_syntax,
            clip_skip=clip_skip,
            progress=len(device_list) <= 1 and _progress_enabled(),
            **({"image": image, "mask_image": mask, "strength": strength} if image is not None else {}),
            **control,
        )
        params = {**result.parameters, "artifact": str(artifact_dir)}
        if lora_specs:
            params["loras"] = [[Path(p).name, s] for p, s in lora_specs]
        if embeddings:
            params["embeddings"] = [p.name for p in embeddings]
        if control:
            params.update(controlnet=list(control["controlnet"]), control_image=[str(p) for p in control_images],
                          controlnet_conditioning_scale=control["controlnet_conditioning_scale"],
                          control_guidance_start=control["control_guidance_start"],
                          control_guidance_end=control["control_guidance_end"], guess_mode=control["guess_mode"],
                          control_preprocess=control_preprocess)
        if image_path is not None:
            params.update(image=str(image_path), **({"mask": str(mask_path)} if mask_path is not None else {}))
        # written before the engines close: their release (device memory, sessions) is no part of the wait for
        # the image
        paths = []
        for i, image in enumerate(result.images):
            path = _output_path(out, i)
            save_png(image, path, {**params, "index": i})
            paths.append(path)
        for path in paths:
            click.echo(f"image: {path}")


def _check_before_load(read: tuple[Manifest | None, DiffusionTrtError | None], prompt: str, **arguments: Any
                       ) -> None:
    """Refuse a ``run`` the artifact cannot honour (its size, batch, guidance...; :func:`~.runtime.request.
    check_before_load`) from its manifest, before the engines load (15-18 s for SD); an artifact whose manifest cannot
    be read is left to the load, which says why.

    Raises:
        RuntimeInputError: as :meth:`~.runtime.pipeline.EnginePipeline.__call__`.
    """
    from .errors import names_arguments
    from .runtime.request import RequestSpec, check_before_load, unopened_engines

    if read[0] is None:
        return
    with names_arguments("prompt", *arguments, *arguments.get("control", {})):  # control's keys are arguments too
        check_before_load(RequestSpec.from_manifest(read[0]), prompt, engines=unopened_engines(read[0]), **arguments)


def _run_scheduler(read: tuple[Manifest | None, DiffusionTrtError | None], artifact_dir: Path, name: str | None
                   ) -> tuple[str, dict[str, Any]] | None:
    """(diffusers class name, config with its overrides) of the scheduler ``run`` builds (``--scheduler`` ``name``, or
    the artifact's own), for the step count's check before the load; ``None`` where the config is not the listed file
    (a size or sha256 other than the manifest's), or cannot be read or used: the load says why.

    The config is read as a file of the folder, not through :class:`~.artifact.reader.ArtifactReader`, whose opening
    would log its warnings (files the manifest does not list) a second time."""
    import hashlib

    from .artifact.values import check_scheduler_config, parse_json
    from .runtime.schedulers import scheduler_for

    manifest = read[0]
    entry = manifest.files.get(manifest.scheduler_config) if manifest is not None else None
    if manifest is None or entry is None or entry.size > 1 << 20:  # a scheduler config is a few hundred bytes
        return None
    path = artifact_dir / manifest.scheduler_config
    try:
        data = path.read_bytes() if path.resolve().is_relative_to(artifact_dir.resolve()) else b""
        if len(data) != entry.size or hashlib.sha256(data).hexdigest() != entry.sha256:
            return None
        config = parse_json(data, str(path))
        own = manifest.scheduler_class or (config.get("_class_name") if isinstance(config, dict) else None) or ""
        class_name, overrides = scheduler_for(check_scheduler_config(config, class_name=own), name, own)
    except (OSError, DiffusionTrtError):
        return None
    return class_name, {**config, **overrides}


def _check_embeddings_before_load(read: tuple[Manifest | None, DiffusionTrtError | None],
                                  embeddings: tuple[Path, ...], artifact_dir: Path,
                                  texts: tuple[str | None, ...] = (), prompt_syntax: str = "a1111") -> None:
    """Refuse ``--embedding`` files the loaded pipeline would refuse (a vector size that is not the text encoder's,
    the artifact's rows full, a name taken twice, an artifact whose text encoder takes none) from its manifest, before
    the engines load; warn of each that none of ``texts`` (the prompts, read in ``prompt_syntax`` as the encoder
    reads them: an embedding's name is matched in the parsed text, so ``neg(v2)`` in A1111 syntax is ``neg`` and a
    weighted ``v2``) names.

    Raises:
        RuntimeInputError: as :meth:`~.runtime.pipeline.EnginePipeline.load_textual_inversion`.
    """
    from .runtime.embeddings import load_embeddings
    from .runtime.request import unopened_engines

    if read[0] is None:
        return
    engines = unopened_engines(read[0])
    encoders = ("text_encoder", "text_encoder_2")[: 1 + read[0].model.is_sdxl]
    if all(name in engines for name in encoders):
        tables = load_embeddings([None] * len(encoders), [engines[n] for n in encoders], list(embeddings), None,
                                 artifact_dir, announce=False)
        from .runtime.prompt_syntax import parse_prompt

        parsed = [s.text for t in texts if t for part in parse_prompt(t, prompt_syntax).parts for s in part]
        unused_raw = set(tables[0].unused(texts))
        for name in tables[0].unused(parsed):
            if name not in unused_raw:  # a name with brackets or BREAK in it, which the A1111 syntax reads as its own
                escaped = _escaped(name)
                fix = f"write it {escaped}" if escaped != name else "rename the file"
                logger.warning("--embedding: %r is written in the prompts, but the A1111 prompt syntax reads its "
                               "brackets as weights (or BREAK as a chunk break), so it changes nothing; %s, or pass "
                               "--prompt-syntax plain", name, fix)
            else:
                logger.warning("--embedding: %r is named in neither --prompt nor --negative-prompt, so it changes "
                               "nothing (an embedding is used by its file name, as a whole word)", name)


def _escaped(text: str) -> str:
    """``text`` with the A1111 prompt syntax's brackets and backslashes escaped (``neg(v2)`` -> ``neg\\(v2\\)``)."""
    return re.sub(r"([\\()\[\]])", r"\\\1", text)


def _control_arguments(read: tuple[Manifest | None, DiffusionTrtError | None], controlnets: tuple[str, ...],
                       control_images: tuple[Path, ...], preprocess: str, start: float, end: float, guess_mode: bool,
                       mode: str) -> dict[str, Any]:
    """run's ControlNet options as EnginePipeline keywords ({} without --controlnet); a --controlnet without a scale
    gets the default of diffusers' ControlNet pipeline of ``mode`` (1.0 txt2img, 0.8 img2img, 0.5 inpaint). One
    --control-image without --controlnet is for the artifact's only ControlNet.

    Raises:
        click.UsageError: a --controlnet without its --control-image or the other way round, a scale that is not a
            finite number; a ControlNet option (--guess-mode, --control-guidance-start/-end, --control-preprocess)
            without any --controlnet, where it would do nothing.
        RuntimeInputError: one --control-image alone, for an artifact without exactly one ControlNet
            (:func:`_only_controlnet`).
    """
    from .config import split_scale
    from .errors import RuntimeInputError
    from .runtime.controlnet import DEFAULT_CONTROL_SCALE
    from .runtime.float_range import finite_in_float32

    if not controlnets and not control_images:
        lone = _given(("guess_mode", "control_guidance_start", "control_guidance_end", "control_preprocess"))
        if lone:
            raise click.UsageError(f"{lone[0]} needs --controlnet NAME --control-image FILE: it sets how ControlNets "
                                   f"act, and none is given; add one, or drop {lone[0]}")
        return {}
    if len(control_images) == 1 and not controlnets:  # the only ControlNet, as controlnet=None from Python and serve
        controlnets = _only_controlnet(_needed(read))
    if read[0] is not None and not _has_controlnet(read[0]):  # before the count: a --control-image will not help
        raise RuntimeInputError("--controlnet: this artifact has no ControlNet; compile it with --controlnet "
                                "[NAME=]FOLDER")
    if len(control_images) != len(controlnets):
        raise click.UsageError(f"{len(control_images)} --control-image for {len(controlnets)} --controlnet; give "
                               "one control image per ControlNet, in the same order")
    names, scales = [], []
    for value in controlnets:
        name, scale, number = split_scale(value, DEFAULT_CONTROL_SCALE[mode])
        if not finite_in_float32(number):
            raise click.UsageError(f"--controlnet {value!r}: the scale {scale!r} is not a finite number in float32's "
                                   f"range; use e.g. {name}:0.8")
        names.append(name)
        scales.append(number)
    max_hw = _profile_max_hw(_needed(read))
    images = [_read_image(p, "--control-image", "RGB", max_hw) for p in control_images]
    if preprocess == "canny":
        from .runtime.control_preprocess import canny

        images = [canny(im) for im in images]
    return {"controlnet": names, "control_image": images if len(images) > 1 else images[0],
            "controlnet_conditioning_scale": scales, "control_guidance_start": start,
            "control_guidance_end": end, "guess_mode": guess_mode}


def _has_controlnet(manifest: Manifest) -> bool:
    """Whether ``manifest`` has any ControlNet component (whole or not: the load says what an incomplete one lacks)."""
    from .artifact.manifest import CONTROLNET_PREFIX, EMBED_PREFIX, UNET_CONTROLNET

    return any(n == UNET_CONTROLNET or n.startswith((CONTROLNET_PREFIX, EMBED_PREFIX)) for n in manifest.components)


def _only_controlnet(manifest: Manifest) -> tuple[str]:
    """The name of ``manifest``'s one ControlNet, for a --control-image given without --controlnet.

    Raises:
        RuntimeInputError: the artifact has no ControlNet, or several (naming them): what it holds, not how the
            command is spelt (one ``error:`` line, exit 2)."""
    from .errors import RuntimeInputError
    from .runtime.controlnet import controlnet_names

    have = controlnet_names(list(manifest.components))
    if not have:
        raise RuntimeInputError("--control-image: this artifact has no ControlNet; compile it with --controlnet "
                                "[NAME=]FOLDER")
    if len(have) > 1:
        raise RuntimeInputError(f"--control-image: this artifact has {len(have)} ControlNets ({', '.join(have)}); "
                                "name the one it is for with --controlnet NAME")
    return (have[0],)


@main.command("inspect")
@click.argument("artifact_dir", type=PathArg(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (for machines).")
@_handle_errors
def inspect_cmd(artifact_dir: Path, as_json: bool) -> None:
    """Summarize a compiled ARTIFACT_DIR: components, precisions, profile, sizes, passes, build facts, tools, memory.

    Reads manifest.json (schema and seal checked) and the ONNX files' initializer sizes (the weight estimate);
    activation memory is measured (recorded by benchmarks/gpu_vram.py) or estimated, as the lines say.
    `diffusion-trt verify` checks the files.

    \b
    Examples:
      diffusion-trt inspect artifacts/tiny
      diffusion-trt inspect artifacts/sd15 --json | jq .components.unet.passes
    """
    import json

    from .artifact.folder import leftover_warnings
    from .artifact.summary import artifact_summary, format_summary
    from .artifact.values import printable_tree
    from .runtime.memory.residency import memory_summary

    manifest = Manifest.read(artifact_dir)
    summary = artifact_summary(artifact_dir, manifest.to_json())
    summary["memory"] = memory_summary(artifact_dir, manifest)
    for line in leftover_warnings(artifact_dir):
        click.echo(f"warning: {printable(line)}", err=True)
    # JSON escapes control characters itself (ensure_ascii); the text shows each string of the manifest escaped
    click.echo(json.dumps(summary, indent=2) if as_json else format_summary(printable_tree(summary)))


@main.command("verify")
@click.argument("artifact_dir", type=PathArg(path_type=Path))
@click.option("--no-hashes", is_flag=True, help="Check sizes only, not sha256 (fast on multi-GB artifacts).")
@click.option("--no-host", is_flag=True, help="Skip the checks against this machine (providers, TensorRT, GPU).")
@click.option("--tensorrt", "trt_version", default=None,
              help="Check plans against this TensorRT (or TensorRT-RTX, e.g. 1.7.1.116) version instead of this "
                   "machine's (with --compute-capability).")
@click.option("--compute-capability", default=None, help="Target GPU compute capability for plans, e.g. 9.0.")
@click.option("--expect-sha256", default=None, metavar="HEX", callback=_sha256_hex,
              help="The manifest digest (manifest_sha256, see `inspect --json`) you trust; any other artifact fails, "
                   "even one resealed after an edit (the seal is an unkeyed sha256: it catches accidents, not intent).")
@click.option("--source", "source", type=PathArg(exists=True, path_type=Path), default=None,
              help="Also check that this model folder (or single .safetensors file) holds the weights compiled.")
@_handle_errors
def verify_cmd(artifact_dir: Path, no_hashes: bool, no_host: bool, trt_version: str | None,
               compute_capability: str | None, expect_sha256: str | None, source: Path | None) -> None:
    """Check that ARTIFACT_DIR is intact and runs here; exit 3 with one line per problem if not.

    Checks the manifest (JSON Schema, seal against hand edits), every file's size and sha256, that no path,
    ONNX external-data reference or symbolic link leads outside the folder, that no unlisted file was added,
    and this machine: ONNX Runtime's provider for the artifact's device, or TensorRT's version and the GPU's
    compute capability for each plan.

    \b
    Examples:
      diffusion-trt verify artifacts/tiny
      diffusion-trt verify artifacts/sd15-trt --tensorrt 10.8.0.43 --compute-capability 9.0
      diffusion-trt verify artifacts/tiny --source models/tiny
    """
    from .artifact.verify import verify_artifact

    if (trt_version is None) != (compute_capability is None):
        raise click.UsageError("--tensorrt and --compute-capability go together")
    target = _verify_target(trt_version, compute_capability)
    if source is not None and source.is_dir() and not (source / "model_index.json").is_file():
        raise click.BadParameter(f"{str(source)!r} has no model_index.json: it is not a diffusers pipeline folder; "
                                 "pass the folder (or .safetensors file) the artifact was compiled from",
                                 param_hint="--source")
    report = verify_artifact(artifact_dir, check_hashes=not no_hashes, check_host=not no_host, trt_host=target,
                             expect_sha256=expect_sha256, source=source)
    for line in report.warnings:
        click.echo(f"warning: {printable(line)}", err=True)
    if not report.ok:
        for line in report.problems:
            click.echo(f"problem: {printable(line)}")
        click.echo(f"{artifact_dir}: {len(report.problems)} problem(s)", err=True)
        sys.exit(3)
    what = "sha256 and size" if not no_hashes else "size"
    host = "host not checked" if no_host else "runs on the target" if report.target_checked else "runs on this machine"
    matches = f"; the weights of {source} were compiled" if source is not None else ""
    click.echo(f"{artifact_dir}: ok ({report.checked_files} files, {what}; {host}{matches})")



def _verify_target(trt_version: str | None, compute_capability: str | None) -> Any:
    """``verify``'s target host from ``--tensorrt`` and ``--compute-capability`` (``None`` when not given), both
    checked as bad input (exit 2): a compute capability such as 'abc' came out as one 'problem:' per plan, exit 3."""
    from .errors import BuildError
    from .trt_compat import TrtHost, format_compute_capability, parse_compute_capability, version_tuple

    if trt_version is None or compute_capability is None:
        return None
    try:
        cc = format_compute_capability(parse_compute_capability(compute_capability))
    except BuildError as e:
        raise click.BadParameter(str(e), param_hint="'--compute-capability'") from None
    if len(version_tuple(trt_version)) < 2:
        raise click.BadParameter(f"{trt_version!r} is not a version; write it as TensorRT's, e.g. 10.8.0.43 (or "
                                 "TensorRT-RTX's, e.g. 1.7.1.116)", param_hint="'--tensorrt'")
    return TrtHost(trt_version, cc)


def _parse_devices(devices: str | None, device: str | None) -> list[int]:
    """``--devices`` as CUDA ordinals ([] when not given); refuses it with ``--device cpu``."""
    if devices is None:
        return []
    if device == "cpu":
        raise click.UsageError(f"--devices {devices} needs CUDA; drop it or use --device cuda")
    from .runtime.parallel import parse_devices

    return parse_devices(devices)


def _check_engine_options(options: dict[str, Any]) -> dict[str, Any]:
    """The ``_runtime_options`` values, checked before anything loads (a bad --size-buckets list exits 2)."""
    from .runtime.engines.buckets import parse_size_buckets

    options = dict(options)
    options["cudnn_conv_algo_search"] = str(options.get("cudnn_conv_algo_search") or "AUTO").upper()
    parse_size_buckets(options.get("size_buckets"))
    return options


def _one_shot_search(options: dict[str, Any], manifest: Manifest | None, device: str | None) -> dict[str, Any]:
    """``run``'s default HEURISTIC search where it acts (an ONNX Runtime artifact on CUDA), else AUTO: a default is
    no reason for the "no effect" warning an explicit ``--cudnn-algo-search`` gets elsewhere. ``manifest``: the one
    ``run`` read (``None``: unreadable; ``from_artifacts`` says what is wrong with the artifact)."""
    from click.core import ParameterSource

    from .artifact.manifest import Backend

    if click.get_current_context().get_parameter_source("cudnn_conv_algo_search") is not ParameterSource.DEFAULT:
        return options
    if manifest is None:
        return options
    if manifest.backend is not Backend.ORT or (device or manifest.device) != "cuda":
        options["cudnn_conv_algo_search"] = "AUTO"
    return options


def _open_pipeline(artifact_dir: Path, device: str | None, scheduler: str | None, device_list: list[int],
                   cuda_graph: bool | None, **engine_options: Any) -> Any:
    """One EnginePipeline (on ``device_list[0]`` when given) or a DataParallelPipeline over 2+ devices."""
    if len(device_list) >= 2:
        from .runtime.parallel import DataParallelPipeline

        return DataParallelPipeline.from_artifacts(artifact_dir, device_list, scheduler=scheduler,
                                                   cuda_graph=cuda_graph, **engine_options)
    from .runtime.pipeline import EnginePipeline

    if device_list:
        return EnginePipeline.from_artifacts(artifact_dir, device="cuda", scheduler=scheduler,
                                             device_id=device_list[0], cuda_graph=cuda_graph, **engine_options)
    return EnginePipeline.from_artifacts(artifact_dir, device=device, scheduler=scheduler, cuda_graph=cuda_graph,
                                         **engine_options)


def _int_list(value: str, option: str) -> tuple[int, ...]:
    try:  # "1,,2" or "1,4,": an empty item (a typo'd number?) is refused, not skipped
        out = tuple(int(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a comma-separated list of integers, e.g. 1,4", param_hint=option
        ) from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"{value!r}: every batch size must be >= 1, e.g. 1,4", param_hint=option)
    return out


@main.command("bench")
@click.argument("artifact_dir", type=PathArg(path_type=Path))
@click.option("--baseline", type=click.Choice(["diffusers", "none"]), default="diffusers", show_default=True,
              help="Also measure diffusers (eager fp16 SDPA, and with a CUDA-graphed UNet on CUDA).")
@click.option("--model-dir", type=PathArg(file_okay=False, path_type=Path), default=None,
              help="diffusers folder for the baseline [default: the manifest's source path].")
@click.option("--steps", type=click.IntRange(min=1), default=50, show_default=True)
@click.option("--batch-size", "batch_sizes", default="1", show_default=True, help="Images per call, e.g. 1,4.")
@click.option("--iters", type=int, default=3, show_default=True, help="Timed end-to-end calls (median).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed calls before timing.")
@click.option("--stage-iters", type=int, default=20, show_default=True, help="Timed calls per stage (median).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="[default: the artifact's]")
@click.option("--devices", default=None, callback=_devices,
              help="CUDA devices, e.g. 0,1: ours on the first, multi-GPU on all.")
@click.option("--scheduler", default=None, help=f"{SCHEDULER_HELP} for both sides [default: the model's].")
@click.option("--cuda-graph/--no-cuda-graph", default=None,
              help="Our engines as CUDA graphs; --cuda-graph: every engine [default: on for static CUDA artifacts and "
                   "TensorRT; ONNX Runtime: the UNet and ControlNets, the text encoder and VAE eager].")
@click.option("--runtime-cache", "runtime_cache", type=PathArg(file_okay=False, path_type=Path), default=None,
              help="TensorRT-RTX: folder of the artifact's runtime cache (kernels compiled for this GPU on first load) "
                   "[default: ~/.cache/diffusion-trt/runtime-cache/<manifest sha256[:16]>].")
@click.option("--prompt", default=None, help="Prompt of every call [default: a fixed landscape prompt].")
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--json", "json_path", type=PathArg(path_type=Path), default=None,
              help="Write the result as JSON (schema: diffusion_trt/data/bench_result.schema.json).")
@click.option("--plot", "plot_path", type=PathArg(path_type=Path), default=None,
              help="Write a bar chart PNG (matplotlib if installed, else Pillow).")
@click.option("--vram-budget", default=None, callback=_vram_budget, metavar="SIZE",
              help="Also run ours under this budget (" + VRAM_BUDGET_HELP.split(": ")[0].lower() + "): per-stage peak "
                   "memory and e2e time with and without it.")
@click.option("--sizes", default=None, metavar="HxW[,HxW...]",
              help="Image sizes to measure, each after one timed first call [default: --height x --width].")
@click.option("--height", type=int, default=None, help="[default: the artifact's opt height]")
@click.option("--width", type=int, default=None, help="[default: the artifact's opt width]")
@_runtime_options("bench")
@_handle_errors
def bench_cmd(artifact_dir: Path, baseline: str, model_dir: Path | None, steps: int, batch_sizes: str, iters: int,
              warmup: int, stage_iters: int, device: str | None, devices: str | None, scheduler: str | None,
              cuda_graph: bool | None, runtime_cache: Path | None, prompt: str | None, seed: int,
              json_path: Path | None, plot_path: Path | None, vram_budget: str | None, sizes: str | None,
              height: int | None, width: int | None, **engine_options: Any) -> None:
    """Time ARTIFACT_DIR's engines per stage and end to end, next to diffusers, in one process.

    Same weights, seed, scheduler and prompt on every side; medians after warm-up; CUDA events for GPU
    stage times; NVTX ranges around every stage (run under `nsys profile` to see them).

    \b
    Examples:
      diffusion-trt bench artifacts/tiny --steps 2 --iters 1 --json bench.json
      diffusion-trt bench artifacts/sd15-fp16 --batch-size 1,4 --json b.json --plot b.png
      diffusion-trt bench artifacts/sd15-fp16-b4 --batch-size 8 --devices 0,1 --baseline none
      diffusion-trt bench artifacts/sd15-fp16 --baseline none --vram-budget 4GB
      diffusion-trt bench artifacts/sd15-dyn --sizes 512x512,768x768,640x384 --size-buckets auto --baseline none
    """
    import json

    from .bench import DEFAULT_PROMPT, BenchConfig, format_table, plot_result, run_bench
    from .runtime.engines.buckets import parse_sizes

    engine_options = _check_engine_options(engine_options)
    _warn_vram_budget_on_cpu(vram_budget, "cuda" if devices is not None else device, artifact_dir)
    for path, flag, example in ((json_path, "--json", "bench.json"), (plot_path, "--plot", "bench.png")):
        if path is not None:
            _refuse_inside_artifact(path, artifact_dir, "output file", flag, _SEALED_FILE)
            _check_output_file(path, flag, example)  # before the benchmark, not after
    if plot_path is not None and plot_path.suffix.lower() != ".png":  # Pillow's fallback wrote a PNG as out.json
        raise click.BadParameter(f"{str(plot_path)!r} does not end in .png (the chart is a PNG); use e.g. bench.png",
                                 param_hint="--plot")
    if json_path is not None and plot_path is not None and _same_file(json_path, plot_path):  # the chart replaced it
        raise click.BadParameter(f"{str(plot_path)!r} is the --json file too; give each its own path, e.g. --json "
                                 "bench.json --plot bench.png", param_hint="--plot")
    if scheduler is not None:  # a typo fails before the engines load, named as --scheduler
        from .runtime.schedulers import resolve_scheduler

        resolve_scheduler(scheduler)
    if model_dir is not None and baseline == "none":
        logger.warning("--model-dir: no effect with --baseline none (it is the diffusers baseline's folder); drop it")
    if sizes is None:
        _check_bench_size(_read_manifest(artifact_dir)[0], height, width)
    elif height is not None or width is not None:
        logger.warning("%s: no effect with --sizes (the sizes measured are those of --sizes); drop it",
                       " and ".join(_given(("height", "width"))))
    device_list = _parse_devices(devices, device)
    config = BenchConfig(
        artifact=artifact_dir, baseline=baseline, model_dir=model_dir, device="cuda" if device_list else device,
        devices=tuple(device_list), steps=steps, batch_sizes=_int_list(batch_sizes, "--batch-size"), iters=iters,
        warmup=warmup, stage_iters=stage_iters, scheduler=scheduler, cuda_graph=cuda_graph,
        runtime_cache_dir=runtime_cache, prompt=DEFAULT_PROMPT if prompt is None else prompt, seed=seed,
        vram_budget=vram_budget, height=height, width=width, sizes=parse_sizes(sizes) if sizes is not None else (),
        **engine_options,
    )
    result = run_bench(config, progress=lambda msg: logger.info("bench: %s", msg))
    click.echo(format_table(result))
    if json_path is not None:
        _write_output_file(json_path, json.dumps(result, indent=2))
        click.echo(f"json: {json_path}")
    if plot_path is not None:
        plot_path.parent.mkdir(parents=True, exist_ok=True)
        click.echo(f"plot: {plot_result(result, plot_path)}")


def _check_bench_size(manifest: Manifest | None, height: int | None, width: int | None) -> None:
    """``bench --height/--width`` against the artifact's profile before the engines load (they were refused at the
    first call, after the load, as ``height=60``); an artifact whose manifest cannot be read is left to the load."""
    from .config import check_image_size
    from .errors import names_arguments

    if manifest is None:
        return
    profile, multiple = manifest.profile, manifest.model.vae_scale_factor
    with names_arguments("height", "width"):
        for name, value, span in (("height", height, profile.height), ("width", width, profile.width)):
            if value is not None:
                check_image_size(name, value, span.min, span.max, multiple=multiple)


@main.command("export-triton")
@click.argument("artifact_dir", type=PathArg(path_type=Path))
@click.argument("repo_dir", type=PathArg(file_okay=False, path_type=Path))
@click.option("--prefix", default="", help="Prepended to every model name (several artifacts in one repository).")
@click.option("--instances", type=click.IntRange(min=1), default=1, show_default=True,
              help="Instances per engine model.")
@click.option("--max-queue-delay-us", type=click.IntRange(min=0), default=2000, show_default=True,
              help="Dynamic-batching delay of the engine models.")
@click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests waiting for the pipeline model at most; more get 503 / UNAVAILABLE at once.")
@click.option("--queue-timeout-s", type=FiniteFloat(min=0), default=60, show_default=True,
              help="A request that waited this long is dropped unrun (503 / UNAVAILABLE); a client may set its own "
                   "with the request's 'timeout' parameter; 0 = no limit.")
@click.option("--overwrite", is_flag=True,
              help="Replace models of the same names in REPO_DIR (Triton model folders, with config.pbtxt; any "
                   "other folder there is refused).")
@_handle_errors
def export_triton_cmd(artifact_dir: Path, repo_dir: Path, prefix: str, instances: int, max_queue_delay_us: int,
                      max_queue: int, queue_timeout_s: float, overwrite: bool) -> None:
    """Write a Triton model repository serving ARTIFACT_DIR: one model per engine plus a BLS pipeline model.

    Engine models use platform onnxruntime_onnx or tensorrt_plan with dynamic batching; the pipeline model
    (Python backend) runs the denoising loop by calling them, and needs numpy, torch, diffusers and
    transformers in Triton's Python environment. A TensorRT-RTX artifact is refused (exit 2): Triton loads plans
    with TensorRT, not the TensorRT-RTX runtime; use `diffusion-trt serve` for it. Models are written beside
    REPO_DIR and moved in at the end (Triton would load a half-written folder inside it).

    \b
    Examples:
      diffusion-trt export-triton artifacts/sd15-trt model_repository
      tritonserver --model-repository model_repository
    """
    from .serve.triton_repo import export_triton_repository

    folders = export_triton_repository(artifact_dir, repo_dir, prefix=prefix, instances=instances,
                                       max_queue_delay_us=max_queue_delay_us, overwrite=overwrite,
                                       max_queue=max_queue, queue_timeout_s=queue_timeout_s)
    for name, folder in folders.items():
        click.echo(f"model: {name} ({folder})")


@main.command("serve")
@click.argument("artifact_dir", type=PathArg(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 exposes the server to the network.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="KServe v2 HTTP port.")
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=None, help="KServe v2 gRPC port [default: port+1].")
@click.option("--max-batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Images per engine call (capped by the artifact's batch profile).")
@click.option("--max-queue-delay-ms", type=FiniteFloat(min=0), default=10, show_default=True,
              help="How long a request waits for batch-mates.")
@click.option("--max-steps", type=click.IntRange(min=1), default=100, show_default=True, help="Largest steps accepted.")
@click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests waiting in Triton's queue at most; more get 503 / UNAVAILABLE at once.")
@click.option("--queue-timeout-s", type=FiniteFloat(min=0), default=60, show_default=True,
              help="A request that waited this long is dropped unrun (503 / UNAVAILABLE); a client may set its own "
                   "with the request's 'timeout' parameter (microseconds); 0 = no limit.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="[default: the artifact's]")
@click.option("--scheduler", default=None, help=f"{SCHEDULER_HELP} [default: the model's].")
@click.option("--vram-budget", default=None, callback=_vram_budget, metavar="SIZE", help=VRAM_BUDGET_HELP)
@click.option("--lora-dir", type=PathArg(file_okay=False, path_type=Path), default=None,
              help="Folder of .safetensors LoRAs a request may name in its optional `lora` input (NAME or NAME:SCALE; "
                   "the artifact compiled with --refittable); read once at start-up.")
@_handle_errors
def serve_cmd(artifact_dir: Path, host: str, port: int, grpc_port: int | None, max_batch_size: int,
              max_queue_delay_ms: float, max_steps: int, max_queue: int, queue_timeout_s: float,
              device: str | None, scheduler: str | None, vram_budget: str | None, lora_dir: Path | None) -> None:
    """Serve ARTIFACT_DIR through a Triton Inference Server (NVIDIA PyTriton) until Ctrl-C.

    Model "pipeline": inputs prompt (BYTES), optional negative_prompt, seed, steps, guidance_scale, height,
    width (and lora, NAME[:SCALE] of a file in --lora-dir); output image (UINT8 [H, W, 3]). Needs
    `pip install 'diffusion-trt[serve]'`.

    A request the rules refuse gets 400 / INVALID_ARGUMENT with one line naming the field and the allowed range; a
    full queue or a request that waited too long 503 / UNAVAILABLE (README "Serving" lists the statuses).

    \b
    Examples:
      diffusion-trt serve artifacts/tiny
      diffusion-trt serve artifacts/sd15-fp16 --port 9000 --max-batch-size 8
      diffusion-trt serve artifacts/sd15-refit --lora-dir loras/
    """
    from .serve.loras import LoraLibrary
    from .serve.server import ServeConfig, serve

    _warn_vram_budget_on_cpu(vram_budget, device, artifact_dir)
    if lora_dir is not None:
        LoraLibrary(lora_dir)  # a missing folder or a bad file fails before the engines load

    config = ServeConfig(host=host, http_port=port, grpc_port=grpc_port or port + 1, max_batch_size=max_batch_size,
                         max_queue_delay_s=max_queue_delay_ms / 1000, max_steps=max_steps, max_queue=max_queue,
                         queue_timeout_s=queue_timeout_s, device=device, scheduler=scheduler,
                         vram_budget=vram_budget, lora_dir=None if lora_dir is None else str(lora_dir))
    serve(artifact_dir, config,
          on_ready=lambda: click.echo(f"ready: http://{host}:{port} grpc {host}:{config.grpc_port}", err=True))


if __name__ == "__main__":
    main()

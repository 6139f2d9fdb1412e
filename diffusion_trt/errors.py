"""One error hierarchy for the whole toolchain.

Every message states the cause, the offending value and the fix, e.g.
``"height=700 is not a multiple of 8; use 696 or 704 (engine profile allows 256..1024)"``.
The CLI turns any :class:`DiffusionTrtError` into one line on stderr and its class's exit code:

====  ==========================================================================================================
code  meaning
====  ==========================================================================================================
0     success
1     an unexpected error, or a compile stage failed (:class:`ExportError`, :class:`PassError`, :class:`BuildError`)
2     bad input or usage: options, model folder, LoRA, runtime arguments, an output path that cannot be used; or
      an optional package the command needs is not installed (:class:`MissingPackageError`: ``serve`` without
      PyTriton, ``--scheduler lms`` without scipy, ``--lora`` without peft), the message naming the ``pip install``
3     the artifact is missing, damaged or incompatible with this machine (``verify`` found problems)
4     a quantized engine failed the quality gate (:class:`QualityGateError`)
====  ==========================================================================================================
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class DiffusionTrtError(Exception):
    """Base class of every error this package raises on purpose.

    Messages spell the arguments they name as the Python API does, ``name=value`` (the field of a config, the
    keyword of a call, the value as ``repr`` writes it): ``"refit_convs=True needs refittable=True"``. Where the
    arguments are checked, :func:`names_arguments` records which names those are in :attr:`arguments`, so that a
    front whose user typed them differently shows them its own way, in one place: the CLI writes the same message
    as ``"--refit-convs needs --refittable"`` (``cli._as_typed``).
    """

    #: process exit code used by the CLI for this error class
    exit_code: int = 1
    #: the argument names whose ``name=value`` the message may hold (set by :func:`names_arguments`)
    arguments: frozenset[str] = frozenset()


class ModelFolderError(DiffusionTrtError):
    """The diffusers pipeline folder is missing, incomplete or unsafe to load."""

    exit_code = 2


class ExportError(DiffusionTrtError):
    """A component could not be exported to ONNX."""


class PassError(DiffusionTrtError):
    """A graph pass failed; the message names the pass and the passes that ran before it."""


class BuildError(DiffusionTrtError):
    """An engine could not be built from an optimized ONNX graph."""


class ArtifactError(DiffusionTrtError):
    """An artifact folder is missing files, fails verification or is incompatible with this machine."""

    exit_code = 3


class OutputPathError(ArtifactError):
    """An output path cannot be used: it exists (without ``--overwrite``), is a file where a folder is needed, overlaps
    the input, or another compile is writing it. A usage error (exit 2), not a damaged artifact."""

    exit_code = 2


class RuntimeInputError(DiffusionTrtError, ValueError):
    """A call to the runtime got an argument it cannot honour (size, steps, guidance, scheduler...)."""

    exit_code = 2


class ModelFileError(DiffusionTrtError, ValueError):
    """``optimize`` got an ONNX file, an inputs file or a shape it cannot use (missing, not ONNX, wrong names)."""

    exit_code = 2


class LoraError(DiffusionTrtError, ValueError):
    """A LoRA file cannot be merged: missing, not safetensors, matching no layer, a bad scale, or merged already."""

    exit_code = 2


class MissingPackageError(DiffusionTrtError, ImportError):
    """An optional package (an extra of diffusion-trt: ``serve``, ``schedulers``, ``lora``...) that the command
    needs is not installed; the message names the ``pip install``. Exit 2 whatever the command: the user fixes the
    set-up and runs it again. (An engine library an artifact needs on this machine, onnxruntime-gpu or TensorRT, is
    the artifact's incompatibility with the machine: :class:`ArtifactError`, exit 3, as ``verify`` reports it.)"""

    exit_code = 2


class QualityGateError(BuildError):
    """A quantized engine is further from fp32 than the quality thresholds allow (``--accept-quality-loss``)."""

    exit_code = 4


class PipelineBusyError(DiffusionTrtError, RuntimeError):
    """An ``EnginePipeline`` was called while another call of it was running (from another thread, or from its own
    callback): a pipeline runs one call at a time, and the second is refused at once rather than run on engines,
    buffers and caches the first is using (diffusers' pipelines are not thread-safe either)."""


@contextlib.contextmanager
def names_arguments(*names: str) -> Iterator[None]:
    """Record ``names`` as the :attr:`DiffusionTrtError.arguments` of an error raised inside (then re-raise it): the
    arguments a check refuses, spelled as its messages spell them. The outermost one wins: the arguments are those of
    the call its caller made (``EnginePipeline.__call__``'s ``height``, not that of a call made inside on the
    caller's behalf, such as ``bench`` calling the pipeline at each of its ``sizes``). A context manager, or a
    decorator::

        with names_arguments(*(f.name for f in dataclasses.fields(self))):  # a config's __post_init__
            ...

        @names_arguments("prompt", "num_inference_steps")
        def check(...): ...
    """
    try:
        yield
    except DiffusionTrtError as e:
        e.arguments = frozenset(names)
        raise


def names_parameters(fn: F) -> F:
    """Decorator: :func:`names_arguments` with ``fn``'s own parameters (a public call's keywords), ``self`` / ``cls``
    and ``*args`` / ``**kwargs`` left out."""
    names = [n for n, p in inspect.signature(fn).parameters.items()
             if n not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return names_arguments(*names)(fn)  # type: ignore[return-value]

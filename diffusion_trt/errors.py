"""One error hierarchy for the whole toolchain.

Every message states the cause, the offending value and the fix, e.g.
``"height=700 is not a multiple of 8; use 696 or 704 (engine profile allows 256..1024)"``.
The CLI turns any :class:`DiffusionTrtError` into one line on stderr and a non-zero exit.
"""

from __future__ import annotations


class DiffusionTrtError(Exception):
    """Base class of every error this package raises on purpose."""

    #: process exit code used by the CLI for this error class
    exit_code: int = 1


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


class RuntimeInputError(DiffusionTrtError, ValueError):
    """A call to the runtime got an argument it cannot honour (size, steps, guidance, scheduler...)."""

    exit_code = 2


class LoraError(DiffusionTrtError, ValueError):
    """A LoRA file cannot be merged: missing, not safetensors, matching no layer, a bad scale, or merged already."""

    exit_code = 2


class QualityGateError(BuildError):
    """A quantized engine is further from fp32 than the quality thresholds allow (``--accept-quality-loss``)."""

    exit_code = 4

"""fp8's hardware check, made before anything is calibrated."""

from __future__ import annotations

from ...errors import BuildError


def check_fp8_target(precision: str, target_compute_capability: str | None) -> str | None:
    """fp8 only: the target GPU's compute capability, checked >= 8.9 before anything is calibrated.

    Args:
        target_compute_capability: ``--target-compute-capability``; ``None`` = this machine's CUDA GPU.

    Returns:
        The compute capability as "major.minor" (``None`` for int8, which every TensorRT GPU runs).

    Raises:
        BuildError: fp8 on a GPU older than 8.9, or no GPU here and no ``--target-compute-capability``.
    """
    from ... import trt_compat

    if precision != "fp8":
        return None
    cc = target_compute_capability
    if cc is None:
        import torch

        if not torch.cuda.is_available():
            raise BuildError(
                "precision fp8 needs a GPU of compute capability >= 8.9 (Ada Lovelace, Hopper or newer) and this "
                "machine has no CUDA GPU to check; pass --target-compute-capability (e.g. 8.9 or 9.0) for the GPU "
                "the engine is for, or use --precision int8"
            )
        cc = "{}.{}".format(*torch.cuda.get_device_capability())
    parsed = trt_compat.parse_compute_capability(cc)
    try:
        trt_compat.check_precision_supported(["fp8"], parsed)
    except BuildError as e:
        raise BuildError(f"{e} (or --precision int8); checked before calibrating") from None
    return trt_compat.format_compute_capability(parsed)

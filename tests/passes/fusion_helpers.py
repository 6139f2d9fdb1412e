"""Shared helpers for the fusion-pass tests: run one pass through optimize_model, check DEBUG reasons, and compare
a rewritten graph on ORT's CUDA provider with the original on the CPU."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx
import pytest

from diffusion_trt.passes import Pass, PassContext, optimize_model
from tests import graphs

#: CUDA provider options of the parity checks: TF32 off, since the reference is an fp32 CPU run and TF32 MatMuls
#: differ by ~1e-2 at these widths.
CUDA_FP32 = {"use_tf32": 0}


def fuse(model: onnx.ModelProto, pass_: Pass, backend: str = "ort", device: str = "cpu",
         **options: Any) -> tuple[onnx.ModelProto, dict[str, int]]:
    """``pass_`` on ``model`` for (backend, device), fp32, through optimize_model (cleanup included)."""
    ctx = PassContext(component="unet", backend=backend, device=device, precision="fp32", options=options)
    out, records = optimize_model(model, [pass_], ctx)
    return out, records[0].counts


def reasons(caplog: pytest.LogCaptureFixture, pass_name: str) -> list[str]:
    """The rejection messages ``pass_name`` logged at DEBUG."""
    return [r.getMessage() for r in caplog.records
            if r.name == f"diffusion_trt.passes.{pass_name}" and r.levelno == logging.DEBUG]


def domains(model: onnx.ModelProto) -> dict[str, int]:
    """The model's opset imports as {domain: version}."""
    return {o.domain: o.version for o in model.opset_import}


def assert_cuda_parity(reference: onnx.ModelProto, rewritten: onnx.ModelProto,
                       provider_options: tuple[dict[str, Any], ...] = (CUDA_FP32,), tol: float = 1e-4) -> None:
    """``rewritten`` on ORT's CUDA provider (once per provider-option set) gives the outputs of ``reference`` run on
    the CPU, on the same random feeds, within ``tol`` (relative and absolute)."""
    import onnxruntime as ort

    feeds = graphs.random_feeds(reference)
    want = graphs.run(reference, feeds)
    for options in provider_options:
        session = ort.InferenceSession(rewritten.SerializeToString(), providers=[("CUDAExecutionProvider", options)])
        for got, ref in zip(session.run(None, feeds), want, strict=True):
            np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)

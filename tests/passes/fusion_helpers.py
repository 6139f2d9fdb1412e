"""Shared helpers for the fusion-pass tests: run one pass through optimize_model, and check DEBUG reasons."""

from __future__ import annotations

import logging
from typing import Any

import onnx
import pytest

from diffusion_trt.passes import Pass, PassContext, optimize_model


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

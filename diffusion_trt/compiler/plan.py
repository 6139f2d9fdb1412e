"""Per-component decisions, made once at the start of ``compile`` and carried: :class:`ComponentPlan`.

Everything a later stage needs to know about *how* a component is built is decided here, from the
:class:`~diffusion_trt.config.CompileConfig` and the model facts, and saved in the manifest
(``components.<name>.compile_plan``): the precision the component computes in (and why it differs from the
requested one), the dtype it is exported in, the pass pipeline it runs, the dtypes of its I/O and, for the
TensorRT libraries, the builder settings. The export, pass, quantize and build stages read the plan; none
of them derives a precision of its own.

Precision rules, in order:

1. int8/fp8 quantize the components of ``QuantizeConfig.components`` (the UNet, optionally the VAE decoder):
   they are exported and optimized in fp32, calibrated, and QDQ nodes carry the reduced precision. The other
   components run fp16 on CUDA and fp32 on the CPU.
2. An SDXL VAE stays fp32 in an fp16 build unless it is fp16-safe (:func:`component_precision`).
3. fp16 is always made by the ``convert_fp16`` pass (fp32 islands, Casts at the borders), for every backend:
   export is fp32, and TensorRT networks are built strongly typed from the graph's own types (no FP16
   builder flag).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..config import QUANTIZED_PRECISIONS, Backend, CompileConfig

#: The components that run the VAE's weights (diffusers' SDXL pipelines upcast the VAE for both).
VAE_COMPONENTS: tuple[str, ...] = ("vae_decoder", "vae_encoder")


def component_precision(name: str, precision: str, facts: Mapping[str, Any], fp16_safe_vae: bool) -> tuple[str, str]:
    """The precision one component is built at, and why it is not ``precision`` ("" when it is).

    SDXL's VAE produces NaN/inf in fp16 (its activations pass 65504; diffusers' ``StableDiffusionXLPipeline`` runs it
    in fp32 whenever ``vae.config.force_upcast`` is true): with ``precision="fp16"`` the VAE components of an SDXL
    model are built fp32, unless the VAE says it is fp16-safe (``force_upcast: false`` in vae/config.json, e.g.
    madebyollin/sdxl-vae-fp16-fix) or the caller says so (``fp16_safe_vae``, ``--fp16-safe-vae``).
    """
    if (precision == "fp16" and name in VAE_COMPONENTS and facts.get("architecture") == "sdxl"
            and facts.get("vae_force_upcast", True) and not fp16_safe_vae):
        return "fp32", ("SDXL VAE kept fp32: it overflows in fp16 (vae/config.json force_upcast=true); pass "
                        "--fp16-safe-vae with an fp16-safe VAE")
    return precision, ""


@dataclass(frozen=True)
class ComponentPlan:
    """How one component is built; frozen, saved in the manifest (:meth:`to_json`).

    Attributes:
        name: the component ("unet", ...).
        precision: what its engine computes in: "fp32", "fp16", "int8" or "fp8"; also the precision its I/O
            dtypes follow (``components.tensor_manifest``).
        precision_note: why ``precision`` differs from the requested one ("" when it does not).
        quantized: calibrated and QDQ-quantized (int8/fp8): exported and optimized in fp32 first.
        export_dtype: the dtype torch exports in: always "fp32" (fp16 comes from ``convert_fp16``).
        pass_backend, pass_precision: the pass pipeline (``passes.pipeline_for(pass_backend, device,
            pass_precision, name)``): both TensorRT libraries run the "tensorrt" pipelines (ops TensorRT's ONNX
            parser maps); quantized components run the fp32 one.
        engine: the :class:`~diffusion_trt.artifact.manifest.Backend` whose build stage makes the engine.
        strongly_typed: TensorRT: build the network strongly typed (types from the graph). Always for
            TensorRT-RTX, and for fp16 (made by ``convert_fp16``) and QDQ graphs on full TensorRT.
        compute_capabilities: TensorRT-RTX targets ("8.6", ..., or "current"); ``None`` = its portable set.
    """

    name: str
    precision: str
    precision_note: str
    quantized: bool
    pass_backend: Backend
    pass_precision: str
    engine: Backend
    strongly_typed: bool | None = None
    compute_capabilities: tuple[str, ...] | None = None
    export_dtype: str = "fp32"

    def trt_build_config(self, refittable: bool) -> Any:
        """The :class:`~diffusion_trt.compiler.build_trt.TrtBuildConfig` of a TensorRT engine (``None`` for ORT)."""
        if not self.engine.is_tensorrt:
            return None
        from .build_trt import TrtBuildConfig

        return TrtBuildConfig(strongly_typed=self.strongly_typed, refittable=refittable, library=self.engine,
                              compute_capabilities=self.compute_capabilities)

    def to_json(self) -> dict[str, Any]:
        return {
            "precision": self.precision,
            "precision_note": self.precision_note,
            "quantized": self.quantized,
            "export_dtype": self.export_dtype,
            "passes": {"backend": str(self.pass_backend), "precision": self.pass_precision},  # str: the plain value
            "engine": str(self.engine),
            "strongly_typed": self.strongly_typed,
            "compute_capabilities": list(self.compute_capabilities) if self.compute_capabilities else None,
        }


def plan_components(config: CompileConfig, facts: Mapping[str, Any], names: Sequence[str]) -> dict[str, ComponentPlan]:
    """Every component's :class:`ComponentPlan`, in ``names`` order (the rules in the module docstring)."""
    quantized = set(config.quantize.components) if config.precision in QUANTIZED_PRECISIONS else set()
    other = ("fp16" if config.device == "cuda" else "fp32") if quantized else config.precision
    plans = {}
    for name in names:
        requested = config.precision if name in quantized else other
        precision, note = component_precision(name, requested, facts, config.fp16_safe_vae)
        is_quantized = name in quantized
        trt = config.backend.is_tensorrt
        rtx = config.backend is Backend.TENSORRT_RTX
        strongly_typed = None
        if rtx or (trt and precision == "fp16"):
            strongly_typed = True  # fp16 types come from convert_fp16; QDQ graphs are detected (None = auto)
        plans[name] = ComponentPlan(
            name=name,
            precision=precision,
            precision_note=note,
            quantized=is_quantized,
            pass_backend=Backend.TENSORRT if trt else config.backend,
            pass_precision="fp32" if is_quantized else precision,
            engine=config.backend,
            strongly_typed=strongly_typed,
            compute_capabilities=config.compute_capabilities if rtx else None,
        )
    return plans

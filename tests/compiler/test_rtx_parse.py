"""The TensorRT pass pipelines against NVIDIA's real TensorRT-RTX ONNX parser and builder (no GPU needed).

Every component of the four tiny pipelines (SD 1.x, SD 2.x, SDXL, SD 1.5 inpainting) is exported as ``compile``
exports it, run through the ("tensorrt-rtx", "cuda", fp16) pass pipeline (fp32 too: tiny by default, the others
as `slow` tests) at a static profile (one image, the model's default size), then parsed and built into a real
plan for compute capability 8.9 (Ada): 21 plans by default, in ~110 CPU-seconds (export ~12 s per arch, a tiny
UNet's passes ~3 s and its build ~8 s). Each build
also says whether the builder found every attention the passes left (MatMul-Softmax-MatMul) as a self-attention
pattern: that form is what the TensorRT emitter of fuse_attention writes for the builder to fuse.

The plans are built by a small helper here (:func:`build_plan`), not by ``compiler.build_trt``, whose
TensorRT-RTX path lands separately; it sets only what an RTX build needs (strongly typed network, one compute
capability, one static profile).
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.compiler.build_trt import ParserErrorInfo, format_parser_errors
from diffusion_trt.compiler.components import ComponentSpec
from diffusion_trt.config import Range, ShapeProfile
from diffusion_trt.passes import PassContext, optimize_model, pipeline_for
from tests import graphs

pytestmark = pytest.mark.rtx_builder

#: arch -> the session fixture that writes its pipeline folder (None: written here).
ARCHS: dict[str, str | None] = {"tiny": "tiny_pipeline_dir", "tiny-sd21": "tiny_sd21_dir",
                                "tiny-sdxl": "tiny_sdxl_dir", "tiny-sd15-inpaint": None}
COMPONENTS: tuple[str, ...] = ("text_encoder", "unet", "vae_decoder", "vae_encoder")
#: SDXL's second text encoder comes with its first (compile's component_names).
ARCH_COMPONENTS: dict[str, tuple[str, ...]] = {
    arch: (("text_encoder", "text_encoder_2", *COMPONENTS[1:]) if arch == "tiny-sdxl" else COMPONENTS)
    for arch in ARCHS
}
#: fp16 (compile's CUDA default) for every arch; fp32 for tiny, and as `slow` tests for the others (their fp32 graphs
#: differ from tiny's only by the missing convert_fp16; three more UNet builds cost ~40 CPU-seconds).
CASES = [pytest.param(arch, precision, name, id=f"{arch}-{precision}-{name}",
                      marks=[pytest.mark.slow] if precision == "fp32" and arch != "tiny" else [])
         for precision in ("fp16", "fp32") for arch in ARCHS for name in ARCH_COMPONENTS[arch]]

_ATTENTION = re.compile(r"^Found (?P<node>.+) to be part of self-attention pattern\.$")


# --- the builder -----------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What one build gave: ``plan_bytes`` (0: no plan), the network's ``layers``, the ONNX nodes the builder
    reported as part of a self-attention pattern, ``seconds`` (parse + build), and its error messages."""

    plan_bytes: int
    layers: int
    attention_nodes: set[str] = field(default_factory=set)
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)


def build_plan(source: Path | onnx.ModelProto, compute_capability: str = "SM89") -> Plan:
    """Parse ``source`` with TensorRT-RTX's ONNX parser and build a plan for ``compute_capability``.

    Every network input gets one profile at the shape the graph gives it (static graphs only). A parser failure
    fails the test with :func:`format_parser_errors`' lines (node index, name, op, message).
    """
    import tensorrt_rtx_bindings as trt

    class _Logger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []
            self.attention: set[str] = set()

        def log(self, severity: Any, msg: str) -> None:
            if severity in (trt.ILogger.ERROR, trt.ILogger.INTERNAL_ERROR):
                self.errors.append(msg)
            elif (found := _ATTENTION.match(msg)) is not None:
                self.attention.add(found["node"])

    start = time.perf_counter()
    log = _Logger()
    builder = trt.Builder(log)
    network = builder.create_network(0)  # TensorRT-RTX networks are always strongly typed
    parser = trt.OnnxParser(network, log)
    if isinstance(source, onnx.ModelProto):
        ok, where = parser.parse(source.SerializeToString()), Path("<model>")
    else:
        ok, where = parser.parse_from_file(str(source)), source
    if not ok or parser.num_errors:
        errors = [ParserErrorInfo.from_trt(parser.get_error(i)) for i in range(parser.num_errors)]
        pytest.fail(format_parser_errors(where, errors))
    config = builder.create_builder_config()
    config.num_compute_capabilities = 1
    config.set_compute_capability(getattr(trt.ComputeCapability, compute_capability), 0)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = tuple(tensor.shape)
        assert all(d > 0 for d in shape), f"input {tensor.name} has a dynamic shape {shape}; build static graphs"
        profile.set_shape(tensor.name, shape, shape, shape)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    return Plan(plan_bytes=0 if plan is None else plan.nbytes, layers=network.num_layers,
                attention_nodes=log.attention, seconds=time.perf_counter() - start, errors=log.errors)


# --- exports and pass pipelines, once per module ----------------------------------------------------------


@dataclass(frozen=True)
class RawExport:
    path: Path
    spec: ComponentSpec
    profile: ShapeProfile
    facts: dict[str, Any]


@pytest.fixture(scope="module")
def raw_exports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                ) -> Callable[[str], dict[str, RawExport]]:
    """``raw_exports(arch)``: each component's fp32 export at a static one-image profile, as ``compile`` makes it."""
    from diffusion_trt.compiler import export
    from diffusion_trt.compiler.dummy import write_dummy_pipeline
    from diffusion_trt.compiler.pipeline import component_names, model_facts, specs_for

    cache: dict[str, dict[str, RawExport]] = {}

    def get(arch: str) -> dict[str, RawExport]:
        if arch not in cache:
            fixture = ARCHS[arch]
            model_dir = (request.getfixturevalue(fixture) if fixture is not None else
                         write_dummy_pipeline(tmp_path_factory.mktemp("models") / arch, arch=arch, seed=0))
            folder = export.check_model_folder(model_dir)
            facts = model_facts(folder)
            specs = specs_for(facts)
            size = facts["default_height"]
            profile = ShapeProfile(batch=Range(1, 1, 1), height=Range(size, size, size), width=Range(size, size, size))
            out = tmp_path_factory.mktemp(f"rtx_{arch}")
            models = export.load_models(folder, "fp32", "cpu")
            exports = {}
            for name in component_names(COMPONENTS, facts):
                path = out / name / "model.onnx"
                export.onnx_from_component(name, models, specs[name], path, precision="fp32",
                                           profile_ranges=export.export_ranges(profile), opset=17, device="cpu",
                                           architecture=folder.architecture)
                exports[name] = RawExport(path, specs[name], profile, facts)
            del models
            gc.collect()
            cache[arch] = exports
        return cache[arch]

    return get


@dataclass(frozen=True)
class Optimized:
    model: onnx.ModelProto
    precision: str  # what compile builds the component at (SDXL's VAE stays fp32 in an fp16 build)
    counts: dict[str, dict[str, int]]  # pass name -> counts


def optimize(raw: RawExport, name: str, precision: str) -> Optimized:
    """The ("tensorrt-rtx", "cuda", precision) pipeline on one export, with compile's per-component options."""
    from diffusion_trt.compiler.pipeline import component_precision, pass_options

    precision, _ = component_precision(name, precision, raw.facts, fp16_safe_vae=False)
    ctx = PassContext(component=name, backend="tensorrt-rtx", device="cuda", precision=precision,
                      options=pass_options(raw.spec, raw.profile, raw.facts))
    model, records = optimize_model(onnx.load(str(raw.path)),
                                    pipeline_for("tensorrt-rtx", "cuda", precision, name, static=True), ctx)
    return Optimized(model, precision, {r.name: dict(r.counts) for r in records})


# --- every component of the tiny pipelines ----------------------------------------------------------------


@pytest.mark.parametrize(("arch", "precision", "name"), CASES)
def test_tensorrt_pipeline_output_parses_and_builds_for_sm89(
    arch: str, precision: str, name: str, raw_exports: Callable[[str], dict[str, RawExport]], tmp_path: Path
) -> None:
    """ai.onnx ops only; the RTX parser maps every node; the builder writes a plan for 8.9 and finds every
    attention the passes fused (one Softmax per site) as a self-attention pattern."""
    optimized = optimize(raw_exports(arch)[name], name, precision)
    model = optimized.model
    assert {n.domain for n in model.graph.node} <= {""}, "check_onnx_domain let a foreign op through"
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    plan = build_plan(path)
    assert plan.plan_bytes > 0, f"{arch} {name} ({optimized.precision}): no plan; TensorRT said: {plan.errors[-3:]}"
    softmax = {n.name for n in model.graph.node if n.op_type == "Softmax"}
    fused = optimized.counts["fuse_attention"]["Attention"]
    assert len(softmax) == fused > 0, f"{fused} attention sites fused, {len(softmax)} Softmax nodes left"
    missing = softmax - plan.attention_nodes
    assert not missing, f"the builder did not take these Softmax nodes as attention: {sorted(missing)[:4]}"


# --- what the emitters rely on, on small graphs --------------------------------------------------------------


def test_the_parser_refuses_a_contrib_op_naming_node_and_op() -> None:
    """Why check_onnx_domain exists: com.microsoft.QuickGelu (what the ORT target emits for CLIP) is a missing
    plugin to the parser. (Not tested: com.microsoft.MultiHeadAttention, on which the 1.7.1 parser segfaults.)"""
    model = graphs.make_model([helper.make_node("QuickGelu", ["x"], ["y"], name="clip_gelu", alpha=1.702,
                                                domain="com.microsoft")],
                              [graphs.tensor_info("x", [2, 8])], [graphs.tensor_info("y", [2, 8])],
                              extra_opsets=[("com.microsoft", 1)], check=False)
    with pytest.raises(pytest.fail.Exception, match=r"node 0 'clip_gelu' \(QuickGelu\): .*Plugin not found"):
        build_plan(model)


def _group_norm(opset: int, scale: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    return graphs.make_model(
        [helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=4, epsilon=1e-5)],
        [graphs.tensor_info("x", [2, 8, 4, 4])], [graphs.tensor_info("y", [2, 8, 4, 4])],
        [graphs.const("s", rng.uniform(0.5, 1.5, scale)), graphs.const("b", rng.standard_normal(scale))],
        opset=opset, ir_version=10, check=False)  # onnx 1.23 calls opset-18 GroupNormalization deprecated


@pytest.mark.parametrize(("opset", "scale", "builds"), [(21, 8, True), (18, 4, True), (18, 8, False), (21, 4, False)],
                         ids=["21-per-channel", "18-per-group", "18-per-channel", "21-per-group"])
def test_group_normalization_scale_follows_the_opset(opset: int, scale: int, builds: bool) -> None:
    """The builder reads GroupNormalization by its opset: scale [C] from 21 (what fuse_group_norm emits, raising
    the graph to 21), [G] at 18..20; the parser takes either, the builder refuses the mismatch."""
    plan = build_plan(_group_norm(opset, scale))
    assert (plan.plan_bytes > 0) == builds, plan.errors[-1:]
    if not builds:
        assert any("scale is expected to match the output at the channel dimension 1" in e for e in plan.errors)

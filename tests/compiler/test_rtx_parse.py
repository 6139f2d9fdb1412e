"""The TensorRT pass pipelines against NVIDIA's real TensorRT-RTX ONNX parser and builder (no GPU needed).

Every component of the four tiny pipelines (SD 1.x, SD 2.x, SDXL, SD 1.5 inpainting) is exported as ``compile``
exports it, run through the ("tensorrt-rtx", "cuda", fp16) pass pipeline (fp32 too: tiny by default, the others
as `slow` tests) at a static profile (one image, the model's default size), then built by the build stage
(``build_trt.engine_from_onnx``, library tensorrt-rtx) into a real plan for compute capability 8.9 (Ada): 21 plans
by default, in ~110 CPU-seconds (export ~12 s per arch, a tiny UNet's passes ~3 s and its build ~8 s). Each build
also says whether the builder took every attention the passes left (MatMul-Softmax-MatMul, what fuse_attention's
TensorRT emitter writes) as a self-attention pattern.
"""

from __future__ import annotations

import gc
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.compiler import build_trt
from diffusion_trt.compiler.build_trt import TrtBuildConfig
from diffusion_trt.compiler.components import ComponentSpec, tensor_manifest
from diffusion_trt.config import CompileConfig, Range, ShapeProfile
from diffusion_trt.errors import BuildError
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

RTX = "tensorrt-rtx"
#: One target keeps the builds short; the tiny graphs hold nothing that differs between RTX targets.
BUILD = TrtBuildConfig(library=RTX, compute_capabilities=("8.9",))

_ATTENTION = re.compile(r"^Found (?P<node>.+) to be part of self-attention pattern\.$")


class _AttentionLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.nodes: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        found = _ATTENTION.match(record.getMessage())
        if found is not None:
            self.nodes.add(found["node"])


@contextmanager
def attention_patterns() -> Iterator[set[str]]:
    """The ONNX nodes the builder reports as part of a self-attention pattern (a VERBOSE message, which
    ``trt_compat.make_trt_logger`` forwards at DEBUG to the library's logger, "tensorrt_rtx_bindings")."""
    log, handler = logging.getLogger("tensorrt_rtx_bindings"), _AttentionLog()
    level = log.level
    log.setLevel(logging.DEBUG)
    log.addHandler(handler)
    try:
        yield handler.nodes
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


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
            specs = specs_for(facts, embedding_vectors=CompileConfig().max_embedding_vectors)  # as compile does
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
    """ai.onnx ops only; the RTX parser maps every node; the build stage writes a plan for 8.9 and the builder
    finds every attention the passes fused (one Softmax per site) as a self-attention pattern."""
    raw = raw_exports(arch)[name]
    optimized = optimize(raw, name, precision)
    model = optimized.model
    assert {n.domain for n in model.graph.node} <= {""}, "check_onnx_domain let a foreign op through"
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    inputs = [tensor_manifest(t, optimized.precision, raw.profile) for t in raw.spec.inputs]
    with attention_patterns() as found:
        facts = build_trt.engine_from_onnx(path, tmp_path / "model.plan", inputs, precision=optimized.precision,
                                           build=BUILD, timing_cache_dir=None)
    assert facts["library"] == RTX and facts["compute_capabilities"] == ["8.9"]
    assert facts["plan_bytes"] == (tmp_path / "model.plan").stat().st_size > 0
    assert [p["kind"] for p in facts["profiles"]] == ["dynamic"]  # static inputs: one profile, no extra fast path
    softmax = {n.name for n in model.graph.node if n.op_type == "Softmax"}
    fused = optimized.counts["fuse_attention"]["Attention"]
    assert len(softmax) == fused > 0, f"{fused} attention sites fused, {len(softmax)} Softmax nodes left"
    missing = softmax - found
    assert not missing, f"the builder did not take these Softmax nodes as attention: {sorted(missing)[:4]}"


# --- what the GroupNorm emitter relies on -------------------------------------------------------------------


def _group_norm_plan(tmp_path: Path, opset: int, scale: int) -> int:
    """Build a lone GroupNormalization (x [2, 8, 4, 4], 4 groups, ``scale`` elements of scale and bias) with the
    build stage's loaders; the plan's size."""
    rng = np.random.default_rng(0)
    model = graphs.make_model(
        [helper.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=4, epsilon=1e-5)],
        [graphs.tensor_info("x", [2, 8, 4, 4])], [graphs.tensor_info("y", [2, 8, 4, 4])],
        [graphs.const("s", rng.uniform(0.5, 1.5, scale)), graphs.const("b", rng.standard_normal(scale))],
        opset=opset, ir_version=10, check=False)  # onnx 1.23 calls opset-18 GroupNormalization deprecated
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    target = build_trt.build_target("fp32", BUILD)
    trt = target.library.import_module()
    builder, network, _parser = build_trt.network_from_onnx(trt, path, strongly_typed=False)
    config, _ = build_trt.config_for(trt, builder, network, target, BUILD, "fp32", True, [])
    return len(build_trt.engine_from_network(trt, builder, network, config, str(path)))


@pytest.mark.parametrize(("opset", "scale"), [(21, 8), (18, 4)], ids=["21-per-channel", "18-per-group"])
def test_group_normalization_builds_with_the_scale_its_opset_defines(tmp_path: Path, opset: int, scale: int) -> None:
    """fuse_group_norm's TensorRT form (scale [C], the graph raised to opset 21) and opset 18's [G] both build."""
    assert _group_norm_plan(tmp_path, opset, scale) > 0


@pytest.mark.parametrize(("opset", "scale"), [(18, 8), (21, 4)], ids=["18-per-channel", "21-per-group"])
def test_group_normalization_with_the_other_opsets_scale_is_refused(tmp_path: Path, opset: int, scale: int) -> None:
    """The parser takes either scale at any opset; the builder reads it by the opset and refuses the mismatch
    (why fuse_group_norm raises the opset to 21 rather than writing per-channel scales at 18..20)."""
    with pytest.raises(BuildError, match="scale is expected to match the output at the channel dimension 1"):
        _group_norm_plan(tmp_path, opset, scale)

"""The TensorRT build stage: config, profiles, precision checks, timing cache, parser-error reports.

Everything above the ``tensorrt`` marker runs without TensorRT or a GPU (pure functions over manifest
entries, bytes and metadata). The ``tensorrt``-marked tests at the end build real engines; they skip where
``import tensorrt`` fails.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from diffusion_trt import trt_compat
from diffusion_trt.compiler import build_trt
from diffusion_trt.compiler.build_trt import (
    ParserErrorInfo,
    TrtBuildConfig,
    check_network_inputs,
    format_parser_errors,
    graph_has_qdq,
    profiles_from_inputs,
    read_timing_cache,
)
from diffusion_trt.compiler.components import component_specs, tensor_manifest
from diffusion_trt.config import Range, ShapeProfile
from diffusion_trt.errors import BuildError, RuntimeInputError
from diffusion_trt.trt_compat import TimingCacheKey, pack_timing_cache, unpack_timing_cache
from tests.graphs import const, make_model, tensor_info

SPECS = component_specs(text_hidden=32, text_len=77, unet_in=4, unet_out=4, latent=4)
#: batch 1..4 (opt 1), 64x64 (32..128): the tiny pipeline's default compile profile
PROFILE = ShapeProfile(batch=Range(1, 1, 4), height=Range(32, 64, 128), width=Range(32, 64, 128))


def unet_inputs(profile: ShapeProfile = PROFILE) -> list[dict[str, Any]]:
    return [tensor_manifest(t, "fp32", profile) for t in SPECS["unet"].inputs]


# --- profiles ------------------------------------------------------------------------------------------


def test_dynamic_profile_comes_from_the_manifest_with_the_cfg_doubled_batch() -> None:
    dynamic, static = profiles_from_inputs(unet_inputs(), TrtBuildConfig())
    assert dynamic.kind == "dynamic"
    # B2: min B (guidance <= 1), opt 2*B (CFG), max 2*max_B; latents h/w = pixels / 8
    assert dynamic.shapes["sample"] == ((1, 4, 4, 4), (2, 4, 8, 8), (8, 4, 16, 16))
    assert dynamic.shapes["timestep"] == ((1,), (2,), (8,))
    assert dynamic.shapes["encoder_hidden_states"] == ((1, 77, 32), (2, 77, 32), (8, 77, 32))
    # the static fast path sits at the opt shape: the CFG batch of one image at 64x64
    assert static.kind == "static"
    assert static.shapes["sample"] == ((2, 4, 8, 8),) * 3
    assert static.shapes["timestep"] == ((2,),) * 3


def test_vae_decoder_batch_is_not_doubled() -> None:
    inputs = [tensor_manifest(t, "fp32", PROFILE) for t in SPECS["vae_decoder"].inputs]
    dynamic, static = profiles_from_inputs(inputs, TrtBuildConfig())
    assert dynamic.shapes["latent_sample"] == ((1, 4, 4, 4), (1, 4, 8, 8), (4, 4, 16, 16))
    assert static.shapes["latent_sample"] == ((1, 4, 8, 8),) * 3


def test_static_compile_profile_gets_one_profile_pinned_to_the_cfg_batch() -> None:
    static = ShapeProfile(batch=Range(2, 2, 2), height=Range(64, 64, 64), width=Range(64, 64, 64))
    (only,) = profiles_from_inputs(unet_inputs(static), TrtBuildConfig())
    assert only.kind == "dynamic"  # min == max already: no separate fast path
    assert only.shapes["sample"] == ((4, 4, 8, 8),) * 3


def test_static_fast_path_can_be_disabled() -> None:
    profiles = profiles_from_inputs(unet_inputs(), TrtBuildConfig(static_profile=False))
    assert [p.kind for p in profiles] == ["dynamic"]


def test_extra_profiles_inside_the_range_add_a_profile_with_their_own_opt() -> None:
    extra = ShapeProfile(batch=Range(1, 2, 2), height=Range(64, 96, 128), width=Range(64, 96, 128))
    profiles = profiles_from_inputs(unet_inputs(), TrtBuildConfig(extra_profiles=(extra,)))
    assert [p.kind for p in profiles] == ["dynamic", "extra", "static"]
    assert profiles[1].shapes["sample"] == ((1, 4, 8, 8), (4, 4, 12, 12), (4, 4, 16, 16))
    assert profiles[1].shapes["encoder_hidden_states"][2] == (4, 77, 32)
    assert profiles[1].to_json()["inputs"]["timestep"] == {"min": [1], "opt": [4], "max": [4]}


def test_extra_profile_outside_the_range_is_refused_with_both_ranges() -> None:
    extra = ShapeProfile(batch=Range(1, 1, 1), height=Range(64, 256, 256), width=Range(64, 64, 64))
    with pytest.raises(BuildError) as e:
        profiles_from_inputs(unet_inputs(), TrtBuildConfig(extra_profiles=(extra,)))
    msg = str(e.value)
    assert "'sample'" in msg and "(2, 4, 32, 8)" in msg and "(8, 4, 16, 16)" in msg and "--max-" in msg


def test_malformed_manifest_entries_are_refused() -> None:
    with pytest.raises(BuildError, match="min/opt/max"):
        profiles_from_inputs([{"name": "x", "dtype": "float32", "shape": ["B"]}], TrtBuildConfig())
    bad = {"name": "x", "dtype": "float32", "shape": ["B"], "min": [4], "opt": [2], "max": [8]}
    with pytest.raises(BuildError, match=r"min .* <= opt .* <= max"):
        profiles_from_inputs([bad], TrtBuildConfig())
    with pytest.raises(BuildError, match="at least one input"):
        profiles_from_inputs([], TrtBuildConfig())


# --- TrtBuildConfig ------------------------------------------------------------------------------------


def test_build_config_json_round_trip() -> None:
    extra = ShapeProfile(batch=Range(1, 1, 2), height=Range(64, 64, 64), width=Range(64, 64, 64))
    config = TrtBuildConfig(
        builder_optimization_level=5,
        workspace_bytes=4 << 30,
        refittable=True,
        flags=("fp16",),
        static_profile=False,
        extra_profiles=(extra,),
    )
    data = json.loads(json.dumps(config.to_json()))
    assert data["extra_profiles"] == [extra.to_json()]
    assert TrtBuildConfig.from_json(data) == config
    assert TrtBuildConfig.from_json(TrtBuildConfig().to_json()) == TrtBuildConfig()


@pytest.mark.parametrize(
    ("kwargs", "pieces"),
    [
        ({"builder_optimization_level": 7}, ["builder_optimization_level=7", "0..5", "default is 3"]),
        ({"builder_optimization_level": True}, ["builder_optimization_level=True"]),
        ({"workspace_bytes": 0}, ["workspace_bytes=0", "positive", "4 GiB"]),
        ({"workspace_bytes": 1.5}, ["workspace_bytes=1.5"]),
        ({"flags": ("fp16", "fp4")}, ["'fp4'", "fp16, bf16, int8, fp8, tf32"]),
        ({"flags": ("fp16",), "strongly_typed": True}, ["strongly_typed=True", "refuses precision flags"]),
        ({"extra_profiles": ({"batch": [1, 1, 1]},)}, ["ShapeProfile"]),
    ],
)
def test_build_config_validation_names_value_and_fix(kwargs: dict[str, Any], pieces: list[str]) -> None:
    with pytest.raises(RuntimeInputError) as e:
        TrtBuildConfig(**kwargs)
    for piece in pieces:
        assert piece in str(e.value)


def test_build_config_from_json_refuses_unknown_keys() -> None:
    with pytest.raises(RuntimeInputError, match=r"no field\(s\) \['fp16_mode'\]"):
        TrtBuildConfig.from_json({"fp16_mode": True})


@pytest.mark.parametrize(
    ("precision", "flags"),
    [("fp32", ()), ("fp16", ("fp16",)), ("bf16", ("bf16",)), ("int8", ("int8", "fp16")), ("fp8", ("fp8", "fp16"))],
)
def test_precision_plan_gives_the_builder_flags(precision: str, flags: tuple[str, ...]) -> None:
    assert TrtBuildConfig().flags_for(precision) == flags


def test_explicit_flags_override_the_precision_plan_and_unknown_precision_is_refused() -> None:
    assert TrtBuildConfig(flags=("bf16",)).flags_for("fp16") == ("bf16",)
    with pytest.raises(RuntimeInputError, match=r"precision='int4'.*fp32, fp16, bf16, int8, fp8"):
        TrtBuildConfig().flags_for("int4")


# --- precision vs compute capability --------------------------------------------------------------------


def test_fp8_is_refused_below_compute_capability_8_9() -> None:
    with pytest.raises(BuildError) as e:
        trt_compat.check_precision_supported(TrtBuildConfig().flags_for("fp8"), "8.6")
    msg = str(e.value)
    assert "fp8" in msg and ">= 8.9" in msg and "8.6" in msg and "--precision fp16" in msg


@pytest.mark.parametrize("cc", ["8.9", "9.0", "10.0", (12, 0)])
def test_fp8_is_allowed_from_8_9(cc: Any) -> None:
    trt_compat.check_precision_supported(("fp8", "fp16"), cc)


def test_bf16_needs_ampere_and_fp16_runs_anywhere() -> None:
    with pytest.raises(BuildError, match=r"bf16 .*>= 8\.0.*this GPU is 7\.5"):
        trt_compat.check_precision_supported(("bf16",), "7.5")
    trt_compat.check_precision_supported(("fp16", "int8"), "7.5")


@pytest.mark.parametrize(
    ("value", "expected"), [("8.9", (8, 9)), ("sm_89", (8, 9)), ("sm90", (9, 0)), ((7, 5), (7, 5))]
)
def test_compute_capability_forms(value: Any, expected: tuple[int, int]) -> None:
    assert trt_compat.parse_compute_capability(value) == expected


def test_unreadable_compute_capability_is_refused() -> None:
    with pytest.raises(BuildError, match=r"'ampere'.*'8.9'"):
        trt_compat.parse_compute_capability("ampere")


def test_engine_from_onnx_without_a_gpu_fails_before_any_work(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(BuildError, match=r"no CUDA device.*--backend ort"):
        build_trt.engine_from_onnx(
            tmp_path / "missing.onnx",
            tmp_path / "model.plan",
            unet_inputs(),
            precision="fp16",
            build=TrtBuildConfig(),
            timing_cache_dir=None,
        )
    assert not (tmp_path / "model.plan").exists()


# --- timing cache --------------------------------------------------------------------------------------

KEY = TimingCacheKey("10.8.0.43", "9.0")


def test_timing_cache_file_name_comes_from_the_key() -> None:
    assert KEY.filename == "trt-10.8.0.43_sm90.timing-cache"
    assert TimingCacheKey("10.9.0.34+cuda12", "8.9").filename == "trt-10.9.0.34_cuda12_sm89.timing-cache"
    assert TimingCacheKey("10.8.0.43", "8.6").filename != KEY.filename
    assert TimingCacheKey("10.9.0.34", "9.0").filename != KEY.filename


def test_timing_cache_key_is_validated() -> None:
    with pytest.raises(BuildError, match="not of the form"):
        TimingCacheKey("unknown", "9.0")
    with pytest.raises(BuildError, match="compute capability"):
        TimingCacheKey("10.8.0.43", "hopper")


def test_timing_cache_round_trip() -> None:
    payload = bytes(range(256)) * 10
    assert unpack_timing_cache(pack_timing_cache(KEY, payload), KEY) == (payload, None)
    assert unpack_timing_cache(pack_timing_cache(KEY, b""), KEY) == (b"", None)


@pytest.mark.parametrize(
    ("other", "pieces"),
    [
        (TimingCacheKey("10.7.0.23", "9.0"), ["TensorRT 10.7.0.23", "TensorRT 10.8.0.43"]),
        (TimingCacheKey("10.8.0.43", "8.6"), ["compute capability 8.6", "on 9.0"]),
    ],
)
def test_timing_cache_for_another_key_is_ignored_with_the_reason(other: TimingCacheKey, pieces: list[str]) -> None:
    payload, reason = unpack_timing_cache(pack_timing_cache(other, b"tactics"), KEY)
    assert payload is None
    for piece in pieces:
        assert piece in reason


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda b: b"\x00" + b[1:], "bad magic"),
        (lambda b: b[:20], "truncated header"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
        (lambda b: b[:-3], "checksum"),
        (lambda b: b"raw TensorRT cache bytes", "bad magic"),
    ],
)
def test_damaged_timing_cache_is_ignored(mangle: Any, reason: str) -> None:
    payload, why = unpack_timing_cache(mangle(pack_timing_cache(KEY, b"tactic timings")), KEY)
    assert payload is None and reason in why


def test_read_timing_cache_from_a_folder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert read_timing_cache(tmp_path, KEY) == (None, {"file": KEY.filename, "loaded": False, "ignored": None})
    (tmp_path / KEY.filename).write_bytes(pack_timing_cache(KEY, b"tactics"))
    assert read_timing_cache(tmp_path, KEY)[0] == b"tactics"
    # a cache copied in under this key's name but made elsewhere: ignored, with a warning that says why
    (tmp_path / KEY.filename).write_bytes(pack_timing_cache(TimingCacheKey("10.8.0.43", "8.0"), b"x"))
    with caplog.at_level(logging.WARNING):
        payload, facts = read_timing_cache(tmp_path, KEY)
    assert payload is None and "compute capability 8.0" in facts["ignored"]
    assert "ignored" in caplog.text and KEY.filename in caplog.text


# --- graph inspection and parser errors ----------------------------------------------------------------


def _qdq_model() -> onnx.ModelProto:
    return make_model(
        [
            helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"]),
        ],
        [tensor_info("x", [1, 4])],
        [tensor_info("y", [1, 4])],
        [const("scale", 0.1), const("zp", 0, np.int8)],
    )


def _relu_model() -> onnx.ModelProto:
    return make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", [1, 4])], [tensor_info("y", [1, 4])])


def test_graph_has_qdq(tmp_path: Path) -> None:
    onnx.save_model(_qdq_model(), str(tmp_path / "q.onnx"))
    onnx.save_model(_relu_model(), str(tmp_path / "r.onnx"))
    assert graph_has_qdq(tmp_path / "q.onnx")
    assert not graph_has_qdq(tmp_path / "r.onnx")


def test_parser_errors_are_reported_per_node() -> None:
    errors = [
        ParserErrorInfo(12, "/down/attn/MHA", "MultiHeadAttention", "UNSUPPORTED_NODE", "No importer registered"),
        ParserErrorInfo(-1, "", "", "INVALID_GRAPH", "model has no graph"),
    ]
    msg = format_parser_errors(Path("unet/model.onnx"), errors)
    assert "unet/model.onnx" in msg and "2 error(s)" in msg
    assert "node 12 '/down/attn/MHA' (MultiHeadAttention): UNSUPPORTED_NODE: No importer registered" in msg
    assert "graph: INVALID_GRAPH: model has no graph" in msg
    assert "fix:" in msg


def test_network_inputs_must_match_the_manifest() -> None:
    inputs = unet_inputs()
    network = {"sample": "float32", "timestep": "float32", "encoder_hidden_states": "float32"}
    check_network_inputs(Path("m.onnx"), network, inputs)
    with pytest.raises(BuildError, match=r"inputs \['sample', 'timestep'\] differ"):
        check_network_inputs(Path("m.onnx"), {"sample": "float32", "timestep": "float32"}, inputs)
    fp16 = [tensor_manifest(t, "fp16", PROFILE) for t in SPECS["unet"].inputs]
    with pytest.raises(BuildError) as e:
        check_network_inputs(Path("m.onnx"), network, fp16)
    assert "sample: network float32, manifest float16" in str(e.value)
    assert "timestep" not in str(e.value).split("(")[1].split(")")[0]  # pinned float32: agrees


# --- with TensorRT (skip where `import tensorrt` fails) -------------------------------------------------


def _entry(name: str, shape: list[Any], lo: list[int], opt: list[int], hi: list[int]) -> dict[str, Any]:
    return {"name": name, "dtype": "float32", "shape": shape, "min": lo, "opt": opt, "max": hi}


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_build_writes_a_plan_and_the_manifest_facts(tmp_path: Path) -> None:
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", ["B", 4])], [tensor_info("y", ["B", 4])]
    )
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    inputs = [_entry("x", ["B", 4], [1, 4], [2, 4], [8, 4])]
    cache_dir = tmp_path / "cache"
    facts = build_trt.engine_from_onnx(
        tmp_path / "model.onnx",
        tmp_path / "model.plan",
        inputs,
        precision="fp32",
        build=TrtBuildConfig(builder_optimization_level=1),
        timing_cache_dir=cache_dir,
    )
    import tensorrt as trt

    from diffusion_trt.artifact.folder import sha256_file

    assert facts["tensorrt"] == trt.__version__
    cc = ".".join(map(str, torch.cuda.get_device_capability()))
    assert facts["compute_capability"] == cc and facts["gpu"] == torch.cuda.get_device_name()
    assert facts["plan_sha256"] == sha256_file(tmp_path / "model.plan")
    assert facts["plan_bytes"] == (tmp_path / "model.plan").stat().st_size
    assert [p["kind"] for p in facts["profiles"]] == ["dynamic", "static"]
    assert facts["timing_cache"] == {
        "file": TimingCacheKey(trt.__version__, cc).filename,
        "loaded": False,
        "saved": True,
        "ignored": None,
    }
    json.dumps(facts)  # goes into manifest.json as is
    again = build_trt.engine_from_onnx(
        tmp_path / "model.onnx",
        tmp_path / "again.plan",
        inputs,
        precision="fp32",
        build=TrtBuildConfig(builder_optimization_level=1),
        timing_cache_dir=cache_dir,
    )
    assert again["timing_cache"]["loaded"] is True


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_parser_errors_name_the_node(tmp_path: Path) -> None:
    model = make_model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="ok_relu"),
            helper.make_node("NoSuchOp", ["r"], ["y"], name="the_bad_node", domain="example.custom"),
        ],
        [tensor_info("x", [1, 4])],
        [tensor_info("y", [1, 4], TensorProto.FLOAT)],
        extra_opsets=[("example.custom", 1)],
        check=False,
    )
    onnx.save_model(model, str(tmp_path / "model.onnx"))
    with pytest.raises(BuildError) as e:
        build_trt.engine_from_onnx(
            tmp_path / "model.onnx",
            tmp_path / "model.plan",
            [_entry("x", [1, 4], [1, 4], [1, 4], [1, 4])],
            precision="fp32",
            build=TrtBuildConfig(),
            timing_cache_dir=None,
        )
    assert "node 1 'the_bad_node' (NoSuchOp)" in str(e.value)
    assert not (tmp_path / "model.plan").exists()


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_fp8_is_refused_before_parsing_on_an_older_gpu(tmp_path: Path) -> None:
    if torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU supports fp8")
    with pytest.raises(BuildError, match=r">= 8.9"):
        build_trt.engine_from_onnx(
            tmp_path / "does-not-exist.onnx",  # never opened: the check comes first
            tmp_path / "model.plan",
            unet_inputs(),
            precision="fp8",
            build=TrtBuildConfig(),
            timing_cache_dir=None,
        )

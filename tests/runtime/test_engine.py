"""EngineSpec validation and OrtEngine on tiny hand-built graphs (plain run and IO binding, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from diffusion_trt.errors import ArtifactError, RuntimeInputError
from diffusion_trt.runtime.engines.engine import Engine, EngineSpec
from diffusion_trt.runtime.engines.ort_engine import OrtEngine, resolve_conv_algo_search
from tests.graphs import const, make_model, tensor_info


def _tensor(name: str, dtype: str, shape: list[Any], lo: list[int], hi: list[int]) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": shape, "min": lo, "opt": lo, "max": hi}


#: unet-shaped: x [B2,4,h,w] float32, t [B2] float32 -> y [B2,4,h,w] = x * 2 + t
ADD_SPEC: dict[str, Any] = {
    "inputs": [
        _tensor("x", "float32", ["B2", 4, "h", "w"], [1, 4, 4, 4], [4, 4, 16, 16]),
        _tensor("t", "float32", ["B2"], [1], [4]),
    ],
    "outputs": [_tensor("y", "float32", ["B2", 4, "h", "w"], [1, 4, 4, 4], [4, 4, 16, 16])],
}

#: vae-decoder-shaped: z [B,4,h,w] -> img [B,3,H,W] (H = 8h): an output dim no input binds
UPSAMPLE_SPEC: dict[str, Any] = {
    "inputs": [_tensor("z", "float32", ["B", 4, "h", "w"], [1, 4, 4, 4], [2, 4, 16, 16])],
    "outputs": [_tensor("img", "float32", ["B", 3, "H", "W"], [1, 3, 32, 32], [2, 3, 128, 128])],
}


def add_model() -> onnx.ModelProto:
    return make_model(
        [
            helper.make_node("Mul", ["x", "two"], ["x2"]),
            helper.make_node("Reshape", ["t", "shape4"], ["t4"]),
            helper.make_node("Add", ["x2", "t4"], ["y"]),
        ],
        [tensor_info("x", ["B2", 4, "h", "w"]), tensor_info("t", ["B2"])],
        [tensor_info("y", ["B2", 4, "h", "w"])],
        [const("two", 2.0), const("shape4", [-1, 1, 1, 1], np.int64)],
    )


def upsample_model() -> onnx.ModelProto:
    return make_model(
        [
            helper.make_node("Resize", ["z", "", "scales"], ["up"], mode="nearest"),
            helper.make_node("Slice", ["up", "starts", "ends", "axes"], ["img"]),
        ],
        [tensor_info("z", ["B", 4, "h", "w"])],
        [tensor_info("img", ["B", 3, "H", "W"])],
        [
            const("scales", [1.0, 1.0, 8.0, 8.0]),
            const("starts", [0], np.int64),
            const("ends", [3], np.int64),
            const("axes", [1], np.int64),
        ],
    )


@pytest.fixture(scope="module")
def add_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("add") / "model.onnx"
    onnx.save_model(add_model(), str(path))
    return path


@pytest.fixture(scope="module")
def upsample_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("up") / "model.onnx"
    onnx.save_model(upsample_model(), str(path))
    return path


def feeds(b: int = 2, h: int = 8, w: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(b, 4, h, w, generator=g), "t": torch.arange(b, dtype=torch.float32)}


def expected(f: dict[str, torch.Tensor]) -> torch.Tensor:
    return f["x"] * 2 + f["t"].view(-1, 1, 1, 1)


# --- EngineSpec.validate ------------------------------------------------------------------------------

SPEC = EngineSpec.from_manifest("unet", ADD_SPEC)


def test_validate_returns_symbol_values() -> None:
    assert SPEC.validate(feeds(b=3, h=8, w=12)) == {"B2": 3, "h": 8, "w": 12}
    assert SPEC.output_shapes({"B2": 3, "h": 8, "w": 12}) == {"y": (3, 4, 8, 12)}


@pytest.mark.parametrize(
    ("mutate", "pieces"),
    [
        (lambda f: f.pop("t"), ["missing input", "'unet'", "t", "it takes x, t"]),
        (lambda f: f.update(extra=torch.zeros(1)), ["unknown input", "extra"]),
        (lambda f: f.update(t=np.zeros(2, np.float32)), ["input 't'", "ndarray", "torch.Tensor"]),
        (lambda f: f.update(x=f["x"].half()), ["input 'x'", "torch.float16", "expects torch.float32"]),
        (lambda f: f.update(x=f["x"][0]), ["input 'x'", "(4, 8, 8)", "rank 3", "rank 4"]),
        (lambda f: f.update(x=torch.zeros(2, 3, 8, 8)), ["input 'x'", "(2, 3, 8, 8)", "dim 1 must be 4"]),
        (
            lambda f: f.update(x=torch.zeros(2, 4, 32, 8)),
            ["input 'x'", "(2, 4, 32, 8)", "dim 2 ('h') = 32", "4..16", "(1, 4, 4, 4)..(4, 4, 16, 16)"],
        ),
        (
            lambda f: f.update(x=torch.zeros(5, 4, 8, 8), t=torch.zeros(5)),
            ["input 'x'", "('B2') = 5", "1..4"],
        ),
        (lambda f: f.update(t=torch.zeros(3)), ["input 't'", "('B2') = 3", "input 'x' has 'B2' = 2"]),
    ],
)
def test_validate_errors_name_tensor_shape_and_range(mutate: Any, pieces: list[str]) -> None:
    f = feeds()
    mutate(f)
    with pytest.raises(RuntimeInputError) as e:
        SPEC.validate(f)
    for piece in pieces:
        assert piece in str(e.value)


def test_validate_checks_device() -> None:
    f = feeds()
    f["x"] = torch.empty(2, 4, 8, 8, device="meta")
    with pytest.raises(RuntimeInputError, match=r"input 'x' is on meta; the engine runs on cpu"):
        SPEC.validate(f, torch.device("cpu"))


def test_spec_rejects_output_dims_no_input_determines() -> None:
    bad = {**UPSAMPLE_SPEC, "outputs": [_tensor("img", "float32", ["B", 3, "Q", "W"], [1, 3, 1, 1], [2, 3, 9, 9])]}
    with pytest.raises(ArtifactError, match=r"dim 'Q' that no input determines"):
        EngineSpec.from_manifest("vae_decoder", bad)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"outputs": []}, "lacks 'inputs'"),
        ({"inputs": [{"name": "x"}], "outputs": []}, "malformed tensor entry"),
        ({"inputs": [_tensor("x", "complex64", [1], [1], [1])], "outputs": []}, "dtype 'complex64'"),
        ({"inputs": [_tensor("x", "float32", ["B", 4], [1], [2])], "outputs": []}, "differ in rank"),
    ],
)
def test_spec_rejects_malformed_manifest_entries(entry: dict[str, Any], match: str) -> None:
    with pytest.raises(ArtifactError, match=match):
        EngineSpec.from_manifest("unet", entry)


# --- OrtEngine -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("io_binding", [False, True])
def test_ort_engine_runs_and_matches_reference(add_path: Path, io_binding: bool) -> None:
    with OrtEngine(add_path, ADD_SPEC, name="unet", io_binding=io_binding) as engine:
        assert isinstance(engine, Engine)
        assert engine.providers == ["CPUExecutionProvider"]
        for b, h, w in ((1, 4, 4), (4, 16, 8), (2, 8, 8)):
            f = feeds(b, h, w, seed=b)
            out = engine.run(f)
            assert list(out) == ["y"]
            assert out["y"].shape == (b, 4, h, w) and out["y"].dtype == torch.float32
            torch.testing.assert_close(out["y"], expected(f))


@pytest.mark.parametrize("io_binding", [False, True])
def test_ort_engine_accepts_non_contiguous_inputs(add_path: Path, io_binding: bool) -> None:
    f = {"x": torch.randn(2, 4, 8, 6).transpose(2, 3), "t": torch.ones(2)}
    assert not f["x"].is_contiguous()
    with OrtEngine(add_path, ADD_SPEC, io_binding=io_binding) as engine:
        torch.testing.assert_close(engine.run(f)["y"], expected(f))


def test_io_binding_outputs_alias_buffers_overwritten_by_next_run(add_path: Path) -> None:
    """The documented contract: with IO binding the returned tensor is the engine's buffer."""
    with OrtEngine(add_path, ADD_SPEC, io_binding=True) as engine:
        f1, f2 = feeds(seed=1), feeds(seed=2)
        y1 = engine.run(f1)["y"]
        kept = y1.clone()
        y2 = engine.run(f2)["y"]
        assert y1.data_ptr() == y2.data_ptr()
        torch.testing.assert_close(y1, expected(f2))  # overwritten in place
        torch.testing.assert_close(kept, expected(f1))
        y3 = engine.run(feeds(b=1, seed=3))["y"]  # a new shape gets a new buffer
        assert y3.shape[0] == 1


def test_ort_engine_derives_output_dims(upsample_path: Path) -> None:
    with OrtEngine(upsample_path, UPSAMPLE_SPEC, name="vae_decoder", io_binding=True) as engine:
        z = torch.randn(2, 4, 5, 7)
        img = engine.run({"z": z})["img"]
        assert img.shape == (2, 3, 40, 56)
        torch.testing.assert_close(img, z[:, :3].repeat_interleave(8, 2).repeat_interleave(8, 3))


def test_plain_run_detects_manifest_shape_disagreement(upsample_path: Path) -> None:
    # the manifest claims H = 4h, the graph makes 8h
    with OrtEngine(upsample_path, UPSAMPLE_SPEC, derived={"H": ("h", 4), "W": ("w", 4)}) as engine:
        with pytest.raises(ArtifactError, match=r"output 'img' has shape \(1, 3, 32, 32\).*predicts \(1, 3, 16, 16\)"):
            engine.run({"z": torch.zeros(1, 4, 4, 4)})


def test_ort_engine_validates_before_running(add_path: Path) -> None:
    with OrtEngine(add_path, ADD_SPEC, name="unet") as engine:
        with pytest.raises(RuntimeInputError, match=r"engine 'unet' input 'x'.*dim 2 \('h'\) = 2 is outside"):
            engine.run({"x": torch.zeros(1, 4, 2, 4), "t": torch.zeros(1)})


def test_run_outside_context_is_an_error(add_path: Path) -> None:
    engine = OrtEngine(add_path, ADD_SPEC, name="unet")
    with pytest.raises(RuntimeError, match="not open"):
        engine.run(feeds())
    with engine:
        with engine:  # re-entrant: the inner exit keeps the session
            pass
        assert engine.is_open
        engine.run(feeds())
    assert not engine.is_open
    with pytest.raises(RuntimeError, match="not open"):
        engine.run(feeds())


def test_graph_manifest_mismatch_is_an_artifact_error(add_path: Path) -> None:
    renamed = {**ADD_SPEC, "inputs": [ADD_SPEC["inputs"][0], _tensor("time", "float32", ["B2"], [1], [4])]}
    with pytest.raises(ArtifactError, match=r"graph's inputs .* differ from the manifest's"):
        OrtEngine(add_path, renamed).__enter__()
    wrong_dtype = {**ADD_SPEC, "outputs": [{**ADD_SPEC["outputs"][0], "dtype": "float16"}]}
    with pytest.raises(ArtifactError, match=r"graph's outputs"):
        OrtEngine(add_path, wrong_dtype).__enter__()


def test_missing_or_corrupt_model_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=r"model file .* is missing"):
        OrtEngine(tmp_path / "nope.onnx", ADD_SPEC).__enter__()
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ArtifactError, match="could not load"):
        OrtEngine(bad, ADD_SPEC).__enter__()


def test_constructor_rejects_bad_options(add_path: Path) -> None:
    with pytest.raises(ArtifactError, match="device='tpu'"):
        OrtEngine(add_path, ADD_SPEC, device="tpu")
    with pytest.raises(ArtifactError, match=r"cudnn_conv_algo_search='FAST'.*AUTO, EXHAUSTIVE, HEURISTIC, DEFAULT"):
        OrtEngine(add_path, ADD_SPEC, device="cuda", cudnn_conv_algo_search="FAST")


def test_auto_conv_algo_search_follows_the_profile(add_path: Path) -> None:
    """AUTO (the default): EXHAUSTIVE for a static profile, HEURISTIC for a dynamic one, and a size-bucket variant
    (static spec) of a dynamic engine keeps the dynamic engine's choice; an explicit choice is kept as given."""
    from diffusion_trt.runtime.engines.buckets import static_spec

    dynamic = OrtEngine(add_path, ADD_SPEC, device="cuda")
    static = static_spec(dynamic.spec, {"B2": 2, "h": 8, "w": 8})
    assert resolve_conv_algo_search("AUTO", dynamic.spec) == "HEURISTIC"
    assert resolve_conv_algo_search("AUTO", static) == "EXHAUSTIVE"
    assert resolve_conv_algo_search("DEFAULT", static) == "DEFAULT"

    def search(engine: OrtEngine) -> str:
        return engine._provider_options()["cudnn_conv_algo_search"]

    assert search(dynamic) == "HEURISTIC"
    assert search(OrtEngine(add_path, static, device="cuda")) == "EXHAUSTIVE"
    assert search(dynamic.variant(static, free_dimensions={"B2": 2, "h": 8, "w": 8})) == "HEURISTIC"
    assert search(OrtEngine(add_path, ADD_SPEC, device="cuda", cudnn_conv_algo_search="EXHAUSTIVE")) == "EXHAUSTIVE"


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="this onnxruntime has the CUDA provider"
)
def test_cuda_without_gpu_build_names_the_fix(add_path: Path) -> None:
    with pytest.raises(ArtifactError) as e:
        OrtEngine(add_path, ADD_SPEC, device="cuda").__enter__()
    msg = str(e.value)
    assert "CUDAExecutionProvider" in msg and "CPUExecutionProvider" in msg and "onnxruntime-gpu" in msg

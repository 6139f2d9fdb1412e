"""Issue 24 item 13: fp16 that is silently wrong. A small CNN whose BatchNorm variance reaches 4.8e7 (as in a text
detector shipped in a PyPI wheel): clipped to 65,504 the output is wrong with every tensor finite. The node that
reads such a weight must stay fp32 (never clipped), the fp16 check must compare outputs with a stated verdict, and
``optimize --check`` must exit 1 when that verdict fails."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from diffusion_trt.cli import main
from diffusion_trt.passes import PassContext, optimize_model
from diffusion_trt.passes import fp16_check as fp16_check_module
from diffusion_trt.passes.convert_fp16 import convert_fp16
from diffusion_trt.passes.parity import MAX_ABS_OF_SCALE, MIN_COSINE, output_parity

VARIANCE = 4.8e7


def _cnn() -> onnx.ModelProto:
    """x[1,3,32,32] -> Conv(8) -> BatchNormalization(var up to 4.8e7) -> Relu -> Conv(4) -> y."""
    rng = np.random.default_rng(0)
    c = 8
    var = np.full(c, 1.0, np.float32)
    var[: c // 2] = VARIANCE  # half the channels: a huge spread before the norm, scaled back by gamma
    conv1 = rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * np.sqrt(var)[:, None, None, None] / 4
    gamma = np.ones(c, np.float32)
    inits = [numpy_helper.from_array(a, n) for a, n in (
        (conv1, "w1"), (np.zeros(c, np.float32), "b1"), (gamma, "gamma"), (np.zeros(c, np.float32), "beta"),
        (np.zeros(c, np.float32), "mean"), (var, "var"),
        (rng.standard_normal((4, c, 3, 3)).astype(np.float32) * 0.2, "w2"))]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c1", "gamma", "beta", "mean", "var"], ["bn"], name="bn",
                              epsilon=1e-5),
             helper.make_node("Relu", ["bn"], ["r"], name="relu"),
             helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "detector",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 32, 32])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = x.astype(np.float16) if session.get_inputs()[0].type == "tensor(float16)" else x
    return np.asarray(session.run(None, {"x": feed})[0], np.float32)


def test_a_weight_beyond_fp16_keeps_its_node_fp32_unclipped() -> None:
    model = _cnn()
    ctx = PassContext(component="cnn", backend="tensorrt", device="cuda", precision="fp16")
    out, records = optimize_model(model, [convert_fp16], ctx)
    counts = records[0].counts
    assert counts["fp32_wide_constants"] == 1 and counts["clipped"] == 0, counts
    bn = next(n for n in out.graph.node if n.op_type == "BatchNormalization")
    inits = {t.name: t for t in out.graph.initializer}
    var = numpy_helper.to_array(inits[bn.input[4]])
    assert var.dtype == np.float32 and float(var.max()) == VARIANCE  # not 65504
    assert inits["w2"].data_type == TensorProto.FLOAT16  # the rest is fp16
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    parity = output_parity("y", _run(model, x), _run(out, x))
    assert parity.failure("fp16") is None, parity


def test_float32_extremes_still_become_fp16_extremes() -> None:
    """-3.4e38 (torch's masked_fill(finfo.min)) is an infinity stand-in, not a value: it becomes -65504 in fp16."""
    from diffusion_trt.passes.convert_fp16 import F32_EXTREME, _beyond_fp16

    assert not _beyond_fp16(np.array([-3.4e38, 1.0], np.float32)) and not _beyond_fp16(np.array([np.inf], np.float32))
    assert _beyond_fp16(np.array([VARIANCE], np.float32)) and _beyond_fp16(np.array([-65505.0], np.float32))
    assert F32_EXTREME == 1e38


def _optimize(tmp_path: Path, *extra: str) -> tuple[int, str, dict]:
    src, out, report = tmp_path / "cnn.onnx", tmp_path / "cnn.fp16.onnx", tmp_path / "r.json"
    onnx.save(_cnn(), str(src))
    result = CliRunner().invoke(main, ["optimize", str(src), "-o", str(out), "--target", "tensorrt", "--precision",
                                       "fp16", "--check", "--json", str(report), "--overwrite", *extra])
    assert "Traceback" not in result.output and (result.exception is None or isinstance(result.exception,
                                                                                          SystemExit))
    return result.exit_code, result.output, json.loads(report.read_text()) if report.exists() else {}


def test_optimize_fp16_check_passes_with_the_node_kept_fp32(tmp_path: Path) -> None:
    code, output, report = _optimize(tmp_path)
    assert code == 0, output
    (parity,) = report["parity"]["outputs"]
    assert parity["cosine"] >= MIN_COSINE and parity["max_abs"] <= MAX_ABS_OF_SCALE["fp16"] * parity["scale"]
    assert report["fp16_check"]["wide_constant_nodes"] == 1
    assert "reading weights beyond +-65504" in output
    assert (tmp_path / "cnn.fp16.onnx").exists()


def test_a_clipped_weight_fails_the_fp16_check_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the tree did before: the variance clipped. The fp16 check's verdict refuses it (compile too: it runs
    the same check on every fp16 component)."""
    monkeypatch.setattr("diffusion_trt.passes.convert_fp16._reads_wide_constant", lambda node, wide: False)
    code, output, _ = _optimize(tmp_path)
    assert code == 1, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the fp16 graph does not match fp32" in errors[0], output
    assert f"needs >= {MIN_COSINE}" in errors[0]
    assert not (tmp_path / "cnn.fp16.onnx").exists()


def test_optimize_check_verdict_exits_1_and_removes_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the fp16 check's own comparison out of the way, ``--check`` gives the same verdict on its own."""
    monkeypatch.setattr("diffusion_trt.passes.convert_fp16._reads_wide_constant", lambda node, wide: False)
    monkeypatch.setattr(fp16_check_module, "_check_parity", lambda *args: None)
    code, output, report = _optimize(tmp_path)
    assert code == 1, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--check: the optimized graph does not match the original" in errors[0], output
    assert "output 'y': cosine" in errors[0] and "allowed 0.05 x" in errors[0]
    assert report["parity"]["outputs"][0]["cosine"] < MIN_COSINE  # --json still tells the figures
    assert not (tmp_path / "cnn.fp16.onnx").exists()


def test_parity_verdict_thresholds() -> None:
    x = np.linspace(-1, 1, 1000)
    assert output_parity("y", x, x + 0.01).failure("fp16") is None
    assert "allowed 0.05 x" in output_parity("y", x, x + 0.2).failure("fp16")
    assert "cosine" in output_parity("y", x, -x).failure("fp32")
    assert "inf/NaN" in output_parity("y", x, np.full_like(x, np.nan)).failure("fp16")
    assert "allowed 0.001 x" in output_parity("y", x, x + 0.01).failure("fp32")  # 1% of scale: too much for fp32


def test_a_failed_check_leaves_an_earlier_output_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--overwrite --check with a graph that fails the verdict: the OUTPUT of an earlier run was written over, then
    removed ("nothing was written", and the earlier result lost)."""
    monkeypatch.setattr("diffusion_trt.passes.convert_fp16._reads_wide_constant", lambda node, wide: False)
    monkeypatch.setattr(fp16_check_module, "_check_parity", lambda *args: None)
    (tmp_path / "cnn.fp16.onnx").write_bytes(b"an earlier, good result")
    code, output, report = _optimize(tmp_path)
    assert code == 1, output
    assert "nothing was written" in output and report["files"] == []
    assert (tmp_path / "cnn.fp16.onnx").read_bytes() == b"an earlier, good result"

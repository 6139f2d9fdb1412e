"""diffusion-trt optimize: any ONNX file through the pass pipelines, the count table, --check, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from diffusion_trt import optimize as opt
from diffusion_trt.cli import main
from diffusion_trt.passes.parity import output_parity
from tests import graphs
from tests.passes.test_fuse_group_norm import group_norm_model


def _invoke(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture
def attention_onnx(tmp_path: Path) -> Path:
    path = tmp_path / "attn.onnx"
    onnx.save_model(graphs.einsum_attention_model(), path)
    return path


def test_optimize_prints_counts_rejections_and_parity(attention_onnx: Path, tmp_path: Path) -> None:
    out, report = tmp_path / "out" / "attn.opt.onnx", tmp_path / "r.json"
    code, text = _invoke("optimize", attention_onnx, "-o", out, "--target", "tensorrt", "--check",
                         "--dump-passes", tmp_path / "dump", "--json", report)
    assert code == 0, text
    assert "lower_einsum" in text and "MatMul=2" in text
    assert "rejected 1x: Softmax: Softmax input is rank 3" in text  # the framework's reason, aggregated
    assert "check: original on CPUExecutionProvider, optimized on CPUExecutionProvider" in text
    data = json.loads(report.read_text())
    (parity,) = data["parity"]["outputs"]
    assert parity["max_abs"] <= 1e-4 * max(parity["scale"], 1.0) and parity["cosine"] > 0.9999
    assert "Einsum" not in graphs.op_counts(onnx.load(out))
    assert (tmp_path / "dump" / "attn" / "00_input.onnx").is_file()


def test_fp16_reports_islands(tmp_path: Path) -> None:
    src = tmp_path / "block.onnx"
    onnx.save_model(graphs.overflow_model(gain=5e4), src)
    code, text = _invoke("optimize", src, "-o", tmp_path / "o.onnx", "--target", "tensorrt", "--precision", "fp16",
                         "--check")
    assert code == 0, text
    assert "fp16 range check: 1 tensor(s) > 32768" in text and "kept fp32: norm, proj" in text
    assert "fp32_range_islands=2" in text and "NOT FINITE" not in text


def test_fp16_refusal_exits_1_naming_the_node(tmp_path: Path) -> None:
    src = tmp_path / "amp.onnx"
    onnx.save_model(graphs.huge_output_model(), src)
    code, text = _invoke("optimize", src, "-o", tmp_path / "o.onnx", "--target", "tensorrt", "--precision", "fp16")
    assert code == 1 and "'amplify'" in text and "cannot make this graph finite" in text
    assert not (tmp_path / "o.onnx").exists()  # never a NaN graph written


def test_check_says_when_the_graph_cannot_run_here(tmp_path: Path) -> None:
    """ort-cuda fuses GroupNorm into com.microsoft.GroupNorm, which has no CPU kernel."""
    src = tmp_path / "gn.onnx"
    onnx.save_model(group_norm_model(), src)
    code, text = _invoke("optimize", src, "-o", tmp_path / "o.onnx", "--target", "ort-cuda", "--check",
                         "--shape", "x:2x8x4x4")
    assert code == 0, text
    if "CUDAExecutionProvider" not in opt._ort.available_providers():
        assert "check: not compared: the optimized graph cannot run on this machine" in text
        assert "CUDAExecutionProvider: not in this onnxruntime" in text


def test_unknown_dims_warn_and_shape_overrides(tmp_path: Path) -> None:
    model = group_norm_model()
    feeds, warnings = opt.random_feeds(model)
    assert feeds[0]["x"].shape[0] == 1 and "--shape x:1x" in warnings[0]
    feeds, warnings = opt.random_feeds(model, {"x": [3, 8, 4, 4]})
    assert feeds[0]["x"].shape == (3, 8, 4, 4) and warnings == []


def test_initializers_listed_as_inputs_are_folded_with_a_warning(tmp_path: Path) -> None:
    """A graph whose weights are also graph inputs (torch's keep_initializers_as_inputs=True): the optimized file
    dropped those inputs without a word, and a caller feeding them would then be refused."""
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], initializer=[weight])
    src = tmp_path / "overridable.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), src)
    result = CliRunner().invoke(main, ["optimize", str(src), "-o", str(tmp_path / "out.onnx"), "--target", "ort-cpu"])
    assert result.exit_code == 0, result.output
    assert ("1 graph input(s) are also initializers (w): they are optimized as the constants they hold, and the "
            "optimized graph does not take them as inputs") in result.output
    assert [i.name for i in onnx.load(tmp_path / "out.onnx").graph.input] == ["x"]


def test_external_data_in_and_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "in" / "mlp.onnx"
    src.parent.mkdir()
    onnx.save_model(graphs.mlp_model(hidden=64), src, save_as_external_data=True, location="mlp.weights",
                    size_threshold=0)
    monkeypatch.setattr(opt, "EXTERNAL_DATA_THRESHOLD_BYTES", 1)  # "large": as a > 2 GB model is written
    result = opt.optimize_file(src, tmp_path / "out" / "mlp.onnx", target="ort-cpu", check=True)
    assert [f.name for f in result.files] == ["mlp.onnx", "mlp.onnx.data"]
    assert all(o.max_abs < 1e-5 for o in result.parity.outputs)


def test_low_opset_is_raised_to_17(tmp_path: Path) -> None:
    model = graphs.mlp_model()
    model.opset_import[0].version = 13
    src = tmp_path / "m13.onnx"
    onnx.save_model(model, src)
    result = opt.optimize_file(src, tmp_path / "o.onnx", target="ort-cpu")
    assert result.opset == (13, 17)


# --- bad input: exit 2 and a message naming the value and the fix -------------------------------------------


@pytest.mark.parametrize(("args", "needles"), [
    (["--target", "onnx-web"], ["'onnx-web'", "ort-cuda", "tensorrt"]),
    (["--precision", "int4"], ["'int4'", "fp16"]),
    (["--target", "ort-cpu", "--precision", "fp16"], ["ort-cpu", "--precision fp32"]),
    (["--shape", "qkv:4xAx6"], ["qkv:4xAx6", "--shape sample:1x4x64x64"]),
    (["--shape", "nope:1x2x3"], ["'nope'", "inputs are qkv"]),
    (["--shape", "qkv:4x24"], ["rank 2", "rank 3"]),
    # a typo'd dim: numpy's MemoryError came out as a traceback (exit 1)
    (["--shape", "qkv:4x99999999999x6", "--check"], ["error: input 'qkv' of shape 4x99999999999x6 would take "
                                                     "17881.4 GiB of random values, more than the 4 GiB",
                                                     "--inputs FILE.npz"]),
    (["--pass-option", "no_such_option=1"], ["no_such_option", "known:"]),
    (["--pass-option", "pack_qkv"], ["'pack_qkv' is not KEY=VALUE", "pack_qkv=false"]),
    (["--pass-option", "pack_qkv=yes"], ["pack_qkv='yes'", "true or false"]),
    (["--inputs", "missing.npz"], ["missing.npz", "numpy.savez"]),
    (["--seed", "-1"], ["-1", "--seed"]),
])
def test_bad_option_values(attention_onnx: Path, tmp_path: Path, args: list[str], needles: list[str]) -> None:
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.onnx", *args)
    assert code == 2, text
    for needle in needles:
        assert needle in text, (needle, text)


def test_a_malformed_shape_names_the_option_once(attention_onnx: Path, tmp_path: Path) -> None:
    """It said "error: Invalid value for --shape: --shape 'qkv:4xAx6' is not ..."."""
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.onnx", "--shape", "qkv:4xAx6")
    assert code == 2 and text.splitlines()[0] == ("error: --shape 'qkv:4xAx6' is not NAME:DIMS with positive dims "
                                                  "joined by x; use e.g. --shape sample:1x4x64x64"), text


def test_bad_inputs_file(attention_onnx: Path, tmp_path: Path) -> None:
    npz = tmp_path / "in.npz"
    np.savez(npz, x=np.zeros((4, 24, 6), np.float32))
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.onnx", "--inputs", npz)
    assert code == 2 and "missing: qkv" in text and "unknown: x" in text and "under its name" in text
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.onnx", "--inputs", npz,
                         "--shape", "qkv:4x24x6")
    assert code == 2 and "drop one of the two" in text
    (tmp_path / "bad.npz").write_text("not numpy")
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.onnx", "--inputs", tmp_path / "bad.npz")
    # said "(ValueError: This file contains pickled (object) data. If you trust the file you can load it unsafely
    # using the `allow_pickle=` keyword argument ...)": numpy's advice for a file that is no pickle either
    assert code == 2 and text == (f"error: --inputs '{tmp_path / 'bad.npz'}' is not a NumPy .npz file (an .npz is a "
                                  "zip archive); write it with numpy.savez(path, input_name=array, ...)\n"), text


def test_bad_paths(attention_onnx: Path, tmp_path: Path) -> None:
    code, text = _invoke("optimize", tmp_path / "none.onnx", "-o", tmp_path / "o.onnx")
    assert code == 2 and "none.onnx" in text and "does not exist" in text
    (tmp_path / "junk.onnx").write_text("junk")
    code, text = _invoke("optimize", tmp_path / "junk.onnx", "-o", tmp_path / "o.onnx")
    assert code == 2 and "is not an ONNX model" in text
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.txt")
    assert code == 2 and "does not end in .onnx" in text
    code, text = _invoke("optimize", attention_onnx, "-o", attention_onnx)
    assert code == 2 and "is the input file" in text
    (tmp_path / "file").write_text("")
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.onnx", "--dump-passes", tmp_path / "file")
    assert code == 2 and "--dump-passes" in text and "is a file; give a folder" in text


def test_json_path_checked_before_the_passes(attention_onnx: Path, tmp_path: Path) -> None:
    """An unwritable --json used to fail after the passes, with OUTPUT already written."""
    (tmp_path / "file").write_text("")
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.onnx", "--json", tmp_path / "file" / "r.json")
    assert code == 2
    assert f"error: --json {tmp_path / 'file' / 'r.json'}: {tmp_path / 'file'} is a file, not a folder" in text
    assert "passes for" not in text and not (tmp_path / "o.onnx").exists()
    # a missing folder is refused, not made (as bench --json and run -o)
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.onnx", "--json", tmp_path / "no" / "r.json")
    assert code == 2
    assert (f"error: --json {tmp_path / 'no' / 'r.json'}: the folder {tmp_path / 'no'} does not exist; create it "
            f"first (mkdir -p {tmp_path / 'no'}) or choose another path") in text
    assert not (tmp_path / "no").exists() and not (tmp_path / "o.onnx").exists()


def test_an_existing_output_is_kept_unless_overwrite(attention_onnx: Path, tmp_path: Path) -> None:
    """As ``run -o``: an existing OUTPUT is refused before any pass runs (exit 2, one line), and replaced only with
    --overwrite."""
    out = tmp_path / "attn.opt.onnx"
    out.write_bytes(b"keep me")
    code, text = _invoke("optimize", attention_onnx, "-o", out, "--target", "tensorrt")
    assert code == 2, text
    assert f"error: {out} already exists; pass --overwrite to replace it, or choose another -o" in text
    assert out.read_bytes() == b"keep me"
    code, text = _invoke("optimize", attention_onnx, "-o", out, "--target", "tensorrt", "--overwrite")
    assert code == 0, text
    assert "Einsum" not in graphs.op_counts(onnx.load(out))


def _sqrt_model() -> onnx.ModelProto:
    """y = Sqrt(x) + 1: NaN on the random normal inputs wherever x < 0, in the original as in any faithful rewrite."""
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 8])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 8])
    one = onnx.numpy_helper.from_array(np.ones((1,), np.float32), "one")
    nodes = [onnx.helper.make_node("Sqrt", ["x"], ["r"]), onnx.helper.make_node("Add", ["r", "one"], ["y"])]
    graph = onnx.helper.make_graph(nodes, "sqrt", [x], [y], [one])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_check_passes_a_graph_whose_original_output_holds_nan(tmp_path: Path) -> None:
    """ONNX's test_operator_sqrt / _pow: the fp32 rewrite matches the original, NaN for NaN; it was refused (exit 1,
    "does not match the original (output holds inf/NaN)", the output removed, "use --precision fp32")."""
    src, out = tmp_path / "sqrt.onnx", tmp_path / "o.onnx"
    onnx.save(_sqrt_model(), src)
    code, text = _invoke("optimize", src, "-o", out, "--target", "ort-cpu", "--check")
    assert code == 0, text
    assert out.exists() and "error:" not in text
    line = next(line for line in text.splitlines() if line.strip().startswith("y "))
    assert "max_abs=0 " in line and "NOT FINITE" not in line and "the original holds" in line and "inf/NaN" in line


def test_parity_takes_the_originals_inf_and_nan_where_they_are() -> None:
    x = np.array([1.0, np.nan, np.inf, -np.inf, 4.0])
    same = output_parity("y", x, x.copy())
    assert same.failure("fp32") is None and same.original_nonfinite == 3 and same.max_abs == 0
    assert "other than the original's" in output_parity("y", x, np.array([np.nan, np.nan, np.inf, -np.inf, 4.0])
                                                        ).failure("fp32")
    assert output_parity("y", x, np.array([1.0, np.nan, -np.inf, -np.inf, 4.0])).failure("fp32") is not None
    assert output_parity("y", x, np.array([1.0, 2.0, np.inf, -np.inf, 4.0])).failure("fp32") is not None


def test_fp16_takes_a_graph_whose_fp32_output_holds_nan_already(tmp_path: Path) -> None:
    """The fp16 range check compared the renamed output 'y/float32' with no fp32 tensor, so NaN the fp32 graph has
    too read as made by fp16: refused (exit 1) with "cannot make this graph finite ... in fp16 but not in fp32"."""
    src, out = tmp_path / "sqrt.onnx", tmp_path / "o.onnx"
    onnx.save(_sqrt_model(), src)
    code, text = _invoke("optimize", src, "-o", out, "--target", "tensorrt", "--precision", "fp16", "--check")
    assert code == 0, text
    assert "outputs finite" in text and "inf/NaN in fp32 already on these inputs" in text
    assert out.exists() and "error:" not in text


def test_a_hard_link_of_the_input_is_the_input(attention_onnx: Path, tmp_path: Path) -> None:
    """-o a hard link of the input (another name, the same file) with --overwrite wrote the optimized graph over the
    input in place: the original was gone."""
    import os

    before = attention_onnx.read_bytes()
    link = tmp_path / "link.onnx"
    os.link(attention_onnx, link)
    code, text = _invoke("optimize", attention_onnx, "-o", link, "--overwrite")
    assert code == 2, text
    assert "error: Invalid value for --output: " in text and "is the input file; write the result elsewhere" in text
    assert attention_onnx.read_bytes() == before


@pytest.mark.parametrize("flag", ["--json", "--dump-passes"])
@pytest.mark.parametrize("target", ["input", "output"])
def test_json_and_dump_paths_may_not_be_the_input_or_the_output(attention_onnx: Path, tmp_path: Path, flag: str,
                                                                 target: str) -> None:
    """--json IN.onnx wrote the JSON over the input model (without --overwrite too); --json OUT.onnx over the output
    after "wrote: OUT.onnx"; --dump-passes OUT.onnx made a folder there and failed after the passes."""
    before = attention_onnx.read_bytes()
    out = tmp_path / "o.onnx"
    path = attention_onnx if target == "input" else out
    code, text = _invoke("optimize", attention_onnx, "-o", out, flag, path, "--overwrite")
    assert code == 2, text
    what = "the input file" if target == "input" else "the --output file"
    assert f"error: Invalid value for {flag}: '{path}' is {what}; give {flag} a path of its own" in text, text
    assert attention_onnx.read_bytes() == before and not out.exists()


def test_one_input_given_two_shapes_is_refused(attention_onnx: Path, tmp_path: Path) -> None:
    """--shape x:1x2 --shape x:3x4 ran on the last one, silently."""
    name = onnx.load(attention_onnx).graph.input[0].name
    code, text = _invoke("optimize", attention_onnx, "-o", tmp_path / "o.onnx", "--shape", f"{name}:1x2",
                         "--shape", f"{name}:3x4")
    assert code == 2, text
    assert f"error: Invalid value for --shape: '{name}' is given more than once; give each input one --shape" in text
    assert not (tmp_path / "o.onnx").exists()

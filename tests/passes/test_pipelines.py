"""pipelines.pipeline_for and the BASE pipeline end to end."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from diffusion_trt.passes import PassContext, optimize_model, pipeline_for
from diffusion_trt.passes.pipelines import BACKENDS, BASE, FUSIONS, PIPELINES
from tests import graphs


@pytest.mark.parametrize("key", list(PIPELINES))
def test_every_pipeline_starts_with_base_and_fuses_before_fp16(key: tuple[str, str, str]) -> None:
    passes = tuple(p for p in pipeline_for(*key, "unet") if p.__name__ != "infer_symbolic_shapes")  # dynamic ort-cuda
    assert passes[: len(BASE)] == BASE
    names = [p.__name__ for p in passes]
    assert [n for n in names if n.startswith(("fuse_", "pack_", "merge_", "lower_"))] == [p.__name__ for p in FUSIONS]
    assert names.index("lower_einsum") < names.index("fuse_attention") < names.index("fuse_batched_attention")
    assert names.index("fuse_geglu") < names.index("fuse_gelu")
    assert names.index("fuse_attention") < names.index("pack_qkv")
    rewriting = [n for n in names if not n.startswith("check_")]
    if "convert_fp16" in names:
        assert rewriting[-1] == "convert_fp16"
    assert ("convert_fp16" in names) == (key[2] == "fp16")


@pytest.mark.parametrize("key", list(PIPELINES))
def test_tensorrt_pipelines_end_with_the_onnx_domain_check(key: tuple[str, str, str]) -> None:
    """check_onnx_domain is last in every TensorRT pipeline (after convert_fp16) and in no ORT pipeline."""
    names = [p.__name__ for p in pipeline_for(*key, "unet", static=True)]
    if key[0] in ("tensorrt", "tensorrt-rtx"):
        assert names[-1] == "check_onnx_domain" and names.count("check_onnx_domain") == 1
    else:
        assert "check_onnx_domain" not in names


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_tensorrt_rtx_shares_the_tensorrt_pipelines(precision: str) -> None:
    assert "tensorrt-rtx" in BACKENDS
    for static in (False, True):
        assert (pipeline_for("tensorrt-rtx", "cuda", precision, "unet", static=static)
                == pipeline_for("tensorrt", "cuda", precision, "unet", static=static))


def test_static_profile_specializes_before_folding() -> None:
    names = [p.__name__ for p in pipeline_for("ort", "cuda", "fp16", "unet", static=True)]
    assert names[:3] == ["eliminate_dead_nodes", "specialize_shapes", "fold_constants"]
    assert "specialize_shapes" not in [p.__name__ for p in pipeline_for("ort", "cuda", "fp16", "unet")]


@pytest.mark.parametrize(("key", "message"), [
    (("ort", "cpu", "fp16"), r"no pass pipeline for ort/cpu/fp16; available: ort/cpu/fp32, "),
    (("tensorrt", "cpu", "fp32"), r"no pass pipeline for tensorrt/cpu/fp32"),
])
def test_missing_combination_is_named(key: tuple[str, str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pipeline_for(*key, "unet")


def test_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match=r"backend='openvino' .*use one of ort, tensorrt, tensorrt-rtx"):
        pipeline_for("openvino", "cpu", "fp32", "unet")


def test_base_pipeline_end_to_end() -> None:
    # dead branch + duplicate constants + a constant subgraph + a shape chain, in one model
    dup = graphs.const("s2", [2.0, 2.0, 2.0, 2.0])
    model = graphs.make_model(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
            helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
            helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["flat"]),
            helper.make_node("Mul", ["s1", "s1"], ["s1sq"]),
            helper.make_node("Mul", ["flat", "s1sq"], ["a"]),
            helper.make_node("Mul", ["a", "s2"], ["y"]),
            helper.make_node("Sigmoid", ["x"], ["dead"]),
        ],
        [graphs.tensor_info("x", [3, 2, 2])],
        [graphs.tensor_info("y", [3, 4])],
        [graphs.const("s1", [2.0, 2.0, 2.0, 2.0]), dup, graphs.const("zero", 0, graphs.np.int64),
         graphs.const("axes0", [0], graphs.np.int64), graphs.const("minus_one", [-1], graphs.np.int64)],
    )
    ctx = PassContext(component="unet", backend="ort", device="cpu", precision="fp32")
    out, records = optimize_model(model, BASE, ctx)
    assert [r.name for r in records] == ["eliminate_dead_nodes", "fold_constants", "infer_shapes", "eliminate_noops"]
    assert records[0].counts == {"nodes_removed": 1, "constants_deduped": 1}
    assert records[1].counts == {"nodes_folded": 5}
    assert graphs.op_counts(out) == {"Reshape": 1, "Mul": 2}
    onnx.checker.check_model(out)
    assert {v.name for v in out.graph.value_info} == {"flat", "a"}
    graphs.assert_same_outputs(model, out)


@pytest.mark.parametrize("key", list(PIPELINES))
def test_layout_passes_after_the_fusions_before_fp16(key: tuple[str, str, str]) -> None:
    """align_shapes on CUDA targets, cancel_transposes on ORT CUDA only; both after every fusion, before fp16."""
    names = [p.__name__ for p in pipeline_for(*key, "unet")]
    last_fusion = max(i for i, n in enumerate(names) if n.startswith("fuse_"))
    assert ("align_shapes" in names) == (key[1] == "cuda")
    assert ("cancel_transposes" in names) == (key[:2] == ("ort", "cuda"))
    for name in ("align_shapes", "cancel_transposes"):
        if name in names:
            assert names.index(name) > last_fusion
            assert "convert_fp16" not in names or names.index(name) < names.index("convert_fp16")


@pytest.mark.parametrize(("options", "message"), [
    ({"pack_qkv": "yes"}, r"pack_qkv='yes' \(pack_qkv\): expects true or false"),
    ({"foo_bar": 1}, r"'foo_bar' is not a pass option one can set; known: align_shapes_channels"),
    ({"static_shapes": {}}, r"'static_shapes' is not a pass option"),
    ({"fuse_attention_emit": "bogus"}, r"expects one of mha, trt, none"),
    ({"fold_constants_size_threshold_bytes": "abc"}, r"expects a positive integer"),
    ({"convert_fp16_fp32_ops": "Softmax"}, r"expects a JSON list of names"),
])
def test_user_pass_options_are_checked(options: dict, message: str) -> None:
    from diffusion_trt.passes.options import check_pass_options

    with pytest.raises(ValueError, match=message):
        check_pass_options(options)


def test_every_user_pass_option_is_read_by_a_pass() -> None:
    """The table names only keys some pass reads (a renamed option would leave a dead entry)."""
    from pathlib import Path

    from diffusion_trt.passes.options import USER_OPTIONS

    sources = "".join(p.read_text() for p in Path(__file__).parents[2].glob("diffusion_trt/passes/*.py")
                      if p.name != "options.py")
    for key in USER_OPTIONS:
        assert f'"{key}"' in sources, key

"""pointwise_convs_as_matmul: 1x1 Convs over weight inputs as channels-last MatMuls (compiler/pointwise_convs.py).

The graphs hold the weights as graph inputs, as expose_weights leaves them; the rewritten graph is run with the
weights bound as ``W[:, :, 0, 0].T`` ([C, O]) and compared with the Conv graph on ONNX Runtime CPU (fp32).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from diffusion_trt.compiler.pointwise_convs import is_pointwise, pointwise_convs_as_matmul
from tests import graphs
from tests.passes.fusion_helpers import fuse

N, C, O, H, W = 2, 8, 6, 3, 5  # noqa: E741 (O: the output channels, as in the docs)
RTOL = ATOL = 1e-5


def _weight_inputs(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in model.graph.input if i.name.startswith("w")}


def _model(nodes: list[onnx.NodeProto], weights: dict[str, list[int]], inits: list[onnx.TensorProto] = (),
           out: tuple[str, list[int]] = ("y", [N, C, H, W])) -> onnx.ModelProto:
    inputs = [graphs.tensor_info("x", [N, C, H, W]), *(graphs.tensor_info(n, s) for n, s in weights.items())]
    model = graphs.make_model(nodes, inputs, [graphs.tensor_info(*out)], list(inits))
    return onnx.shape_inference.infer_shapes(model)


def _check(before: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int], dict[str, np.ndarray]]:
    """The pass on ``before``, its outputs compared with the Conv graph's (weights bound [C, O] where rewritten)."""
    after, counts = fuse(before, pointwise_convs_as_matmul)
    onnx.checker.check_model(after, full_check=True)
    weights = _weight_inputs(before)
    shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in after.graph.input}
    bound = {n: np.ascontiguousarray(w[:, :, 0, 0].T) if len(shapes[n]) == 2 else w for n, w in weights.items()}
    x = np.random.default_rng(3).standard_normal((N, C, H, W)).astype(np.float32)
    want = graphs.run(before, {"x": x, **weights})
    got = graphs.run(after, {"x": x, **bound})
    for g, e in zip(got, want, strict=True):
        np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL)
    return after, counts, bound


def _conv(x: str, w: str, y: str, bias: str | None = None, **attrs: object) -> onnx.NodeProto:
    return helper.make_node("Conv", [x, w, *([bias] if bias else [])], [y], kernel_shape=[1, 1], **attrs)


def _transformer_like() -> onnx.ModelProto:
    """SD's Transformer2DModel without linear projection: proj_in (1x1) -> permute(0,2,3,1) -> reshape [N,HW,C]
    -> (a Linear) -> reshape [N,H,W,C] -> permute(0,3,1,2) -> proj_out (1x1) -> + residual."""
    rng = np.random.default_rng(0)
    inits = [graphs.const("b_in", rng.standard_normal(C)), graphs.const("b_out", rng.standard_normal(C)),
             graphs.const("lin", rng.standard_normal((C, C)) * 0.3),
             graphs.const("seq", np.asarray([N, H * W, C]), np.int64),
             graphs.const("img", np.asarray([N, H, W, C]), np.int64)]
    nodes = [_conv("x", "w_in", "h", "b_in"),
             helper.make_node("Transpose", ["h"], ["h_t"], perm=[0, 2, 3, 1]),
             helper.make_node("Reshape", ["h_t", "seq"], ["s"]),
             helper.make_node("MatMul", ["s", "lin"], ["s2"]),
             helper.make_node("Reshape", ["s2", "img"], ["i"]),
             helper.make_node("Transpose", ["i"], ["i_t"], perm=[0, 3, 1, 2]),
             _conv("i_t", "w_out", "p", "b_out"),
             helper.make_node("Add", ["p", "x"], ["y"])]
    return _model(nodes, {"w_in": [C, C, 1, 1], "w_out": [C, C, 1, 1]}, inits)


def test_a_transformer_blocks_proj_in_and_out_become_matmuls_with_no_transpose_added() -> None:
    before = _transformer_like()
    after, counts, bound = _check(before)
    ops = graphs.op_counts(after)
    assert counts["MatMul"] == 2 and counts["Transpose_added"] == 0 and counts["rejected"] == 0
    assert "Conv" not in ops and ops["Transpose"] == 2 and ops["MatMul"] == 3  # the Convs' 2 Transposes, moved
    assert ops["Reshape"] == 2 and not {"Shape", "Slice", "Concat"} & set(ops)  # static: nothing reads a shape
    assert {n: list(w.shape) for n, w in bound.items()} == {"w_in": [C, C], "w_out": [C, C]}
    matmuls = [n for n in after.graph.node if n.op_type == "MatMul" and n.input[1].startswith("w")]
    assert sorted(n.input[1] for n in matmuls) == ["w_in", "w_out"]  # the inputs themselves: no per-run transpose


@pytest.mark.parametrize("bias", [True, False])
def test_a_lone_1x1_conv_becomes_transpose_matmul_transpose(bias: bool) -> None:
    """A ResNet conv_shortcut (C -> O): nothing to cancel, so the two Transposes stay."""
    inits = [graphs.const("b", np.arange(O, dtype=np.float32))] if bias else []
    before = _model([_conv("x", "w", "y", "b" if bias else None)], {"w": [O, C, 1, 1]}, inits, ("y", [N, O, H, W]))
    after, counts, bound = _check(before)
    assert counts["MatMul"] == 1 and counts["Transpose_added"] == 2
    assert graphs.op_counts(after) == {"Transpose": 2, "MatMul": 1, **({"Add": 1} if bias else {})}
    assert bound["w"].shape == (C, O)
    assert [list(d.dim_value for d in i.type.tensor_type.shape.dim) for i in after.graph.input if i.name == "w"] \
        == [[C, O]]
    other = {"x": np.ones((N, C, H, W), np.float32), "w": bound["w"] * 2}  # a LoRA'd weight bound later counts
    assert not np.allclose(graphs.run(after, other)[0], graphs.run(after, {**other, "w": bound["w"]})[0])


def test_dynamic_shapes_add_no_shape_nodes() -> None:
    """The MatMul broadcasts over N, H, W: no Reshape, so a dynamic graph gets no Shape/Slice/Concat either."""
    inputs = [graphs.tensor_info("x", ["n", C, "h", "w"]), graphs.tensor_info("w", [O, C, 1, 1])]
    model = graphs.make_model([_conv("x", "w", "y")], inputs, [graphs.tensor_info("y", ["n", O, "h", "w"])])
    after, counts = fuse(onnx.shape_inference.infer_shapes(model), pointwise_convs_as_matmul)
    assert graphs.op_counts(after) == {"Transpose": 2, "MatMul": 1} and counts["MatMul"] == 1
    w = np.random.default_rng(1).standard_normal((O, C, 1, 1)).astype(np.float32)
    x = np.random.default_rng(2).standard_normal((3, C, 4, 2)).astype(np.float32)
    np.testing.assert_allclose(graphs.run(after, {"x": x, "w": np.ascontiguousarray(w[:, :, 0, 0].T)})[0],
                               graphs.run(model, {"x": x, "w": w})[0], rtol=RTOL, atol=ATOL)


def test_must_not_fire_on_constant_spatial_or_strided_weights_nor_one_read_otherwise() -> None:
    """A constant 1x1 weight (ORT's own Conv takes it), a 3x3 and a strided 1x1 over weight inputs (spatial Convs,
    --refit-convs), and a 1x1 weight input that something else reads too (its layout cannot change) stay Convs; a
    weight input two 1x1 Convs read is relaid out once, both rewritten."""
    rng = np.random.default_rng(0)
    nodes = [_conv("x", "k", "a"),
             helper.make_node("Conv", ["a", "w3"], ["b"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             _conv("b", "ws", "c", strides=[2, 2]),
             _conv("c", "we", "d"), helper.make_node("Identity", ["we"], ["z"]),
             _conv("d", "wd", "e"), _conv("e", "wd", "y")]
    inputs = [graphs.tensor_info("x", [N, C, H, W])] + [
        graphs.tensor_info(n, s) for n, s in (("w3", [C, C, 3, 3]), ("ws", [C, C, 1, 1]), ("we", [C, C, 1, 1]),
                                              ("wd", [C, C, 1, 1]))]
    before = onnx.shape_inference.infer_shapes(graphs.make_model(
        nodes, inputs, [graphs.tensor_info("y", [N, C, 2, 3]), graphs.tensor_info("z", [C, C, 1, 1])],
        [graphs.const("k", rng.standard_normal((C, C, 1, 1)))]))
    after, counts, bound = _check(before)
    assert counts == {"MatMul": 2, "Transpose_added": 2, "rejected": 1}  # wd's two readers; we's Conv
    # wd's two MatMuls: Transpose -> MatMul -> MatMul -> Transpose (the pair between them cancelled)
    assert graphs.op_counts(after) == {"Conv": 4, "Identity": 1, "Transpose": 2, "MatMul": 2}
    assert bound["wd"].shape == (C, C) and bound["we"].shape == (C, C, 1, 1)


def test_is_pointwise() -> None:
    assert is_pointwise({}, [O, C, 1, 1]) and is_pointwise({"auto_pad": b"VALID", "group": 1}, [O, C, 1, 1])
    assert not is_pointwise({}, [O, C, 3, 3]) and not is_pointwise({"strides": [2, 2]}, [O, C, 1, 1])
    assert not is_pointwise({"group": 2}, [O, C, 1, 1]) and not is_pointwise({"pads": [1, 1, 1, 1]}, [O, C, 1, 1])
    assert not is_pointwise({"dilations": (2, 2)}, [O, C, 1, 1]) and not is_pointwise({}, None)


# -- the tiny UNet, compiled static (64x64, batch 1) for ORT CPU: refittable against baked -------------------------

STATIC = {f"{k}{d}": 64 for k in ("", "min_", "max_") for d in ("height", "width")}


@pytest.fixture(scope="module")
def tiny_unets(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny UNet's graph compiled ``--refittable`` and baked (no LoRA slots), static profile."""
    from diffusion_trt.compiler.pipeline import compile_pipeline
    from diffusion_trt.config import CompileConfig

    out = {}
    for kind, refittable in (("refittable", True), ("baked", False)):
        config = CompileConfig(refittable=refittable, batch_size=1, min_batch_size=1, max_batch_size=1,
                               components=("unet",), **STATIC)
        art = compile_pipeline(tiny_pipeline_dir, tmp_path_factory.mktemp(kind) / "art", config)
        out[kind] = onnx.load(str(art / "unet" / "model.onnx")).graph
        out[f"{kind}-manifest"] = json.loads((art / "manifest.json").read_text())
    return out


def test_the_rewrite_is_recorded_in_the_manifests_passes(tiny_unets: dict[str, Any]) -> None:
    """``inspect`` reads the component's ``passes``: the rewrite's record comes last there, with a count per 1x1 Conv
    rewritten; a baked compile has none."""
    def records(kind: str) -> list[dict[str, Any]]:
        unet = tiny_unets[f"{kind}-manifest"]["components"]["unet"]
        return [r for r in unet["passes"] if r["name"] == "pointwise_convs_as_matmul"]

    (record,) = records("refittable")
    assert tiny_unets["refittable-manifest"]["components"]["unet"]["passes"][-1] is record
    assert record["modified"] and sum(record["counts"].values()) > 0, record
    assert records("baked") == []


def test_the_tiny_static_refittable_unet_has_the_baked_graph_plus_bias_adds_and_lone_transposes(
    tiny_pipeline_dir: Path, tiny_unets: dict[str, Any]
) -> None:
    """Machine-independent facts of the rewrite on the whole tiny UNet (1233 nodes against the baked 1162; the
    Reshape-MatMul form before it: 1522): no Conv reads a weight input; no Shape/Slice/Concat/Reshape beyond the
    baked graph's; one MatMul (+ one bias Add) per 1x1 Conv; Transposes beyond the baked graph's only at the 1x1
    Convs with no permute beside them (``conv_shortcut``: one pair each; proj_in/proj_out: none)."""
    import torch
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline_dir, subfolder="unet", local_files_only=True)
    pointwise = [n for n, m in unet.named_modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1)]
    lone = [n for n in pointwise if not n.endswith(("proj_in", "proj_out"))]
    assert lone and len(pointwise) > len(lone) and all(n.endswith("conv_shortcut") for n in lone)
    refit, baked = (graphs.op_counts(onnx.ModelProto(graph=tiny_unets[k])) for k in ("refittable", "baked"))
    graph = tiny_unets["refittable"]
    inputs = {i.name for i in graph.input}
    assert not [n.name for n in graph.node if n.op_type == "Conv" and n.input[1] in inputs]
    for op in ("Shape", "Slice", "Concat", "Reshape", "Gather"):
        assert refit.get(op, 0) <= baked.get(op, 0), op
    assert refit["Conv"] == baked["Conv"] - len(pointwise) and refit["MatMul"] == baked["MatMul"] + len(pointwise)
    assert refit["Add"] == baked["Add"] + len(pointwise)  # the Conv's bias, now an Add over the channels
    assert refit["Transpose"] == baked["Transpose"] + 2 * len(lone)
    assert sum(refit.values()) == sum(baked.values()) + len(pointwise) + 2 * len(lone)
    weights = {n.input[1] for n in graph.node if n.op_type == "MatMul"} & inputs
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert sum(len(dims[w]) == 2 for w in weights) >= len(pointwise)  # [C, O] inputs (the Linears' are 2-D too)

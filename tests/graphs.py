"""Tiny ONNX graphs for tests, and ONNX Runtime helpers to compare a model before and after a rewrite.

Every builder returns a checked ``onnx.ModelProto`` (opset 17, IR 9 unless told) small enough to build and
run in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 9

#: Tolerances for before/after comparisons, one row per dtype: (rtol, atol).
TOLERANCE: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float16": (1e-3, 1e-3),
}


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    *,
    opset: int = OPSET,
    ir_version: int = IR_VERSION,
    value_info: Sequence[onnx.ValueInfoProto] = (),
    extra_opsets: Sequence[tuple[str, int]] = (),
    check: bool = True,
) -> onnx.ModelProto:
    """A model from its parts; ``extra_opsets`` adds (domain, version) imports for custom-domain nodes."""
    graph = helper.make_graph(list(nodes), "test", list(inputs), list(outputs), list(initializers),
                              value_info=list(value_info))
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v) for d, v in extra_opsets)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=ir_version, producer_name="tests")
    if check:
        onnx.checker.check_model(model)
    return model


def tensor_info(
    name: str, shape: Sequence[int | str | None] | None, dtype: int = TensorProto.FLOAT
) -> onnx.ValueInfoProto:
    """A graph input/output description; ``shape=None`` means unknown rank (the checker refuses that on graph
    inputs and outputs: build with ``check=False``)."""
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name: str, values: np.ndarray | Sequence[float] | float, dtype: type = np.float32) -> onnx.TensorProto:
    """An initializer."""
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def random_feeds(model: onnx.ModelProto, seed: int = 0, dims: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Random float32 inputs for ``model``; symbolic dims are taken from ``dims`` (default 2)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value if d.HasField("dim_value") else (dims or {}).get(d.dim_param, 2)
                 for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``model`` (a ModelProto or a path) with ONNX Runtime CPU, all graph optimizations off."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto | str,
                        feeds: dict[str, np.ndarray] | None = None) -> None:
    """Both models give the same outputs on the same inputs, within :data:`TOLERANCE` for their dtype."""
    feeds = feeds if feeds is not None else random_feeds(before)
    expected, actual = run(before, feeds), run(after, feeds)
    assert len(expected) == len(actual)
    for want, got in zip(expected, actual, strict=True):
        assert want.dtype == got.dtype and want.shape == got.shape
        rtol, atol = TOLERANCE.get(want.dtype.name, (0.0, 0.0))
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """How many nodes of each op type the main graph has."""
    counts: dict[str, int] = {}
    for node in model.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


# --- builders ---------------------------------------------------------------------------------------------


def dead_branch_model() -> onnx.ModelProto:
    """y = Relu(x) + 1; a dead branch Sigmoid(x) -> Neg that reaches no output."""
    return make_model(
        [
            helper.make_node("Relu", ["x"], ["r"]),
            helper.make_node("Add", ["r", "one"], ["y"]),
            helper.make_node("Sigmoid", ["x"], ["dead1"]),
            helper.make_node("Neg", ["dead1"], ["dead2"]),
        ],
        [tensor_info("x", [2, 3])],
        [tensor_info("y", [2, 3])],
        [const("one", 1.0)],
    )


def duplicate_constants_model() -> onnx.ModelProto:
    """y = ((x * s1) * s2) + b; s1 and s2 are equal 8-element initializers; b has the same bytes as neither."""
    scale = np.linspace(0.5, 2.0, 8)
    return make_model(
        [
            helper.make_node("Mul", ["x", "s1"], ["a"]),
            helper.make_node("Mul", ["a", "s2"], ["c"]),
            helper.make_node("Add", ["c", "b"], ["y"]),
        ],
        [tensor_info("x", [2, 8])],
        [tensor_info("y", [2, 8])],
        [const("s1", scale), const("s2", scale), const("b", scale[::-1])],
    )


def constant_subgraph_model() -> onnx.ModelProto:
    """y = x @ (W * 2 + b): the weight expression is foldable; a Constant node feeds it."""
    rng = np.random.default_rng(1)
    return make_model(
        [
            helper.make_node("Constant", [], ["two"], value_float=2.0),
            helper.make_node("Mul", ["W", "two"], ["W2"]),
            helper.make_node("Add", ["W2", "b"], ["Wb"]),
            helper.make_node("MatMul", ["x", "Wb"], ["y"]),
        ],
        [tensor_info("x", [3, 4])],
        [tensor_info("y", [3, 5])],
        [const("W", rng.standard_normal((4, 5))), const("b", rng.standard_normal(5))],
    )


def shape_chain_model(batch: int | str = 2) -> onnx.ModelProto:
    """y = Reshape(x, concat(shape(x)[0], [12])): flattens x:[batch, 3, 4] to [batch, 12].

    With a static batch the Shape -> Gather -> Concat chain folds to a constant; with a symbolic one it cannot.
    """
    return make_model(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
            helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
            helper.make_node("Concat", ["n1", "twelve"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ],
        [tensor_info("x", [batch, 3, 4])],
        [tensor_info("y", [batch, 12])],
        [const("zero", 0, np.int64), const("axes0", [0], np.int64), const("twelve", [12], np.int64)],
    )


def mlp_model(hidden: int = 16) -> onnx.ModelProto:
    """y = Relu(x @ W1 + b1) @ W2, x:[N, 8] (N symbolic); intermediate tensors carry no shapes."""
    rng = np.random.default_rng(2)
    return make_model(
        [
            helper.make_node("MatMul", ["x", "W1"], ["h"]),
            helper.make_node("Add", ["h", "b1"], ["hb"]),
            helper.make_node("Relu", ["hb"], ["hr"]),
            helper.make_node("MatMul", ["hr", "W2"], ["y"]),
        ],
        [tensor_info("x", ["N", 8])],
        [tensor_info("y", ["N", 4])],
        [const("W1", rng.standard_normal((8, hidden))), const("b1", rng.standard_normal(hidden)),
         const("W2", rng.standard_normal((hidden, 4)))],
    )


def diamond_model() -> onnx.ModelProto:
    """h = x * s is read by two nodes (Relu and Sigmoid) and is also y2: a fusion must not swallow it.

    y1 = Relu(h) + Sigmoid(h),  y2 = h.
    """
    return make_model(
        [
            helper.make_node("Mul", ["x", "s"], ["h"]),
            helper.make_node("Relu", ["h"], ["r"]),
            helper.make_node("Sigmoid", ["h"], ["g"]),
            helper.make_node("Add", ["r", "g"], ["y1"]),
            helper.make_node("Identity", ["h"], ["y2"]),
        ],
        [tensor_info("x", [2, 3])],
        [tensor_info("y1", [2, 3]), tensor_info("y2", [2, 3])],
        [const("s", 3.0)],
    )


#: Whole-model fp16-vs-fp32 comparisons (an fp16 graph against its fp32 source, outputs of magnitude ~1):
#: (rtol, atol). Measured on the tiny UNet / VAE: max abs diff 1e-3 / 5e-3.
FP16_VS_FP32_TOLERANCE: tuple[float, float] = (2e-2, 2e-2)


def attention_model(*, static: bool = True, cross: bool = False, mask: bool = False, post_scale: bool = False,
                    heads: int = 2, head_dim: int = 4, seq: int = 6, kv_seq: int = 5,
                    batch: int | str = 2) -> onnx.ModelProto:
    """One multi-head attention as torch exports it: y[B,S,C] = out_proj(attention(x @ Wq, ctx @ Wk, ctx @ Wv)).

    ``static``: Reshape targets and the SDPA scale are constants; otherwise they are computed from Shape as the
    TorchScript exporter does for dynamic axes (scale = sqrt(1/sqrt(d)) applied to Q and to K^T).
    ``post_scale``: CLIP eager form, one constant Mul after Q K^T. ``mask``: an additive [1,1,S,L] bias before
    the Softmax. ``cross``: K and V read a second input ``ctx[B,L,C]`` instead of ``x``.
    """
    rng = np.random.default_rng(3)
    c = heads * head_dim
    kv = "ctx" if cross else "x"
    nodes: list[onnx.NodeProto] = []
    inits = [const(f"W{n}", rng.standard_normal((c, c)) * 0.5) for n in "qkvo"]
    length = kv_seq if cross else seq
    if not static:
        inits += [const("i0", 0, np.int64), const("c0", [0], np.int64), const("m1", [-1], np.int64),
                  const("cN", [heads], np.int64), const("cd", [head_dim], np.int64)]
    if static:
        inits.append(const("split", [0, -1, heads, head_dim], np.int64))
    else:
        nodes += [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Gather", ["xs", "i0"], ["b"], axis=0),
                  helper.make_node("Unsqueeze", ["b", "c0"], ["b1"]),
                  helper.make_node("Concat", ["b1", "m1", "cN", "cd"], ["split"], axis=0)]
    for name, src in (("q", "x"), ("k", kv), ("v", kv)):
        nodes += [helper.make_node("MatMul", [src, f"W{name}"], [f"{name}3"]),
                  helper.make_node("Reshape", [f"{name}3", "split"], [f"{name}4"])]
    nodes += [helper.make_node("Transpose", ["q4"], ["qt"], perm=[0, 2, 1, 3]),
              helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
              helper.make_node("Transpose", ["v4"], ["vt"], perm=[0, 2, 1, 3])]
    if post_scale:
        inits.append(const("s", 1 / np.sqrt(head_dim)))
        nodes += [helper.make_node("MatMul", ["qt", "kt"], ["qk0"]), helper.make_node("Mul", ["qk0", "s"], ["qk"])]
    else:
        if static:
            inits.append(const("sq", [head_dim ** -0.25]))
        else:
            inits += [const("one", [1.0]), const("big", [2**62], np.int64)]
            nodes += [helper.make_node("Shape", ["qt"], ["qts"]),
                      helper.make_node("Slice", ["qts", "m1", "big"], ["dd"]),
                      helper.make_node("Cast", ["dd"], ["ddf"], to=TensorProto.FLOAT),
                      helper.make_node("Sqrt", ["ddf"], ["sd"]), helper.make_node("Div", ["one", "sd"], ["s"]),
                      helper.make_node("Sqrt", ["s"], ["sq"])]
        nodes += [helper.make_node("Mul", ["qt", "sq"], ["qs"]), helper.make_node("Mul", ["kt", "sq"], ["ks"]),
                  helper.make_node("MatMul", ["qs", "ks"], ["qk"])]
    scores = "qk"
    if mask:
        causal = np.triu(np.full((seq, length), -1e9, dtype=np.float32), 1)[None, None]
        inits.append(const("bias", causal))
        nodes.append(helper.make_node("Add", ["qk", "bias"], ["qkb"]))
        scores = "qkb"
    nodes += [helper.make_node("Softmax", [scores], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "vt"], ["a"]),
              helper.make_node("Transpose", ["a"], ["at"], perm=[0, 2, 1, 3])]
    inits.append(const("merge", [0, -1, c], np.int64))
    nodes += [helper.make_node("Reshape", ["at", "merge"], ["a3"]), helper.make_node("MatMul", ["a3", "Wo"], ["y"])]
    inputs = [tensor_info("x", [batch, seq, c])] + ([tensor_info("ctx", [batch, kv_seq, c])] if cross else [])
    model = make_model(nodes, inputs, [tensor_info("y", [batch, seq, c])], inits)
    return onnx.shape_inference.infer_shapes(model)


def einsum_attention_model(heads_batch: int = 4, channels: int = 8, tokens: int = 6) -> onnx.ModelProto:
    """guided-diffusion's QKVAttentionLegacy as its exporters write it (the foreign terrain UNet's form):

        qkv[BH, 3C, T] -> Split -> q*s, k*s -> Einsum("bct,bcs->bts") -> Softmax(-1) -> Einsum("bts,bcs->bct", w, v)
    """
    scale = 1.0 / math.sqrt(math.sqrt(channels))
    nodes = [
        helper.make_node("Split", ["qkv", "split"], ["q0", "k0", "v"], axis=1),
        helper.make_node("Mul", ["q0", "s"], ["q"]),
        helper.make_node("Mul", ["k0", "s"], ["k"]),
        helper.make_node("Einsum", ["q", "k"], ["w"], equation="bct,bcs->bts"),
        helper.make_node("Softmax", ["w"], ["p"], axis=-1),
        helper.make_node("Einsum", ["p", "v"], ["out"], equation="bts,bcs->bct"),
    ]
    inits = [const("split", [channels] * 3, np.int64), const("s", scale)]
    return make_model(nodes, [tensor_info("qkv", [heads_batch, 3 * channels, tokens])],
                      [tensor_info("out", [heads_batch, channels, tokens])], inits)


def einsum_model(equation: str, shapes: Sequence[Sequence[int]], out_shape: Sequence[int]) -> onnx.ModelProto:
    """One Einsum over inputs a, b, ... of the given shapes."""
    names = [chr(ord("a") + i) for i in range(len(shapes))]
    nodes = [helper.make_node("Einsum", names, ["y"], equation=equation)]
    return make_model(nodes, [tensor_info(n, list(s)) for n, s in zip(names, shapes, strict=True)],
                      [tensor_info("y", list(out_shape))])


def overflow_model(gain: float = 5e4, width: int = 16) -> onnx.ModelProto:
    """A block whose fp32 activations pass fp16's range and are normalized away (the SDXL VAE mechanism):

        x[2, D] -> MatMul(W * gain) -> h (|h| ~ gain) -> LayerNormalization -> y (|y| ~ 1)

    In fp16 without islands h is inf and y NaN; with MatMul and LayerNormalization fp32 it is finite. At gain 5e4
    the weights stay inside fp16's range (|W| < 40,000): the overflow is the activation's alone (a weight beyond
    +-65504 would keep MatMul fp32 by itself, convert_fp16's ``fp32_wide_constants``).
    """
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((width, width)) * gain / math.sqrt(width)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["n"], axis=-1, name="norm"),
             helper.make_node("Relu", ["n"], ["y"], name="act")]
    inits = [const("w", weight), const("gamma", np.ones(width)), const("beta", np.zeros(width))]
    return make_model(nodes, [tensor_info("x", [2, width])], [tensor_info("y", [2, width])], inits)


def huge_output_model(gain: float = 1e5) -> onnx.ModelProto:
    """y = x * gain: an fp32 output fp16 cannot hold whatever stays fp32 inside (the check must refuse)."""
    nodes = [helper.make_node("Mul", ["x", "g"], ["y"], name="amplify")]
    return make_model(nodes, [tensor_info("x", [2, 4])], [tensor_info("y", [2, 4])], [const("g", gain)])

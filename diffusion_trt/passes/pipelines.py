"""The ordered pass lists, one per (backend, device, precision): explicit tuples, nothing registers itself.

No pass runs another pass: two run a step of one inside themselves, as a library call, because their own logic
needs it there: specialize_shapes repeats shape inference and folding until the Shape nodes stop falling (a
fixpoint, not a fixed list), and convert_fp16 infers the dtypes its classification reads (after the fusions,
whose new tensors may lack them).

Ordering rules (keep them next to the tuples they constrain):
  * eliminate_dead_nodes first: every later pass, folding included, then works on the live graph only, and
    merged duplicate constants are read once.
  * specialize_shapes (static profiles only) before fold_constants: once every input dim is concrete, all
    shape arithmetic folds away and no Shape node is left to run on the host.
  * infer_symbolic_shapes (dynamic profiles on ort-cuda only) right after infer_shapes: ONNX inference gives a
    dynamic graph a fresh ``unk__N`` name per Conv output and per broadcast, so every residual Add looked as if
    it might broadcast and fuse_skip_layer_norm / fuse_bias / fuse_skip_group_norm / merge_conv_biases /
    cancel_transposes turned their sites down (SD-1.5 UNet: 0 of the static profile's 150); the symbolic
    expressions (``h``, ``h*w``) make equal dims equal by name. Static graphs have no symbols to name, and the
    other targets run none of those fusions, so their graphs stay as they were.
  * fold_constants before infer_shapes: folding turns shape computations into constants, which lets
    inference resolve more shapes (Reshape / Expand targets).
  * infer_shapes before eliminate_noops: whether ``x / 1`` can go depends on x's rank (no broadcasting).
  * eliminate_noops last in BASE: the ``Div(x, 1)`` diffusers writes after each attention's output projection
    and each ResNet's residual sum sit inside the patterns fuse_skip_layer_norm / fuse_bias match; the fusions
    match on shapes and ranks (head size, channel counts), which the noop removal leaves as they were.
  * lower_einsum first of the fusions: the attention it lowers to MatMul-Softmax-MatMul is what fuse_attention
    (and TensorRT's own attention fusion) look for.
  * fuse_geglu before fuse_gelu: BiasSplitGelu takes the gate's GELU with it; fuse_gelu then fuses the rest.
  * fuse_attention after fuse_layer_norm: the norms in front of each attention are then one node, which
    makes the self/cross classification structural.
  * fuse_batched_attention after lower_einsum (it matches the MatMul form) and fuse_attention (which takes the
    rank-4 sites; this pass only looks at rank-3 Softmax nodes).
  * fuse_skip_layer_norm after fuse_attention: the attention fusion finds its LayerNorm in front of the Q/K/V
    projections; once that LayerNorm is a SkipLayerNormalization it would not.
  * fuse_bias after fuse_skip_layer_norm: a residual sum that feeds a LayerNorm is better fused into it (one
    kernel for bias + residual + norm); fuse_bias takes the residual sums that feed anything else.
  * fuse_skip_group_norm after fuse_group_norm (it rewrites the ort-cuda GroupNorm that pass emits) and before
    align_shapes / cancel_transposes: it moves Conv biases into the norm and adds Transposes that pair with
    the ones fuse_group_norm inserted.
  * merge_conv_biases after fuse_skip_group_norm: a ResNet sum that feeds a GroupNorm is better taken whole into
    SkipGroupNorm (both Conv biases and the Add in the norm kernel); merge_conv_biases takes the other sums.
  * pack_qkv after fuse_attention (it rewrites the MultiHeadAttention nodes that pass emits), last of the
    fusions: the projections it merges are read by nothing else, so no later fusion looks at them.
  * every fusion before convert_fp16: the Casts it inserts at fp32 islands break the patterns.
  * align_shapes after the fusions, before convert_fp16: the padding changes channel counts the fusions check
    (and it touches only Convs with channel counts that are not multiples of 8: conv_in / conv_out and the VAE's
    latent convs, which no fusion reads); the weights are padded in fp32 and then converted with the rest.
  * cancel_transposes after the fusions (ort-cuda only): the Transposes it removes are those fuse_group_norm
    puts around each NHWC GroupNorm; before convert_fp16: a Cast at an fp32 island between two Transposes
    would stop them meeting. Not for TensorRT / ORT CPU: their fusions insert no Transposes (and TensorRT
    removes redundant ones itself).
  * TensorRT fp16 gets convert_fp16 too and is built strongly typed: the graph's types (with its fp32
    islands) are what runs, on TensorRT 10 and on 11, whose builder no longer takes precision flags.
  * tensorrt-rtx (TensorRT for RTX: always strongly typed, same ONNX parser) shares the tensorrt tuples.
  * check_onnx_domain last in the TensorRT pipelines, after convert_fp16: it rewrites nothing and proves the
    final graph holds ai.onnx ops only, the parser's whole vocabulary (it refuses contrib ops, and TensorRT-RTX
    1.7.1's crashes on com.microsoft.MultiHeadAttention). The TensorRT emitters, measured with that parser and
    builder (tests/compiler/test_rtx_parse.py): LayerNormalization (opset 17), GroupNormalization with
    per-channel scale (opset 21: at 18..20 the builder wants scale [G]), Gelu (opset 20), and attention as
    MatMul-Softmax-MatMul, which the builder finds as a self-attention pattern at fp16 and fp32 (the ONNX
    Attention op of opset 23 builds only at fp16 without a GPU: no fp32 kernel).
"""

from __future__ import annotations

from ..artifact.manifest import Backend
from .align_shapes import align_shapes
from .base import Pass
from .cancel_transposes import cancel_transposes
from .check_onnx_domain import check_onnx_domain
from .convert_fp16 import convert_fp16
from .eliminate_dead_nodes import eliminate_dead_nodes
from .eliminate_noops import eliminate_noops
from .fold_constants import fold_constants
from .fuse_attention import fuse_attention
from .fuse_batched_attention import fuse_batched_attention
from .fuse_bias import fuse_bias
from .fuse_geglu import fuse_geglu
from .fuse_gelu import fuse_gelu
from .fuse_group_norm import fuse_group_norm
from .fuse_layer_norm import fuse_layer_norm
from .fuse_skip_group_norm import fuse_skip_group_norm
from .fuse_skip_layer_norm import fuse_skip_layer_norm
from .infer_shapes import infer_shapes
from .infer_symbolic_shapes import infer_symbolic_shapes
from .lower_einsum import lower_einsum
from .merge_conv_biases import merge_conv_biases
from .pack_qkv import pack_qkv
from .specialize_shapes import specialize_shapes

#: The backends a pipeline exists for: every :class:`~diffusion_trt.artifact.manifest.Backend`'s value (the passes
#: take the plain strings, as ``optimize`` and the compiler's ``ComponentPlan.pass_backend`` give them).
BACKENDS: tuple[str, ...] = tuple(b.value for b in Backend)

#: Clean-up every pipeline starts with.
BASE: tuple[Pass, ...] = (
    eliminate_dead_nodes,  # first: later passes see only live nodes, duplicate constants merged
    fold_constants,  # before infer_shapes: folded shape subgraphs let inference resolve more shapes
    infer_shapes,  # the fusions added after BASE match on shapes
    eliminate_noops,  # after infer_shapes (needs ranks); clears Div-by-1 out of the fusion patterns
)

#: The fusions, in order. Each emits the form of the target in ctx (ORT CUDA contrib ops, ORT CPU ops,
#: TensorRT-parsable standard ops) or counts `skipped_for_target` where the target has nothing better.
FUSIONS: tuple[Pass, ...] = (
    lower_einsum,  # first: Einsum attention becomes MatMul-Softmax-MatMul
    fuse_layer_norm,
    fuse_group_norm,
    fuse_geglu,  # before fuse_gelu
    fuse_gelu,
    fuse_attention,  # after fuse_layer_norm
    fuse_batched_attention,  # after lower_einsum; the rank-3 (heads-in-batch) sites fuse_attention leaves
    fuse_skip_layer_norm,  # after fuse_attention
    fuse_bias,  # after fuse_skip_layer_norm
    fuse_skip_group_norm,  # after fuse_group_norm; before align_shapes (it moves Conv biases)
    merge_conv_biases,  # after fuse_skip_group_norm (which takes the ResNet sums feeding a GroupNorm whole)
    pack_qkv,  # after fuse_attention; ort-cuda only, off unless ctx.options["pack_qkv"] (measured neutral)
)

#: After the fusions on CUDA targets: channel padding, then (ORT CUDA) the NHWC Transposes that cancel.
ORT_CUDA_LAYOUT: tuple[Pass, ...] = (align_shapes, cancel_transposes)
TENSORRT_LAYOUT: tuple[Pass, ...] = (align_shapes,)

#: The TensorRT pipelines (full TensorRT and TensorRT-RTX alike; fp16 built strongly typed): the final graph holds
#: ai.onnx ops only.
TENSORRT_FP32: tuple[Pass, ...] = (*BASE, *FUSIONS, *TENSORRT_LAYOUT, check_onnx_domain)
TENSORRT_FP16: tuple[Pass, ...] = (*BASE, *FUSIONS, *TENSORRT_LAYOUT, convert_fp16, check_onnx_domain)

PIPELINES: dict[tuple[str, str, str], tuple[Pass, ...]] = {
    (Backend.ORT, "cpu", "fp32"): (*BASE, *FUSIONS),
    (Backend.ORT, "cuda", "fp32"): (*BASE, *FUSIONS, *ORT_CUDA_LAYOUT),
    (Backend.ORT, "cuda", "fp16"): (*BASE, *FUSIONS, *ORT_CUDA_LAYOUT, convert_fp16),  # convert_fp16 last
    (Backend.TENSORRT, "cuda", "fp32"): TENSORRT_FP32,
    (Backend.TENSORRT, "cuda", "fp16"): TENSORRT_FP16,
    (Backend.TENSORRT_RTX, "cuda", "fp32"): TENSORRT_FP32,
    (Backend.TENSORRT_RTX, "cuda", "fp16"): TENSORRT_FP16,
}


def pipeline_for(backend: str, device: str, precision: str, component: str, static: bool = False) -> tuple[Pass, ...]:
    """The passes to run, in order, for one component built for ``backend`` on ``device`` at ``precision``.

    Args:
        static: the profile is one shape (min == max); prepends ``specialize_shapes``, which reads the shapes
            from ``ctx.options["static_shapes"]``. A dynamic one on ort-cuda gets ``infer_symbolic_shapes``
            after ``infer_shapes``.

    Raises:
        ValueError: no pipeline for that combination; the message lists the ones that exist.
    """
    del component  # every component takes the same passes; per-component islands are ctx.options
    key = (backend, device, precision)
    if key not in PIPELINES:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} has no pass pipeline; use one of {', '.join(BACKENDS)}")
        known = ", ".join("/".join(k) for k in PIPELINES)
        raise ValueError(f"no pass pipeline for {'/'.join(key)}; available: {known}")
    passes = PIPELINES[key]
    if static:
        passes = (passes[0], specialize_shapes, *passes[1:])
    elif (backend, device) == (Backend.ORT, "cuda"):
        at = passes.index(infer_shapes) + 1
        passes = (*passes[:at], infer_symbolic_shapes, *passes[at:])
    return passes

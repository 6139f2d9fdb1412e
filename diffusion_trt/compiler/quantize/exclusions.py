"""The nodes quantization leaves float: :data:`DEFAULT_EXCLUDE`, each category found from the graph's structure.

Quantized op types: :data:`QUANTIZED_OP_TYPES` (Conv, MatMul, Gemm); everything else stays in the float precision
of the graph. The categories (never matched on exporter-made node names):

* ``first_conv``      Conv with no Conv upstream: ``conv_in`` reads the raw latents / image.
* ``last_conv``       Conv with no Conv downstream: ``conv_out`` writes the noise prediction / pixels.
* ``time_embedding``  Conv/MatMul/Gemm whose inputs depend on the ``timestep`` input only: the sinusoidal
                      embedding's MLP and every ResNet's ``time_emb_proj`` (NVIDIA ModelOpt's diffusers recipe
                      leaves the same layers unquantized).
* ``attention_scores`` MatMuls that feed a Softmax or read one (Q·Kᵀ and P·V, present where attention is not fused).
* ``softmax``, ``normalization``  Softmax and the normalization ops; not of a quantized type, listed so that they stay
                      excluded when ``op_types`` is widened.

Override with ``QuantizeConfig.exclude``: any of these category names and/or node names; ``()`` excludes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from ...errors import RuntimeInputError

QUANTIZED_OP_TYPES: tuple[str, ...] = ("Conv", "MatMul", "Gemm")
EXCLUDE_CATEGORIES: tuple[str, ...] = (
    "first_conv", "last_conv", "time_embedding", "attention_scores", "softmax", "normalization",
)
DEFAULT_EXCLUDE: tuple[str, ...] = EXCLUDE_CATEGORIES
_NORM_OPS = frozenset({"LayerNormalization", "GroupNormalization", "InstanceNormalization", "BatchNormalization",
                       "GroupNorm", "SkipGroupNorm", "SkipLayerNormalization", "SimplifiedLayerNormalization"})


def name_nodes(model: onnx.ModelProto) -> int:
    """Give every unnamed (or duplicately named) node a unique name, ``<op_type>_q<index>``; return how many.

    ``quantize_static`` addresses nodes by name; names are only handles here, never matched on.
    """
    seen: set[str] = set()
    renamed = 0
    for i, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_q{i}"
            renamed += 1
        seen.add(node.name)
    return renamed


def sensitive_nodes(model: onnx.ModelProto, categories: Sequence[str]) -> dict[str, list[str]]:
    """Node names per exclusion category (see the module docstring); unknown strings are taken as node names.

    Returns:
        ``{category: [node names]}``; explicit node names are grouped under ``"named"``.

    Raises:
        RuntimeInputError: a string is neither a category nor a node of the graph.
    """
    graph = model.graph
    nodes = list(graph.node)
    names = {n.name for n in nodes}
    consts = {t.name for t in graph.initializer}
    producer = {o: n for n in nodes for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    out: dict[str, list[str]] = {}
    wanted = list(dict.fromkeys(categories))
    for item in wanted:
        if item not in EXCLUDE_CATEGORIES and item not in names:
            raise RuntimeInputError(
                f"quantize exclusion {item!r} is neither a category ({', '.join(EXCLUDE_CATEGORIES)}) nor a node of "
                "the graph; fix --quantize-exclude"
            )
    quantizable = [n for n in nodes if n.op_type in QUANTIZED_OP_TYPES]

    # graph inputs each tensor depends on (constants depend on none); nodes are topologically sorted
    deps: dict[str, frozenset[str]] = {i.name: frozenset({i.name}) for i in graph.input if i.name not in consts}
    conv_above: dict[str, bool] = {}
    for n in nodes:
        # Shape/Size read a tensor's shape, not its values: `timestep.expand(sample.shape[0])` is timestep-only
        shape_only = n.op_type in ("Shape", "Size")
        d: frozenset[str] = frozenset() if shape_only else frozenset().union(
            *(deps.get(i, frozenset()) for i in n.input if i))
        above = any(conv_above.get(i, False) for i in n.input if i) or n.op_type == "Conv"
        for o in n.output:
            deps[o] = d
            conv_above[o] = above
    conv_below: dict[str, bool] = {}
    for n in reversed(nodes):
        below = any(conv_below.get(o, False) for o in n.output)
        for i in n.input:
            conv_below[i] = conv_below.get(i, False) or below or n.op_type == "Conv"

    def first(n: onnx.NodeProto) -> bool:
        return n.op_type == "Conv" and not conv_above.get(n.input[0], False)

    def last(n: onnx.NodeProto) -> bool:
        return n.op_type == "Conv" and not any(conv_below.get(o, False) for o in n.output)

    def time_only(n: onnx.NodeProto) -> bool:
        d = frozenset().union(*(deps.get(i, frozenset()) for i in n.input if i))
        return d == frozenset({"timestep"})

    def near_softmax(n: onnx.NodeProto) -> bool:
        if n.op_type != "MatMul":
            return False
        reads = any(producer.get(i) is not None and producer[i].op_type == "Softmax" for i in n.input)
        feeds = any(c.op_type == "Softmax" for o in n.output for c in consumers.get(o, []))
        return reads or feeds

    tests = {"first_conv": first, "last_conv": last, "time_embedding": time_only, "attention_scores": near_softmax}
    for item in wanted:
        if item in tests:
            out[item] = [n.name for n in quantizable if tests[item](n)]
        elif item == "softmax":
            out[item] = [n.name for n in nodes if n.op_type == "Softmax"]
        elif item == "normalization":
            out[item] = [n.name for n in nodes if n.op_type in _NORM_OPS]
        else:
            out.setdefault("named", []).append(item)
    return out

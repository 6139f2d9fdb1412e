"""The ``PassContext.options`` a user may set (``compile --pass-option KEY=VALUE``), with their types, checked once.

Each pass reads its own keys (its docstring says what they do); this table is what the command line and
``CompileConfig.pass_options`` accept. Keys that compile derives itself (``static_shapes``,
``convert_fp16_fp32_inputs``, ``convert_fp16_fp32_attention``) are not settable: compile computes them from the
model and the profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .fuse_attention import EMITS

#: key -> (what the value must be: ``bool``, ``int``, ``list`` (of strings) or a tuple of allowed strings; the pass).
USER_OPTIONS: dict[str, tuple[Any, str]] = {
    "align_shapes_channels": (int, "align_shapes"),
    "convert_fp16_fp32_nodes": (list, "convert_fp16"),
    "convert_fp16_fp32_ops": (list, "convert_fp16"),
    "convert_fp16_keep_io_types": (bool, "convert_fp16"),
    "convert_fp16_range_check": (bool, "convert_fp16"),  # read by fp16_check.py around the pass
    "convert_fp16_range_max": (int, "convert_fp16"),
    "convert_fp16_range_check_max_bytes": (int, "convert_fp16"),  # graphs with more weight bytes go unchecked
    "fold_constants_error_ok": (bool, "fold_constants"),
    "fold_constants_size_threshold_bytes": (int, "fold_constants"),
    "fuse_attention_emit": (EMITS, "fuse_attention"),
    "fuse_gelu_raise_opset": (bool, "fuse_gelu"),
    "fuse_group_norm_raise_opset": (bool, "fuse_group_norm"),
    "infer_shapes_path_threshold_bytes": (int, "infer_shapes"),
    "merge_conv_biases": (bool, "merge_conv_biases"),
    "pack_qkv": (bool, "pack_qkv"),
}


def check_pass_options(options: Mapping[str, Any]) -> None:
    """Check user-given pass options against :data:`USER_OPTIONS`.

    Raises:
        ValueError: an unknown key (the message lists the known ones) or a value of the wrong type (the message
            names the expected one, e.g. ``pack_qkv=yes: expects true or false``).
    """
    for key, value in options.items():
        if key not in USER_OPTIONS:
            known = ", ".join(sorted(USER_OPTIONS))
            raise ValueError(f"{key!r} is not a pass option one can set; known: {known}")
        kind, pass_name = USER_OPTIONS[key]
        if kind is bool:
            ok, want = isinstance(value, bool), "true or false"
        elif kind is int:
            ok, want = isinstance(value, int) and not isinstance(value, bool) and value > 0, "a positive integer"
        elif kind is list:
            ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
            want = 'a JSON list of names, e.g. ["Softmax"]'
        else:
            ok, want = value in kind, "one of " + ", ".join(kind)
        if not ok:
            raise ValueError(f"{key}={value!r} ({pass_name}): expects {want}")

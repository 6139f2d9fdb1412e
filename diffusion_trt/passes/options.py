"""The pass options one may set (``compile --pass-option KEY=VALUE``, ``CompileConfig.pass_options``), checked once.

Each pass declares its options as a frozen dataclass next to it (``FuseGeluOptions`` in fuse_gelu.py ...), one
:func:`.base.option` field per key, and reads them with ``ctx.options_for(FuseGeluOptions)``. The table here is
derived from those dataclasses: :data:`OPTIONS` lists them by pass, :data:`USER_OPTIONS` holds the keys a user may
set. Keys that compile derives itself (``static_shapes``, ``convert_fp16_fp32_inputs``,
``convert_fp16_fp32_attention``, ``infer_symbolic_shapes_dim_relations``) are not settable: compile computes them
from the model and the profile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .align_shapes import AlignShapesOptions
from .convert_fp16 import ConvertFp16Options
from .fold_constants import FoldConstantsOptions
from .fuse_attention import FuseAttentionOptions
from .fuse_gelu import FuseGeluOptions
from .fuse_group_norm import FuseGroupNormOptions
from .infer_shapes import InferShapesOptions
from .infer_symbolic_shapes import InferSymbolicShapesOptions
from .merge_conv_biases import MergeConvBiasesOptions
from .pack_qkv import PackQkvOptions
from .specialize_shapes import SpecializeShapesOptions

#: pass name -> its options dataclass (convert_fp16's also holds the range check's keys, read by fp16_check.py).
OPTIONS: dict[str, type] = {
    "align_shapes": AlignShapesOptions,
    "convert_fp16": ConvertFp16Options,
    "fold_constants": FoldConstantsOptions,
    "fuse_attention": FuseAttentionOptions,
    "fuse_gelu": FuseGeluOptions,
    "fuse_group_norm": FuseGroupNormOptions,
    "infer_shapes": InferShapesOptions,
    "infer_symbolic_shapes": InferSymbolicShapesOptions,
    "merge_conv_biases": MergeConvBiasesOptions,
    "pack_qkv": PackQkvOptions,
    "specialize_shapes": SpecializeShapesOptions,
}

#: key -> (what the value must be: ``bool``, ``int``, ``list`` (of strings) or a tuple of allowed strings; the pass).
USER_OPTIONS: dict[str, tuple[Any, str]] = {
    spec.metadata["key"]: (spec.metadata["kind"], pass_name)
    for pass_name, cls in OPTIONS.items()
    for spec in dataclasses.fields(cls)
    if spec.metadata["user"]
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
        ok, want = _accepts(kind, value)
        if not ok:
            raise ValueError(f"{key}={value!r} ({pass_name}): expects {want}")


def _accepts(kind: Any, value: Any) -> tuple[bool, str]:
    """Whether ``value`` is of ``kind``, and how the error message names the kind."""
    if kind is bool:
        return isinstance(value, bool), "true or false"
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0, "a positive integer"
    if kind is list:
        names = isinstance(value, list) and all(isinstance(v, str) for v in value)
        return names, 'a JSON list of names, e.g. ["Softmax"]'
    return value in kind, "one of " + ", ".join(kind)

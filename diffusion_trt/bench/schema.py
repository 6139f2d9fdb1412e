"""The bench result's JSON Schema (``diffusion_trt/data/bench_result.schema.json``), checked with jsonschema.

:func:`validate_result` reports the first violation, in the order the schema lists the properties, as one line
that names the key: ``env: missing key 'gpu'``, ``runs[0].e2e_spread_s = [1.0, 2.0]; expected [min, median, max]``.
"""

from __future__ import annotations

import ast
import functools
import importlib.resources
import json
import re
from collections.abc import Mapping
from typing import Any

from ..artifact.values import _validator_class, json_path

SCHEMA_RESOURCE = ("diffusion_trt.data", "bench_result.schema.json")


@functools.cache
def result_schema() -> dict[str, Any]:
    """The JSON Schema of a bench result, parsed once."""
    package, name = SCHEMA_RESOURCE
    return json.loads(importlib.resources.files(package).joinpath(name).read_text(encoding="utf-8"))


def validate_result(data: Mapping[str, Any]) -> None:
    """Check a bench result against :func:`result_schema` (integers must be JSON integers, not ``1.0`` or ``true``).

    Raises:
        ValueError: naming the first key whose presence, type or value is wrong (schema property order).
    """
    schema = result_schema()
    errors = [(_where(e), e) for e in _validator_class()(schema).iter_errors(data)]
    if errors:
        path, error = min(errors, key=lambda pe: _order(schema, pe[0]))
        raise ValueError(_message(schema, data, path, error))


def _where(error: Any) -> list[Any]:
    """The error's JSON path; for a missing key, the path of that key."""
    path = list(error.absolute_path)
    if error.validator == "required":
        path.append(_missing_key(error.message))
    return path


def _missing_key(message: str) -> str:
    match = re.match(r"(.*) is a required property$", message)
    return ast.literal_eval(match.group(1)) if match else message


def _resolve(schema: dict[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any]:
    ref = node.get("$ref")
    return _resolve(schema, schema["$defs"][ref.rsplit("/", 1)[1]]) if ref else node


def _nodes(schema: dict[str, Any], path: list[Any]) -> list[Mapping[str, Any]]:
    """The subschema at each prefix of ``path`` (``[root, at path[:1], ...]``); ``{}`` past the schema's reach."""
    node: Mapping[str, Any] = schema
    out = [node]
    for p in path:
        node = _resolve(schema, node.get("items", {}) if isinstance(p, int) else node.get("properties", {}).get(p, {}))
        out.append(node)
    return out


def _order(schema: dict[str, Any], path: list[Any]) -> list[int]:
    """Sort key of a violation: each path step's position in its parent's properties (array steps: the index)."""
    key = []
    for node, p in zip(_nodes(schema, path), path, strict=False):
        props = list(node.get("properties", {}))
        key.append(p if isinstance(p, int) else (props.index(p) if p in props else len(props)))
    return key


def _message(schema: dict[str, Any], data: Any, path: list[Any], error: Any) -> str:
    """One line naming the key, the value and what was expected."""
    where = _path_text(path)
    parent = json_path(path[:-1]) if len(path) > 1 else "result"  # "env: missing key 'gpu'", as before
    if error.validator == "required":
        return f"{parent}: missing key {path[-1]!r}"
    if "x-message" in error.schema:
        return f"{parent}: {error.schema['x-message']}"
    for depth in range(len(path), 0, -1):  # the innermost value that says what it expects as a whole
        expected = _nodes(schema, path)[depth].get("x-expected")
        if expected:
            return f"{_path_text(path[:depth])} = {_value(data, path[:depth])!r}; expected {expected}"
    value = error.instance
    if error.validator == "const":
        return f"{where} = {value!r}; expected {error.validator_value!r}"
    if error.validator == "enum":
        return f"{where} = {value!r}; expected one of {tuple(error.validator_value)}"
    if error.validator == "type":
        types = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
        return f"{where} = {value!r} has type {type(value).__name__}; expected {' or '.join(types)}"
    return f"{where}: {error.message}"


def _path_text(path: list[Any]) -> str:
    """``result`` for the top level, ``result.<key>`` for its keys, else the JSON path (``runs[0].stages_ms``)."""
    if not path:
        return "result"
    return f"result.{path[0]}" if len(path) == 1 else json_path(path)


def _value(data: Any, path: list[Any]) -> Any:
    for p in path:
        data = data[p]
    return data

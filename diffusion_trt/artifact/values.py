"""Untrusted JSON of an artifact: parsing ``manifest.json`` / ``scheduler_config.json`` bytes, and checking values.

An artifact may come from another host, and its seal is an unkeyed sha256 (it catches accidents, not intent: anyone
can edit a manifest and reseal it). So whatever the manifest and the shipped configs say is checked before the
runtime uses it, the same way in ``verify`` and in the loader:

* :func:`parse_json`: UTF-8, JSON, no ``NaN``/``Infinity``, nesting at most :data:`MAX_JSON_DEPTH`, integers of at
  most :data:`MAX_INT_DIGITS` digits, no lone surrogate escape; every failure is one
  :class:`~diffusion_trt.errors.ArtifactError` line (never ``UnicodeDecodeError``, ``RecursionError``, the
  interpreter's int-parsing ``ValueError`` or, later, a ``UnicodeEncodeError``).
* :func:`schema_problems`: JSON Schema validation where integers are JSON integers (``1000``, not ``1000.0`` or
  ``true``), one line per violation with its JSON path.
* :func:`scheduler_config_problems`: ``scheduler_config.json`` against ``data/scheduler_config.schema.json``
  (``num_train_timesteps`` an integer in 1..100000, betas in (0, 1), known enums...), for a scheduler class of the
  allow-list (:func:`scheduler_classes`) with the values that class accepts (``$defs/classes``).

Imports no torch, diffusers or compiler code (the runtime and ``verify`` use it).
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import re
from collections.abc import Collection
from typing import Any

from ..errors import ArtifactError

#: Deepest nesting of objects/arrays accepted in an artifact's JSON (the real manifests nest 6 deep).
MAX_JSON_DEPTH = 32
#: Most digits of a JSON integer (sha256 hex is a string; sizes and shapes have at most 20 digits).
MAX_INT_DIGITS = 30
#: The JSON Schema of ``scheduler/scheduler_config.json``, shipped inside the package.
SCHEDULER_SCHEMA_RESOURCE = ("diffusion_trt.data", "scheduler_config.schema.json")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (more than {MAX_INT_DIGITS})")
    return int(text)


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


_SURROGATE = re.compile("[\ud800-\udfff]")
#: What a terminal may act on or hide: C0 controls (ESC starts the sequences that set a window title or clear the
#: screen; CR rewrites a line), DEL, C1 controls, zero-width and bidirectional marks, lone surrogates, BOM.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ud800-\udfff\ufeff]")
_UNPRINTABLE_BUT_NEWLINE = re.compile(_UNPRINTABLE.pattern.replace("\x00-\x1f", "\x00-\x09\x0b-\x1f"))


def printable(text: str, newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on (or hide) written as its Python escape (``\\x1b``,
    ``\\u202e``), so what an artifact says is shown, never executed: for everything printed from an artifact (its
    manifest's values, file names, error messages quoting them). ``newlines``: keep ``\\n`` (a message of several
    lines of our own); otherwise it is escaped too, so a value cannot fake a line of output."""
    pattern = _UNPRINTABLE_BUT_NEWLINE if newlines else _UNPRINTABLE
    return pattern.sub(lambda m: ascii(m.group())[1:-1], text)


def printable_tree(data: Any) -> Any:
    """A copy of parsed JSON with :func:`printable` applied to every string, keys included."""
    if isinstance(data, str):
        return printable(data)
    if isinstance(data, dict):
        return {printable_tree(k): printable_tree(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [printable_tree(v) for v in data]
    return data


def _tree_problem(data: Any, limit: int) -> str | None:
    """Why a parsed document cannot be used: nested deeper than ``limit``, a string or key holding a lone surrogate
    (``"\\ud800"``: JSON allows the escape, but no UTF-8 text can hold it, so printing or hashing it raises), or a key
    holding a NUL; ``None`` when none of these. Iterative: a deep document must not recurse here either."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return f"holds a lone surrogate escape ({ascii(value)[:60]}), which is no character of UTF-8 text"
        elif isinstance(value, dict | list):
            if depth > limit:
                return f"nests objects/arrays deeper than {limit} levels"
            if isinstance(value, dict) and any("\0" in k for k in value):
                key = next(k for k in value if "\0" in k)
                return f"has a key with a NUL character ({ascii(key)[:60]}), which no name of ours holds"
            children = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | str))
    return None


def parse_json(data: bytes | memoryview, where: str, fix: str = "recompile the artifact") -> Any:
    """Parse untrusted JSON bytes.

    Args:
        data: the file's bytes (any bytes-like object: the reader's large files are memoryviews).
        where: the file, for messages.
        fix: what the user should do, for messages.

    Raises:
        ArtifactError: not UTF-8, not JSON, ``NaN``/``Infinity``, an integer of more than :data:`MAX_INT_DIGITS`
            digits, nested deeper than :data:`MAX_JSON_DEPTH`, a lone surrogate (``"\\ud800"``) in a string or key, or a
            NUL in a key; one line naming the file, the cause and ``fix``.
    """
    try:
        text = (data if isinstance(data, bytes) else bytes(data)).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{where} is not UTF-8 text (byte {e.start}: {e.reason}); {fix}") from None
    try:
        value = json.loads(text, parse_int=_int, parse_constant=_constant)
    except RecursionError:
        raise ArtifactError(f"{where} nests deeper than Python can parse; {fix}") from None
    except ValueError as e:  # JSONDecodeError is a ValueError, and so are _int's and _constant's refusals
        raise ArtifactError(f"{where} is not valid JSON ({e}); {fix}") from None
    problem = _tree_problem(value, MAX_JSON_DEPTH)
    if problem is not None:
        raise ArtifactError(f"{where} {problem}; {fix}")
    return value


def json_path(parts: Collection[Any]) -> str:
    """``components.unet.inputs[0]`` for a jsonschema error's ``absolute_path``."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


@functools.cache
def _validator_class() -> Any:
    try:
        import jsonschema
    except ImportError:  # pragma: no cover - a declared dependency
        raise ArtifactError(
            "the artifact cannot be validated: jsonschema is not installed; pip install 'jsonschema>=4.18'"
        ) from None
    base = jsonschema.Draft202012Validator
    strict = base.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool)
    )
    return jsonschema.validators.extend(base, type_checker=strict)


def schema_problems(data: Any, schema: dict[str, Any], file: str) -> list[str]:
    """JSON Schema violations of ``data``, one line each (``"<file> <json path>: <message>"``), sorted by path.

    Integers must be JSON integers: ``1000.0`` and ``true`` are not (jsonschema's default accepts ``1000.0``).

    Raises:
        ArtifactError: jsonschema is not installed (a dependency of diffusion-trt).
    """
    return [f"{file} {path}: {message}" for path, message in _schema_errors(data, schema)]


def _schema_errors(data: Any, schema: dict[str, Any]) -> list[tuple[str, str]]:
    """(JSON path, short message) of each violation, sorted by path."""
    validator = _validator_class()(schema)
    errors = sorted(validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    return [(json_path(e.absolute_path), _short(e.message)) for e in errors]


def _short(message: str, limit: int = 200) -> str:
    """jsonschema quotes the offending value; a 100 kB value must not make a 100 kB error line."""
    return message if len(message) <= limit else message[: limit - 1] + "…"


@functools.cache
def scheduler_schema() -> dict[str, Any]:
    """The JSON Schema of ``scheduler/scheduler_config.json`` (``data/scheduler_config.schema.json``), parsed once."""
    package, name = SCHEDULER_SCHEMA_RESOURCE
    return json.loads(importlib.resources.files(package).joinpath(name).read_text(encoding="utf-8"))


def scheduler_classes() -> tuple[str, ...]:
    """The diffusers scheduler classes the runtime builds (the schema's ``_class_name`` enum: the classes the
    runtime's ``--scheduler`` names map to), in the schema's order."""
    return tuple(scheduler_schema()["properties"]["_class_name"]["enum"])


def scheduler_config_problems(config: Any, file: str = "scheduler_config.json", class_name: str | None = None
                              ) -> list[str]:
    """Values of a scheduler config the runtime would hand to diffusers that are of the wrong type or out of range,
    or that the scheduler class it builds does not accept.

    Args:
        config: the parsed ``scheduler_config.json``.
        file: the file, for messages.
        class_name: the class the runtime builds (the manifest's ``scheduler.class_name``, or the class of a chosen
            ``--scheduler``); ``None`` = the config's ``_class_name``. It must be one of :func:`scheduler_classes`,
            and the config's values must be ones it accepts (the schema's ``$defs/classes/<class>``).

    Returns:
        One line per problem (``"scheduler_config.json num_train_timesteps: -5 is less than the minimum of 1"``),
        one per key at most; empty when the config is safe to build that scheduler from.
    """
    own = config.get("_class_name") if isinstance(config, dict) else None
    cls = class_name if class_name is not None else own
    problems, found = [], {}  # found: path -> message, the class's own first (it names what that class accepts)
    if isinstance(cls, str) and cls not in scheduler_classes():
        problems.append(f"{file}: scheduler class {cls!r} is not one the runtime runs; use one of "
                        f"{', '.join(scheduler_classes())}")
        if cls == own:
            found["_class_name"] = ""  # said just above, once
    per_class = scheduler_schema()["$defs"]["classes"].get(cls) if isinstance(cls, str) else None
    for path, message in _schema_errors(config, per_class) if per_class else []:
        found.setdefault(path, f"{message} ({cls})")
    for path, message in _schema_errors(config, scheduler_schema()):
        found.setdefault(path, message)
    problems += [f"{file} {path}: {message}" for path, message in sorted(found.items()) if message]
    if isinstance(config, dict) and not problems:
        if cls is None:
            problems.append(f"{file}: names no scheduler class (_class_name); use one of "
                            f"{', '.join(scheduler_classes())}")
        problems += _cross_field_problems(config, file)
    return problems


#: The runtime's default ``num_inference_steps`` (``runtime.request``): a config must let it run.
DEFAULT_STEPS = 50


def _cross_field_problems(config: dict[str, Any], file: str) -> list[str]:
    """What one key's schema cannot say: betas in order, ``trained_betas`` of the right length, and a ``steps_offset``
    that keeps the default :data:`DEFAULT_STEPS` steps inside the training timesteps ("leading" spacing adds it to
    every timestep: its first is ``(n - 1) * (train // n) + steps_offset`` for ``n`` steps)."""
    problems = []
    start, end = config.get("beta_start"), config.get("beta_end")
    if isinstance(start, int | float) and isinstance(end, int | float) and start > end:
        problems.append(f"{file}: beta_start={start} is larger than beta_end={end}")
    betas, train = config.get("trained_betas"), int(config.get("num_train_timesteps", 1000))
    if isinstance(betas, list) and len(betas) != train:
        problems.append(f"{file} trained_betas: {len(betas)} values for num_train_timesteps={train}")
    offset = int(config.get("steps_offset", 0))
    steps = min(DEFAULT_STEPS, train)
    first = (steps - 1) * (train // steps) + offset
    if first >= train:
        problems.append(
            f"{file} steps_offset: {offset} with num_train_timesteps={train} starts the default {steps} steps at "
            f"timestep {first}, past the last training timestep {train - 1}; use at most {train - 1 - first + offset} "
            "(diffusers' configs use 0 or 1)"
        )
    return problems


def check_scheduler_config(config: Any, file: str = "scheduler_config.json", class_name: str | None = None
                           ) -> dict[str, Any]:
    """``config`` when :func:`scheduler_config_problems` finds nothing (for ``class_name``: the artifact's class, or
    ``None`` for the config's ``_class_name``).

    Raises:
        ArtifactError: one line listing every problem and the fix.
    """
    problems = scheduler_config_problems(config, file, class_name)
    if problems:
        raise ArtifactError(
            f"the artifact's scheduler config is unsafe to use: {'; '.join(problems)}; restore the original "
            "scheduler/scheduler_config.json (diffusers' values) or recompile the artifact"
        )
    return dict(config)

"""Import diffusers' scheduler modules without importing ``torch._dynamo`` on the way (issue 28).

Why: ``import diffusers`` reaches ``diffusers.utils.torch_utils``, whose one use of TorchDynamo at import time is
``from torch._dynamo import allow_in_graph as maybe_allow_in_graph`` (a decorator for its attention blocks). Importing
``torch._dynamo`` is most of diffusers' import: 1.55 of 2.09 s on the 2-core CPU machine (``python -X importtime``,
torch 2.13, diffusers 0.42.1), and ``from_artifacts`` waits for that import before its first image.

How: while the scheduler is imported (:func:`deferred_dynamo`), ``sys.modules["torch._dynamo"]`` holds a stand-in
whose ``allow_in_graph`` is :func:`allow_in_graph` below: it imports the real ``torch._dynamo`` when first *called*
(when diffusers' model modules are imported, which a runtime that only schedules never does) and returns the real
decorator's result, so diffusers behaves as before. Any other attribute of the stand-in imports the real module
and answers from it. The stand-in leaves ``sys.modules`` when the block ends; a later ``import torch._dynamo`` is
the real one. Nothing is deferred when ``torch._dynamo`` or ``diffusers.utils.torch_utils`` is already imported.

Another thread that imports TorchDynamo during the block (~0.4 s) gets what it asks for: a name of the module
imports the real one; a submodule (``import torch._dynamo.config``) is found through the stand-in's ``__path__``,
the real package's folder.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

_DYNAMO = "torch._dynamo"
_lock = threading.Lock()


def allow_in_graph(fn: Any) -> Any:
    """``torch._dynamo.allow_in_graph(fn)``, importing the real ``torch._dynamo`` first (see the module docstring)."""
    return _real_dynamo().allow_in_graph(fn)


class _StandIn(types.ModuleType):
    """``torch._dynamo`` while diffusers' scheduler is imported: :func:`allow_in_graph`, else the real module."""

    allow_in_graph = staticmethod(allow_in_graph)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # the import system's questions (``__spec__``, ``__file__``...) stay unanswered
            raise AttributeError(name)
        return getattr(_real_dynamo(), name)


def _real_dynamo() -> types.ModuleType:
    """The real ``torch._dynamo`` (imported now if need be; the stand-in, if still in place, leaves first)."""
    with _lock:
        if isinstance(sys.modules.get(_DYNAMO), _StandIn):
            del sys.modules[_DYNAMO]
    return importlib.import_module(_DYNAMO)


@contextlib.contextmanager
def deferred_dynamo() -> Iterator[bool]:
    """Hold the stand-in in ``sys.modules`` for the block (see the module docstring); yields whether it did."""
    with _lock:
        defer = _DYNAMO not in sys.modules and "diffusers.utils.torch_utils" not in sys.modules
        spec = importlib.util.find_spec(_DYNAMO) if defer else None  # the package's folder; imports nothing of it
        stand_in = _StandIn(_DYNAMO, __doc__) if spec is not None else None
        if stand_in is not None:
            stand_in.__path__ = list(spec.submodule_search_locations or [])
            sys.modules[_DYNAMO] = stand_in
    try:
        yield stand_in is not None
    finally:
        with _lock:
            if stand_in is not None and sys.modules.get(_DYNAMO) is stand_in:
                del sys.modules[_DYNAMO]

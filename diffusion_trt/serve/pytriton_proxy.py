"""What ``serve`` adds to PyTriton 0.7's Triton model: request statuses, a byte bound, a bounded queue.

PyTriton answers *every* exception of an inference callable with Triton's INTERNAL status (HTTP 500, gRPC
INTERNAL) and the full Python traceback as the message (``pytriton/proxy/inference.py`` formats it,
``pytriton/proxy/model.py`` wraps it in ``TritonModelException``); it has no error type that maps to another
status. And its ``ModelConfig(batching=False)`` writes no ``dynamic_batching`` block, so Triton queues the
requests of an unbatched model without any bound. This module closes both from outside PyTriton:

* :func:`patched` appends :data:`PROXY_TAIL` to the ``model.py`` PyTriton hands tritonserver (its proxy, run by
  the Python-backend stub): a subclass of PyTriton's ``TritonPythonModel`` whose ``execute``

  1. refuses a request whose BYTES inputs hold more than their byte bound, with INVALID_ARG, before PyTriton
     copies it into the shared memory our process reads (a 256 MB prompt never reaches this process);
  2. turns PyTriton's error into the status our callable asked for: a :class:`StatusError` ("[diffusion-trt:
     INVALID_ARG] steps=0 must be in 1..20") becomes INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT) or UNAVAILABLE
     (503 / UNAVAILABLE) with just that one line; any other error becomes INTERNAL "internal error ...; see the
     server log" (the traceback goes to the server log only, never to the client);

  3. waits up to 60 s, not PyTriton's 1 s, for the first instance's handshake socket when an instance starts, and
     tries again while it refuses connections (``get_config_from_handshake_server``): on a loaded host the other
     instances gave up and the server died during start-up;

* and adds ``dynamic_batching { default_queue_policy {...} }`` to the model's config (Triton accepts it with
  ``max_batch_size: 0``: one request per execution, as before): at most ``max_queue`` requests wait, more get
  UNAVAILABLE "Exceeds maximum queue size"; a request that waited longer than its timeout (``timeout_s``, or the
  client's own ``timeout`` parameter) is rejected with UNAVAILABLE "Request timeout expired" instead of being run.

Only the model named in :func:`patched` is changed, and only while the context is open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

#: Triton error codes a :class:`StatusError` may carry (``pb_utils.TritonError`` attribute names).
STATUS_CODES: tuple[str, ...] = ("INVALID_ARG", "UNAVAILABLE")
_MARK = "[diffusion-trt:{code}] "


class StatusError(Exception):
    """A request error for the client, with its Triton status: "INVALID_ARG" (400) or "UNAVAILABLE" (503).

    Its ``str`` carries a marker the proxy reads back (see the module docstring); ``message`` is one line.
    """

    def __init__(self, code: str, message: str) -> None:
        if code not in STATUS_CODES:
            raise ValueError(f"code={code!r}; use one of {', '.join(STATUS_CODES)}")
        self.code = code
        self.message = " ".join(str(message).split())  # one line, whatever the message held
        super().__init__(_MARK.format(code=code) + self.message)


#: Appended to PyTriton's proxy ``model.py``; formatted with ``max_bytes`` (input name -> bytes at most).
#: It runs inside tritonserver's Python-backend stub: pb_utils and PyTriton's TritonPythonModel are in scope.
PROXY_TAIL = '''

# ---- appended by diffusion-trt serve (diffusion_trt/serve/pytriton_proxy.py) ----
import re as _dtrt_re

_DTRT_MAX_BYTES = {max_bytes!r}
_DTRT_MARK = _dtrt_re.compile(r"\\[diffusion-trt:(INVALID_ARG|UNAVAILABLE)\\] ([^\\n]*)")
_DtrtPyTritonModel = TritonPythonModel
_dtrt_get_config = get_config_from_handshake_server


def get_config_from_handshake_server(socket_path, timeout_s=60.0):
    """PyTriton's wait of instances 1..N for instance 0's handshake socket, with 60 s instead of its 1 s, and tried
    again while the socket exists but does not listen yet: on a loaded host instance 0 took longer and every other
    instance failed to initialise (TimeoutError, or ConnectionRefusedError: the start-up that died)."""
    import time as _time

    deadline = _time.monotonic() + timeout_s
    while True:
        try:
            return _dtrt_get_config(socket_path, timeout_s=max(1.0, deadline - _time.monotonic()))
        except (ConnectionRefusedError, TimeoutError):
            if _time.monotonic() >= deadline:
                raise
            _time.sleep(0.05)


def _dtrt_refusal(request):
    """An INVALID_ARG response for a request whose BYTES inputs are too large, else None."""
    for name, limit in _DTRT_MAX_BYTES.items():
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            continue
        size = sum(len(item) for item in tensor.as_numpy().reshape(-1))
        if size > limit:
            message = (f"{{name}} is {{size}} bytes; at most {{limit}} are accepted (the prompt length limit, in "
                       f"UTF-8 bytes): send a shorter {{name}}")
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG))
    return None


def _dtrt_error(text):
    """The client's error for PyTriton's error text: the marked status and line, else INTERNAL without details."""
    found = list(_DTRT_MARK.finditer(text))
    if found:
        code, message = found[-1].group(1), found[-1].group(2)
        return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    return pb_utils.TritonError("internal error while running the pipeline; see the server log")


class TritonPythonModel(_DtrtPyTritonModel):
    def execute(self, requests):
        refused = [_dtrt_refusal(r) for r in requests]
        todo = [r for r, refusal in zip(requests, refused) if refusal is None]
        done = iter(())
        if todo:
            try:
                done = iter(super().execute(todo))
            except pb_utils.TritonModelException as e:
                done = iter([pb_utils.InferenceResponse(error=_dtrt_error(str(e))) for _ in todo])
        return [refusal if refusal is not None else next(done) for refusal in refused]
'''


def proxy_tail(max_bytes: Mapping[str, int]) -> str:
    """:data:`PROXY_TAIL` for these byte bounds (BYTES input name -> bytes at most)."""
    return PROXY_TAIL.format(max_bytes={str(k): int(v) for k, v in max_bytes.items()})


def queue_policy(max_queue: int, timeout_s: float) -> dict[str, Any]:
    """The ``dynamic_batching`` block (protobuf JSON names) bounding the model's queue.

    Args:
        max_queue: requests waiting at most (>= 1); more are refused with UNAVAILABLE.
        timeout_s: a request waiting longer is rejected (UNAVAILABLE), not run; 0 = no timeout. A client may set a
            shorter (or longer) one with the request's ``timeout`` parameter (``allow_timeout_override``).
    """
    return {"defaultQueuePolicy": {"timeoutAction": "REJECT", "defaultTimeoutMicroseconds": int(timeout_s * 1e6),
                                   "allowTimeoutOverride": True, "maxQueueSize": int(max_queue)}}


@contextlib.contextmanager
def patched(model_name: str, *, max_bytes: Mapping[str, int], max_queue: int, timeout_s: float) -> Iterator[None]:
    """While open, PyTriton gives model ``model_name`` the proxy tail and the queue policy (module docstring).

    Patches ``pytriton.models.model.Model`` (``get_proxy_model_files``: the files sent to tritonserver;
    ``generate_model``: the same on a local model store) and ``ModelConfigGenerator.get_config``; restored on exit.
    """
    from pytriton.model_config import generator
    from pytriton.models import model as models

    tail = proxy_tail(max_bytes)
    original = (models.Model.get_proxy_model_files, models.Model.generate_model,
                generator.ModelConfigGenerator.get_config)
    get_files, generate, get_config = original

    def get_proxy_model_files(self: Any) -> dict[str, bytes]:
        files = get_files(self)
        if self.model_name == model_name:
            key = f"file:{self.model_version}/model.py"
            files[key] = files[key] + tail.encode()
        return files

    def generate_model(self: Any, model_repository: Any) -> None:
        generate(self, model_repository)
        if self.model_name == model_name:
            path = model_repository / self.model_name / str(self.model_version) / "model.py"
            path.write_text(path.read_text(encoding="utf-8") + tail, encoding="utf-8")

    def config(self: Any) -> dict[str, Any]:
        out = get_config(self)
        if out.get("name") == model_name:
            out["dynamic_batching"] = queue_policy(max_queue, timeout_s)
        return out

    models.Model.get_proxy_model_files = get_proxy_model_files
    models.Model.generate_model = generate_model
    generator.ModelConfigGenerator.get_config = config
    try:
        yield
    finally:
        models.Model.get_proxy_model_files, models.Model.generate_model = original[:2]
        generator.ModelConfigGenerator.get_config = original[2]


__all__ = ["PROXY_TAIL", "STATUS_CODES", "StatusError", "patched", "proxy_tail", "queue_policy"]

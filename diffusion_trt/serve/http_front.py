"""The HTTP front of ``diffusion-trt serve``: our limits in front of Triton's own HTTP parser.

Triton 2.51 (the one PyTriton 0.7 embeds) has no request-size option and answers HTTP 500 for much that is the
client's error: a seed of 2^63, a shape of [-1], a ``timeout`` parameter of -1 or "abc", a lone surrogate
(``"\\ud800"``) in a prompt, malformed JSON, a JSON array as the body (measured: ``benchmarks/serve_abuse.py``). It
also wraps an INT32 that does not fit (``steps`` 2^32+3 runs 3 steps) and reads a whole 256 MB body into memory,
which tritonserver and the Python-backend stub that took it keep (+512 MB each). None of that reaches code of ours,
so ``serve`` listens itself on the HTTP port and hands Triton (bound to another port of 127.0.0.1) only requests
that passed these checks, byte for byte as they came:

1. **Body size**: ``Content-Length`` required on POST (411 without it, or with ``Transfer-Encoding``) and at most
   ``max_body_bytes`` (413, decided before the body is read; the body, up to 1 GiB, is drained in 1 MiB pieces and
   dropped, so the client reads the answer);
   compressed bodies (``Content-Encoding`` other than identity: Triton would inflate them past any cap) 415.
2. **Where**: POST only to ``/v2/models/<model>[/versions/<v>]/infer`` (404 otherwise: ``generate`` and the
   administrative endpoints are not served through the front); GET is forwarded as it is (health, metadata).
3. **The JSON header** of an infer request (all of the body, or its first ``Inference-Header-Content-Length``
   bytes in the binary-tensor extension): UTF-8 JSON, no duplicate keys, nested at most :data:`MAX_DEPTH` deep, and
   the KServe v2 request shape with the types Triton reads: ``id`` a string; ``parameters`` an object of strings,
   booleans and numbers, ``timeout`` and ``priority`` integers >= 0; every input an object with a string ``name``
   and ``datatype``, a ``shape`` of integers >= 0, and ``data`` whose every element has the datatype's JSON type
   (strings for BYTES, with no lone surrogate; integers inside INT8..UINT64's ranges; numbers for FP16..FP64;
   booleans for BOOL); outputs likewise. A request that fails gets **400** and one line naming the field, in
   Triton's own error format (``{"error": "..."}``), so clients read it as they read Triton's.
4. **Connections**: at most ``max_connections`` at once (more get 503 at once), and a connection idle (or a body
   stalled) for ``idle_timeout_s`` is closed.

What remains (README "Serving"): gRPC goes to Triton directly (its typed protobuf already refuses these with
INVALID_ARGUMENT, but accepts messages up to 2 GB: the stub's byte bound refuses a large prompt there, after
tritonserver read it); and the port Triton's HTTP listens on is reachable from this machine (127.0.0.1 only).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

#: POST paths forwarded: the KServe v2 infer endpoint of a model (any version).
INFER_PATH = re.compile(r"/v2/models/[^/?#]+(?:/versions/[^/?#]+)?/infer")
#: JSON nesting the header may have (an infer request needs 4: body, inputs, input, data).
MAX_DEPTH = 8
#: Headers of one hop only, never forwarded (either way).
HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                         "upgrade", "expect", "content-length", "host"})
_DRAIN_CHUNK = 1 << 20
#: A refused body is read (and dropped) up to this size so that the client reads the 413, not a reset.
DRAIN_AT_MOST = 1 << 30

_INT_RANGES: dict[str, tuple[int, int]] = {
    **{f"INT{b}": (-(2 ** (b - 1)), 2 ** (b - 1) - 1) for b in (8, 16, 32, 64)},
    **{f"UINT{b}": (0, 2**b - 1) for b in (8, 16, 32, 64)},
}
_FLOATS = frozenset({"FP16", "FP32", "FP64", "BF16"})
_UINT64 = (0, 2**64 - 1)


@dataclass(frozen=True)
class FrontLimits:
    """The front's bounds (``ServeConfig`` derives them; see :mod:`.server`).

    Attributes:
        max_body_bytes: a request body at most (413 beyond).
        max_connections: client connections at once (503 beyond).
        idle_timeout_s: a connection silent this long (between requests, or in the middle of one) is closed.
        upstream_timeout_s: how long one request may take inside Triton (queue wait + compute) before 503.
    """

    max_body_bytes: int
    max_connections: int = 128
    idle_timeout_s: float = 60.0
    upstream_timeout_s: float = 3600.0


class FrontError(Exception):
    """A request the front refuses: its HTTP status and one line for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = " ".join(message.split())


# -- the JSON header ------------------------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # Triton's parser takes the first, ours the last: which one was checked?
            raise FrontError(400, f"the request JSON has the key {_show(key)} twice in one object; send it once")
        out[key] = value
    return out


def _show(value: Any, limit: int = 40) -> str:
    """A value as JSON spells it (``null``, ``"abc"``, ``"\\ud800"``), for a message, cut to ``limit`` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            return depth
        level = [v for item in level if isinstance(item, dict | list)
                 for v in (item.values() if isinstance(item, dict) else item)]
    return depth


def load_header(raw: bytes) -> Any:
    """The request JSON, parsed as strictly as Triton's checks need.

    Raises:
        FrontError: 400, not UTF-8 JSON, a duplicate key, or nested more than :data:`MAX_DEPTH` deep.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FrontError(400, f"the request body is not UTF-8 ({e.reason} at byte {e.start}); send JSON as UTF-8"
                         ) from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError:  # json's scanner bounds its own recursion
        raise FrontError(400, f"the request JSON is nested more than {MAX_DEPTH} levels deep") from None
    except json.JSONDecodeError as e:
        raise FrontError(400, f"the request body is not valid JSON ({e.msg} at character {e.pos})") from None
    if _depth(doc) > MAX_DEPTH:
        raise FrontError(400, f"the request JSON is nested more than {MAX_DEPTH} levels deep")
    return doc


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _uint(where: str, value: Any, hi: int = _UINT64[1]) -> None:
    if not _is_int(value) or not 0 <= value <= hi:
        raise FrontError(400, f"{where}={_show(value)} must be an integer in 0..{hi}")


def _object(where: str, value: Any, allowed: frozenset[str] | None = None) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FrontError(400, f"{where} must be a JSON object, got {_show(value)}")
    if allowed is not None and (unknown := sorted(set(value) - allowed)):
        raise FrontError(400, f"{where} has the unknown key {_show(unknown[0])}; a KServe v2 infer request has "
                              f"{', '.join(sorted(allowed))}")
    return value


def _parameters(where: str, value: Any) -> None:
    """A ``parameters`` object: strings, booleans or numbers (what Triton takes), the known ones typed."""
    params = _object(where, value)
    for key, v in params.items():
        name = f"{where}.{key}"
        if key in ("timeout", "priority", "binary_data_size", "shared_memory_offset", "shared_memory_byte_size",
                   "classification"):
            _uint(name, v)
        elif key in ("binary_data", "binary_data_output", "sequence_start", "sequence_end"):
            if not isinstance(v, bool):
                raise FrontError(400, f"{name}={_show(v)} must be true or false")
        elif key in ("sequence_id", "shared_memory_region"):
            if not (isinstance(v, str) or (key == "sequence_id" and _is_int(v) and 0 <= v <= _UINT64[1])):
                raise FrontError(400, f"{name}={_show(v)} must be a string" +
                                 (" or an integer >= 0" if key == "sequence_id" else ""))
        elif not isinstance(v, str | bool | int | float) or (_is_int(v) and not -(2**63) <= v < 2**63):
            raise FrontError(400, f"{name}={_show(v)} must be a string, a boolean or a number (64-bit)")


def _leaves(data: Any) -> Iterator[Any]:
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        else:
            yield item


def _data(name: str, datatype: str, data: Any) -> None:
    """Every element of an input's ``data`` of the datatype's JSON type and range."""
    if not isinstance(data, list):
        raise FrontError(400, f"input {_show(name)}: data must be a JSON array, got {_show(data)}")
    where = f"input {_show(name)} ({datatype})"
    for i, leaf in enumerate(_leaves(data)):
        if datatype == "BYTES":
            if not isinstance(leaf, str):
                raise FrontError(400, f"{where}: element {i} is {_show(leaf)}, not a string")
            try:
                leaf.encode("utf-8")
            except UnicodeEncodeError as e:
                raise FrontError(400, f"{where}: element {i} holds a lone surrogate ({_show(leaf[e.start])} at "
                                      f"character {e.start}), which is not text; send the text as UTF-8") from None
        elif datatype in _INT_RANGES:
            lo, hi = _INT_RANGES[datatype]
            if not _is_int(leaf):
                raise FrontError(400, f"{name}={_show(leaf)} is not an integer ({datatype})")
            if not lo <= leaf <= hi:
                raise FrontError(400, f"{name}={leaf} is outside {datatype}'s range {lo}..{hi}")
        elif datatype in _FLOATS:
            if not isinstance(leaf, int | float) or isinstance(leaf, bool):
                raise FrontError(400, f"{name}={_show(leaf)} is not a number ({datatype})")
        elif datatype == "BOOL" and not isinstance(leaf, bool):
            raise FrontError(400, f"{name}={_show(leaf)} is not true or false (BOOL)")


def check_infer_header(doc: Any) -> None:
    """The KServe v2 infer request ``doc`` (parsed JSON) has the shape and types Triton's parser reads.

    Raises:
        FrontError: 400, naming the first field that is wrong and what it takes.
    """
    request = _object("the request", doc, frozenset({"id", "parameters", "inputs", "outputs"}))
    if "id" in request and not isinstance(request["id"], str):
        raise FrontError(400, f"id={_show(request['id'])} must be a string")
    if "parameters" in request:
        _parameters("parameters", request["parameters"])
    if "inputs" not in request or not isinstance(request["inputs"], list):
        raise FrontError(400, "the request needs inputs, a JSON array of {name, datatype, shape, data} objects")
    for k, item in enumerate(request["inputs"]):
        tensor = _object(f"inputs[{k}]", item, frozenset({"name", "datatype", "shape", "parameters", "data"}))
        name = tensor.get("name")
        if not isinstance(name, str):
            raise FrontError(400, f"inputs[{k}].name={_show(name)} must be a string")
        if not isinstance(tensor.get("datatype"), str):
            raise FrontError(400, f"input {_show(name)}: datatype={_show(tensor.get('datatype'))} must be a string, "
                                  "e.g. \"BYTES\"")
        shape = tensor.get("shape")
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d < 2**63 for d in shape):
            raise FrontError(400, f"input {_show(name)}: shape={_show(shape)} must be a list of integers >= 0, "
                                  "e.g. [1]")
        if "parameters" in tensor:
            _parameters(f"input {_show(name)} parameters", tensor["parameters"])
        if "data" in tensor:
            _data(name, tensor["datatype"], tensor["data"])
    outputs = request.get("outputs", [])
    if not isinstance(outputs, list):
        raise FrontError(400, f"outputs={_show(outputs)} must be a JSON array of {{name, parameters}} objects")
    for k, item in enumerate(outputs):
        output = _object(f"outputs[{k}]", item, frozenset({"name", "parameters"}))
        if not isinstance(output.get("name"), str):
            raise FrontError(400, f"outputs[{k}].name={_show(output.get('name'))} must be a string")
        if "parameters" in output:
            _parameters(f"output {_show(output['name'])} parameters", output["parameters"])


def check_infer_body(body: bytes, header_length: str | None) -> None:
    """An infer request's body: its JSON header (all of it, or the first ``header_length`` bytes) checked.

    Raises:
        FrontError: 400.
    """
    end = len(body)
    if header_length is not None:
        text = header_length.strip()
        if not text.isascii() or not text.isdigit() or not 0 < int(text) <= len(body):
            raise FrontError(400, f"Inference-Header-Content-Length={_show(header_length)} must be an integer in "
                                  f"1..{len(body)} (the body's length)")
        end = int(text)
    check_infer_header(load_header(body[:end]))


# -- the server -----------------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    """One client connection; ``server`` is the :class:`_Server` (limits, upstream port)."""

    protocol_version = "HTTP/1.1"  # keep-alive, as Triton
    # TCP_NODELAY: the headers and the body go out in two writes, and Nagle held the second until the client's
    # delayed ACK: +43 ms per request (measured on loopback: 45.3 ms -> 2.6 ms a request through the front)
    disable_nagle_algorithm = True
    server_version = "diffusion-trt"
    server: _Server

    def setup(self) -> None:
        self.timeout = self.server.limits.idle_timeout_s
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("front %s: " + format, self.address_string(), *args)

    def handle_expect_100(self) -> bool:
        """``Expect: 100-continue`` with a body over the bound: 413 before the client sends it."""
        length = self.headers.get("Content-Length", "")
        if length.isascii() and length.isdigit() and int(length) > self.server.limits.max_body_bytes:
            self.close_connection = True  # the body may follow all the same: it is never read as a request
            self._send_error(413, self._too_large(int(length)))
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:
        self._serve(infer=False)

    def do_POST(self) -> None:
        self._serve(infer=True)

    def do_PUT(self) -> None:
        self._send_error(405, f"{self.command} is not served; POST /v2/models/<model>/infer, or GET")

    do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_PUT

    def _too_large(self, length: int) -> str:
        return (f"the request body is {length} bytes; at most {self.server.limits.max_body_bytes} are accepted "
                "(the prompt length limit, as JSON): send shorter prompts")

    def _serve(self, infer: bool) -> None:
        try:
            body = self._body(required=infer)
            path = self.path.split("?", 1)[0]
            if infer:
                if not INFER_PATH.fullmatch(path):
                    raise FrontError(404, f"POST {_show(path, 80)} is not served here; send inference requests to "
                                          "POST /v2/models/<model>/infer")
                check_infer_body(body, self.headers.get("Inference-Header-Content-Length"))
        except FrontError as e:
            logger.debug("front refused %s %s: %d %s", self.command, self.path[:80], e.status, e.message)
            self._send_error(e.status, e.message)
            return
        self._forward(body)

    def _body(self, required: bool) -> bytes:
        """The request's body, read only when its declared length is within the bound.

        Raises:
            FrontError: 411 (no length, chunked), 415 (compressed), 400 (a malformed length), 413 (too large).
        """
        headers = self.headers
        if headers.get("Transfer-Encoding") is not None:
            self.close_connection = True
            raise FrontError(411, "chunked request bodies are not accepted; send a Content-Length")
        encoding = (headers.get("Content-Encoding") or "identity").strip().lower()
        lengths = headers.get_all("Content-Length") or []
        if len(lengths) > 1:
            self.close_connection = True
            raise FrontError(400, "the request has more than one Content-Length header; send one")
        if not lengths:
            if required:
                raise FrontError(411, "a POST needs a Content-Length header")
            return b""
        text = lengths[0].strip()
        if not text.isascii() or not text.isdigit():
            self.close_connection = True
            raise FrontError(400, f"Content-Length={_show(lengths[0])} is not a number of bytes")
        length = int(text)
        if length > self.server.limits.max_body_bytes:
            self._drain(length)
            raise FrontError(413, self._too_large(length))
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True
            raise FrontError(400, f"the body ended after {len(body)} of its {length} bytes")
        if encoding != "identity":
            raise FrontError(415, f"Content-Encoding {_show(encoding)} is not accepted; send the body uncompressed")
        return body

    def _drain(self, length: int) -> None:
        """Read and drop a refused body (1 MiB at a time), so the client gets the answer rather than a reset; a body
        over :data:`DRAIN_AT_MOST` is not waited for (the connection is closed after the answer)."""
        self.close_connection = True
        if length > DRAIN_AT_MOST:
            return
        left = length
        with contextlib.suppress(OSError):
            while left > 0:
                chunk = self.rfile.read(min(_DRAIN_CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)

    def _forward(self, body: bytes) -> None:
        """Send the request to Triton as it came (less the hop-by-hop headers) and its answer back."""
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port,
                                              timeout=self.server.limits.upstream_timeout_s)
        try:
            upstream.request(self.command, self.path, body=body if self.command == "POST" else None,
                             headers=headers)
            response = upstream.getresponse()
            data = response.read()
            status, reason, reply = response.status, response.reason, response.getheaders()
        except (OSError, http.client.HTTPException) as e:
            logger.warning("front: Triton did not answer %s %s (%s)", self.command, self.path[:80], e)
            self._send_error(503, "the inference server did not answer; retry later")
            return
        finally:
            upstream.close()
        try:
            self.send_response(status, reason)
            for key, value in reply:
                if key.lower() not in HOP_HEADERS and key.lower() not in ("server", "date"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away meanwhile
            self.close_connection = True

    def _send_error(self, status: int, message: str) -> None:
        """Triton's error format: ``{"error": "..."}`` with ``status``."""
        data = json.dumps({"error": message}).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], upstream_port: int, limits: FrontLimits) -> None:
        self.limits = limits
        self.upstream_port = upstream_port
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # 503 at once, from the accepting thread (a few bytes)
            body = b'{"error":"server busy: too many connections; retry later"}'
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class HttpFront:
    """The front: bound to ``host:port`` when made, serving (in a thread) from :meth:`start` to :meth:`close`,
    forwarding to Triton's HTTP on ``127.0.0.1:upstream_port``. A context manager (``with`` starts and closes it).

    Raises:
        OSError: ``host:port`` cannot be bound (in use, not an address of this machine).
    """

    def __init__(self, host: str, port: int, upstream_port: int, limits: FrontLimits) -> None:
        self._server = _Server((host, port), upstream_port, limits)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="diffusion-trt-http-front", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, and close the listening socket (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=10)
        self._server.server_close()

    def __enter__(self) -> HttpFront:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def free_loopback_port() -> int:
    """A TCP port of 127.0.0.1 free now (for Triton's own HTTP endpoint behind the front)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


__all__ = ["INFER_PATH", "MAX_DEPTH", "FrontError", "FrontLimits", "HttpFront", "check_infer_body",
           "check_infer_header", "free_loopback_port", "load_header"]

"""The gRPC front of ``diffusion-trt serve``: a message-size bound in front of Triton's gRPC server.

Triton 2.51 takes gRPC messages up to 2 GB and has no option to lower that: a 256 MB prompt is read whole by
tritonserver and copied into the shared memory of the Python-backend stub that takes it, before the stub's byte
bound refuses it (measured over three such prompts: tritonserver +1.4 GB, +256 MB in each of three stubs;
``benchmarks/results/cpu-2core-2026-12-01-serve-abuse-2-before.json``). So ``serve`` listens itself on the gRPC port and
relays every call, as raw bytes (nothing is decoded or re-encoded), to Triton's gRPC on another port of 127.0.0.1:

* a request message over ``max_message_bytes`` is refused by grpc itself, from its length prefix, with
  RESOURCE_EXHAUSTED ("Received message larger than max"), before the message is held;
* at most ``max_calls`` calls at once (more get RESOURCE_EXHAUSTED at once);
* a client that cancels, or whose deadline passes, cancels its call inside Triton too; metadata and the client's
  deadline are passed on; Triton's status and details come back as they are (INVALID_ARGUMENT for what our request
  rules refuse, UNAVAILABLE for a full queue).

The typed protobuf already keeps out what the HTTP front checks in JSON (a seed of 2^63 or a timeout of "abc"
cannot be written; a shape of [-1] is INVALID_ARGUMENT from Triton).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

#: Request metadata not passed on (grpc's own, and the per-hop ones).
_OWN_METADATA = ("grpc-", ":")


def _timeout(context: Any) -> float | None:
    """The client's deadline as a timeout; ``None`` when it set none (grpc reports that as ~infinity, which a
    call's ``timeout`` turns into an overflowed, already-passed deadline)."""
    left = context.time_remaining()
    return None if left is None or left > 1e7 else float(left)


def _metadata(context: Any) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in context.invocation_metadata() or () if not k.startswith(_OWN_METADATA)
            and k != "user-agent"]


class GrpcFront:
    """Relays every gRPC call on ``host:port`` to ``127.0.0.1:upstream_port``; bound when made, serving from
    :meth:`start` to :meth:`close` (a context manager too).

    Raises:
        OSError: ``host:port`` cannot be bound.
    """

    def __init__(self, host: str, port: int, upstream_port: int, max_message_bytes: int, max_calls: int) -> None:
        import grpc

        self._grpc = grpc
        self._channel = grpc.insecure_channel(
            f"127.0.0.1:{upstream_port}",
            options=[("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", -1)],
        )
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=max_calls, thread_name_prefix="diffusion-trt-grpc-front"),
            handlers=[_Relay(grpc, self._channel)],
            options=[("grpc.max_receive_message_length", max_message_bytes), ("grpc.max_send_message_length", -1),
                     ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=max_calls,
        )
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:  # grpc >= 1.5x raises where older ones returned 0
            raise OSError(f"cannot bind {host}:{port} ({e})") from None
        if not bound:
            raise OSError(f"cannot bind {host}:{port}")
        self.port = bound
        self._started = False

    def start(self) -> None:
        self._server.start()
        self._started = True

    def close(self) -> None:
        """Stop (calls in flight get 5 s), close the channel to Triton (idempotent)."""
        if self._started:
            self._server.stop(grace=5).wait(10)
            self._started = False
        self._channel.close()

    def __enter__(self) -> GrpcFront:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class _Relay:
    """A ``grpc.GenericRpcHandler`` for every method: unary calls as futures (cancelled with the client's call),
    ``ModelStreamInfer`` as a bidirectional stream; requests and responses stay bytes."""

    def __init__(self, grpc: Any, channel: Any) -> None:
        self._grpc = grpc
        self._channel = channel

    def service(self, details: Any) -> Any:
        method = details.method
        if method.endswith("/ModelStreamInfer"):
            return self._grpc.stream_stream_rpc_method_handler(self._stream(method))
        return self._grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _unary(self, method: str) -> Any:
        call = self._channel.unary_unary(method)
        grpc = self._grpc

        def relay(request: bytes, context: Any) -> bytes:
            future = call.future(request, metadata=_metadata(context), timeout=_timeout(context))
            context.add_callback(future.cancel)  # the client went away: so does the call in Triton
            try:
                return future.result()  # type: ignore[no-any-return]
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                    return b""
                context.abort(e.code(), e.details() or "")
            except grpc.FutureCancelledError:
                context.abort(grpc.StatusCode.CANCELLED, "cancelled")
            raise AssertionError("unreachable")  # pragma: no cover - abort raises

        return relay

    def _stream(self, method: str) -> Any:
        call = self._channel.stream_stream(method)
        grpc = self._grpc

        def relay(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
            responses = call(requests, metadata=_metadata(context), timeout=_timeout(context))
            context.add_callback(responses.cancel)
            try:
                yield from responses
            except grpc.RpcError as e:
                if context.is_active():
                    context.abort(e.code(), e.details() or "")

        return relay


__all__ = ["GrpcFront"]

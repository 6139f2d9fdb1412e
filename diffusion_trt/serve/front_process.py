"""``serve``'s two fronts (:mod:`.http_front`, :mod:`.grpc_front`) in a process of their own.

Why a process: every request needs the GIL a few times on its way through a front (accept, parse, relay, answer),
and in the serve process the pipeline's loop, the micro-batcher and PyTriton's proxy threads hold it. Measured on
the tiny CPU artifact (3 steps; the same server reached through the fronts and through Triton's own port, rounds
alternating): in the serve process the fronts added ~30 ms a request (sequential 91-106 vs 66-69 ms) and cost ~20%
of the 8-concurrent throughput; in their own process ~5 ms (68 vs 63 ms) and ~7% (29.7 vs 31.8 rps, 4 rounds of
120 requests, within this shared machine's noise). The child is started by :class:`FrontProcess` with its settings as
JSON on the command line, binds both ports at once (so a port in use fails before Triton starts), prints one JSON
line (``{"ready": true}`` or ``{"error": "..."}``) and serves until its standard input closes (the serve process
went away or is stopping) or it gets SIGTERM. It ignores SIGINT: Ctrl-C reaches the serve process, which stops it.

    python -m diffusion_trt.serve.front_process '{"host": "127.0.0.1", "http_port": 8000, ...}'
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

from .http_front import FrontLimits, HttpFront

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class FrontSettings:
    """Where the fronts listen and where they relay to (Triton's endpoints on 127.0.0.1), and their bounds."""

    host: str
    http_port: int
    grpc_port: int
    http_upstream: int
    grpc_upstream: int
    max_body_bytes: int
    max_connections: int
    idle_timeout_s: float
    upstream_timeout_s: float

    @classmethod
    def of(cls, host: str, http_port: int, grpc_port: int, http_upstream: int, grpc_upstream: int,
           limits: FrontLimits) -> FrontSettings:
        return cls(host, http_port, grpc_port, http_upstream, grpc_upstream, limits.max_body_bytes,
                   limits.max_connections, limits.idle_timeout_s, limits.upstream_timeout_s)

    def limits(self) -> FrontLimits:
        return FrontLimits(self.max_body_bytes, self.max_connections, self.idle_timeout_s, self.upstream_timeout_s)


class FrontStartError(Exception):
    """The fronts could not start (a port in use...); the message says which and why."""


class FrontProcess:
    """The child process running both fronts; a context manager (started and ready on enter, stopped on exit).

    Raises:
        FrontStartError: the child reported an error, exited, or was not ready within :data:`READY_TIMEOUT_S`.
    """

    def __init__(self, settings: FrontSettings) -> None:
        self.settings = settings
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> FrontProcess:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "diffusion_trt.serve.front_process", json.dumps(asdict(self.settings))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        try:
            line = self._first_line()
            reply = json.loads(line) if line else {"error": f"the front process exited ({self._proc.poll()})"}
        except (ValueError, OSError) as e:
            reply = {"error": f"the front process did not start ({e})"}
        if not reply.get("ready"):
            self.close()
            raise FrontStartError(str(reply.get("error", reply)))
        return self

    def _first_line(self) -> bytes:
        assert self._proc is not None and self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], READY_TIMEOUT_S)
        if not ready:
            raise OSError(f"no answer within {READY_TIMEOUT_S:.0f} s")
        return self._proc.stdout.readline()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Close the child's standard input (it stops), wait 10 s, then kill it (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _say(reply: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    """The child: bind, say ready, serve until stdin closes or SIGTERM."""
    from .grpc_front import GrpcFront

    logging.basicConfig(level=logging.WARNING, format="front: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = FrontSettings(**json.loads((argv if argv is not None else sys.argv[1:])[0]))
    limits = settings.limits()
    try:
        http = HttpFront(settings.host, settings.http_port, settings.http_upstream, limits)
    except OSError as e:
        _say({"error": f"cannot listen on {settings.host}:{settings.http_port} ({e.strerror or e}); choose another "
                       "--port"})
        return 2
    try:
        relay = GrpcFront(settings.host, settings.grpc_port, settings.grpc_upstream, limits.max_body_bytes,
                          limits.max_connections)
    except OSError as e:
        http.close()
        _say({"error": f"cannot listen on {settings.host}:{settings.grpc_port} ({e}); choose another --grpc-port"})
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), stop.set()), daemon=True).start()  # EOF: parent gone
    http.start()
    relay.start()
    _say({"ready": True, "pid": os.getpid()})
    stop.wait()
    http.close()
    relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

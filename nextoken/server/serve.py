"""`nextoken serve`: the app under uvicorn, with a SIGTERM that drains instead of dropping requests.

On the first SIGTERM the server keeps its socket open but answers every new POST with 503 (Retry-After), lets the
requests in flight finish within the drain deadline, aborts what is left, then shuts uvicorn down and exits 0. A
second SIGTERM, or SIGINT, stops at once. Where it may bind: see bind.py. Slow clients are timed out: a request's
headers must arrive within the request timeout (the connection is closed otherwise), then its body (408), and a
stream's client must keep reading (the stream timeout; its requests are aborted otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING, cast

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from nextoken.config import EngineConfig
from nextoken.errors import NextokenError
from nextoken.server.app import DRAIN_TIMEOUT_S, ServerState, create_app
from nextoken.server.bind import check_bind
from nextoken.server.middleware import REQUEST_TIMEOUT_S
from nextoken.server.streaming import SEND_TIMEOUT_S

if TYPE_CHECKING:
    from nextoken.engine.async_engine import AsyncEngine
    from nextoken.engine.engine import LLMEngine
    from nextoken.server.replica_options import ReplicaOptions

log = logging.getLogger("nextoken.server")


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        await super().startup(sockets)
        if not self.started:
            return
        self._loop = asyncio.get_running_loop()
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        replicas = getattr(self.state.async_engine, "num_replicas", None)
        print(f"nextoken: serving {self.state.engine.model_name} at {self.url}/v1 "
              f"(max_model_len {self.state.engine.max_model_len}{f'; {replicas} replicas' if replicas else ''}; "
              "SIGTERM drains, Ctrl+C stops)", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # Not recorded in uvicorn's captured signals: after a drain the process exits 0 instead of re-raising.
        if self._drain_task is None:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self.should_exit = True  # a second SIGTERM: stop now (lifespan shutdown aborts what is left)

    async def shutdown(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        # Streams in flight would hold their connections until uvicorn's grace period ran out and their tasks were
        # cancelled (a traceback in the log, a truncated response): their engine requests end first, so each stream
        # ends at once with an error event and [DONE]. After a drain this finds the engine stopped already.
        await self.state.async_engine.shutdown(0.0)
        await super().shutdown(sockets)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        log.warning("SIGTERM: draining (up to %.0f s), new requests get 503", self.drain_timeout)
        try:
            await self.state.drain(self.drain_timeout)
        finally:
            self.should_exit = True


class _HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers, counted from the connection (or from the
    end of the previous response): uvicorn's keep-alive timer stops at the first byte received, so a client sending
    its headers a byte at a time would otherwise hold its connection forever."""

    head_timeout = REQUEST_TIMEOUT_S
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_response_complete(self) -> None:
        self._arm_head_timer()  # before the base class handles a pipelined request, which disarms it
        super().on_response_complete()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete: its body has the middleware's deadline
            self._disarm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def head_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """The protocol class for uvicorn's `http` setting, with this head timeout."""
    return type("HeadTimeoutProtocol", (_HeadTimeoutProtocol,), {"head_timeout": seconds})


def serve(engine_config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          allow_insecure_bind: bool = False, drain_timeout: float = DRAIN_TIMEOUT_S,
          stream_timeout: float = SEND_TIMEOUT_S, request_timeout: float = REQUEST_TIMEOUT_S,
          record_dir: str | None = None, replicas: ReplicaOptions | None = None) -> int:
    """Load the model, serve until stopped; 0 after a clean stop (SIGTERM included). `replicas`: run the engines as
    Ray Serve replicas behind this server (replicas.py) instead of one engine in this process."""
    check_bind(host, api_key, allow_insecure_bind)
    if not 0 <= port <= 65535:
        raise NextokenError(f"invalid port {port}: must be in 0..65535 (0 picks a free one)")
    if drain_timeout < 0:
        raise NextokenError(f"invalid drain timeout {drain_timeout}: must be >= 0 seconds")
    for name, value in (("stream", stream_timeout), ("request", request_timeout)):
        if not 0 < value < float("inf"):
            raise NextokenError(f"invalid {name} timeout {value}: must be a positive number of seconds")
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s", stream=sys.stderr)
    logging.getLogger("nextoken").setLevel(logging.INFO)  # start-up facts: KV bytes per token, pool size
    if record_dir is not None and not os.path.isdir(record_dir):
        raise NextokenError(f"invalid --record-dir {record_dir}: not a directory")
    if replicas is not None:
        if record_dir is not None:
            raise NextokenError("--record-dir needs the engine in this process: it cannot be combined with --replicas")
        if engine_config.tensor_parallel > 1:
            raise NextokenError(f"--tensor-parallel {engine_config.tensor_parallel} with --replicas: a replica splits "
                                "no model across processes; use replicas (more requests) or tensor parallelism (a "
                                "larger model), not both")
        from nextoken.server.replicas import serve_replicas

        # FrontEngine and RemoteEngine stand where LLMEngine and AsyncEngine stand (remote_engine.py).
        return serve_replicas(engine_config, replicas, lambda front, remote: _run(
            create_app(engine_config, api_key=api_key, stream_timeout=stream_timeout, request_timeout=request_timeout,
                       engine=cast("LLMEngine", front), async_engine=cast("AsyncEngine", remote)),
            host, port, drain_timeout, request_timeout))
    app = create_app(engine_config, api_key=api_key, stream_timeout=stream_timeout, request_timeout=request_timeout,
                     record_dir=record_dir)
    return _run(app, host, port, drain_timeout, request_timeout)


def _run(app: FastAPI, host: str, port: int, drain_timeout: float, request_timeout: float) -> int:
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            server_header=False, timeout_keep_alive=5, timeout_graceful_shutdown=10,
                            http=head_timeout_protocol(request_timeout))
    server = _DrainingServer(config, app.state.nextoken, drain_timeout)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind (it has logged why)
        if not server.started:
            raise NextokenError(f"could not start the server on {host}:{port} (see the message above)") from None
        raise exc
    return 0

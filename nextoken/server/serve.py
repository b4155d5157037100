"""`nextoken serve`: the app under uvicorn, with a SIGTERM that drains instead of dropping requests.

On the first SIGTERM the server keeps its socket open but answers every new POST with 503 (Retry-After), lets the
requests in flight finish within the drain deadline, aborts what is left, then shuts uvicorn down and exits 0. A
second SIGTERM, or SIGINT, stops at once. Where it may bind: see bind.py.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn

from nextoken.config import EngineConfig
from nextoken.errors import NextokenError
from nextoken.server.app import DRAIN_TIMEOUT_S, ServerState, create_app
from nextoken.server.bind import check_bind

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
        print(f"nextoken: serving {self.state.engine.model_name} at {self.url}/v1 "
              f"(max_model_len {self.state.engine.max_model_len}; SIGTERM drains, Ctrl+C stops)", flush=True)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None:
            super().handle_exit(sig, frame)
            return
        # Not recorded in uvicorn's captured signals: after a drain the process exits 0 instead of re-raising.
        if self._drain_task is None:
            self._loop.call_soon_threadsafe(self._start_drain)
        else:
            self.should_exit = True  # a second SIGTERM: stop now (lifespan shutdown aborts what is left)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        log.warning("SIGTERM: draining (up to %.0f s), new requests get 503", self.drain_timeout)
        try:
            await self.state.drain(self.drain_timeout)
        finally:
            self.should_exit = True


def serve(engine_config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          allow_insecure_bind: bool = False, drain_timeout: float = DRAIN_TIMEOUT_S) -> int:
    """Load the model, serve until stopped; 0 after a clean stop (SIGTERM included)."""
    check_bind(host, api_key, allow_insecure_bind)
    if not 0 <= port <= 65535:
        raise NextokenError(f"invalid port {port}: must be in 0..65535 (0 picks a free one)")
    if drain_timeout < 0:
        raise NextokenError(f"invalid drain timeout {drain_timeout}: must be >= 0 seconds")
    logging.basicConfig(level=logging.WARNING, format="[%(name)s] %(message)s", stream=sys.stderr)
    logging.getLogger("nextoken").setLevel(logging.INFO)  # start-up facts: KV bytes per token, pool size
    app = create_app(engine_config, api_key=api_key)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
                            server_header=False, timeout_keep_alive=5, timeout_graceful_shutdown=10)
    server = _DrainingServer(config, app.state.nextoken, drain_timeout)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits 1 when it cannot bind (it has logged why)
        if not server.started:
            raise NextokenError(f"could not start the server on {host}:{port} (see the message above)") from None
        raise exc
    return 0

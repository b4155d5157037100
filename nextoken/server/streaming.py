"""Responses that notice a client leaving: a server-sent-events stream, and a wait for a non-streaming result.

Both race the work against the ASGI `http.disconnect` message. When the client goes first, the work is cancelled at
once (the event iterator is closed, the awaited task cancelled), which aborts its engine requests: their KV blocks
are free after the engine's next pass, whether the client left mid-stream, while queued, or while waiting for a
whole answer. A stream whose client stops reading (a send blocked on a full socket for `send_timeout` seconds,
`serve --stream-timeout`) is abandoned the same way. Starlette's StreamingResponse is not used because it does not
close its iterator on a disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, MutableMapping
from typing import Any, TypeVar

from starlette.responses import Response

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
T = TypeVar("T")
SEND_TIMEOUT_S = 30.0  # a stream whose client reads nothing for this long is abandoned (and its request aborted)
log = logging.getLogger("nextoken.server")


def json_bytes(data: Any) -> bytes:
    """Compact UTF-8 JSON; text that is not valid Unicode (a lone surrogate) falls back to \\u escapes."""
    try:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(data, ensure_ascii=True, separators=(",", ":")).encode()


def json_response(data: Any, status: int = 200) -> Response:
    return Response(json_bytes(data), status_code=status, media_type="application/json")


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data.encode() if isinstance(data, str) else json_bytes(data)
    return b"data: " + payload + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(receive: Receive, work: Coroutine[Any, Any, T]) -> tuple[bool, T | None]:
    """(True, result) when `work` finishes first; (False, None) when the client disconnects first (work cancelled)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, gone):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pending
    if task.cancelled():
        return False, None
    return True, task.result()


class EventStream(Response):
    """A `text/event-stream` response fed by an async iterator of encoded events."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], send_timeout: float = SEND_TIMEOUT_S) -> None:
        # Not Response.__init__: it would render an empty body and announce Content-Length: 0.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.send_timeout = send_timeout

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        # The client's leaving cancels this task wherever it waits (for the next event, or on a full socket): no
        # task or timer of its own per event, which cost about 30 us an event in the event loop.
        task = asyncio.current_task()
        assert task is not None
        streaming, left = True, False

        def client_left(gone: asyncio.Future[None]) -> None:
            nonlocal left
            if streaming and not gone.cancelled():
                left = True
                task.cancel()

        gone = asyncio.ensure_future(wait_for_disconnect(receive))
        gone.add_done_callback(client_left)
        events = aiter(self.events)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                try:
                    chunk = await anext(events)
                except StopAsyncIteration:
                    break
                # A client that stops reading fills the socket and blocks the send: give up on it.
                async with asyncio.timeout(self.send_timeout):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            task.uncancel()  # ours, for the client that left: the response simply ends
        except TimeoutError:
            log.warning("a stream's client read nothing for %.0f s: the stream is abandoned and its requests aborted",
                        self.send_timeout)
        finally:
            streaming = False  # a disconnect noticed from here on cancels nothing
            gone.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

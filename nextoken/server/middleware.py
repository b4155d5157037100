"""The ASGI layer in front of every route: API key, draining, body size, status metrics, last-resort 500.

Order of checks: the API key (every route but /health; constant-time comparison; the key is never logged), then
draining (after SIGTERM every POST gets 503 with Retry-After), then the body: a POST body is read here in full, at
most `max_body_bytes` (a larger one is refused with 413 before anything is parsed or kept; up to DRAIN_FACTOR
times the limit is read and dropped first so the client sees the 413) within `request_timeout` seconds (a body
trickled slower than that is a 408, and the connection closes), and replayed to the route. An exception escaping a
route becomes a bare 500 error object; the log gets its type and an escaped message, never a traceback or a request
body.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from nextoken.server.errors import ApiError, error_body
from nextoken.server.metrics import ServerMetrics

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

log = logging.getLogger("nextoken.server")
OPEN_PATHS = frozenset({"/health"})  # reachable without the API key: load balancers probe it
DRAIN_FACTOR = 8  # a refused body up to this many times the limit is read (and dropped) before the 413
REQUEST_TIMEOUT_S = 30.0  # a request's headers, then its body, must each arrive within this long


def escape_for_log(text: str, limit: int = 200) -> str:
    """Control characters (and everything non-ASCII) escaped, so a logged field cannot forge log lines."""
    return text[:limit].encode("ascii", "backslashreplace").decode().replace("\n", "\\n").replace("\r", "\\r")


class GuardMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, metrics: ServerMetrics,
                 is_draining: Callable[[], bool], request_timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.is_draining = is_draining
        self.request_timeout = request_timeout

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        status = [0]  # the status actually sent, for the counter

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            self._check(scope)
            if scope["method"] == "POST":
                try:
                    async with asyncio.timeout(self.request_timeout):
                        receive = await self._buffer_body(scope, receive)
                except TimeoutError:
                    raise ApiError(408, f"the request body did not arrive within {self.request_timeout:g} s",
                                   headers={"Connection": "close"}) from None
            await self.app(scope, receive, send_counted)
        except ApiError as exc:
            if status[0] == 0:
                await _send_error(send_counted, exc)
        except _ClientGone:
            status[0] = 499  # nginx's code for "client closed the request": nothing is sent
        except Exception as exc:  # a bug in nextoken: answer 500 (if nothing was sent yet), log without traceback
            log.error("unhandled %s on %s: %s", type(exc).__name__, escape_for_log(path), escape_for_log(str(exc)))
            if status[0] == 0:
                await _send_error(send_counted, ApiError(500, "internal server error"))
        finally:
            self.metrics.count_request(path, status[0] or 499)

    def _check(self, scope: MutableMapping[str, Any]) -> None:
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            header = _header(scope, b"authorization") or b""
            scheme, _, token = header.partition(b" ")
            # compare_digest on the whole token: its time does not depend on where a guess goes wrong.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                raise ApiError(401, "missing or invalid API key: send the header Authorization: Bearer <key>",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if self.is_draining() and scope["method"] == "POST":
            raise ApiError(503, "the server is shutting down and admits no new requests")

    async def _buffer_body(self, scope: MutableMapping[str, Any], receive: Receive) -> Receive:
        """Read the whole body (bounded) and return a receive that replays it, then passes through."""
        length = _header(scope, b"content-length")
        if length is not None:
            if not length.isdigit():
                raise ApiError(400, "invalid Content-Length header")
            if int(length) > self.max_body_bytes:
                if int(length) <= self.max_body_bytes * DRAIN_FACTOR:
                    await _discard_body(receive, self.max_body_bytes * DRAIN_FACTOR)
                raise _too_large(self.max_body_bytes)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                if more:
                    await _discard_body(receive, self.max_body_bytes * DRAIN_FACTOR - size)
                raise _too_large(self.max_body_bytes)
            chunks.append(chunk)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body exceeds the limit of {limit} bytes", headers={"Connection": "close"})


async def _discard_body(receive: Receive, budget: int) -> None:
    """Read and drop up to `budget` more bytes of a refused body, so that a client still sending it can finish and
    read the 413 (closing on unread data makes the kernel reset the connection first). Never stored."""
    more = True
    while more and budget > 0:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        budget -= len(message.get("body", b""))
        more = message.get("more_body", False)


class _ClientGone(Exception):
    """The client disconnected before its body arrived: there is nobody to answer."""


def _header(scope: MutableMapping[str, Any], name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value)
    return None


async def _send_error(send: Send, exc: ApiError) -> None:
    body = error_body(exc.status, exc.message, param=exc.param, code=exc.code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})

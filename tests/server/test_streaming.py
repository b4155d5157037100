"""EventStream without a server: every event is sent; a client that leaves (while the next event is awaited, or
while a send blocks) or stops reading ends the response quietly and closes the event iterator, which is what
aborts the engine requests behind it; a cancellation from elsewhere still propagates."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from nextoken.server.streaming import EventStream


class Client:
    """The ASGI side: `receive` answers http.disconnect once `leave()` is called; `send` records the body chunks
    and blocks while `blocked` is clear."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()
        self.blocked = asyncio.Event()
        self.blocked.set()
        self.bodies: list[bytes] = []
        self.ended = False

    def leave(self) -> None:
        self.gone.set()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        await asyncio.sleep(0)  # as a socket write lets the loop run others
        await self.blocked.wait()
        if message["type"] == "http.response.body":
            if message["more_body"]:
                self.bodies.append(message["body"])
            else:
                self.ended = True


class Events:
    """An event source that records being closed; after `count` events it waits on `more`."""

    def __init__(self, count: int, then_wait: bool = False) -> None:
        self.count, self.then_wait = count, then_wait
        self.more = asyncio.Event()
        self.closed = False

    async def __call__(self) -> AsyncIterator[bytes]:
        try:
            for i in range(self.count):
                yield f"data: {i}\n\n".encode()
            if self.then_wait:
                await self.more.wait()
        finally:
            self.closed = True


def run(body: Any) -> None:
    asyncio.run(body())


async def started(client: Client, events: Events, sent: int, send_timeout: float = 30.0) -> asyncio.Task[None]:
    """The response under way, once `sent` events have gone out."""
    response = asyncio.ensure_future(EventStream(events(), send_timeout)({}, client.receive, client.send))
    while len(client.bodies) < sent:
        await asyncio.sleep(0.001)
    return response


def test_every_event_is_sent_then_the_end() -> None:
    async def body() -> None:
        client, events = Client(), Events(500)
        await EventStream(events())({}, client.receive, client.send)
        assert client.bodies == [f"data: {i}\n\n".encode() for i in range(500)] and client.ended and events.closed

    run(body)


def test_leaving_while_the_next_event_is_awaited_ends_quietly() -> None:
    async def body() -> None:
        client, events = Client(), Events(3, then_wait=True)
        response = await started(client, events, 3)
        client.leave()
        await asyncio.wait_for(response, 5)  # returns, no CancelledError
        assert events.closed and not client.ended and not response.cancelled()
        await asyncio.sleep(0)  # this task was not left cancelled either

    run(body)


def test_leaving_while_a_send_blocks_ends_quietly() -> None:
    async def body() -> None:
        client, events = Client(), Events(1000)
        response = await started(client, events, 10)
        client.blocked.clear()  # the socket is full
        await asyncio.sleep(0.01)
        client.leave()
        await asyncio.wait_for(response, 5)
        assert events.closed and 10 <= len(client.bodies) < 1000 and not client.ended

    run(body)


def test_a_client_that_stops_reading_is_given_up() -> None:
    async def body() -> None:
        client, events = Client(), Events(1000)
        response = await started(client, events, 10, send_timeout=0.05)
        client.blocked.clear()  # never read again, never disconnects
        await asyncio.wait_for(response, 5)
        assert events.closed and len(client.bodies) < 1000 and not client.ended

    run(body)


def test_a_cancellation_from_elsewhere_propagates() -> None:
    async def body() -> None:
        client, events = Client(), Events(2, then_wait=True)
        response = await started(client, events, 2)
        response.cancel()
        with pytest.raises(asyncio.CancelledError):
            await response
        assert events.closed

    run(body)

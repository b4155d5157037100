"""AsyncEngine: one LLMEngine driven by a background thread, for asyncio callers (the HTTP server).

Invariants: every call into the engine (add, abort, step) happens on the engine thread; callers reach it only through
a command list guarded by a condition variable, processed between steps. The thread steps while any request is
unfinished and otherwise sleeps on the condition (no busy loop). Each caller's requests report to one asyncio.Queue
fed with `loop.call_soon_threadsafe`; a caller that stops listening (break, GeneratorExit, CancelledError) aborts its
requests, which frees their KV blocks in the next pass of the loop. An exception while serving one request fails
that request (or, for a failed forward pass, the requests in the engine at the time) and the loop goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from nextoken.engine.engine import EngineBusy, LLMEngine
from nextoken.engine.request import RequestOutput
from nextoken.errors import NextokenError
from nextoken.sampling_params import SamplingParams

DEBUG_STEPS = 64  # steps /debug/engine keeps

__all__ = ["AsyncEngine", "EngineBusy", "EngineFailure", "EngineStats", "EngineStopped", "RequestStream", "SubRequest"]

log = logging.getLogger("nextoken.engine")


class EngineStopped(NextokenError):
    """The engine is draining or stopped (SIGTERM): no new requests are admitted."""

    http_status = 503


class EngineFailure(NextokenError):
    """The engine failed while serving this request (a bug in nextoken, not the caller's input)."""

    http_status = 500


@dataclass(frozen=True)
class SubRequest:
    """One engine request of a group (a prompt, or one of the `n` choices of a prompt)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    share_prompt_with: str | None = None  # another choice of the same prompt, whose prompt blocks this one takes


@dataclass(frozen=True)
class EngineStats:
    """A snapshot published by the engine thread after each pass, safe to read from any thread."""

    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    num_steps: int = 0
    num_preemptions: int = 0
    num_finished: tuple[tuple[str, int], ...] = ()  # (finish reason, requests ended so far with it)

    @property
    def num_unfinished(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(eq=False)
class _Group:
    """The requests of one caller, all reporting to one queue as (index in the group, output) or an exception."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException]
    requests: Sequence[SubRequest]
    added: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


class RequestStream:
    """(index in the group, RequestOutput) for each step that advanced one of a group's requests, until all finish.

    `close()` (also on leaving `async with`, on an error, or when cancelled while waiting) aborts every request
    not yet finished; closing twice is harmless.
    """

    def __init__(self, engine: AsyncEngine, group: _Group) -> None:
        self._engine = engine
        self._group = group
        self._unfinished = {r.request_id for r in group.requests}

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        try:
            item = await self._group.queue.get()
        except BaseException:  # CancelledError: the consumer went away
            self.close()
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        index, out = item
        if out.finished:
            self._unfinished.discard(out.request_id)
        return index, out

    def close(self) -> None:
        if self._unfinished:
            self._engine.abort(tuple(self._unfinished))
            self._unfinished.clear()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class AsyncEngine:
    """An LLMEngine on its own thread: `add` / `generate` from asyncio, `abort`, `stats`, `shutdown`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[_Group | _Abort] = []  # guarded by _cond
        self._debug: deque[dict[str, Any]] | None = None  # the last steps' views, once /debug/engine asked
        self._debug_snapshot: tuple[dict[str, Any], ...] = ()
        self._stop_thread = False  # guarded by _cond
        self._num_in_hand = 0  # guarded by _cond: commands taken by the engine thread, not yet in `stats`
        self._admitting = True
        self._owners: dict[str, tuple[_Group, int]] = {}  # engine thread only: request id -> (group, index)
        self._num_steps = 0
        self.stats = EngineStats(num_kv_blocks_total=engine.block_manager.num_blocks)
        self._thread = threading.Thread(target=self._run, name="nextoken-engine", daemon=True)

    # --- caller side (any thread, usually the event loop's) ---------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def is_admitting(self) -> bool:
        return self._admitting

    @property
    def is_running(self) -> bool:
        """The engine thread is alive (False before start, after shutdown, or if its loop died)."""
        return self._thread.is_alive()

    async def add(self, requests: Sequence[SubRequest]) -> RequestStream:
        """Admit several requests as one unit and return the stream of their outputs.

        Admission is all or nothing: if one add fails (PromptTooLong, EngineBusy, EngineStopped, ...) the others are
        withdrawn and the error is raised here. A caller cancelled while waiting leaves nothing behind.
        """
        if not self._admitting:
            raise EngineStopped("the server is shutting down and admits no new requests")
        group = _Group(asyncio.get_running_loop(), asyncio.Queue(), list(requests))
        stream = RequestStream(self, group)
        self._submit(group)
        try:
            await asyncio.wrap_future(group.added)
        except BaseException:
            stream.close()  # cancelled after the engine thread took the add: withdraw (harmless otherwise)
            raise
        return stream

    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Run one request, yielding its RequestOutput deltas (the last has `finished` set); add errors are raised
        at the first iteration. Leaving early (break, GeneratorExit, CancelledError) aborts the request."""
        stream = await self.add([SubRequest(request_id, prompt_ids, params)])
        try:
            async for _, out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_ids: Sequence[str]) -> None:
        self._submit(_Abort(tuple(request_ids)))

    async def snapshot(self) -> EngineStats:
        """The latest statistics (`stats`; awaitable, as a remote engine's must be read)."""
        return self.stats

    async def shutdown(self, drain_timeout: float) -> None:
        """Stop admitting, let in-flight requests finish within `drain_timeout` seconds, abort the rest, stop."""
        self._admitting = False
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline and self._thread.is_alive() and (self.stats.num_unfinished or
                                                                            self._has_commands()):
            await asyncio.sleep(0.02)
        with self._cond:
            self._stop_thread = True
            self._cond.notify()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)

    def _has_commands(self) -> bool:
        """Commands not yet reflected in `stats`: queued, or taken by the engine thread and still in hand."""
        with self._cond:
            return bool(self._commands) or self._num_in_hand > 0

    def _submit(self, command: _Group | _Abort) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # --- engine thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug in this loop: fail every caller rather than leave them waiting forever
            log.error("engine loop died (%s); failing all requests", type(exc).__name__)
            self._admitting = False
            with self._cond:
                commands, self._commands = self._commands, []
            for command in commands:
                if isinstance(command, _Group) and command.added.set_running_or_notify_cancel():
                    command.added.set_exception(EngineFailure("the engine stopped unexpectedly"))
            self._abort_all(lambda: EngineFailure("the engine stopped unexpectedly"))

    def _loop(self) -> None:
        busy = False
        while True:
            with self._cond:
                while not self._commands and not self._stop_thread and not self.engine.has_unfinished():
                    # Idle: pending background work is checked on now and then (an idle server would otherwise
                    # hold the weights twice until its first request).
                    self._cond.wait(0.05 if self.engine.idle_work() else None)
                commands, self._commands = self._commands, []
                self._num_in_hand = len(commands)
                stopping = self._stop_thread
            for command in commands:
                if isinstance(command, _Abort):
                    self._abort(command.request_ids)
                else:
                    self._add(command, refuse=stopping or not self._admitting)
            if stopping:
                self._abort_all(lambda: EngineStopped("the server shut down before this request finished"))
                self._publish()
                return
            self._publish()
            with self._cond:
                self._num_in_hand = 0  # their effect is in the stats now: a drain that looks sees them
            if self.engine.has_unfinished():
                self._step()
                busy = True
            if busy and not self.engine.has_unfinished():  # just became idle: a cheap moment to check the books
                self._check_idle()
                busy = False
            self._publish()

    def _add(self, group: _Group, refuse: bool) -> None:
        if not group.added.set_running_or_notify_cancel():
            return  # the caller went away before its requests were added
        added: list[str] = []
        try:
            if refuse:
                raise EngineStopped("the server is shutting down and admits no new requests")
            for index, sub in enumerate(group.requests):
                self.engine.add_request(sub.prompt_ids, sub.params, sub.request_id, sub.share_prompt_with)
                added.append(sub.request_id)
                self._owners[sub.request_id] = (group, index)
        except Exception as exc:  # NextokenError for the caller; anything else is failed the same way, not raised
            self._abort(added)
            group.added.set_exception(exc)
        else:
            group.added.set_result(None)

    def _abort(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._owners.pop(request_id, None)
            self.engine.abort(request_id)

    def _abort_all(self, reason: Callable[[], BaseException]) -> None:
        """Abort every request and send each group its own exception (one instance per raising task)."""
        groups = {id(g): g for g, _ in self._owners.values()}
        self._abort(list(self._owners))
        for group in groups.values():
            self._deliver(group, reason())

    def enable_debug(self) -> None:
        """Keep a view of the last DEBUG_STEPS steps from now on (the server's /debug/engine)."""
        if self._debug is None:
            self.engine.observe_schedule = True
            self._debug = deque(maxlen=DEBUG_STEPS)

    @property
    def debug_steps(self) -> tuple[dict[str, Any], ...]:
        """The last steps' views, oldest first (a snapshot the engine thread replaces after each step)."""
        return self._debug_snapshot

    def _view(self, seconds: float) -> dict[str, Any]:
        """One step as /debug/engine shows it: what ran, who runs and waits, the blocks each holds."""
        engine, scheduler = self.engine, self.engine.scheduler
        return {"step": self._num_steps, "seconds": round(seconds, 6),
                "ran": [{"request": rid, "first": first, "tokens": count}
                        for rid, first, count in engine.last_schedule],
                "running": [{"request": r.request_id, "computed": r.num_computed_tokens, "tokens": r.num_tokens,
                             "prompt_tokens": r.num_prompt_tokens, "blocks": list(r.block_table)}
                            for r in scheduler.running],
                "waiting": [r.request_id for r in scheduler.waiting],
                "free_blocks": engine.block_manager.num_free_blocks, "preemptions": scheduler.num_preemptions}

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a forward-pass failure touches the whole batch: fail what is in the engine
            log.error("engine step failed (%s: %s); failing %d requests", type(exc).__name__,
                      str(exc).encode("unicode_escape").decode()[:200], len(self._owners))
            self._abort_all(lambda: EngineFailure("the engine failed while generating this request"))
            self._abort([r.request_id for r in (*self.engine.scheduler.running, *self.engine.scheduler.waiting)])
            return
        self._num_steps += 1
        if self._debug is not None:
            self._debug.append(self._view(time.perf_counter() - started))
            self._debug_snapshot = tuple(self._debug)
        for out in outputs:
            owner = self._owners.get(out.request_id)
            if owner is None:
                continue  # aborted between the step's start and now
            group, index = owner
            if out.finished:
                del self._owners[out.request_id]
            if out.finish_reason == "error":
                self._abort([r.request_id for r in group.requests])
                own = out.request.error if out.request is not None else None  # the request's own doing: a 400
                self._deliver(group, own or EngineFailure("the engine failed while generating this request"))
            elif not self._deliver(group, (index, out)):
                self._abort([r.request_id for r in group.requests])

    def _deliver(self, group: _Group, item: tuple[int, RequestOutput] | BaseException) -> bool:
        try:
            group.loop.call_soon_threadsafe(group.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
            return False
        return True

    def _check_idle(self) -> None:
        """With nothing running every block must be unreferenced; a leak is logged, not raised (the loop goes on)."""
        try:
            self.engine.block_manager.check_integrity(expected_refs={})
        except AssertionError as exc:
            log.error("KV block bookkeeping is inconsistent at idle: %s", exc)

    def _publish(self) -> None:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        self.stats = EngineStats(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                                 num_kv_blocks_used=blocks.num_used_blocks, num_kv_blocks_total=blocks.num_blocks,
                                 num_steps=self._num_steps, num_preemptions=scheduler.num_preemptions,
                                 num_finished=tuple(sorted(scheduler.num_finished.items())))

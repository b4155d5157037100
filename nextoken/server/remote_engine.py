"""The server's engine when the engines run as Ray Serve replicas: `RemoteEngine` stands where `AsyncEngine` stands in
a single process (`add`, `snapshot`, `shutdown`, ...), `FrontEngine` where `LLMEngine` stands for the text side.

Invariants: the routes, validation, streaming and errors are the single-process server's own (app.py runs
unchanged over these two); a request's admission errors (queue full, shutting down) are raised by `add`, before any
byte is sent, as there; a replica that dies fails the requests it held with `ReplicaDied` (503), never a hang; the
engine statistics are the replicas' summed, counters kept monotonic across replicas that die (`ReplicaStats`).
Only imported when replicas are asked for: it imports Ray.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from nextoken.config import EngineConfig
from nextoken.engine.async_engine import EngineFailure, EngineStats, EngineStopped, SubRequest
from nextoken.engine.inputs import InputProcessor, Limits
from nextoken.engine.request import RequestOutput
from nextoken.errors import NextokenError

AFFINITY_BLOCKS = 8  # prompt blocks whose chained hashes route a request (a prefix of up to 8 blocks is matched)
STALE_S = 3.0  # a replica that has published nothing for this long counts as gone in the gauges


class ReplicaDied(NextokenError):
    """The replica serving a request died (it is being replaced); the request did not complete."""

    http_status = 503


class RemoteFailure(NextokenError):
    """An error a replica raised for a request, carried back with its HTTP status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.http_status = status


def prefix_hashes(prompt_ids: Sequence[int], block_size: int, num_blocks: int = AFFINITY_BLOCKS) -> list[str]:
    """Chained hashes of the prompt's first full blocks (one per block, each covering all blocks before it): two
    prompts sharing k full blocks share their first k hashes, as the replicas' prefix caches share those blocks."""
    hashes: list[str] = []
    digest = hashlib.blake2b(digest_size=8)
    for b in range(min(len(prompt_ids) // block_size, num_blocks)):
        digest.update(b"".join(t.to_bytes(4, "little") for t in prompt_ids[b * block_size:(b + 1) * block_size]))
        hashes.append(digest.copy().hexdigest())
    return hashes


@dataclass(frozen=True)
class _BlockManagerView:
    block_size: int


@dataclass
class FrontEngine:
    """What the routes read from an engine, without its weights: the text side and the replicas' limits."""

    config: EngineConfig
    model_name: str
    max_model_len: int
    model_config: Any  # ModelConfig
    tokenizer: Any  # Tokenizer
    chat_template: Any  # ChatTemplate
    inputs: InputProcessor
    block_manager: _BlockManagerView

    @classmethod
    def build(cls, config: EngineConfig, info: dict[str, Any]) -> FrontEngine:
        """`info`: a replica's `describe()` (its model name, context and KV limits)."""
        from nextoken.loader.text_side import load_text_side
        from nextoken.loader.registry import open_model, resolve_model
        from nextoken.models.config import ModelConfig

        gguf = open_model(resolve_model(config.model))
        model_config = ModelConfig.from_gguf(gguf)
        tokenizer, template = load_text_side(gguf, model_config)
        limits: Limits = info["limits"]
        inputs = InputProcessor(tokenizer, template, model_config.vocab_size, limits, end_ids=model_config.eog_ids)
        return cls(config, info["model_name"], limits.max_model_len, model_config, tokenizer, template, inputs,
                   _BlockManagerView(info["block_size"]))


@dataclass
class ReplicaStats:
    """The replicas' latest snapshots summed: gauges over the live ones, counters over every replica ever seen (a dead
    replica's last totals stay counted, so no counter goes back)."""

    snapshots: dict[str, tuple[float, EngineStats]] = field(default_factory=dict)  # tag -> (time published, stats)

    def total(self, now: float) -> EngineStats:
        live = [s for t, s in self.snapshots.values() if now - t < STALE_S]
        finished: dict[str, int] = {}
        for _, stats in self.snapshots.values():
            for reason, count in stats.num_finished:
                finished[reason] = finished.get(reason, 0) + count
        every = [s for _, s in self.snapshots.values()]
        return EngineStats(num_running=sum(s.num_running for s in live), num_waiting=sum(s.num_waiting for s in live),
                           num_kv_blocks_used=sum(s.num_kv_blocks_used for s in live),
                           num_kv_blocks_total=sum(s.num_kv_blocks_total for s in live),
                           num_steps=sum(s.num_steps for s in every),
                           num_preemptions=sum(s.num_preemptions for s in every),
                           num_finished=tuple(sorted(finished.items())))


def _unwrap(exc: BaseException, replica: str | None) -> NextokenError:
    """A Ray error from a replica call as the NextokenError the server maps to a status."""
    if isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError)):
        where = f" ({replica})" if replica else ""
        return ReplicaDied(f"the replica serving this request{where} died before it completed; it is being "
                           "replaced, retry the request")
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, NextokenError):
        return exc.cause
    return EngineFailure("the engine failed while generating this request")


class RemoteStream:
    """(index in the group, RequestOutput) as a replica streams them; the shape of `RequestStream`. `close()` cancels
    the replica's generator, which aborts the requests not yet finished there."""

    def __init__(self, engine: RemoteEngine, generator: Any, replica: str, request_ids: Sequence[str]) -> None:
        self._engine = engine
        self._generator = generator
        self.replica = replica
        self._unfinished = set(request_ids)
        self._stopped = False  # the server stopped it (shutdown): its reader gets EngineStopped
        engine._open.add(self)

    def __aiter__(self) -> RemoteStream:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if self._stopped:
            self._stopped = False
            raise EngineStopped("the server shut down before this request finished")
        if not self._unfinished:
            self.close()
            raise StopAsyncIteration
        try:
            item = await self._generator.__anext__()
        except StopAsyncIteration:
            self.close()
            raise EngineFailure("the replica ended the stream before its requests finished") from None
        except asyncio.CancelledError:
            self.close()
            raise
        except Exception as exc:
            self.close()
            if self._stopped:  # cancelled by shutdown while waiting
                raise EngineStopped("the server shut down before this request finished") from None
            raise _unwrap(exc, self.replica) from None
        if isinstance(item, RemoteFailure):
            self.close()
            raise item
        index, out = item
        if out.finished:
            self._unfinished.discard(out.request_id)
        return index, out

    def close(self) -> None:
        if self._unfinished:
            self._generator.cancel()
            self._unfinished.clear()
        self._engine._open.discard(self)

    async def __aenter__(self) -> RemoteStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


class RemoteEngine:
    """Requests sent to the replicas through a Ray Serve deployment handle (its request router picks the replica by
    prefix); statistics read from the replicas' board."""

    def __init__(self, handle: Any, board: Any, block_size: int, num_replicas: int) -> None:
        self.num_replicas = num_replicas
        self._handle = handle.options(stream=True)
        self._board = board
        self._block_size = block_size
        self._admitting = True
        self._open: set[RemoteStream] = set()
        self._replica_stats = ReplicaStats()
        self.stats = EngineStats()
        self.replicas: list[dict[str, Any]] = []  # the replicas as last read: tag, pid, last published
        self.debug_steps: tuple[dict[str, Any], ...] = ()

    def start(self) -> None:
        """Nothing to start: the replicas run already (the lifespan calls this as it calls AsyncEngine.start)."""

    @property
    def is_admitting(self) -> bool:
        return self._admitting

    @property
    def is_running(self) -> bool:
        return self._admitting

    async def add(self, requests: Sequence[SubRequest]) -> RemoteStream:
        """Send the group to a replica; its admission errors are raised here, as AsyncEngine.add raises them."""
        if not self._admitting:
            raise EngineStopped("the server is shutting down and admits no new requests")
        requests = list(requests)
        hashes = prefix_hashes(requests[0].prompt_ids, self._block_size) if requests else []
        generator = self._handle.generate.remote(requests, prefix_hashes=hashes)
        try:
            first = await generator.__anext__()
        except asyncio.CancelledError:
            generator.cancel()
            raise
        except Exception as exc:
            raise _unwrap(exc, None) from None
        if isinstance(first, RemoteFailure):
            raise first
        return RemoteStream(self, generator, first, [r.request_id for r in requests])

    async def snapshot(self) -> EngineStats:
        """The replicas' statistics summed, read from the board now."""
        board = await self._board.read.remote()
        for tag, entry in board["replicas"].items():
            self._replica_stats.snapshots[tag] = (entry["published"], entry["stats"])
        now = time.time()
        self.stats = self._replica_stats.total(now)
        self.replicas = [{"replica": tag, "pid": e["pid"], "live": now - e["published"] < STALE_S}
                         for tag, e in sorted(board["replicas"].items())]
        self.debug_steps = tuple(step | {"replica": tag} for tag, e in sorted(board["replicas"].items())
                                 for step in e["debug_steps"])
        return self.stats

    def enable_debug(self) -> None:
        """Ask every replica to keep its last steps (they arrive with their next publications)."""
        self._board.enable_debug.remote()

    async def shutdown(self, drain_timeout: float) -> None:
        """Stop admitting, let the open streams finish within `drain_timeout` seconds, then cancel the rest."""
        self._admitting = False
        deadline = time.monotonic() + drain_timeout
        while self._open and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for stream in list(self._open):
            stream._stopped = bool(stream._unfinished)
            stream.close()

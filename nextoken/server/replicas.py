"""Engine replicas on Ray Serve (`nextoken serve --replicas N [--ray-address ADDR]`): the Ray side.

`EngineReplica` is a Serve deployment of N replicas, each one LLMEngine in an AsyncEngine on `threads` cores; Serve
starts them, health-checks them and replaces one that dies. `PrefixAffinityRouter`, the deployment's request router,
sends a request to the replica that last served its longest known prompt prefix (chained block hashes, so that
replica's prefix cache holds those blocks), unless that replica is busier than the least loaded by more than
`IMBALANCE`; otherwise to the least loaded (fewest requests in flight). Each replica publishes its engine statistics
to a `ReplicaBoard` actor, which /metrics reads. The HTTP side stays nextoken's own app in the `serve` process (the
Ray driver), over `RemoteEngine` (remote_engine.py). `start`, `stop`: Ray and the application, local or joined.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import Any

from nextoken.config import EngineConfig
from nextoken.errors import NextokenError

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica
except ImportError as exc:  # the optional extra is not installed
    raise NextokenError("replicas need Ray Serve: pip install 'nextoken[ray]'") from exc

from nextoken.engine.async_engine import EngineStats, SubRequest
from nextoken.server.remote_engine import FrontEngine, RemoteEngine, RemoteFailure
from nextoken.server.replica_options import ReplicaOptions

APP_NAME = "nextoken"
IMBALANCE = 8  # requests in flight by which the prefix's replica may exceed the least loaded and still be chosen
MAX_PREFIXES = 65536  # prefix hashes the router remembers (least recently used forgotten first)
PUBLISH_EVERY_S = 0.1  # a replica publishes changed statistics this often, and unchanged ones every second
OBJECT_STORE_BYTES = 256 << 20  # a local Ray instance's object store: the requests and outputs are small
log = logging.getLogger("nextoken.server")


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """The replicas' latest statistics by replica tag, and whether /debug/engine asked for their steps."""

    def __init__(self) -> None:
        self.replicas: dict[str, dict[str, Any]] = {}
        self.debug = False

    def publish(self, tag: str, pid: int, stats: EngineStats, debug_steps: tuple[dict[str, Any], ...]) -> bool:
        self.replicas[tag] = {"pid": pid, "stats": stats, "debug_steps": debug_steps, "published": time.time()}
        return self.debug

    def enable_debug(self) -> None:
        self.debug = True

    def read(self) -> dict[str, Any]:
        return {"replicas": self.replicas}


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Prefix-cache affinity, then the least loaded (Serve probes the ranked replicas' queue lengths and takes the
    shortest of the first rank that has room). A prefix seen nowhere goes to the least loaded replica by the cached
    queue lengths, ties to the one holding fewest prefixes, so that different prefixes spread over the replicas."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._owner: OrderedDict[str, Any] = OrderedDict()  # prefix hash -> the replica id that last served it
        self._num_owned: Counter[Any] = Counter()  # replica id -> prefix hashes it owns

    def _hashes(self, pending_request: PendingRequest | None) -> list[str]:
        if pending_request is None:
            return []
        return list(pending_request.kwargs.get("prefix_hashes") or [])

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hashes = self._hashes(pending_request)
        if not hashes or len(candidate_replicas) < 2:  # shuffled: equal queue lengths tie to either replica
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        by_id = {r.replica_id: r for r in candidate_replicas}
        load = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas}
        for h in reversed(hashes):  # the longest shared prefix first
            owner = by_id.get(self._owner[h]) if h in self._owner else None
            if owner is not None:
                if load[owner.replica_id] <= min(load.values()) + IMBALANCE:
                    return [[owner], candidate_replicas]
                break
        best = min(candidate_replicas, key=lambda r: (load[r.replica_id], self._num_owned[r.replica_id]))
        return [[best], candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        for h in self._hashes(pending_request):
            previous = self._owner.get(h)
            if previous is not None:
                self._num_owned[previous] -= 1
            self._owner[h] = replica_id
            self._owner.move_to_end(h)
            self._num_owned[replica_id] += 1
        while len(self._owner) > MAX_PREFIXES:
            self._num_owned[self._owner.popitem(last=False)[1]] -= 1

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        for h in [h for h, owner in self._owner.items() if owner == replica_id]:
            del self._owner[h]
        self._num_owned.pop(replica_id, None)


@serve.deployment(name="engine", max_ongoing_requests=100_000, health_check_period_s=2, health_check_timeout_s=10,
                  graceful_shutdown_timeout_s=5, logging_config={"log_level": "WARNING", "enable_access_log": False},
                  request_router_config=RequestRouterConfig(
                      request_router_class=PrefixAffinityRouter))  # type: ignore[arg-type]
class EngineReplica:
    """One engine: `describe()` for the server's text side, `generate(requests)` streams a group's outputs."""

    async def __init__(self, config: EngineConfig, board: Any) -> None:  # type: ignore[misc]
        from nextoken.engine.async_engine import AsyncEngine
        from nextoken.engine.engine import LLMEngine

        self.engine = await asyncio.to_thread(LLMEngine, config)
        self.async_engine = AsyncEngine(self.engine)
        self.async_engine.start()
        self.board = board
        self.tag = serve.get_replica_context().replica_id.unique_id
        self._publisher = asyncio.create_task(self._publish_loop())

    async def describe(self) -> dict[str, Any]:
        return {"model_name": self.engine.model_name, "limits": self.engine.inputs.limits,
                "block_size": self.engine.block_manager.block_size}

    async def generate(self, requests: list[SubRequest], prefix_hashes: list[str] | None = None) -> Any:
        """First the replica's tag (or a RemoteFailure: not admitted), then (index, output) per output."""
        from nextoken.engine.async_engine import EngineStopped

        try:
            stream = await self.async_engine.add(requests)
        except NextokenError as exc:
            yield RemoteFailure(str(exc), exc.http_status)
            return
        yield self.tag
        async with stream:
            try:
                async for index, out in stream:
                    yield index, _portable(out)
            except NextokenError as exc:
                if isinstance(exc, EngineStopped):
                    exc = EngineStopped(f"replica {self.tag} is stopping: {exc}")
                yield RemoteFailure(str(exc), exc.http_status)

    async def check_health(self) -> None:
        if not self.async_engine.is_running:
            raise RuntimeError("the engine thread is not running")

    async def _publish_loop(self) -> None:
        last: tuple[EngineStats, int] | None = None
        last_at = 0.0
        while True:
            stats = self.async_engine.stats
            steps = self.async_engine.debug_steps
            if (stats, len(steps)) != last or time.monotonic() - last_at > 1.0:
                try:
                    debug = await self.board.publish.remote(self.tag, os.getpid(), stats, steps)
                except Exception:  # the board is gone (shutting down): try again later
                    debug = False
                if debug:
                    self.async_engine.enable_debug()
                last, last_at = (stats, len(steps)), time.monotonic()
            await asyncio.sleep(PUBLISH_EVERY_S)

    async def __del__(self) -> None:
        self._publisher.cancel()
        await self.async_engine.shutdown(0.0)


def _portable(out: Any) -> Any:
    """A RequestOutput whose request (kept for its totals) is reduced to what the server reads of it: a Request holds
    a grammar's matcher and the engine's bookkeeping, which need not travel."""
    if out.request is None:
        return out
    r = out.request
    view = _RequestView(prompt_token_logprobs=r.prompt_token_logprobs, prompt_logprobs=r.prompt_logprobs,
                        beams=r.beams, timings=r.timings, output_ids=list(r.output_ids))
    return replace(out, request=view)


@dataclass(frozen=True)
class _RequestView:
    prompt_token_logprobs: Any
    prompt_logprobs: Any
    beams: Any
    timings: Any
    output_ids: list[int]


@dataclass
class Deployed:
    """A running application: its handle, the board, and whether this process started Ray (and so stops it)."""

    handle: Any
    board: Any
    local_ray: bool


def start(config: EngineConfig, options: ReplicaOptions) -> Deployed:
    """Start (or join) Ray, deploy the replicas and wait until they are ready."""
    options.check()
    threads = options.threads_per_replica()
    local = options.ray_address is None
    logging.getLogger("ray.serve").setLevel(logging.WARNING)  # Serve's start-up chatter; its warnings stay
    if local:
        ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
                 object_store_memory=OBJECT_STORE_BYTES, _node_ip_address="127.0.0.1", logging_level=logging.WARNING,
                 configure_logging=True, log_to_driver=True)
    else:
        try:
            ray.init(address=options.ray_address, logging_level=logging.WARNING, log_to_driver=True)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise NextokenError(f"could not join the Ray cluster at --ray-address {options.ray_address!r}: "
                                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    try:
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        board = ReplicaBoard.options(  # type: ignore[attr-defined]
            name=f"{APP_NAME}-board", get_if_exists=False).remote()
        replica_config = replace(config, threads=threads)
        app = EngineReplica.options(num_replicas=options.num_replicas,  # type: ignore[attr-defined]
                                    ray_actor_options={"num_cpus": threads}).bind(replica_config, board)
        handle = serve.run(app, name=APP_NAME, route_prefix=None)
    except BaseException:
        stop(Deployed(None, None, local))
        raise
    return Deployed(handle, board, local)


def stop(deployed: Deployed) -> None:
    """Delete the application; on a local instance shut Serve and Ray down too (no Ray process is left)."""
    try:
        if deployed.local_ray:
            serve.shutdown()
        else:
            serve.delete(APP_NAME)
    except Exception as exc:  # stopping goes on: Ray's own shutdown ends what is left
        log.warning("stopping the replicas: %s", type(exc).__name__)
    ray.shutdown()


def serve_replicas(config: EngineConfig, options: ReplicaOptions,
                   run: Callable[[FrontEngine, RemoteEngine], int]) -> int:
    """Deploy the replicas, then `run` the server over them (the text side loaded here, the limits read from a
    replica); Ray and the application are stopped however `run` ends."""
    deployed = start(config, options)
    try:
        info = deployed.handle.describe.remote().result()
        front = FrontEngine.build(config, info)
        remote = RemoteEngine(deployed.handle, deployed.board, info["block_size"], options.num_replicas)
        return run(front, remote)
    finally:
        stop(deployed)

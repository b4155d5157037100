"""`nextoken serve --replicas 2 --threads 1`: two engine replicas on a local Ray instance behind one endpoint.

The single-process server's own API, error and lifecycle tests run here unchanged against it (imported below; this
module's `server` fixture stands in for conftest's). Then what only replicas have: 64 concurrent streams spread
over both replicas, each with its greedy output alone; prefix-cache affinity (requests sharing a long prefix land on
the replica that served it); /metrics summing the replicas; a replica killed with SIGKILL mid-load, whose streams
end with an error naming the dead replica while the other's complete, and which Ray Serve replaces. The fixture stops
the server and checks that no process it started (Ray's included) is left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess, metric, wait_idle
from tests.server.test_api import (  # noqa: F401  (run here against the replicas)
    test_chat_non_streaming_equals_streaming,
    test_completion_matches_stream_and_usage,
    test_echo_scores_the_prompt,
    test_logprobs,
    test_models_lists_the_served_model,
    test_n_choices_are_indexed_and_seeded,
    test_stop_string_cuts_the_text,
    test_tokenize_messages_matches_chat_usage,
)
from tests.server.test_errors import (  # noqa: F401
    test_body_over_the_limit_is_413,
    test_invalid_chat_fields_are_400_naming_the_field,
    test_malformed_bodies_are_small_400s,
    test_unknown_model_is_404,
)
from tests.server.test_lifecycle import test_client_leaving_a_non_streaming_request_aborts_it  # noqa: F401

pytest.importorskip("ray.serve", reason="replicas need the ray extra: pip install 'nextoken[ray]'")

REPLICA = "x-nextoken-replica"
PROMPTS = ["the cat sat on the mat", "hello there", "in the beginning", "seven seas", "on at en", "a"]


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tiny_model: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """The replicated server; stopped (SIGINT) at the end, then no process it started may be left."""
    proc = ServerProcess(str(tiny_model), "--kv-cache-bytes", str(16 << 20), "--replicas", "2", "--threads", "1",
                         log_dir=server_logs, wait=False)
    started: set[int] = set()
    try:
        proc.wait_ready(timeout=120)
        yield proc
    finally:
        started |= _descendants(proc.proc.pid)
        code = proc.stop()
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p for p in started if _alive(p)]
        for pid in left:  # never leave them running, even when the test below fails
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left after the server stopped: {left}"
    assert code in (0, 130), proc.log.read_text()[-3000:]  # Ctrl+C's status, as the single-process server's


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)


def _settled(server: ServerProcess, name: str, quiet_s: float = 1.5, timeout_s: float = 20.0) -> float:
    """A metric once it has not changed for quiet_s: the replicas publish to the board every 0.1 s when something
    changed and every second regardless, so a value that held for longer than that is what the replicas hold."""
    value, since = metric(server, name), time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"{name} still changing after {timeout_s} s"
        time.sleep(0.1)
        now = metric(server, name)
        if now != value:
            value, since = now, time.monotonic()
    return value


def _replicas(server: ServerProcess) -> list[dict[str, Any]]:
    return list(httpx.get(server.url + "/debug/engine", timeout=10).json()["replicas"])


async def _stream(http: httpx.AsyncClient, server: ServerProcess, body: dict[str, Any],
                  started: asyncio.Event | None = None) -> tuple[str, str, Any]:
    """(replica, text, error object or None) of one streamed completion; `started` is set once its response began."""
    text, error = [], None
    async with http.stream("POST", server.base_url + "/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        if started is not None:
            started.set()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
            else:
                text.append(event["choices"][0]["text"])
    return r.headers[REPLICA], "".join(text), error


def test_64_concurrent_streams_spread_over_the_replicas(server: ServerProcess) -> None:
    params: dict[str, Any] = dict(model=server.model, max_tokens=16, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            alone = {}
            for prompt in PROMPTS:
                r = await http.post(server.base_url + "/completions", json={**params, "prompt": prompt})
                alone[prompt] = r.json()["choices"][0]["text"]
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
            results = await asyncio.gather(*(_stream(http, server, {**params, "prompt": p}) for p in prompts))
        assert [text for _, text, _ in results] == [alone[p] for p in prompts]
        assert all(error is None for _, _, error in results)
        assert len({replica for replica, _, _ in results}) == 2  # the least loaded takes the short prompts

    asyncio.run(run())
    wait_idle(server)


def test_requests_sharing_a_prefix_go_to_the_replica_that_holds_it(server: ServerProcess) -> None:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    served: dict[int, set[str]] = {}
    for k in range(6):
        prefix = " ".join(words[(k + i) % len(words)] for i in range(150))  # well over 8 blocks of 16 tokens
        for suffix in (" first question", " second question", " third"):
            r = httpx.post(server.base_url + "/completions", timeout=30,
                           json={"model": server.model, "prompt": prefix + suffix, "max_tokens": 2})
            assert r.status_code == 200, r.text
            served.setdefault(k, set()).add(r.headers[REPLICA])
    assert all(len(replicas) == 1 for replicas in served.values()), served
    assert len(set().union(*served.values())) == 2  # different prefixes still use both replicas


def test_metrics_sum_the_replicas(server: ServerProcess) -> None:
    wait_idle(server)
    name = 'nextoken_requests_finished_total{reason="length"}'
    before = _settled(server, name)  # the earlier tests' last requests may still be on their way to the board
    replicas = set()
    for i in range(8):  # distinct long prefixes: spread over both replicas by the router
        prompt = " ".join(f"count {i} {j}" for j in range(60))
        r = httpx.post(server.base_url + "/completions", timeout=30,
                       json={"model": server.model, "prompt": prompt, "max_tokens": 3, "ignore_eos": True})
        replicas.add(r.headers[REPLICA])
    assert len(replicas) == 2
    deadline = time.monotonic() + 10
    while metric(server, name) - before < 8 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _settled(server, name) - before == 8
    live = [r for r in _replicas(server) if r["live"]]
    assert len(live) == 2 and metric(server, "nextoken_kv_blocks_total") > 0


def test_a_replica_killed_mid_load_fails_its_streams_clearly_and_is_replaced(server: ServerProcess) -> None:
    wait_idle(server)
    pids = {r["replica"]: r["pid"] for r in _replicas(server) if r["live"]}
    assert len(pids) == 2
    body = {"model": server.model, "max_tokens": 400, "temperature": 0, "ignore_eos": True}

    async def run() -> list[tuple[str, str, Any]]:
        async with httpx.AsyncClient(timeout=60) as http:
            started = [asyncio.Event() for _ in range(8)]
            tasks = [asyncio.ensure_future(_stream(http, server, {**body, "prompt": PROMPTS[i % 6]}, started[i]))
                     for i in range(8)]
            async with asyncio.timeout(30):  # all admitted and streaming (a replica killed before a response
                await asyncio.gather(*(event.wait() for event in started))  # began answers 503 instead)
            victim = sorted(pids)[0]
            os.kill(pids[victim], signal.SIGKILL)
            async with asyncio.timeout(60):  # never a hang (the survivors' 400 tokens, on a busy machine too)
                return list(await asyncio.gather(*tasks))

    results = asyncio.run(run())
    victim = sorted(pids)[0]
    failed = [r for r in results if r[0] == victim]
    assert failed and all(e is not None and "replica" in e["message"] and e["type"] == "service_unavailable"
                          for _, _, e in failed)
    assert all(e is None for replica, _, e in results if replica != victim)
    # Ray Serve starts a new replica; requests succeed meanwhile and after.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = httpx.post(server.base_url + "/completions", timeout=30,
                       json={"model": server.model, "prompt": "after", "max_tokens": 2})
        assert r.status_code == 200, r.text
        live = {x["replica"] for x in _replicas(server) if x["live"]}
        if len(live) == 2 and victim not in live:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the killed replica was not replaced: {_replicas(server)}")
    wait_idle(server, timeout=15)

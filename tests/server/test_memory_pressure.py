"""Memory pressure on a real server: a KV pool of eight blocks (128 tokens) and six concurrent requests of about 70
tokens each, every one of which fits alone. Running requests are preempted (and recomputed) to make room, which
/metrics counts, and every request still answers exactly what it answers alone; afterwards the server is idle with
every block free."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import ServerProcess, canary, metric, wait_idle

BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 kv heads, head dim 16, fp32, 16 tokens a block
PROMPTS = ["the cat sat on", "hello there", "seven seas on at en", "a b c d e", "under an old grey sky", "zz"]


def _answer(server: ServerProcess, body: dict[str, Any]) -> list[str]:
    body = {"model": server.model, **body}
    if not body.get("stream"):
        response = httpx.post(server.base_url + "/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return [c["text"] for c in response.json()["choices"]]
    texts = [""] * body.get("n", 1)
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=120) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in map(json.loads, events[:-1]):
        assert "error" not in event, event
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    return texts


def test_preemption_under_a_tiny_kv_pool_keeps_every_answer(tiny_model: Path,
                                                            spawn_server: Callable[..., ServerProcess]) -> None:
    server = spawn_server(str(tiny_model), "--kv-cache-bytes", str(8 * BLOCK_BYTES), "--threads", "1")
    assert metric(server, "nextoken_kv_blocks_total") == 8
    bodies = [{"prompt": p, "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1}
              for i, p in enumerate(PROMPTS)]
    alone = [_answer(server, body) for body in bodies]
    alone_canary = canary(server)
    assert metric(server, "nextoken_preemptions_total") == 0  # one at a time, each fits

    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda body: _answer(server, body), bodies))
    assert together == alone
    assert metric(server, "nextoken_preemptions_total") > 0
    wait_idle(server)
    assert canary(server) == alone_canary

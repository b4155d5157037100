"""Speculative decoding through the whole server in-process (tests/server/test_faults.py's App), by n-gram and by a
draft model: a batch of completions, greedy, seeded, streamed, with log-probabilities and stop strings, answers what
a server without speculation answers, every KV block comes back (the draft's too), and /metrics counts the proposed
and accepted tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from nextoken.config import EngineConfig
from nextoken.engine.engine import LLMEngine
from tests.server.test_faults import App, _text

BODIES = [
    {"prompt": "the the the the the the", "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    {"prompt": "on at en on at en on at en", "max_tokens": 24, "temperature": 0.8, "seed": 5, "ignore_eos": True},
    {"prompt": "seven seas", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 3, "stop": ["qz"]},
    {"prompt": "a a a a", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True},
]


def start(tiny_llama: Path, **options: Any) -> App:
    """The tiny model served in-process, its engine thread started; a speculator verifies every proposal (the tiny
    model's steps cost next to nothing)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", kv_cache_bytes=4 << 20,
                                    threads=1, **options))
    if engine.speculator is not None:
        engine.speculator.adaptive = False
    served = App(engine)
    served.state.async_engine.start()
    return served


def _serve(tiny_llama: Path, **options: Any) -> list[tuple[int, Any]] | tuple[list[tuple[int, Any]], str]:
    served = start(tiny_llama, **options)
    engine = served.engine
    try:
        results = served.run(*BODIES)

        async def metrics() -> str:
            transport = httpx.ASGITransport(app=served.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
                return (await http.get("/metrics")).text

        text = asyncio.run(metrics())
    finally:
        asyncio.run(served.state.async_engine.shutdown(0))
    engine.block_manager.check_integrity(expected_refs={})
    draft = engine.speculator.draft if engine.speculator is not None else None
    assert draft is None or draft.blocks.num_used_blocks == 0
    return results, text


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculation_answers_as_plain_decoding_and_is_counted(tiny_llama: Path, proposer: str) -> None:
    plain, plain_metrics = _serve(tiny_llama)
    speculative = "ngram" if proposer == "ngram" else f"draft:{tiny_llama}"
    spec, spec_metrics = _serve(tiny_llama, speculative=speculative, num_speculative_tokens=4)
    for a, b in zip(plain, spec, strict=True):
        want, got = _text(a), _text(b)
        if isinstance(want, str):  # a stream's text
            assert got == want
            continue
        for (text, logprobs, reason), (text2, logprobs2, reason2) in zip(want, got, strict=True):
            assert (text2, reason2) == (text, reason)
            if logprobs is not None:  # the same tokens; a log-probability's last bits may move with the pass's rows
                assert logprobs2["tokens"] == logprobs["tokens"]
                assert all(abs(x - y) < 1e-5 for x, y in zip(logprobs["token_logprobs"], logprobs2["token_logprobs"]))
    assert _sample(plain_metrics, "nextoken_spec_proposed_tokens_total") == 0
    proposed = _sample(spec_metrics, "nextoken_spec_proposed_tokens_total")
    accepted = _sample(spec_metrics, "nextoken_spec_accepted_tokens_total")
    assert proposed >= accepted > 0
    assert _sample(spec_metrics, "nextoken_spec_mean_accepted_length_count") >= 1

"""Speculative decoding under combinations of the generation options, drawn by hypothesis: batches of greedy and seeded
completions with n, echo, logprobs, stop strings and token ids, penalties, min_tokens, logit_bias and ignore_eos,
streamed or whole, sent at once to a server that speculates (by n-gram, a draft model or its own cut head; every
proposal verified) and to one without speculation. Each answers the same texts and finish reasons, log-probabilities
within 1e-4 (a verifying pass's rows may round apart from single rows in their last bits), and both end with every KV
block free."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.test_faults import App
from tests.server.test_speculative_api import start

# Repetitive prompts: n-gram lookup finds something to propose.
PROMPTS = ["the the the the the the", "on at en on at en on at en", "a b c a b c a b", [5, 9, 5, 9, 5, 9, 5], "seven"]


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> Iterator[App]:
    served = start(tiny_llama)
    yield served
    asyncio.run(served.state.async_engine.shutdown(0))


@pytest.fixture(params=["ngram", "draft", "head:64"])
def spec(request: pytest.FixtureRequest, tiny_llama: Path) -> Iterator[App]:
    """A server proposing by n-gram lookup, by a draft model (the same tiny file) or by its own cut head."""
    speculative = f"draft:{tiny_llama}" if request.param == "draft" else request.param
    served = start(tiny_llama, speculative=speculative, num_speculative_tokens=4)
    yield served
    asyncio.run(served.state.async_engine.shutdown(0))


@st.composite
def body(draw: st.DrawFn) -> dict[str, Any]:
    max_tokens = draw(st.sampled_from([1, 6, 16]))
    out: dict[str, Any] = {
        "prompt": draw(st.sampled_from(PROMPTS)), "n": draw(st.integers(1, 2)), "max_tokens": max_tokens,
        "temperature": draw(st.sampled_from([0.0, 0.8])), "seed": draw(st.sampled_from([None, 5])),
        "stream": draw(st.booleans())}
    for name, values in (("echo", [True]), ("logprobs", [0, 2]), ("stop", [["e"], ["on a"]]),
                         ("stop_token_ids", [[9]]), ("presence_penalty", [0.6]), ("frequency_penalty", [0.8]),
                         ("repetition_penalty", [1.2]), ("min_tokens", [min(3, max_tokens)]),
                         ("logit_bias", [{"5": 3.0}]), ("ignore_eos", [True]), ("top_k", [4]), ("top_p", [0.9])):
        if draw(st.booleans()):
            out[name] = draw(st.sampled_from(values))
    if out["temperature"] and out["seed"] is None:
        out["seed"] = 7  # answers fixed by their seeds
    return out


def answers(results: list[tuple[int, Any]]) -> list[Any]:
    """Each request's choices: (index, text, finish reason, token log-probabilities), a stream's gathered."""
    out = []
    for status, payload in results:
        assert status == 200, payload
        if isinstance(payload, list):  # a stream's events
            assert payload[-1] == "[DONE]"
            choices: dict[int, list[Any]] = {}
            for event in payload[:-1]:
                for c in event["choices"]:
                    entry = choices.setdefault(c["index"], ["", None, []])
                    entry[0] += c["text"]
                    entry[1] = c["finish_reason"] or entry[1]
                    entry[2] += (c.get("logprobs") or {}).get("token_logprobs", [])
            out.append(sorted((i, *entry) for i, entry in choices.items()))
        else:
            out.append([(c["index"], c["text"], c["finish_reason"], (c["logprobs"] or {}).get("token_logprobs", []))
                        for c in payload["choices"]])
    return out


def close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all((x is None) == (y is None) and (x is None or abs(x - y) < 1e-4)
                                    for x, y in zip(a, b))


def test_speculation_answers_as_plain_decoding_in_every_combination(plain: App, spec: App) -> None:
    @given(bodies=st.lists(body(), min_size=1, max_size=4))
    @settings(max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def check(bodies: list[dict[str, Any]]) -> None:
        expected, got = answers(plain.run(*bodies)), answers(spec.run(*bodies))
        for sent, want, have in zip(bodies, expected, got):
            assert [c[:3] for c in have] == [c[:3] for c in want], sent
            assert all(close(h[3], w[3]) for h, w in zip(have, want)), sent
        for served in (plain, spec):
            served.engine.block_manager.check_integrity(expected_refs={})

    check()
    counted = spec.state.metrics  # the server's counters: proposals were made, and kept
    assert counted.spec_proposed._value.get() > 100 and counted.spec_accepted._value.get() > 0

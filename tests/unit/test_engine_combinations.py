"""Continuous batching's promise, drawn by hypothesis: batches of requests with shared prefixes (prefix-cache hits),
prompts longer than a step's token budget (chunked prefill), a KV pool too small for all of them (preemption),
choices sharing their prompt's blocks, aborts at random steps, n-gram speculation or none, and every mix of greedy
and seeded sampling, stop strings and token ids, penalties, min_tokens, logit_bias and log-probabilities. Every
request that is not aborted answers exactly what it answers alone on a roomy engine (tokens, finish reason;
log-probabilities within 1e-5), and once the batch is done every block is free and the block manager's books balance."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nextoken.config import EngineConfig
from nextoken.engine.engine import LLMEngine
from nextoken.sampling_params import SamplingParams

DOCUMENT = [(7 * i + 3) % 250 + 3 for i in range(64)]  # the start many prompts share
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # the tiny Llama's KV block of 16 tokens, fp32 (tests/tiny.py)
seen: Counter[str] = Counter()


def engine(path: Path, **options: Any) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu", threads=1, **options))
    eng.runner.settle()  # no copy onto huge pages left running behind the test
    return eng


@pytest.fixture(scope="module")
def roomy(tiny_llama: Path) -> LLMEngine:
    """One request at a time, no prefix cache."""
    return engine(tiny_llama, kv_cache_bytes=8 << 20, enable_prefix_caching=False)


@pytest.fixture(params=[None, "ngram"])
def tight(request: pytest.FixtureRequest, tiny_llama: Path) -> LLMEngine:
    """8 blocks of 16 tokens, a 24-token step budget; with n-gram speculation, every proposal verified."""
    if request.param is None:
        return engine(tiny_llama, kv_cache_bytes=8 * BLOCK_BYTES, max_num_batched_tokens=24)
    eng = engine(tiny_llama, kv_cache_bytes=8 * BLOCK_BYTES, max_num_batched_tokens=24, speculative=request.param,
                 num_speculative_tokens=4)
    assert eng.speculator is not None
    eng.speculator.adaptive = False
    return eng


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[int], SamplingParams, int | None, int]:
    """(prompt, params, the step to abort it at or None, how many choices share the prompt)."""
    shared = draw(st.sampled_from([0, 0, 16, 20, 40]))
    prompt = DOCUMENT[:shared] + draw(st.lists(st.integers(3, 255), min_size=1, max_size=30))
    temperature = draw(st.sampled_from([0.0, 0.9]))
    max_tokens = draw(st.integers(1, 24))
    extra: dict[str, Any] = {}
    for name, values in (("stop", [("e",), ("th", "a")]), ("stop_token_ids", [(9,), (40, 41)]),
                         ("presence_penalty", [0.7]), ("frequency_penalty", [0.5]), ("repetition_penalty", [1.3]),
                         ("min_tokens", [min(4, max_tokens)]), ("logit_bias", [{5: 4.0}]), ("ignore_eos", [True]),
                         ("logprobs", [0, 3]), ("top_k", [3]), ("top_p", [0.8])):
        if draw(st.booleans()):
            extra[name] = draw(st.sampled_from(values))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                            seed=draw(st.integers(0, 99)) if temperature else None, **extra)
    abort_at = draw(st.sampled_from([None, None, None, 0, 1, 3, 6]))
    return prompt, params, abort_at, draw(st.sampled_from([1, 1, 2]))


def answer(outputs: dict[str, Any], rid: str) -> tuple[list[int], str | None, list[float]]:
    req = outputs[rid].request
    return list(req.output_ids), req.finish_reason, [lp[0] for lp in req.logprobs]


def run(eng: LLMEngine, batch: list[tuple[list[int], SamplingParams, int | None, int]]) -> dict[str, Any]:
    """The batch added at once (choices sharing their prompt), stepped to the end with its aborts: the last output
    of each request that was not aborted."""
    aborts: dict[int, list[str]] = {}
    ids: list[list[str]] = []
    for i, (prompt, params, abort_at, choices) in enumerate(batch):
        group: list[str] = []
        for c in range(choices):
            group.append(eng.add_request(prompt, params, f"r{i}-{c}", share_prompt_with=group[0] if group else None))
        ids.append(group)
        if abort_at is not None:
            aborts.setdefault(abort_at, []).extend(group)
    last: dict[str, Any] = {}
    step, preempted = 0, eng.scheduler.num_preemptions
    while eng.has_unfinished():
        for rid in aborts.pop(step, []):
            eng.abort(rid)
        for out in eng.step():
            last[out.request_id] = out
        step += 1
        assert step < 2000, "the batch never finished"
    seen["preemptions"] += eng.scheduler.num_preemptions - preempted
    return {rid: out for rid, out in last.items() if out.finished and out.finish_reason != "abort"}


def test_every_request_answers_as_it_does_alone(roomy: LLMEngine, tight: LLMEngine) -> None:
    seen.clear()

    @given(batch=st.lists(requests(), min_size=1, max_size=6))
    @settings(max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def check(batch: list[tuple[list[int], SamplingParams, int | None, int]]) -> None:
        together = run(tight, batch)
        for i, (prompt, params, abort_at, choices) in enumerate(batch):
            if abort_at is not None:
                continue
            for c in range(choices):
                alone = run(roomy, [(prompt, params, None, 1)])
                want = answer(alone, "r0-0")
                got = answer(together, f"r{i}-{c}")
                assert got[:2] == want[:2], (prompt, params)
                assert len(got[2]) == len(want[2]) and all(abs(a - b) < 1e-5 for a, b in zip(got[2], want[2]))
            seen["compared"] += choices
        for eng in (tight, roomy):
            eng.block_manager.check_integrity(expected_refs={})
            assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks

    check()
    assert seen["compared"] > 100 and seen["preemptions"] > 0, dict(seen)  # the pool was too small at times

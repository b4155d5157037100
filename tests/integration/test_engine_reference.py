"""The whole engine on the real default model (SmolLM2-135M, fp32) against the transformers reference.

Batching, chunked prefill, prefix caching and block sharing must not change a single greedy token: every reference
prompt's 48-token continuation (tests/data/reference/smollm2/hf.json) comes out identical while 64 requests of mixed
lengths run together with a 256-token step budget and the prefix cache on, and the engine ends idle with every
block free. A second request sharing a ~1,000-token prefix reaches its first token at least 5 times sooner.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from nextoken import LLM, SamplingParams
from nextoken.engine.request import Request
from tests.conftest import load_reference, real_llm

REFERENCE = load_reference("smollm2", "hf.json")
PROMPTS = REFERENCE["prompts"]
EOG_IDS = frozenset(REFERENCE["meta"]["eog_ids"])
STEP_BUDGET = 256  # max_num_batched_tokens: prompts longer than this are computed in chunks
KV_BYTES = 256 << 20  # 46,080 bytes per token in fp32: about 5,800 tokens, room for all 64 requests at once


@dataclass
class Job:
    name: str
    prompt_ids: list[int]
    max_tokens: int
    expected_ids: list[int] | None  # from the reference; None for requests that are only there as load
    expected_finish: str | None = None


def _reference_job(name: str, prompt: dict, start: int, max_tokens: int) -> Job:
    """The reference prompt followed by the first `start` tokens of its greedy continuation: greedy decoding must
    continue with the reference's next tokens (its teacher-forced argmax equals its greedy output everywhere)."""
    greedy = prompt["greedy_ids"]
    expected = greedy[start:start + max_tokens]
    ends_on_eog = prompt["stopped_on_eog"] and start + max_tokens >= len(greedy)
    return Job(name, prompt["hf_ids"] + greedy[:start], max_tokens, expected, "stop" if ends_on_eog else "length")


def mixed_workload() -> list[Job]:
    """64 requests: 25 cut from one 430-token document (chunked prefill, prefix hits on each other), the 13 reference
    prompts (48 tokens), each again (16 tokens; its prompt blocks mostly cached by then), and each continued from the
    middle of its reference output (prefix hits on the first copy's prompt blocks). The long prompts come first, so
    that their chunks are computed while few requests decode beside them: mixed steps are the slow ones on CPU."""
    document = [t for p in PROMPTS for t in p["hf_ids"]]
    jobs = [Job(f"document[:{40 + 20 * i}]", document[:40 + 20 * i], 16, None) for i in range(20)]
    for i in range(5):  # from the middle: the same tokens as other requests' later blocks, at position 0
        start = 16 * (3 + 5 * i)
        jobs.append(Job(f"document[{start}:]", document[start:start + 96], 16, None))
    jobs += [_reference_job(p["id"], p, 0, REFERENCE["meta"]["gen_max_new_tokens"]) for p in PROMPTS]
    jobs += [_reference_job(p["id"] + "/again", p, 0, 16) for p in PROMPTS]
    for p in PROMPTS:
        start = len(p["greedy_ids"]) // 2
        jobs.append(_reference_job(p["id"] + "/continued", p, start, min(16, len(p["greedy_ids"]) - start)))
    assert len(jobs) == 64
    return jobs


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def chunked() -> Iterator[tuple[LLM, list[str]]]:
    """The default model with a small step budget (chunked prefill) and a pool for 64 requests; the log lines its
    start wrote."""
    records = _Records()
    logger = logging.getLogger("nextoken")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_bytes=KV_BYTES,
                  max_num_batched_tokens=STEP_BUDGET, enable_prefix_caching=True)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    yield llm, records.messages


@pytest.mark.slow
def test_reference_outputs_unchanged_among_64_concurrent_requests(chunked: tuple[LLM, list[str]]) -> None:
    llm, _ = chunked
    engine = llm.engine
    jobs = mixed_workload()
    ids = {engine.add_request(job.prompt_ids, SamplingParams(temperature=0, max_tokens=job.max_tokens)): job
           for job in jobs}
    done: dict[str, Request] = {}
    max_running = num_split_chunks = num_steps = 0
    while engine.has_unfinished():
        num_steps += 1
        assert num_steps < 2_000, "the engine stopped making progress"
        before = {id(r): r.num_computed_tokens for r in engine.scheduler.running}
        for out in engine.step():
            if out.finished and out.request is not None:
                done[out.request_id] = out.request
        max_running = max(max_running, len(engine.scheduler.running))
        # A prompt whose computed count moved but stopped short of its end was split across steps.
        num_split_chunks += sum(1 for r in engine.scheduler.running
                                if 0 < r.num_computed_tokens < r.num_prompt_tokens
                                and r.num_computed_tokens != before.get(id(r)))
    assert set(done) == set(ids)
    mismatches = []
    for request_id, job in ids.items():
        req = done[request_id]
        if job.expected_ids is None:
            assert req.finish_reason in ("length", "stop") and 1 <= len(req.output_ids) <= job.max_tokens
        elif req.output_ids != job.expected_ids or req.finish_reason != job.expected_finish:
            mismatches.append(f"{job.name}: got {req.output_ids} ({req.finish_reason}), "
                              f"reference {job.expected_ids} ({job.expected_finish})")
    assert not mismatches, "\n".join(mismatches)
    # The run exercised what it claims to: many requests at once, split prompts, prefix hits.
    cached = {ids[r].name: req.timings.num_cached_prompt_tokens for r, req in done.items()}
    print(f"{num_steps} steps, up to {max_running} requests running, {num_split_chunks} partial prompt chunks, "
          f"{sum(cached.values())} prompt tokens from the prefix cache, {engine.scheduler.num_preemptions} preemptions")
    assert max_running >= 56, f"at most {max_running} requests ran at once"
    assert num_split_chunks > 0
    assert all(cached[p["id"] + "/continued"] >= len(p["hf_ids"]) // 16 * 16 for p in PROMPTS), cached
    assert sum(v > 0 for k, v in cached.items() if k.startswith("document[:")) >= 15, cached
    # Idle: nothing queued, every block unreferenced.
    assert not engine.scheduler.running and not engine.scheduler.waiting
    engine.block_manager.check_integrity(expected_refs={})
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_start_logs_kv_bytes_per_token_and_pool_size(chunked: tuple[LLM, list[str]]) -> None:
    llm, messages = chunked
    cfg = llm.model_config
    bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    assert bytes_per_token == 46_080  # 30 layers x 3 KV heads x 64 dims for SmolLM2-135M
    pool_tokens = KV_BYTES // (bytes_per_token * 16) * 16
    assert llm.engine.block_manager.num_blocks * llm.engine.block_manager.block_size == pool_tokens
    assert any(str(bytes_per_token) in m and f"{pool_tokens} tokens" in m for m in messages), messages


def test_shared_prefix_computes_only_what_follows_the_cache() -> None:
    """Prompts sharing their first 1,000 tokens: a later one computes only what follows the 62 full blocks it finds
    cached (the tokens each forward pass took are counted; the time to first token is printed, and measured by
    benchmarks/latency.py, not asserted: a timing depends on what else the machine runs)."""
    llm = real_llm("smollm2")
    document = [t for p in PROMPTS for t in p["hf_ids"]] * 3
    first_ids = document[:1010]
    later_ids = [document[:1000] + document[2 + k:12 + k] for k in (0, 20)]
    assert all(ids[1000:] != first_ids[1000:] for ids in later_ids)
    llm.engine.block_manager.reset_prefix_cache()  # whatever earlier tests left in the shared engine
    params = SamplingParams(temperature=0, max_tokens=1)
    runner = llm.engine.runner
    computed: list[int] = []
    execute = runner.execute

    def counting(scheduled):  # noqa: ANN001, ANN202
        computed.append(sum(item.num_new_tokens for item in scheduled))
        return execute(scheduled)

    runner.execute = counting
    try:
        first = llm.generate(first_ids, params, use_tqdm=False)[0]
        cold = sum(computed)
        computed.clear()
        later = [llm.generate(ids, params, use_tqdm=False)[0] for ids in later_ids]
    finally:
        del runner.execute
    assert first.timings["cached_prompt_tokens"] == 0 and cold == len(first_ids)
    assert all(out.timings["cached_prompt_tokens"] >= 992 for out in later)
    assert sum(computed) == sum(len(ids) - out.timings["cached_prompt_tokens"] for ids, out in zip(later_ids, later))
    assert sum(computed) <= 2 * 18
    ttft_first = first.timings["time_to_first_token_s"]
    ttft_later = min(out.timings["time_to_first_token_s"] or float("inf") for out in later)
    print(f"time to first token: {ttft_first:.3f} s cold, {ttft_later:.3f} s with 992 cached tokens "
          f"({ttft_first / ttft_later:.1f}x)")

"""AsyncEngine in-process on the tiny model: outputs equal the plain engine's, consumers that leave abort their
requests, add errors reach the caller, a failing request fails alone, a failing step fails only its batch, the
idle thread sleeps, and shutdown drains within its deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from nextoken import LLM
from nextoken.config import EngineConfig
from nextoken.engine.async_engine import AsyncEngine, EngineBusy, EngineFailure, EngineStopped, SubRequest
from nextoken.engine.engine import LLMEngine
from nextoken.errors import PromptTooLong
from nextoken.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["the cat sat", "hello", "seven seas on at en", "a"]


def _engine(model: Path, **options: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu", kv_cache_bytes=4 << 20, **options))


def _run(engine: LLMEngine, body: Callable[[AsyncEngine], Coroutine[Any, Any, None]]) -> None:
    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        try:
            await body(async_engine)
        finally:
            await async_engine.shutdown(0)
        assert async_engine.stats.num_unfinished == 0 and async_engine.stats.num_kv_blocks_used == 0
        engine.block_manager.check_integrity(expected_refs={})

    asyncio.run(main())


async def _tokens(stream: AsyncIterator[Any]) -> list[int]:
    return [t async for out in stream for t in out.new_token_ids]


async def _idle(async_engine: AsyncEngine) -> None:
    for _ in range(200):
        if async_engine.stats.num_unfinished == 0 and async_engine.stats.num_kv_blocks_used == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not idle: {async_engine.stats}")


@pytest.fixture(scope="module")
def alone(tiny_llama: Path) -> dict[str, list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_bytes=4 << 20)
    return {p: llm.generate(p, GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS}


def test_concurrent_generate_equals_the_engine_alone(tiny_llama: Path, alone: dict[str, list[int]]) -> None:
    engine = _engine(tiny_llama)

    async def body(ae: AsyncEngine) -> None:
        results = await asyncio.gather(*(_tokens(ae.generate(engine.tokenizer.encode(p), GREEDY, f"r{i}"))
                                         for i, p in enumerate(PROMPTS * 4)))
        assert results == [alone[p] for p in PROMPTS * 4]

    _run(engine, body)


def test_leaving_early_or_being_cancelled_aborts(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def body(ae: AsyncEngine) -> None:
        gen = ae.generate(engine.tokenizer.encode("the cat"), long, "left")
        async for _ in gen:
            break
        await gen.aclose()
        await _idle(ae)

        task = asyncio.ensure_future(_tokens(ae.generate(engine.tokenizer.encode("the cat"), long, "cancelled")))
        while ae.stats.num_running == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _idle(ae)

    _run(engine, body)


def test_add_errors_reach_the_caller_and_groups_are_all_or_nothing(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, max_waiting=2)

    async def body(ae: AsyncEngine) -> None:
        with pytest.raises(PromptTooLong):
            await ae.add([SubRequest("long", [5] * 300, GREEDY)])
        group = [SubRequest(f"g{i}", [5, 6], GREEDY) for i in range(3)]
        with pytest.raises(EngineBusy):
            await ae.add(group)
        assert engine.get_request("g0") is None  # withdrawn with the rest of its group
        await _idle(ae)

    _run(engine, body)


def test_a_failing_request_fails_alone(tiny_llama: Path, alone: dict[str, list[int]]) -> None:
    engine = _engine(tiny_llama)
    accept = engine._accept

    def faulty(live: Any, *args: Any) -> Any:
        if live.request.request_id == "bad" and len(live.request.output_ids) == 3:
            raise RuntimeError("injected fault in detokenization")
        return accept(live, *args)

    engine._accept = faulty  # type: ignore[method-assign,assignment]

    async def body(ae: AsyncEngine) -> None:
        good = [_tokens(ae.generate(engine.tokenizer.encode(p), GREEDY, f"ok{i}")) for i, p in enumerate(PROMPTS)]
        bad = _tokens(ae.generate(engine.tokenizer.encode("hello"), GREEDY, "bad"))
        *results, failure = await asyncio.gather(*good, bad, return_exceptions=True)
        assert isinstance(failure, EngineFailure)
        assert results == [alone[p] for p in PROMPTS]
        assert await _tokens(ae.generate(engine.tokenizer.encode("a"), GREEDY, "after")) == alone["a"]

    _run(engine, body)


def test_a_failing_step_fails_its_batch_and_the_loop_goes_on(tiny_llama: Path, alone: dict[str, list[int]]) -> None:
    engine = _engine(tiny_llama)
    execute, calls = engine.runner.execute, [0]

    def faulty(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected forward failure")
        return execute(*args)

    engine.runner.execute = faulty  # type: ignore[method-assign,assignment]

    async def body(ae: AsyncEngine) -> None:
        with pytest.raises(EngineFailure):
            await _tokens(ae.generate(engine.tokenizer.encode("hello"), GREEDY, "doomed"))
        await _idle(ae)
        assert await _tokens(ae.generate(engine.tokenizer.encode("a"), GREEDY, "after")) == alone["a"]

    _run(engine, body)


def test_idle_thread_sleeps(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)

    async def body(ae: AsyncEngine) -> None:
        await _tokens(ae.generate(engine.tokenizer.encode("a"), GREEDY, "warm"))
        await _idle(ae)  # the last step's stats are published just after its output is delivered
        steps, cpu = ae.stats.num_steps, time.process_time()
        await asyncio.sleep(0.5)
        assert ae.stats.num_steps == steps
        assert time.process_time() - cpu < 0.1  # a spinning thread would burn the whole half second

    _run(engine, body)


def test_shutdown_drains_in_flight_and_refuses_new(tiny_llama: Path, alone: dict[str, list[int]]) -> None:
    engine = _engine(tiny_llama)

    longer = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # in flight for a while, even here

    async def body(ae: AsyncEngine) -> None:
        running = asyncio.ensure_future(_tokens(ae.generate(engine.tokenizer.encode("hello"), longer, "in-flight")))
        while ae.stats.num_running == 0 and not running.done():
            await asyncio.sleep(0.005)
        await ae.shutdown(drain_timeout=30)
        tokens = await running
        assert len(tokens) == 200 and tokens[:len(alone["hello"])] == alone["hello"]  # drained to its end
        with pytest.raises(EngineStopped):
            await ae.add([SubRequest("late", [5], GREEDY)])

    _run(engine, body)


def test_shutdown_past_its_deadline_aborts(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    endless = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)

    async def body(ae: AsyncEngine) -> None:
        running = asyncio.ensure_future(_tokens(ae.generate(engine.tokenizer.encode("a"), endless, "cut")))
        while ae.stats.num_running == 0 and not running.done():
            await asyncio.sleep(0.005)
        await ae.shutdown(drain_timeout=0.05)
        with pytest.raises(EngineStopped):
            await running

    _run(engine, body)


def test_idle_engine_applies_the_huge_page_move(tiny_llama: Path) -> None:
    """Without any request, the engine thread applies the weights' move onto huge pages once its copy is ready: an
    idle server does not hold the weights twice."""
    engine = _engine(tiny_llama, weights="int4")
    move = engine.runner.huge_pages
    assert move is not None and not move.applied

    async def body(async_engine: AsyncEngine) -> None:
        for _ in range(200):
            if engine.runner.huge_pages is None:
                break
            await asyncio.sleep(0.02)
        assert engine.runner.huge_pages is None and move.applied
        assert await _tokens(async_engine.generate(engine.tokenizer.encode("the cat sat"), GREEDY, "after")) != []

    _run(engine, body)


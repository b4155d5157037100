"""trace --engine (trace/engine_view.py): the steps of a batch as the scheduler ran them, checked against what the
engine must have done: every prompt position computed once per admission, later copies of the prompt served by the
prefix cache, preemption under a small pool, finished requests' blocks back."""

from __future__ import annotations

from pathlib import Path

import pytest

from nextoken import LLM, SamplingParams
from nextoken.cli import main
from nextoken.trace.engine_view import block_map, run_engine_view

PROMPT = "the cat sat on the mat and looked at the dog for a long while"


def test_a_batch_step_by_step(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=1 << 20, max_num_batched_tokens=32)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    view = run_engine_view(llm, PROMPT, params, 4, arrive_every=3)
    labels = [label for s in view.steps for label in s.arrived]
    assert labels == ["A", "B", "C", "D"] and [s.index for s in view.steps if s.arrived] == [0, 3, 6, 9]
    num_prompt = next(iter(view.requests.values())).num_prompt_tokens
    for label in labels:
        ran = [r for s in view.steps for r in s.ran if r.label == label]
        prefill = [r for r in ran if r.kind == "prefill"]
        covered = prefill[0].cached + sum(r.count for r in prefill)
        assert covered == num_prompt  # the prompt: cached and computed, each position once
        assert [r.first for r in prefill] == sorted(r.first for r in prefill)  # chunks in order
        assert sum(r.count for r in ran if r.kind == "decode") == 11  # 12 tokens: the prompt's last row gave one
    assert max(r.count for s in view.steps for r in s.ran) <= 32  # the step budget: chunked prefill
    assert any(r.cached for s in view.steps for r in s.ran)  # later arrivals hit the first's cached blocks
    assert {label for s in view.steps for label, _ in s.finished} == set(labels)
    last = view.steps[-1]
    assert last.blocks == {} and last.free_blocks == llm.engine.block_manager.num_blocks
    assert llm.engine.scheduler.schedule.__self__ is llm.engine.scheduler  # type: ignore[attr-defined]


def test_preemption_shows_under_a_small_pool(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=96 << 10, enable_prefix_caching=False)
    blocks = llm.engine.block_manager.num_blocks
    params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)
    view = run_engine_view(llm, PROMPT, params, 4, arrive_every=1)
    preempted = [x for s in view.steps for x in s.preempted]
    assert preempted, f"no preemption with {blocks} blocks"
    for s in view.steps:  # never more blocks held than the pool has
        assert sum(len(t) for t in s.blocks.values()) + s.free_blocks <= blocks
    busiest = max(view.steps, key=lambda s: sum(len(v) for v in s.blocks.values()))
    cells = "".join(block_map(busiest, blocks))
    assert len(cells) == blocks and set(cells) <= set("ABCD*.")
    assert sum(c != "." for c in cells) == sum(len(t) for t in busiest.blocks.values())


def test_the_command(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "--model", str(tiny_llama), "--device", "cpu", "--max-tokens", "4", "--engine", "3",
                 PROMPT]) == 0
    text = capsys.readouterr().out
    assert "the engine, step by step" in text and "A prefill 0-" in text and "C arrives" in text
    assert "block map after step" in text

"""trace --branch (trace/branch.py): the prompt computed once and shared, each branch drawing what its setting
draws alone, the probabilities of each other's tokens from each branch's own sampling distribution, and the page in
headless Chromium."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from nextoken import LLM, SamplingParams
from nextoken.trace.branch import run_branches
from nextoken.trace.command import TraceOptions, trace
from nextoken.trace.probs import sampling_distributions
from nextoken.trace.report import make_console
from tests.trace.test_html import run_chromium

PROMPT = "the cat sat on the mat"
SETTINGS = {"temperature=0": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            "temperature=3,seed=4": SamplingParams(temperature=3.0, seed=4, max_tokens=6, ignore_eos=True),
            "temperature=2,top_k=5,seed=1": SamplingParams(temperature=2.0, top_k=5, seed=1, max_tokens=6,
                                                           ignore_eos=True)}


def test_branches_share_one_prefill_and_draw_what_each_setting_draws_alone(llama_llm: LLM) -> None:
    prompt_ids, branches = run_branches(llama_llm, PROMPT, list(SETTINGS), list(SETTINGS.values()))
    assert branches[0].computed_prompt_tokens == len(prompt_ids)  # the first computes the prompt...
    assert [b.computed_prompt_tokens for b in branches[1:]] == [1, 1]  # ...the others only its last token
    for b, params in zip(branches, SETTINGS.values()):
        alone = llama_llm.generate([prompt_ids], params)[0].token_ids
        assert b.token_ids == alone
    assert branches[0].own == [1.0] * 6  # greedy: its own token, always
    logits = llama_llm.engine.runner.score(prompt_ids + branches[1].token_ids)
    for i in range(6):
        _, _, final = sampling_distributions(logits[len(prompt_ids) - 1 + i], branches[1].params, prompt_ids,
                                             branches[1].token_ids[:i])
        assert branches[1].own[i] == pytest.approx(float(final[branches[1].token_ids[i]]))
        assert branches[1].others[i]["A"] == pytest.approx(float(final[branches[0].token_ids[i]]))
        assert branches[1].others[i]["C"] == pytest.approx(float(final[branches[2].token_ids[i]]))
    assert not llama_llm.engine.has_unfinished()
    assert llama_llm.engine.block_manager.num_free_blocks == llama_llm.engine.block_manager.num_blocks


def test_the_command_and_its_page(tiny_llama: Path, tmp_path: Path) -> None:
    out = io.StringIO()
    page = tmp_path / "branches.html"
    trace(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True),
          TraceOptions(model=str(tiny_llama), device="cpu", branch=tuple(SETTINGS), html=page), make_console(out))
    text = out.getvalue()
    assert "computed once" in text and "A: temperature=0" in text and "C: temperature=2,top_k=5,seed=1" in text
    result = run_chromium(page, tmp_path, "--dump-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count('<td class="step">') == 5
    assert len(re.findall(r'<span class="tok">', result.stdout)) == 15  # a token per branch and step
    assert "<script" not in result.stdout

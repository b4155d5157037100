"""The Python API under combinations of SamplingParams, drawn by hypothesis: `LLM.generate` over several prompts at once
answers, prompt by prompt, what it answers for each prompt alone (every choice's text, tokens and finish reason,
usage, and every log-probability of the prompt's and the answers' scores within 1e-4: a batch's rows may round apart
in their last bits, and near-tied alternatives with them), and `LLM.stream` gives one choice's tokens and text as
`generate` does. Choices are seeded apart (choice i of a seeded request draws from seed + i), so n > 1 with a seed
repeats exactly too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nextoken import LLM, SamplingParams

PROMPTS = ["the cat sat on the mat", "hello", "seven seas and seven skies", [5, 9, 17, 33, 65], "on at en on at"]


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_bytes=2 << 20, threads=1,
               max_num_batched_tokens=32)


@st.composite
def sampling(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(1, 12))
    temperature = draw(st.sampled_from([0.0, 0.8]))
    extra: dict[str, Any] = {}
    for name, values in (("n", [2, 3]), ("stop", [("e",), ("at", "o")]), ("stop_token_ids", [(9,)]),
                         ("logprobs", [0, 2]), ("prompt_logprobs", [0, 3]), ("presence_penalty", [0.5]),
                         ("repetition_penalty", [1.2]), ("min_tokens", [min(3, max_tokens)]),
                         ("logit_bias", [{6: 2.0}]), ("ignore_eos", [True]), ("top_k", [5]),
                         ("include_stop_str_in_output", [True])):
        if draw(st.booleans()):
            extra[name] = draw(st.sampled_from(values))
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=7 if temperature else None, **extra)


def result(out: Any) -> tuple:
    """Everything an output says, its log-probabilities apart (a batch's rows may round apart in their last bits)."""
    return (out.prompt_token_ids, out.usage, [(c.text, c.token_ids, c.finish_reason) for c in out.outputs],
            [len(top) for top in out.prompt_logprobs or []], [e is None for e in out.prompt_token_logprobs or []],
            [[len(top) for _, top in c.logprobs or []] for c in out.outputs])


def scores(out: Any) -> list[float]:
    """Every log-probability an output reports, in order."""
    values = [lp for top in out.prompt_logprobs or [] for _, lp in top]
    values += [e[0] for e in out.prompt_token_logprobs or [] if e is not None]
    for c in out.outputs:
        values += [x for lp, top in c.logprobs or [] for x in (lp, *(v for _, v in top))]
    return values


def test_generate_together_answers_as_alone_and_stream_as_generate(llm: LLM) -> None:
    @given(params=sampling(), prompts=st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=4))
    @settings(max_examples=80, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    def check(params: SamplingParams, prompts: list[Any]) -> None:
        together = llm.generate(prompts, params, use_tqdm=False)
        assert len(together) == len(prompts)
        for prompt, out in zip(prompts, together):
            alone = llm.generate([prompt], params, use_tqdm=False)[0]
            assert result(out) == result(alone), (prompt, params)
            assert all(abs(x - y) < 1e-4 for x, y in zip(scores(out), scores(alone), strict=True))
            assert len(out.outputs) == params.n
            assert all(len(c.token_ids) <= params.max_tokens for c in out.outputs)
            assert out.usage["completion_tokens"] == sum(len(c.token_ids) for c in out.outputs)
        if params.n == 1:
            ids = together[0].prompt_token_ids
            deltas = list(llm.stream(ids, params))
            assert deltas[-1].finished
            assert [t for d in deltas for t in d.new_token_ids] == together[0].outputs[0].token_ids
            assert "".join(d.new_text for d in deltas) == together[0].outputs[0].text
        llm.engine.block_manager.check_integrity(expected_refs={})

    check()

"""Tensor parallelism on the real models, two processes on loopback: against one process in the same formats (the
CPU's defaults: the file's int4 blocks, the int8 LM head pass), teacher-forced top-5 log-probabilities within 1e-4 at
every position of the reference prompts, and greedy continuations identical (and the reference's). SmolLM2 splits
its 3 KV heads 2 + 1; Gemma 3 replicates its one KV head and splits its 4 query heads 2 + 2.
"""

from __future__ import annotations

import time

import pytest

from nextoken import LLM
from nextoken.sampling_params import SamplingParams
from tests.conftest import REAL_MODELS, TEST_KV_BYTES, load_reference, needs_native, real_llm

TOLERANCE = 1e-4  # nats


@needs_native
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_two_ranks_match_one(model: str) -> None:
    one = real_llm(model, "auto", "fp32")
    started = time.perf_counter()
    two = LLM(REAL_MODELS[model], kv_dtype="fp32", kv_cache_bytes=TEST_KV_BYTES, tensor_parallel=2)
    try:
        assert two.engine.runner.weights == one.engine.runner.weights == "int4"
        loaded = time.perf_counter()
        prompts = load_reference(model, "hf.json")["prompts"]
        greedy = SamplingParams(temperature=0, max_tokens=48)
        outs = two.generate([p["hf_ids"] for p in prompts], greedy, use_tqdm=False)
        ones = one.generate([p["hf_ids"] for p in prompts], greedy, use_tqdm=False)
        for p, out, base in zip(prompts, outs, ones):
            assert out.token_ids == base.token_ids == p["greedy_ids"], p["id"]
        decoded = time.perf_counter()
        scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
        worst = 0.0
        refs = load_reference(model, "hf_top5.json")["prompts"]
        outs = two.generate([p["seq_ids"] for p in refs], scored, use_tqdm=False)
        ones = one.generate([p["seq_ids"] for p in refs], scored, use_tqdm=False)
        for p, out, base_out in zip(refs, outs, ones):
            assert len(out.prompt_logprobs) == len(p["seq_ids"])
            for pos, (row, base) in enumerate(zip(out.prompt_logprobs, base_out.prompt_logprobs)):
                mine = dict(row)
                assert row[0][0] == base[0][0], f"{p['id']} position {pos}: top-1 differs"
                for token_id, lp in base:
                    # A token may leave the top 5 only in a tie with the 5th.
                    worst = max(worst, abs(mine.get(token_id, row[-1][1]) - lp))
        print(f"{model}: two ranks vs one, worst top-5 log-probability difference {worst:.1e}; start "
              f"{loaded - started:.1f} s, greedy {decoded - loaded:.1f} s, "
              f"scoring {time.perf_counter() - decoded:.1f} s")
        assert worst < TOLERANCE
    finally:
        two.close()

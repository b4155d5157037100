"""Speculative decoding on the real models against the reference: 48-token greedy continuations of every reference
prompt identical to transformers' (tests/data/reference), with n-gram proposals verified on every step they exist
(not only where the adaptive k would verify them), the prompts batched together, in fp32 and the CPU's default
formats; with SmolLM2 in int4 drafting for SmolLM2 in fp32; with SmolLM2's first 10 layers drafting (early exit);
with each model drafting for itself through its head's likeliest tokens (then verifying runs the full head over the
drafted rows). Verifying passes run the proposals as extra rows (the block kernels for a few, a GEMM past them), so
this holds those paths' logits to the reference's greedy choice too."""

from __future__ import annotations

import pytest

from nextoken import LLM
from nextoken.sampling_params import SamplingParams
from tests.conftest import REAL_MODELS, TEST_KV_BYTES, load_reference, needs_native

# (model, dtype, proposer, k): the defaults need the native kernels, and so does an int4 draft. k = 5 and 15: the
# verifying passes' few-row kernels and a GEMM; early exit, whose proposals are seldom accepted (every step drafts k
# tokens and verifies them all), at 5 only.
ROUTES = [pytest.param("smollm2", "float32", "ngram", k) for k in (5, 15)] + [
    pytest.param(model, "auto", "ngram", k, marks=needs_native) for model in ("smollm2", "gemma3") for k in (5, 15)] + [
    pytest.param("smollm2", "float32", "draft:smollm2-135m-instruct", k, marks=needs_native) for k in (5, 15)] + [
    pytest.param("smollm2", "auto", "self:10", 5, marks=needs_native)] + [
    pytest.param(model, "auto", f"head:{n}", k, marks=needs_native)
    for model, n in (("smollm2", 8192), ("gemma3", 16384)) for k in (5, 15)]


@pytest.mark.parametrize(("model", "dtype", "speculative", "k"), ROUTES)
def test_greedy_with_speculation_matches_reference(model: str, dtype: str, speculative: str, k: int) -> None:
    llm = LLM(REAL_MODELS[model], dtype=dtype, kv_dtype="fp32", device="cpu", kv_cache_bytes=TEST_KV_BYTES,
              speculative=speculative, num_speculative_tokens=k)
    assert llm.engine.speculator is not None
    llm.engine.speculator.adaptive = False
    prompts = load_reference(model, "hf.json")["prompts"]
    outs = llm.generate([p["hf_ids"] for p in prompts], SamplingParams(temperature=0, max_tokens=48),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.token_ids == p["greedy_ids"], p["id"]
        assert out.finish_reason == ("stop" if p["stopped_on_eog"] else "length"), p["id"]
    assert sum(out.timings["spec_accepted_tokens"] for out in outs) > 0
    llm.engine.block_manager.check_integrity(expected_refs={})
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks

"""Beam search on a packaged model against transformers' own (tests/data/beam_reference.json, written by
scripts/beam_reference.py from the same GGUF file): on every reference prompt, 4 beams, 16 tokens, no end token,
length penalty 0, the best beam is transformers' best beam and width 1 is its greedy search; and the best
beam is at least as likely as the greedy continuation wherever transformers' is (beam search can prune the greedy
path; on one reference prompt both do)."""

from __future__ import annotations

import json

from nextoken import SamplingParams
from tests.conftest import DATA, real_llm

REFERENCE = json.loads((DATA / "beam_reference.json").read_text())
NEW_TOKENS = 16


def test_beams_match_transformers() -> None:
    llm = real_llm("smollm2", "auto")  # the default formats: within 1e-3 of fp32 (tests/models/test_reference.py)
    prompts = json.loads((DATA / "reference" / "prompts.json").read_text())["prompts"]
    below_greedy = []
    for p in prompts:
        ref = REFERENCE[p["id"]]
        ids = llm.encode(p["text"]) if "text" in p else llm.render_chat(p["messages"])[1]
        best = llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, beam_width=4,
                                                  length_penalty=0.0), use_tqdm=False)[0].outputs[0]
        one = llm.generate([ids], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, beam_width=1),
                           use_tqdm=False)[0].outputs[0]
        assert best.token_ids == ref["beams"]["token_ids"], p["id"]
        assert one.token_ids == ref["greedy"]["token_ids"], p["id"]
        assert abs(best.cumulative_logprob - ref["beams"]["cumulative_logprob"]) < 1e-3
        if best.cumulative_logprob < one.cumulative_logprob - 1e-4:  # a row's last bits move with its batch
            below_greedy.append(p["id"])
    want = [pid for pid, r in REFERENCE.items()
            if r["beams"]["cumulative_logprob"] < r["greedy"]["cumulative_logprob"] - 1e-4]
    assert below_greedy == want and len(want) <= 1

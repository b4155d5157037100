"""Beam search on the paged cache: width 1 is greedy; every hypothesis's cumulative log-probability is what the model
gives its tokens when re-scored from scratch (so a forked beam's shared blocks and its copy of the partly filled one
hold the right K/V), and so is each token's where logprobs are asked; the best beam scores at least greedy's path;
beams really share blocks while they run; every block comes back, also when a search is aborted; other requests in
the same steps are untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from nextoken import LLM, SamplingParams
from nextoken.errors import InvalidSamplingParams

PROMPTS = [list(range(5, 30)), [7, 11, 13, 17, 19, 23, 29, 31, 37], list(range(100, 133))]  # 25, 9, 33 tokens


@pytest.fixture(scope="module", params=["llama", "gemma"])
def llm(request: pytest.FixtureRequest) -> LLM:
    path: Path = request.getfixturevalue(f"tiny_{request.param}")
    return LLM(str(path), weights="fp32", kv_dtype="fp32", device="cpu", kv_cache_bytes=8 << 20, block_size=8)


def rescored(llm: LLM, prompt: list[int], tokens: list[int]) -> float:
    out = llm.generate([prompt + tokens], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return sum(e[0] for e in out.prompt_token_logprobs[len(prompt):])


def greedy(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    return out.token_ids, sum(lp for lp, _ in out.logprobs)


def beams(llm: LLM, prompt: list[int], width: int, n: int, max_tokens: int = 10, **kw) -> list:  # noqa: ANN003
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, beam_width=width, n=n, **kw)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs


def test_width_one_is_greedy(llm: LLM) -> None:
    for prompt in PROMPTS:
        (best,) = beams(llm, prompt, 1, 1)
        tokens, logprob = greedy(llm, prompt, 10)
        assert best.token_ids == tokens and abs(best.cumulative_logprob - logprob) < 1e-4


@pytest.mark.parametrize("width", [2, 4])
def test_every_beam_scores_what_the_model_gives_it(llm: LLM, width: int) -> None:
    for prompt in PROMPTS:
        out = beams(llm, prompt, width, width, length_penalty=0.0)
        assert len(out) == width and len({tuple(c.token_ids) for c in out}) == width
        scores = [c.cumulative_logprob for c in out]
        assert scores == sorted(scores, reverse=True)
        for c in out:
            assert abs(c.cumulative_logprob - rescored(llm, prompt, c.token_ids)) < 1e-4
        assert scores[0] >= greedy(llm, prompt, 10)[1] - 1e-5


@pytest.mark.parametrize("k", [0, 3, 9])
def test_every_beam_reports_its_tokens_log_probabilities(llm: LLM, k: int) -> None:
    """logprobs=k: each beam's tokens with the model's log-probability of each (re-scored from scratch) and the top k
    there, best first, the token's own among them where it ranks; the same beams as without (9 > 2W: a longer list
    of candidates does not change the search)."""
    for prompt in PROMPTS:
        plain = beams(llm, prompt, 3, 3)
        out = beams(llm, prompt, 3, 3, logprobs=k)
        assert [(c.token_ids, c.cumulative_logprob) for c in out] == [(c.token_ids, c.cumulative_logprob)
                                                                      for c in plain]
        assert all(c.logprobs is None for c in plain)
        for c in out:
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            assert abs(sum(lp for lp, _ in c.logprobs) - c.cumulative_logprob) < 1e-4
            for i, (token, (lp, top)) in enumerate(zip(c.token_ids, c.logprobs)):
                assert abs(lp - rescored(llm, prompt + c.token_ids[:i], [token])) < 1e-4
                assert len(top) == k and [x for _, x in top] == sorted((x for _, x in top), reverse=True)
                assert all(abs(x - lp) < 1e-6 for t, x in top if t == token)


def test_beams_share_blocks_and_give_them_all_back(llm: LLM) -> None:
    engine = llm.engine
    bm = engine.block_manager
    free = bm.num_free_blocks
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12, ignore_eos=True, beam_width=4), "search")
    group = engine._beam_groups["search"]
    shared = 0
    while engine.has_unfinished():
        engine.step()
        shared = max(shared, sum(b.ref_count > 1 for b in bm.blocks))
        bm.check_integrity()
    assert group.num_forks > 0 and shared > 0
    assert bm.num_free_blocks == free
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True, beam_width=4), "dropped")
    for _ in range(5):
        engine.step()
    assert bm.num_free_blocks < free
    assert engine.abort("dropped") and not engine.has_unfinished()
    bm.check_integrity()
    assert bm.num_free_blocks == free


def test_other_requests_in_the_same_steps_are_untouched(llm: LLM) -> None:
    alone = llm.generate(PROMPTS[1:], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True, beam_width=3), "search")
    together = llm.generate(PROMPTS[1:], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    while engine.has_unfinished():
        engine.step()
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]


def test_bad_beam_settings_name_the_parameter() -> None:
    for kw, name in (({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"),
                     ({"beam_width": 2, "n": 3}, "n"), ({"beam_width": 2, "stop": ("x",)}, "stop"),
                     ({"beam_width": 2, "prompt_logprobs": 1}, "prompt_logprobs"),
                     ({"length_penalty": float("nan")}, "length_penalty")):
        with pytest.raises(InvalidSamplingParams, match=name):
            SamplingParams(**kw)


def test_n_choices_share_the_prompts_blocks(llm: LLM) -> None:
    """n > 1: the prompt is computed once; the other choices take references to its blocks and a copy of the one
    holding its last token, computing that token alone, and draw as they would on their own."""
    engine = llm.engine
    bm = engine.block_manager
    free = bm.num_free_blocks
    prompt = list(range(140, 173))  # 33 tokens (4 full blocks of 8 and one more), in no cache yet
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, n=3)
    computed = []
    step = engine.runner.execute

    def execute(scheduled):  # noqa: ANN001, ANN202
        computed.append(sum(item.num_new_tokens for item in scheduled))
        return step(scheduled)

    engine.runner.execute = execute
    try:
        together = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    finally:
        del engine.runner.execute
    assert computed[0] == len(prompt) and computed[1] == 1 + 2  # the others' last prompt token, the first's decode
    assert bm.num_free_blocks == free
    bm.check_integrity()
    from nextoken.engine.inputs import choices

    alone = [llm.generate([prompt], p, use_tqdm=False)[0].outputs[0].token_ids for p in choices(params)]
    assert [c.token_ids for c in together] == alone

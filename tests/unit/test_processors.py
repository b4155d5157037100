"""Logits processors (engine/processors.py): each on hand-computed small logits, in one batch beside rows that use
none (their tokens unchanged) and seeded sampled rows, and through the engine on the tiny model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nextoken import LLM
from nextoken.cli import main
from nextoken.engine.processors import apply_processors
from nextoken.engine.sampler import Sampler, SamplingRow
from nextoken.errors import InvalidInput, InvalidSamplingParams
from nextoken.sampling_params import SamplingParams

INF = math.inf
# Row 0's argmax is token 0; its next best token 1.
LOGITS = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, -1.0])


def row(params: SamplingParams, output_ids: list[int] | None = None, stop_ids: frozenset[int] = frozenset(),
        seed: int | None = None) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(params, generator, [1, 2], output_ids or [], stop_ids)


def processed(params: SamplingParams, output_ids: list[int] | None = None,
              stop_ids: frozenset[int] = frozenset()) -> list[float]:
    return apply_processors(LOGITS[None].clone(), [row(params, output_ids, stop_ids)])[0].tolist()


def test_logit_bias_adds_to_its_tokens() -> None:
    assert processed(SamplingParams(logit_bias={5: 100, 0: -1.5})) == [1.5, 2.0, 1.0, 0.5, 0.0, 99.0]


def test_min_tokens_bans_the_end_ids_until_reached() -> None:
    params = SamplingParams(min_tokens=2)
    assert processed(params, [4], frozenset({0, 3})) == [-INF, 2.0, 1.0, -INF, 0.0, -1.0]
    assert processed(params, [4, 4], frozenset({0, 3})) == LOGITS.tolist()


def test_bad_words_ban_single_tokens_always_and_last_tokens_after_their_prefix() -> None:
    params = SamplingParams(bad_words=[[1], [4, 2, 0], [5, 3]])
    assert processed(params, [3]) == [3.0, -INF, 1.0, 0.5, 0.0, -1.0]
    assert processed(params, [1, 4, 2]) == [-INF, -INF, 1.0, 0.5, 0.0, -1.0]
    assert processed(params, [4, 2, 5]) == [3.0, -INF, 1.0, -INF, 0.0, -1.0]


def test_allowed_token_ids_mask_the_rest() -> None:
    assert processed(SamplingParams(allowed_token_ids=[2, 4])) == [-INF, -INF, 1.0, -INF, 0.0, -INF]


def test_one_batch_mixing_processors_plain_greedy_and_seeded_rows() -> None:
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=7)
    batch = [
        row(SamplingParams(temperature=0, logit_bias={4: 100})),  # forced: 4
        row(greedy),  # untouched: 0
        row(SamplingParams(temperature=0, allowed_token_ids=[2, 3])),  # 2 beats 3
        row(sampled, seed=7),
        row(SamplingParams(temperature=0, min_tokens=1), stop_ids=frozenset({0})),  # 0 banned: 1
        row(SamplingParams(temperature=0, bad_words=[[0], [2, 1]]), output_ids=[2]),  # 0 and 1 banned: 2
        row(SamplingParams(temperature=1.0, seed=7, allowed_token_ids=[5]), seed=7),  # the only one left: 5
    ]
    logits = LOGITS.repeat(len(batch), 1)  # [7, 6]
    got = Sampler()(logits, batch).token_ids
    alone = Sampler()(LOGITS.repeat(2, 1), [row(greedy), row(sampled, seed=7)]).token_ids
    assert got == [4, alone[0], 2, alone[1], 1, 2, 5]
    assert logits.equal(LOGITS.repeat(len(batch), 1))  # the caller's logits are left as they were


def test_logprobs_stay_the_raw_models() -> None:
    params = SamplingParams(temperature=0, logit_bias={5: 100}, logprobs=1)
    result = Sampler()(LOGITS[None].clone(), [row(params)])
    chosen, top = result.logprobs[0]  # type: ignore[misc]
    raw = LOGITS.log_softmax(-1)
    assert result.token_ids == [5] and chosen == pytest.approx(float(raw[5])) and top[0][0] == 0


def test_processors_turn_off_the_argmax_only_step() -> None:
    assert Sampler.argmax_only([SamplingParams(temperature=0)])
    for options in ({"logit_bias": {1: 1}}, {"min_tokens": 1}, {"bad_words": [[1]]}, {"allowed_token_ids": [1]}):
        assert not Sampler.argmax_only([SamplingParams(temperature=0), SamplingParams(temperature=0, **options)])


@pytest.mark.parametrize(("options", "name"), [
    ({"logit_bias": {1: 100.5}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"1": 1}}, "logit_bias"), ({"logit_bias": {1: math.inf}}, "logit_bias"),
    ({"logit_bias": {i: 1 for i in range(301)}}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"bad_words": [[]]}, "bad_words"),
    ({"bad_words": [[1, -2]]}, "bad_words"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.0]}, "allowed_token_ids"), ({"beam_width": 2, "logit_bias": {1: 1}}, "logit_bias"),
])
def test_invalid_values_are_refused_by_name(options: dict, name: str) -> None:
    with pytest.raises(InvalidSamplingParams, match=f"invalid {name}="):
        SamplingParams(**options)


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=8 << 20)


def generate(llm: LLM, **options: object) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=8, **options)  # type: ignore[arg-type]
    return llm.generate("the cat sat", params, use_tqdm=False)[0].token_ids


def test_engine_logit_bias_forces_a_token(llm: LLM) -> None:
    free = generate(llm, ignore_eos=True)
    forced = next(t for t in range(3, 50) if t not in free)
    assert generate(llm, ignore_eos=True, logit_bias={forced: 100}) == [forced] * 8


def test_engine_min_tokens_outlasts_an_early_end(llm: LLM) -> None:
    first = generate(llm, ignore_eos=True)[0]
    assert generate(llm, ignore_eos=True, stop_token_ids=[first]) == [first]  # the early end
    out = generate(llm, ignore_eos=True, stop_token_ids=[first], min_tokens=5)
    assert len(out) >= 5 and first not in out[:5]


def test_engine_allowed_token_ids_and_bad_words(llm: LLM) -> None:
    free = generate(llm, ignore_eos=True)
    allowed = [7, 11, 13]
    assert set(generate(llm, ignore_eos=True, allowed_token_ids=allowed)) <= set(allowed)
    banned = sorted(set(free))
    assert not set(generate(llm, ignore_eos=True, bad_words=[[t] for t in banned])) & set(banned)


def test_engine_refuses_ids_past_the_vocabulary(llm: LLM) -> None:
    vocab = llm.engine.inputs.vocab_size
    for options in ({"logit_bias": {vocab: 1}}, {"bad_words": [[1, vocab]]}, {"allowed_token_ids": [vocab]}):
        with pytest.raises(InvalidInput, match=next(iter(options))):
            llm.engine.add_request([1, 2, 3], SamplingParams(**options))  # type: ignore[arg-type]


def test_cli_flags(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["run", "the cat", "--model", str(tiny_llama), "--device", "cpu", "--raw", "--json", "--max-tokens", "4"]
    assert main([*base, "--logit-bias", "9=100", "--logit-bias", "3=-1", "--min-tokens", "2",
                 "--allowed-token-ids", "9,10", "--bad-words", "zebra"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == [9] * 4
    assert main([*base, "--allowed-token-ids", "10000000"]) == 2
    assert "allowed_token_ids" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--logit-bias", "9:100"])
    assert "ID=BIAS" in capsys.readouterr().err

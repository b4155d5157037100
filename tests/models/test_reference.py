"""The forward pass against the reference implementation (transformers, fp32) on every reference prompt.

fp32: teacher-forced top-5 log-probabilities within 1e-3 and 48-token greedy continuations identical.
bf16: teacher-forced top-1 agreement with the reference of at least 99%, and the mean KL from fp32 reported.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nextoken.sampling_params import SamplingParams
from tests.conftest import DATA, agreement_and_kl, load_reference, real_llm

MODELS = ["smollm2", "gemma3"]


def teacher_forced_logprobs(llm, seq_ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """log-softmax at every position of seq_ids, via prompt_logprobs over the whole vocabulary's top 20."""
    out = llm.generate([seq_ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20),
                       use_tqdm=False)[0]
    return out.prompt_logprobs


@pytest.mark.parametrize("model", MODELS)
def test_fp32_top5_logprobs_match_reference(model: str) -> None:
    llm = real_llm(model)
    ref = load_reference(model, "hf_top5.json")
    worst = 0.0
    for prompt in ref["prompts"]:
        rows = teacher_forced_logprobs(llm, prompt["seq_ids"])
        assert len(rows) == len(prompt["seq_ids"])
        for pos, (ids, lps) in enumerate(zip(prompt["top5_ids"], prompt["top5_logprobs"])):
            mine = dict(rows[pos])
            assert [i for i, _ in rows[pos][:1]] == ids[:1], f"{prompt['id']} position {pos}: top-1 differs"
            for token_id, lp in zip(ids, lps):
                assert token_id in mine, f"{prompt['id']} position {pos}: reference top-5 id {token_id} missing"
                worst = max(worst, abs(mine[token_id] - lp))
    print(f"{model}: worst top-5 log-probability error {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.parametrize("model", MODELS)
def test_fp32_greedy_continuations_match_reference(model: str) -> None:
    llm = real_llm(model)
    ref = load_reference(model, "hf.json")
    prompts = ref["prompts"]
    outs = llm.generate([p["hf_ids"] for p in prompts], SamplingParams(temperature=0, max_tokens=48),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.token_ids == p["greedy_ids"], p["id"]
        assert out.finish_reason == ("stop" if p["stopped_on_eog"] else "length"), p["id"]


def test_smollm2_last_position_logits_match_reference() -> None:
    llm = real_llm("smollm2")
    ref = {p["id"]: p for p in load_reference("smollm2", "hf.json")["prompts"]}
    for name in ("en_capital", "chat_capital"):
        expected = torch.from_numpy(np.load(DATA / "reference" / "smollm2" / f"logits_{name}.npy")).float()
        logits = llm.engine.runner.score(ref[name]["hf_ids"])[-1]
        assert torch.allclose(logits.log_softmax(-1), expected.log_softmax(-1), atol=1e-3), name


@pytest.mark.parametrize("model", MODELS)
def test_bf16_agrees_with_reference(model: str) -> None:
    llm16 = real_llm(model, "bfloat16")
    agreement, mean_kl = agreement_and_kl(model, lambda ids: llm16.engine.runner.score(ids).log_softmax(-1))
    print(f"{model} bf16: top-1 agreement {agreement:.2%}, mean KL from fp32 {mean_kl:.2e} nats")
    assert agreement >= 0.99
    assert mean_kl < 0.05

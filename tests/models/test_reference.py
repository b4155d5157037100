"""The forward pass against the reference implementation (transformers, fp32) on every reference prompt, on CPU and,
where one is present, on a CUDA GPU (scripts/device_check.sh).

fp32: teacher-forced top-5 log-probabilities within 1e-3 and 48-token greedy continuations identical (on a GPU the
decode steps replay CUDA graphs, so this holds the captured steps to the reference too).
bf16: teacher-forced top-1 agreement with the reference of at least 99%, and the mean KL from fp32 reported; on a GPU,
where bf16 is the default, greedy continuations leave the reference's only where its token was a near tie.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nextoken.sampling_params import SamplingParams
from tests.conftest import DATA, agreement_and_kl, load_reference, real_llm

MODELS = ["smollm2", "gemma3"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/device_check.sh)")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
NEAR_TIE = 0.25  # nats: bf16 weights move a logit by about this much at most on these prompts


def teacher_forced_logprobs(llm, seq_ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """log-softmax at every position of seq_ids, via prompt_logprobs over the whole vocabulary's top 20."""
    out = llm.generate([seq_ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20),
                       use_tqdm=False)[0]
    return out.prompt_logprobs


def captured(llm) -> bool:  # noqa: ANN001
    """Whether a GPU model's decode steps replayed CUDA graphs."""
    graphs = llm.engine.runner.graphs
    return graphs is not None and bool(graphs.steps) and all(
        step is not None and step.graph is not None for step in graphs.steps.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", MODELS)
def test_fp32_top5_logprobs_match_reference(model: str, device: str) -> None:
    llm = real_llm(model, device=device)
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
    print(f"{model} on {device}: worst top-5 log-probability error {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", MODELS)
def test_fp32_greedy_continuations_match_reference(model: str, device: str) -> None:
    llm = real_llm(model, device=device)
    ref = load_reference(model, "hf.json")
    prompts = ref["prompts"]
    outs = llm.generate([p["hf_ids"] for p in prompts], SamplingParams(temperature=0, max_tokens=48),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.token_ids == p["greedy_ids"], p["id"]
        assert out.finish_reason == ("stop" if p["stopped_on_eog"] else "length"), p["id"]
    if device == "cuda":
        assert captured(llm)


@pytest.mark.parametrize("device", DEVICES)
def test_smollm2_last_position_logits_match_reference(device: str) -> None:
    llm = real_llm("smollm2", device=device)
    ref = {p["id"]: p for p in load_reference("smollm2", "hf.json")["prompts"]}
    for name in ("en_capital", "chat_capital"):
        expected = torch.from_numpy(np.load(DATA / "reference" / "smollm2" / f"logits_{name}.npy")).float()
        logits = llm.engine.runner.score(ref[name]["hf_ids"])[-1].float().cpu()
        assert torch.allclose(logits.log_softmax(-1), expected.log_softmax(-1), atol=1e-3), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", MODELS)
def test_bf16_agrees_with_reference(model: str, device: str) -> None:
    llm16 = real_llm(model, "bfloat16", device=device)
    agreement, mean_kl = agreement_and_kl(model, lambda ids: llm16.engine.runner.score(ids).log_softmax(-1))
    print(f"{model} bf16 on {device}: top-1 agreement {agreement:.2%}, mean KL from fp32 {mean_kl:.2e} nats")
    assert agreement >= 0.99
    assert mean_kl < 0.05


@cuda
@pytest.mark.parametrize("model", MODELS)
def test_cuda_default_greedy_leaves_reference_only_at_near_ties(model: str) -> None:
    """The CUDA defaults (bf16 weights, bf16 KV cache, decode from CUDA graphs): each greedy continuation follows the
    reference's until a step where the reference's token was within NEAR_TIE nats of ours, if ever."""
    llm = real_llm(model, "auto", "auto", "cuda")
    runner = llm.engine.runner
    assert (runner.weights, runner.kv_dtype) == ("bf16", "bf16")
    prompts = load_reference(model, "hf.json")["prompts"]
    outs = llm.generate([p["hf_ids"] for p in prompts], SamplingParams(temperature=0, max_tokens=48, logprobs=20),
                        use_tqdm=False)
    followed = 0
    for p, out in zip(prompts, outs):
        mine, theirs = out.token_ids, p["greedy_ids"]
        same = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        followed += same
        if same < min(len(mine), len(theirs)):
            chosen, top = out.outputs[0].logprobs[same]
            theirs_lp = dict(top).get(theirs[same], float("-inf"))
            assert chosen - theirs_lp < NEAR_TIE, (f"{p['id']} step {same}: the reference's token {theirs[same]} "
                                                   f"is {chosen - theirs_lp:.3f} nats below ours")
    print(f"{model} on cuda (bf16, graphs): {followed} of {sum(len(p['greedy_ids']) for p in prompts)} "
          f"reference tokens followed")
    assert captured(llm)

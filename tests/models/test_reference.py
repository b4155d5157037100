"""The forward pass against the reference implementation (transformers, fp32) on every reference prompt, on CPU and,
where one is present, on a CUDA GPU (scripts/device_check.sh).

fp32 weights, and on CPU the default formats (the file's own blocks, activations in two levels of codes, the int8
LM head pass with its best candidates rescored): teacher-forced top-5 log-probabilities within 1e-3 and 48-token
greedy continuations identical (on a GPU the decode steps replay CUDA graphs, so this holds the captured steps to the
reference too). Past Gemma 3's 512-token window, where there is no transformers reference here, the default formats
are held to the fp32 route the same way.
bf16: teacher-forced top-1 agreement with the reference of at least 99%, and the mean KL from fp32 reported; on a GPU,
where bf16 is the default, greedy continuations leave the reference's only where its token was a near tie.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nextoken.ops.quant_linear import BlockLinear
from nextoken.sampling_params import SamplingParams
from tests.conftest import DATA, agreement_and_kl, load_reference, needs_native, real_llm

MODELS = ["smollm2", "gemma3"]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/device_check.sh)")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
# (device, weights): fp32 everywhere; the defaults on CPU (on a GPU they are bf16, held to the next test's bar; with the
# native kernels off they are fp32)
EXACT_ROUTES = [("cpu", "fp32"), pytest.param("cpu", "default", marks=needs_native),
                pytest.param("cuda", "fp32", marks=cuda), pytest.param("cuda", "int4", marks=cuda)]
LONG = 800  # tokens: a prompt past Gemma 3's sliding window
NEAR_TIE = 0.25  # nats: bf16 weights move a logit by about this much at most on these prompts


def teacher_forced_logprobs(llm, seq_ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    """log-softmax at every position of seq_ids, via prompt_logprobs over the whole vocabulary's top 20."""
    out = llm.generate([seq_ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20),
                       use_tqdm=False)[0]
    return out.prompt_logprobs


def exact_llm(model: str, device: str, weights: str):  # noqa: ANN201 - a nextoken LLM
    """fp32 weights, the default formats, or (on CUDA) the file's blocks in the Triton kernels."""
    if weights == "int4":
        llm = real_llm(model, "auto", "fp32", device, weights="int4")
        blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, BlockLinear)]
        assert blocks and all(m.kernels == "triton" for m in blocks)
        return llm
    llm = real_llm(model, "float32" if weights == "fp32" else "auto", "fp32", device)
    if weights == "default":
        assert llm.engine.runner.weights == "int4" and llm.engine.runner.lm_head == "int8"
    return llm


def worst_top5_error(rows: list, top5_ids: list[list[int]], top5_logprobs: list[list[float]], name: str) -> float:
    """The largest |log p - reference| over each position's reference top 5 (which must all be in ours, with the same
    top 1)."""
    worst = 0.0
    for pos, (ids, lps) in enumerate(zip(top5_ids, top5_logprobs)):
        mine = dict(rows[pos])
        assert rows[pos][0][0] == ids[0], f"{name} position {pos}: top-1 differs"
        for token_id, lp in zip(ids, lps):
            assert token_id in mine, f"{name} position {pos}: reference top-5 id {token_id} missing"
            worst = max(worst, abs(mine[token_id] - lp))
    return worst


def captured(llm) -> bool:  # noqa: ANN001
    """Whether a GPU model's decode steps replayed CUDA graphs."""
    graphs = llm.engine.runner.graphs
    return graphs is not None and bool(graphs.steps) and all(
        step is not None and step.graph is not None for step in graphs.steps.values())


@pytest.mark.parametrize(("device", "weights"), EXACT_ROUTES)
@pytest.mark.parametrize("model", MODELS)
def test_top5_logprobs_match_reference(model: str, device: str, weights: str) -> None:
    llm = exact_llm(model, device, weights)
    ref = load_reference(model, "hf_top5.json")
    worst = 0.0
    for prompt in ref["prompts"]:
        rows = teacher_forced_logprobs(llm, prompt["seq_ids"])
        assert len(rows) == len(prompt["seq_ids"])
        worst = max(worst, worst_top5_error(rows, prompt["top5_ids"], prompt["top5_logprobs"], prompt["id"]))
    print(f"{model} {weights} on {device}: worst top-5 log-probability error {worst:.2e}")
    assert worst < 1e-3


@needs_native
@pytest.mark.parametrize("model", MODELS)
def test_default_formats_match_fp32_past_the_window(model: str) -> None:
    """A prompt of LONG tokens (the reference prompts joined): the default formats' top-5 log-probabilities at every
    position within 1e-3 of the fp32 route's, as on the reference prompts."""
    refs = load_reference(model, "hf_top5.json")["prompts"]
    ids = refs[0]["seq_ids"][:1] + [t for p in refs for t in p["seq_ids"][1:]][:LONG - 1]
    assert len(ids) == LONG
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    exact = exact_llm(model, "cpu", "fp32").generate([ids], params, use_tqdm=False)[0].prompt_logprobs
    rows = exact_llm(model, "cpu", "default").generate([ids], params, use_tqdm=False)[0].prompt_logprobs
    worst = worst_top5_error(rows, [[i for i, _ in r] for r in exact], [[lp for _, lp in r] for r in exact], "long")
    print(f"{model} default formats, {LONG} tokens: worst top-5 difference from fp32 {worst:.2e}")
    assert worst < 1e-3


@pytest.mark.parametrize(("device", "weights"), EXACT_ROUTES)
@pytest.mark.parametrize("model", MODELS)
def test_greedy_continuations_match_reference(model: str, device: str, weights: str) -> None:
    llm = exact_llm(model, device, weights)
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

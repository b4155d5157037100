"""Every architecture family against the reference implementation: tiny random models built by transformers, written as
GGUF files the way llama.cpp converts them (tests/hf_reference.py) and saved as Hugging Face directories
(safetensors), each format run through the whole engine in fp32.

Teacher-forced top-5 log-probabilities within 1e-4 of transformers' forward at every position; greedy continuations
identical to transformers' own generation, for several prompts batched together, with the prompts' prefill split into
chunks across steps and through the paged cache. Families whose recipe the fused native step covers also run it
(int8 weights), held to the modules by the native tests' bars; the others say why they stay on the modules.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from nextoken import LLM
from nextoken.sampling_params import SamplingParams
from nextoken.trace.run import run_request
from nextoken.trace.report import describe_paths
from nextoken.trace.summary import summarize
from nextoken.trace.tracer import RecordingTracer
from tests.hf_reference import (ARCHS, VOCAB, build, reference_greedy, reference_logprobs, save_directory,
                                write_gguf)
from tests.unit.test_hf_dir import tiny_tokenizer

NAMES = [n for n in ARCHS if n != "phi3-longrope"]  # its reference switches factors by length: its own test
LENGTHS = (40, 23, 9)  # prompts of a batch: past Mistral's 12-token window, and a few blocks of 16 each
NEW_TOKENS = 12


FORMATS = ["gguf", "hf"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path, Path]]:
    """name -> (the transformers model, its GGUF file, its Hugging Face directory)."""
    out = {}
    for i, name in enumerate(NAMES):
        model = build(name, seed=i)
        directory = tmp_path_factory.mktemp(name)
        hf = directory / "hf"
        save_directory(model, hf)
        tiny_tokenizer(hf)
        out[name] = (model, write_gguf(model, name, directory / f"tiny-{name}.gguf"), hf)
    return out


def model_path(models: dict, name: str, fmt: str) -> Path:
    return models[name][1 if fmt == "gguf" else 2]


def prompts(name: str) -> list[list[int]]:
    rng = np.random.default_rng(sum(map(ord, name)))
    return [rng.integers(3, VOCAB, size=n).tolist() for n in LENGTHS]


def fp32_llm(path: Path, **options) -> LLM:  # noqa: ANN003
    return LLM(str(path), weights="fp32", kv_dtype="fp32", device="cpu", kv_cache_bytes=8 << 20, **options)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_top5_logprobs_match_transformers(models: dict, name: str, fmt: str) -> None:
    model, path = models[name][0], model_path(models, name, fmt)
    llm = fp32_llm(path)
    for ids in prompts(name):
        ref = reference_logprobs(model, ids)
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20), use_tqdm=False)[0]
        for pos in range(len(ids) - 1):  # prompt_logprobs[pos]: the distribution after token pos
            mine = dict(out.prompt_logprobs[pos])
            top = ref[pos].topk(5)
            assert out.prompt_logprobs[pos][0][0] == int(top.indices[0]), f"{name} position {pos}: top-1 differs"
            for token, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(mine[token] - lp) < 1e-4, f"{name} position {pos} token {token}: {mine[token]} vs {lp}"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", NAMES)
def test_greedy_continuations_match_transformers_batched_and_chunked(models: dict, name: str, fmt: str) -> None:
    model, path = models[name][0], model_path(models, name, fmt)
    want = [reference_greedy(model, ids, NEW_TOKENS) for ids in prompts(name)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # Chunks of 16 tokens a step: the longest prompt's prefill spans three steps, beside the others' decodes.
    llm = fp32_llm(path, max_num_batched_tokens=16, enable_chunked_prefill=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts(name), params, use_tqdm=False)]
    assert got == want


def test_the_mistral_window_matters_here(models: dict) -> None:
    """Mistral's sliding window changes the reference at these lengths: the test above holds it, not just attention."""
    model = models["mistral"][0]
    ids = prompts("mistral")[0]
    windowed = reference_logprobs(model, ids)
    model.config.sliding_window = None
    try:
        assert (reference_logprobs(model, ids)[20:] - windowed[20:]).abs().max() > 1e-2
    finally:
        model.config.sliding_window = ARCHS["mistral"][1]["sliding_window"]


def test_phi3_longrope_factors_past_the_original_context(tmp_path: Path) -> None:
    """Phi-3's long factors and attention factor, for a 40-token prompt past the 32 the model was trained at
    (transformers then takes the long factors for the whole sequence; nextoken takes them for any sequence of a model
    whose context is longer than that, as llama.cpp does)."""
    model = build("phi3-longrope", seed=11)
    llm = fp32_llm(write_gguf(model, "phi3-longrope", tmp_path / "tiny-phi3-longrope.gguf"))
    rope = llm.model_config.rope
    assert rope.freq_factors == tuple(ARCHS["phi3-longrope"][1]["rope_parameters"]["long_factor"])
    assert rope.attention_factor > 1.0
    ids = prompts("phi3")[0]
    ref = reference_logprobs(model, ids)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20), use_tqdm=False)[0]
    for pos in range(len(ids) - 1):
        mine = dict(out.prompt_logprobs[pos])
        top = ref[pos].topk(5)
        for token, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(mine[token] - lp) < 1e-4, f"position {pos} token {token}: {mine[token]} vs {lp}"


NATIVE = [n for n in NAMES if n not in ("gpt2", "mixtral", "qwen2moe")]


@pytest.mark.parametrize("name", NAMES)
def test_the_fused_step_runs_every_recipe_it_covers(models: dict, name: str) -> None:
    """With block weights, families the native step covers run fused; the others run on the modules, and a trace
    says which parts keep them there."""
    path = models[name][1]
    llm = LLM(str(path), weights="int8", device="cpu", kv_cache_bytes=8 << 20)
    model = llm.engine.runner.model
    gaps = model.config.recipe.native_gaps()
    if name in NATIVE:
        assert model.fused is not None and not gaps
    else:
        assert model.fused is None and gaps
        run = run_request(llm, "the cat", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                          tracer=RecordingTracer(top_k=5))
        summary = summarize(llm, run)
        assert summary.native_gaps == gaps
        assert f"the native step has no {', '.join(gaps)}" in describe_paths(summary.paths, summary.native_gaps)


def test_moe_cost_counts_the_experts_a_token_takes(models: dict) -> None:
    from nextoken.trace.cost import ModelCost

    llm = fp32_llm(models["mixtral"][1])
    cfg = llm.model_config
    assert (cfg.num_experts, cfg.experts_per_token, cfg.recipe.mlp) == (4, 2, "moe")
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = h * (q + 2 * kv) + q * h
    assert ModelCost.from_config(cfg).block_params == cfg.num_layers * (
        attention + h * 4 + 2 * 3 * h * cfg.expert_ffn_size)


def test_moe_routes_each_token_to_its_top_experts(models: dict) -> None:
    """The router's choice per token, kept for a tracer: k distinct experts, weights as the family scales them."""
    for name, renormalized in (("mixtral", True), ("qwen2moe", False)):
        llm = fp32_llm(models[name][1])
        llm.generate([prompts(name)[0]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        chosen, weights = llm.engine.runner.model.layers[0].mlp.last_choice
        assert chosen.shape[1] == 2 and bool((chosen[:, 0] != chosen[:, 1]).all())
        sums = weights.sum(-1)
        assert torch.allclose(sums, torch.ones_like(sums)) == renormalized


def test_trace_shows_each_tokens_router_choice(models: dict) -> None:
    from rich.console import Console

    from nextoken.trace.report import print_report

    llm = fp32_llm(models["mixtral"][1])
    tracer = RecordingTracer(top_k=5)
    run = run_request(llm, "the cat", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), tracer=tracer)
    steps = [s for s in tracer.steps if s.router]
    assert len(steps) == 4 and all(sorted(s.router) == [0, 1] for s in steps)
    for step in steps:
        for experts, weights in step.router.values():
            assert len(set(experts)) == 2 and abs(sum(weights) - 1) < 1e-5
    console = Console(record=True, width=200)
    print_report(console, llm, run, summarize(llm, run), 5)
    text = console.export_text()
    assert "router: the experts each step's last row took" in text
    experts, weights = steps[-1].router[1]
    assert f"{experts[0]}x{weights[0]:.2f} {experts[1]}x{weights[1]:.2f}" in text

"""RecordingTracer on the tiny models: a traced run draws what an untraced one draws, its stage times add up to the
measured total, its candidates are the model's teacher-forced distribution, and its attention weights reproduce the
model's own attention output. References are independent: the engine's `score` forward pass, a naive sampler, and
the values and outputs the attention layers produce (read through hooks of the test's own). "q8_*" models run the
fused paths (tests/trace/test_fast_path.py); their attention comes from each step's re-run on the modules."""

from __future__ import annotations

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.errors import PromptTooLong
from nextoken.sampling_params import StructuredOutputs
from nextoken.trace.attention import select_layers
from nextoken.trace.run import run_request
from nextoken.trace.tracer import STAGES, NullTracer, RecordingTracer
from tests.conftest import needs_native

PROMPT = "the cat sat on the mat"


def hook_count(llm: LLM) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in llm.engine.runner.model.modules())


@pytest.mark.parametrize("arch", ["llama", "gemma", pytest.param("q8_llama", marks=needs_native),
                                  pytest.param("q8_gemma", marks=needs_native)])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=12,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_traced_run_draws_the_untraced_tokens(arch: str, params: SamplingParams,
                                              request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(f"{arch}_llm")
    sampler = llm.engine.sampler
    untraced = run_request(llm, PROMPT, params)
    tracer = RecordingTracer(top_k=5, capture_attention=True)
    traced = run_request(llm, PROMPT, params, tracer=tracer)
    assert len(traced.output_ids) == 12
    assert traced.output_ids == untraced.output_ids
    assert [s.token_id for s in tracer.samples] == traced.output_ids
    if params.is_greedy:  # and the public API agrees
        assert llm.generate([traced.prompt_ids], params)[0].token_ids == traced.output_ids
    assert hook_count(llm) == 0 and llm.engine.sampler is sampler  # nothing left behind
    assert llm.engine.runner.model.probe is None


def test_null_tracer_attaches_nothing(llama_llm: LLM) -> None:
    sampler = llama_llm.engine.sampler
    tracer = NullTracer()
    tracer.attach(llama_llm.engine)
    assert hook_count(llama_llm) == 0 and llama_llm.engine.sampler is sampler
    tracer.detach()


def test_a_recording_tracer_records_one_run(llama_llm: LLM) -> None:
    tracer = RecordingTracer()
    run_request(llama_llm, PROMPT, SamplingParams(temperature=0, max_tokens=2), tracer=tracer)
    with pytest.raises(RuntimeError, match="one run"):
        run_request(llama_llm, PROMPT, SamplingParams(temperature=0, max_tokens=2), tracer=tracer)
    assert hook_count(llama_llm) == 0 and not llama_llm.engine.has_unfinished()


def test_tracer_detaches_when_the_request_is_refused(llama_llm: LLM) -> None:
    sampler = llama_llm.engine.sampler
    with pytest.raises(PromptTooLong):
        run_request(llama_llm, PROMPT, SamplingParams(max_tokens=10_000), tracer=RecordingTracer())
    assert hook_count(llama_llm) == 0 and llama_llm.engine.sampler is sampler
    assert not llama_llm.engine.has_unfinished()


@pytest.mark.parametrize("arch", ["llama", pytest.param("q8_llama", marks=needs_native)])
def test_stage_times_add_up_to_the_measured_total(arch: str, request: pytest.FixtureRequest) -> None:
    llama_llm: LLM = request.getfixturevalue(f"{arch}_llm")
    shares = []
    for _ in range(3):  # a run of a few ms on a busy machine may be descheduled between two spans: the best of 3
        tracer = RecordingTracer()
        run = run_request(llama_llm, PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          tracer=tracer)
        stages = tracer.stage_seconds()
        accounted = sum(stages.values())
        assert accounted <= run.total_s * 1.0001  # spans never overlap...
        shares.append(accounted / run.total_s)
        if shares[-1] >= 0.9:
            break
    assert max(shares) >= 0.9, (shares, {k: round(v * 1e3, 3) for k, v in stages.items()})  # ...and miss little
    for stage in STAGES:
        assert stages[stage] > 0, stage
    # Every step measured every stage of the pipeline, in pipeline order.
    assert [s.phase for s in tracer.steps] == ["prefill"] + ["decode"] * 15
    for step in tracer.steps:
        spans = [step.spans[s] for s in STAGES[1:]]
        for (start, end), (next_start, _) in zip(spans, spans[1:]):
            assert start <= end <= next_start
    prefill, decode = tracer.stage_seconds("prefill"), tracer.stage_seconds("decode")
    assert all(prefill[s] + decode[s] == pytest.approx(stages[s]) for s in STAGES)


@pytest.mark.parametrize("arch", ["gemma", pytest.param("q8_gemma", marks=needs_native)])
def test_layer_times_cover_every_layer_in_both_phases(arch: str, request: pytest.FixtureRequest) -> None:
    gemma_llm: LLM = request.getfixturevalue(f"{arch}_llm")
    tracer = RecordingTracer()
    run_request(gemma_llm, PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), tracer=tracer)
    blocks = tracer.stage_seconds()["blocks"]
    for phase in ("prefill", "decode"):
        layers = tracer.layer_seconds(phase)
        assert len(layers["attn"]) == gemma_llm.model_config.num_layers
        assert all(t > 0 for t in layers["attn"] + layers["mlp"])
    total = sum(sum(tracer.layer_seconds(p)[k]) for p in ("prefill", "decode") for k in ("attn", "mlp", "other"))
    assert total <= blocks * 1.0001  # the per-layer parts fit inside the blocks span


def naive_sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then the k most likely, then the smallest prefix reaching top_p, written out longhand."""
    scaled = (logits / temperature).double()
    order = sorted(range(len(scaled)), key=lambda i: -float(scaled[i]))[:top_k]
    weights = {i: float(scaled[i].exp()) for i in order}
    norm = sum(weights.values())
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += weights[i] / norm
        if mass >= top_p:
            break
    out = torch.zeros(len(scaled), dtype=torch.float64)
    for i in kept:
        out[i] = weights[i]
    return out / out.sum()


def test_candidates_are_the_model_distribution_before_and_after_filtering(llama_llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=8, ignore_eos=True)
    tracer = RecordingTracer(top_k=10)
    run = run_request(llama_llm, PROMPT, params, tracer=tracer, raw=True)
    ids = run.prompt_ids + run.output_ids
    # Teacher-forced reference: one forward pass over the whole sequence; row p predicts token p + 1.
    reference = llama_llm.engine.runner.score(ids[:-1])
    n = len(run.prompt_ids)
    for i, rec in enumerate(tracer.samples):
        row = reference[n - 1 + i]
        top = row.softmax(dim=-1).topk(10)
        assert rec.top_ids == top.indices.tolist()
        assert rec.raw_probs == pytest.approx(top.values.tolist(), abs=1e-5)
        assert rec.temp_probs == pytest.approx((row / 0.8).softmax(-1)[rec.top_ids].tolist(), abs=1e-5)
        expected = naive_sampling_probs(row, 0.8, 20, 0.9)
        assert rec.final_probs == pytest.approx(expected[rec.top_ids].tolist(), abs=1e-5)
        assert rec.num_kept == int((expected > 0).sum())
        assert rec.token_id == run.output_ids[i] and rec.drawn_final_prob > 0
        nonzero = expected[expected > 0]
        assert rec.entropy_final == pytest.approx(float(-(nonzero * nonzero.log2()).sum()), abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma", pytest.param("q8_llama", marks=needs_native),
                                  pytest.param("q8_gemma", marks=needs_native)])
def test_attention_weights_reproduce_the_model_attention_output(arch: str, request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(f"{arch}_llm")
    cfg = llm.model_config
    values: dict[tuple[int, int], torch.Tensor] = {}  # (layer, position) -> v [kv_heads, head_dim]
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # (layer, position) -> attention output [heads, head_dim]
    handles = []
    for i, layer in enumerate(llm.engine.runner.model.layers):
        state: dict[str, list[int]] = {}

        def on_attn(module: torch.nn.Module, args: tuple, state: dict = state) -> None:
            state["pos"] = args[1].tolist()

        def on_qkv(module: torch.nn.Module, args: tuple, out: torch.Tensor, i: int = i, state: dict = state) -> None:
            v = out[:, -cfg.num_kv_heads * cfg.head_dim:].reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            for j, p in enumerate(state["pos"]):
                values[(i, p)] = v[j].clone()

        def on_o(module: torch.nn.Module, args: tuple, i: int = i, state: dict = state) -> None:
            o = args[0].reshape(-1, cfg.num_heads, cfg.head_dim)
            for j, p in enumerate(state["pos"]):
                outputs[(i, p)] = o[j].clone()

        handles += [layer.attn.register_forward_pre_hook(on_attn),
                    layer.attn.qkv_proj.register_forward_hook(on_qkv),
                    layer.attn.o_proj.register_forward_pre_hook(on_o)]
    try:
        tracer = RecordingTracer(capture_attention=True)
        run_request(llm, PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), tracer=tracer)
    finally:
        for h in handles:
            h.remove()
    capture = tracer.attention
    assert capture is not None and capture.layers == list(range(cfg.num_layers))
    group = cfg.num_heads // cfg.num_kv_heads
    assert sorted(capture.rows) == list(range(len(capture.rows)))  # every prompt and decode query position
    for p, rows in capture.rows.items():
        for slot, layer in enumerate(capture.layers):
            weights = rows[slot].float()  # [heads, p + 1]
            assert weights.sum(dim=-1) == pytest.approx([1.0] * cfg.num_heads, abs=2e-3)
            if cfg.layer_is_sliding[layer] and p + 1 > cfg.sliding_window:
                assert bool((weights[:, :p + 1 - cfg.sliding_window] == 0).all())
            v = torch.stack([values[(layer, k)] for k in range(p + 1)]).repeat_interleave(group, dim=1)
            got = torch.einsum("hk,khd->hd", weights, v)
            torch.testing.assert_close(got, outputs[(layer, p)], atol=5e-3, rtol=1e-2)


def test_attention_capture_stays_within_its_budget(gemma_llm: LLM) -> None:
    # 30 prompt tokens + 6 generated, 2 heads: 2 x (1 + ... + 35) = 1260 weights per layer; 3000 fit two layers.
    tracer = RecordingTracer(capture_attention=True, attention_budget=3000)
    run = run_request(gemma_llm, PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), tracer=tracer)
    capture = tracer.attention
    assert capture is not None and len(run.prompt_ids) == 30
    assert capture.layers == [0, 5]
    assert capture.num_weights == 2 * 1260 <= 3000


def test_select_layers_spreads_evenly_with_both_ends() -> None:
    assert select_layers(30, 40) == list(range(30))
    assert select_layers(30, 4) == [0, 10, 19, 29]
    assert select_layers(30, 1) == [29]


def test_each_processor_is_shown_with_the_logits_it_changed_and_the_grammar_with_what_it_allowed(
        llama_llm: LLM) -> None:
    tok = llama_llm.engine.tokenizer
    digits = {tok.token_to_id(str(d)) for d in range(10)}
    first = run_request(llama_llm, PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)).output_ids
    banned = first[0]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=4, logit_bias={banned: -100, 7: 3.5},
                            repetition_penalty=1.3, structured_outputs=StructuredOutputs(regex="[0-9]{4}"))
    tracer = RecordingTracer()
    run = run_request(llama_llm, PROMPT, params, tracer=tracer)
    assert all(t in digits for t in run.output_ids) and len(run.output_ids) == 4
    for step, rec in enumerate(tracer.samples):
        effects = {e.name: e for e in rec.effects}
        assert list(effects) == ["penalties", "structured_outputs", "logit_bias"]  # the sampler's order
        grammar = effects["structured_outputs"]
        assert grammar.num_allowed == 10 and set(grammar.allowed_ids) <= digits  # what the grammar allowed here
        assert grammar.num_changed == llama_llm.engine.inputs.vocab_size - 10
        assert effects["logit_bias"].num_changed == 2 and set(effects["logit_bias"].ids) == {banned, 7}
        seen = set(run.prompt_ids) | set(run.output_ids[:step])
        assert effects["penalties"].num_changed == len(seen)  # every token already seen, and nothing else
    plain = RecordingTracer()
    run_request(llama_llm, PROMPT, SamplingParams(temperature=0, max_tokens=2), tracer=plain)
    assert all(not rec.effects for rec in plain.samples)

"""A trace observes the path an untraced request runs. On tiny models whose steps run fused (the prompt's blocks as
one native call where the CPU has AVX-512, every decode step as one), a traced run makes the same native calls as an
untraced one and draws the same tokens; its per-layer times come from the calls' own counters; greedy steps whose
argmax the native call took still show their candidates, as the engine's own log-probabilities of the same step
rank them; attention maps come from a re-run of each fused step on the modules, which agrees with the fused step and
leaves the engine's cache as it was; and an untraced run hands the native calls no profile at all."""

from __future__ import annotations

import math

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.ops.fused import FusedDecoder, NativeStep
from nextoken.models.probe import FUSED_BLOCKS, MODULES, NATIVE_STEP
from nextoken.ops import native
from nextoken.trace import tracer as tracer_module
from nextoken.trace.run import run_request
from nextoken.trace.tracer import RecordingTracer
from tests.conftest import needs_native

pytestmark = needs_native

PROMPT = "the cat sat on the mat"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Each native step's and fused blocks call's profile (None: untimed), as the call was made."""
    seen: dict[str, list] = {NATIVE_STEP: [], FUSED_BLOCKS: []}
    decode_step, decode_layers = native.decode_step, native.decode_layers
    monkeypatch.setattr(native, "decode_step", lambda lib, plan, *a: seen[NATIVE_STEP].append(plan.profile) or
                        decode_step(lib, plan, *a))
    monkeypatch.setattr(native, "decode_layers", lambda *a: seen[FUSED_BLOCKS].append(a[13]) or decode_layers(*a))
    return seen


def expected_paths(llm: LLM, num_steps: int) -> list[str]:
    fused = llm.engine.runner.model.fused
    assert fused is not None
    return [FUSED_BLOCKS if fused.chunks else MODULES] + [NATIVE_STEP] * (num_steps - 1)


@pytest.mark.parametrize("arch", ["llama", "gemma"])
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_traced_run_takes_the_untraced_path(arch: str, params: SamplingParams, calls: dict[str, list],
                                              request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(f"q8_{arch}_llm")
    untraced = run_request(llm, PROMPT, params)
    counts = {path: len(seen) for path, seen in calls.items()}
    tracer = RecordingTracer(top_k=5)
    traced = run_request(llm, PROMPT, params, tracer=tracer)
    assert traced.output_ids == untraced.output_ids
    assert {path: len(seen) - counts[path] for path, seen in calls.items()} == counts  # the same native calls
    assert counts[NATIVE_STEP] == 5
    assert [s.path for s in tracer.steps] == expected_paths(llm, 6)
    assert [s.phase for s in tracer.steps] == ["prefill"] + ["decode"] * 5
    for step in tracer.steps:
        # From the native calls' counters (the module path's hooks where the prompt ran there): every layer timed,
        # its attention and MLP inside its block, the blocks inside the blocks stage.
        assert all(a > 0 and m > 0 and a + m < b for a, m, b in zip(step.attn_s, step.mlp_s, step.block_s))
        assert sum(step.block_s) <= step.seconds("blocks") * 1.0001
        assert all(step.seconds(stage) > 0 for stage in ("schedule", "embedding", "blocks", "lm_head", "sampling"))
    assert [s.token_id for s in tracer.samples] == traced.output_ids  # a candidate list for every token


def test_greedy_native_steps_show_the_candidates_the_engine_ranks(q8_llama_llm: LLM) -> None:
    """A greedy native step takes the argmax in C and no sampler runs: its candidates come from the logits the call
    wrote. The same request asking for log-probabilities (its steps still native, the sampler then ranks the rows)
    is the reference."""
    tracer = RecordingTracer(top_k=4)
    run = run_request(q8_llama_llm, PROMPT, GREEDY, tracer=tracer)
    reference = q8_llama_llm.generate([run.prompt_ids], SamplingParams(temperature=0, max_tokens=6, logprobs=4,
                                                                       ignore_eos=True), use_tqdm=False)[0]
    assert reference.token_ids == run.output_ids
    for step, (token_id, (chosen, top)) in zip(tracer.steps, zip(reference.token_ids, reference.outputs[0].logprobs)):
        rec = step.sample
        assert rec is not None and rec.token_id == token_id and rec.drawn_rank == 0
        assert rec.top_ids == [t for t, _ in top]
        assert [math.log(p) for p in rec.raw_probs] == pytest.approx([lp for _, lp in top], abs=1e-4)
    assert sum(s.path == NATIVE_STEP for s in tracer.steps) == 5


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_attention_maps_rerun_fused_steps_on_the_modules(arch: str, calls: dict[str, list],
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(f"q8_{arch}_llm")
    untraced = run_request(llm, PROMPT, GREEDY)
    pool = llm.engine.runner.kv_pool
    unchanged: list[bool] = []
    replay = tracer_module.replay_on_modules

    def bits(t: torch.Tensor) -> torch.Tensor:  # compared as bytes: slots never written may hold NaN patterns
        return t.view(torch.uint8).clone()

    def watched(*args: object) -> object:  # the engine's cache before and after each re-run
        before = [(bits(layer.k), bits(layer.v)) for layer in pool.layers]
        agreement = replay(*args)
        unchanged.append(all(torch.equal(k, bits(layer.k)) and torch.equal(v, bits(layer.v))
                             for (k, v), layer in zip(before, pool.layers)))
        return agreement

    monkeypatch.setattr(tracer_module, "replay_on_modules", watched)
    tracer = RecordingTracer(capture_attention=True)
    traced = run_request(llm, PROMPT, GREEDY, tracer=tracer)
    assert traced.output_ids == untraced.output_ids
    assert [s.path for s in tracer.steps] == expected_paths(llm, 6)
    fused = [s for s in tracer.steps if s.path != MODULES]
    assert len(unchanged) == len(fused) and all(unchanged)  # the re-runs wrote only into their private copies
    for step in tracer.steps:
        if step.path == MODULES:
            assert step.replay is None  # its maps are the run's own
            continue
        agreement = step.replay
        assert agreement is not None and agreement.agrees
        assert agreement.logits_diff is not None and agreement.logits_diff <= agreement.logits_bar
        assert agreement.kv_diff <= agreement.kv_bar
    capture = tracer.attention
    assert capture is not None
    assert sorted(capture.rows) == list(range(len(traced.prompt_ids) + 5))  # every query position has its map


def test_a_rerun_that_disagrees_is_flagged(q8_llama_llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar is not vacuous: a fused step whose logits were off by 0.1 (a misplaced window or slot moves them by
    about 1) does not pass it."""
    replay = tracer_module.replay_on_modules

    def off(model, pool, table, ids, first, logits, int8):  # type: ignore[no-untyped-def]
        return replay(model, pool, table, ids, first, None if logits is None else logits + 0.1, int8)

    monkeypatch.setattr(tracer_module, "replay_on_modules", off)
    tracer = RecordingTracer(capture_attention=True)
    run_request(q8_llama_llm, PROMPT, GREEDY, tracer=tracer)
    assert tracer.replays and not any(a.agrees for a in tracer.replays)
    assert all(a.logits_diff is not None and a.logits_diff > a.logits_bar for a in tracer.replays)


def test_counters_cost_nothing_when_off(q8_gemma_llm: LLM, calls: dict[str, list]) -> None:
    """Untraced, every native call gets a null profile (nothing is timed); a traced run's profile is handed over
    only while its tracer is attached."""
    model = q8_gemma_llm.engine.runner.model
    run_request(q8_gemma_llm, PROMPT, GREEDY)
    assert calls[NATIVE_STEP] and all(p is None for seen in calls.values() for p in seen)
    tracer = RecordingTracer()
    run_request(q8_gemma_llm, PROMPT, GREEDY, tracer=tracer)
    timed = calls[NATIVE_STEP][5:]
    assert len(timed) == 5 and all(p is not None for p in timed)
    assert model.probe is None
    step = q8_gemma_llm.engine.runner._step[1]
    assert isinstance(step, NativeStep) and step.plan.profile is None
    before = len(calls[NATIVE_STEP])
    run_request(q8_gemma_llm, PROMPT, GREEDY)
    assert calls[NATIVE_STEP][before:] == [None] * 5
    assert isinstance(model.fused, FusedDecoder)

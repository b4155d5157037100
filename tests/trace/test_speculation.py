"""`trace` under speculative decoding: each decode step's proposals, who made them, which the verifying pass accepted
or rejected, and why. References are independent of the tracer: the proposals the engine's speculator really made
(read by the test's own wrapper around it), plain decoding's tokens (a second engine without speculation), and the
model's teacher-forced distribution (the engine's `score` forward pass, sampled with a naive sampler)."""

from __future__ import annotations

import io
import random
import re
from pathlib import Path

import pytest

from nextoken import LLM, SamplingParams
from nextoken.engine.request import Request
from nextoken.trace.command import TraceOptions, trace
from nextoken.trace.report import make_console
from nextoken.trace.run import run_request
from nextoken.trace.tracer import RecordingTracer
from tests.tiny import write_tiny_model
from tests.trace.test_html import run_chromium
from tests.trace.test_tracer import naive_sampling_probs

# A prompt that repeats itself, so that prompt lookup has something to copy.
PROMPT = "on at en on at en on at en on at en the cat sat on the mat the cat sat on the mat the cat"


def _spec_llm(path: Path, wrong: float) -> tuple[LLM, list[tuple[int, list[int]]]]:
    """Speculation at full length on every step, each proposed token replaced by a random one with probability
    `wrong` (rejections everywhere); and the list of (output length, proposal) the engine verified, as the test's
    own wrapper saw them."""
    llm = LLM(str(path), weights="fp32", device="cpu", kv_cache_bytes=4 << 20, enable_prefix_caching=False,
              speculative="ngram", num_speculative_tokens=4)
    speculator = llm.engine.speculator
    assert speculator is not None
    speculator.adaptive = False
    seen: list[tuple[int, list[int]]] = []
    rng = random.Random(0)
    propose = speculator.propose

    def corrupted(requests: list[Request], max_model_len: int) -> None:
        propose(requests, max_model_len)
        for req in requests:
            req.spec_ids = [rng.randrange(llm.model_config.vocab_size) if rng.random() < wrong else t
                            for t in req.spec_ids]
            if req.spec_ids:
                seen.append((len(req.output_ids), list(req.spec_ids)))

    speculator.propose = corrupted  # type: ignore[method-assign]
    return llm, seen


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5, max_tokens=24,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_each_proposal_is_judged_by_the_token_the_target_drew(tiny_llama: Path, params: SamplingParams) -> None:
    llm, seen = _spec_llm(tiny_llama, wrong=0.3)
    tracer = RecordingTracer(top_k=5)
    run = run_request(llm, PROMPT, params, tracer=tracer, raw=True)
    plain = LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=4 << 20)
    assert run.output_ids == plain.generate([run.prompt_ids], params)[0].token_ids  # speculation changes nothing
    assert [s.token_id for s in tracer.samples] == run.output_ids  # one record per token, in order
    records = tracer.speculation
    verifying = [(first, r) for first, r in records if r.verdicts]
    # Every verifying step the engine ran is in the trace, with the proposals the engine verified.
    assert [(first, [v.token_id for v in r.verdicts]) for first, r in verifying] == seen
    assert any(v.status == "rejected" for _, r in verifying for v in r.verdicts)
    assert any(v.status == "accepted" for _, r in verifying for v in r.verdicts)
    ids = run.prompt_ids + run.output_ids
    reference = llm.engine.runner.score(ids[:-1])  # row p predicts token p + 1
    n = len(run.prompt_ids)
    for first, r in verifying:
        m = r.num_accepted
        statuses = [v.status for v in r.verdicts]
        assert statuses == ["accepted"] * m + (["rejected"] + ["unchecked"] * (len(statuses) - m - 1)
                                               if m < len(statuses) else [])
        for j, v in enumerate(r.verdicts[:m + 1]):
            assert v.drawn_id == run.output_ids[first + j]  # the row's draw is the token kept at that position
            assert (v.token_id == v.drawn_id) == (v.status == "accepted")
            row = reference[n - 1 + first + j]
            expected = row.softmax(-1) if params.is_greedy else naive_sampling_probs(row, 0.9, 20, 0.9)
            assert v.target_prob == pytest.approx(float(expected[v.token_id]), abs=1e-5)
            assert v.drawn_prob == pytest.approx(float(expected[v.drawn_id]), abs=1e-5)
        assert len(r.kept) == m  # the step's tokens: its first row's, then one per accepted proposal
        assert r.match is not None and r.match[0] >= 2
    text = "".join(r.reason(llm.tokenizer) for _, r in verifying)
    assert "proposed by ngram (after a repeated" in text and "rejected: the target drew" in text


def test_a_sampled_draft_is_judged_by_the_rejection_rule(tiny_llama: Path, tmp_path: Path) -> None:
    """Unseeded sampling with a draft model keeps its rule under the tracer: the draft draws its proposals from its
    own distribution q, and each verdict shows p(x) (the trace's own row: the model's teacher-forced distribution),
    q(x) (the draft's, teacher-forced) and the uniform u: accepted while u q(x) < p(x); at the rejection the step
    keeps a token drawn from the residual. The trace's tokens are the request's, in order."""
    draft = write_tiny_model(tmp_path / "draft.gguf", "llama", seed=7)  # other weights, the same vocabulary
    llm = LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=4 << 20, enable_prefix_caching=False,
              speculative=f"draft:{draft}", num_speculative_tokens=3)
    speculator = llm.engine.speculator
    assert speculator is not None and speculator.draft is not None
    speculator.adaptive = False
    speculator.generator.manual_seed(3)  # the draft's draws and the rule's uniforms: one run, repeatable
    tracer = RecordingTracer(top_k=5)
    params = SamplingParams(temperature=2.0, top_k=20, max_tokens=40, ignore_eos=True)
    run = run_request(llm, PROMPT, params, tracer=tracer, raw=True)
    assert [s.token_id for s in tracer.samples] == run.output_ids
    verifying = [(first, r) for first, r in tracer.speculation if r.verdicts]
    assert verifying and all(r.sampled for _, r in verifying)
    ids = run.prompt_ids + run.output_ids
    target = llm.engine.runner.score(ids[:-1])
    drafts = speculator.draft.runner.score(ids[:-1])
    n = len(run.prompt_ids)
    statuses = set()
    for first, r in verifying:
        m = r.num_accepted
        assert [v.status for v in r.verdicts][:m + 1] == ["accepted"] * m + (["rejected"] if m < len(r.verdicts)
                                                                             else [])
        for j, v in enumerate(r.verdicts[:m + 1]):
            statuses.add(v.status)
            at = n - 1 + first + j
            assert v.target_prob == pytest.approx(float(naive_sampling_probs(target[at], 2.0, 20, 1.0)[v.token_id]),
                                                  abs=1e-5)
            assert v.draft_prob == pytest.approx(float(naive_sampling_probs(drafts[at], 2.0, 20, 1.0)[v.token_id]),
                                                 abs=1e-5)
            assert (v.uniform * v.draft_prob < v.target_prob) == (v.status == "accepted")
            assert v.drawn_id == run.output_ids[first + j]  # what the step kept there
            assert (v.drawn_id == v.token_id) == (v.status == "accepted") or v.status == "rejected"
        assert len(r.kept) == m
    assert statuses == {"accepted", "rejected"}
    text = "".join(r.reason(llm.tokenizer) for _, r in verifying)
    notes = [note for _, r in verifying for note in r.token_notes(llm.tokenizer)]
    assert "from the residual max(0, p - q)" in text and any(note.startswith("proposed by draft:") for note in notes)


def test_a_step_that_proposes_nothing_says_why(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=4 << 20, enable_prefix_caching=False,
              speculative="ngram", num_speculative_tokens=4)
    tracer = RecordingTracer()
    # Distinct words: no n-gram ends the prompt twice, and max_tokens leaves no room at the last step.
    run = run_request(llm, "alpha beta gamma", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                      tracer=tracer, raw=True)
    notes = [r.reason(llm.tokenizer) for _, r in tracer.speculation]
    assert len(notes) == len(run.output_ids) - 1  # every decode step (the first token comes from the prefill)
    assert notes[-1].startswith("no room")
    assert all(n.startswith(("no proposal", "no room", "held back", "1 proposed", "2 proposed")) for n in notes)


def test_the_command_shows_proposals_in_the_terminal_and_on_the_page(tiny_llama: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.html"
    buffer = io.StringIO()
    trace(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
          TraceOptions(model=str(tiny_llama), device="cpu", weights="fp32", raw=True, speculative="ngram",
                       num_speculative_tokens=4, html=out), make_console(buffer))
    printed = buffer.getvalue()
    summary = re.search(r"speculative decoding \(ngram\): (\d+) tokens proposed over (\d+) of (\d+) decode steps, "
                        r"(\d+) accepted", printed)
    assert summary is not None, printed[-3000:]
    assert int(summary.group(3)) >= 1 and int(summary.group(4)) <= int(summary.group(1))
    assert "every decode step: proposals" in printed
    result = run_chromium(out, tmp_path, "--dump-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'id="spec"' in result.stdout and "speculative decoding (ngram)" in result.stdout
    accepted = int(summary.group(4))
    assert result.stdout.count("tok gen accepted") + result.stdout.count("tok gen special accepted") == accepted


def test_trace_takes_the_speculative_options_on_the_command_line(tiny_llama: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from nextoken.cli import main

    assert main(["trace", PROMPT, "--model", str(tiny_llama), "--device", "cpu", "--raw", "--max-tokens", "8",
                 "--speculative", "ngram", "--num-speculative-tokens", "3"]) == 0
    assert "speculative decoding (ngram)" in capsys.readouterr().out
    assert main(["trace", "hi", "--model", str(tiny_llama), "--num-speculative-tokens", "3"]) == 2
    assert "num_speculative_tokens is set but speculative is not" in capsys.readouterr().err

"""Speculative decoding: tokens proposed cheaply, then verified in one forward pass of the target model, so that a
step can yield several tokens without changing what is generated (Leviathan et al. 2022; Chen et al. 2023).

Proposers: prompt lookup (engine/ngram.py), draft models (engine/draft.py) and the model itself with a cut head
(engine/head_draft.py); how many of a sequence's proposals are verified: engine/spec_policy.py.

Verification (LLMEngine.step): the scheduler computes a request's proposals after its last known token, and each
gets a logits row. Every row is sampled as plain decoding would sample it at that point: penalties and processors
over the output as it would stand there (output + the proposals before it), the same filters, and the uniform that
plain decoding would use for that output position (a request's generator gives row j the (len(output) + j)-th
draw, and is put back to just past the tokens kept). The proposals are accepted while they equal the sampled
tokens; the first sampled token that differs (or the one after the last proposal) is kept too. For a proposer
that is deterministic given the sequence, this is the rejection rule with a one-hot proposal q = [x]: x is kept
with probability p(x), and on rejection the token is drawn from p without x, renormalized; so the output
distribution is the target's exactly, greedy output is plain greedy decoding's, and a seeded request draws the
same tokens (up to a logit's last bits, which may move with the rows of a pass).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from nextoken.cache.block_manager import BlockManager
from nextoken.config import EngineConfig
from nextoken.engine.draft import DraftModel
from nextoken.engine.head_draft import HeadDraft
from nextoken.engine.rejection import Decision, RuleTrail, distributions, rejection_rule
from nextoken.engine.request import Request
from nextoken.engine.runner import ModelRunner
from nextoken.engine.sampler import SampleResult, Sampler, SamplingRow
from nextoken.engine.scheduler import ScheduledRequest, Scheduler
from nextoken.engine.spec_policy import (SHADOW_TOKENS, KPolicy, SeqSpec, SpecChoice, StepCosts, calibrate,
                                        num_accepted)


def restore_generator(generator: torch.Generator, state: torch.Tensor, num_kept: int) -> None:
    """A request's generator put back to `state` (before its verifying rows drew) and past the draws of the
    `num_kept` tokens kept: the sampler's one fp64 uniform per token (Sampler.rewind's convention), so the next
    step draws what plain decoding would."""
    generator.set_state(state)
    for _ in range(num_kept):
        torch.rand(1, dtype=torch.float64, generator=generator)


def sampling_rows(scheduled: Sequence[ScheduledRequest], sampling: Sequence[tuple[int, int]]
                  ) -> tuple[list[SamplingRow], list[int], dict[int, torch.Tensor]]:
    """A step's rows to sample, from (scheduled item, its first logits row) of each chunk that samples: one per
    chunk, and one more per proposal, row j as plain decoding would sample it once the proposals before it are the
    output's (penalties and processors see them). -> (the rows, their logits rows, the seeded generators' states
    before drawing, by item, for the items that verify a sampled request)."""
    rows: list[SamplingRow] = []
    picked: list[int] = []
    saved: dict[int, torch.Tensor] = {}
    for i, first in sampling:
        req, spec = scheduled[i].request, scheduled[i].spec_ids
        if spec and req.generator is not None and not req.params.is_greedy:
            saved[i] = req.generator.get_state()
        for j in range(len(spec) + 1):
            # A grammar's matcher stands at the output's end: only a request without proposals has one (the
            # engine never lets such a request propose).
            rows.append(SamplingRow(req.params, req.generator, req.prompt_ids,
                                    req.output_ids + spec[:j] if j else req.output_ids, req.stop_ids,
                                    req.grammar if j == 0 else None))
            picked.append(first + j)
    return rows, picked, saved


def first_rows(scheduled: Sequence[ScheduledRequest], sampling: Sequence[tuple[int, int]]) -> dict[int, int]:
    """Each sampling item's first row among sampling_rows' rows."""
    out: dict[int, int] = {}
    at = 0
    for i, _ in sampling:
        out[i] = at
        at += 1 + len(scheduled[i].spec_ids)
    return out


def kept_logprobs(result: SampleResult, first: int, kept: Sequence[int], logits: torch.Tensor
                  ) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """The log-probabilities of the tokens a verified chunk keeps, its rows from `first` in the step's `result` and
    `logits`: each row's as the sampler reported them, the chosen one recomputed where the rejection rule kept
    another token than the row drew (engine/rejection.py; the top list does not depend on the token)."""
    out = []
    for j, token in enumerate(kept):
        logprob = result.logprobs[first + j]
        if logprob is not None and token != result.token_ids[first + j]:
            logprob = (float(logits[first + j].float().log_softmax(-1)[token]), logprob[1])
        out.append(logprob)
    return out


def verify_rows(max_k: int) -> list[int]:
    """The row counts whose verifying passes `calibrate` times: up to a step of K + 1 rows, in steps that double
    (StepCosts interpolates between them, and extrapolates past them for batches), and 12, where CPU products
    change from the block kernels to a GEMM (ops/quant_linear.py)."""
    return sorted({r for r in (1, 2, 4, 8, 12, 16, 32, 64) if r < max_k + 1} | {max_k + 1})



class Speculator:
    """Proposes each decoding sequence's next tokens before a step (`propose`) and learns from what was accepted
    (`record`) and what steps cost (`observe`)."""

    def __init__(self, max_k: int, costs: StepCosts, draft: DraftModel | HeadDraft | None = None) -> None:
        self.max_k = max_k
        self.costs = costs
        self.policy = KPolicy(costs, max_k)
        self.draft = draft  # proposals from a draft model (engine/draft.py), else prompt lookup
        # Unseeded sampled requests' draft draws and rejection tests (engine/rejection.py) draw from this.
        self.generator = torch.Generator()
        self.generator.seed()
        # False: every proposal verified at its full length (up to K), whatever it costs (tests, measurements).
        self.adaptive = True

    @classmethod
    def build(cls, config: EngineConfig, runner: ModelRunner, max_model_len: int, blocks: BlockManager,
              text: Callable[[], list[int]]) -> Speculator | None:
        """The engine's speculator, where `config.speculative` asks for one: its proposer (a draft model loaded, the
        target's first layers, or the target with a cut head, whose likeliest tokens come from its predictions over
        `text()`) and its step costs, timed on the weights' final pages (no background copy beside the passes)."""
        max_k = config.max_speculative_tokens
        if not max_k:
            return None
        draft: DraftModel | None = None
        if config.draft_model:
            draft = DraftModel.load(config.draft_model, config, runner.model_config.vocab_size, max_model_len)
        elif config.self_draft_layers:
            draft = DraftModel.early_exit(runner, config.self_draft_layers)
        runner.settle()
        if config.head_draft_vocab:  # its verifying steps run the blocks over one token per sequence
            head = HeadDraft.build(runner, config.head_draft_vocab, blocks, text(), runner.model_config.eog_ids)
            return cls(max_k, StepCosts(head.verify_costs(verify_rows(max_k))), head)
        if draft is not None:
            draft.runner.settle()
            draft.time_passes()
        costs = calibrate(runner.model, runner.kv_pool, verify_rows(max_k), runner.device)
        return cls(max_k, StepCosts(costs), draft)

    def propose(self, requests: Sequence[Request], max_model_len: int) -> None:
        """Set `spec_ids` of each running request that decodes next (every known token but the last computed).
        The step is costed as one row per running request (a prompt chunk among them makes the step dearer, and the
        proposals' share of it smaller: counting it as one row errs towards proposing less), then the proposals."""
        decoding = [r for r in requests if r.num_computed_tokens == r.num_tokens - 1]
        if self.draft is not None:
            self._propose_drafts(decoding, len(requests), max_model_len)
            return
        rows = len(requests)
        tokens = float(len(decoding))
        verifying = False
        for req in decoding:
            state = req.spec_state
            if state is None:
                state = req.spec_state = SeqSpec()
            # The token after the proposals is kept too: at most max_tokens in all, within the context.
            room = min(self.max_k, req.params.max_tokens - len(req.output_ids) - 1, max_model_len - req.num_tokens - 1)
            if room <= 0:
                req.spec_ids = []
                state.choice = SpecChoice(room, 0, 0, 1.0)
                continue
            state.check_shadow(req.all_ids)
            proposal = state.index.propose(req.all_ids, room)
            if not proposal and state.run:  # nothing repeats here: whatever was copied is left behind
                state.end_run()
            if not self.adaptive:
                req.spec_ids = proposal
                state.choice = SpecChoice(room, len(proposal), len(proposal), state.expected_tokens(len(proposal)))
                continue
            k, more = self.policy.choose(rows, tokens, state.expected_tokens, len(proposal), verifying)
            if k == 0 and proposal and state.shadow is None:
                state.shadow = (req.num_tokens, proposal[:SHADOW_TOKENS])
            req.spec_ids = proposal[:k]
            state.choice = SpecChoice(room, len(proposal), k, state.expected_tokens(k))
            if k:
                state.shadow = None  # this step's verification tells more, from the same tokens
                rows += k
                tokens = more
                verifying = True

    def _propose_drafts(self, decoding: list[Request], rows: int, max_model_len: int) -> None:
        """propose, with the draft model: each sequence's k chosen first (its proposals cost a draft step each),
        then drafted together. A sequence off drafts two tokens now and then (at its first step, then every
        `probe_gap` steps, a gap that doubles while they accept nothing), to learn whether it should be on; as long
        as its probes' time stays within PROBE_SHARE of its decode time (a probe's draft passes include catching
        the draft's cache up on every token since the last: on a CPU, often several plain steps' time)."""
        assert self.draft is not None
        tokens, verifying, extra = float(len(decoding)), False, 0.0
        # Until a draft pass is measured, it is taken to cost what a target step does: drafting must prove itself.
        step_cost = self.costs(1, verify=False)
        per_token = self.draft.step_seconds or step_cost
        ks: list[int] = []
        for req in decoding:
            state = req.spec_state
            if state is None:
                state = req.spec_state = SeqSpec()
            state.decode_steps += 1
            room = min(self.max_k, req.params.max_tokens - len(req.output_ids) - 1, max_model_len - req.num_tokens - 1)
            k = max(room, 0)
            if self.adaptive and k:
                k, more = self.policy.choose(rows, tokens, state.draft_expected, room, verifying, per_token, extra)
                state.steps_off = 0 if k else state.steps_off + 1
                # A probe drafts two tokens: the second's pass times a draft step.
                if state.steps_off >= state.probe_gap and state.may_probe(self._probe_cost(req, per_token),
                                                                           step_cost):
                    k = min(2, room)
                    more, state.steps_off, state.probing = tokens + state.draft_expected(k) - 1.0, 0, True
                if k:
                    rows, tokens, verifying, extra = rows + k, more, True, extra + k * per_token
            state.choice = SpecChoice(room, max(room, 0), k, state.draft_expected(k), state.probing)
            ks.append(k)
        for req, k in zip(decoding, ks):
            if k and req.spec_state.probing:
                req.spec_state.probe_seconds += self._probe_cost(req, per_token)
        for req, proposal in zip(decoding, self.draft.propose(decoding, ks, self.generator)):
            req.spec_ids = proposal

    def _probe_cost(self, req: Request, per_token: float) -> float:
        """A probe's expected time: the draft's cache caught up on the tokens it lacks, two draft passes, and the
        verifying pass's two extra rows."""
        assert self.draft is not None
        return (self.draft.behind(req) * self.draft.catch_up_seconds + 2 * per_token
                + max(0.0, self.costs(3, verify=True) - self.costs(1, verify=False)))

    def release(self, running: Sequence[Request]) -> None:
        """After a step, or an abort: a draft model's shadows of requests no longer running give their blocks
        back."""
        if self.draft is not None:
            self.draft.release({req.request_id for req in running})

    def verify(self, item: ScheduledRequest, token_ids: Sequence[int], first: int, failed: set[int],
               saved: torch.Tensor | None, scheduler: Scheduler, logits: torch.Tensor,
               rows: Sequence[SamplingRow]) -> list[int]:
        """A chunk with proposals, its rows sampled (from `first` in `token_ids`, in `logits` and `rows`; `failed`:
        rows whose sampling raised): the tokens it yields (the accepted proposals, then the token sampled after
        them; [] where its sampling failed). Proposals drawn from a draft's distribution (`spec_q`) meet the
        rejection rule (engine/rejection.py); the others are kept while they equal the rows' own draws. Advances
        the request's counter over what is kept, puts a seeded generator (its state `saved` before the draws) back
        to just past the draws of the kept tokens, and learns."""
        req, count = item.request, len(item.spec_ids) + 1
        q, req.spec_q = req.spec_q[:len(item.spec_ids)], []
        if any(first + j in failed for j in range(count)):
            scheduler.advance(item, len(item.spec_ids))
            return []
        drawn = token_ids[first:first + count]
        if len(q) == len(item.spec_ids):
            span = slice(first, first + count)
            p = distributions(Sampler.processed(logits[span], list(rows[span])), [req.params] * count)
            decisions: list[Decision] = []
            accepted, residual = rejection_rule(item.spec_ids, q, p, self.generator, decisions)
            kept = list(item.spec_ids[:accepted]) + [drawn[-1] if residual is None else residual]
            req.spec_rule = RuleTrail(decisions, kept[-1], residual is not None)
        else:
            kept = list(drawn[:num_accepted(item.spec_ids, drawn) + 1])
            req.spec_rule = None
        scheduler.advance(item, count - len(kept))
        if saved is not None and req.generator is not None:
            restore_generator(req.generator, saved, len(kept))
        self.record(req, len(item.spec_ids), len(kept) - 1)
        return kept

    def record(self, req: Request, num_proposed: int, num_accepted_: int) -> None:
        """A verified step of `req`: its runs and its counters."""
        if req.spec_state is None:
            req.spec_state = SeqSpec()
        req.spec_state.learn(num_proposed, num_accepted_)
        t = req.timings
        t.num_spec_proposed += num_proposed
        t.num_spec_accepted += num_accepted_
        t.num_spec_steps += 1

    def observe(self, rows: int, seconds: float, verify: bool) -> None:
        """A decode step's time: `rows` rows, verifying proposals or not."""
        self.costs.observe(rows, seconds, verify)

"""Speculative decoding: tokens proposed cheaply, then verified in one forward pass of the target model, so that a
step can yield several tokens without changing what is generated (Leviathan et al. 2022; Chen et al. 2023).

Proposer: prompt lookup (n-gram). The longest recent n-gram ending the sequence (prompt and output) that occurred
before proposes the tokens that followed it there; a match running into the sequence's end continues with the
period it found ("a b a b" -> "a b ..."). No extra model; an index per sequence, updated as tokens are accepted.

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

Adaptive k (`KPolicy`): how many tokens to propose is chosen per sequence, per step, from the tokens it can expect
a step to yield and the measured cost of a pass of n rows (`StepCosts`): the k that maximizes the expected tokens
per second of the step, which is 0 (off) whenever plain decoding is faster. What a sequence can expect (`SeqSpec`)
comes from its runs: copying (an edit, a list, a quotation) comes in runs of proposals that keep being right, ended
by a divergence after which the next proposals are mostly wrong. A run that has lasted r tokens is expected to go
on as the sequence's earlier runs that reached r went on, and half as long again as it has lasted (one more
observation; nothing past what was seen is assumed); a k > 0 must promise MIN_GAIN times plain decoding's rate, so
that a marginal bet is not taken. A sequence switched off keeps learning at no cost: its proposal is kept aside
and checked against the tokens plain decoding then yields, which are exactly the tokens verification would have
sampled (the same rows, the same uniforms), so its runs are known either way and speculation resumes as soon as it
would pay.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from nextoken.cache.kv_pool import KVPool
from nextoken.config import EngineConfig
from nextoken.engine.draft import DraftModel
from nextoken.engine.request import Request
from nextoken.engine.runner import ModelRunner
from nextoken.engine.sampler import SamplingRow
from nextoken.engine.scheduler import ScheduledRequest, Scheduler
from nextoken.ops.attention import AttentionMetadata

NGRAM_MIN = 2  # the shortest n-gram that may propose: a single token repeats too often to predict much
NGRAM_MAX = 6
RUN_HISTORY = 16  # a sequence's latest runs that predict its next one
DRAFT_DECAY = 0.9  # per verified step, the weight of a sequence's earlier draft acceptance
PROBE_GAP = 16  # steps after which a sequence whose drafts do not pay drafts two tokens again...
MAX_PROBE_GAP = 256  # ...doubling while those accept nothing, up to this
MIN_GAIN = 1.1  # the expected speed-up over not speculating below which a sequence does not propose
# Tokens of an unverified proposal checked against plain decoding: few, so that a run of copying is noticed soon
SHADOW_TOKENS = 4


def num_accepted(spec_ids: Sequence[int], token_ids: Sequence[int]) -> int:
    """How many proposals the sampled tokens (one per row: after the last known token, then after each proposal)
    confirm: the proposals are kept while each equals the token sampled before it."""
    m = 0
    while m < len(spec_ids) and token_ids[m] == spec_ids[m]:
        m += 1
    return m


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


def verify_rows(max_k: int) -> list[int]:
    """The row counts whose verifying passes `calibrate` times: up to a step of K + 1 rows, in steps that double
    (StepCosts interpolates between them, and extrapolates past them for batches), and 12, where CPU products
    change from the block kernels to a GEMM (ops/quant_linear.py)."""
    return sorted({r for r in (1, 2, 4, 8, 12, 16, 32, 64) if r < max_k + 1} | {max_k + 1})


# --- proposer ---------------------------------------------------------------------------------------------------


class NgramIndex:
    """Per sequence: every n-gram (NGRAM_MIN..NGRAM_MAX tokens) that has a token after it -> where that token is, in
    its latest occurrence. Updated incrementally: each new token adds at most NGRAM_MAX - NGRAM_MIN + 1 entries."""

    def __init__(self) -> None:
        self.starts: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are in the index

    def update(self, ids: Sequence[int]) -> None:
        for end in range(self.num_indexed, len(ids) - 1):  # an n-gram ending at `end` is followed by ids[end + 1]
            for n in range(NGRAM_MIN, min(NGRAM_MAX, end + 1) + 1):
                self.starts[tuple(ids[end - n + 1:end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, len(ids) - 1)

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow ids: after the latest earlier occurrence of its longest indexed suffix."""
        self.update(ids)
        size = len(ids)
        for n in range(min(NGRAM_MAX, size), NGRAM_MIN - 1, -1):
            start = self.starts.get(tuple(ids[size - n:]))
            if start is not None:
                out: list[int] = []
                for j in range(k):  # past the sequence's end: the period the match found, over the proposals
                    out.append(ids[start + j] if start + j < size else out[start + j - size])
                return out
        return []


# --- adaptive k -------------------------------------------------------------------------------------------------


class StepCosts:
    """Seconds a step takes by the number of rows it computes, apart for plain decode steps (on CPUs the native
    step) and verifying ones (the forward pass over several rows per sequence). Verifying passes are measured once
    per row count on a private cache at start (`calibrate`); both are then kept as moving averages of the engine's
    own steps. Between measured counts, linear interpolation; a plain count not seen yet costs what verifying it
    would."""

    def __init__(self, measured: dict[int, float]) -> None:
        self.verify: dict[int, float] = dict(measured)
        self.plain: dict[int, float] = {}
        self._points = sorted(self.verify.items())  # the verify table, by rows

    def observe(self, rows: int, seconds: float, verify: bool) -> None:
        """A step's time. A moving average, each sample held within half to twice the average first: a step that
        waited for the CPU (another process, a page fault storm) moves it a little, not to the sample."""
        table = self.verify if verify else self.plain
        old = table.get(rows)
        table[rows] = seconds if old is None else 0.8 * old + 0.2 * min(max(seconds, old / 2), 2 * old)
        if verify:
            self._points = sorted(self.verify.items())

    def __call__(self, rows: int, verify: bool = True) -> float:
        known = self.plain.get(rows) if not verify else None
        return known if known is not None else self._interpolate(rows)

    def _interpolate(self, rows: int) -> float:
        known = self.verify.get(rows)
        if known is not None:
            return known
        points = self._points
        if rows <= points[0][0] or len(points) == 1:
            return points[0][1] * rows / points[0][0]
        at = bisect.bisect_left(points, (rows, 0.0))
        if at < len(points):
            (r0, s0), (r1, s1) = points[at - 1], points[at]
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        (r0, s0), (r1, s1) = points[-2], points[-1]
        return s1 + max(s1 - s0, 0.0) / (r1 - r0) * (rows - r1)


@torch.inference_mode()
def calibrate(model: torch.nn.Module, runner_kv: KVPool, rows: Iterable[int], device: torch.device,
              context: int = 64) -> dict[int, float]:
    """Seconds of a forward pass computing `rows` new tokens with logits for each (a verification pass) after
    `context` cached ones, on a private cache shaped like the engine's: the faster of two runs (the less disturbed
    by whatever else the machine runs), after one pass of the most rows that warms the buffers."""
    rows = sorted(set(rows))
    total = context + max(rows)
    num_blocks = -(-total // runner_kv.block_size)
    pool = KVPool(runner_kv.shape, num_blocks, runner_kv.block_size, device)
    table = torch.arange(num_blocks, device=device)[None]
    out: dict[int, float] = {}
    for n in [rows[-1]] + rows:
        # [n] ordinary tokens spread over the vocabulary: a run of one id (token 0) can drive fp32 activations
        # into subnormal numbers, whose arithmetic is many times slower, and the pass would time that
        vocab = model.config.vocab_size
        ids = (torch.arange(n, device=device) * 7919 + 1000) % vocab
        positions = torch.arange(context, context + n, device=device)
        meta = AttentionMetadata(slot_mapping=positions.clone(), query_start_loc=[0, n], seq_lens=[context + n],
                                 block_tables=table, block_size=runner_kv.block_size)
        times = []
        for _ in range(2):
            start = time.perf_counter()
            model(ids, positions, pool.layers, meta)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        out[n] = min(times)
    return out


@dataclass
class SeqSpec:
    """A sequence's speculation state: its n-gram index, the length of its current run of accepted proposals (`run`)
    and of its latest runs ended by a rejection, and while it is off, its proposal kept aside unverified (`shadow`:
    where it starts, its first SHADOW_TOKENS tokens)."""

    index: NgramIndex = field(default_factory=NgramIndex)
    run: int = 0
    runs: deque[int] = field(default_factory=lambda: deque(maxlen=RUN_HISTORY))
    shadow: tuple[int, list[int]] | None = None
    # A draft model's proposals (engine/draft.py): decayed counts of accepted ones and of first rejections, and
    # the steps since the sequence last drafted.
    draft_accepted: float = 0.0
    draft_rejected: float = 0.0
    steps_off: int = PROBE_GAP - 1  # a sequence's first decode step drafts: something to learn from
    probe_gap: int = PROBE_GAP  # doubled after each probe that accepts nothing, up to MAX_PROBE_GAP
    probing: bool = False

    def draft_expected(self, k: int) -> float:
        """Tokens a step verifying k drafted proposals is expected to yield, each accepted given those before it
        with the sequence's estimated probability (a Laplace estimate: 0.5 before any draft)."""
        a = (self.draft_accepted + 1.0) / (self.draft_accepted + self.draft_rejected + 2.0)
        return sum(a ** i for i in range(k + 1))

    def expected_tokens(self, k: int) -> float:
        """Tokens a step verifying k proposals is expected to yield: the accepted ones (what earlier runs that lasted
        as long as this one went on to accept, and half as many as this one has lasted, each at most k), then one
        more."""
        ahead = [length - self.run for length in self.runs if length >= self.run] + [self.run / 2]
        return 1.0 + sum(min(n, k) for n in ahead) / len(ahead)

    def learn(self, num_proposed: int, num_accepted_: int) -> None:
        if self.probing:
            self.probe_gap = PROBE_GAP if num_accepted_ else min(2 * self.probe_gap, MAX_PROBE_GAP)
            self.probing = False
        self.draft_accepted = DRAFT_DECAY * self.draft_accepted + num_accepted_
        self.draft_rejected = DRAFT_DECAY * self.draft_rejected + (1 if num_accepted_ < num_proposed else 0)
        self.run += num_accepted_
        if num_accepted_ < num_proposed:
            self.end_run()

    def end_run(self) -> None:
        self.runs.append(self.run)
        self.run = 0

    def check_shadow(self, ids: Sequence[int]) -> None:
        """Learn from the proposal kept aside once the tokens generated since decide it (a mismatch, or all of it
        matched)."""
        if self.shadow is None:
            return
        start, proposal = self.shadow
        known = ids[start:start + len(proposal)]
        m = num_accepted(proposal[:len(known)], known)
        if m < len(known) or len(known) == len(proposal):
            self.learn(len(proposal), m)
            self.shadow = None


class KPolicy:
    """How many of its proposals each sequence verifies this step (see the module docstring)."""

    def __init__(self, costs: StepCosts, max_k: int) -> None:
        self.costs = costs
        self.max_k = max_k

    def choose(self, rows: int, tokens: float, expected: Callable[[int], float], available: int,
               verifying: bool = False, per_token: float = 0.0, extra: float = 0.0) -> tuple[int, float]:
        """A step of `rows` rows expected to yield `tokens` tokens (`verifying`: some sequence in it proposes
        already; `extra`: seconds its proposals cost besides; `per_token`: seconds each proposal of this sequence
        costs, a draft model's step): (the k among 0..available that maximizes the step's expected tokens per
        second with this sequence's k proposals added, the step's tokens then)."""
        best_k, best_rate, best_tokens = 0, MIN_GAIN * tokens / (self.costs(rows, verify=verifying) + extra), tokens
        for k in range(1, min(available, self.max_k) + 1):
            more = tokens + expected(k) - 1.0
            rate = more / (self.costs(rows + k) + extra + k * per_token)
            if rate > best_rate:
                best_k, best_rate, best_tokens = k, rate, more
        return best_k, best_tokens


class Speculator:
    """Proposes each decoding sequence's next tokens before a step (`propose`) and learns from what was accepted
    (`record`) and what steps cost (`observe`)."""

    def __init__(self, max_k: int, costs: StepCosts, draft: DraftModel | None = None) -> None:
        self.max_k = max_k
        self.costs = costs
        self.policy = KPolicy(costs, max_k)
        self.draft = draft  # proposals from a draft model (engine/draft.py), else prompt lookup
        # False: every proposal verified at its full length (up to K), whatever it costs (tests, measurements).
        self.adaptive = True

    @classmethod
    def build(cls, config: EngineConfig, runner: ModelRunner, max_model_len: int) -> Speculator | None:
        """The engine's speculator, where `config.speculative` asks for one: its proposer (a draft model loaded, or
        the target's first layers) and its step costs, timed on the weights' final pages (no background copy beside
        the passes)."""
        max_k = config.max_speculative_tokens
        if not max_k:
            return None
        draft = None
        if config.draft_model:
            draft = DraftModel.load(config.draft_model, config, runner.model_config.vocab_size, max_model_len)
        elif config.self_draft_layers:
            draft = DraftModel.early_exit(runner, config.self_draft_layers)
        runner.settle()
        if draft is not None:
            draft.runner.settle()
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
                continue
            state.check_shadow(req.all_ids)
            proposal = state.index.propose(req.all_ids, room)
            if not proposal and state.run:  # nothing repeats here: whatever was copied is left behind
                state.end_run()
            if not self.adaptive:
                req.spec_ids = proposal
                continue
            k, more = self.policy.choose(rows, tokens, state.expected_tokens, len(proposal), verifying)
            if k == 0 and proposal and state.shadow is None:
                state.shadow = (req.num_tokens, proposal[:SHADOW_TOKENS])
            req.spec_ids = proposal[:k]
            if k:
                state.shadow = None  # this step's verification tells more, from the same tokens
                rows += k
                tokens = more
                verifying = True

    def _propose_drafts(self, decoding: list[Request], rows: int, max_model_len: int) -> None:
        """propose, with the draft model: each sequence's k chosen first (its proposals cost a draft step each),
        then drafted together. A sequence off drafts two tokens now and then (at its first step, then every
        `probe_gap` steps, a gap that doubles while they accept nothing), to learn whether it should be on."""
        assert self.draft is not None
        tokens, verifying, extra = float(len(decoding)), False, 0.0
        # Until a draft pass is measured, it is taken to cost what a target step does: drafting must prove itself.
        per_token = self.draft.step_seconds or self.costs(1, verify=False)
        ks: list[int] = []
        for req in decoding:
            state = req.spec_state
            if state is None:
                state = req.spec_state = SeqSpec()
            room = min(self.max_k, req.params.max_tokens - len(req.output_ids) - 1, max_model_len - req.num_tokens - 1)
            k = max(room, 0)
            if self.adaptive and k:
                k, more = self.policy.choose(rows, tokens, state.draft_expected, room, verifying, per_token, extra)
                state.steps_off = 0 if k else state.steps_off + 1
                if state.steps_off >= state.probe_gap:  # two tokens: the second's pass times a draft step
                    k = min(2, room)
                    more, state.steps_off, state.probing = tokens + state.draft_expected(k) - 1.0, 0, True
                if k:
                    rows, tokens, verifying, extra = rows + k, more, True, extra + k * per_token
            ks.append(k)
        for req, proposal in zip(decoding, self.draft.propose(decoding, ks)):
            req.spec_ids = proposal

    def release(self, running: Sequence[Request]) -> None:
        """After a step, or an abort: a draft model's shadows of requests no longer running give their blocks
        back."""
        if self.draft is not None:
            self.draft.release({req.request_id for req in running})

    def verify(self, item: ScheduledRequest, token_ids: Sequence[int], first: int, failed: set[int],
               saved: torch.Tensor | None, scheduler: Scheduler) -> list[int]:
        """A chunk with proposals, its rows sampled (from `first` in `token_ids`; `failed`: rows whose sampling
        raised): the tokens it yields (the accepted proposals, then the token sampled after them; [] where its
        sampling failed). Advances the request's counter over what is kept, puts a seeded generator (its state
        `saved` before the draws) back to just past the draws of the kept tokens, and learns."""
        req, count = item.request, len(item.spec_ids) + 1
        if any(first + j in failed for j in range(count)):
            scheduler.advance(item, len(item.spec_ids))
            return []
        drawn = token_ids[first:first + count]
        kept = list(drawn[:num_accepted(item.spec_ids, drawn) + 1])
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

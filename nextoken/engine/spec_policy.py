"""Adaptive k (`KPolicy`): how many tokens to propose is chosen per sequence, per step, from the tokens it can expect
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
from typing import TYPE_CHECKING

import torch

from nextoken.cache.kv_pool import KVPool
from nextoken.engine.ngram import NgramIndex
from nextoken.ops.attention import AttentionMetadata

if TYPE_CHECKING:
    from nextoken.models.base import CausalLM

RUN_HISTORY = 16  # a sequence's latest runs that predict its next one
DRAFT_DECAY = 0.9  # per verified step, the weight of a sequence's earlier draft acceptance
PROBE_GAP = 16  # steps after which a sequence whose drafts do not pay drafts two tokens again...
MAX_PROBE_GAP = 256  # ...doubling while those accept nothing, up to this
# Probes may take at most this share of a sequence's plain decode time (its steps at a plain step's cost): each
# waits until its expected time fits, the first too (it catches the draft's cache up on the whole prompt).
PROBE_SHARE = 0.05
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
def calibrate(model: CausalLM, runner_kv: KVPool, rows: Iterable[int], device: torch.device,
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


@dataclass(frozen=True)
class SpecChoice:
    """A sequence's latest decode step as the speculator saw it (for `trace`): the most it could propose (`room`:
    K, the tokens left to max_tokens and the context), what its proposer offered (`available`), how many of those
    the policy verifies (`k`), and the tokens it expected the step to yield from this sequence at that k."""

    room: int
    available: int
    k: int
    expected: float
    probe: bool = False  # a draft's occasional two-token probe of a sequence that is off


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
    probe_seconds: float = 0.0  # time its probes took (their draft passes and their rows' share of the verification)
    decode_steps: int = 0
    choice: SpecChoice | None = None

    def may_probe(self, probe_cost: float, step_cost: float) -> bool:
        """Whether a probe costing `probe_cost` keeps the probes' time within PROBE_SHARE of the decode time."""
        return self.probe_seconds + probe_cost <= PROBE_SHARE * self.decode_steps * step_cost

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

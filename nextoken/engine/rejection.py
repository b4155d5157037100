"""Speculative sampling with a sampled draft (Leviathan et al. 2022, Chen et al. 2023): a draft model draws each
proposal x from its own distribution q (after the request's penalties, processors, temperature, top-k, top-p and
min-p, as the target's rows get them); the target keeps x with probability min(1, p(x) / q(x)) and, at the first
proposal it rejects, draws from the residual max(0, p - q), renormalized. Every token kept is then distributed as p
exactly, and a draft close to the target is accepted at the rate sum_x min(p(x), q(x)) rather than at p(x) of its
greedy choice: at temperature 1, an int4 draft of the fp32 target agrees most of the time where its argmax would
be accepted one time in three.

Unseeded sampled requests only: a seeded request keeps greedy proposals and the one-hot rule of
engine/speculative.py, which draws exactly the tokens plain decoding draws with that seed.

p and q are the distributions the sampler's draw defines (engine/sampler.py, steps a-g: ops/sampling.py's
`kept_weights`, natively where it can: `weigh_rows`), normalized.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nextoken.ops.sampling import weigh_rows
from nextoken.sampling_params import SamplingParams


def uses_sampled_draft(params: SamplingParams) -> bool:
    """Whether a request's proposals are drawn from the draft's distribution (else they are its greedy tokens)."""
    return not params.is_greedy and params.seed is None


def distributions(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [rows, vocab] (after penalties and processors), one SamplingParams per row -> [rows, vocab] fp64, each
    row the distribution that row's draw samples from: the sampler's own kept weights, normalized (one-hot at the
    argmax for a greedy row)."""
    weights = weigh_rows(logits, [p.temperature for p in params], [p.top_k for p in params],
                         [p.top_p for p in params], [p.min_p for p in params])
    return weights / weights.sum(dim=1, keepdim=True)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token from probs [vocab] (fp64, any non-negative weights with a positive sum), by inverse CDF at one
    uniform: never a token of weight 0."""
    cdf = torch.cumsum(probs, 0)
    u = float(torch.rand(1, dtype=torch.float64, generator=generator))
    at = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    return min(at, probs.numel() - 1)


@dataclass(frozen=True)
class Decision:
    """One proposal x under the rule: p(x), q(x), and the uniform u drawn for it (kept iff u q(x) < p(x))."""

    p: float
    q: float
    u: float

    @property
    def kept(self) -> bool:
        return self.u * self.q < self.p


@dataclass(frozen=True)
class RuleTrail:
    """A verifying step under the rule, as a tracer reads it: each examined proposal's decision, the token the step
    ends with, and whether that came from the residual (at a rejection) or is the last row's own draw."""

    decisions: list[Decision]
    last: int
    residual: bool


def rejection_rule(proposals: Sequence[int], q: Sequence[torch.Tensor], p: torch.Tensor,
                   generator: torch.Generator, decisions: list[Decision] | None = None) -> tuple[int, int | None]:
    """The rejection rule over proposals x_1..x_k drawn from q[j] [vocab] each, given the target's p [k + 1, vocab]
    (row j at proposal j's position, row k after the last). -> (proposals accepted, the token drawn from the residual
    at the first rejected one, or None where all were accepted: the next token is then a plain draw from p[k]).
    `decisions`: where given, each examined proposal's Decision is appended (a tracer reads them)."""
    for j, x in enumerate(proposals):
        decision = Decision(float(p[j, x]), float(q[j][x]), float(torch.rand(1, dtype=torch.float64,
                                                                             generator=generator)))
        if decisions is not None:
            decisions.append(decision)
        if decision.kept:  # u < p(x) / q(x): always where p(x) >= q(x)
            continue
        residual = torch.clamp(p[j] - q[j], min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: nothing left over to draw from but p
            residual = p[j]
        return j, draw(residual, generator)
    return len(proposals), None

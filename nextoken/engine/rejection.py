"""Speculative sampling with a sampled draft (Leviathan et al. 2022, Chen et al. 2023): a draft model draws each
proposal x from its own distribution q (after the request's penalties, processors, temperature, top-k, top-p and
min-p, as the target's rows get them); the target keeps x with probability min(1, p(x) / q(x)) and, at the first
proposal it rejects, draws from the residual max(0, p - q), renormalized. Every token kept is then distributed as p
exactly, and a draft close to the target is accepted at the rate sum_x min(p(x), q(x)) rather than at p(x) of its
greedy choice: at temperature 1, an int4 draft of the fp32 target agrees most of the time where its argmax would
be accepted one time in three.

Unseeded sampled requests only: a seeded request keeps greedy proposals and the one-hot rule of
engine/speculative.py, which draws exactly the tokens plain decoding draws with that seed.

The distributions are fp64 renderings of the sampler's draw (engine/sampler.py, steps b-g): the same tokens kept,
weights exp((l - max l) / T) (0 below e^-24) rather than their fixed-point rounding, so p and q differ from the
plain draw's by less than 1e-9 of a probability.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from nextoken.sampling_params import SamplingParams

NEGLIGIBLE = -24.0  # (l - max l) / T below this weighs 0, as in the sampler's draw


def uses_sampled_draft(params: SamplingParams, seeded: bool) -> bool:
    """Whether a request's proposals are drawn from the draft's distribution (else they are its greedy tokens)."""
    return not params.is_greedy and not seeded


def distributions(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits [rows, vocab] (after penalties and processors), one SamplingParams per row -> [rows, vocab] fp64, each
    row the distribution that row's draw samples from (one-hot at the argmax for a greedy row, or one whose largest
    logit is not finite)."""
    rows, vocab = logits.shape
    out = torch.zeros(rows, vocab, dtype=torch.float64, device=logits.device)
    for i, p in enumerate(params):
        x = logits[i].double()
        top = float(x.max())
        inv_t = 1.0 / p.temperature if p.temperature > 0 else math.inf
        if p.is_greedy or not math.isfinite(top) or not math.isfinite(inv_t):
            out[i, int(torch.argmax(x))] = 1.0
            continue
        x = (x - top) * inv_t
        w = torch.where(x < NEGLIGIBLE, 0.0, torch.exp(x))
        if 0 < p.top_k < vocab:  # the k largest (ties: lower ids first, as the draw orders them)
            kept = torch.zeros(vocab, dtype=torch.bool, device=x.device)
            kept[_ranked(x)[:p.top_k]] = True
            w = torch.where(kept, w, 0.0)
        if p.top_p < 1.0:  # in that order, the tokens whose weight before them is below top_p of the whole
            order = _ranked(x, w > 0)
            before = torch.cumsum(w[order], 0) - w[order]
            drop = order[before >= p.top_p * float(w.sum())]
            drop = drop[1:] if drop.numel() and drop[0] == order[0] else drop  # the first always stays
            w[drop] = 0.0
        if p.min_p > 0.0:  # the best weighs exactly 1
            w = torch.where(w >= p.min_p, w, 0.0)
        out[i] = w / w.sum()
    return out


def _ranked(x: torch.Tensor, among: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids by x descending, then id ascending (the draw's order); only those where `among` is set."""
    ids = torch.arange(x.numel(), device=x.device) if among is None else among.nonzero()[:, 0]
    # A stable sort of the ids (ascending) by -x keeps equal values in id order.
    return ids[torch.sort(-x[ids], stable=True).indices]


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token from probs [vocab] (fp64, any non-negative weights with a positive sum), by inverse CDF at one
    uniform: never a token of weight 0."""
    cdf = torch.cumsum(probs, 0)
    u = float(torch.rand(1, dtype=torch.float64, generator=generator))
    at = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    return min(at, probs.numel() - 1)


def verify(proposals: Sequence[int], q: Sequence[torch.Tensor], p: torch.Tensor,
           generator: torch.Generator) -> tuple[int, int | None]:
    """The rejection rule over proposals x_1..x_k drawn from q[j] [vocab] each, given the target's p [k + 1, vocab]
    (row j at proposal j's position, row k after the last). -> (proposals accepted, the token drawn from the residual
    at the first rejected one, or None where all were accepted: the next token is then a plain draw from p[k])."""
    for j, x in enumerate(proposals):
        px, qx = float(p[j, x]), float(q[j][x])
        u = float(torch.rand(1, dtype=torch.float64, generator=generator))
        if u * qx < px:  # u < p(x) / q(x): always where p(x) >= q(x)
            continue
        residual = torch.clamp(p[j] - q[j], min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: nothing left over to draw from but p
            residual = p[j]
        return j, draw(residual, generator)
    return len(proposals), None

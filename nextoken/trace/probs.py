"""What the sampler saw at one step: the raw next-token distribution and the one it actually drew from.

The stages are the engine's own (`apply_penalties`, `apply_processors`, then temperature, top-k, top-p and min-p as
the draw weighs and keeps tokens, `kept_weights` in ops/sampling.py), called on a copy of the logits handed to the
sampler, so the figures shown are those of the run and no second implementation can drift from it. Greedy requests
draw the argmax: their final distribution is one-hot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nextoken.engine.processors import apply_processors
from nextoken.engine.sampler import SamplingRow, apply_penalties
from nextoken.ops.sampling import kept_weights
from nextoken.sampling_params import SamplingParams


@dataclass
class SampleRecord:
    """One sampled position. Lists are aligned: `top_ids[i]` has raw_probs[i], temp_probs[i], final_probs[i]."""

    token_id: int  # what the sampler drew
    top_ids: list[int]  # the K most likely ids under the raw distribution
    raw_probs: list[float]  # softmax of the model's logits
    temp_probs: list[float]  # after penalties and temperature (greedy: after penalties)
    final_probs: list[float]  # the distribution drawn from, after top-k, top-p and min-p
    drawn_raw_prob: float
    drawn_final_prob: float
    drawn_rank: int  # 0 = the raw distribution's most likely token
    entropy_raw: float  # bits
    entropy_final: float  # bits
    num_kept: int  # tokens left with a nonzero probability


def entropy_bits(probs: torch.Tensor) -> float:
    p = probs[probs > 0].double()
    return max(0.0, float(-(p * p.log()).sum() / math.log(2)))  # max: a one-hot sums to -0.0


def sampling_distributions(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                           output_ids: list[int], stop_ids: frozenset[int] = frozenset()
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [vocab] fp32 -> (raw, after temperature, final) probabilities, each [vocab]; `stop_ids`: the request's
    end ids, which min_tokens bans."""
    raw = logits.float().softmax(dim=-1)
    x = logits.float()[None]  # [1, vocab]
    row = SamplingRow(params, None, prompt_ids, output_ids, stop_ids)
    if params.has_penalties:
        x = apply_penalties(x, [row])
    if params.has_processors:
        x = apply_processors(x.clone(), [row])  # in place: never on the caller's logits
    if params.is_greedy:
        tempered = x[0].softmax(dim=-1)
        final = torch.zeros_like(tempered)
        final[int(x[0].argmax())] = 1.0
        return raw, tempered, final
    tempered = (x[0] / params.temperature).softmax(dim=-1)
    kept = kept_weights(x, [params.temperature], [params.top_k], [params.top_p], [params.min_p])[0]
    return raw, tempered, (kept / kept.sum()).float()


def describe_sample(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                    token_id: int, top_k: int, stop_ids: frozenset[int] = frozenset()) -> SampleRecord:
    raw, tempered, final = sampling_distributions(logits, params, prompt_ids, output_ids, stop_ids)
    top = raw.topk(min(top_k, raw.shape[0]))
    ids = top.indices.tolist()
    return SampleRecord(
        token_id=token_id, top_ids=ids, raw_probs=top.values.tolist(), temp_probs=tempered[ids].tolist(),
        final_probs=final[ids].tolist(), drawn_raw_prob=float(raw[token_id]), drawn_final_prob=float(final[token_id]),
        drawn_rank=int((raw > raw[token_id]).sum()), entropy_raw=entropy_bits(raw), entropy_final=entropy_bits(final),
        num_kept=int((final > 0).sum()))

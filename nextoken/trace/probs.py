"""What the sampler saw at one step: the raw next-token distribution and the one it actually drew from.

The stages are the engine's own (`apply_penalties`, `apply_processors`, then temperature, top-k, top-p and min-p as
the draw weighs and keeps tokens, `kept_weights` in ops/sampling.py), called on a copy of the logits handed to the
sampler, so the figures shown are those of the run and no second implementation can drift from it. Greedy requests
draw the argmax: their final distribution is one-hot. Each logits processor is also applied alone to the penalized
logits, to say which tokens it changed (bans and biases commute, so that is what it did in the run); a grammar's
mask is the one its matcher gave at the step, taken before the drawn token advanced it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from nextoken.engine.processors import apply_processors
from nextoken.engine.sampler import SamplingRow, apply_penalties
from nextoken.ops.sampling import weigh_rows
from nextoken.sampling_params import SamplingParams


MAX_EFFECT_IDS = 6  # the tokens shown per processor and step (the likeliest under the raw distribution)
PROCESSORS = ("penalties", "structured_outputs", "allowed_token_ids", "min_tokens", "bad_words", "logit_bias")


@dataclass
class ProcessorEffect:
    """What one logits processor (or the penalties) did at a step."""

    name: str
    num_changed: int  # logits it changed
    ids: list[int]  # the likeliest of them (raw distribution), up to MAX_EFFECT_IDS
    num_allowed: int | None = None  # a grammar: the tokens it allowed
    allowed_ids: list[int] = field(default_factory=list)  # ... the likeliest of those


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
    effects: list[ProcessorEffect] = field(default_factory=list)  # per processor that changed a logit
    # Asked-for ids (a speculative step's proposals) -> (raw, final) probability.
    probs_of: dict[int, tuple[float, float]] = field(default_factory=dict)


def entropy_bits(probs: torch.Tensor) -> float:
    p = probs[probs > 0].double()
    return max(0.0, float(-(p * p.log()).sum() / math.log(2)))  # max: a one-hot sums to -0.0


class _Mask:
    """A grammar's mask as it stood at the step, in a GrammarMatcher's place (apply_processors reads `bitmask`)."""

    def __init__(self, allowed: np.ndarray) -> None:
        self.vocab_size = len(allowed)
        padded = np.zeros(-(-len(allowed) // 32) * 32, dtype=bool)
        padded[:len(allowed)] = allowed
        self._bits = np.packbits(padded, bitorder="little").tobytes()

    def bitmask(self) -> bytes:
        return self._bits


def processor_effects(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                      stop_ids: frozenset[int], allowed: np.ndarray | None) -> list[ProcessorEffect]:
    """Which logits each processor changed at a step (logits [vocab]: the model's raw row)."""
    raw = logits.float()[None]
    x = apply_penalties(raw, [SamplingRow(params, None, prompt_ids, output_ids, stop_ids)]) \
        if params.has_penalties else raw
    order = raw[0].argsort(descending=True)
    effects = []

    def effect(name: str, after: torch.Tensor, before: torch.Tensor) -> ProcessorEffect | None:
        changed = (after[0] != before[0]) & ~(after[0].isnan() & before[0].isnan())
        if not bool(changed.any()):
            return None
        ids = [int(i) for i in order[changed[order]][:MAX_EFFECT_IDS]]
        return ProcessorEffect(name, int(changed.sum()), ids)

    if params.has_penalties:
        e = effect("penalties", x, raw)
        if e is not None:
            effects.append(e)
    alone = replace(params, logit_bias=(), min_tokens=0, bad_words=(), allowed_token_ids=None,
                    structured_outputs=None, beam_width=None)
    active = {"structured_outputs": allowed is not None, "allowed_token_ids": params.allowed_token_ids is not None,
              "min_tokens": params.min_tokens > 0, "bad_words": bool(params.bad_words),
              "logit_bias": bool(params.logit_bias)}
    for name in PROCESSORS[1:]:
        if not active[name]:
            continue
        grammar = _Mask(allowed) if name == "structured_outputs" and allowed is not None else None
        only = replace(alone, **{name: getattr(params, name)})
        row = SamplingRow(only, None, prompt_ids, output_ids, stop_ids, grammar)  # type: ignore[arg-type]
        e = effect(name, apply_processors(x.clone(), [row]), x)
        if name == "structured_outputs" and allowed is not None:
            kept = torch.from_numpy(allowed[:raw.shape[1]])
            e = e or ProcessorEffect(name, 0, [])
            e.num_allowed = int(kept.sum())
            e.allowed_ids = [int(i) for i in order[kept[order]][:MAX_EFFECT_IDS]]
        if e is not None:
            effects.append(e)
    return effects


def sampling_distributions(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                           output_ids: list[int], stop_ids: frozenset[int] = frozenset(),
                           allowed: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [vocab] fp32 -> (raw, after temperature, final) probabilities, each [vocab]; `stop_ids`: the request's
    end ids, which min_tokens bans; `allowed`: a grammar's mask at the step."""
    raw = logits.float().softmax(dim=-1)
    x = logits.float()[None]  # [1, vocab]
    grammar = _Mask(allowed) if allowed is not None else None
    row = SamplingRow(params, None, prompt_ids, output_ids, stop_ids, grammar)  # type: ignore[arg-type]
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
    kept = weigh_rows(x, [params.temperature], [params.top_k], [params.top_p], [params.min_p])[0]
    return raw, tempered, (kept / kept.sum()).float()


def describe_sample(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
                    token_id: int, top_k: int, stop_ids: frozenset[int] = frozenset(),
                    allowed: np.ndarray | None = None, probs_of: Sequence[int] = ()) -> SampleRecord:
    raw, tempered, final = sampling_distributions(logits, params, prompt_ids, output_ids, stop_ids, allowed)
    top = raw.topk(min(top_k, raw.shape[0]))
    ids = top.indices.tolist()
    return SampleRecord(
        token_id=token_id, top_ids=ids, raw_probs=top.values.tolist(), temp_probs=tempered[ids].tolist(),
        final_probs=final[ids].tolist(), drawn_raw_prob=float(raw[token_id]), drawn_final_prob=float(final[token_id]),
        drawn_rank=int((raw > raw[token_id]).sum()), entropy_raw=entropy_bits(raw), entropy_final=entropy_bits(final),
        num_kept=int((final > 0).sum()),
        effects=processor_effects(logits, params, prompt_ids, output_ids, stop_ids, allowed)
        if params.has_penalties or params.has_processors else [],
        probs_of={i: (float(raw[i]), float(final[i])) for i in probs_of})

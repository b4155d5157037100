"""The sampler: logits [num_seqs, vocab] -> one token id per sequence, plus log-probabilities when asked. It makes
every sampling decision, from whether a step needs more than its rows' argmax (`argmax_only`) to the draw.

Stage order: 1. penalties (repetition over prompt + output; presence and frequency over output); 2. logits
processors (engine/processors.py: a grammar's mask, allowed_token_ids, min_tokens, bad_words, logit_bias); 3. greedy
rows (temperature 0): argmax of those logits, done; 4-8. the draw: temperature, top-k, top-p, min-p, then one
uniform u in [0, 1) from the request's own CPU generator (seeded requests repeat exactly, whatever the batch).

The draw is defined in exact arithmetic, so that every route gives the same token for the same row, parameters and
u: nt_sample_rows for fp32 rows on the CPU (its AVX-512, AVX2 and plain C builds alike), ops/sampling.py in torch
for the rest (CUDA, no kernels). For a row l [N] (fp32, penalized), T > 0, top_k (0: off), top_p (1: off) and
min_p (0: off), in fp64 (l is the row after stages 1-2):
  a. top = max l. With a NaN, no finite top, or no finite 1 / T, the draw is the argmax (the first NaN; token 0 for a
     row of -inf).
  b. x_i = ((double) l_i - top) * inv_t, inv_t = 1 / T.
  c. w_i = floor(E(x_i) 2^Q) 2^-Q, and 0 where x_i < -24; Q = 34 up to 2^19 tokens, one less per doubling past
     that. E is a fixed sequence of fp64 operations, each rounded on its own (no FMA, no libm): n = x log2(e)
     rounded to even, r = (x - n LN2_HI) - n LN2_LO, Taylor's polynomial of degree 11 in r by Horner, times 2^n
     made from its bits; E(0) = 1, |E(x) / e^x - 1| < 1e-13. Every weight is a multiple of 2^-Q in [0, 1] and N of
     them sum to at most 2^53 units: every sum below is exact, however a route orders it.
  d. The row's order: x descending, then id ascending.
  e. top-k (0 < k < N): the first k in that order; otherwise every token.
  f. top-p (p < 1): S1 = the top-k set's weight; keep its tokens (in order) whose weight before them is below p * S1
     (the first always).
  g. min-p (> 0): keep the tokens with w_i >= min_p (the best weighs exactly 1).
  h. S = the kept weight; the token is the first kept one, by ascending id, whose running sum exceeds u * S: never
     one of weight 0.
Why that is exact on every route, the fast paths that keep it, and what it costs: docs/exactness.md.
Log-probabilities are those of the raw model distribution (log_softmax of the logits before penalties and
processors), whatever chose the token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nextoken.engine.processors import apply_processors
from nextoken.ops import native, sampling
from nextoken.sampling_params import SamplingParams

log = logging.getLogger("nextoken.engine")

if TYPE_CHECKING:
    from nextoken.engine.grammar import GrammarMatcher


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: frozenset[int] = frozenset()  # the ids that end the request: banned until min_tokens
    grammar: GrammarMatcher | None = None  # structured output's place in its grammar (engine/grammar.py)


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the drawn token, [(id, logprob), ...] top-K) or None where not asked for.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    logits = logits.clone()
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), dtype=torch.long,
                                device=logits.device)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and row.output_ids:
            ids = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(logits.shape[1], device=logits.device).index_add_(
                0, ids, torch.ones(len(ids), device=logits.device))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows `rows` (distinct, increasing): t itself, not a gathered copy, when that is all of them."""
    return t if len(rows) == t.shape[0] else t[rows]


def argmax(logits: torch.Tensor) -> list[int]:
    """Each row's first highest entry (a NaN counts as highest, as in torch). On the CPU through numpy, whose
    vectorized argmax is about 10x torch's (262k-entry rows: 30 vs 300 us)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


class Sampler:
    def __init__(self, native_draws: bool = True) -> None:
        # Requests without a seed draw from this one; seeded requests carry their own generator.
        self.default_generator = torch.Generator()
        self.default_generator.seed()
        # fp32 CPU rows draw in one native call (nt_sample_rows) where the kernels are built, others through
        # ops/sampling.py: the same token either way.
        self.native_draws = native_draws

    @staticmethod
    def argmax_only(params: Iterable[SamplingParams]) -> bool:
        """Whether a step's tokens are its rows' argmax and nothing else is needed from its logits: every row
        greedy, without penalties or processors (they change the logits first) or log-probabilities. A step that
        can take the argmax itself (the native decode step) then hands back only the ids (`from_argmax`)."""
        return all(p.is_greedy and not p.has_penalties and not p.has_processors and p.logprobs is None
                   for p in params)

    @staticmethod
    def from_argmax(token_ids: list[int]) -> SampleResult:
        """The result of a step whose rows `argmax_only` let take their argmax elsewhere."""
        return SampleResult(token_ids, [None] * len(token_ids))

    @staticmethod
    def processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Stages 1-2: the logits after the rows' penalties and processors (a copy where any applies)."""
        raw = logits
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits, rows)  # a copy
        if any(r.params.has_processors for r in rows):
            logits = apply_processors(logits if logits is not raw else logits.clone(), rows)
        return logits

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """logits [num_rows, vocab] fp32 (one row per entry of `rows`)."""
        raw = logits
        logits = self.processed(logits, rows)
        greedy = [r.params.is_greedy for r in rows]
        if all(greedy):
            token_ids = argmax(logits)
        else:
            token_ids = self._draw(logits, rows, greedy)
        return SampleResult(token_ids, self._logprobs(raw, rows, token_ids))

    @staticmethod
    def rewind(row: SamplingRow) -> None:
        """A seeded row's generator put back where it stood before this step's draw: `_draw` takes exactly one
        uniform from it per token sampled, and none for greedy rows. For the rare redraw after a failed batch."""
        if row.generator is None or row.params.seed is None:
            return
        row.generator.manual_seed(row.params.seed)
        if not row.params.is_greedy:
            for _ in range(len(row.output_ids)):
                torch.rand(1, dtype=torch.float64, generator=row.generator)

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> list[int]:
        idx = [i for i, g in enumerate(greedy) if not g]
        sub = take_rows(logits, idx)
        ps = [rows[i].params for i in idx]
        # One uniform per row from the request's CPU generator, whatever the device: seeded requests repeat on any.
        uniforms = [float(torch.rand(1, dtype=torch.float64, generator=rows[i].generator or self.default_generator))
                    for i in idx]
        params = ([p.temperature for p in ps], [p.top_k for p in ps], [p.top_p for p in ps], [p.min_p for p in ps])
        lib = native.library() if self.native_draws and sub.device.type == "cpu" and sub.dtype == torch.float32 \
            else None
        if lib is not None and sub.stride(-1) == 1:
            drawn = native.sample_rows(lib, sub, *params, uniforms)
        else:
            drawn = sampling.sample_rows(sub, *params, uniforms)
        out = argmax(logits) if len(idx) < len(rows) else [0] * len(rows)  # the greedy rows' tokens
        for i, token in zip(idx, drawn):
            out[i] = token
        return out

    @staticmethod
    def _logprobs(raw: torch.Tensor, rows: list[SamplingRow], token_ids: list[int]
                  ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        wanted = [r.params.logprobs for r in rows]
        if all(w is None for w in wanted):
            return [None] * len(rows)
        logp = raw.log_softmax(dim=-1)
        out: list[tuple[float, list[tuple[int, float]]] | None] = []
        for i, k in enumerate(wanted):
            if k is None:
                out.append(None)
                continue
            chosen = float(logp[i, token_ids[i]])
            top = logp[i].topk(k) if k else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            out.append((chosen, pairs))
        return out


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], first: int, k: int
                     ) -> tuple[list[list[tuple[int, float]]], list[tuple[float, int]]]:
    """Rows of prompt positions first.. (row j: the distribution after position first + j) -> each row's top-k
    (id, log p), and for the rows whose next token is in the prompt, that token's (log p, rank): the teacher-forced
    scores a perplexity is made of. One batched pass over the rows, no loop over the vocabulary."""
    if logits.shape[0] == 0:
        return [], []
    logp = logits.float().log_softmax(dim=-1)
    top = logp.topk(max(k, 1), dim=-1)
    ids, vals = top.indices[:, :k].tolist(), top.values[:, :k].tolist()
    known = min(logp.shape[0], len(prompt_ids) - 1 - first)  # rows whose next token is a prompt token
    actual: list[tuple[float, int]] = []
    if known > 0:
        nxt = torch.tensor(prompt_ids[first + 1:first + 1 + known], device=logp.device)
        chosen = logp[:known].gather(1, nxt[:, None])  # [known, 1]
        ranks = (logp[:known] > chosen).sum(dim=-1) + 1
        actual = list(zip(chosen[:, 0].tolist(), ranks.tolist()))
    return [list(zip(i, v)) for i, v in zip(ids, vals)], actual


def sample_isolating(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]
                     ) -> tuple[SampleResult, set[int]]:
    """The rows' tokens, and the indices of rows whose sampling raised. The batch is drawn at once; should that
    raise, each row is drawn again alone (a seeded one from its generator rewound to this step's start), so one
    request's failing sampling fails it alone and the others draw what they would have drawn."""
    try:
        return sampler(logits, rows), set()
    except Exception as exc:
        log.error("sampling a batch of %d rows failed (%s); drawing them one at a time", len(rows),
                  type(exc).__name__)
    token_ids: list[int] = []
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = []
    failed: set[int] = set()
    for k, row in enumerate(rows):
        Sampler.rewind(row)
        try:
            one = sampler(logits[k:k + 1], [row])
        except Exception as exc:
            log.error("sampling failed for one request (%s)", type(exc).__name__)
            failed.add(k)
            one = SampleResult([0], [None])  # never used: the request fails
        token_ids.append(one.token_ids[0])
        logprobs.append(one.logprobs[0])
    return SampleResult(token_ids, logprobs), failed

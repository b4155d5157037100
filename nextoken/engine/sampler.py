"""The sampler: logits [num_seqs, vocab] -> one token id per sequence, plus log-probabilities when asked. It makes
every sampling decision, from whether a step needs more than its rows' argmax (`argmax_only`) to the draw.

Stage order, each stage skipped when no row of the batch uses it:
  1. penalties (repetition over prompt + output; presence and frequency over output)
  2. greedy rows (temperature 0): argmax of the penalized logits, done
  3. temperature: logits / T
  4. top-k: keep the k largest
  5. top-p: keep the smallest set whose probability reaches p (the most likely token always stays)
  6. min-p: drop tokens below min_p x the most likely token's probability
  7. draw from softmax by inverse CDF, with the request's own generator (seeded requests repeat exactly, whatever
     the batch)
On the CPU, fp32 rows take stages 3-7 in one native call (nt_sample_rows, where the kernels are built): the row's
exps and their sums in vector lanes, then, for the filters, the tokens within a factor of the best (widened until
they hold the filtered row) sorted, cut and drawn from; plain temperature draws in vocabulary order. The torch route
(CUDA, or no kernels) takes them over each row's CANDIDATES largest logits where the filters keep the row within
them (`candidates`; then WIDE_CANDIDATES in large vocabularies), else over the whole row (`filter_logits`). Both
draw the same distribution; a given uniform may land on another token (the order the draw walks differs).
Log-probabilities are those of the raw model distribution (log_softmax of the unmodified logits).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from nextoken.ops import native
from nextoken.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]


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


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Stages 3-6 on rows [num_rows, vocab] with per-row parameters [num_rows]; removed tokens become -inf.

    top_k 0 and top_p 1 and min_p 0 are no-ops.
    """
    logits = logits / temperature[:, None]
    vocab = logits.shape[1]
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [num_rows, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if bool((top_p < 1).any()):
        logits = top_p_filter(logits, top_p)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


# Candidates a sampled row is first filtered and drawn among (`candidates`). Sorting whole rows cost 1.2 s a step for
# 64 rows of Gemma 3's 262k vocabulary on 2 cores; the 1,024 largest of each row take 47 ms, and in practice hold
# the nucleus.
CANDIDATES = 1024


def _nucleus(sorted_logits: torch.Tensor, log_total: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which of each row's tokens (sorted by logit, descending) the nucleus keeps: a token is dropped when those
    before it already reach p; the first is always kept. log_total: each whole row's logsumexp [rows, 1]."""
    probs = (sorted_logits - log_total).exp()
    keep = probs.cumsum(dim=-1) - probs < top_p[:, None]
    keep[:, 0] = True
    return keep


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Stage 5 over whole rows: tokens outside each row's nucleus become -inf (rows with top_p 1 keep every token).
    The sampler only sends here the rows its candidates do not hold."""
    values, order = logits.sort(dim=-1, descending=True)
    keep = _nucleus(values, logits.logsumexp(dim=-1, keepdim=True), top_p) | (top_p >= 1)[:, None]
    return logits.masked_fill(~torch.zeros_like(keep).scatter_(1, order, keep), float("-inf"))


# Second set for the rows the first does not hold (a flat distribution at temperature 1 with top-p 0.95), in
# vocabularies of at least 4x as many: 64 of Gemma 3's rows take 0.14 s to find, against 1 s for a whole-row sort.
WIDE_CANDIDATES = 16384


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t's rows `rows` (distinct, increasing): t itself, not a gathered copy, when that is all of them."""
    return t if len(rows) == t.shape[0] else t[rows]


def candidates(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
               min_p: torch.Tensor, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 3-6 over each row's `count` largest logits only: (probs [rows, C], token ids [rows, C], bounded [rows]).
    A bounded row's filtered distribution lies among its candidates (top-k within them, or a nucleus or a min-p cut
    the candidates reach), and probs is that distribution, in the same order as the ids; for the other rows probs
    means nothing (they need more candidates, or filter_logits over the whole row). For 64 rows of Gemma 3's 262k
    vocabulary this leaves out the whole-row passes of the filtered softmax and the draw."""
    vocab = logits.shape[1]
    count = min(CANDIDATES if count is None else count, vocab)
    raw, ids = logits.topk(count, dim=-1)  # sorted, descending: the order of logits / T too (T > 0)
    values = raw / temperature[:, None]
    with_k = (top_k > 0) & (top_k < vocab)
    by_k = with_k & (top_k <= count)
    beyond_k = torch.arange(count, device=logits.device)[None, :] >= top_k[:, None]
    values = values.masked_fill(by_k[:, None] & beyond_k, float("-inf"))
    # Top-p reads the probabilities of the top-k-filtered row: within the candidates where top-k bounds the row,
    # over the whole row where there is no top-k (a top-k past the candidates leaves the row unbounded).
    with_p = top_p < 1
    log_total = values.logsumexp(dim=-1, keepdim=True)
    whole = with_p & ~by_k
    if bool(whole.all()):
        log_total = (logits / temperature[:, None]).logsumexp(dim=-1, keepdim=True)
    elif bool(whole.any()):
        log_total[whole] = (logits[whole] / temperature[whole, None]).logsumexp(dim=-1, keepdim=True)
    mass = (values - log_total).exp().sum(dim=-1)
    by_p = with_p & (by_k | (~with_k & (mass >= top_p)))
    values = values.masked_fill(with_p[:, None] & ~_nucleus(values, log_total, top_p), float("-inf"))
    # min-p: p < min_p * p_max is a logit below the largest + log(min_p), whatever the normalization
    cut = values[:, :1] + min_p[:, None].log()  # -inf where min_p is 0: no cut
    by_min_p = (min_p > 0) & (values[:, -1] < cut[:, 0])
    values = values.masked_fill(values < cut, float("-inf"))
    exact = ~with_p | by_k | ~with_k  # the nucleus above used the right normalization
    bounded = (by_k | by_p | by_min_p | (count == vocab)) & exact
    return values.softmax(dim=-1), ids, bounded


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, block: int = 1024) -> list[int]:
    """Per row i of probs [rows, vocab], the token at cumulative probability uniforms[i] (in [0, 1)) times the row's
    total: the first token whose running sum exceeds it, so never one of probability 0. Two levels, in float64 (a
    small token's share is not lost to rounding near the top): the row's sums of `block` entries locate the block,
    then a running sum within it. One pass over the rows; torch.multinomial took 8 ms for each 262k-entry row."""
    rows, vocab = probs.shape
    whole = vocab // block * block
    sums = [probs[:, :whole].view(rows, -1, block).sum(-1, dtype=torch.float64)] if whole else []
    if whole < vocab:
        sums.append(probs[:, whole:].sum(-1, keepdim=True, dtype=torch.float64))
    cdf = torch.cat(sums, dim=1).cumsum(dim=1)
    targets = uniforms.double() * cdf[:, -1]
    blocks = torch.searchsorted(cdf, targets[:, None], right=True)[:, 0].clamp_(max=cdf.shape[1] - 1).tolist()
    tokens = []
    for i, b in enumerate(blocks):
        part = probs[i, b * block:(b + 1) * block].double()
        rest = targets[i] - (cdf[i, b - 1] if b else 0.0)  # >= 0: the block's sums before it do not exceed the target
        k = int(torch.searchsorted(part.cumsum(0), rest[None], right=True))
        if k == part.shape[0]:  # the block's running sum rounded below its total: its last token that can occur
            k = int(part.nonzero()[-1])
        tokens.append(b * block + k)
    return tokens


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
        # fp32 CPU rows draw in one native call (nt_sample_rows: the same stages) where the kernels are built.
        self.native_draws = native_draws

    @staticmethod
    def argmax_only(params: Iterable[SamplingParams]) -> bool:
        """Whether a step's tokens are its rows' argmax and nothing else is needed from its logits: every row
        greedy, without penalties (they change the logits first) or log-probabilities. A step that can take the
        argmax itself (the native decode step) then hands back only the ids (`from_argmax`)."""
        return all(p.is_greedy and not p.has_penalties and p.logprobs is None for p in params)

    @staticmethod
    def from_argmax(token_ids: list[int]) -> SampleResult:
        """The result of a step whose rows `argmax_only` let take their argmax elsewhere."""
        return SampleResult(token_ids, [None] * len(token_ids))

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """logits [num_rows, vocab] fp32 (one row per entry of `rows`)."""
        raw = logits
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits, rows)
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
        # Draws use each request's CPU generator (seeded requests repeat on any device), so the rows come to the CPU:
        # one uniform per row from it, found in the row's cumulative distribution.
        uniforms = torch.cat([torch.rand(1, dtype=torch.float64, generator=rows[i].generator or self.default_generator)
                              for i in idx])
        out = argmax(logits) if len(idx) < len(rows) else [0] * len(rows)  # the greedy rows' tokens
        lib = native.library() if self.native_draws and sub.device.type == "cpu" and sub.dtype == torch.float32 \
            else None
        if lib is not None:
            drawn = native.sample_rows(lib, sub, *([getattr(p, name) for p in ps]
                                                   for name in ("temperature", "top_k", "top_p", "min_p")),
                                       uniforms.tolist())
            for i, token in zip(idx, drawn):
                out[i] = token
            return out
        dev = logits.device
        params = tuple(torch.tensor([getattr(p, name) for p in ps], device=dev)
                       for name in ("temperature", "top_k", "top_p", "min_p"))
        _, top_k, top_p, min_p = params
        # Rows whose filtered distribution lies among their largest logits draw from those (then from a wider set
        # for rows the first does not hold); the rest (plain temperature, or a nucleus wider than both) from the
        # whole filtered row.
        left = ((top_k > 0) | (top_p < 1) | (min_p > 0)).nonzero().flatten().tolist()
        done: set[int] = set()
        for count in (CANDIDATES, WIDE_CANDIDATES):
            if not left or (count == WIDE_CANDIDATES and 4 * count > sub.shape[1]):  # no cheaper than a sort there
                break
            probs, ids, bounded = candidates(take_rows(sub, left), *(take_rows(p, left) for p in params),
                                             count=count)
            held = bounded.nonzero().flatten()
            if held.numel():
                picks = torch.tensor(inverse_cdf(probs[held].cpu(), uniforms[[left[j] for j in held.tolist()]]))
                for j, token in zip(held.tolist(), ids[held].cpu().gather(1, picks[:, None])[:, 0].tolist()):
                    out[idx[left[j]]] = token
                    done.add(left[j])
            left = [left[j] for j in (~bounded).nonzero().flatten().tolist()]
        rest = [j for j in range(len(idx)) if j not in done]
        if rest:
            filtered = filter_logits(take_rows(sub, rest), *(take_rows(p, rest) for p in params))
            for j, token in zip(rest, inverse_cdf(filtered.softmax(dim=-1).cpu(), uniforms[rest])):
                out[idx[j]] = token
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

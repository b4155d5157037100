"""Logits processors: a step's penalized logits [num_rows, vocab] changed in place by each row's logit_bias,
min_tokens, bad_words, allowed_token_ids (SamplingParams; OpenAI's and vLLM's meanings) and structured output (the
grammar's mask, engine/grammar.py), before the greedy argmax and the draw.

Batched over the rows: each processor gathers the (row, token) pairs of the rows that use it into index tensors
once per step and writes them with one index_put, never a Python loop over the vocabulary. Bans are -inf, biases
finite, so the order of the processors does not change the result (-inf plus a bias stays -inf).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nextoken.engine.sampler import SamplingRow


def banned_ids(row: SamplingRow, vocab: int) -> list[int]:
    """The tokens this row may not take now: its end ids while fewer than min_tokens were generated, and the last
    token of each bad word whose prefix the output ends with (a one-token word: always)."""
    p, out = row.params, row.output_ids
    banned = [t for t in row.stop_ids if t < vocab] if len(out) < p.min_tokens else []
    for word in p.bad_words:
        prefix = len(word) - 1
        if word[-1] < vocab and prefix <= len(out) and (prefix == 0 or list(word[:-1]) == out[len(out) - prefix:]):
            banned.append(word[-1])
    return banned


def _put(logits: torch.Tensor, row_idx: Sequence[int], token_ids: Sequence[int], values: torch.Tensor | float,
         accumulate: bool = False) -> None:
    index = (torch.tensor(row_idx, dtype=torch.long, device=logits.device),
             torch.tensor(token_ids, dtype=torch.long, device=logits.device))
    value = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=logits.dtype,
                                                                          device=logits.device)
    logits.index_put_(index, value, accumulate=accumulate)


def apply_processors(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """logits [num_rows, vocab] (one row per entry of `rows`) with every row's processors applied, in place;
    returns them."""
    vocab = logits.shape[1]
    # Structured output: -inf wherever the row's grammar does not allow the token.
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    if constrained:
        from nextoken.engine.grammar import apply_masks
        apply_masks(logits, constrained, [rows[i].grammar for i in constrained])  # type: ignore[misc]
    # allowed_token_ids: the rows that restrict get a mask, True everywhere but their allowed ids; -inf there.
    restricted = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if restricted:
        mask = torch.ones(len(restricted), vocab, dtype=torch.bool, device=logits.device)  # [num_restricted, vocab]
        pairs = [(k, t) for k, i in enumerate(restricted) for t in rows[i].params.allowed_token_ids or () if t < vocab]
        if pairs:
            _put(mask, [k for k, _ in pairs], [t for _, t in pairs], torch.tensor(False, device=logits.device))
        idx = torch.tensor(restricted, dtype=torch.long, device=logits.device)
        logits[idx] = logits[idx].masked_fill(mask, float("-inf"))
    # min_tokens and bad_words: -inf at each banned (row, token).
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, row in enumerate(rows):
        if row.params.min_tokens or row.params.bad_words:
            banned = banned_ids(row, vocab)
            ban_rows += [i] * len(banned)
            ban_ids += banned
    if ban_ids:
        _put(logits, ban_rows, ban_ids, float("-inf"))
    # logit_bias: added (accumulate: a bias lands on its logit, whatever else the step writes).
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        for t, bias in row.params.logit_bias_pairs:
            if t < vocab:  # checked against the vocabulary when added; bounds kept here for direct callers
                bias_rows.append(i)
                bias_ids.append(t)
                biases.append(float(bias))
    if biases:
        _put(logits, bias_rows, bias_ids, torch.tensor(biases, dtype=logits.dtype, device=logits.device),
             accumulate=True)
    return logits

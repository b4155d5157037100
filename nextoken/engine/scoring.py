"""Perplexity of a text under the model: its tokens scored in windows of the context, each token once.

A text longer than the context is cut into windows of `context` tokens that start `stride` tokens apart (the sliding
window of transformers' perplexity guide): each window scores only the tokens the previous one did not reach, with
up to `context - stride` tokens before them as their context. Every scored token's log-probability comes from the
engine's teacher-forced prompt scores (`prompt_logprobs`: one forward pass over each window, through the paged cache
as any prompt); the first token of the text has nothing to predict it and is never scored, nor, where windows do not
overlap (stride = context), the first of each window (as in transformers' guide).

Perplexity = exp(mean negative log-likelihood over the scored tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from nextoken.errors import InvalidInput


@dataclass(frozen=True)
class Window:
    begin: int  # the window's tokens: ids[begin:end]
    end: int
    first_scored: int  # tokens ids[first_scored:end] are scored here (their predictions come from this window)


@dataclass
class Perplexity:
    tokens: int  # the text's tokens
    scored: int  # tokens scored (all but the first)
    nll: float  # the sum of their negative log-likelihoods (nats)
    windows: int

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.scored) if self.scored else float("nan")


def windows(num_tokens: int, context: int, stride: int) -> Iterator[Window]:
    """The windows over a text of `num_tokens`: each token from the second on scored in exactly one (with stride =
    context, those that begin a window in none)."""
    if context < 2:
        raise InvalidInput(f"a window of {context} tokens scores nothing: it must hold at least 2", "context")
    if not 1 <= stride <= context:
        raise InvalidInput(f"stride {stride} must be between 1 and the window's {context} tokens", "stride")
    scored_to = 1  # tokens below this are scored (the first never is)
    begin = 0
    while scored_to < num_tokens:
        end = min(begin + context, num_tokens)
        yield Window(begin, end, max(scored_to, begin + 1))
        scored_to = end
        begin += stride


def perplexity(ids: list[int], context: int, stride: int,
               score: Callable[[list[list[int]]], list[list[float | None]]], batch: int = 4,
               progress: Callable[[Perplexity, int, int], None] | None = None) -> Perplexity:
    """The perplexity of `ids`. `score` maps windows' ids to each position's log p of its own token (None at 0),
    several windows a call; `progress(result so far, windows done, windows in all)` after each call."""
    spans = list(windows(len(ids), context, stride))
    result = Perplexity(tokens=len(ids), scored=0, nll=0.0, windows=len(spans))
    for at in range(0, len(spans), batch):
        group = spans[at:at + batch]
        for w, logprobs in zip(group, score([ids[w.begin:w.end] for w in group])):
            own = logprobs[w.first_scored - w.begin:]
            assert all(lp is not None for lp in own)
            result.nll -= sum(own)  # type: ignore[arg-type]
            result.scored += len(own)
        if progress is not None:
            progress(result, at + len(group), len(spans))
    return result

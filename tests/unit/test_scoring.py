"""Perplexity windows: every token after the first scored exactly once (where windows overlap), with the context each window gives it; bad
window settings refused naming the setting."""

from __future__ import annotations

import math

import pytest

from nextoken.engine.scoring import perplexity, windows
from nextoken.errors import InvalidInput


@pytest.mark.parametrize("n", [1, 2, 3, 17, 64, 65, 200])
@pytest.mark.parametrize(("context", "stride"), [(2, 1), (2, 2), (16, 8), (16, 16), (16, 3), (64, 32)])
def test_each_token_is_scored_once(n: int, context: int, stride: int) -> None:
    scored = []
    for w in windows(n, context, stride):
        assert 0 <= w.begin < w.first_scored <= w.end <= n and w.end - w.begin <= context
        scored.extend(range(w.first_scored, w.end))
    if stride < context:
        assert scored == list(range(1, n))
    else:  # windows side by side: each one's first token has nothing before it in the window, as the text's first
        assert scored == [p for p in range(1, n) if p % context]


def test_bad_windows_are_refused() -> None:
    with pytest.raises(InvalidInput, match="at least 2"):
        list(windows(10, 1, 1))
    with pytest.raises(InvalidInput, match="stride 0"):
        list(windows(10, 8, 0))
    with pytest.raises(InvalidInput, match="stride 9"):
        list(windows(10, 8, 9))


def test_perplexity_sums_the_scored_tokens() -> None:
    """A scorer that gives token t at position p the log-probability -(t + p) / 100: the total is known exactly."""
    ids = list(range(3, 40))

    def score(batch: list[list[int]]) -> list[list[float | None]]:
        return [[None] + [-(t + p) / 100 for p, t in enumerate(w[1:], 1)] for w in batch]

    calls = []
    result = perplexity(ids, 8, 3, score, batch=2, progress=lambda r, done, total: calls.append((done, total)))
    expected = 0.0
    for w in windows(len(ids), 8, 3):
        expected += sum((ids[p] + p - w.begin) / 100 for p in range(w.first_scored, w.end))
    assert result.scored == len(ids) - 1 and math.isclose(result.nll, expected)
    assert math.isclose(result.value, math.exp(expected / (len(ids) - 1)))
    assert calls[-1] == (result.windows, result.windows) and len(calls) == math.ceil(result.windows / 2)

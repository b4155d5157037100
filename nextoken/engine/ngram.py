"""Prompt lookup (n-gram), speculative decoding's proposer without a model (engine/speculative.py).

The longest recent n-gram ending the sequence (prompt and output) that occurred before proposes the tokens that
followed it there; a match running into the sequence's end continues with the period it found ("a b a b" ->
"a b ..."). An index per sequence, updated as tokens are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

NGRAM_MIN = 2  # the shortest n-gram that may propose: a single token repeats too often to predict much
NGRAM_MAX = 6


class NgramIndex:
    """Per sequence: every n-gram (NGRAM_MIN..NGRAM_MAX tokens) that has a token after it -> where that token is, in
    its latest occurrence. Updated incrementally: each new token adds at most NGRAM_MAX - NGRAM_MIN + 1 entries."""

    def __init__(self) -> None:
        self.starts: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this position are in the index

    def update(self, ids: Sequence[int]) -> None:
        for end in range(self.num_indexed, len(ids) - 1):  # an n-gram ending at `end` is followed by ids[end + 1]
            for n in range(NGRAM_MIN, min(NGRAM_MAX, end + 1) + 1):
                self.starts[tuple(ids[end - n + 1:end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, len(ids) - 1)

    def match(self, ids: Sequence[int]) -> tuple[int, int] | None:
        """(n, start): the longest indexed n-gram ending ids, and where the token after its latest earlier occurrence
        is; None when no n-gram of NGRAM_MIN tokens or more ending ids occurred before. Reads the index as it
        stands (propose updates it first)."""
        size = len(ids)
        for n in range(min(NGRAM_MAX, size), NGRAM_MIN - 1, -1):
            start = self.starts.get(tuple(ids[size - n:]))
            if start is not None:
                return n, start
        return None

    def propose(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens to follow ids: after the latest earlier occurrence of its longest indexed suffix."""
        self.update(ids)
        found = self.match(ids)
        if found is None:
            return []
        size, start = len(ids), found[1]
        out: list[int] = []
        for j in range(k):  # past the sequence's end: the period the match found, over the proposals
            out.append(ids[start + j] if start + j < size else out[start + j - size])
        return out

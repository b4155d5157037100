"""Generated ids -> streamed text, honouring stop strings.

The incremental detokenizer gives UTF-8-safe deltas; here text that could still turn into a stop string is held
back until it either completes one (the request stops, the stop string itself is cut) or cannot any more. Stop
strings split across tokens are found because the search runs over the emitted tail plus the held-back text.
"""

from __future__ import annotations

from collections.abc import Sequence

from nextoken.tokenizer.detokenize import IncrementalDetokenizer
from nextoken.tokenizer.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str],
                 skip_special_tokens: bool, include_stop_str: bool = False) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        self.stop = tuple(stop)
        self.include_stop_str = include_stop_str
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""  # everything emitted so far
        self.pending = ""  # decoded but held back: may be the start of a stop string

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Feed one id -> (text to emit now, the stop string found or None)."""
        self.pending += self.detok.add(token_id)
        if not self.stop:
            return self._emit(len(self.pending)), None
        # Search the new text plus enough of the emitted tail to catch a stop string spanning both.
        tail_len = min(len(self.text), self.max_stop_len - 1)
        window = self.text[len(self.text) - tail_len:] + self.pending
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = window.find(s)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is not None:
            idx, s = best
            cut = idx - tail_len + (len(s) if self.include_stop_str else 0)
            # A match starting in the emitted tail was already partly shown; emit nothing more then.
            return self._emit(max(cut, 0)), s
        return self._emit(len(self.pending) - self._held_suffix()), None

    def finish(self) -> str:
        """At the end (no stop string found): everything still held back, including an incomplete character."""
        self.pending += self.detok.flush()
        return self._emit(len(self.pending))

    def _held_suffix(self) -> int:
        """Length of the longest end of `pending` that begins some stop string."""
        for n in range(min(len(self.pending), self.max_stop_len - 1), 0, -1):
            end = self.pending[-n:]
            if any(s.startswith(end) for s in self.stop):
                return n
        return 0

    def _emit(self, n: int) -> str:
        out, self.pending = self.pending[:n], self.pending[n:]
        self.text += out
        return out

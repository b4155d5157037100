"""Streaming detokenization: generated ids in, text deltas out, in O(1) per token.

Invariant: the concatenation of every `add` delta and the final `flush` equals `tokenizer.decode(generated ids)`, and
no delta contains half of a multi-byte character. Instead of re-decoding a window of recent ids (vLLM's prefix/read
offsets), it feeds each token's bytes to Python's incremental UTF-8 decoder, which holds back an incomplete trailing
sequence and replaces invalid bytes exactly as the one-shot `bytes.decode(errors="replace")` behind `decode` does.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from nextoken.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas; not thread-safe (one per sequence).

    `prompt_ids` matter only for SentencePiece-style files that prepend a space when encoding (add_space_prefix):
    `decode` drops one leading space from a text's start, but generated text that follows prompt text is not a
    start, so then its leading space is kept (for every other file the output is exactly decode(generated ids)).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._special = tokenizer.special_ids
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Whether the first character still to come is the start of the text (and a leading space must go).
        self._strip_leading_space = tokenizer.add_space_prefix and not tokenizer.decode(
            prompt_ids, skip_special_tokens=skip_special_tokens)
        self.num_tokens = 0

    def add(self, token_id: int) -> str:
        """Append one generated id; returns the text it completes (possibly "", while a character is incomplete)."""
        data = self._tokenizer.piece_bytes(token_id)  # validates the id (TokenizerError names it)
        self.num_tokens += 1
        if self._skip and int(token_id) in self._special:
            return ""
        return self._emit(self._utf8.decode(data))

    def flush(self) -> str:
        """End of the sequence: whatever is held back (an incomplete trailing character comes out as U+FFFD)."""
        return self._emit(self._utf8.decode(b"", final=True))

    def _emit(self, text: str) -> str:
        if text and self._strip_leading_space:
            self._strip_leading_space = False
            if text.startswith(" "):
                text = text[1:]
        return text

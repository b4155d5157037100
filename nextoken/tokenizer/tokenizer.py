"""Text <-> token ids for a model: `Tokenizer.from_gguf(metadata)` for a GGUF file, `Tokenizer.from_hf(spec, json)`
for a Hugging Face directory's tokenizer.json.

Encoding runs on a Hugging Face `tokenizers` object, built from the GGUF file or tokenizer.json itself (ids identical
to transformers and llama.cpp).
Decoding joins each token's bytes from a piece table and decodes UTF-8 once, so `decode` and the streaming
`IncrementalDetokenizer` agree exactly. An instance is immutable after construction and safe to share across threads.
"""

from __future__ import annotations

import bisect
import operator
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from nextoken.errors import TokenizerError
from nextoken.tokenizer.from_gguf import (
    TokenizerSpec,
    build_hf_tokenizer,
    clone_hf_tokenizer,
    parse_metadata,
    piece_table,
    special_token_ids,
)
from nextoken.tokenizer.from_hf import build_encoders


_SURROGATE = re.compile("[\ud800-\udfff]")  # lone UTF-16 halves: valid in a str, not in text


class Tokenizer:
    """A model's tokenizer. Build with `from_gguf` or `from_hf`; the attributes below are read-only by convention."""

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool  # SentencePiece-style: a space was prepended on encode, so decode drops one leading space
    special_ids: frozenset[int]  # control tokens (type 3): chat markers, BOS/EOS, <unusedN>...
    kind: str  # "bpe" (byte-level, GGUF model "gpt2") or "spm" (SentencePiece-style, GGUF model "llama")
    load_stats: dict[str, Any]  # timings of the build, and whether the merges cache was hit (spm without merges)

    def __init__(self, spec: TokenizerSpec, hf: HFTokenizer, plain_hf: HFTokenizer, pieces: list[bytes],
                 load_stats: dict[str, Any]) -> None:
        self._spec = spec
        self._hf = hf
        self._plain_hf = plain_hf  # same model, but special-token strings are ordinary text (encode_special_tokens)
        self._pieces = pieces
        self.vocab_size = len(spec.tokens)
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = spec.bos_id, spec.eos_id, spec.unk_id, spec.pad_id
        self.add_bos, self.add_eos, self.add_space_prefix = spec.add_bos, spec.add_eos, spec.add_space_prefix
        self.special_ids = frozenset(special_token_ids(spec))
        self.kind = spec.kind
        self.load_stats = load_stats
        # The one control token untrusted text may legitimately produce: <unk> (Gemma's is type 3), which BPE emits
        # for a character it cannot spell, not even byte by byte.
        self._plain_allowed = frozenset(i for i in (spec.unk_id,) if i is not None)

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], *, source: str = "model") -> Tokenizer:
        """Build from GGUF metadata (`read_gguf(path).metadata`); `source` names the file in error messages."""
        t0 = time.perf_counter()
        spec = parse_metadata(metadata, source)
        stats: dict[str, Any] = {"kind": spec.kind, "vocab_size": len(spec.tokens)}
        hf = build_hf_tokenizer(spec, stats)
        plain = clone_hf_tokenizer(hf, spec)
        plain.encode_special_tokens = True
        pieces = piece_table(spec)
        stats["total_s"] = time.perf_counter() - t0
        return cls(spec, hf, plain, pieces, stats)

    @classmethod
    def from_hf(cls, spec: TokenizerSpec, tokenizer_json: str) -> Tokenizer:
        """Build from a Hugging Face tokenizer.json (its text) and the spec derived from it with the directory's other
        files (tokenizer/from_hf.py): the file's own encoder, and the spec's pieces for decoding."""
        t0 = time.perf_counter()
        stats: dict[str, Any] = {"kind": spec.kind, "vocab_size": len(spec.tokens)}
        hf, plain = build_encoders(spec, tokenizer_json)
        stats["build_bpe_s"] = time.perf_counter() - t0
        pieces = piece_table(spec)
        stats["total_s"] = time.perf_counter() - t0
        return cls(spec, hf, plain, pieces, stats)

    # ----------------------------------------------------------------------------------------------- encoding

    def encode(self, text: str, *, add_special_tokens: bool = True,
               plain_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Token ids of `text`. `add_special_tokens` applies the file's BOS/EOS rules.

        `plain_spans`: character ranges of `text` holding untrusted content, in which special-token strings encode
        as ordinary text. Outside them (e.g. in a rendered chat template) they are single control tokens.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() needs a str, got {type(text).__name__}")
        spans = self._normalize_spans(text, plain_spans)
        lone = _SURROGATE.search(text)
        if lone is not None:
            raise TokenizerError(f"the text holds a lone surrogate (U+{ord(lone.group()):04X}) at character "
                                 f"{lone.start()}, which is not Unicode text")
        try:
            ids = self._encode_spans(text, spans) if spans else self._hf.encode(text, add_special_tokens=False).ids
        except Exception as exc:  # the tokenizers library refused it: say so in our words, with its kind
            raise TokenizerError(f"the tokenizer cannot encode this text ({type(exc).__name__})") from None
        if add_special_tokens:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    @staticmethod
    def _normalize_spans(text: str, plain_spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Sorted, merged, non-empty spans; invalid ranges raise TokenizerError naming plain_spans."""
        spans = []
        for span in plain_spans:
            try:
                start, end = (operator.index(x) for x in span)
            except (TypeError, ValueError):
                raise TokenizerError(f"plain_spans: {span!r} is not a (start, end) pair of integers") from None
            if not 0 <= start <= end <= len(text):
                raise TokenizerError(f"plain_spans: ({start}, {end}) is not a range within the text "
                                     f"(length {len(text)})")
            if start < end:
                spans.append((start, end))
        spans.sort()
        merged: list[tuple[int, int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def _encode_spans(self, text: str, spans: list[tuple[int, int]]) -> list[int]:
        enc = self._hf.encode(text, add_special_tokens=False)
        special = self.special_ids
        starts = [s for s, _ in spans]

        def in_plain(start: int, end: int) -> bool:
            k = bisect.bisect_left(starts, end)  # spans starting before `end`; the last of them reaches furthest
            return k > 0 and spans[k - 1][1] > start

        # Fast path, and the common case: no special token touches untrusted text, so the plain encoding stands.
        if not any(i in special and in_plain(s, e) for i, (s, e) in zip(enc.ids, enc.offsets)):
            return enc.ids
        # Find the special tokens of each stretch of trusted text on its own (so a match can neither reach into
        # untrusted text nor be shadowed by one that does), then encode everything between them with special-token
        # matching off. The pieces are exactly where the full encoding splits too, so trusted text encodes the same.
        cuts: list[tuple[int, int, int]] = []
        pos = 0
        for span_start, span_end in [*spans, (len(text), len(text))]:
            if pos < span_start:
                segment = text[pos:span_start]
                seg = self._hf.encode(segment, add_special_tokens=False)
                for i, (s, e) in zip(seg.ids, seg.offsets):
                    if i in special and segment[s:e] == self._spec.tokens[i]:
                        cuts.append((pos + s, pos + e, i))
            pos = span_end
        ids: list[int] = []
        prev = 0
        for start, end, token_id in cuts:
            ids += self._encode_plain(text[prev:start])
            ids.append(token_id)
            prev = end
        ids += self._encode_plain(text[prev:])
        return ids

    def _encode_plain(self, piece: str) -> list[int]:
        if not piece:
            return []
        ids = self._plain_hf.encode(piece, add_special_tokens=False).ids
        leaked = [i for i in ids if i in self.special_ids and i not in self._plain_allowed]
        if leaked:  # cannot happen by construction (see generate_merges); refuse rather than let it through
            raise TokenizerError(f"{self._spec.source}: untrusted text encoded to control token {leaked[0]} "
                                 f"({self._spec.tokens[leaked[0]]!r})")
        return ids

    # ----------------------------------------------------------------------------------------------- decoding

    def _check_id(self, token_id: int) -> int:
        try:
            i = operator.index(token_id)
        except TypeError:
            raise TokenizerError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= i < self.vocab_size:
            raise TokenizerError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        return i

    def decode_bytes(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> bytes:
        """The raw bytes `ids` stand for (before UTF-8 decoding and the leading-space rule)."""
        pieces, special = self._pieces, self.special_ids
        out = []
        for raw in ids:
            i = self._check_id(raw)
            if not (skip_special_tokens and i in special):
                out.append(pieces[i])
        return b"".join(out)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of `ids`; control tokens appear as their text unless skipped.

        Invalid UTF-8 (e.g. a cut multi-byte character) becomes one U+FFFD per maximal bad subpart, as transformers'
        byte-level decoder does. (Its SentencePiece ByteFallback decoder instead turns a whole run of byte tokens
        into U+FFFDs when any of it is invalid, valid characters included; valid text decodes identically.)
        """
        text = self.decode_bytes(ids, skip_special_tokens=skip_special_tokens).decode("utf-8", "replace")
        if self.add_space_prefix and text.startswith(" "):
            text = text[1:]  # the space encode prepended (SentencePiece's add_dummy_prefix)
        return text

    def id_to_piece(self, token_id: int) -> str:
        """The raw vocabulary string, e.g. 'Ġthe', '▁the', '<0xE4>', '<|im_end|>'."""
        return self._spec.tokens[self._check_id(token_id)]

    def token_to_id(self, piece: str) -> int | None:
        """The id of a raw vocabulary string (the last one, if the vocabulary repeats it), or None."""
        return self._spec.token_index.get(piece)

    def piece_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for: 'Ġ' -> b' ', '<0xE4>' -> b'\\xe4', '▁' -> b' '; control tokens -> text."""
        return self._pieces[self._check_id(token_id)]

    def display_piece(self, token_id: int) -> str:
        """Human-readable: the text if the bytes are valid UTF-8, else '<0xE4>' (one byte) or '\\xe4\\xbd' form."""
        data = self.piece_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            if len(data) == 1:
                return f"<0x{data[0]:02X}>"
            return data.decode("utf-8", "backslashreplace")

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, source={self._spec.source!r})"

"""Structured output: a request's StructuredOutputs (a JSON schema, any JSON object, a regex, a list of choices, a
Lark or GBNF grammar) as a mask over the vocabulary at each step, so the output matches it by construction.

The matching is llguidance's (the grammar engine llama.cpp and vLLM integrate; no JSON matcher of our own). Chosen
over xgrammar by measurement on our two vocabularies: xgrammar's mask is faster (3 us against 11-28 us per token,
SmolLM2 and Gemma 3, one thread), but both are under 1% of a decode step, and xgrammar imports transformers and
triton at run time where llguidance needs nothing; it also reads Lark and GBNF both, and takes our own piece table
as the vocabulary (the exact bytes each id stands for, the same table our decoder joins).

One `GrammarCompiler` per model: the llguidance tokenizer is built at the first constrained request (SmolLM2 0.1 s,
Gemma 3 0.9 s), then each distinct constraint is compiled once (kept, most recent first) and every request gets
its own copy of the compiled matcher (`GrammarMatcher`), which follows the tokens it accepts. JSON is generated
compact but readable (", " and ": ", no free whitespace: a small model at temperature 1 would otherwise pad it
without end); a schema's own "x-guidance" options override that.

The end: once the grammar is complete the mask allows only the model's end ids, so the request ends as any other;
a grammar that can go no further after a token (`is_stopped`) ends the request at that token.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nextoken.errors import InvalidInput
from nextoken.ops import native
from nextoken.sampling_params import StructuredOutputs
from nextoken.tokenizer.tokenizer import Tokenizer

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_COMPILED = 64  # distinct constraints kept compiled per model


class _Vocabulary:
    """The tokenizer as llguidance's TokenizerWrapper reads it: each id's bytes, the special ids, an encoder."""

    def __init__(self, tokenizer: Tokenizer, end_ids: Sequence[int]) -> None:
        self.eos_token_id = end_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.piece_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def grammar_text(constraint: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint (not yet checked)."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    kind, text = constraint.kind, constraint.schema
    if kind in ("json", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_DEFAULTS)  # type: ignore[arg-type]
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        import json
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choice
                                                                            or ()))
    # Lark, or GBNF (llama.cpp's): any_to_lark converts GBNF and leaves Lark as it is.
    try:
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text) if "::=" in text else text)
    except Exception as exc:  # the converter's own parse errors
        raise InvalidInput(f"invalid structured_outputs.grammar: {exc}", "structured_outputs") from None


class GrammarCompiler:
    """Constraints -> matchers for one model. Thread-safe: the server checks requests on worker threads while the
    engine thread makes matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, end_ids: Sequence[int]) -> None:
        self._tokenizer_src = tokenizer
        self.vocab_size = vocab_size  # the logits' width (the embedding's rows), which may exceed the tokenizer's
        self.end_ids = sorted(end_ids) or [t for t in (tokenizer.eos_id,) if t is not None]
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[StructuredOutputs, Any] = OrderedDict()

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                wrapper = llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer_src, self.end_ids))
                self._ll_tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=self.end_ids)
            return self._ll_tokenizer

    def compile(self, constraint: StructuredOutputs, param: str = "structured_outputs") -> Any:
        """The compiled matcher of a constraint (to copy, never to advance); InvalidInput naming `param` and, in
        llguidance's words, what is wrong: an unsupported keyword, an unsatisfiable schema, a bad regex."""
        with self._lock:
            if constraint in self._compiled:
                self._compiled.move_to_end(constraint)
                return self._compiled[constraint]
        import llguidance
        tokenizer = self.ll_tokenizer
        try:
            grammar = grammar_text(constraint)
        except ValueError as exc:
            raise InvalidInput(f"invalid {param}: {exc}", param) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidInput(f"invalid {param}: {_one_line(messages[0])}", param)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidInput(f"invalid {param}: {_one_line(matcher.get_error())}", param)
        with self._lock:
            self._compiled[constraint] = matcher
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, constraint: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for one request, at the start of its output."""
        return GrammarMatcher(self.compile(constraint).deep_copy(), self.vocab_size)


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._m = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0

    def bitmask(self) -> bytes:
        """The tokens the grammar allows next, a bit each (llguidance's layout: 32-bit words, little-endian bits)."""
        return self._m.compute_bitmask()

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self.bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)

    def accept(self, token_id: int) -> bool:
        """Advance over a generated token; False if the grammar does not allow it (then it is in error)."""
        ok = bool(self._m.consume_token(token_id))
        self.num_accepted += ok
        return ok

    @property
    def is_stopped(self) -> bool:
        """No token may follow (the grammar is complete, or its end id was taken)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return _one_line(self._m.get_error()) if self._m.is_error() else None


def apply_masks(logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher]) -> None:
    """-inf in logits [num_rows, vocab], in place, wherever row rows[k]'s grammar (matchers[k]) does not allow the
    token. Each matcher writes its bitmask into one buffer; on the CPU one native call fills the rows (nt_mask_rows:
    3-40 us a 50k-260k row, where numpy's masked writes take 160 us for 50k, and torch's would run on its own OpenMP
    pool, whose spinning workers contend with the kernels'); elsewhere torch expands the bits."""
    vocab = logits.shape[1]
    words = (max(m.vocab_size for m in matchers) + 31) // 32
    bits = np.zeros((len(matchers), words), dtype=np.uint32)  # 0: banned, also past a matcher's own vocabulary
    for k, m in enumerate(matchers):
        raw = np.frombuffer(m.bitmask(), dtype=np.uint32)
        bits[k, :len(raw)] = raw[:words]
    lib = native.library() if logits.device.type == "cpu" and logits.dtype == torch.float32 \
        and logits.stride(-1) == 1 else None
    if lib is not None:
        native.mask_rows(lib, logits, list(rows), bits)
        return
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    if allowed.shape[1] < vocab:
        allowed = np.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])))
    idx = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    mask = torch.from_numpy(allowed).to(logits.device)
    logits[idx] = logits[idx].masked_fill(~mask, float("-inf"))


def _one_line(message: str) -> str:
    """llguidance's message on one line, without its source excerpts and caret lines."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and not re.fullmatch(r"\^+", line) and not re.match(r"\d+ \|", line)]
    return " ".join(kept) or "the grammar is invalid"

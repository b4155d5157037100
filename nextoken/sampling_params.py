"""SamplingParams: how one request turns logits into tokens and when it stops, validated once at the edge.

temperature 0 means greedy, and so does any temperature below GREEDY_BELOW (1e-5, vLLM's choice): at such a
temperature the draw is the argmax anyway wherever two logits differ by more than a ten-thousandth, and the
logits divided by it (or its reciprocal) would overflow fp32 from about 3e-39 down. Stage order (see
engine/sampler.py): penalties, logits processors, temperature, top-k, top-p, min-p, draw.
Logits processors (engine/processors.py), off by default, as OpenAI and vLLM define them: logit_bias (token id ->
bias in [-100, 100] added to its logit), min_tokens (the request's end ids banned until that many were generated),
bad_words (token-id sequences: one token is banned always, a longer one's last token wherever the output ends with
the rest), allowed_token_ids (no other token may be generated). They bind greedy rows too; log-probabilities stay
the raw model's. Token ids are checked against the vocabulary where the engine knows it (engine/inputs.py).
Structured output (`structured_outputs`, engine/grammar.py) is one more processor: a token mask from a grammar.
Every invalid value raises InvalidSamplingParams naming the parameter and its valid range.
"""

from __future__ import annotations

import json as json_module
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from nextoken.errors import InvalidSamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_N = 16
MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam's row reads its top 2W log-probabilities
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 64
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (see the module's docstring)
MAX_GRAMMAR_CHARS = 1 << 17  # a schema, regex or grammar's text
MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match, as vLLM's StructuredOutputsParams: exactly one of a JSON schema (`json`, a dict or
    its JSON text), any JSON object (`json_object`), a regular expression (`regex`, Rust regex syntax, matched whole),
    one of a list of strings (`choice`), or a grammar (`grammar`: Lark, or GBNF where it holds "::="). Kept as text
    (a schema as its JSON text), so the params stay hashable; whether the model can follow it is checked against its
    tokenizer (engine/grammar.py), whose errors name the keyword at fault. A schema's properties are generated in the
    order it gives them."""

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidSamplingParams("invalid structured_outputs: give exactly one of json, json_object, regex, "
                                        f"choice and grammar (got {', '.join(given) or 'none'})")
        if isinstance(self.json, Mapping):
            try:
                text = json_module.dumps(self.json, allow_nan=False)  # in its order: the output's keys follow it
            except (TypeError, ValueError) as exc:
                raise InvalidSamplingParams(f"invalid structured_outputs.json: not a JSON schema ({exc})") from None
            object.__setattr__(self, "json", text)
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) and c for c in self.choice) \
                    or not 1 <= len(self.choice) <= MAX_CHOICES:
                raise InvalidSamplingParams(f"invalid structured_outputs.choice: must be 1 to {MAX_CHOICES} "
                                            "non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        name = given[0]
        if name in ("json", "regex", "grammar"):
            text = getattr(self, name)
            if not isinstance(text, str) or not text.strip() or len(text) > MAX_GRAMMAR_CHARS:
                raise InvalidSamplingParams(f"invalid structured_outputs.{name}: must be a non-empty string of at "
                                            f"most {MAX_GRAMMAR_CHARS} characters")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None)

    @property
    def schema(self) -> str:
        """The JSON schema text, the regex, the choices as a JSON list, or the grammar."""
        if self.json_object:
            return '{"type": "object"}'
        if self.choice is not None:
            return json_module.dumps(list(self.choice))
        return cast(str, getattr(self, self.kind))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-K log-probabilities of each generated position
    prompt_logprobs: int | None = None  # top-K log-probabilities at each prompt position (teacher-forced)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Beam search (engine/beam.py) where set: the beams kept, the exponent of the length its scores are divided by,
    # and whether it ends as soon as beam_width hypotheses are finished. Deterministic: no draw, no penalties.
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool = False
    # Logits processors (see the module's docstring). logit_bias is given as a mapping and kept as sorted
    # (id, bias) pairs, so the params stay hashable; allowed_token_ids None: every token.
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    structured_outputs: StructuredOutputs | None = None  # a token mask from a grammar (engine/grammar.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            if len(bias) > MAX_LOGIT_BIAS:  # before sorting: a huge mapping is refused without the work
                raise InvalidSamplingParams(f"invalid logit_bias=<{len(bias)} entries>: must be at most "
                                            f"{MAX_LOGIT_BIAS} entries")
            pairs = bias.items()
            try:
                bias = tuple(sorted(pairs))
            except TypeError:  # keys that do not compare (an int beside a str) are invalid anyway
                bias = tuple(pairs)
        object.__setattr__(self, "logit_bias", tuple(bias))
        object.__setattr__(self, "bad_words", tuple(tuple(w) if isinstance(w, (list, tuple)) else w
                                                    for w in self.bad_words))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def has_processors(self) -> bool:
        """Whether a logits processor changes this request's logits (some step may still leave them as they are)."""
        return bool(self.logit_bias or self.min_tokens or self.bad_words or self.allowed_token_ids is not None
                    or self.structured_outputs is not None)

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as kept: (id, bias) pairs by id."""
        return cast(tuple[tuple[int, float], ...], self.logit_bias)

    @property
    def processor_ids(self) -> dict[str, list[int]]:
        """The token ids each processor names, by parameter: for the check against the vocabulary."""
        return {"logit_bias": [t for t, _ in self.logit_bias_pairs],
                "bad_words": [t for w in self.bad_words for t in w],
                "allowed_token_ids": list(self.allowed_token_ids or ())}

    def _validate(self) -> None:
        def fail(name: str, value: object, valid: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"invalid {name}={value!r}: must be {valid}")

        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise fail(name, value, "a finite number")
            return float(value)

        def integer(name: str) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not -2**63 <= value < 2**63:
                raise fail(name, value, "a 64-bit integer")
            return value

        if not 1 <= integer("max_tokens"):
            raise fail("max_tokens", self.max_tokens, ">= 1")
        if number("temperature") < 0:
            raise fail("temperature", self.temperature, ">= 0 (0 means greedy)")
        if integer("top_k") < 0:
            raise fail("top_k", self.top_k, ">= 0 (0 turns it off)")
        if not 0 < number("top_p") <= 1:
            raise fail("top_p", self.top_p, "in (0, 1]")
        if not 0 <= number("min_p") <= 1:
            raise fail("min_p", self.min_p, "in [0, 1]")
        if not 0 < number("repetition_penalty") <= 10:
            raise fail("repetition_penalty", self.repetition_penalty, "in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= number(name) <= 2:
                raise fail(name, getattr(self, name), "in [-2, 2]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise fail("seed", self.seed, "an integer in [0, 2^63)")
        if not 1 <= integer("n") <= MAX_N:
            raise fail("n", self.n, f"between 1 and {MAX_N}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise fail("stop", f"<{len(self.stop)} strings>", f"at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise fail("stop", s, f"non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**63:
                raise fail("stop_token_ids", t, "non-negative token ids")
        if self.beam_width is not None:
            if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                    or not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
                raise fail("beam_width", self.beam_width, f"an integer between 1 and {MAX_BEAM_WIDTH}")
            if self.n > self.beam_width:
                raise fail("n", self.n, f"at most beam_width={self.beam_width} (the best n beams are returned)")
            if self.stop:
                raise fail("stop", self.stop, "empty with beam search (stop_token_ids end beams)")
            if self.prompt_logprobs is not None:  # the search scores its beams, not the prompt
                raise fail("prompt_logprobs", self.prompt_logprobs, "unset with beam search")
        if not -10 <= number("length_penalty") <= 10:
            raise fail("length_penalty", self.length_penalty, "in [-10, 10]")
        if not isinstance(self.early_stopping, bool):
            raise fail("early_stopping", self.early_stopping, "true or false")
        self._validate_processors(fail)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise fail(name, value, f"an integer between 0 and {MAX_LOGPROBS}")

    def _validate_processors(self, fail: Callable[[str, object, str], InvalidSamplingParams]) -> None:
        def token_id(t: object) -> bool:
            return not isinstance(t, bool) and isinstance(t, int) and 0 <= t < 2**63

        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise fail("logit_bias", f"<{len(self.logit_bias)} entries>", f"at most {MAX_LOGIT_BIAS} entries")
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise fail("logit_bias", pair, "a mapping of token ids to biases")
            t, bias = pair
            if not token_id(t):
                raise fail("logit_bias", t, "keyed by non-negative integer token ids")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise fail("logit_bias", bias, "biases in [-100, 100]")  # NaN fails the comparison too
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise fail("min_tokens", self.min_tokens, f"an integer between 0 and max_tokens={self.max_tokens}")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise fail("bad_words", f"<{len(self.bad_words)} sequences>", f"at most {MAX_BAD_WORDS} sequences")
        for word in self.bad_words:
            if not isinstance(word, tuple) or not 1 <= len(word) <= MAX_BAD_WORD_TOKENS \
                    or not all(token_id(t) for t in word):
                raise fail("bad_words", word, f"sequences of 1 to {MAX_BAD_WORD_TOKENS} non-negative token ids")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise fail("allowed_token_ids", list(self.allowed_token_ids), "not empty (None allows every token)")
            bad = next((t for t in self.allowed_token_ids if not token_id(t)), None)
            if bad is not None:
                raise fail("allowed_token_ids", bad, "non-negative token ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise fail("structured_outputs", self.structured_outputs, "a StructuredOutputs")
        if self.beam_width is not None and self.has_processors:
            # Beams rank the raw model's log-probabilities; a processor there would be accepted and ignored.
            name = next(n for n, v in (("logit_bias", self.logit_bias), ("min_tokens", self.min_tokens),
                                       ("bad_words", self.bad_words),
                                       ("structured_outputs", self.structured_outputs)) if v) \
                if self.allowed_token_ids is None else "allowed_token_ids"
            raise fail(name, getattr(self, name), "unset with beam search")

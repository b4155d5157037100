"""SamplingParams: how one request turns logits into tokens and when it stops, validated once at the edge.

temperature 0 means greedy, and so does any temperature below GREEDY_BELOW (1e-5, vLLM's choice): at such a
temperature the draw is the argmax anyway wherever two logits differ by more than a ten-thousandth, and the
logits divided by it (or its reciprocal) would overflow fp32 from about 3e-39 down. Stage order (see
engine/sampler.py): penalties, temperature, top-k, top-p, min-p, draw.
Every invalid value raises InvalidSamplingParams naming the parameter and its valid range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nextoken.errors import InvalidSamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_N = 16
MAX_LOGPROBS = 20
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # each beam's row reads its top 2W log-probabilities
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (see the module's docstring)


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

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
        if not -10 <= number("length_penalty") <= 10:
            raise fail("length_penalty", self.length_penalty, "in [-10, 10]")
        if not isinstance(self.early_stopping, bool):
            raise fail("early_stopping", self.early_stopping, "true or false")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise fail(name, value, f"an integer between 0 and {MAX_LOGPROBS}")

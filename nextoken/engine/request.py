"""Request: one sequence's state in the engine, and RequestOutput, what a step reports about it.

One counter drives everything: `num_computed_tokens` catches up to `num_tokens` (prompt + generated). A prompt is
computed in one or more chunks; a prefix-cache hit advances the counter without compute; preemption resets it to 0.
A token is sampled whenever a step brings the counter level with `num_tokens`. Speculative decoding
(engine/speculative.py) computes proposed tokens past `num_tokens` in the same step; the counter counts them and
takes back the rejected ones (Scheduler.advance).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from nextoken.errors import NextokenError
from nextoken.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Timings:
    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    # Speculative decoding: tokens proposed and accepted, and the steps that verified proposals.
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    num_spec_steps: int = 0


class Request:
    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 eog_ids: frozenset[int]) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.all_ids = list(prompt_ids)  # prompt + output, kept in step so slicing never concatenates
        self.num_computed_tokens = 0
        self.num_cached_blocks = 0  # leading blocks of block_table already registered in the prefix cache
        self.block_table: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: int | str | None = None  # the end id or stop string that finished it
        self.num_preemptions = 0
        self.timings = Timings()
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eog_ids)
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # per output token, when asked
        self.prompt_logprobs: list[list[tuple[int, float]]] = []  # per prompt position, when asked
        # Per prompt position i >= 1, when prompt_logprobs is asked: (log p of token i given those before it, its
        # rank among all tokens, 1 = the most likely); position 0 has none (nothing before it).
        self.prompt_token_logprobs: list[tuple[float, int] | None] = []
        self.beams: list[Any] | None = None  # a finished beam search's best hypotheses (engine/beam.py)
        self.grammar: Any = None  # structured output's GrammarMatcher (engine/grammar.py), advanced per token
        # Why the engine ended this request with finish_reason "error", where the request's own settings did it (a
        # NextokenError its caller gets, a 400 from the server); None for a fault of the engine's.
        self.error: NextokenError | None = None
        # Speculative decoding: the tokens proposed to follow all_ids, to be verified in the next step, and the
        # proposer's own state for this sequence (engine/speculative.py).
        self.spec_ids: list[int] = []
        # A sampled draft's distribution for each of spec_ids (engine/rejection.py); empty for other proposals.
        self.spec_q: list[Any] = []
        # The last verifying step's rejection rule (engine/rejection.RuleTrail; None: the one-hot rule), for a tracer.
        self.spec_rule: Any = None
        self.spec_state: Any = None
        # The head draft's passes over this request's own cache (engine/head_draft.py): (the position of their first
        # token, the tokens they drafted, the final norm's rows [len(drafted), hidden] for the last known token and
        # each drafted one but the last), so that verifying computes only the last proposal; None otherwise.
        self.spec_hidden: tuple[int, list[int], torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        self.all_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.timings.finished = time.perf_counter()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed {self.num_computed_tokens}/"
                f"{self.num_tokens}, blocks {len(self.block_table)})")


@dataclass
class RequestOutput:
    """A step's news about one request: the new token ids and text since the last output, and totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    new_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    request: Request | None = None  # the request itself, for totals (timings, logprobs) once finished

"""One request through the engine, step by step, with a tracer watching: the path `nextoken run` takes
(the engine's input processor, `LLMEngine.add_request`, `LLMEngine.step` until the request finishes), timed as a whole.

The engine must be idle: the tracer takes every forward pass to be this request's. Also here: `--compare`
settings ("temperature=0.2,top_p=0.9") parsed into SamplingParams, validated like any other.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nextoken.engine.inputs import Chat
from nextoken.errors import NextokenError
from nextoken.sampling_params import SamplingParams
from nextoken.trace.tracer import NullTracer

if TYPE_CHECKING:
    from nextoken.llm import LLM

# Settings `--compare` may change: the ones that shape the sampled distribution, and the seed and length.
COMPARE_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty", "seed", "max_tokens")
_ids = itertools.count()


@dataclass
class RunResult:
    """A finished request: its rendered prompt, ids, output and timings (seconds)."""

    prompt_text: str  # as sent to the tokenizer (chat template applied unless raw)
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str | None
    total_s: float  # wall time from before tokenization to the last step's return
    timings: dict[str, float | None]  # the engine's request timings (llm.request_timings)
    params: SamplingParams
    tracer: Any  # the tracer that watched (NullTracer or RecordingTracer)


def run_request(llm: LLM, prompt: str, params: SamplingParams, *, raw: bool = False, system: str | None = None,
                tracer: NullTracer | None = None) -> RunResult:
    """Tokenize `prompt` (as one user turn unless raw), run it to the end, and report. The tracer is attached for
    this run only and detached whatever happens."""
    from nextoken.llm import request_timings

    tracer = tracer if tracer is not None else NullTracer()
    engine = llm.engine
    if engine.has_unfinished():
        raise NextokenError("the engine is running other requests; a trace needs it to itself")
    tracer.attach(engine)
    request_id: str | None = None
    finished = False
    try:
        start = time.perf_counter()
        tracer.start(start)
        # As `nextoken run`: the text as it is (the user's own: special-token text is control tokens), or one turn.
        rendered, prompt_ids = llm.inputs.prompt_ids(prompt if raw else Chat.turn(prompt, system), special_tokens=True)
        text = rendered if rendered is not None else prompt
        tracer.record("tokenize", start, time.perf_counter())
        request_id = engine.add_request(prompt_ids, params, f"trace-{next(_ids)}")
        request = engine.get_request(request_id)
        assert request is not None
        tracer.begin_request(request)
        pieces: list[str] = []
        # Every step computes at least one token of the request, so this bounds a loop that would never finish.
        for _ in range(len(prompt_ids) + params.max_tokens + 1):
            tracer.begin_step()
            outputs = engine.step()
            tracer.end_step()
            for out in outputs:
                if out.request_id == request_id:
                    pieces.append(out.new_text)
                    finished = out.finished
            if finished:
                break
        else:
            raise RuntimeError(f"request {request_id} did not finish within its token budget")
        total = time.perf_counter() - start
    finally:
        if request_id is not None and not finished:
            engine.abort(request_id)
        tracer.detach()
    return RunResult(prompt_text=text, prompt_ids=prompt_ids, output_ids=list(request.output_ids),
                     text="".join(pieces), finish_reason=request.finish_reason, total_s=total,
                     timings=request_timings(request), params=params, tracer=tracer)


def parse_setting(setting: str, base: SamplingParams) -> SamplingParams:
    """"temperature=0.2,top_p=0.9" -> `base` with those fields replaced (and validated)."""
    changes: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in setting.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in COMPARE_KEYS:
            raise NextokenError(f"bad --compare setting {part!r}: expected KEY=VALUE with KEY one of "
                                f"{', '.join(COMPARE_KEYS)}")
        kind = int if key in ("top_k", "seed", "max_tokens") else float
        try:
            changes[key] = None if key == "seed" and value.strip().lower() == "none" else kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise NextokenError(f"bad --compare setting {part!r}: {value!r} is not {what}") from None
    if not changes:
        raise NextokenError(f"empty --compare setting {setting!r}")
    return dataclasses.replace(base, **changes)

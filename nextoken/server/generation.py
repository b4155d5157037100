"""From a validated completions / chat request to engine requests.

`prepare` (run off the event loop: it tokenizes) turns a request into a `Job`: one engine request per prompt and
choice, choice index = prompt index * n + choice. The engine's input processor (engine/inputs.py) renders, encodes
and checks every prompt, fits it and max_tokens to the context and the KV cache, checks stop_token_ids against the
vocabulary and seeds each choice; its errors come back as 400s naming the parameter. Their outputs become response
bodies and stream chunks in server/choices.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from nextoken.engine.async_engine import SubRequest
from nextoken.engine.engine import LLMEngine
from nextoken.engine.inputs import choices, prompt_list
from nextoken.engine.reasoning import opened_by_prompt
from nextoken.engine.record import with_logprobs
from nextoken.engine.tools import prepare_messages, template_renders_tools
from nextoken.errors import NextokenError
from nextoken.sampling_params import SamplingParams
from nextoken.server.errors import ApiError, api_error_from
from nextoken.server.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)

Kind = Literal["chat", "completion"]


@dataclass
class Job:
    kind: Kind
    response_id: str
    model: str
    prompts: list[list[int]]
    n: int
    requests: list[SubRequest]
    stream: bool
    include_usage: bool
    logprobs: int | None
    # A reasoning model's chat: per prompt, whether its rendered text leaves a thinking section open (None: answers
    # are all content).
    thinking: list[bool] | None = None
    echo: bool = False  # completions: the prompt before each choice's text (and its scores, with logprobs)
    per_prompt: int = 1  # engine requests per prompt: n, best_of (sampled, the best n returned) or 1 (a beam search)
    beam: bool = False  # the choices are a beam search's n best beams
    tool_calls: bool = False  # a chat whose answers may hold tool calls (engine/tools.py), parsed from the content
    record: SamplingParams | None = None  # a recorded request's params as asked (engine/record.py)
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.perf_counter)

def render_messages(engine: LLMEngine, messages: Sequence[ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[int]]:
    """Chat messages -> (prompt text, ids) (the input processor's render: contents stay plain text)."""
    try:
        return engine.inputs.render_chat([m.model_dump() for m in messages], add_generation_prompt, template_kwargs)
    except NextokenError as exc:
        raise api_error_from(exc, param="messages") from None


def encode_prompt(engine: LLMEngine, text: str, add_special_tokens: bool, special_tokens: bool) -> list[int]:
    """A raw text prompt's ids: its special-token text stays plain text unless `special_tokens` (the request's
    extension field) asks for control tokens; `add_special_tokens` applies the file's BOS/EOS rules."""
    try:
        return engine.inputs.encode(text, special_tokens=special_tokens, add_special_tokens=add_special_tokens)
    except NextokenError as exc:
        raise api_error_from(exc, param="prompt") from None


def _prompts(engine: LLMEngine, request: CompletionRequest | ChatCompletionRequest
             ) -> tuple[list[list[int]], list[bool] | None]:
    """The request's prompts as ids, each through the input processor; for a reasoning model's chat, whether each
    prompt leaves a thinking section open (else None)."""
    if isinstance(request, ChatCompletionRequest):
        if not request.messages:
            raise ApiError(400, "messages is empty", param="messages")
        setup = request.tool_setup()
        native = template_renders_tools(engine.chat_template.source)
        messages, tool_vars = prepare_messages([m.model_dump() for m in request.messages], setup, native)
        extra = {**(request.chat_template_kwargs or {}), **tool_vars}
        try:
            text, ids = engine.inputs.render_chat(messages, True, extra)
        except NextokenError as exc:
            raise api_error_from(exc, param="messages") from None
        return [ids], [opened_by_prompt(text)] if engine.inputs.thinks else None
    items = prompt_list(request.prompt)
    if not items:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise ApiError(400, f"{len(items)} prompts in one request; the limit is {MAX_PROMPTS}", param="prompt")
    try:
        return [engine.inputs.prompt_ids(item, special_tokens=bool(request.special_tokens))[1] for item in items], None
    except NextokenError as exc:
        raise api_error_from(exc, param="prompt") from None


def prepare(engine: LLMEngine, request: CompletionRequest | ChatCompletionRequest, kind: Kind,
            record: bool = False) -> Job:
    """Validate and tokenize; raises ApiError naming the parameter at fault. `record`: the request is to be recorded
    (one prompt, one choice), its rows reading the top-K log-probabilities a record keeps."""
    prompt_param = "messages" if kind == "chat" else "prompt"
    prompts, thinking = _prompts(engine, request)
    inputs = engine.inputs
    try:
        inputs.check_stop_token_ids(request.stop_token_ids or ())
        bad_words = inputs.bad_words_ids(request.bad_words or ())
    except NextokenError as exc:
        raise api_error_from(exc) from None
    asked = request.requested_max_tokens()
    tools = request.tool_setup() if isinstance(request, ChatCompletionRequest) else None
    n = request.num_choices
    queue = engine.config.max_waiting
    subrequests: list[SubRequest] = []
    response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    try:
        if len(prompts) * n > queue:  # admitted all at once into the waiting queue: this one never could be
            param = "n" if n > 1 else prompt_param
            raise ApiError(400, f"n={n} choices for {len(prompts)} prompt(s) make {len(prompts) * n} requests, more "
                                f"than the {queue} the waiting queue holds (--max-waiting)", param=param)
        best_of = getattr(request, "best_of", None) or n
        for p, ids in enumerate(prompts):
            max_tokens = inputs.fit(ids, asked, param=prompt_param)  # asked, or --max-tokens-default within room
            params = request.sampling_params(max_tokens, request.seed)
            if tools is not None and tools.constraint() is not None:
                params = replace(params, structured_outputs=tools.constraint())
            if bad_words:
                params = replace(params, bad_words=bad_words)
            inputs.check_processor_ids(params, "tools" if tools is not None and tools.constraint() is not None
                                       else request.structured_param)
            if best_of > n and params.logprobs is None:
                params = replace(params, logprobs=0)  # the chosen tokens' log-probabilities rank the candidates
            for i, choice_params in enumerate(choices(params, best_of)):
                subrequests.append(SubRequest(f"{response_id}-{p}-{i}", ids, choice_params,
                                              f"{response_id}-{p}-0" if i else None))
    except NextokenError as exc:
        raise api_error_from(exc) from None
    recorded = None
    if record:
        if len(subrequests) != 1 or request.beam_width is not None:
            raise ApiError(400, "a recorded request has one prompt and one choice (n=1, no best_of or beam search)",
                           param="n")
        recorded = subrequests[0].params
        subrequests[0] = replace(subrequests[0], params=with_logprobs(recorded))
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return Job(kind=kind, response_id=response_id, model=engine.model_name, prompts=prompts, n=n,
               requests=subrequests, stream=bool(request.stream), include_usage=include_usage,
               logprobs=request.num_logprobs(), thinking=thinking, record=recorded,
               echo=isinstance(request, CompletionRequest) and bool(request.echo),
               per_prompt=len(subrequests) // len(prompts), beam=request.beam_width is not None,
               tool_calls=tools is not None and tools.calls_possible)

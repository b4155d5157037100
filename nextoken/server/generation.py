"""From a validated completions / chat request to engine requests, and from their outputs to OpenAI bodies.

`prepare` (run off the event loop: it tokenizes) turns a request into a `Job`: one engine request per prompt and
choice, choice index = prompt index * n + choice, seed + choice when seeded. Every limit is checked here with the
parameter named: prompt length against the context, max_tokens against the context minus the prompt (both counts
in the message), stop_token_ids against the vocabulary. `Choices` accumulates outputs into response bodies and
stream chunks; usage counts each prompt once and every choice's tokens.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from nextoken.engine.async_engine import SubRequest
from nextoken.engine.engine import LLMEngine
from nextoken.engine.request import RequestOutput
from nextoken.errors import NextokenError
from nextoken.server.errors import ApiError, api_error_from
from nextoken.server.protocol import (
    MAX_PROMPTS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    TokenLogprob,
    TopLogprob,
    Usage,
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
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.perf_counter)


def render_messages(engine: LLMEngine, messages: Sequence[ChatMessage], add_generation_prompt: bool = True
                    ) -> list[int]:
    """Chat messages -> prompt ids; special-token text inside contents stays plain text (as LLM.render_chat)."""
    dicts = [m.model_dump() for m in messages]
    try:
        text, spans = engine.chat_template.render_with_spans(dicts, add_generation_prompt=add_generation_prompt)
        return engine.tokenizer.encode(text, add_special_tokens=False, plain_spans=spans)
    except NextokenError as exc:
        raise api_error_from(exc, param="messages") from None


def encode_prompt(engine: LLMEngine, text: str, add_special_tokens: bool, special_tokens: bool) -> list[int]:
    """A raw text prompt's ids: its special-token text stays plain text unless `special_tokens` (the request's
    extension field) asks for control tokens; `add_special_tokens` applies the file's BOS/EOS rules."""
    try:
        return engine.tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                       plain_spans=() if special_tokens else [(0, len(text))])
    except NextokenError as exc:
        raise api_error_from(exc, param="prompt") from None


def _prompts(engine: LLMEngine, request: CompletionRequest) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        items: list[str | list[int]] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]  # type: ignore[list-item]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise ApiError(400, f"{len(items)} prompts in one request; the limit is {MAX_PROMPTS}", param="prompt")
    vocab = engine.model_config.vocab_size
    out = []
    for item in items:
        if isinstance(item, str):
            ids = encode_prompt(engine, item, True, bool(request.special_tokens))
        else:
            bad = next((t for t in item if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})",
                               param="prompt")
            ids = list(item)
        out.append(ids)
    return out


def prepare(engine: LLMEngine, request: CompletionRequest | ChatCompletionRequest, kind: Kind) -> Job:
    """Validate and tokenize; raises ApiError naming the parameter at fault."""
    prompt_param = "messages" if kind == "chat" else "prompt"
    if isinstance(request, ChatCompletionRequest):
        if not request.messages:
            raise ApiError(400, "messages is empty", param="messages")
        prompts = [render_messages(engine, request.messages)]
    else:
        prompts = _prompts(engine, request)
    vocab = engine.model_config.vocab_size
    bad_stop = next((t for t in request.stop_token_ids or () if not 0 <= t < vocab), None)
    if bad_stop is not None:
        raise ApiError(400, f"stop_token_ids: {bad_stop} is outside the vocabulary (0..{vocab - 1})",
                       param="stop_token_ids")
    max_len = engine.max_model_len
    pool_tokens = engine.block_manager.num_blocks * engine.block_manager.block_size
    asked = request.requested_max_tokens()
    n = request.num_choices
    queue = engine.config.max_waiting
    if len(prompts) * n > queue:  # admitted all at once into the waiting queue: this one never could be
        param = "n" if n > 1 else prompt_param
        raise ApiError(400, f"n={n} choices for {len(prompts)} prompt(s) make {len(prompts) * n} requests, more than "
                            f"the {queue} the waiting queue holds (--max-waiting)", param=param)
    subrequests: list[SubRequest] = []
    response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    for p, ids in enumerate(prompts):
        if not ids:
            raise ApiError(400, "the prompt is empty", param=prompt_param)
        if len(ids) >= max_len:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context holds {max_len} (the prompt "
                                "must leave room for at least one generated token)", param=prompt_param)
        limit = min(max_len, pool_tokens)
        where = "the context" if limit == max_len else "the whole KV cache"
        room = limit - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but {where} holds {limit}", param=prompt_param)
        if asked is not None and asked > room:
            raise ApiError(400, f"the prompt has {len(ids)} tokens and max_tokens is {asked}: together "
                                f"{len(ids) + asked} tokens, more than the {limit} that {where} holds",
                           param="max_tokens")
        try:
            default = min(room, engine.config.max_tokens_default)  # --max-tokens-default
            base = request.sampling_params(asked if asked is not None else default, request.seed)
        except NextokenError as exc:
            raise api_error_from(exc) from None
        for i in range(n):
            params = base if base.seed is None or i == 0 else replace(base, seed=(base.seed + i) % 2**63)
            subrequests.append(SubRequest(f"{response_id}-{p}-{i}", ids, params))
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return Job(kind=kind, response_id=response_id, model=engine.model_name, prompts=prompts, n=n,
               requests=subrequests, stream=bool(request.stream), include_usage=include_usage,
               logprobs=subrequests[0].params.logprobs)


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    token_logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)


class Choices:
    """The outputs of a job's engine requests so far, and the response bodies and chunks made from them."""

    def __init__(self, job: Job, engine: LLMEngine) -> None:
        self.job = job
        self.engine = engine
        self.choices = [_Choice() for _ in job.requests]

    def add(self, index: int, out: RequestOutput) -> None:
        choice = self.choices[index]
        if choice.first_token_at is None and out.new_token_ids:
            choice.first_token_at = time.perf_counter()
        choice.text.append(out.new_text)
        choice.num_tokens = out.num_output_tokens
        if out.finished:
            choice.finish_reason = out.finish_reason
        if self.job.logprobs is not None:
            for token_id, (chosen, top) in zip(out.new_token_ids, out.new_logprobs):
                choice.token_logprobs.append((token_id, chosen, top))

    def usage(self) -> Usage:
        prompt = sum(len(ids) for ids in self.job.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def response(self) -> dict[str, Any]:
        job = self.job
        if job.kind == "chat":
            return ChatCompletionResponse(
                id=job.response_id, created=job.created, model=job.model, usage=self.usage(),
                choices=[ChatChoice(index=i, message=AssistantMessage(content="".join(c.text)),
                                    logprobs=self._chat_logprobs(c.token_logprobs),
                                    finish_reason=c.finish_reason) for i, c in enumerate(self.choices)]
            ).model_dump()
        return CompletionResponse(
            id=job.response_id, created=job.created, model=job.model, usage=self.usage(),
            choices=[CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason,
                                      logprobs=self._completion_logprobs(c.token_logprobs))
                     for i, c in enumerate(self.choices)]
        ).model_dump()

    def role_chunk(self) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant role (OpenAI's first chunk); completions have none."""
        if self.job.kind != "chat":
            return None
        return self._chunk([ChatChunkChoice(index=i, delta=Delta(role="assistant", content=""))
                            for i in range(len(self.choices))])

    def delta_chunk(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        """The chunk for one output (after `add`), or None when it carries nothing to show yet."""
        num_new = len(out.new_token_ids)
        entries = self.choices[index].token_logprobs[-num_new:] if self.job.logprobs is not None and num_new else []
        if not out.new_text and not out.finished and not entries:
            return None  # text held back (a possible stop string, half a character): nothing to send yet
        reason = out.finish_reason if out.finished else None
        if self.job.kind == "chat":
            return self._chunk([ChatChunkChoice(index=index, delta=Delta(content=out.new_text),
                                                logprobs=self._chat_logprobs(entries), finish_reason=reason)])
        chunk = CompletionResponse(id=self.job.response_id, created=self.job.created, model=self.job.model,
                                   choices=[CompletionChoice(index=index, text=out.new_text, finish_reason=reason,
                                                             logprobs=self._completion_logprobs(entries))])
        return self._with_usage_slot(chunk.model_dump())

    def usage_chunk(self) -> dict[str, Any]:
        if self.job.kind == "chat":
            return ChatCompletionChunk(id=self.job.response_id, created=self.job.created, model=self.job.model,
                                       choices=[], usage=self.usage()).model_dump()
        return CompletionResponse(id=self.job.response_id, created=self.job.created, model=self.job.model,
                                  choices=[], usage=self.usage()).model_dump()

    def _chunk(self, choices: list[ChatChunkChoice]) -> dict[str, Any]:
        chunk = ChatCompletionChunk(id=self.job.response_id, created=self.job.created, model=self.job.model,
                                    choices=choices)
        data = chunk.model_dump()
        for choice in data["choices"]:  # OpenAI's deltas carry only the keys that change
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        return self._with_usage_slot(data)

    def _with_usage_slot(self, chunk: dict[str, Any]) -> dict[str, Any]:
        # With include_usage every chunk carries "usage": null and the last one the totals, as OpenAI sends them.
        chunk.pop("usage", None)
        if self.job.include_usage:
            chunk["usage"] = None
        return chunk

    def _piece(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.engine.tokenizer.piece_bytes(token_id)
        return raw.decode("utf-8", "replace"), list(raw)

    def _chat_logprobs(self, entries: list[tuple[int, float, list[tuple[int, float]]]]) -> ChatLogprobs | None:
        if self.job.logprobs is None:
            return None
        content = []
        for token_id, chosen, top in entries:
            text, raw = self._piece(token_id)
            tops = [TopLogprob(token=t, logprob=lp, bytes=b) for (t, b), lp in
                    ((self._piece(i), lp) for i, lp in top)]
            content.append(TokenLogprob(token=text, logprob=chosen, bytes=raw, top_logprobs=tops))
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, entries: list[tuple[int, float, list[tuple[int, float]]]]
                             ) -> CompletionLogprobs | None:
        if self.job.logprobs is None:
            return None
        tokens, offsets, offset = [], [], 0
        for token_id, _, _ in entries:
            text = self._piece(token_id)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(tokens=tokens, token_logprobs=[chosen for _, chosen, _ in entries],
                                  top_logprobs=[{self._piece(i)[0]: lp for i, lp in top} for _, _, top in entries],
                                  text_offset=offsets)

"""From a Job's engine outputs to OpenAI bodies: `Choices` accumulates each choice's text, reasoning, tool calls
and log-probabilities into a whole response or stream chunks, ranks best_of's samples by their answers' mean
log-probability, and counts usage (each prompt once, every choice's tokens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nextoken.engine.engine import LLMEngine
from nextoken.engine.reasoning import ReasoningSplitter
from nextoken.engine.request import RequestOutput
from nextoken.engine.tools import ToolCall, ToolCallParser
from nextoken.server.generation import Job
from nextoken.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    FunctionCallOut,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)


def _tool_call(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


def _tool_call_delta(index: int, call: ToolCall) -> ToolCallDelta:
    """A completed call as one stream delta: its index among the message's calls, id, name and whole arguments."""
    return ToolCallDelta(index=index, id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


# (token, its log-probability, the top ones there); an echoed prompt's first token has neither.
LogprobEntry = tuple[int, float | None, list[tuple[int, float]] | None]


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    token_logprobs: list[LogprobEntry] = field(default_factory=list)
    num_echoed: int = 0  # the echoed prompt's entries, first in token_logprobs
    splitter: ReasoningSplitter | None = None  # a reasoning model's: the thinking section apart from the content
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    last_split: tuple[str, str] = ("", "")  # the latest output's (reasoning, content)
    echoed: bool = False  # its prompt was sent (echo)
    beams: list[Any] | None = None  # a beam search's n best hypotheses
    tools: ToolCallParser | None = None  # a chat with tools: its content's calls, parsed as it streams
    new_calls: list[ToolCall] = field(default_factory=list)  # the latest output's completed calls


def _mean_logprob(entries: Sequence[LogprobEntry]) -> float:
    """The mean log-probability of an answer's tokens (best_of's ranking)."""
    return sum(lp for _, lp, _ in entries if lp is not None) / max(len(entries), 1)


class Choices:
    """The outputs of a job's engine requests so far, and the response bodies and chunks made from them."""

    def __init__(self, job: Job, engine: LLMEngine) -> None:
        self.job = job
        self.engine = engine
        self.choices = [_Choice() for _ in job.requests]
        if job.thinking is not None:
            for i, choice in enumerate(self.choices):
                choice.splitter = ReasoningSplitter(job.thinking[i // job.per_prompt])
        if job.tool_calls:
            for choice in self.choices:
                choice.tools = ToolCallParser()

    def add(self, index: int, out: RequestOutput) -> None:
        choice = self.choices[index]
        if choice.first_token_at is None and out.new_token_ids:
            choice.first_token_at = time.perf_counter()
        if self.job.echo and not choice.text:  # the first output: the prompt comes first
            ids = self.job.prompts[index // self.job.per_prompt]
            choice.text.append(self.engine.tokenizer.decode(ids))
            if self.job.logprobs is not None and out.request is not None:
                req = out.request
                for token_id, actual, top in zip(ids, req.prompt_token_logprobs, [None, *req.prompt_logprobs]):
                    choice.token_logprobs.append((token_id, None if actual is None else actual[0], top))
                choice.num_echoed = len(ids)
        choice.text.append(out.new_text)
        if choice.splitter is not None or choice.tools is not None:
            reasoning, content = "", out.new_text
            if choice.splitter is not None:
                reasoning, content = choice.splitter.feed(out.new_text)
                if out.finished:
                    more = choice.splitter.finish()
                    reasoning, content = reasoning + more[0], content + more[1]
            if choice.tools is not None:
                content, choice.new_calls = choice.tools.feed(content)
                if out.finished:
                    content += choice.tools.finish()[0]
            choice.reasoning.append(reasoning)
            choice.content.append(content)
            choice.last_split = (reasoning, content)
        choice.num_tokens = out.num_output_tokens
        if out.finished:
            choice.finish_reason = out.finish_reason
            if choice.tools is not None and choice.tools.calls and out.finish_reason == "stop":
                choice.finish_reason = "tool_calls"
        if self.job.logprobs is not None or self.job.per_prompt > self.job.n:  # asked, or ranking best_of
            for token_id, (chosen, top) in zip(out.new_token_ids, out.new_logprobs):
                choice.token_logprobs.append((token_id, chosen, top))
        if out.finished and out.request is not None and out.request.beams is not None:
            choice.beams = out.request.beams

    @staticmethod
    def _message(choice: _Choice) -> AssistantMessage:
        if choice.splitter is None and choice.tools is None:
            return AssistantMessage(content="".join(choice.text))
        content: str | None = "".join(choice.content)
        calls = choice.tools.calls if choice.tools is not None else []
        if calls and not content.strip():  # type: ignore[union-attr]
            content = None  # as OpenAI: a message of calls only has no content
        opened = choice.splitter is not None and choice.splitter.opened
        return AssistantMessage(content=content, reasoning_content="".join(choice.reasoning) if opened else None,
                                tool_calls=[_tool_call(c) for c in calls] or None)

    def usage(self) -> Usage:
        prompt = sum(len(ids) for ids in self.job.prompts)
        completion = sum(c.num_tokens for c in self.choices)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def returned(self) -> list[_Choice]:
        """The response's choices: as computed; a beam search's beams; or the best n of each prompt's best_of by
        log-probability per token."""
        job = self.job
        if job.beam:
            decode = self.engine.tokenizer.decode
            out = []
            for index, c in enumerate(self.choices):
                prompt = decode(job.prompts[index // job.per_prompt]) if job.echo else ""
                for h in c.beams or []:
                    beam = _Choice(text=[prompt + decode(h.token_ids, skip_special_tokens=True)],
                                   num_tokens=len(h.token_ids), finish_reason=h.finish_reason,
                                   token_logprobs=[(t, lp, top) for t, (lp, top) in zip(h.token_ids, h.logprobs or [])])
                    if job.thinking is not None:
                        beam.splitter = ReasoningSplitter(job.thinking[index // job.per_prompt])
                        reasoning, content = beam.splitter.feed(beam.text[0])
                        more = beam.splitter.finish()
                        beam.reasoning, beam.content = [reasoning + more[0]], [content + more[1]]
                    out.append(beam)
            return out
        if job.per_prompt == job.n:
            return self.choices
        out = []
        for p in range(len(job.prompts)):
            group = self.choices[p * job.per_prompt:(p + 1) * job.per_prompt]
            mean = [_mean_logprob(c.token_logprobs[c.num_echoed:]) for c in group]  # the answers alone
            order = sorted(range(len(group)), key=lambda k: mean[k], reverse=True)[:job.n]
            out += [group[k] for k in order]
        return out

    def response(self) -> dict[str, Any]:
        job = self.job
        returned = self.returned()
        if job.kind == "chat":
            body = ChatCompletionResponse(
                id=job.response_id, created=job.created, model=job.model, usage=self.usage(),
                choices=[ChatChoice(index=i, message=self._message(c), logprobs=self._chat_logprobs(c.token_logprobs),
                                    finish_reason=c.finish_reason) for i, c in enumerate(returned)]
            ).model_dump()
            return body
        return CompletionResponse(
            id=job.response_id, created=job.created, model=job.model, usage=self.usage(),
            choices=[CompletionChoice(index=i, text="".join(c.text), finish_reason=c.finish_reason,
                                      logprobs=self._completion_logprobs(c.token_logprobs))
                     for i, c in enumerate(returned)]
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
        choice = self.choices[index]
        if self.job.echo and not choice.echoed:  # the echoed prompt rides on the first chunk
            choice.echoed = True
            num_new += len(self.job.prompts[index // self.job.per_prompt]) if self.job.logprobs is not None else 0
            out = RequestOutput(out.request_id, out.new_token_ids, choice.text[0] + out.new_text, out.finished,
                                out.finish_reason, out.num_prompt_tokens, out.num_output_tokens, out.new_logprobs,
                                out.request)
        entries = choice.token_logprobs[-num_new:] if self.job.logprobs is not None and num_new else []
        split = choice.splitter is not None or choice.tools is not None
        reasoning, content = choice.last_split if split else ("", out.new_text)
        calls = choice.new_calls
        if not reasoning and not content and not out.finished and not entries and not calls:
            return None  # text held back (a stop string, a marker or a tool call, half a character): nothing yet
        reason = choice.finish_reason if out.finished else None
        if self.job.kind == "chat":
            first = len(choice.tools.calls) - len(calls) if choice.tools is not None else 0
            delta = Delta(content=content if content or not (reasoning or calls) else None,
                          reasoning_content=reasoning or None,
                          tool_calls=[_tool_call_delta(first + k, c) for k, c in enumerate(calls)] or None)
            return self._chunk([ChatChunkChoice(index=index, delta=delta, logprobs=self._chat_logprobs(entries),
                                                finish_reason=reason)])
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

    def _chat_logprobs(self, entries: list[LogprobEntry]) -> ChatLogprobs | None:
        if self.job.logprobs is None:
            return None
        content = []
        for token_id, chosen, top in entries:
            assert chosen is not None and top is not None  # an answer's token (a chat never echoes its prompt)
            text, raw = self._piece(token_id)
            tops = [TopLogprob(token=t, logprob=lp, bytes=b) for (t, b), lp in
                    ((self._piece(i), lp) for i, lp in top)]
            content.append(TokenLogprob(token=text, logprob=chosen, bytes=raw, top_logprobs=tops))
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, entries: list[LogprobEntry]) -> CompletionLogprobs | None:
        if self.job.logprobs is None:
            return None
        tokens, offsets, offset = [], [], 0
        for token_id, _, _ in entries:
            text = self._piece(token_id)[0]
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
        return CompletionLogprobs(tokens=tokens, token_logprobs=[chosen for _, chosen, _ in entries],
                                  top_logprobs=[None if top is None else {self._piece(i)[0]: lp for i, lp in top}
                                                for _, _, top in entries],
                                  text_offset=offsets)

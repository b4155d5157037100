"""OpenAI response bodies for /v1/completions, /v1/chat/completions (and their stream chunks), /v1/models,
/tokenize, /detokenize, /health and errors: closed models, every field present in what the server sends."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Response(BaseModel):
    """Closed, and every field present in what the server sends (defaults too): the OpenAPI document says so."""

    model_config = ConfigDict(extra="forbid", json_schema_serialization_defaults_required=True)


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob]


class FunctionCallOut(_Response):
    name: str
    arguments: str  # JSON text


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    index: int  # the call's place among the message's calls


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None  # null for a message of tool calls only
    reasoning_content: str | None = None  # a reasoning model's thinking section (null for other models)
    tool_calls: list[ToolCallOut] | None = None  # the calls the model made (chat with tools), else null


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None  # each call whole, in the chunk where it completes


class ChatChunkChoice(_Response):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str


class DebugRan(_Response):
    request: str
    first: int  # the first position the step computed
    tokens: int


class DebugRunning(_Response):
    request: str
    computed: int
    tokens: int
    prompt_tokens: int
    blocks: list[int]  # the KV blocks it holds, in order


class DebugStep(_Response):
    step: int
    seconds: float
    ran: list[DebugRan]
    running: list[DebugRunning]
    waiting: list[str]
    free_blocks: int
    preemptions: int  # so far, in all


class EngineDebug(_Response):
    """/debug/engine: the engine's last steps, recorded from the first call on."""

    steps: list[DebugStep]
    num_blocks: int
    block_size: int
    num_running: int
    num_waiting: int


class HealthResponse(_Response):
    status: Literal["ok"]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Response):
    """OpenAI's error object; every non-2xx answer but a 499 (nobody is listening) carries one."""

    error: ErrorDetail

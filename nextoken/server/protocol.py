"""OpenAI request bodies for /v1/completions, /v1/chat/completions, /tokenize and /detokenize (read from the wire
by server/parsing.py; the response bodies: server/responses.py).

Request models are strict and closed: a field nextoken does not implement (suffix, audio, ...) is a 400 naming it,
never silently dropped; a value of the wrong JSON type is a 400 too (no "5" for 5). `user` is accepted: in OpenAI's
API it is metadata for abuse monitoring with no effect on generation, and nextoken neither uses nor logs it.
logit_bias maps token id strings to biases, as OpenAI's. response_format (json_object, json_schema) constrains the
output, as OpenAI's. Extensions beyond OpenAI's fields, with vLLM's names: top_k, min_p, repetition_penalty,
ignore_eos, stop_token_ids, min_tokens, bad_words (strings, each banned as tokenized with and without a leading
space), allowed_token_ids, structured_outputs (json, json_object, regex, choice, grammar); tools, tool_choice and
parallel_tool_calls as OpenAI's (engine/tools.py); and special_tokens (a text
prompt's special-token text as control tokens, off by default). Ranges are checked by SamplingParams, which names
the field.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from nextoken.engine.tools import NAME, Tool, ToolSetup
from nextoken.errors import InvalidInput, InvalidSamplingParams
from nextoken.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, StructuredOutputs
from nextoken.server.errors import ApiError

MAX_BODY_BYTES = 1 << 20  # larger bodies are refused with 413 before they are read
MAX_PROMPTS = 64  # prompts in one /v1/completions request

# Every integer a request carries is a signed 64-bit one: larger values are a 400 naming the field, never wrapped
# on their way into the kernels' int64 arrays.
Int = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]
Prompt = str | list[str] | list[Int] | list[list[Int]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Request):
    include_usage: bool | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the output always matches the schema, strict or not


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """Extension (vLLM's): exactly one of these constrains the output (sampling_params.StructuredOutputs)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(_Request):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant's message of tool calls
    name: str | None = None  # a participant's name: metadata, as `user`
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always match the parameters, strict or not, where calls are required


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class _GenerationRequest(_Request):
    """Fields shared by completions and chat completions; None means "not given" (the default applies)."""

    model: str
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    n: Int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # metadata only, see the module docstring
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[Int] | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: Int | None = None
    bad_words: list[str] | None = None  # tokenized by the server (generation.py)
    allowed_token_ids: list[Int] | None = None
    # Extensions: beam search (engine/beam.py) instead of sampling; the n best beams are the choices.
    beam_width: Int | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    # The output constrained to a JSON schema, any JSON object (response_format, OpenAI's), a regex, a list of
    # choices or a grammar (structured_outputs, vLLM's): engine/grammar.py.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return None

    def check(self) -> None:
        """Cross-field rules pydantic's types cannot say."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed together with stream=true", param="stream_options")
        if not 1 <= self.num_choices <= MAX_N:
            raise ApiError(400, f"invalid n={self.n}: must be between 1 and {MAX_N}", param="n")
        if self.beam_width is not None and self.stream:
            raise ApiError(400, "beam search gives its beams when it ends: it cannot stream", param="stream")
        # Up to 19 digits: a 64-bit id or a number SamplingParams refuses, never a huge int to parse.
        bad_key = next((k for k in self.logit_bias or () if not re.fullmatch(r"[0-9]{1,19}", k)), None)
        if bad_key is not None:
            raise ApiError(400, f"invalid logit_bias key {bad_key!r}: must be a token id (a non-negative integer "
                                "as a string)", param="logit_bias")
        self.structured()

    @property
    def structured_param(self) -> str:
        """The request field a structured-output error names."""
        if self.structured_outputs is not None:
            return "structured_outputs"
        return "response_format.json_schema.schema"

    def structured(self) -> StructuredOutputs | None:
        """response_format or structured_outputs as the engine's StructuredOutputs (None: free text)."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and so is not None:
            raise ApiError(400, "give one of response_format and structured_outputs", param="structured_outputs")
        try:
            if so is not None:
                return StructuredOutputs(json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                                         choice=None if so.choice is None else tuple(so.choice), grammar=so.grammar)
            if fmt is None or fmt.type == "text":
                if fmt is not None and fmt.json_schema is not None:
                    raise ApiError(400, "response_format.json_schema needs type json_schema",
                                   param="response_format.json_schema")
                return None
            if fmt.type == "json_object":
                return StructuredOutputs(json_object=True)
            if fmt.json_schema is None:
                raise ApiError(400, "response_format of type json_schema needs json_schema",
                               param="response_format.json_schema")
            schema = fmt.json_schema.schema_
            return StructuredOutputs(json_object=True) if schema is None else StructuredOutputs(json=schema)
        except InvalidSamplingParams as exc:
            raise ApiError(400, str(exc), param="structured_outputs" if so is not None else "response_format") \
                from None

    def sampling_params(self, max_tokens: int, seed: int | None) -> SamplingParams:
        """The params of one engine request (one choice): n is fanned out by the server, `seed` is per choice."""
        def given(value: Any, default: Any) -> Any:
            return default if value is None else value

        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens, temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0),
            top_k=given(self.top_k, 0), min_p=given(self.min_p, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0),
            presence_penalty=given(self.presence_penalty, 0.0), frequency_penalty=given(self.frequency_penalty, 0.0),
            seed=seed, stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=given(self.ignore_eos, False), logprobs=self.num_logprobs(), beam_width=self.beam_width,
            n=self.num_choices if self.beam_width is not None else 1,
            length_penalty=given(self.length_penalty, 1.0), early_stopping=given(self.early_stopping, False),
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()}, min_tokens=given(self.min_tokens, 0),
            allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            structured_outputs=self.structured())


class CompletionRequest(_GenerationRequest):
    prompt: Prompt
    logprobs: Int | None = None
    echo: bool | None = None  # the prompt before the completion, with its tokens' log-probabilities when asked
    best_of: Int | None = None  # sampled server-side; the n with the highest log-probability per token returned

    def check(self) -> None:
        super().check()
        if self.best_of is not None:
            if not self.num_choices <= self.best_of <= MAX_N:
                raise ApiError(400, f"invalid best_of={self.best_of}: must be between n={self.num_choices} and "
                                    f"{MAX_N}", param="best_of")
            if self.stream and self.best_of > self.num_choices:
                raise ApiError(400, "best_of > n cannot stream: the best are known only at the end", param="best_of")
            if self.beam_width is not None:
                raise ApiError(400, "best_of samples; beam_width searches: give one of them", param="best_of")
        if self.beam_width is not None and self.echo and self.logprobs is not None:
            raise ApiError(400, "echo with logprobs scores the prompt, which a beam search does not: give one of them",
                           param="echo")
    # Extension: whether special-token text in a text prompt ("<|im_end|>") becomes control tokens. Default false:
    # a raw prompt is text, as chat contents are; token-id prompts are taken as they are either way.
    special_tokens: bool | None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(self, max_tokens: int, seed: int | None) -> SamplingParams:
        params = super().sampling_params(max_tokens, seed)
        if self.echo and self.logprobs is not None:  # the prompt's own scores, from the same forward pass
            params = replace(params, prompt_logprobs=self.logprobs)
        return params


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    # Extension (vLLM's): more variables for the chat template, as Qwen3's {"enable_thinking": false}.
    chat_template_kwargs: dict[str, bool | int | float | str | None] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        super().check()
        for i, m in enumerate(self.messages):
            if m.content is None and not (m.role == "assistant" and m.tool_calls):
                raise ApiError(400, f"messages[{i}] has no content", param=f"messages[{i}].content")
            if m.tool_calls is not None and m.role != "assistant":
                raise ApiError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                               param=f"messages[{i}].tool_calls")
            if (m.tool_call_id is not None) != (m.role == "tool"):
                raise ApiError(400, f"messages[{i}]: a tool message, and only a tool message, carries tool_call_id",
                               param=f"messages[{i}].tool_call_id")
        for i, t in enumerate(self.tools or ()):
            if not NAME.fullmatch(t.function.name):
                raise ApiError(400, f"invalid tools[{i}].function.name {t.function.name!r}: 1 to 64 letters, digits, "
                                    "'_', '-' or '.'", param=f"tools[{i}].function.name")
        if self.tool_setup() is not None and (self.response_format is not None and self.response_format.type != "text"
                                              or self.structured_outputs is not None):
            raise ApiError(400, "tools cannot be combined with response_format or structured_outputs", param="tools")

    def tool_setup(self) -> ToolSetup | None:
        """The request's tools and tool_choice, checked (None without tools)."""
        tools = [Tool(t.function.name, t.function.description, t.function.parameters or {})
                 for t in self.tools or ()]
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        try:
            return ToolSetup.from_request(tools, choice, self.parallel_tool_calls)
        except InvalidInput as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, f"max_tokens={self.max_tokens} and max_completion_tokens="
                                f"{self.max_completion_tokens} disagree; give one of them", param="max_tokens")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"invalid top_logprobs={self.top_logprobs}: must be between 0 and {MAX_LOGPROBS}",
                           param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # prompt only; default true (the model file's BOS/EOS rules)
    add_generation_prompt: bool | None = None  # messages only; default true
    special_tokens: bool | None = None  # prompt only; default false (see CompletionRequest)
    chat_template_kwargs: dict[str, bool | int | float | str | None] | None = None  # messages only

    def check(self) -> None:
        if self.prompt is not None and self.chat_template_kwargs is not None:
            raise ApiError(400, "chat_template_kwargs applies to messages only", param="chat_template_kwargs")
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
        if self.messages is not None and self.add_special_tokens is not None:
            raise ApiError(400, "add_special_tokens applies to prompt only", param="add_special_tokens")
        if self.messages is not None and self.special_tokens is not None:
            raise ApiError(400, "special_tokens applies to prompt only", param="special_tokens")
        if self.prompt is not None and self.add_generation_prompt is not None:
            raise ApiError(400, "add_generation_prompt applies to messages only", param="add_generation_prompt")


class DetokenizeRequest(_Request):
    model: str
    tokens: list[Int]

    def check(self) -> None:
        pass

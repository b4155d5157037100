"""Request bodies to validated models: `parse_request` turns a body into one of server/protocol.py's requests, or
an ApiError (415 for a body that is not JSON, 400 for bad UTF-8, bad JSON or bad fields) whose message describes
the problem without quoting the body back and whose `param` names the field at fault.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import ValidationError

from nextoken.server.errors import ApiError
from nextoken.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                      FunctionCall, FunctionDefinition, JsonSchemaFormat, NamedFunction,
                                      NamedToolChoice, ResponseFormat, StreamOptions, StructuredOutputsField, TextPart,
                                      TokenizeRequest, ToolCallIn, ToolDefinition)

RequestT = TypeVar("RequestT", CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
_UNION_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_request(body: bytes, content_type: str | None, model: type[RequestT]) -> RequestT:
    """A request body -> a validated model, or ApiError: 415 (not JSON), 400 (bad UTF-8, bad JSON, bad fields).

    Messages about malformed bodies describe the problem without quoting the body back.
    """
    media_type = (content_type or "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, "the request body must be JSON, sent with Content-Type: application/json")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte offset {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)  # NaN and Infinity are not JSON numbers
    except (ValueError, RecursionError) as exc:
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise ApiError(400, f"the request body is not valid JSON{where}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request.check()
    return request


def _validation_error(exc: ValidationError) -> ApiError:
    error = exc.errors(include_url=False, include_input=False)[0]
    # A union's alternatives appear in `loc` as type names ("str", "list[int]"); keep field names and indices.
    loc = error["loc"]
    parts = [p for p in loc if isinstance(p, int) or p in _FIELD_NAMES]
    if error["type"] == "extra_forbidden":
        parts = [p for p in parts if p != loc[-1]] + [loc[-1]]  # the unknown field itself is no known name
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".") or None
    field = next((p for p in reversed(parts) if isinstance(p, str)), None)
    if error["type"] == "extra_forbidden":
        return ApiError(400, f"unsupported field {param!r}: nextoken does not implement it", param=param)
    if error["type"] == "missing":
        return ApiError(400, f"missing required field {param!r}", param=param)
    if field in _UNION_HINTS and error["type"] in ("string_type", "int_type", "list_type", "model_type",
                                                   "literal_error", "dict_type"):
        return ApiError(400, f"invalid {param}: must be {_UNION_HINTS[field]}", param=param)
    if error["type"] in ("less_than_equal", "greater_than_equal"):  # Int's bounds
        return ApiError(400, f"invalid {param}: must be an integer in [-2^63, 2^63)", param=param)
    return ApiError(400, f"invalid {param}: {error['msg']}", param=param)


_FIELD_NAMES = frozenset(name for m in (CompletionRequest, ChatCompletionRequest, TokenizeRequest,
                                        DetokenizeRequest, ChatMessage, TextPart, StreamOptions, ResponseFormat,
                                        JsonSchemaFormat, StructuredOutputsField, ToolCallIn, FunctionCall,
                                        ToolDefinition, FunctionDefinition, NamedToolChoice, NamedFunction)
                         for name in m.model_fields) | {"schema", "json"}

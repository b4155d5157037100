"""The server's OpenAPI document (/openapi.json), built from the protocol's pydantic models.

Routes read their own bodies (`parsing.parse_request` turns every malformed one into a 400 or 415 in OpenAI's error
shape), so FastAPI cannot infer them: `OPERATIONS` states each route's request body, its success response and every
error status it can answer. Invariant: the document is true. Its paths are the app's routes (a test holds them equal)
and schemathesis holds every response the server sends to it. Links chain /v1/models' id and /tokenize's ids into the
routes that take them, for stateful fuzzing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from nextoken.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nextoken.server.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    EngineDebug,
    ErrorResponse,
    HealthResponse,
    ModelList,
    TokenizeResponse,
)

_REF = "#/components/schemas/{model}"
# Malformed body or fields, unknown model, body too slow, too large, not JSON, queue full or draining (a full queue
# is a 503, as vLLM answers it, not a 429: nothing is rate-limited per client).
_BODY_ERRORS = (400, 404, 408, 413, 415, 503)
_DESCRIPTIONS = {
    400: "invalid request: malformed JSON or an invalid field, named in `param`",
    401: "missing or invalid API key",
    404: "the model is not the one this server serves",
    408: "the request body did not arrive within the server's request timeout (serve --request-timeout)",
    413: "the request body exceeds the size limit",
    415: "the request body is not sent as application/json",
    503: "the waiting queue is full, or the server is shutting down; retry after Retry-After seconds",
}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "required": True,
                                "schema": {"type": "string", "pattern": "^[0-9]+$"}}}


@dataclass(frozen=True)
class Operation:
    """One route: its body model (POSTs), its 200 body (a model, or a media type with a plain string schema)."""

    method: str
    path: str
    operation_id: str
    summary: str
    request: type[BaseModel] | None
    response: type[BaseModel] | str
    errors: tuple[int, ...]
    streams: bool = False  # `stream: true` answers text/event-stream
    needs_key: bool = True  # with --api-key; /health stays open for load balancers
    links: tuple[tuple[str, str, dict[str, str]], ...] = ()  # (name, target operation id, requestBody expressions)


# One event of a stream (OpenAPI 3.1 reads a text/event-stream `schema` per event, as the WHATWG parser yields
# them): its data is a JSON chunk of the route's streaming body, or "[DONE]" last.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer"}}}

_FROM_MODELS = {"model": "$response.body#/data/0/id"}
_FROM_TOKENS = "$request.body#/model"

OPERATIONS = (
    Operation("get", "/health", "health", "200 while the engine runs and admits requests", None, HealthResponse,
              (503,), needs_key=False),
    Operation("get", "/metrics", "metrics", "Prometheus metrics", None, "text/plain", ()),
    Operation("get", "/debug/engine", "debugEngine", "the engine's last steps: what each ran, the blocks each request "
              "holds", None, EngineDebug, ()),
    Operation("get", "/v1/models", "listModels", "the served model", None, ModelList, (),
              links=(("CompleteWithModel", "createCompletion", _FROM_MODELS),
                     ("ChatWithModel", "createChatCompletion", _FROM_MODELS),
                     ("TokenizeWithModel", "tokenize", _FROM_MODELS),
                     ("DetokenizeWithModel", "detokenize", _FROM_MODELS))),
    Operation("post", "/v1/completions", "createCompletion", "text completion (JSON, or SSE with stream=true)",
              CompletionRequest, CompletionResponse, _BODY_ERRORS, streams=True),
    Operation("post", "/v1/chat/completions", "createChatCompletion",
              "chat completion (JSON, or SSE with stream=true)", ChatCompletionRequest, ChatCompletionResponse,
              _BODY_ERRORS, streams=True),
    Operation("post", "/tokenize", "tokenize", "a prompt or chat messages as token ids", TokenizeRequest,
              TokenizeResponse, _BODY_ERRORS,
              links=(("DetokenizeTokens", "detokenize", {"model": _FROM_TOKENS, "tokens": "$response.body#/tokens"}),
                     ("CompleteTokens", "createCompletion",
                      {"model": _FROM_TOKENS, "prompt": "$response.body#/tokens"}))),
    Operation("post", "/detokenize", "detokenize", "token ids as text", DetokenizeRequest, DetokenizeResponse,
              _BODY_ERRORS),
)


def build_openapi(title: str, version: str, *, api_key: bool) -> dict[str, Any]:
    """The OpenAPI 3.1 document for OPERATIONS; `api_key`: the server requires a bearer token (401s, security)."""
    models = {op.request for op in OPERATIONS if op.request is not None}
    outputs = {op.response for op in OPERATIONS if not isinstance(op.response, str)} | {ErrorResponse}
    _, defs = models_json_schema([(m, "validation") for m in sorted(models, key=lambda m: m.__name__)] +
                                 [(m, "serialization") for m in sorted(outputs, key=lambda m: m.__name__)],
                                 ref_template=_REF)
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, api_key)
    document: dict[str, Any] = {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
                                "components": {"schemas": defs.get("$defs", {})}}
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def _operation(op: Operation, api_key: bool) -> dict[str, Any]:
    if isinstance(op.response, str):
        ok: dict[str, Any] = {op.response: {"schema": {"type": "string"}}}
    else:
        ok = {"application/json": {"schema": _ref(op.response)}}
    if op.streams:
        ok["text/event-stream"] = {"schema": _SSE_EVENT}
    responses: dict[str, Any] = {"200": {"description": "success", "content": ok}}
    errors = (*op.errors, 401) if api_key and op.needs_key else op.errors
    for status in sorted(errors):
        responses[str(status)] = {"description": _DESCRIPTIONS[status],
                                  "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
        if status == 503:
            responses[str(status)]["headers"] = _RETRY_AFTER
    if op.links:
        responses["200"]["links"] = {name: {"operationId": target, "requestBody": body}
                                     for name, target, body in op.links}
    operation: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary, "responses": responses}
    if op.request is not None:
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": _ref(op.request)}}}
    if api_key and op.needs_key:
        operation["security"] = [{"bearer": []}]
    return operation


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}

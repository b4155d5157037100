"""The OpenAI-compatible HTTP API on FastAPI: /v1/models, /v1/completions, /v1/chat/completions (JSON or SSE),
/tokenize, /detokenize, /health, /metrics, and /openapi.json describing them (`openapi.py`).

`create_app` loads the model and wraps its LLMEngine in an AsyncEngine whose thread runs for the app's lifespan.
Invariants: every error is an OpenAI error object with the right status and no traceback or path; a request whose
client goes away is aborted (its KV blocks are free after the next engine pass); the served model answers to its
registry name and to the id /v1/models lists, any other name is a 404; after `drain` (SIGTERM) every POST is a 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from nextoken import __version__
from nextoken.config import EngineConfig
from nextoken.engine.async_engine import AsyncEngine, RequestStream
from nextoken.engine.engine import LLMEngine
from nextoken.engine.record import make_bundle, write_bundle
from nextoken.engine.request import RequestOutput
from nextoken.errors import NextokenError
from nextoken.loader.registry import REGISTRY
from nextoken.server.choices import Choices
from nextoken.server.errors import ApiError, api_error_from, error_body, error_response
from nextoken.server.generation import Job, Kind, encode_prompt, prepare, render_messages
from nextoken.server.metrics import ServerMetrics
from nextoken.server.middleware import REQUEST_TIMEOUT_S, GuardMiddleware
from nextoken.server.openapi import build_openapi
from nextoken.server.parsing import RequestT, parse_request
from nextoken.server.protocol import (
    MAX_BODY_BYTES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from nextoken.server.streaming import SEND_TIMEOUT_S, EventStream, json_response, sse, unless_disconnected

RECORD_HEADER = "X-Nextoken-Record"  # "1" on a request: record it (--record-dir); on the answer: the record's name
REPLICA_HEADER = "X-Nextoken-Replica"  # on an answer served by a replica (serve --replicas): which one
DRAIN_TIMEOUT_S = 30.0  # how long SIGTERM lets in-flight requests run before aborting them


@dataclass
class ServerState:
    """What the routes share; `app.state.nextoken` holds it."""

    engine: LLMEngine
    async_engine: AsyncEngine
    metrics: ServerMetrics
    model_names: frozenset[str]
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False
    stream_timeout: float = SEND_TIMEOUT_S  # a stream whose client reads nothing for this long is abandoned
    record_dir: str | None = None  # where requests asking for it (X-Nextoken-Record) are recorded

    async def drain(self, timeout: float) -> None:
        """Stop admitting (POSTs get 503), let in-flight requests finish within `timeout`, abort the rest."""
        self.draining = True
        await self.async_engine.shutdown(timeout)


def create_app(engine_config: EngineConfig, api_key: str | None = None, *, engine: LLMEngine | None = None,
               async_engine: AsyncEngine | None = None, max_body_bytes: int = MAX_BODY_BYTES, stream_timeout: float = SEND_TIMEOUT_S,
               request_timeout: float = REQUEST_TIMEOUT_S, record_dir: str | None = None) -> FastAPI:
    """The app for one model. `engine`: an LLMEngine already built from `engine_config` (tests share one).
    `stream_timeout`: seconds a stream's send may stay blocked on a client that reads nothing before the stream is
    abandoned and its requests aborted; `request_timeout`: seconds a request's body may take to arrive (408);
    `record_dir`: where requests with the header `X-Nextoken-Record: 1` are written as records (engine/record.py).
    `async_engine`: what runs the requests, when not an AsyncEngine over `engine` (replicas: remote_engine.py, with a
    FrontEngine as `engine`)."""
    llm_engine = engine if engine is not None else LLMEngine(engine_config)
    names = {llm_engine.model_name}
    if engine_config.model in REGISTRY:
        names.add(engine_config.model)
    state = ServerState(llm_engine, async_engine or AsyncEngine(llm_engine), ServerMetrics(), frozenset(names),
                        stream_timeout=stream_timeout, record_dir=record_dir)
    document = build_openapi("nextoken", __version__, api_key=api_key is not None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.async_engine.start()
        yield
        await state.async_engine.shutdown(0.0)  # after a drain: already stopped; otherwise abort what is left

    app = FastAPI(title="nextoken", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.nextoken = state
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, metrics=state.metrics,
                       is_draining=lambda: state.draining, request_timeout=request_timeout)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = "no such route" if exc.status_code == 404 else str(exc.detail)
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health() -> Response:
        if state.draining or not state.async_engine.is_running:
            return ApiError(503, "draining" if state.draining else "the engine is not running").response()
        return json_response({"status": "ok"})

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return json_response(document)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(await state.async_engine.snapshot()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/engine")
    async def debug_engine() -> Response:
        """The engine's last steps (what each ran, who runs and waits, the blocks each holds), recorded from the
        first call on; behind the API key like every route but /health."""
        engine = state.async_engine
        engine.enable_debug()
        stats = await engine.snapshot()
        return json_response({"steps": list(engine.debug_steps), "num_blocks": stats.num_kv_blocks_total,
                              "block_size": llm_engine.block_manager.block_size, "num_running": stats.num_running,
                              "num_waiting": stats.num_waiting,
                              **({"replicas": engine.replicas} if hasattr(engine, "replicas") else {})})

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [{
            "id": llm_engine.model_name, "object": "model", "created": state.created, "owned_by": "nextoken",
            "max_model_len": llm_engine.max_model_len}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(state, request, await _parse(state, request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(state, request, await _parse(state, request, ChatCompletionRequest))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _parse(state, request, TokenizeRequest)
        if body.messages is not None:
            messages = body.messages
            add_prompt = body.add_generation_prompt is not False
            _, ids = await asyncio.to_thread(render_messages, llm_engine, messages, add_prompt,
                                             body.chat_template_kwargs)
        else:
            ids = await asyncio.to_thread(encode_prompt, llm_engine, body.prompt or "", body.add_special_tokens
                                          is not False, bool(body.special_tokens))
        return json_response({"tokens": ids, "count": len(ids), "max_model_len": llm_engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _parse(state, request, DetokenizeRequest)
        vocab = llm_engine.model_config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return json_response({"prompt": llm_engine.tokenizer.decode(body.tokens)})

    return app




async def _parse(state: ServerState, request: Request, model: type[RequestT]) -> RequestT:
    body = parse_request(await request.body(), request.headers.get("content-type"), model)
    if body.model not in state.model_names:
        raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                            f"{state.engine.model_name!r}", param="model", code="model_not_found")
    return body


async def _generate(state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest
                    ) -> Response:
    kind: Kind = "chat" if isinstance(body, ChatCompletionRequest) else "completion"
    record = request.headers.get(RECORD_HEADER, "").strip().lower() not in ("", "0", "false", "no")
    if record and state.record_dir is None:
        raise ApiError(400, f"this server records nothing: start it with --record-dir DIR to honour {RECORD_HEADER}")
    job = await asyncio.to_thread(prepare, state.engine, body, kind, record)  # tokenizing: off the loop
    try:
        stream = await state.async_engine.add(job.requests)
    except NextokenError as exc:
        raise api_error_from(exc) from None
    state.metrics.prompt_tokens.inc(sum(len(ids) for ids in job.prompts))
    choices = Choices(job, state.engine)
    headers = {RECORD_HEADER: f"{job.response_id}.json"} if record else {}
    replica = getattr(stream, "replica", None)
    if replica is not None:
        headers[REPLICA_HEADER] = replica
    if job.stream:
        response: Response = EventStream(_events(state, job, stream, choices), state.stream_timeout)
        response.headers.update(headers)
        return response
    try:
        finished, result = await unless_disconnected(request.receive, _collect(state, job, stream, choices))
    finally:
        stream.close()  # a no-op when all finished; otherwise (cancelled, failed) aborts what is left
    if not finished:
        return Response(status_code=499)  # nobody is listening; the counter records it as "client closed"
    response = json_response(result)
    response.headers.update(headers)
    return response


async def _write_record(state: ServerState, job: Job, out: RequestOutput) -> None:
    """A recorded job's bundle, once its request finished (hashing the model file, the first time, takes a while:
    off the loop)."""
    if job.record is None or not out.finished or out.request is None or state.record_dir is None:
        return
    path = Path(state.record_dir) / f"{job.response_id}.json"
    prompt_text = state.engine.tokenizer.decode(job.prompts[0])
    bundle = await asyncio.to_thread(make_bundle, state.engine, out.request, prompt_text,
                                     state.engine.tokenizer.decode(out.request.output_ids,
                                                                   skip_special_tokens=job.record.skip_special_tokens),
                                     job.record)
    await asyncio.to_thread(write_bundle, path, bundle)


async def _collect(state: ServerState, job: Job, stream: RequestStream, choices: Choices) -> dict[str, Any]:
    async with stream:
        try:
            async for index, out in stream:
                _record(state, job, choices, index, out)
                await _write_record(state, job, out)
        except NextokenError as exc:
            raise api_error_from(exc) from None
    return choices.response()


async def _events(state: ServerState, job: Job, stream: RequestStream, choices: Choices) -> AsyncIterator[bytes]:
    """SSE chunks: the role (chat), text deltas, finish reasons, usage when asked, then `[DONE]`."""
    async with stream:
        role = choices.role_chunk()
        if role is not None:
            yield sse(role)
        try:
            async for index, out in stream:
                _record(state, job, choices, index, out)
                chunk = choices.delta_chunk(index, out)
                if chunk is not None:
                    yield sse(chunk)
                await _write_record(state, job, out)
        except NextokenError as exc:  # the status line is sent already: report the error in the stream
            error = api_error_from(exc)
            yield b"data: " + error_body(error.status, error.message) + b"\n\n"
        else:
            if job.include_usage:
                yield sse(choices.usage_chunk())
    yield sse("[DONE]")


def _record(state: ServerState, job: Job, choices: Choices, index: int, out: RequestOutput) -> None:
    choices.add(index, out)
    metrics, choice = state.metrics, choices.choices[index]
    metrics.generation_tokens.inc(len(out.new_token_ids))
    if out.new_token_ids and choice.num_tokens == len(out.new_token_ids) and choice.first_token_at is not None:
        metrics.ttft.observe(choice.first_token_at - job.arrival)
    if out.finished and choice.num_tokens > 1 and choice.first_token_at is not None:
        metrics.tpot.observe((time.perf_counter() - choice.first_token_at) / (choice.num_tokens - 1))
    if out.finished and out.request is not None:
        t = out.request.timings
        metrics.count_speculation(t.num_spec_proposed, t.num_spec_accepted, t.num_spec_steps)

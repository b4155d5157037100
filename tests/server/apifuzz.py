"""Shared by the schemathesis test and the long campaign (benchmarks/fuzz_api.py): the server under fuzzing, the
schema loaded from its own /openapi.json, the checks every response must pass, and the state machine.

Checks, and why these: `not_a_server_error` (a 5xx is a bug), `status_code_conformance` and
`content_type_conformance` (every status and media type is declared), `response_schema_conformance` (bodies,
errors included, match the declared models), `response_headers_conformance` (503s carry Retry-After),
`negative_data_rejection` (a body that breaks the schema is refused with a 4xx) and `ignored_auth` (routes declared
as needing the key refuse requests without it). Not `positive_data_acceptance`: a body valid by the schema can still
be refused by rules JSON Schema does not state (n within 16, the served model's name, prompt length against the
context), each a declared 400 or 404.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from schemathesis.generation.modes import GenerationMode

from tests.server.conftest import API_KEY, ServerProcess
from tests.tiny import write_tiny_model

FUZZ_CONTEXT = 64  # every generation ends within 64 tokens, so any case is quick on the tiny model
REQUEST_TIMEOUT_S = 30.0  # a response slower than this is a hang, and fails the case
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ROUTES = ("GET /health", "GET /metrics", "GET /debug/engine", "GET /v1/models", "POST /v1/completions",
          "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection, ignored_auth]


def start_server(workdir: Path, log_dir: Path) -> ServerProcess:
    """A server on a tiny Llama with a 64-token context, behind the API key."""
    model = write_tiny_model(workdir / "fuzz-llama.gguf", "llama",
                             overrides={"llama.context_length": ("uint32", FUZZ_CONTEXT)})
    return ServerProcess(str(model), "--kv-cache-bytes", str(16 << 20), "--api-key", API_KEY, log_dir=log_dir)


def load_schema(server: ServerProcess) -> Any:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH, timeout=10)
    schema.config.update(base_url=server.url, headers=AUTH, request_timeout=REQUEST_TIMEOUT_S)
    return schema


def aim_at_model(case: Any, model: str) -> None:
    """Most generated bodies name the served model, so they reach generation instead of stopping at the 404; one
    in eight keeps its generated name (a stable choice by the name's hash), which keeps the 404 path fuzzed."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("model"), str) and zlib.crc32(body["model"].encode()) % 8:
        body["model"] = model


def cases(schema: Any, route: str) -> st.SearchStrategy[Any]:
    """Generated requests for one route ("POST /tokenize"): bodies valid by the document and bodies that are not."""
    method, path = route.split(" ")
    operation = schema[path][method]
    return st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))


def state_machine(schema: Any, model: str) -> Any:
    """The schema's link-driven state machine: /v1/models' id and /tokenize's ids feed the routes that take them."""
    base = schema.as_state_machine()

    class Machine(base):  # type: ignore[misc, valid-type]
        def before_call(self, case: Any) -> None:
            aim_at_model(case, model)

        def validate_response(self, response: Any, case: Any, additional_checks: Any = None, **kwargs: Any) -> None:
            case.validate_response(response, checks=CHECKS)

    return Machine

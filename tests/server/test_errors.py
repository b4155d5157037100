"""Every error status the server promises, as clients see it: OpenAI error objects with the right status, the
offending field in `param`, `Retry-After` where a retry may work, and small bodies that never echo the input or
carry a traceback or a path."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, ROOT, ServerProcess, wait_idle

MARKER = "ZQXJ-secret-marker"


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)


def _error(exc: pytest.ExceptionInfo[openai.APIStatusError]) -> dict:
    body = exc.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def _post(server: ServerProcess, path: str, content: bytes, content_type: str = "application/json",
          headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, content=content, headers={"content-type": content_type, **(headers or {})},
                      timeout=30)


def _assert_clean(response: httpx.Response) -> None:
    text = response.text
    assert len(text) < 600 and MARKER not in text and "Traceback" not in text and str(ROOT) not in text


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}, "tools[0].function.arguments"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"structured_outputs": {"regex": "(", "grammar": "x"}}, "structured_outputs"),
    ({"suffix": "x"}, "suffix"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop": "y" * 257}, "stop"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": -1}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"seed": -3}, "seed"),
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
])
def test_invalid_chat_fields_are_400_naming_the_field(server: ServerProcess, fields: dict, param: str) -> None:
    body = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_completions_only_fields_and_length_limits(client: openai.OpenAI, server: ServerProcess) -> None:
    for extra in ({"suffix": "x"},):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=server.model, prompt="hi", max_tokens=2, **extra)
        assert _error(exc)["param"] == next(iter(extra))
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=server.model, prompt=[5, 6, 7], max_tokens=1022)
    error = _error(exc)
    assert error["param"] == "max_tokens" and "3 tokens" in error["message"] and "1022" in error["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=server.model, prompt=[5] * 1024, max_tokens=1)
    assert _error(exc)["param"] == "prompt" and "1024 tokens" in _error(exc)["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=server.model, prompt="", max_tokens=1)
    assert _error(exc)["param"] == "prompt"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    error = _error(exc)
    assert error["param"] == "model" and error["code"] == "model_not_found"
    missing = httpx.post(str(client.base_url) + "chat/completions", json={"messages": []}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"


BIG = 2**64 + 5  # past int64: once wrapped to 5 on its way into the kernels


@pytest.mark.parametrize(("path", "fields", "param"), [
    ("/v1/completions", {"top_k": BIG}, "top_k"),
    ("/v1/completions", {"top_k": 2**63}, "top_k"),
    ("/v1/completions", {"max_tokens": BIG}, "max_tokens"),
    ("/v1/completions", {"seed": BIG}, "seed"),
    ("/v1/completions", {"n": BIG}, "n"),
    ("/v1/completions", {"logprobs": BIG}, "logprobs"),
    ("/v1/completions", {"stop_token_ids": [1, BIG]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, BIG]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [-BIG]]}, "prompt"),
    ("/v1/chat/completions", {"top_logprobs": BIG, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"max_completion_tokens": -BIG}, "max_completion_tokens"),
    ("/detokenize", {"tokens": [BIG]}, "tokens"),
])
def test_integers_past_64_bits_are_400_naming_the_field(server: ServerProcess, path: str, fields: dict,
                                                        param: str) -> None:
    body: dict = {"model": server.model}
    if path == "/v1/completions":
        body |= {"prompt": "the cat", "max_tokens": 2}
    elif path == "/v1/chat/completions":
        body |= {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = _post(server, path, json.dumps(body | fields).encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split("[")[0] == param, error  # with the list index where there is one
    assert "2^63" in error["message"] or param in ("n", "logprobs", "top_logprobs", "prompt"), error
    _assert_clean(response)


def test_unknown_route_is_an_error_object(server: ServerProcess) -> None:
    response = httpx.get(server.url + "/v1/nothing/here", timeout=30)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_body_over_the_limit_is_413(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=server.model, prompt="a" * (1 << 20), max_tokens=1)
    assert exc.value.status_code == 413

    assert asyncio.run(_post_chunked(server.url + "/v1/completions")) == 413  # no Content-Length


async def _post_chunked(url: str) -> int:
    """A chunked body, refused while it is read, once past the limit."""
    async def body() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b" " * (1 << 17)

    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(url, content=body(), headers={"content-type": "application/json"})
        return response.status_code


def test_wrong_content_type_is_415(server: ServerProcess) -> None:
    response = _post(server, "/v1/completions", b'{"model": "x"}', content_type="text/plain")
    assert response.status_code == 415
    assert _post(server, "/tokenize", b"prompt=x", content_type="application/x-www-form-urlencoded"
                 ).status_code == 415


@pytest.mark.parametrize("body", [
    b'{"model": "tiny-llama", "prompt": "' + MARKER.encode() + b'"',  # cut short
    b'{"model": "tiny-llama", "prompt": "\xff\xfe' + MARKER.encode() + b'"}',  # invalid UTF-8
    b'{"model": "tiny-llama", "prompt": "a", "temperature": NaN, "x": "' + MARKER.encode() + b'"}',
    b"[" * 100_000 + MARKER.encode(),  # nested far too deep
    b'["' + MARKER.encode() + b'"]',  # not an object
    b"",
])
def test_malformed_bodies_are_small_400s(server: ServerProcess, body: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        response = _post(server, path, body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
        _assert_clean(response)


def test_api_key_guards_every_route_but_health(guarded_server: ServerProcess) -> None:
    url = guarded_server.url
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/debug/engine"),
                             ("POST", "/v1/completions"),
                             ("POST", "/tokenize"), ("GET", "/nothing")):
            response = httpx.request(method, url + path, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["type"] == "authentication_error"
            assert API_KEY not in response.text
    bad = openai.OpenAI(base_url=guarded_server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=guarded_server.base_url, api_key=API_KEY, max_retries=0)
    assert good.models.list().data[0].id == guarded_server.model
    assert API_KEY not in guarded_server.log.read_text()


def test_full_queue_is_503_with_retry_after(guarded_server: ServerProcess) -> None:
    """At most one request runs and one waits (--max-num-seqs 1 --max-waiting 1): the rest are refused at once,
    and the admitted ones complete."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": guarded_server.model, "prompt": "the cat", "max_tokens": 300, "temperature": 0,
            "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=guarded_server.url, headers=headers, timeout=60) as http:
            return list(await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(6))))

    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
    for response in responses:
        if response.status_code == 503:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["type"] == "service_unavailable"
        else:
            assert response.json()["usage"]["completion_tokens"] == 300
    wait_idle(guarded_server, headers=headers)


def test_more_choices_than_the_queue_holds_is_400_naming_n(guarded_server: ServerProcess) -> None:
    """With --max-waiting 1 a request of n=2 choices (or of two prompts) could never be admitted: a 400 naming the
    parameter, not a 503 to retry forever; n=1 still runs."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    wait_idle(guarded_server, headers=headers)
    for extra, param in (({"n": 2}, "n"), ({"prompt": ["a", "b"]}, "prompt")):
        body = {"model": guarded_server.model, "prompt": "the cat", "max_tokens": 2, **extra}
        response = httpx.post(guarded_server.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param and "waiting queue" in response.json()["error"]["message"]
        assert "retry-after" not in response.headers
    chat = {"model": guarded_server.model, "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2}
    response = httpx.post(guarded_server.url + "/v1/chat/completions", json=chat, headers=headers, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"
    body = {"model": guarded_server.model, "prompt": "the cat", "max_tokens": 2, "n": 1}
    assert httpx.post(guarded_server.url + "/v1/completions", json=body, headers=headers, timeout=60).status_code == 200


def test_a_request_without_max_tokens_stops_at_the_server_default(guarded_server: ServerProcess) -> None:
    """--max-tokens-default 40: a request that gives no max_tokens (ignore_eos, so only a cap stops it) ends at 40
    tokens, not at the end of the 1024-token context; one that gives more gets what it asked for."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    wait_idle(guarded_server, headers=headers)
    body = {"model": guarded_server.model, "prompt": "the cat", "temperature": 0, "ignore_eos": True}
    for extra, count in (({}, 40), ({"max_tokens": 60}, 60)):
        response = httpx.post(guarded_server.url + "/v1/completions", json=body | extra, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == count
        assert response.json()["choices"][0]["finish_reason"] == "length"
    chat = {"model": guarded_server.model, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    response = httpx.post(guarded_server.url + "/v1/chat/completions", json=chat, headers=headers, timeout=60)
    assert response.json()["usage"]["completion_tokens"] == 40


def test_raw_prompts_keep_special_token_text_as_text_unless_asked(server: ServerProcess) -> None:
    """A text prompt's "<|im_end|>" is text (several ordinary tokens) in /tokenize and /v1/completions, unless
    the request sets special_tokens; token-id prompts are taken as they are."""
    def tokenize(**extra: object) -> list[int]:
        response = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": "a<|im_end|>b", **extra},
                              timeout=30)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    control = tokenize(special_tokens=True)
    plain = tokenize()
    end = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": "<|im_end|>",
                                                     "special_tokens": True, "add_special_tokens": False},
                     timeout=30).json()["tokens"]
    assert len(end) == 1 and end[0] in control and end[0] not in plain and len(plain) > len(control)
    assert tokenize(special_tokens=False) == plain
    for flag, expected in ((None, plain), (True, control)):
        body = {"model": server.model, "prompt": "a<|im_end|>b", "max_tokens": 1}
        if flag is not None:
            body["special_tokens"] = flag
        usage = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["usage"]
        assert usage["prompt_tokens"] == len(expected)
    messages = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "special_tokens": True}
    refused = httpx.post(server.url + "/tokenize", json=messages, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "special_tokens"
    wait_idle(server)


def test_odd_text_in_messages(server: ServerProcess) -> None:
    """NUL and bidi controls are ordinary text; a lone surrogate cannot be encoded: 400, and the server goes on."""
    def chat(content: str) -> httpx.Response:
        body = {"model": server.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
        return _post(server, "/v1/chat/completions", json.dumps(body).encode())  # \ud800 escaped: valid JSON

    assert chat("a\x00b \u202eevil\u202c <|im_start|>").status_code == 200
    surrogate = chat("half \ud800 a pair")
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "messages"
    message = surrogate.json()["error"]["message"]  # in nextoken's words, not the tokenizers library's
    assert "lone surrogate (U+D800)" in message and "utf-8" not in message.lower(), message
    _assert_clean(surrogate)
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}
    wait_idle(server)

"""Structured output and tool calls through the server on the real default model, with the official client:
response_format (json_object, json_schema), structured_outputs (regex, choice, grammar), the 400s that name what a
schema or tool request got wrong, and a two-turn tool round trip (call, result, answer), streamed and not."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import ServerProcess, wait_idle

MODEL = "smollm2-135m-instruct"
CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number"},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        "status": {"enum": ["active", "retired"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string",
                                                                                       "maxLength": 30}},
                    "required": ["city"], "additionalProperties": False},
        "nickname": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "status", "address"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 40},
                                      "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string",
                                                                                                "maxLength": 30}},
                                                        "required": ["tz"]}}}


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    spawn: Callable[..., ServerProcess] = request.getfixturevalue("spawn_server")
    yield spawn(MODEL, "--kv-cache-bytes", str(96 << 20))


@pytest.fixture(scope="module")
def spawn_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[Callable[..., ServerProcess]]:
    procs: list[ServerProcess] = []

    def spawn(model: str, *args: str) -> ServerProcess:
        proc = ServerProcess(model, *args, log_dir=tmp_path_factory.mktemp("structured-logs"))
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    wait_idle(server)  # every KV block back after each test


def ask(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def test_json_schema_samples_at_temperature_1_parse_and_validate(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "contact", "schema": CONTACT, "strict": True}}
    prompts = ["Make up a contact card for a retired sailor.", "Describe a young programmer from Japan as JSON.",
               "Give me a person.", "Invent a chef who lives in Lyon.", "A contact, please."]
    texts = []
    for prompt in prompts:
        reply = client.chat.completions.create(model=MODEL, messages=ask(prompt), temperature=1.0, n=4, seed=5,
                                               max_tokens=200, response_format=fmt)  # type: ignore[arg-type]
        for choice in reply.choices:
            assert choice.finish_reason == "stop"
            texts.append(choice.message.content or "")
    assert len(texts) == 20
    for text in texts:
        value = json.loads(text)
        jsonschema.validate(value, CONTACT)
        assert list(value) == [k for k in CONTACT["properties"] if k in value]  # type: ignore[attr-defined]
    assert len(set(texts)) > 10  # sampled, not one answer repeated


def test_json_object_and_the_extensions(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ask("Paris as JSON, with its name and country."),
                                           temperature=0, max_tokens=200, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content or ""), dict)
    for extension, check in (({"regex": r"[A-Z][a-z]+, [0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", t)),
                             ({"choice": ["Paris", "Lyon", "Nice"]}, lambda t: t in ("Paris", "Lyon", "Nice")),
                             ({"grammar": 'root ::= ("yes" | "no") "!"'}, lambda t: t in ("yes!", "no!"))):
        reply = client.chat.completions.create(model=MODEL, messages=ask("What is the capital of France?"),
                                               temperature=0.7, seed=1, max_tokens=20, n=4,
                                               extra_body={"structured_outputs": extension})
        assert all(check(c.message.content or "") and c.finish_reason == "stop" for c in reply.choices), extension
    completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10,
                                           temperature=0, extra_body={"structured_outputs": {"regex": " [A-Z][a-z]+"}})
    assert re.fullmatch(" [A-Z][a-z]+", completion.choices[0].text)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 3, "maximum": 1}}}}, "response_format.json_schema.schema", "minimum"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format.type"),
    ({"structured_outputs": {"regex": "a(", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs", "nowhere"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "one of"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "bad name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "if": {}}}}],
      "tool_choice": "required"}, "tools", '"if"'),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "tools", "cannot be combined"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "no content"),
])
def test_bad_schemas_and_tool_requests_are_a_400_naming_the_field(client: openai.OpenAI, body: dict, param: str,
                                                                  words: str) -> None:
    request = {"model": MODEL, "messages": ask("hi"), "max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/chat/completions", body=request, cast_to=dict)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("stream", [False, True])
def test_constraints_that_leave_no_token_fail_the_request_alone_naming_them(client: openai.OpenAI,
                                                                             server: ServerProcess,
                                                                             stream: bool) -> None:
    """A JSON schema, whose answer opens with '{', and allowed_token_ids that hold only a word: no token satisfies
    both. The request ends with a 400 naming structured_outputs (streamed: an error event after the status line), not
    an internal error; the next request is served as before."""
    word = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=30).json()["tokens"]
    request = {"model": MODEL, "messages": ask("hi"), "max_tokens": 8, "allowed_token_ids": word,
               "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CONTACT}}}
    message = "the structured output's grammar and the request's other token constraints"
    if not stream:
        with pytest.raises(openai.BadRequestError) as info:
            client.post("/chat/completions", body=request, cast_to=dict)
        error = info.value.body
        assert isinstance(error, dict) and error["param"] == "structured_outputs" and message in error["message"]
    else:
        with pytest.raises(openai.APIError) as info:
            extra = {"allowed_token_ids": request.pop("allowed_token_ids")}  # not the official client's own field
            for _ in client.chat.completions.create(stream=True, extra_body=extra, **request):  # type: ignore
                pass
        assert message in str(info.value.message)
    reply = client.chat.completions.create(model=MODEL, messages=ask("What is the capital of France?"),
                                           temperature=0, max_tokens=8)
    assert reply.choices[0].message.content


def run_tools(client: openai.OpenAI, messages: list, stream: bool, **options: object) -> tuple[dict, str | None]:
    """One turn: the assistant's message (content, tool_calls) and its finish reason, streamed or not."""
    request = {"model": MODEL, "messages": messages, "tools": [WEATHER, TIME], "temperature": 0, "max_tokens": 120,
               **options}
    if not stream:
        reply = client.chat.completions.create(**request)  # type: ignore[call-overload]
        message = reply.choices[0].message
        calls = [{"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                "arguments": c.function.arguments}}
                 for c in message.tool_calls or []]
        return {"role": "assistant", "content": message.content, "tool_calls": calls}, reply.choices[0].finish_reason
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **request):  # type: ignore[call-overload]
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "type": "function",
                                                      "function": {"name": "", "arguments": ""}})
                entry["function"]["name"] += call.function.name or ""
                entry["function"]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    text = "".join(content)
    return {"role": "assistant", "content": text or None, "tool_calls": [calls[k] for k in sorted(calls)]}, finish


@pytest.mark.parametrize("stream", [False, True])
def test_a_two_turn_tool_round_trip(client: openai.OpenAI, stream: bool) -> None:
    messages: list = ask("What is the weather like in Paris right now, in celsius?")
    named = {"type": "function", "function": {"name": "get_weather"}}
    message, finish = run_tools(client, messages, stream, tool_choice=named)
    assert finish == "tool_calls" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])  # type: ignore[index]
    messages += [message, {"role": "tool", "tool_call_id": call["id"],
                           "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    answer, finish = run_tools(client, messages, stream, tool_choice="none")
    assert finish in ("stop", "length") and answer["content"] and not answer["tool_calls"]
    assert "18" in answer["content"] or "sunny" in answer["content"].lower()


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_validate_against_their_functions(client: openai.OpenAI, stream: bool) -> None:
    for parallel in (False, True):
        message, finish = run_tools(client, ask("What time is it in Tokyo, and what is the weather in Oslo?"),
                                    stream, tool_choice="required", parallel_tool_calls=parallel, temperature=1.0,
                                    seed=4)
        assert message["tool_calls"]
        # One call ends the answer; parallel calls may go on (a small model repeats them) until max_tokens.
        assert finish == "tool_calls" and len(message["tool_calls"]) == 1 if not parallel else \
            finish in ("tool_calls", "length")
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}  # type: ignore[index]
        for call in message["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])


def test_auto_parses_the_calls_a_model_writes_and_leaves_other_text_as_content(client: openai.OpenAI) -> None:
    # The model writes the convention's call itself here (steered by a few-shot turn), and plain text elsewhere.
    shot = [{"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
            {"role": "assistant", "content": "It is 21 degrees in Rome."}]
    message, finish = run_tools(client, shot + ask("Weather in Madrid?"), False, tool_choice="auto")
    if message["tool_calls"]:
        assert finish == "tool_calls"
        for call in message["tool_calls"]:
            assert call["function"]["name"] in ("get_weather", "get_time")
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
    else:
        assert finish in ("stop", "length") and "<tool_call>" not in (message["content"] or "")
    plain, finish = run_tools(client, ask("Say hello."), True, tool_choice="none")
    assert plain["content"] and not plain["tool_calls"] and finish in ("stop", "length")


def test_a_request_recorded_through_the_server_replays_identically(tmp_path_factory: pytest.TempPathFactory,
                                                                   spawn_server: Callable[..., ServerProcess]) -> None:
    from nextoken.cli import main

    records = tmp_path_factory.mktemp("records")
    proc = spawn_server(MODEL, "--kv-cache-bytes", str(32 << 20), "--record-dir", str(records))
    client = openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=60)
    for stream in (False, True):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=ask("Name a colour."), temperature=0.9, seed=7, max_tokens=12, stream=stream,
            extra_headers={"X-Nextoken-Record": "1"})
        name = raw.headers["x-nextoken-record"]
        reply = raw.parse()
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)  # type: ignore[union-attr]
        else:
            text = reply.choices[0].message.content  # type: ignore[union-attr]
            assert reply.choices[0].logprobs is None  # the record's top-5 stay out of the answer  # type: ignore
        wait_idle(proc)
        data = json.loads((records / name).read_text())
        assert data["text"] == text and data["params"]["seed"] == 7 and len(data["steps"]) >= 1
        assert main(["replay", str(records / name)]) == 0
    with pytest.raises(openai.BadRequestError, match="one prompt and one choice"):
        client.chat.completions.create(model=MODEL, messages=ask("x"), n=2, max_tokens=2,
                                       extra_headers={"X-Nextoken-Record": "1"})


def test_a_server_without_a_record_dir_refuses_to_record(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="--record-dir"):
        client.chat.completions.create(model=MODEL, messages=ask("x"), max_tokens=2,
                                       extra_headers={"X-Nextoken-Record": "1"})

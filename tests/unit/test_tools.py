"""Tool calls (engine/tools.py): the parser on text cut at every position, the prompt convention and a template's
own tools, tool_choice's checks, and the grammar that makes required calls valid, on the tiny model."""

from __future__ import annotations

import json

import jsonschema
import pytest

from nextoken import LLM, SamplingParams
from nextoken.engine.tools import (
    RESULTS_NOTE,
    Tool,
    ToolCallParser,
    ToolSetup,
    prepare_messages,
    template_renders_tools,
)
from nextoken.errors import InvalidInput
from tests.tiny import write_tiny_model

WEATHER = Tool("get_weather", "The weather.", {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
    "additionalProperties": False})
CLOCK = Tool("clock", None, {})
TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
        '\n<tool_call>{"name": "clock", "arguments": "{}"}</tool_call> <tool_call>not json</tool_call> done <tool')


def parse(pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    parser = ToolCallParser()
    content, calls = [], []
    for piece in pieces:
        text, new = parser.feed(piece)
        content.append(text)
        calls += new
    content.append(parser.finish()[0])
    return "".join(content), [(c.name, c.arguments) for c in calls]


def test_the_parser_finds_calls_and_keeps_the_rest_as_content_wherever_the_text_is_cut() -> None:
    expected = ("Let me check.  <tool_call>not json</tool_call> done <tool",  # no whitespace between calls
                [("get_weather", '{"city": "Oslo", "unit": "c"}'), ("clock", "{}")])
    assert parse([TEXT]) == expected
    for cut in range(1, len(TEXT)):
        assert parse([TEXT[:cut], TEXT[cut:]]) == expected, cut
    assert parse(list(TEXT)) == expected  # a character at a time


def test_the_parser_holds_back_only_what_may_become_a_tag() -> None:
    parser = ToolCallParser()
    assert parser.feed("Hello <tool") == ("Hello ", [])
    assert parser.feed("box> and <") == ("<toolbox> and ", [])
    assert parser.feed('tool_call>{"name": "clock", "arguments": {}}</tool_call>') == ("", parser.calls)
    assert [c.name for c in parser.calls] == ["clock"] and parser.calls[0].id.startswith("call_")


def test_tool_choice_is_checked() -> None:
    assert ToolSetup.from_request([], None, None) is None
    with pytest.raises(InvalidInput, match="tool_choice needs tools"):
        ToolSetup.from_request([], "required", None)
    with pytest.raises(InvalidInput, match="'nope', which is not among tools"):
        ToolSetup.from_request([WEATHER], {"type": "function", "function": {"name": "nope"}}, None)
    with pytest.raises(InvalidInput, match="given twice"):
        ToolSetup.from_request([WEATHER, WEATHER], "auto", None)
    setup = ToolSetup.from_request([WEATHER, CLOCK], None, None)
    assert setup is not None and setup.choice == "auto" and setup.constraint() is None
    assert ToolSetup.from_request([WEATHER], "none", None).constraint() is None  # type: ignore[union-attr]


def test_the_convention_renders_tools_calls_and_results_as_turns_every_template_takes() -> None:
    setup = ToolSetup.from_request([WEATHER], "auto", None)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5 degrees"},
                {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]
    out, variables = prepare_messages(messages, setup, native=False)
    assert variables == {} and [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert '"name": "get_weather"' in out[0]["content"] and "<tools>" in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}'
                                 '\n</tool_call>')
    assert out[3]["content"] == ("<tool_response>\n5 degrees\n</tool_response>\n<tool_response>\nrain\n"
                                 f"</tool_response>\n{RESULTS_NOTE}")
    hidden, _ = prepare_messages(messages, ToolSetup.from_request([WEATHER], "none", None), native=False)
    assert [m["role"] for m in hidden] == ["user", "assistant", "user"]  # "none": the tools are not shown
    native, variables = prepare_messages(messages, setup, native=True)
    assert variables["tools"][0]["function"]["name"] == "get_weather"
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "c"}
    assert native[2]["role"] == "tool" and native[1]["content"] == ""
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    # A longer context than the other tiny models': the tools' system message is long in a byte-level vocabulary.
    path = write_tiny_model(tmp_path_factory.mktemp("tools") / "tiny-llama-2k.gguf", "llama", shape={"context": 2048})
    return LLM(str(path), weights="fp32", device="cpu", kv_cache_bytes=32 << 20)


@pytest.mark.parametrize(("choice", "parallel"), [("required", False), ("required", True),
                                                  ({"type": "function", "function": {"name": "get_weather"}}, True)])
def test_required_and_named_calls_always_parse_and_validate(llm: LLM, choice: object, parallel: bool) -> None:
    setup = ToolSetup.from_request([WEATHER, CLOCK], choice, parallel)  # type: ignore[arg-type]
    assert setup is not None
    params = SamplingParams(temperature=1.0, seed=2, n=12, max_tokens=200, structured_outputs=setup.constraint())
    for out in llm.generate("call a tool", params, use_tqdm=False)[0].outputs:
        parser = ToolCallParser()
        content, calls = parser.feed(out.text)
        if out.finish_reason == "stop":
            assert not content.strip() and not parser.finish()[0] and calls
        assert len(calls) == 1 or (parallel and choice == "required")
        for call in calls:
            assert choice == "required" or call.name == "get_weather"
            jsonschema.validate(json.loads(call.arguments), (WEATHER if call.name == "get_weather" else CLOCK).parameters)


def test_llm_chat_takes_tools_as_openai_does(llm: LLM) -> None:
    weather = WEATHER.as_openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = llm.chat([{"role": "user", "content": "weather?"}], SamplingParams(temperature=1.0, seed=1, max_tokens=200),
                   tools=[weather], tool_choice=named)[0].outputs[0]
    assert out.finish_reason == "tool_calls" and out.content is None and out.tool_calls is not None
    [call] = out.tool_calls
    jsonschema.validate(json.loads(call.arguments), WEATHER.parameters)
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answer = llm.chat(history, SamplingParams(temperature=0, max_tokens=8), tools=[weather],
                      tool_choice="none")[0].outputs[0]
    assert answer.content == answer.text and answer.tool_calls == []
    with pytest.raises(InvalidInput, match="invalid tool"):
        llm.chat([{"role": "user", "content": "x"}], tools=[{"type": "function", "function": {"name": "a b"}}])


# Qwen2.5's template, its tool parts as the model's tokenizer_config.json has them (shortened where it repeats).
QWEN_TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{%- if messages[0]['role'] == 'system' %}
{{- messages[0]['content'] }}
{%- else %}
You are a helpful assistant.
{%- endif %}
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{- "\\n" }}{{- tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


def test_a_template_that_renders_tools_gets_them_and_the_calls_as_it_expects() -> None:
    from nextoken.tokenizer.chat import ChatTemplate

    template = ChatTemplate(QWEN_TOOLS_TEMPLATE)
    assert template_renders_tools(template.source)
    setup = ToolSetup.from_request([WEATHER], "auto", None)
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5 degrees"}]
    shown, variables = prepare_messages(messages, setup, native=True)
    text = template.render(shown, **variables)
    assert '{"type": "function", "function": {"name": "get_weather", "description": "The weather."' in text
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
            in text)  # the arguments an object, as the template's tojson writes it: not a JSON string in a string
    assert "<tool_response>\n5 degrees\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    parser = ToolCallParser()  # and what such a model writes back is what the parser reads
    parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen", "unit": "c"}}\n</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Bergen",
                                                                                          "unit": "c"})]

"""Tool calls: OpenAI's `tools` and `tool_choice` for a chat, in one text format, the one Qwen's and Hermes' templates
teach their models:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that renders tools itself (it names `tools`) gets them as template variables, and the messages as it
expects them (an assistant's tool_calls with their arguments as objects, `tool` messages as they are). For any other
template, the documented convention (docs/decoding.md): the tools and the format above are described in a system
message (`TOOLS_PROMPT`), an assistant's calls become that text, and tool results become a user turn, each
wrapped in <tool_response> tags, closed by `RESULTS_NOTE` (every template renders user turns; Gemma's refuses other
roles).

`tool_choice`: "none" leaves the tools out of the prompt and the output is content; "auto" lets the model choose
and parses what it wrote; "required" and a named function constrain the output with a grammar (engine/grammar.py)
to calls: one of the named function; one or more for "required" (one, without parallel_tool_calls), each an object
whose "name" is a function's and whose "arguments" match that function's parameters schema, so the arguments always
parse and validate.
`ToolCallParser` turns generated text into content and calls as it streams, holding back only what may still become
a <tool_call> tag.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nextoken.errors import InvalidInput
from nextoken.sampling_params import StructuredOutputs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are described here, as JSON "
    "schemas, within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with a JSON "
    "object holding its name and arguments within <tool_call></tool_call> tags, one per call:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n</tool_call>")
RESULTS_NOTE = "Answer the question with these results."  # ends a turn of tool results (small models echo them else)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: Mapping[str, Any]  # a JSON schema of the arguments object

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> Tool:
        """OpenAI's {"type": "function", "function": {"name", "description", "parameters"}}, checked."""
        function = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) \
                or not NAME.fullmatch(function["name"]):
            raise InvalidInput(f"invalid tool {tool!r}: must be {{'type': 'function', 'function': {{'name': ..., "
                               "'parameters': {...}}}} with a name of 1 to 64 letters, digits, '_', '-' or '.'",
                               "tools")
        parameters = function.get("parameters") or {}
        if not isinstance(parameters, Mapping):
            raise InvalidInput(f"invalid tool {function['name']!r}: parameters must be a JSON schema", "tools")
        return cls(function["name"], function.get("description"), parameters)

    def as_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ToolSetup:
    """A chat's tools and tool_choice, checked: what the prompt shows and what the output may be."""

    tools: tuple[Tool, ...]
    choice: str  # "none", "auto", "required", or "function" (a named one)
    function: str | None = None  # the named function
    parallel: bool = True

    @classmethod
    def from_request(cls, tools: Sequence[Tool] | None, tool_choice: str | Mapping[str, Any] | None,
                     parallel_tool_calls: bool | None) -> ToolSetup | None:
        """None where the request has no tools (then tool_choice may only be "none" or absent)."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise InvalidInput("tool_choice needs tools", "tool_choice")
            return None
        names = [t.name for t in tools]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise InvalidInput(f"tools: the function name {dup!r} is given twice", "tools")
        function = None
        if isinstance(tool_choice, Mapping):
            function = tool_choice["function"]["name"]
            if function not in names:
                raise InvalidInput(f"tool_choice names the function {function!r}, which is not among tools "
                                   f"({', '.join(names)})", "tool_choice")
            choice = "function"
        else:
            choice = tool_choice or "auto"
        return cls(tuple(tools), choice, function, True if parallel_tool_calls is None else parallel_tool_calls)

    @property
    def calls_possible(self) -> bool:
        return self.choice != "none"

    def constraint(self) -> StructuredOutputs | None:
        """The grammar the output must follow: calls only, for "required" and a named function; else None."""
        if self.choice not in ("required", "function"):
            return None
        tools = [t for t in self.tools if self.function in (None, t.name)]
        options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": _arguments_schema(t)},
                    "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**schema, "x-guidance": JSON_STYLE}
        repeat = ' ("\\n" call)*' if self.parallel and self.choice == "required" else ""
        lark = f'start: call{repeat}\ncall: "{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
        return StructuredOutputs(grammar=lark)


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    schema = dict(tool.parameters) if tool.parameters else {"type": "object"}
    return schema


def template_renders_tools(template_source: str) -> bool:
    """Whether a chat template renders tools itself (it reads a `tools` variable)."""
    return re.search(r"\btools\b", template_source) is not None


def prepare_messages(messages: Sequence[Mapping[str, Any]], setup: ToolSetup | None, native: bool
                     ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """OpenAI chat messages (tool_calls, tool results) -> (messages for the template, template variables), for a
    template that renders tools itself (`native`) or through the convention of the module's docstring."""
    show = setup is not None and setup.calls_possible
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{"type": "function", "id": c.get("id"),
                                    "function": {"name": c["function"]["name"],
                                                 "arguments": _as_object(c["function"]["arguments"])}}
                                   for c in m["tool_calls"]]
            if m.get("content") is None:
                m["content"] = ""
            out.append(m)
        return out, ({"tools": [t.as_openai() for t in setup.tools]} if show and setup is not None else {})
    out = []
    for m in messages:
        role, content = m.get("role"), m.get("content")
        text = content if isinstance(content, str) else "" if content is None else \
            "".join(part["text"] for part in content)
        if role == "tool":
            reply = f"<tool_response>\n{text}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # several results answer one turn
                out[-1]["tool_results"].append(reply)
            else:
                out.append({"role": "user", "tool_results": [reply]})
            continue
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{OPEN}\n{_call_json(c)}\n{CLOSE}" for c in m["tool_calls"])
            text = f"{text}\n{calls}" if text else calls
        out.append({"role": role, "content": text})
    for m in out:
        if "tool_results" in m:
            m["content"] = "\n".join(m.pop("tool_results")) + "\n" + RESULTS_NOTE
    if show and setup is not None:
        described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t.as_openai()) for t in setup.tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, {}


def _call_json(call: Mapping[str, Any]) -> str:
    """An assistant's earlier call as the convention writes it: {"name": ..., "arguments": {...}}."""
    return json.dumps({"name": call["function"]["name"], "arguments": _as_object(call["function"]["arguments"])})


def _as_object(arguments: Any) -> Any:
    """A call's arguments as the template shows them: the object its JSON text stands for (text that is not JSON
    stays text)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


class ToolCallParser:
    """Generated text -> content and tool calls, incrementally. `feed(text)` returns the content that can be shown
    now and the calls completed by this text; `finish()` the rest. A block that does not parse as a call (no name, or
    arguments that are not an object) stays content; whitespace between calls, or after the last, is none."""

    def __init__(self) -> None:
        self._pending = ""  # text not yet shown: a possible tag's start, an open block, whitespace after a call
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                cut = len(self._pending) - _partial_suffix(self._pending, OPEN)
                if not (self.calls or calls) or self._pending[:cut].strip():
                    content.append(self._pending[:cut])
                    self._pending = self._pending[cut:]
                break
            end = self._pending.find(CLOSE, start)
            if end < 0:  # an open block: whitespace before it goes or stays with it, once it is known to be a call
                if not ((self.calls or calls) and not self._pending[:start].strip()):
                    content.append(self._pending[:start])
                    self._pending = self._pending[start:]
                break
            call = _parse_call(self._pending[start + len(OPEN):end])
            if call is None:
                content.append(self._pending[:end + len(CLOSE)])
            else:
                content.append(self._content_before(start, calls))
                calls.append(call)
            self._pending = self._pending[end + len(CLOSE):]
        self.calls += calls
        return "".join(content), calls

    def _content_before(self, start: int, calls: list[ToolCall]) -> str:
        before = self._pending[:start]
        return "" if (self.calls or calls) and not before.strip() else before

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._pending = self._pending, ""
        return ("" if self.calls and not rest.strip() else rest), []


def _parse_call(block: str) -> ToolCall | None:
    try:
        data = json.loads(block)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(data["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0

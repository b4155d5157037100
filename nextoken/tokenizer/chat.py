"""Chat templates: Hugging Face-style Jinja templates rendered as transformers' `apply_chat_template` renders them.

Invariants: templates run in jinja2's immutable sandbox and never reach Python internals; a render stops within
`timeout_s` and `max_output_bytes`; every failure (syntax, `raise_exception`, bad messages, sandbox or limit
violations, template runtime errors) is a `TemplateError` naming the template and, where known, the line.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
import time
import traceback
from datetime import datetime
from typing import Any, Callable, Generator, Iterable, Iterator, NoReturn, cast

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from nextoken.errors import TemplateError

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
MAX_RANGE = 10_000  # range() length; the sandbox's own 100_000, nested twice, is 10^10 iterations
MAX_INT_BITS = 4096  # integer `*`/`**` results; chat templates never need more, and huge powers take minutes
# Filters whose parameters set the size of what they build ('x'|center(10**10), [1]|batch(10**10, 0), indent=...).
_SIZED_FILTERS = ("center", "indent", "format", "batch", "slice")
_HUGE_WIDTH = re.compile(r"[%:.<>^=][-+ #0]*\d{7,}")  # a width/precision of 10^6+ in a %- or {}-format string
_DYNAMIC_WIDTH = re.compile(r"\*|\{[^{}]*\{")  # widths taken from the arguments: '%*s', '{:>{}}'
_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("chat_template_deadline", default=math.inf)

# Gemma 3's published template (google/gemma-3-*-it), for text content: the system prompt joins the first user turn.
_GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ (message['content'] or '') | trim }}{{ '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
# ChatML, as transformers' former `default_chat_template`.
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain `json.dumps`, no HTML escaping (jinja's own escapes `<>&'`, breaking prompts)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (marks assistant text for training): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        return nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True), lineno=lineno)


class _GuardedCodeGenerator(CodeGenerator):
    # Loops and `~` compile to plain Python, past every sandbox hook: an empty nested loop or `~` doubling a string
    # would run unchecked. Route both through the environment so they meet the deadline and the size limit.
    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        guard = nodes.EnvironmentAttribute("guard_iter")  # jinja forbids new node types; a call node does it
        node.iter = nodes.Call(guard, [node.iter], [], None, None, lineno=node.iter.lineno)
        node.iter.set_environment(self.environment)
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.guard_size(")
        super().visit_Concat(node, frame)
        self.write(")")

    # Container literals can nest one list inside another many times over (`[l, l]` in a loop): tiny in memory,
    # exponential once printed. Measure each new container as the tree it prints as.
    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self.write("environment.guard_size(")
        super().visit_List(node, frame)
        self.write(")")

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # a loop target or assignment unpacking, not a value
            super().visit_Tuple(node, frame)
            return
        self.write("environment.guard_size(")
        super().visit_Tuple(node, frame)
        self.write(")")

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self.write("environment.guard_size(")
        super().visit_Dict(node, frame)
        self.write(")")


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment plus limits on time, size, ranges and arithmetic."""

    code_generator_class = _GuardedCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})  # also stops the compiler folding them into constants

    def __init__(self, label: str, max_size: int, timeout_s: float) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do", _GenerationTag])
        self.label, self.max_size, self.timeout_s = label, max_size, timeout_s
        self.filters["tojson"] = _tojson
        for name in (*_SIZED_FILTERS, "tojson"):
            self.filters[name] = self._checked_filter(name, self.filters[name])
        self.globals.pop("lipsum", None)  # lipsum(n) loops n times inside Python, out of every hook's reach
        self.globals.update(range=self._range, raise_exception=self._raise_exception, strftime_now=_strftime_now)

    def fail(self, what: str) -> NoReturn:
        raise TemplateError(f"{self.label}: {what}")

    def _raise_exception(self, message: str) -> NoReturn:
        self.fail(str(message))

    def tick(self) -> None:
        if time.monotonic() > _DEADLINE.get():
            self.fail(f"rendering exceeded the time limit of {self.timeout_s:g} s")

    def guard_size(self, value: Any) -> Any:
        if isinstance(value, str) and len(value) > self.max_size:
            self.fail(f"a value of {len(value)} items exceeds the size limit ({self.max_size})")
        if isinstance(value, (list, tuple, dict)):
            size = _tree_size(value, {})
            if size > self.max_size:
                self.fail(f"a value of {size} nested items exceeds the size limit ({self.max_size})")
        return value

    def guard_iter(self, iterable: Iterable[Any]) -> Iterator[Any]:
        for item in iterable:
            self.tick()
            yield item

    def check_ints(self, values: Iterable[Any]) -> None:
        for value in values:
            for v in value.values() if isinstance(value, dict) else (value,):
                if isinstance(v, int) and abs(v) > self.max_size:
                    self.fail(f"argument {v} exceeds the size limit ({self.max_size})")

    def check_format(self, fmt: str, params: Iterable[Any]) -> None:
        if _HUGE_WIDTH.search(fmt):
            self.fail(f"a width or precision in format string {fmt[:60]!r} exceeds the size limit")
        if _DYNAMIC_WIDTH.search(fmt):
            self.check_ints(params)

    def _range(self, *args: int) -> range:
        rng = range(*args)
        if rng[MAX_RANGE:MAX_RANGE + 1]:  # slicing, unlike len(), works for ranges past sys.maxsize
            self.fail(f"range({', '.join(map(str, args))}) has more than {MAX_RANGE} items")
        return rng

    def _checked_filter(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)  # copies jinja's pass_context/eval_context markers, so arguments arrive unchanged
        def checked(value: Any, *args: Any, **kwargs: Any) -> Any:
            params = (*args, *kwargs.values())
            if name == "format" and isinstance(value, str):
                self.check_format(value, params)
            else:
                self.check_ints(params)
            return self.guard_size(fn(value, *args, **kwargs))
        return checked

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        # The sandbox returns an Undefined that fails only when used, and `{{ ''.__class__ }}` would render as "".
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def getattr(self, obj: Any, attribute: str) -> Any:
        self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        self.tick()
        return super().getitem(obj, argument)

    def call(self, context: jinja2.runtime.Context, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.tick()
        method = getattr(obj, "__wrapped__", obj)  # the sandbox hands out str.format wrapped
        owner = getattr(method, "__self__", None)
        if isinstance(owner, str):  # 'x'.ljust(10**10), '{:>10000000000}'.format(x)
            params = (*args, *kwargs.values())
            if getattr(method, "__name__", "") in ("format", "format_map"):
                self.check_format(owner, params)
            else:
                self.check_ints(params)
        return self.guard_size(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        self.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > self.max_size:
                    self.fail(f"repeating {len(seq)} items {n} times exceeds the size limit ({self.max_size})")
        if operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
            if operator == "*":
                bits = left.bit_length() + right.bit_length()
            else:
                bits = abs(left).bit_length() * right if abs(left) > 1 else 0
            if bits > MAX_INT_BITS:
                self.fail(f"integer {operator} result exceeds {MAX_INT_BITS} bits")
        if operator == "%" and isinstance(left, str):
            self.check_format(left, right if isinstance(right, tuple) else (right,))
        return self.guard_size(super().call_binop(context, operator, left, right))


def _tree_size(value: Any, memo: dict[int, int]) -> int:
    """Items a container holds counted as a tree (shared parts once per appearance), in time linear in the distinct
    containers: what printing it would produce."""
    if not isinstance(value, (list, tuple, dict)):
        return 1
    key = id(value)
    if key not in memo:
        memo[key] = 1  # a container reaching itself counts once rather than forever
        items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
        memo[key] = 1 + sum(_tree_size(v, memo) for v in items)
    return memo[key]


def _strftime_now(fmt: str) -> str:
    """transformers' `strftime_now`: the current local time, formatted."""
    return datetime.now().strftime(str(fmt))


def _where(exc: BaseException) -> str:
    """' (line N)' for the template line that raised: jinja rewrites tracebacks to template lines."""
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<template>"]
    return f" (line {lines[-1]})" if lines else ""


def _normalize(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of `messages`, each content a string (text parts joined by newlines, as vLLM does)."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TemplateError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise TemplateError(f"messages[{i}]['role'] must be one of {sorted(ROLES)}, got {role!r}")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise TemplateError(f"messages[{i}]['content'][{j}] must be {{'type': 'text', 'text': str}}")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            # None is allowed only beside tool_calls, as in OpenAI's API: templates handle that case themselves.
            raise TemplateError(f"messages[{i}]['content'] must be a string or a list of text parts, "
                                f"got {type(content).__name__}")
        out.append({**message, "content": content})
    return out


class ChatTemplate:
    """A compiled chat template. `render(messages)` returns the prompt text, special tokens written as text."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "chat template",
                 max_output_bytes: int = 1_000_000, timeout_s: float = 2.0) -> None:
        if not isinstance(source, str):
            raise TemplateError(f"{name}: template source must be a string, got {type(source).__name__}")
        self.source, self.name, self.is_fallback = source, name, False
        self.bos_token, self.eos_token = bos_token, eos_token
        self.max_output_bytes, self.timeout_s = max_output_bytes, timeout_s
        self._env = _Sandbox(name, max_output_bytes, timeout_s)
        try:
            self._template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"{name}: syntax error on line {exc.lineno}: {exc.message}") from exc
        except (jinja2.TemplateError, RecursionError) as exc:
            raise TemplateError(f"{name}: cannot compile: {type(exc).__name__}: {exc}") from exc

    @classmethod
    def for_model(cls, source: str | None, *, architecture: str, bos_token: str, eos_token: str) -> ChatTemplate:
        """The model file's template or, when it has none (None or ""), a fallback with `is_fallback` set.

        gemma/gemma2/gemma3 get Gemma 3's published turn format (`<start_of_turn>user ... <end_of_turn>`). Every
        other architecture gets ChatML (`<|im_start|>role ... <|im_end|>`): the most widely used instruct format
        and transformers' former default, so it is the likeliest to be right when the file is silent.
        """
        if source:
            return cls(source, bos_token=bos_token, eos_token=eos_token, name=f"{architecture} chat template")
        gemma = architecture in ("gemma", "gemma2", "gemma3")
        template = cls(_GEMMA_TEMPLATE if gemma else _CHATML_TEMPLATE, bos_token=bos_token, eos_token=eos_token,
                       name=f"{architecture} fallback chat template ({'Gemma turns' if gemma else 'ChatML'})")
        template.is_fallback = True
        return template

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt for `messages`; `extra` (tools, date_string, ...) become template variables."""
        # transformers always passes tools and documents (None when absent): templates test `tools is not none`.
        context = {"bos_token": self.bos_token, "eos_token": self.eos_token, "tools": None, "documents": None,
                   **extra, "messages": _normalize(messages), "add_generation_prompt": add_generation_prompt}
        pieces: list[str] = []
        size, token = 0, _DEADLINE.set(time.monotonic() + self.timeout_s)
        stream = cast(Generator[str, None, None], self._template.generate(context))  # generate is a generator
        try:
            for piece in stream:
                size += len(piece.encode("utf-8", "surrogatepass"))
                if size > self.max_output_bytes:
                    self._env.fail(f"rendered output exceeds {self.max_output_bytes} bytes")
                self._env.tick()
                pieces.append(piece)
        except TemplateError:
            raise  # raise_exception's message or a limit: already says what happened
        except SecurityError as exc:
            raise TemplateError(f"{self.name}: unsafe operation blocked by the sandbox{_where(exc)}: {exc}") from exc
        except RecursionError as exc:
            raise TemplateError(f"{self.name}: recursion too deep (a macro or loop calling itself?)") from exc
        except MemoryError as exc:
            raise TemplateError(f"{self.name}: ran out of memory while rendering") from exc
        except Exception as exc:
            raise TemplateError(f"{self.name}: rendering failed{_where(exc)}: {type(exc).__name__}: {exc}") from exc
        finally:
            stream.close()
            _DEADLINE.reset(token)
        return "".join(pieces)

    def render_with_spans(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                          **extra: Any) -> tuple[str, list[tuple[int, int]]]:
        """The prompt plus the character spans that hold message contents (untrusted text, in which special-token
        strings must stay plain text when encoded).

        Contents are located by rendering once more with a unique marker in each content's place, the content's
        own leading and trailing whitespace kept around it (so that a template that trims contents trims the
        whitespace in both renderings alike). The marked rendering's text between markers is the template's own:
        the prompt must be that text with each marker replaced by the content as the template left it (whole,
        stripped on either side, or both), each at the very place its marker stands, never matched elsewhere. Where
        a template changes contents past recognition, everything from that content's place to the end of the
        prompt's last template text is taken as untrusted: a user's text never becomes a control token, even if
        the template's own tokens after it then do not either.
        """
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **extra)
        normalized = _normalize(messages)
        contents = [m["content"] if isinstance(m["content"], str) else None for m in normalized]
        marked = []
        for i, m in enumerate(normalized):
            content = contents[i]
            if content is None:
                marked.append(m)
                continue
            core = content.strip()
            lead, trail = content[:len(content) - len(content.lstrip())], content[len(content.rstrip()):]
            marked.append({**m, "content": f"{lead}\ue000{i}\ue001{trail}" if core else content})
        try:
            skeleton = self.render(marked, add_generation_prompt=add_generation_prompt, **extra)
        except TemplateError:
            skeleton = ""
        pieces = _MARKER.split(skeleton) if skeleton else []
        spans = _locate(text, pieces, contents) if pieces else None
        if spans is None:  # no usable skeleton: the whole prompt is untrusted but for nothing
            return text, [(0, len(text))] if any(c for c in contents) else []
        return text, [s for s in spans if s[0] < s[1]]


def _locate(text: str, pieces: list[str], contents: list[str | None]) -> list[tuple[int, int]] | None:
    """Spans of the contents in `text`, given the marked rendering split at its markers (`pieces`: template text,
    marker, template text, ...). Each content is taken at its marker's place only: the template text before it must
    match there, then one of the content's forms, then the template text after it. Where none fits, the rest of the
    prompt (up to its final template text, when the prompt ends with that) is one untrusted span. None where even the
    first template text does not match (the template renders differently each time)."""
    if not text.startswith(pieces[0]):
        return None
    spans, pos = [], len(pieces[0])
    for k in range(1, len(pieces), 2):
        content = contents[int(pieces[k][1:-1])] or ""
        after = pieces[k + 1]
        forms = dict.fromkeys((content.strip(), content, content.lstrip(), content.rstrip()))
        found = next((f for f in forms if text.startswith(f, pos) and text.startswith(after, pos + len(f))), None)
        if found is None:
            tail = pieces[-1]
            stop = len(text) - len(tail) if tail and text.endswith(tail) and len(text) - len(tail) >= pos \
                else len(text)
            spans.append((pos, stop))
            return spans
        spans.append((pos, pos + len(found)))
        pos += len(found) + len(after)
    return spans


_MARKER = re.compile("(\ue000\\d+\ue001)")

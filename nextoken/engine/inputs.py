"""The input processor: where a prompt becomes validated token ids and a request's `n` its choices' params, for the
CLI, `LLM` and the server alike.

A prompt is a chat (`Chat`: messages through the model's template, their contents plain text, never control tokens),
text (special-token text plain unless `special_tokens`), or token ids (taken as given, checked against the
vocabulary). Choice i of n draws with seed + i (mod 2^63) where the request is seeded. `fit` is the server's
admission rule: the prompt and max_tokens against the context and the KV cache, and the default max_tokens.
Every refusal is an InvalidInput (PromptTooLong for length) naming the request field at fault (`param`); the engine's
add_request checks the same limits again for requests added directly, in its own words.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nextoken.engine.grammar import GrammarCompiler
from nextoken.engine.reasoning import thinks
from nextoken.errors import InvalidInput, PromptTooLong
from nextoken.sampling_params import SamplingParams
from nextoken.tokenizer.chat import ChatTemplate
from nextoken.tokenizer.tokenizer import Tokenizer

Prompt = str | Sequence[int]  # text, or token ids
# Template variables the input processor sets itself.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})


@dataclass(frozen=True)
class Chat:
    """Messages ({"role", "content"} dicts) to render through the model's chat template."""

    messages: Sequence[Mapping[str, Any]]
    add_generation_prompt: bool = True
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # more template variables: enable_thinking...

    @classmethod
    def turn(cls, content: str, system: str | None = None) -> Chat:
        """One user message, after a system message where one is given."""
        return cls(([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}])


@dataclass(frozen=True)
class Limits:
    """What a request must fit: the context, the whole KV cache, and the max_tokens of a request that gives none."""

    max_model_len: int
    pool_tokens: int
    max_tokens_default: int


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt ready for the engine: its text (rendered, for a chat; None for token ids), its ids, and one
    SamplingParams per choice."""

    text: str | None
    prompt_ids: list[int]
    params: list[SamplingParams] = field(default_factory=list)


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or ids) or a batch of them -> the batch."""
    if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def choices(params: SamplingParams, n: int | None = None) -> list[SamplingParams]:
    """The params of each of `n` choices (default params.n): choice i seeded with seed + i (mod 2^63), so each
    repeats on its own and none repeats another."""
    count = params.n if n is None else n
    if params.beam_width is not None:  # one search returns the n best beams
        return [params]
    if params.seed is None:
        return [params] * count
    return [params if i == 0 else replace(params, seed=(params.seed + i) % 2**63) for i in range(count)]


class InputProcessor:
    """Prompts -> token ids for one model: its tokenizer, chat template and vocabulary size (the embedding's rows,
    which may exceed the tokenizer's), the limits `fit` checks (None: a text-side-only processor), and the ids that
    end a generation (the end a grammar allows once complete)."""

    def __init__(self, tokenizer: Tokenizer, chat_template: ChatTemplate, vocab_size: int,
                 limits: Limits | None = None, end_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.vocab_size = vocab_size
        self.limits = limits
        self.grammars = GrammarCompiler(tokenizer, vocab_size, end_ids)  # structured output's (engine/grammar.py)

    @property
    def thinks(self) -> bool:
        """Whether the model's answers may hold a thinking section (engine/reasoning.py)."""
        return thinks(self.chat_template.source)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[int]]:
        """Messages -> (prompt text, token ids), special tokens parsed only where the template wrote them;
        `template_kwargs` become template variables (Qwen3's enable_thinking), never overriding the messages."""
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & RESERVED_TEMPLATE_VARIABLES)
        if reserved:
            raise InvalidInput(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
        text, spans = self.chat_template.render_with_spans([dict(m) for m in messages],
                                                           add_generation_prompt=add_generation_prompt, **extra)
        return text, self.tokenizer.encode(text, add_special_tokens=False, plain_spans=spans)

    def encode(self, text: str, *, special_tokens: bool = False, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's ids: its special-token text plain text unless `special_tokens` (the server's request field;
        LLM and the CLI's raw prompts, the caller's own text, set it); `add_special_tokens`: the file's BOS/EOS."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens,
                                     plain_spans=() if special_tokens else [(0, len(text))])

    def check_ids(self, ids: Sequence[int], param: str = "prompt") -> list[int]:
        """Token ids, each an integer within the vocabulary; InvalidInput naming the first that is not."""
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInput(f"prompt token id {bad!r} is outside the vocabulary (0..{vocab - 1})", param)
        return list(ids)

    def check_stop_token_ids(self, ids: Sequence[int]) -> None:
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidInput(f"stop_token_ids: {bad} is outside the vocabulary (0..{vocab - 1})", "stop_token_ids")

    def bad_words_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """bad_words given as text -> token-id sequences, as vLLM: each word encoded as plain text without special
        tokens, as it stands and after one leading space (a word's ids often differ mid-sentence), both kept."""
        ids: list[tuple[int, ...]] = []
        for word in words:
            if not isinstance(word, str) or not word.strip():
                raise InvalidInput(f"bad_words: {word!r} is not a word", "bad_words")
            for text in (word, " " + word.lstrip()):
                encoded = tuple(self.encode(text, add_special_tokens=False))
                if encoded and encoded not in ids:
                    ids.append(encoded)
        return tuple(ids)

    def check_processor_ids(self, params: SamplingParams, structured_param: str = "structured_outputs") -> None:
        """The token ids of params' logits processors, each within the vocabulary, and its structured output a grammar
        this model can follow (compiled now, kept for the request); InvalidInput naming the field
        (`structured_param`: the request field the structured output came from)."""
        vocab = self.vocab_size
        for param, ids in params.processor_ids.items():
            bad = next((t for t in ids if not t < vocab), None)
            if bad is not None:
                raise InvalidInput(f"{param}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs, structured_param)

    def prompt_ids(self, prompt: Prompt | Chat, *, special_tokens: bool = False, add_special_tokens: bool = True
                   ) -> tuple[str | None, list[int]]:
        """(text, ids) of a chat (rendered), a text prompt or token ids (checked against the vocabulary)."""
        if isinstance(prompt, Chat):
            return self.render_chat(prompt.messages, prompt.add_generation_prompt, prompt.template_kwargs)
        if isinstance(prompt, str):
            return prompt, self.encode(prompt, special_tokens=special_tokens, add_special_tokens=add_special_tokens)
        return None, self.check_ids(prompt)

    def process(self, prompt: Prompt | Chat, params: SamplingParams, n: int | None = None, *,
                special_tokens: bool = False) -> PreparedPrompt:
        """A prompt and its params -> its ids, not empty, and the params of each of its `n` choices."""
        text, ids = self.prompt_ids(prompt, special_tokens=special_tokens)
        if not ids:
            raise InvalidInput("the prompt is empty", "messages" if isinstance(prompt, Chat) else "prompt")
        return PreparedPrompt(text, ids, choices(params, n))

    def fit(self, prompt_ids: Sequence[int], max_tokens: int | None, param: str = "prompt") -> int:
        """The max_tokens a request of these prompt ids runs with: the one asked for if the context and the whole KV
        cache hold it beside the prompt, else PromptTooLong naming `max_tokens`; none asked: the default, capped by
        the room left. A prompt with no room for one token is refused naming `param`."""
        assert self.limits is not None, "fit needs the engine's limits"
        max_len, num_prompt = self.limits.max_model_len, len(prompt_ids)
        if not num_prompt:
            raise InvalidInput("the prompt is empty", param)
        if num_prompt >= max_len:
            raise PromptTooLong(f"the prompt has {num_prompt} tokens but the context holds {max_len} (the prompt "
                                "must leave room for at least one generated token)", param)
        limit = min(max_len, self.limits.pool_tokens)
        where = "the context" if limit == max_len else "the whole KV cache"
        room = limit - num_prompt
        if room < 1:
            raise PromptTooLong(f"the prompt has {num_prompt} tokens but {where} holds {limit}", param)
        if max_tokens is not None and max_tokens > room:
            raise PromptTooLong(f"the prompt has {num_prompt} tokens and max_tokens is {max_tokens}: together "
                                f"{num_prompt + max_tokens} tokens, more than the {limit} that {where} holds",
                                "max_tokens")
        return max_tokens if max_tokens is not None else min(room, self.limits.max_tokens_default)

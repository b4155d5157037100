"""Combinations of the generation options, drawn by hypothesis, through the official client: every one is answered
200, or 400 naming the parameter where the API documents it refused (best_of > n with stream; beam search with
stream, best_of, stop strings, echo with logprobs or n above beam_width; top_logprobs without logprobs), and the
answer is whole: one choice per prompt and n (indices in order), each with a finish reason and no more tokens than
max_tokens, log-probabilities exactly where asked (an echoed prompt's first token without one), usage that adds up,
and a stream that ends every choice, then its usage chunk when asked. Options that each work alone can fail
together (best_of over an echoed prompt with logprobs once summed the prompt's missing first log-probability: a
500); schemathesis draws from the whole schema, these from the options that interact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import ServerProcess, wait_idle

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
PROMPTS = ["Hello there, how", [5, 9, 17, 33], ["One two", "three four five"], [[7, 8, 9], [10, 11]]]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def num_prompts(prompt: Any) -> int:
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


@st.composite
def completion_options(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 3))
    stream = draw(st.booleans())
    options: dict[str, Any] = {
        "prompt": draw(st.sampled_from(PROMPTS)), "n": n, "stream": stream,
        "best_of": draw(st.sampled_from([None, n, n + 1])), "echo": draw(st.booleans()),
        "logprobs": draw(st.sampled_from([None, 0, 2])), "max_tokens": draw(st.sampled_from([1, 4])),
        "temperature": draw(st.sampled_from([0.0, 1.0])), "seed": draw(st.sampled_from([None, 3])),
        "stop": draw(st.sampled_from([None, ["e"], "the"]))}
    beam_width = draw(st.sampled_from([None, None, 2, 3]))
    if beam_width is not None:  # an extension: the client sends it in the body
        options["extra_body"] = {"beam_width": beam_width}
    if stream and draw(st.booleans()):
        options["stream_options"] = {"include_usage": True}
    return options


@st.composite
def chat_options(draw: st.DrawFn) -> dict[str, Any]:
    stream = draw(st.booleans())
    options: dict[str, Any] = {
        "messages": [{"role": "user", "content": draw(st.sampled_from(["Hi!", "Name three colours."]))}],
        "n": draw(st.integers(1, 3)), "stream": stream, "logprobs": draw(st.sampled_from([None, False, True])),
        "top_logprobs": draw(st.sampled_from([None, 0, 3])), "max_completion_tokens": draw(st.sampled_from([1, 5])),
        "temperature": draw(st.sampled_from([0.0, 1.0])), "seed": draw(st.sampled_from([None, 3])),
        "stop": draw(st.sampled_from([None, ["e"]]))}
    if stream and draw(st.booleans()):
        options["stream_options"] = {"include_usage": True}
    return options


def gather(chunks: Any, text_of: Callable[[Any], str], scores_of: Callable[[Any], list[Any]]
           ) -> tuple[dict[int, str], dict[int, str | None], dict[int, list[Any]]]:
    """A stream's choices gathered by index: (texts, finish reasons, log-probability entries)."""
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    scores: dict[int, list[Any]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + text_of(c)
            finish[c.index] = c.finish_reason or finish.get(c.index)
            if c.logprobs is not None:
                scores.setdefault(c.index, []).extend(scores_of(c.logprobs))
    return texts, finish, scores


def assert_stream_is_whole(whole: Any, stream: Any, text_of: Callable[[Any], str],
                           scores_of: Callable[[Any], list[Any]], scored: bool,
                           whole_text: Callable[[Any], str] = lambda c: c.text) -> None:
    """A stream gathered by choice against the whole answer to the same request: per choice the same text and finish
    reason, and where log-probabilities were asked, the same entries (scores_of reads a whole choice's as a chunk's)."""
    texts, finish, scores = gather(stream, text_of, scores_of)
    assert [texts.get(c.index) for c in whole.choices] == [whole_text(c) for c in whole.choices]
    assert [finish.get(c.index) for c in whole.choices] == [c.finish_reason for c in whole.choices]
    if scored:
        assert [scores.get(c.index, []) for c in whole.choices] == [scores_of(c.logprobs) for c in whole.choices]


def check_usage(usage: Any) -> None:
    assert usage.prompt_tokens > 0 and usage.completion_tokens >= 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_option_combinations(client: openai.OpenAI, server: ServerProcess) -> None:
    @given(options=completion_options())
    @SETTINGS
    def check(options: dict[str, Any]) -> None:
        call = dict(options, model=server.model)
        beam = options.get("extra_body", {}).get("beam_width")
        refused_by = ("stream" if beam is not None and options["stream"]
                      else "best_of" if options["stream"] and options["best_of"] is not None
                      and options["best_of"] > options["n"]
                      else "best_of" if beam is not None and options["best_of"] is not None
                      else "echo" if beam is not None and options["echo"] and options["logprobs"] is not None
                      else "n" if beam is not None and options["n"] > beam
                      else "stop" if beam is not None and options["stop"] is not None else None)
        if refused_by is not None:
            with pytest.raises(openai.BadRequestError) as refused:
                list(client.completions.create(**call)) if options["stream"] else client.completions.create(**call)
            assert refused.value.body["param"] == refused_by  # type: ignore[index]
            return
        expected = num_prompts(options["prompt"]) * options["n"]
        if options["stream"]:
            finished: dict[int, str] = {}
            usage = None
            for chunk in client.completions.create(**call):
                if chunk.usage is not None:
                    assert not chunk.choices and usage is None
                    usage = chunk.usage
                    continue
                assert usage is None, "a chunk after the usage chunk"
                for c in chunk.choices:
                    assert c.index not in finished, f"choice {c.index} went on after its finish"
                    if c.finish_reason is not None:
                        finished[c.index] = c.finish_reason
            assert sorted(finished) == list(range(expected))
            assert set(finished.values()) <= {"stop", "length"}
            assert (usage is not None) == ("stream_options" in options)
            if usage is not None:
                check_usage(usage)
            return
        r = client.completions.create(**call)
        assert [c.index for c in r.choices] == list(range(expected))
        check_usage(r.usage)
        for c in r.choices:
            assert c.finish_reason in ("stop", "length")
            if options["logprobs"] is None:
                assert c.logprobs is None
                continue
            lp = c.logprobs
            assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
            assert lp.text_offset == sorted(lp.text_offset)
            if options["echo"]:
                assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
                if options["stop"] is None and c.finish_reason == "length":  # no stop text or end token left out
                    assert "".join(lp.tokens) == c.text  # the prompt's tokens, then the answer's
            answer = [x for x in lp.token_logprobs if x is not None]
            assert all(x <= 1e-6 for x in answer)
            assert len(answer) <= options["max_tokens"] + (len(lp.tokens) - 1 if options["echo"] else 0)
            assert all(top is None or len(top) <= max(options["logprobs"], 1) for top in lp.top_logprobs)

    check()
    wait_idle(server)


def test_chat_option_combinations(client: openai.OpenAI, server: ServerProcess) -> None:
    @given(options=chat_options())
    @SETTINGS
    def check(options: dict[str, Any]) -> None:
        call = dict(options, model=server.model)
        if options["top_logprobs"] is not None and not options["logprobs"]:
            with pytest.raises(openai.BadRequestError) as refused:
                list(client.chat.completions.create(**call)) if options["stream"] else \
                    client.chat.completions.create(**call)
            assert refused.value.body["param"] == "top_logprobs"  # type: ignore[index]
            return
        if options["stream"]:
            finished: dict[int, str] = {}
            tokens: dict[int, int] = {}
            usage = None
            for chunk in client.chat.completions.create(**call):
                if chunk.usage is not None:
                    assert not chunk.choices and usage is None
                    usage = chunk.usage
                    continue
                for c in chunk.choices:
                    assert c.index not in finished, f"choice {c.index} went on after its finish"
                    if c.logprobs is not None and c.logprobs.content:
                        tokens[c.index] = tokens.get(c.index, 0) + len(c.logprobs.content)
                    if c.finish_reason is not None:
                        finished[c.index] = c.finish_reason
            assert sorted(finished) == list(range(options["n"]))
            assert all(count <= options["max_completion_tokens"] for count in tokens.values())
            assert (usage is not None) == ("stream_options" in options)
            if usage is not None:
                check_usage(usage)
            return
        r = client.chat.completions.create(**call)
        assert [c.index for c in r.choices] == list(range(options["n"]))
        check_usage(r.usage)
        for c in r.choices:
            assert c.finish_reason in ("stop", "length") and c.message.role == "assistant"
            if not options["logprobs"]:
                assert c.logprobs is None
                continue
            content = c.logprobs.content
            assert content is not None and len(content) <= options["max_completion_tokens"]
            assert all(len(t.top_logprobs) == (options["top_logprobs"] or 0) for t in content)

    check()
    wait_idle(server)


@st.composite
def deterministic_options(draw: st.DrawFn) -> dict[str, Any]:
    """Options whose answers are fixed (greedy, or seeded), with the processors and filters that shape a row."""
    options: dict[str, Any] = {
        "prompt": draw(st.sampled_from(PROMPTS)), "n": draw(st.integers(1, 3)), "echo": draw(st.booleans()),
        "logprobs": draw(st.sampled_from([None, 0, 2])), "max_tokens": draw(st.sampled_from([1, 3, 8])),
        "temperature": draw(st.sampled_from([0.0, 0.7, 1.0])), "seed": draw(st.sampled_from([3, 11])),
        "stop": draw(st.sampled_from([None, ["e"], ["o", "th"]])),
        "presence_penalty": draw(st.sampled_from([None, 0.5])), "frequency_penalty": draw(st.sampled_from([None, 1.0])),
        "top_p": draw(st.sampled_from([None, 0.9]))}
    extra: dict[str, Any] = {}
    for name, values in (("top_k", [5]), ("min_p", [0.05]), ("repetition_penalty", [1.3]), ("ignore_eos", [True]),
                         ("min_tokens", [2]), ("logit_bias", [{"7": 5.0}]), ("stop_token_ids", [[9]])):
        if draw(st.booleans()):
            extra[name] = draw(st.sampled_from(values))
    if "min_tokens" in extra:  # at most max_tokens (a larger one is refused by name)
        extra["min_tokens"] = min(extra["min_tokens"], options["max_tokens"])
    if extra:
        options["extra_body"] = extra
    return options


def test_streams_give_the_whole_answers(client: openai.OpenAI, server: ServerProcess) -> None:
    """A deterministic request streamed: per choice, the same text, finish reason and log-probabilities as whole."""
    @given(options=deterministic_options())
    @settings(SETTINGS, max_examples=120)
    def check(options: dict[str, Any]) -> None:
        call = dict(options, model=server.model)
        whole = client.completions.create(**call)
        assert_stream_is_whole(whole, client.completions.create(**call, stream=True), lambda c: c.text,
                               lambda lp: lp.token_logprobs, options["logprobs"] is not None)
        extra = options.get("extra_body", {})
        for c in whole.choices:
            if extra.get("ignore_eos") and options["stop"] is None and "stop_token_ids" not in extra:
                assert c.finish_reason == "length"

    check()
    wait_idle(server)


@st.composite
def deterministic_chat_options(draw: st.DrawFn) -> dict[str, Any]:
    logprobs = draw(st.booleans())
    options: dict[str, Any] = {
        "messages": [{"role": "user", "content": draw(st.sampled_from(["Hi!", "Name three colours."]))}],
        "n": draw(st.integers(1, 3)), "logprobs": logprobs,
        "max_completion_tokens": draw(st.sampled_from([1, 4, 8])),
        "temperature": draw(st.sampled_from([0.0, 1.0])), "seed": draw(st.sampled_from([3, 11])),
        "stop": draw(st.sampled_from([None, ["e"]])), "frequency_penalty": draw(st.sampled_from([None, 1.0]))}
    if logprobs:
        options["top_logprobs"] = draw(st.sampled_from([0, 2]))
    return options


def test_chat_streams_give_the_whole_answers(client: openai.OpenAI, server: ServerProcess) -> None:
    @given(options=deterministic_chat_options())
    @settings(SETTINGS, max_examples=80)
    def check(options: dict[str, Any]) -> None:
        call = dict(options, model=server.model)
        whole = client.chat.completions.create(**call)
        assert_stream_is_whole(whole, client.chat.completions.create(**call, stream=True),
                               lambda c: c.delta.content or "",
                               lambda lp: [(t.token, t.logprob, len(t.top_logprobs)) for t in lp.content or []],
                               options["logprobs"], whole_text=lambda c: c.message.content)

    check()
    wait_idle(server)

"""The thinking section apart from the content: whole answers, the same answers in every split into deltas (markers
cut anywhere), answers the prompt opened, and answers with no section."""

from __future__ import annotations

import itertools

import pytest

from nextoken.engine.reasoning import ReasoningSplitter, opened_by_prompt, split, thinks

CASES = [
    # (answer, opened by the prompt, reasoning, content)
    ("<think>\nLet me add.\n2+2=4\n</think>\n\nIt is 4.", False, "Let me add.\n2+2=4", "It is 4."),
    ("<think></think>Hi", False, "", "Hi"),
    ("  <think>a</think>b", False, "a", "b"),
    ("It is 4.", False, None, "It is 4."),
    ("No <think> here", False, None, "No <think> here"),
    ("<thin", False, None, "<thin"),
    ("<think>still thinking", False, "still thinking", ""),
    ("Let me add.\n</think>\n\nIt is 4.", True, "Let me add.", "It is 4."),
    ("x < y </think>z", True, "x < y ", "z"),  # only newlines around a marker are layout
    ("a</think>b</think>c", True, "a", "b</think>c"),  # only the first end closes the section
]


@pytest.mark.parametrize(("answer", "opened", "reasoning", "content"), CASES)
def test_whole_answers(answer: str, opened: bool, reasoning: str | None, content: str) -> None:
    assert split(answer, opened) == (reasoning, content)


@pytest.mark.parametrize(("answer", "opened", "reasoning", "content"), CASES)
def test_every_split_into_three_deltas_gives_the_same(answer: str, opened: bool, reasoning: str | None,
                                                      content: str) -> None:
    for i, j in itertools.combinations_with_replacement(range(len(answer) + 1), 2):
        splitter = ReasoningSplitter(opened)
        parts = [splitter.feed(piece) for piece in (answer[:i], answer[i:j], answer[j:])] + [splitter.finish()]
        assert "".join(r for r, _ in parts) == (reasoning or ""), (i, j)
        assert "".join(c for _, c in parts) == content, (i, j)
        assert splitter.opened == (reasoning is not None)


def test_streamed_reasoning_is_not_held_back_longer_than_a_marker() -> None:
    splitter = ReasoningSplitter()
    assert splitter.feed("<think>") == ("", "")
    assert splitter.feed("abc") == ("abc", "")
    assert splitter.feed("de</th") == ("de", "")
    assert splitter.feed("ink>f") == ("", "f")


def test_templates_and_prompts() -> None:
    assert thinks("{{ '<think>' }}...{{ '</think>' }}") and not thinks("{{ messages }}") and not thinks(None)
    assert opened_by_prompt("<|im_start|>assistant\n<think>\n")
    assert not opened_by_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opened_by_prompt(None)


def test_llm_chat_gives_reasoning_and_content(tmp_path) -> None:  # noqa: ANN001
    from nextoken import LLM, SamplingParams
    from tests.thinker import write_thinker

    llm = LLM(str(write_thinker(tmp_path / "thinker.gguf")), weights="fp32", kv_cache_bytes=4 << 20)
    params = SamplingParams(temperature=0, max_tokens=20)
    out = llm.chat([{"role": "user", "content": "hi"}], params)[0]
    assert (out.outputs[0].reasoning, out.outputs[0].content, out.text) == ("ab", "cd", "<think>ab</think>cd")
    off = llm.chat([{"role": "user", "content": "hi"}], params, chat_template_kwargs={"enable_thinking": False})[0]
    assert off.prompt.endswith("<think>\n\n</think>\n\n")

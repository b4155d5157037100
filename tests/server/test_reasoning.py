"""A reasoning model's thinking section through the API, as the official `openai` client reads it: apart from the
content as `reasoning_content` in the message, and as deltas of its own when streamed; the template's
`enable_thinking` switch through `chat_template_kwargs`. The model (tests/thinker.py) always answers
`<think>ab</think>cd`, so each field's value is known."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess
from tests.thinker import write_thinker

MESSAGES = [{"role": "user", "content": "what is 2+2?"}]


@pytest.fixture
def thinker(tmp_path: Path, spawn_server) -> ServerProcess:  # noqa: ANN001
    return spawn_server(str(write_thinker(tmp_path / "thinker.gguf")))


def test_the_thinking_section_is_apart_from_the_content(thinker: ServerProcess) -> None:
    client = openai.OpenAI(base_url=thinker.base_url, api_key="unused", max_retries=0, timeout=30)
    reply = client.chat.completions.create(model=thinker.model, messages=MESSAGES, temperature=0)
    message = reply.choices[0].message.model_dump()
    assert (message["reasoning_content"], message["content"]) == ("ab", "cd")
    assert reply.choices[0].finish_reason == "stop"

    reasoning, content = [], []
    for chunk in client.chat.completions.create(model=thinker.model, messages=MESSAGES, temperature=0, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert not (delta.get("reasoning_content") and delta.get("content"))  # each delta is one or the other
            reasoning.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
    assert ("".join(reasoning), "".join(content)) == ("ab", "cd")


def test_enable_thinking_reaches_the_template(thinker: ServerProcess) -> None:
    def tokens(kwargs: dict | None) -> int:
        body = {"model": thinker.model, "messages": MESSAGES}
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        r = httpx.post(f"{thinker.url}/tokenize", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["count"]

    # The switch off writes an empty section into the prompt: <think>, two newlines, </think>, two newlines.
    assert tokens({"enable_thinking": False}) == tokens(None) + 6 == tokens({"enable_thinking": True}) + 6
    client = openai.OpenAI(base_url=thinker.base_url, api_key="unused", max_retries=0, timeout=30)
    reply = client.chat.completions.create(model=thinker.model, messages=MESSAGES, temperature=0, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.usage.prompt_tokens == tokens({"enable_thinking": False})
    r = httpx.post(f"{thinker.base_url}/chat/completions", timeout=30,
                   json={"model": thinker.model, "messages": MESSAGES, "chat_template_kwargs": {"messages": 1}})
    assert r.status_code == 400 and "chat_template_kwargs" in r.text


def test_other_models_reasoning_is_null(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=30,
                   json={"model": server.model, "messages": MESSAGES, "max_tokens": 3},
                   headers={"Authorization": "Bearer unused"})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and isinstance(message["content"], str)  # as the schema says

"""The server on the real default model: a greedy chat answer through the official client."""

from __future__ import annotations

from collections.abc import Callable

import openai

from tests.server.conftest import ServerProcess


def test_smollm2_knows_the_capital_of_france(spawn_server: Callable[..., ServerProcess]) -> None:
    proc = spawn_server("smollm2-135m-instruct", "--kv-cache-bytes", str(64 << 20))
    client = openai.OpenAI(base_url=proc.base_url, api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"] == [proc.model]
    reply = client.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason in ("stop", "length")

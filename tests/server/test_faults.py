"""Faults injected into one request of a batch, through the whole server in-process (the app over httpx's ASGI
transport, its AsyncEngine thread running): an exception in that request's sampling, its detokenization or its stop
matching. The request fails alone: a stream ends with an error event (then [DONE]), a whole answer is a 500 error
object without traceback or path. The other requests of the batch, a seeded sampled one among them, answer exactly
what they answer alone; the engine goes on, every KV block comes back, and a greedy canary answers as before.

The faults are real exceptions raised inside the engine's own code paths (the sampler's draw, the incremental
detokenizer, the stop-string search), patched for requests whose prompt is POISON only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nextoken.config import EngineConfig
from nextoken.engine import engine as engine_module
from nextoken.engine import output as output_module
from nextoken.engine.engine import LLMEngine
from nextoken.engine.output import TextStream
from nextoken.server.app import create_app
from nextoken.tokenizer.detokenize import IncrementalDetokenizer

POISON = [7, 11, 13, 17, 19, 23]  # the prompt (token ids) of the requests that fail
MODEL = "tiny"
GOOD = [
    {"prompt": "the cat sat", "max_tokens": 20, "temperature": 0, "ignore_eos": True},
    {"prompt": "hello", "max_tokens": 20, "temperature": 0.8, "seed": 5, "ignore_eos": True},
    {"prompt": "seven seas", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 3, "stop": ["qz"]},
    {"prompt": "a", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True},
]
CANARY = {"prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
# Sampled (the sampler runs for the batch), with a stop string (the stop search runs for every token).
BAD = {"prompt": POISON, "max_tokens": 20, "temperature": 0.8, "seed": 9, "ignore_eos": True, "stop": ["qz"]}


class App:
    """The app with its engine thread started; `post` returns the JSON body, or the events of a stream."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.app = create_app(EngineConfig(model=str(engine.model_path)), engine=engine)
        self.state = self.app.state.nextoken

    async def post(self, http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, Any]:
        response = await http.post("/v1/completions", json={"model": self.engine.model_name, **body})
        if body.get("stream"):
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            return response.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]
        return response.status_code, response.json()

    def run(self, *bodies: dict[str, Any]) -> list[tuple[int, Any]]:
        """All bodies sent at once; the engine idle afterwards."""
        async def main() -> list[tuple[int, Any]]:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
                results = await asyncio.gather(*(self.post(http, b) for b in bodies))
            for _ in range(500):
                stats = self.state.async_engine.stats
                if stats.num_unfinished == 0 and stats.num_kv_blocks_used == 0:
                    return list(results)
                await asyncio.sleep(0.01)
            raise AssertionError(f"not idle: {self.state.async_engine.stats}")

        return asyncio.run(main())


@pytest.fixture
def app(tiny_llama: Path) -> Iterator[App]:
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), dtype="float32", device="cpu", kv_cache_bytes=4 << 20,
                                    threads=1))
    served = App(engine)
    served.state.async_engine.start()
    try:
        yield served
    finally:
        asyncio.run(served.state.async_engine.shutdown(0))
    assert served.state.async_engine.is_running is False


def _text(status_and_body: tuple[int, Any]) -> Any:
    """What a good request answered: its choices' texts and token log-probabilities, or a stream's text."""
    status, body = status_and_body
    assert status == 200, body
    if isinstance(body, list):
        assert body[-1] == "[DONE]"
        return "".join(e["choices"][0]["text"] for e in body[:-1] if e["choices"])
    return [(c["text"], c["logprobs"], c["finish_reason"]) for c in body["choices"]]


def _poison_sampling(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine) -> None:
    draw = engine.sampler._draw

    def faulty(logits: Any, rows: list[Any], greedy: list[bool]) -> list[int]:
        tokens = draw(logits, rows, greedy)  # every row's uniform is drawn first: seeded rows must be rewound
        if any(list(r.prompt_ids) == POISON and len(r.output_ids) >= 2 for r in rows):
            raise FloatingPointError("injected fault in sampling")
        return tokens

    monkeypatch.setattr(engine.sampler, "_draw", faulty)


def _poison_detokenization(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine) -> None:
    class Faulty(IncrementalDetokenizer):
        def __init__(self, tokenizer: Any, prompt_ids: Any = (), skip_special_tokens: bool = False) -> None:
            super().__init__(tokenizer, prompt_ids, skip_special_tokens)
            self.poisoned = list(prompt_ids) == POISON

        def add(self, token_id: int) -> str:
            if self.poisoned and self.num_tokens == 3:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected fault in detokenization")
            return super().add(token_id)

    monkeypatch.setattr(output_module, "IncrementalDetokenizer", Faulty)


def _poison_stop_matching(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine) -> None:
    class Faulty(TextStream):
        def __init__(self, tokenizer: Any, prompt_ids: Any, *args: Any) -> None:
            super().__init__(tokenizer, prompt_ids, *args)
            self.poisoned = list(prompt_ids) == POISON

        def _held_suffix(self) -> int:
            if self.poisoned and self.detok.num_tokens >= 4:
                raise IndexError("injected fault in stop matching")
            return super()._held_suffix()

    monkeypatch.setattr(engine_module, "TextStream", Faulty)


@pytest.mark.parametrize("poison", [_poison_sampling, _poison_detokenization, _poison_stop_matching],
                         ids=["sampling", "detokenization", "stop-matching"])
def test_a_fault_in_one_request_fails_it_alone(app: App, monkeypatch: pytest.MonkeyPatch, poison: Any) -> None:
    alone = [_text(app.run(body)[0]) for body in GOOD]
    canary = _text(app.run(CANARY)[0])
    assert _text(app.run(BAD)[0])  # unpoisoned, the bad request is a good one
    poison(monkeypatch, app.engine)

    *good, (whole_status, whole), (stream_status, events) = app.run(*GOOD, BAD, {**BAD, "stream": True})
    assert [_text(g) for g in good] == alone
    assert whole_status == 500
    error = whole["error"]
    assert error["type"] == "server_error" and "internal error while generating" in error["message"]
    assert "Traceback" not in json.dumps(whole) and "/" not in error["message"]
    assert stream_status == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error" and "internal error while generating" in events[-2]["error"]["message"]
    assert app.engine.scheduler.num_finished["error"] == 2

    app.engine.block_manager.check_integrity(expected_refs={})
    assert app.state.async_engine.is_running
    assert [_text(r) for r in app.run(CANARY, *GOOD)] == [canary, *alone]  # the engine goes on, exact as before

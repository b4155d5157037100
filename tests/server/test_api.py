"""The OpenAI API as the official `openai` client sees it, against a real server process on the tiny model:
chat and completions, streaming or not, usage, stop strings, n > 1, logprobs, tokenize/detokenize, logits
processors, and 32 concurrent streams that each get exactly their greedy output alone."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import ServerProcess, wait_idle

GREEDY: dict[str, Any] = {"temperature": 0.0}
PROMPTS = ["the cat sat on the mat", "hello there", "in the beginning", "seven seas", "on at en", "a"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)


def test_models_lists_the_served_model(client: openai.OpenAI, server: ServerProcess) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model] == ["tiny-llama"]


def test_completion_matches_stream_and_usage(client: openai.OpenAI, server: ServerProcess) -> None:
    full = client.completions.create(model=server.model, prompt="the cat", max_tokens=12, **GREEDY,
                                     extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert full.usage is not None and full.usage.completion_tokens == 12
    prompt_ids = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": "the cat"}).json()
    assert full.usage.prompt_tokens == prompt_ids["count"]

    chunks = list(client.completions.create(model=server.model, prompt="the cat", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_non_streaming_equals_streaming(client: openai.OpenAI, server: ServerProcess) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    full = client.chat.completions.create(model=server.model, messages=messages, max_completion_tokens=10,
                                          **GREEDY)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=server.model, messages=messages, max_tokens=10, stream=True,
                                            **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_stop_string_cuts_the_text(client: openai.OpenAI, server: ServerProcess) -> None:
    base = client.completions.create(model=server.model, prompt="hello there", max_tokens=30, **GREEDY,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[5:8]
    assert len(stop) == 3 and stop in base
    kwargs: dict[str, Any] = dict(model=server.model, prompt="hello there", max_tokens=30, stop=[stop], **GREEDY,
                                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.text == base[:base.index(stop)] and whole.finish_reason == "stop"
    parts = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(p.text for p in parts) == whole.text and parts[-1].finish_reason == "stop"


def test_n_choices_are_indexed_and_seeded(client: openai.OpenAI, server: ServerProcess) -> None:
    kwargs: dict[str, Any] = dict(model=server.model, prompt="the cat", max_tokens=8, n=3, temperature=5.0, seed=7,
                                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert first.usage is not None and first.usage.completion_tokens == 24
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in first.choices]  # seed + i per choice
    assert len({c.text for c in first.choices}) > 1
    single = client.completions.create(**{**kwargs, "n": 1, "seed": 8})
    assert single.choices[0].text == first.choices[1].text
    streamed = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, n=2, stream=True, **GREEDY)
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] and texts[0]


def test_multiple_prompts_and_token_prompts(client: openai.OpenAI, server: ServerProcess) -> None:
    ids = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": "seven seas"}).json()["tokens"]
    out = client.completions.create(model=server.model, prompt=["seven seas", "hello"], max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=server.model, prompt=ids, max_tokens=6, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert by_ids.choices[0].text == out.choices[0].text
    text = httpx.post(server.url + "/detokenize", json={"model": server.model, "tokens": ids}).json()["prompt"]
    assert text == "seven seas"


def test_logprobs(client: openai.OpenAI, server: ServerProcess) -> None:
    out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5  # greedy: the chosen one is the best


def test_tokenize_messages_matches_chat_usage(client: openai.OpenAI, server: ServerProcess) -> None:
    messages: list[Any] = [{"role": "user", "content": "what <|im_end|> is"}]
    tokens = httpx.post(server.url + "/tokenize", json={"model": server.model, "messages": messages}).json()
    out = client.chat.completions.create(model=server.model, messages=messages, max_tokens=1, **GREEDY)
    assert out.usage is not None and out.usage.prompt_tokens == tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 1024
    assert tokens["tokens"].count(2) == 1  # <|im_end|> typed by the user stays text; the template's is one


def test_32_concurrent_streams_match_their_greedy_output_alone(server: ServerProcess) -> None:
    params: dict[str, Any] = dict(model=server.model, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True})

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        alone = {}
        for prompt in PROMPTS:
            out = await client.completions.create(prompt=prompt, **params)
            alone[prompt] = out.choices[0].text

        async def stream(prompt: str) -> str:
            parts = []
            async for chunk in await client.completions.create(prompt=prompt, stream=True, **params):
                parts.append(chunk.choices[0].text)
            return "".join(parts)

        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
        results = await asyncio.gather(*(stream(p) for p in prompts))
        assert results == [alone[p] for p in prompts]
        await client.close()

    asyncio.run(run())
    wait_idle(server)


def test_echo_scores_the_prompt(client: openai.OpenAI, server: ServerProcess) -> None:
    """echo with logprobs, as OpenAI's legacy completions: the prompt's text and tokens first, each token's own
    log-probability given those before it (none for the first) and the top alternatives there; then the answer."""
    prompt = [5, 9, 17, 33, 65, 129]
    plain = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0)
    r = client.completions.create(model=server.model, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                  logprobs=2)
    choice = r.choices[0]
    tokens = httpx.post(server.url + "/detokenize", json={"model": server.model, "tokens": prompt},
                        timeout=30).json()
    assert choice.text == tokens["prompt"] + plain.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 3 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for token, actual, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert actual <= max(top.values()) + 1e-6 and len(top) == 2
        if token in top:
            assert abs(top[token] - actual) < 1e-5
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == choice.text


def test_best_of_returns_the_likeliest_samples(client: openai.OpenAI, server: ServerProcess) -> None:
    """best_of 4, n 2: four sampled completions, the two with the highest log-probability per token returned (the
    same seeds give the same four: they are the four of n=4)."""
    prompt = [5, 9, 17, 33]
    common = dict(model=server.model, prompt=prompt, max_tokens=6, temperature=1.0, seed=7, logprobs=0)
    four = client.completions.create(n=4, **common).choices
    best = client.completions.create(n=2, best_of=4, **common).choices
    mean = sorted((sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs), c.text) for c in four)
    assert [c.text for c in best] == [text for _, text in reversed(mean[-2:])]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(n=3, best_of=2, **common)
    # With the prompt echoed (its first token has no log-probability), the same two, ranked by their answers alone.
    echoed = client.completions.create(n=2, best_of=4, echo=True, **common).choices
    text = httpx.post(server.url + "/detokenize", json={"model": server.model, "tokens": prompt}, timeout=30).json()
    assert [c.text for c in echoed] == [text["prompt"] + c.text for c in best]


def test_beam_search_returns_the_n_best_beams(server: ServerProcess) -> None:
    body = {"model": server.model, "prompt": [5, 9, 17, 33], "max_tokens": 6, "beam_width": 3, "n": 2,
            "ignore_eos": True}
    r = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and choices[0]["text"] != choices[1]["text"]
    greedy = httpx.post(server.base_url + "/completions", json={**body, "beam_width": 1, "n": 1}, timeout=30).json()
    plain = httpx.post(server.base_url + "/completions", timeout=30,
                       json={"model": server.model, "prompt": [5, 9, 17, 33], "max_tokens": 6, "temperature": 0,
                             "ignore_eos": True}).json()
    assert greedy["choices"][0]["text"] == plain["choices"][0]["text"]
    streamed = httpx.post(server.base_url + "/completions", json={**body, "stream": True}, timeout=30)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
    # echo puts the prompt before each beam; logprobs gives each beam's tokens theirs; a beam search does not score
    # the prompt, so echo with logprobs is refused, not answered without the prompt's scores.
    echoed = httpx.post(server.base_url + "/completions", json={**body, "echo": True}, timeout=30).json()
    prompt = httpx.post(server.url + "/detokenize", json={"model": server.model, "tokens": body["prompt"]},
                        timeout=30).json()["prompt"]
    assert [c["text"] for c in echoed["choices"]] == [prompt + c["text"] for c in choices]
    scored = httpx.post(server.base_url + "/completions", json={**body, "logprobs": 2}, timeout=30).json()["choices"]
    assert [c["text"] for c in scored] == [c["text"] for c in choices]
    for c in scored:
        lp = c["logprobs"]
        assert "".join(lp["tokens"]) == c["text"] and len(lp["token_logprobs"]) == 6
        assert all(len(top) == 2 and actual <= max(top.values()) + 1e-6
                   for actual, top in zip(lp["token_logprobs"], lp["top_logprobs"]))
    both = httpx.post(server.base_url + "/completions", json={**body, "echo": True, "logprobs": 1}, timeout=30)
    assert both.status_code == 400 and both.json()["error"]["param"] == "echo"
    chat = httpx.post(server.base_url + "/chat/completions", timeout=30, json={
        "model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "beam_width": 2,
        "n": 2, "logprobs": True, "top_logprobs": 2}).json()
    assert len(chat["choices"]) == 2 and chat["usage"]["completion_tokens"] > 0
    for c in chat["choices"]:
        content = c["logprobs"]["content"]
        assert 1 <= len(content) <= 4 and all(len(t["top_logprobs"]) == 2 for t in content)


def test_logits_processors(client: openai.OpenAI, server: ServerProcess) -> None:
    def tokens(text: str) -> list[int]:
        return httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": text,
                                                         "add_special_tokens": False}).json()["tokens"]

    def text(ids: list[int]) -> str:
        return httpx.post(server.url + "/detokenize", json={"model": server.model, "tokens": ids}).json()["prompt"]

    cat = tokens("cat")[-1]
    forced = client.completions.create(model=server.model, prompt="the", max_tokens=6, **GREEDY,
                                       logit_bias={str(cat): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == text([cat] * 6)
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=6, **GREEDY, logit_bias={str(cat): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == text([cat] * 6)
    # cat forced and an end id: it ends the request once min_tokens allow it.
    for min_tokens, num_tokens in ((0, 1), (4, 5)):
        ended = client.completions.create(model=server.model, prompt="the", max_tokens=6, **GREEDY,
                                          logit_bias={str(cat): 100},
                                          extra_body={"stop_token_ids": [cat], "min_tokens": min_tokens})
        assert ended.usage is not None and ended.usage.completion_tokens == num_tokens
        assert ended.choices[0].finish_reason == "stop"
    allowed = tokens(" the cat")
    only = client.completions.create(model=server.model, prompt="the", max_tokens=6, **GREEDY,
                                     extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert set(tokens(only.choices[0].text)) <= set(allowed)
    free = client.completions.create(model=server.model, prompt="the", max_tokens=6, **GREEDY,
                                     extra_body={"ignore_eos": True}).choices[0].text
    banned = client.completions.create(model=server.model, prompt="the", max_tokens=6, **GREEDY,
                                       extra_body={"ignore_eos": True, "bad_words": [free.split()[0]]})
    assert banned.choices[0].text != free
    for key, bias in (("1", 101), ("x", 1), (str(10**6), 1)):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2, logit_bias={key: bias})
        assert exc.value.response.json()["error"]["param"] == "logit_bias"


def test_debug_engine_shows_the_steps_that_ran(client: openai.OpenAI, server: ServerProcess,
                                               guarded_server: ServerProcess) -> None:
    import httpx

    from tests.server.conftest import API_KEY

    assert httpx.get(server.url + "/debug/engine", timeout=10).json()["steps"] is not None  # recording from now on
    client.completions.create(model=server.model, prompt=[1, 2, 3, 4, 5], max_tokens=4, temperature=0,
                              extra_body={"ignore_eos": True})
    view = httpx.get(server.url + "/debug/engine", timeout=10).json()
    ours = [s for s in view["steps"] if s["ran"]][-4:]  # the request's steps: a prefill, then three decodes
    assert [r["tokens"] for s in ours for r in s["ran"]] == [5, 1, 1, 1]
    assert [r["first"] for s in ours for r in s["ran"]] == [0, 5, 6, 7]
    running = [r for s in ours[:-1] for r in s["running"]]
    assert running and all(len(r["blocks"]) >= 1 for r in running)
    assert view["num_blocks"] > 0 and view["block_size"] == 16
    assert httpx.get(guarded_server.url + "/debug/engine", timeout=10).status_code == 401  # behind the key
    assert httpx.get(guarded_server.url + "/debug/engine", timeout=10,
                     headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200

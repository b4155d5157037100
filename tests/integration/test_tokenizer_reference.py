"""Real GGUF tokenizers against transformers' reference ids and texts (tests/data/tokenizer_reference.json).

All 13 prompts of SmolLM2 (byte-level BPE) and Gemma 3 (SentencePiece-style, merges derived from scores): ids equal
`hf_ids`, decoding gives the text and greedy continuations back, chat markers are single ids, and a cached build of
Gemma's merges gives the same tokenizer as a cold one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nextoken.loader.gguf import read_gguf
from nextoken.loader.registry import resolve_model
from nextoken.tokenizer.tokenizer import Tokenizer

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "tokenizer_reference.json").read_text("utf-8"))
MODELS = tuple(REFERENCE["models"])  # "smollm2-135m-instruct", "gemma-3-270m"
CHAT_MARKERS = {"smollm2-135m-instruct": ("<|im_start|>", "<|im_end|>"),
                "gemma-3-270m": ("<bos>", "<start_of_turn>", "<end_of_turn>")}


@pytest.fixture(scope="module")
def model_paths() -> dict[str, Path]:
    return {name: resolve_model(name) for name in MODELS}  # before any NEXTOKEN_CACHE_DIR change


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokcache")


@pytest.fixture(scope="module")
def tokenizers(model_paths, cache_root) -> dict[str, Tokenizer]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXTOKEN_CACHE_DIR", str(cache_root))
        return {name: Tokenizer.from_gguf(read_gguf(path).metadata, source=str(path))
                for name, path in model_paths.items()}


CASES = [(model, p["id"]) for model in MODELS for p in REFERENCE["models"][model]["prompts"]]


def prompt(model: str, prompt_id: str) -> dict:
    return next(p for p in REFERENCE["models"][model]["prompts"] if p["id"] == prompt_id)


@pytest.mark.parametrize(("model", "prompt_id"), CASES)
def test_ids_match_reference(tokenizers, model, prompt_id):
    p = prompt(model, prompt_id)
    assert tokenizers[model].encode(p["text"], add_special_tokens=p["add_special"]) == p["hf_ids"]


@pytest.mark.parametrize(("model", "prompt_id"), CASES)
def test_decode_matches_reference(tokenizers, model, prompt_id):
    tok, p = tokenizers[model], prompt(model, prompt_id)
    if p["kind"] == "text":
        assert tok.decode(p["hf_ids"], skip_special_tokens=True) == p["text"]
    else:
        assert tok.decode(p["hf_ids"]) == p["text"]  # rendered chats: markers (and <bos>) are part of the text
    assert tok.decode(p["greedy_ids"]) == p["greedy_text"]


@pytest.mark.parametrize(("model", "prompt_id"), [c for c in CASES if prompt(*c)["kind"] == "chat"])
def test_chat_markers_are_single_ids(tokenizers, model, prompt_id):
    tok, p = tokenizers[model], prompt(model, prompt_id)
    ids = tok.encode(p["text"], add_special_tokens=False)
    for marker in CHAT_MARKERS[model]:
        marker_id = tok.token_to_id(marker)
        assert marker_id in tok.special_ids
        assert ids.count(marker_id) == p["text"].count(marker) > 0


@pytest.mark.parametrize(("model", "prompt_id"), [c for c in CASES if prompt(*c)["kind"] == "chat"])
def test_plain_spans_over_user_messages_keep_reference_ids(tokenizers, model, prompt_id):
    # Marking every message body as untrusted changes nothing when none contains marker text.
    tok, p = tokenizers[model], prompt(model, prompt_id)
    text, spans = p["text"], []
    for role in ("user\n", "system\n", "assistant\n", "model\n"):
        start = text.find(role)
        while start >= 0:
            body = start + len(role)
            end = min([i for i in (text.find(m, body) for m in CHAT_MARKERS[model]) if i >= 0] + [len(text)])
            spans.append((body, end))
            start = text.find(role, end)
    assert spans
    assert tok.encode(text, add_special_tokens=False, plain_spans=spans) == p["hf_ids"]


def test_cached_gemma_build_is_identical(model_paths, cache_root, tokenizers, monkeypatch):
    monkeypatch.setenv("NEXTOKEN_CACHE_DIR", str(cache_root))
    cold = tokenizers["gemma-3-270m"]
    assert cold.load_stats["merges_cache"] == "miss"
    metadata = read_gguf(model_paths["gemma-3-270m"]).metadata
    t0 = time.perf_counter()
    warm = Tokenizer.from_gguf(metadata)
    warm_s = time.perf_counter() - t0
    assert warm.load_stats["merges_cache"] == "hit"
    assert warm_s < cold.load_stats["total_s"]
    for p in REFERENCE["models"]["gemma-3-270m"]["prompts"]:
        assert warm.encode(p["text"], add_special_tokens=p["add_special"]) == p["hf_ids"]

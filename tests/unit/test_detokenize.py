"""IncrementalDetokenizer: deltas + flush == decode, never half a character, no re-decoding, on real tokenizers.

Checked on every reference greedy continuation (Chinese and emoji span several byte tokens) and on random id
sequences biased towards byte tokens, partial UTF-8 pieces and control tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nextoken.errors import TokenizerError
from nextoken.tokenizer.detokenize import IncrementalDetokenizer
from nextoken.tokenizer.tokenizer import Tokenizer
from tests.conftest import real_tokenizer

REFERENCE = json.loads((Path(__file__).parent.parent / "data" / "tokenizer_reference.json").read_text("utf-8"))
MODELS = {"smollm": "smollm2-135m-instruct", "gemma": "gemma-3-270m"}


@pytest.fixture(scope="module")
def smollm(tmp_path_factory) -> Tokenizer:
    return real_tokenizer(MODELS["smollm"], tmp_path_factory)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Tokenizer:
    return real_tokenizer(MODELS["gemma"], tmp_path_factory)


def stream(tok: Tokenizer, ids: list[int], *, skip: bool = False, prompt: list[int] | None = None) -> list[str]:
    """Run the detokenizer over `ids`, checking the invariants after every token; returns the deltas (+ flush)."""
    detok = IncrementalDetokenizer(tok, prompt or (), skip_special_tokens=skip)
    final = tok.decode(ids, skip_special_tokens=skip)
    deltas: list[str] = []
    emitted = ""
    for n, token_id in enumerate(ids, 1):
        delta = detok.add(token_id)
        deltas.append(delta)
        emitted += delta
        # Every delta lands where the full decoding has it, so no U+FFFD from a cut character can slip in.
        assert final.startswith(emitted)
        so_far = tok.decode_bytes(ids[:n], skip_special_tokens=skip)
        try:
            complete = so_far.decode("utf-8")
        except UnicodeDecodeError:
            # Only an incomplete trailing character (at most 3 bytes, so at most 3 U+FFFD) may be held back.
            assert len(tok.decode(ids[:n], skip_special_tokens=skip)) - len(emitted) <= 3
        else:
            # Nothing pending: everything is out already (no lag).
            if tok.add_space_prefix and complete.startswith(" "):
                complete = complete[1:]
            assert emitted == complete
    deltas.append(detok.flush())
    assert "".join(deltas) == final
    return deltas


REFERENCE_CASES = [(name, p["id"]) for name, model in MODELS.items() for p in REFERENCE["models"][model]["prompts"]]


@pytest.mark.parametrize(("name", "prompt_id"), REFERENCE_CASES)
def test_reference_continuations(name, prompt_id, request):
    tok: Tokenizer = request.getfixturevalue(name)
    prompt = next(p for p in REFERENCE["models"][MODELS[name]]["prompts"] if p["id"] == prompt_id)
    deltas = stream(tok, prompt["greedy_ids"], prompt=prompt["hf_ids"])
    assert "".join(deltas) == prompt["greedy_text"]
    assert "".join(stream(tok, prompt["greedy_ids"], skip=True)) == tok.decode(prompt["greedy_ids"],
                                                                                 skip_special_tokens=True)


def test_multi_byte_characters_are_held_back(smollm):
    # In SmolLM2's 'zh_weather' continuation the ideographs arrive in byte pieces: some tokens complete nothing.
    prompt = next(p for p in REFERENCE["models"][MODELS["smollm"]]["prompts"] if p["id"] == "zh_weather")
    deltas = stream(smollm, prompt["greedy_ids"])
    assert "" in deltas[:-1] and "\ufffd" not in "".join(deltas)


def test_emoji_from_byte_tokens(gemma):
    ids = [gemma.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    assert stream(gemma, ids) == ["", "", "", "😀", ""]
    # Cut short, the trailing bytes come out as decode has them, at flush.
    assert stream(gemma, ids[:3]) == ["", "", "", gemma.decode(ids[:3])]
    assert gemma.decode(ids[:3]) == "\ufffd"


def _ids(tok: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Random ids, weighted towards the hard cases: byte tokens / partial UTF-8 pieces, control tokens."""
    partial = [i for i in range(tok.vocab_size) if len(tok.piece_bytes(i)) <= 2
               and tok.display_piece(i) != tok.piece_bytes(i).decode("utf-8", "replace")]
    specials = sorted(tok.special_ids)[:50]
    words = [tok.token_to_id(p) for p in ("Ġthe", "▁the", "the", " ", "Ġ", "▁", "\n") if tok.token_to_id(p) is not None]
    one = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(partial), st.sampled_from(partial),
                    st.sampled_from(specials), st.sampled_from(words))
    return st.lists(one, max_size=40)


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_random_id_sequences(name, request):
    tok: Tokenizer = request.getfixturevalue(name)

    @settings(max_examples=200, deadline=None)
    @given(_ids(tok), st.booleans())
    def check(ids: list[int], skip: bool) -> None:
        stream(tok, ids, skip=skip)

    check()


def test_never_redecodes(gemma, monkeypatch):
    detok = IncrementalDetokenizer(gemma, [2, 105])

    def boom(*args, **kwargs):
        raise AssertionError("the detokenizer must not re-decode the sequence")

    monkeypatch.setattr(gemma, "decode", boom)
    monkeypatch.setattr(gemma, "decode_bytes", boom)
    ids = np.random.default_rng(0).integers(0, gemma.vocab_size, 5000).tolist()
    out = "".join(detok.add(i) for i in ids) + detok.flush()
    monkeypatch.undo()
    assert out == gemma.decode(ids)


def test_out_of_vocabulary_id(smollm):
    detok = IncrementalDetokenizer(smollm)
    with pytest.raises(TokenizerError, match="49152"):
        detok.add(49152)


def test_leading_space_rule_of_prefix_space_vocabularies():
    # A SentencePiece-style file with add_space_prefix: decode drops the encoder's leading space, and so does the
    # stream at the start of a text, but not after prompt text.
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "h", "i", "y", "o", "\u2581h", "\u2581hi", "\u2581y", "\u2581yo"]
    tok = Tokenizer.from_gguf({
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": -np.arange(len(tokens), dtype=np.float32),
        "tokenizer.ggml.token_type": np.array([2, 3, 3] + [1] * 9, dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.add_space_prefix": True,
    })
    ids = tok.encode("hi yo", add_special_tokens=False)
    assert ids == [9, 11] and tok.decode(ids) == "hi yo"
    assert "".join(stream(tok, ids)) == "hi yo"
    assert "".join(stream(tok, [1, *ids], skip=True)) == "hi yo"
    assert "".join(stream(tok, [1, *ids])) == "<s> hi yo"
    detok = IncrementalDetokenizer(tok, prompt_ids=[1, 9])
    assert detok.add(11) == " yo"  # continues "hi": the space belongs to the text

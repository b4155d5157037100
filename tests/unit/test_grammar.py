"""Structured output (engine/grammar.py): the constraint's validation, llguidance's errors named by keyword, the mask
on hand-checked vocabularies, and 200 sampled generations at temperature 1 on tiny random models (which never
"want" JSON: every token of it comes from the mask) that all parse and validate against their schemas."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from nextoken import LLM
from nextoken.engine.processors import apply_processors
from nextoken.engine.sampler import Sampler, SamplingRow
from nextoken.errors import InvalidInput, InvalidSamplingParams
from nextoken.sampling_params import SamplingParams, StructuredOutputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"enum": [0.5, -1, 2e3]},  # (a free number: a random model may write "1.000..." without end)
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 5}, "zip": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99999}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
ITEMS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                       "ok": {"type": "boolean"},
                       "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=32 << 20)


@pytest.fixture(scope="module")
def gemma_llm(tiny_gemma: Path) -> LLM:
    return LLM(str(tiny_gemma), weights="fp32", device="cpu", kv_cache_bytes=32 << 20)


def test_exactly_one_constraint_is_given() -> None:
    for options in ({}, {"json": {"type": "object"}, "regex": "a"}, {"json_object": True, "choice": ("a",)}):
        with pytest.raises(InvalidSamplingParams, match="exactly one of"):
            StructuredOutputs(**options)  # type: ignore[arg-type]
    for options, field in (({"choice": ()}, "choice"), ({"choice": ("a", "")}, "choice"), ({"regex": ""}, "regex"),
                           ({"grammar": " "}, "grammar"), ({"json": {"x": float("nan")}}, "json")):
        with pytest.raises(InvalidSamplingParams, match=f"structured_outputs.{field}"):
            StructuredOutputs(**options)  # type: ignore[arg-type]


def test_a_schema_is_kept_as_its_json_text_in_its_own_order() -> None:
    a = StructuredOutputs(json={"b": 1, "a": {"y": 2, "x": 1}})
    assert a == StructuredOutputs(json='{"b": 1, "a": {"y": 2, "x": 1}}') and a.kind == "json"
    assert hash(a) == hash(StructuredOutputs(json={"b": 1, "a": {"y": 2, "x": 1}}))
    assert StructuredOutputs(choice=["x", "y"]).schema == '["x", "y"]'  # type: ignore[arg-type]


def test_beam_search_refuses_a_grammar() -> None:
    with pytest.raises(InvalidSamplingParams, match="invalid structured_outputs=.*unset with beam search"):
        SamplingParams(beam_width=2, structured_outputs=StructuredOutputs(regex="a"))


@pytest.mark.parametrize(("constraint", "message"), [
    (StructuredOutputs(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredOutputs(json={"type": "object", "if": {}, "then": {}}), '"if"'),
    (StructuredOutputs(json={"type": "integer", "minimum": 5, "maximum": 3}), "minimum"),
    (StructuredOutputs(json={"allOf": [{"type": "string"}, {"type": "integer"}]}), "Unsatisfiable"),
    (StructuredOutputs(json={"type": "strng"}), "strng"),
    (StructuredOutputs(json="{not json"), "invalid structured_outputs"),
    (StructuredOutputs(regex="a(b"), "unclosed group"),
    (StructuredOutputs(grammar="start: missing_rule"), "missing_rule"),
    (StructuredOutputs(grammar='root ::= "a" undefined'), "undefined"),
])
def test_unsupported_or_unsatisfiable_constraints_are_refused_naming_the_keyword(
        llm: LLM, constraint: StructuredOutputs, message: str) -> None:
    with pytest.raises(InvalidInput, match=re.escape(message)) as info:
        llm.engine.inputs.check_processor_ids(SamplingParams(structured_outputs=constraint))
    assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidInput, match=re.escape(message)):  # added directly: refused the same way
        llm.engine.add_request([1, 2, 3], SamplingParams(structured_outputs=constraint))
    assert not llm.engine.has_unfinished()


def test_the_mask_allows_exactly_the_tokens_that_keep_a_match_possible(llm: LLM) -> None:
    tokenizer = llm.engine.tokenizer
    matcher = llm.engine.inputs.grammars.matcher(StructuredOutputs(regex="(ab|ac)[0-9]"))
    allowed = {i for i in range(tokenizer.vocab_size) if matcher.allowed()[i]}
    assert {tokenizer.piece_bytes(i) for i in allowed} == {b"a"}  # no vocabulary token holds "ab" or "ac"
    assert matcher.accept(tokenizer.token_to_id("a"))  # type: ignore[arg-type]
    assert {tokenizer.piece_bytes(i) for i in range(tokenizer.vocab_size) if matcher.allowed()[i]} == {b"b", b"c"}
    for piece in ("c", "7"):
        assert matcher.accept(tokenizer.token_to_id(piece))  # type: ignore[arg-type]
    ends = [i for i in range(tokenizer.vocab_size) if matcher.allowed()[i]]
    assert ends and set(ends) <= set(llm.engine.eog_ids)  # complete: only an end id may follow
    assert not llm.engine.inputs.grammars.matcher(StructuredOutputs(regex="x")).accept(
        tokenizer.token_to_id("y"))  # type: ignore[arg-type]


def test_the_mask_is_applied_with_the_other_processors_in_one_batch(llm: LLM) -> None:
    vocab = llm.engine.inputs.vocab_size
    tokenizer = llm.engine.tokenizer
    digit = tokenizer.token_to_id("5")
    constraint = StructuredOutputs(regex="[0-9]+")
    matcher = llm.engine.inputs.grammars.matcher(constraint)
    logits = torch.zeros(2, vocab)
    logits[:, digit] = -5.0  # the free row would never take it
    rows = [SamplingRow(SamplingParams(temperature=0, structured_outputs=constraint), None, [1], [], grammar=matcher),
            SamplingRow(SamplingParams(temperature=0), None, [1], [])]
    processed = apply_processors(logits.clone(), rows)
    digits = {tokenizer.token_to_id(str(d)) for d in range(10)}
    assert {i for i in range(vocab) if processed[0, i] > float("-inf")} == digits
    assert processed[1].equal(logits[1])
    assert Sampler()(logits, rows).token_ids[0] in digits - {digit}
    assert not Sampler.argmax_only([SamplingParams(temperature=0, structured_outputs=StructuredOutputs(regex="a"))])


def test_constraints_that_leave_no_token_raise_naming_them(llm: LLM) -> None:
    """A regex of digits with allowed_token_ids holding only a letter: no token satisfies both. The request fails
    alone with an InvalidInput naming structured_outputs (not the engine's generic failure), its blocks come back,
    and the next request runs."""
    letter = llm.engine.tokenizer.token_to_id("a")
    params = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[letter],
                            structured_outputs=StructuredOutputs(regex="[0-9]+"))
    with pytest.raises(InvalidInput, match="no token is left at output position 0") as info:
        llm.generate("hello", params, use_tqdm=False)
    assert info.value.param == "structured_outputs"
    llm.engine.block_manager.check_integrity(expected_refs={})
    assert llm.generate("hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("model", ["llm", "gemma_llm"])
def test_200_samples_at_temperature_1_all_parse_and_validate(model: str, request: pytest.FixtureRequest) -> None:
    engine_llm: LLM = request.getfixturevalue(model)
    prompts = ["the cat sat", "json please:", "{", "x"]
    count = 0
    for schema, per_prompt in ((PERSON, 15), (ITEMS, 10)):
        params = SamplingParams(temperature=1.0, max_tokens=160, seed=11, n=per_prompt,
                                structured_outputs=StructuredOutputs(json=schema))
        for out in engine_llm.generate(prompts, params, use_tqdm=False):
            for choice in out.outputs:
                assert choice.finish_reason == "stop", choice.text  # ended by the grammar, never cut
                value = json.loads(choice.text)
                jsonschema.validate(value, schema)
                if isinstance(value, dict):  # keys in the schema's order
                    assert list(value) == [k for k in schema["properties"] if k in value]  # type: ignore[index]
                count += 1
    assert count == 4 * (15 + 10) == 100
    assert engine_llm.engine.block_manager.num_free_blocks == engine_llm.engine.block_manager.num_blocks


def test_any_json_object_regex_choice_and_both_grammar_syntaxes(llm: LLM) -> None:
    def texts(constraint: StructuredOutputs, n: int = 8, max_tokens: int = 48) -> list[str]:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=3, n=n, structured_outputs=constraint)
        outs = llm.generate("the cat sat", params, use_tqdm=False)[0].outputs
        return [o.text for o in outs if o.finish_reason == "stop"]

    objects = texts(StructuredOutputs(json_object=True), max_tokens=160)
    assert all(isinstance(json.loads(t), dict) for t in objects)
    assert all(re.fullmatch(r"[0-9]{3}-[a-c]{2}", t) for t in texts(StructuredOutputs(regex="[0-9]{3}-[a-c]{2}")))
    assert set(texts(StructuredOutputs(choice=("yes", "no", "maybe")), n=16)) <= {"yes", "no", "maybe"}
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-z]/'
    assert all(re.fullmatch(r"\([a-z](,[a-z])*\)", t) for t in texts(StructuredOutputs(grammar=lark)))
    gbnf = 'root ::= "<" digit digit ">"\ndigit ::= [0-9]'
    assert all(re.fullmatch(r"<[0-9]{2}>", t) for t in texts(StructuredOutputs(grammar=gbnf)))


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 1000, 49_152])
def test_the_native_mask_fill_equals_the_bits_expanded(vocab: int) -> None:
    from nextoken.ops import native

    lib = native.library()
    if lib is None:
        pytest.fail("the native kernels did not build")
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32 - (1 if vocab > 64 else 0)  # a mask shorter than the row: the rest is banned
    bits = torch.randint(0, 2**32, (3, words), generator=gen, dtype=torch.int64).numpy().astype("uint32")
    bits[1, : words // 2] = 0xFFFFFFFF  # whole words allowed and banned, the kernel's shortcuts
    bits[2, words // 2:] = 0
    logits = torch.randn(5, vocab, generator=gen)
    got = logits.clone()
    native.mask_rows(lib, got, [4, 0, 2], bits)
    expected = logits.clone()
    for k, r in enumerate([4, 0, 2]):
        for j in range(vocab):
            if j >= 32 * words or not (int(bits[k, j // 32]) >> (j % 32)) & 1:
                expected[r, j] = float("-inf")
    assert got.equal(expected)


def test_speculation_leaves_a_grammar_request_to_plain_decoding(tiny_llama: Path) -> None:
    spec = LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=32 << 20, speculative="ngram",
               num_speculative_tokens=4)
    params = SamplingParams(temperature=1.0, max_tokens=160, seed=11, n=6, structured_outputs=StructuredOutputs(
        json=ITEMS))
    plain = LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=32 << 20)
    ours = [o.text for o in spec.generate("x", params, use_tqdm=False)[0].outputs]
    assert ours == [o.text for o in plain.generate("x", params, use_tqdm=False)[0].outputs]
    for text in ours:
        jsonschema.validate(json.loads(text), ITEMS)

"""Record and replay (engine/record.py): a recorded request replays identically; a changed seed is found at the step
where the draws part; corrupt, truncated, newer and other-model bundles are refused with one line naming which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nextoken import LLM, SamplingParams
from nextoken.cli import main
from nextoken.engine.record import BundleError, read_bundle
from nextoken.sampling_params import StructuredOutputs
from tests.tiny import write_tiny_model

PARAMS = SamplingParams(temperature=3.0, seed=3, max_tokens=12, ignore_eos=True, top_k=50, logit_bias={7: 1.5})


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), weights="fp32", device="cpu", kv_cache_bytes=8 << 20)


@pytest.fixture
def bundle(llm: LLM, tmp_path: Path) -> Path:
    path = tmp_path / "run.json"
    llm.generate("the cat sat", PARAMS, record=path)
    return path


def edited(path: Path, change: object) -> Path:
    data = json.loads(path.read_text())
    change(data)  # type: ignore[operator]
    out = path.with_name("edited.json")
    out.write_text(json.dumps(data))
    return out


def test_a_record_holds_what_decides_the_tokens_and_replays_identically(llm: LLM, bundle: Path) -> None:
    out = llm.generate("the cat sat", PARAMS)[0]
    data = json.loads(bundle.read_text())
    assert data["format"] == "nextoken-record" and len(data["model"]["sha256"]) == 64
    assert data["prompt"]["ids"] == out.prompt_token_ids and [s["token"] for s in data["steps"]] == out.token_ids
    assert all(len(s["top"]) == 5 for s in data["steps"]) and data["params"]["seed"] == 3
    assert data["params"]["logprobs"] is None  # as given: the top-5 are the record's own
    assert data["engine"]["weights"] == "fp32" and data["model"]["formats"]["weights"] == "fp32"
    result = llm.replay(bundle)
    assert result.identical and result.first_difference is None and result.max_logprob_change == 0.0
    assert result.message.startswith("identical: 12 tokens")


def test_a_changed_seed_is_found_at_the_step_where_the_draws_part(llm: LLM, bundle: Path) -> None:
    recorded = [s["token"] for s in json.loads(bundle.read_text())["steps"]]
    for seed in range(4, 40):
        other = llm.generate("the cat sat", SamplingParams(**{**PARAMS.__dict__, "seed": seed}))[0].token_ids
        if other != recorded:
            break
    first = next(i for i, (a, b) in enumerate(zip(recorded, other)) if a != b)
    result = llm.replay(edited(bundle, lambda d: d["params"].update(seed=seed)))
    assert not result.identical and result.first_difference == first
    assert result.message.startswith(f"differs at step {first}: recorded ")


def test_structured_output_and_processors_are_recorded(llm: LLM, tmp_path: Path) -> None:
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, bad_words=[[9]], allowed_token_ids=None,
                            structured_outputs=StructuredOutputs(regex="[0-9]{3}"))
    llm.generate("x", params, record=tmp_path / "so.json")
    assert read_bundle(tmp_path / "so.json").params == params
    assert llm.replay(tmp_path / "so.json").identical


@pytest.mark.parametrize(("change", "words"), [
    (lambda text: text[: len(text) // 2], "is truncated"),
    (lambda text: text.replace('"steps"', '"steps" x'), "is corrupt"),
    (lambda text: text.replace('"version": 1', '"version": 2'), "format version 2"),
    (lambda text: text.replace('"format": "nextoken-record"', '"format": "other"'), "not a nextoken record"),
    (lambda text: text.replace('"token"', '"tok"'), "is corrupt: a field is missing"),
])
def test_bad_bundles_are_refused_in_one_line(bundle: Path, change: object, words: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    bad = bundle.with_name("bad.json")
    bad.write_text(change(bundle.read_text()))  # type: ignore[operator]
    with pytest.raises(BundleError, match=words):
        read_bundle(bad)
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_another_model_file_is_refused(bundle: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = write_tiny_model(tmp_path / "other.gguf", "llama", seed=1)  # same shape and vocabulary, other weights
    assert main(["replay", str(bundle), "--model", str(other)]) == 2
    assert "was made with another model file" in capsys.readouterr().err


def test_the_command_line_records_and_replays(tiny_llama: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cli.json"
    args = ["--model", str(tiny_llama), "--weights", "fp32", "--device", "cpu", "--temperature", "2", "--seed", "5",
            "--max-tokens", "6", "--raw"]
    assert main(["run", *args, "--record", str(path), "the cat"]) == 0
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0
    assert capsys.readouterr().out.startswith("identical: ")
    changed = edited(path, lambda d: d["steps"][2].update(token=(d["steps"][2]["token"] + 1) % 200))
    assert main(["replay", str(changed)]) == 1
    assert capsys.readouterr().out.startswith("differs at step 2: ")

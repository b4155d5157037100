"""The parity check (nextoken/check.py): its figures recomputed independently for one format, a format that changes
nothing scored as exact, transformers' own forward of a tiny model directory agreeing with nextoken's fp32 route,
and the command's table and errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nextoken import LLM
from nextoken.check import parse_format, run_check
from nextoken.cli import main
from nextoken.errors import NextokenError
from tests.hf_reference import build, save_directory
from tests.unit.test_hf_dir import tiny_tokenizer

PROMPTS = ["the cat sat", "a b c d"]


def test_the_figures_are_the_kl_and_agreement_of_the_two_routes(tiny_llama: Path) -> None:
    sequences, [same, int8] = run_check(str(tiny_llama), PROMPTS, ["weights=fp32", "weights=int8,kv_dtype=int8"],
                                        continuation=6)
    assert same.mean_kl == 0 and same.worst_kl == 0 and same.top1 == 1.0  # the reference's own formats
    assert int8.formats["weights"] == "int8" and int8.formats["kv_dtype"] == "int8"
    ref = LLM(str(tiny_llama), device="cpu", weights="fp32", lm_head="fp32", kv_dtype="fp32")
    fast = LLM(str(tiny_llama), device="cpu", weights="int8", kv_dtype="int8")
    kls, agree = [], []
    for seq in sequences:
        p = ref.engine.runner.score(seq).double().log_softmax(-1)
        q = fast.engine.runner.score(seq).double().log_softmax(-1)
        kls += (p.exp() * (p - q)).sum(-1).tolist()
        agree += (p.argmax(-1) == q.argmax(-1)).tolist()
    assert int8.positions == len(kls) == sum(len(s) for s in sequences)
    assert int8.mean_kl == pytest.approx(sum(kls) / len(kls), rel=1e-3)
    assert int8.worst_kl == pytest.approx(max(kls), rel=1e-3) and int8.worst_kl > 0
    assert int8.top1 == sum(agree) / len(agree)
    prompt, position, token = int8.worst_at  # type: ignore[misc]
    assert sequences[prompt][position] == token


def test_transformers_own_forward_agrees_with_the_fp32_route(tmp_path: Path) -> None:
    directory = save_directory(build("llama"), tmp_path / "llama")
    tiny_tokenizer(directory)
    _, [default, hf] = run_check(str(directory), PROMPTS, ["default"], continuation=4, against="transformers")
    assert hf.name == "transformers fp32" and hf.positions == default.positions
    assert hf.top1 == 1.0 and hf.worst_kl < 1e-6  # the reference is transformers' own numbers


def test_formats_are_parsed_or_refused_by_name() -> None:
    assert parse_format("default") == {}
    assert parse_format("weights=int8, kv-dtype=int8") == {"weights": "int8", "kv_dtype": "int8"}
    for bad in ("int8", "colour=red", "weights"):
        with pytest.raises(NextokenError, match="invalid format"):
            parse_format(bad)


def test_the_command(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\n\nhello there\n")
    args = ["check", "--model", str(tiny_llama), "--prompts", str(prompts), "--continuation", "3"]
    assert main([*args, "--formats", "default", "weights=int8,activations=int8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["prompts"] == ["the cat sat", "hello there"] and [f["format"] for f in data["formats"]] == [
        "default", "weights=int8,activations=int8"]
    assert all(0 <= f["top1_agreement"] <= 1 and f["mean_kl"] >= 0 for f in data["formats"])
    assert main([*args, "--formats", "weights=int8"]) == 0
    out = capsys.readouterr().out
    assert "top-1 agreement" in out and "weights=int8" in out
    assert main(["check", "--model", str(tiny_llama), "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "No such file" in capsys.readouterr().err

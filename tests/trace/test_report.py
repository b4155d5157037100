"""The terminal report and `--compare` on the tiny models, and the `trace` command line: sections in pipeline order,
user text printed as text (never rich markup), one column per compared setting with entropies, user errors as one
line and exit code 2; and once on the real default model, as a user runs it."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType

from nextoken import SamplingParams, cli
from nextoken.errors import NextokenError
from nextoken.trace import cost
from nextoken.trace.command import TraceOptions, trace
from nextoken.trace.report import make_console
from nextoken.trace.run import parse_setting, run_request
from nextoken.trace.tracer import RecordingTracer
from tests.conftest import load_reference, needs_native
from tests.tiny import write_tiny_model

SECTIONS = ("1. Input", "2. Embedding and positions", "3. Blocks", "4. Output", "5. Cost", "Tracing overhead")


@pytest.fixture(autouse=True)
def quick_peaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A private cache dir and a small peak measurement: these tests check the report, not the machine."""
    monkeypatch.setenv("NEXTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cost, "MIN_MEASURE_S", 0.01)
    monkeypatch.setattr(cost, "GEMM_SIZE", {"cpu": 128})
    monkeypatch.setattr(cost, "COPY_BYTES", 1 << 20)


def run_trace(model: Path, prompt: str, params: SamplingParams, **options: object) -> str:
    out = io.StringIO()
    assert trace(prompt, params, TraceOptions(model=str(model), device="cpu", **options),  # type: ignore[arg-type]
                 make_console(out)) == 0
    return out.getvalue()


def test_report_sections_in_pipeline_order(tiny_gemma: Path) -> None:
    text = run_trace(tiny_gemma, "[bold]the[/bold] cat", SamplingParams(temperature=0, max_tokens=5,
                                                                        ignore_eos=True), top_k=3)
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    assert "[bold]the[/bold] cat" in text  # the prompt as typed, not styled
    assert "'<start_of_turn>'" in text and "characters per token" in text
    assert "local, window 8" in text and "global" in text  # Gemma 3's layers: five local, one global
    assert re.search(r"stages add up to (9\d|100)\.\d% of the measured total", text)
    assert "same tokens as the untraced run: yes" in text
    assert "top-3 candidates" in text
    steps = re.findall(r"^\s+(\d) │", text[text.index("4. Output"):text.index("5. Cost")], flags=re.M)
    assert steps == ["0", "1", "2", "3", "4"]  # one row per generated token
    assert "KV cache per token: 2 x 6 layers x 1 kv heads x 32 head dim x 4 bytes = 1,536 B" in text
    assert max(len(line) for line in text.splitlines()) <= 120  # piped: a fixed width


@needs_native
def test_report_names_the_path_each_phase_took(tmp_path: Path) -> None:
    """A model whose steps run fused: the report says which path each phase took (the prompt's blocks in one native
    call where the CPU has AVX-512, every decode step in one), where the per-layer times came from, and, with the
    attention maps asked for (--html), that the fused steps were re-run on the modules and agreed."""
    from nextoken.ops import native

    model = write_tiny_model(tmp_path / "tiny-gemma3-q8.gguf", "gemma3", table=GGMLQuantizationType.Q8_0)
    text = run_trace(model, "the cat", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                     weights="int4", html=tmp_path / "trace.html")
    flat = " ".join(text.split())  # rich wraps long lines
    prefill = "fused blocks" if native.library().nt_has_vnni512() else "modules"
    assert f"on the paths an untraced run takes: prefill: 1 step on {prefill}; decode: 4 steps on native step" in flat
    assert "native step: the whole step in one native call" in flat
    assert "from the native calls' own counters where steps ran fused" in flat
    assert "same tokens as the untraced run: yes" in flat
    fused = 5 if prefill == "fused blocks" else 4
    assert re.search(rf"the {fused} steps that ran fused were re-run on the module path .* and the re-runs agree "
                     r"with the fused steps, value by value; closest to its bar: a logit \S+ apart \(its bar \S+\), "
                     r"a K/V value", flat)


def test_compare_has_one_column_per_setting_with_entropies(tiny_llama: Path) -> None:
    settings = ("temperature=0.2,seed=1", "temperature=1.0,top_p=0.9,seed=1", "top_k=3,seed=1")
    text = run_trace(tiny_llama, "the cat", SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True),
                     compare=settings)
    header = next(line for line in text.splitlines() if "step" in line)
    assert all(s in header for s in settings)
    rows = [line for line in text.splitlines() if re.match(r"^\s+\d+ ", line)]
    assert len(rows) == 4
    for row in rows:
        assert len(re.findall(r"H \d+\.\d\d->\d+\.\d\d", row)) == 3


def test_compare_entropies_follow_the_settings(llama_llm: object) -> None:
    base = SamplingParams(max_tokens=1, seed=0)
    runs = {s: run_request(llama_llm, "the cat", parse_setting(s, base), tracer=RecordingTracer())  # type: ignore
            for s in ("temperature=0.2", "temperature=1.0", "temperature=1.0,top_k=2")}
    first = {s: r.tracer.samples[0] for s, r in runs.items()}
    raw = {round(rec.entropy_raw, 6) for rec in first.values()}
    assert len(raw) == 1  # same prompt, same model: the same raw distribution
    assert first["temperature=0.2"].entropy_final < first["temperature=1.0"].entropy_final
    assert first["temperature=1.0"].entropy_final == pytest.approx(first["temperature=1.0"].entropy_raw, abs=1e-4)
    assert first["temperature=1.0,top_k=2"].num_kept == 2 and first["temperature=1.0,top_k=2"].entropy_final <= 1


@pytest.mark.parametrize("setting", ["temp=0.5", "temperature", "temperature=hot", "top_k=1.5", "top_p=2", ""])
def test_bad_compare_settings_are_refused(setting: str) -> None:
    with pytest.raises(NextokenError):
        parse_setting(setting, SamplingParams())


def test_command_line_errors_are_one_line(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["--compare", "top_q=1"], ["--compare", "temperature=1", "--html", "x.html"], ["--top", "0"]):
        assert cli.main(["trace", "hi", "--model", str(tiny_llama), *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("nextoken: error:") and err.count("\n") == 1


def test_trace_on_the_default_model() -> None:
    # One thread: the report's sections are checked here, not speed, and a shared two-core machine stalls
    # oversubscribed OpenMP threads.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "nextoken", "trace", "--max-tokens", "4",
                          "What is the capital of France?"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    ref = next(p for p in load_reference("smollm2", "hf.json")["prompts"] if p["id"] == "chat_capital")
    tokens = re.findall(r"^\s+\d+ │\s+(\d+) │", text[:text.index("2. Embedding")], flags=re.M)
    assert [int(t) for t in tokens] == ref["hf_ids"]  # the tokenization table: transformers' ids
    assert "The capital of France" in text  # the reference greedy continuation's first 4 tokens
    assert "2 x 30 layers x 3 kv heads x 64 head dim x 4 bytes = 46,080 B" in text
    assert "same tokens as the untraced run: yes" in text
    assert "GFLOP/s" in text and "of peak" in text

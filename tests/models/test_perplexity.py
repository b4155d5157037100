"""`perplexity` on the packaged models against transformers' (tests/data/perplexity_reference.json, written by
scripts/perplexity_reference.py from the same GGUF files), with the default formats, in three window settings: within
1e-3 relative. The command line gives the same figure."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import DATA, REAL_MODELS, real_llm

TEXT = DATA / "perplexity.txt"
REFERENCE = json.loads((DATA / "perplexity_reference.json").read_text())


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_perplexity_matches_transformers(model: str) -> None:
    llm = real_llm(model, "auto")
    ref = REFERENCE[REAL_MODELS[model]]
    text = TEXT.read_text(encoding="utf-8")
    for setting, want in ref["windows"].items():
        context, stride = map(int, setting.split("/"))
        got = llm.perplexity(text, context=context, stride=stride)
        assert got.tokens == ref["tokens"] and got.scored == want["scored"]
        assert abs(got.value / want["perplexity"] - 1) < 1e-3, (setting, got.value, want["perplexity"])


def test_the_command_prints_it() -> None:
    out = subprocess.run([sys.executable, "-m", "nextoken", "perplexity", str(TEXT), "--context", "256", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    want = REFERENCE["smollm2-135m-instruct"]["windows"]["256/128"]
    assert result["scored"] == want["scored"] and abs(result["perplexity"] / want["perplexity"] - 1) < 1e-3

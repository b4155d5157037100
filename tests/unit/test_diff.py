"""nextoken diff (nextoken/diff.py): a deliberately perturbed weight is found at its layer, two runs in the same
settings differ nowhere, the first divergent token's margins are the two runs' own logits, and the command's
errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.cli import main
from nextoken.diff import ROUNDING, compare_runs, diff, teacher_forced

PROMPT = "the cat sat on the mat"


def make(model: Path) -> LLM:
    return LLM(str(model), weights="fp32", device="cpu", kv_cache_bytes=8 << 20)


@pytest.mark.parametrize("layer", [0, 1])
def test_a_perturbed_weight_is_found_at_its_layer(tiny_llama: Path, layer: int) -> None:
    a, b = make(tiny_llama), make(tiny_llama)
    with torch.no_grad():
        b.engine.runner.model.layers[layer].mlp.down_proj.weight[3, 5] += 0.5
    _, ids = a.render_chat([{"role": "user", "content": PROMPT}])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens_a = a.generate([ids], params)[0].token_ids
    tokens_b = b.generate([ids], params)[0].token_ids
    report = compare_runs(a, b, ids, tokens_a, tokens_b)
    assert report.first_layer == layer
    assert all(d.relative == 0 for d in report.layers[:layer + 1])  # the embedding and the blocks before: the same
    assert report.layers[layer + 1].relative > ROUNDING
    same = compare_runs(a, make(tiny_llama), ids, tokens_a, tokens_a)
    assert same.first_layer is None and same.first_divergence is None and max(same.kl) == 0 and same.top1 == 1.0


def test_the_margins_at_the_first_divergence_are_each_runs_logits(tiny_llama: Path) -> None:
    a, b = make(tiny_llama), make(tiny_llama)
    _, ids = a.render_chat([{"role": "user", "content": PROMPT}])
    tokens_a = a.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].token_ids
    tokens_b = tokens_a[:2] + [(tokens_a[2] + 1) % 250] + tokens_a[3:]  # as if B had drawn another token at step 2
    report = compare_runs(a, b, ids, tokens_a, tokens_b)
    assert report.first_divergence == 2
    logits, hidden = teacher_forced(a, ids + tokens_a)
    row = len(ids) - 1 + 2
    assert report.margin_a == pytest.approx(float(logits[row, tokens_a[2]] - logits[row, tokens_b[2]]))
    assert report.margin_a == report.margin_b and report.margin_a >= 0  # the same model, greedy: A's is its argmax
    assert len(hidden) == len(a.engine.runner.model.layers) + 1


def test_the_command_on_records(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "a.json"
    assert main(["run", "--model", str(tiny_llama), "--weights", "fp32", "--device", "cpu", "--max-tokens", "6",
                 "--raw", "--record", str(record), PROMPT]) == 0
    capsys.readouterr()
    assert main(["diff", str(record), str(record)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("same tokens: both runs generated the same 6 tokens") and "within 1e-05" in out
    assert main(["diff", str(record), "--weights", "int8"]) in (0, 1)
    out = capsys.readouterr().out
    assert "hidden states part at layer 0" in out  # int8 projections: the first block already differs
    assert main(["diff", str(record)]) == 2
    assert "needs a second record or a setting" in capsys.readouterr().err
    other = json.loads(record.read_text())
    other["prompt"]["ids"] = other["prompt"]["ids"][:-1]
    (tmp_path / "b.json").write_text(json.dumps(other))
    assert main(["diff", str(record), str(tmp_path / "b.json")]) == 2
    assert "different prompts" in capsys.readouterr().err
    report, _ = diff(str(record), model=None, overrides={"kv_dtype": "int8"})
    assert report.first_layer is not None and report.first_layer >= 0  # the cache's int8 values: a block reads them

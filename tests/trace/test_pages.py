"""The glass box's pages (trace/pages.py) for diff, check and the engine view, written by the commands on the tiny
model and read back from headless Chromium's DOM: their tables hold the reports' figures, row for row."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nextoken.cli import main
from tests.trace.test_html import run_chromium

PROMPT = "the cat sat on the mat"


def dom(page: Path, tmp_path: Path) -> str:
    result = run_chromium(page, tmp_path, "--dump-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "<script" not in result.stdout and "http" not in result.stdout.replace("http-equiv", "")
    return result.stdout


def rows(text: str) -> list[list[str]]:
    return [[re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr>(.*?)</tr>", text, re.S)]


def test_the_diff_page(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "a.json"
    assert main(["run", "--model", str(tiny_llama), "--weights", "fp32", "--device", "cpu", "--max-tokens", "5",
                 "--raw", "--record", str(record), PROMPT]) == 0
    page = tmp_path / "diff.html"
    main(["diff", str(record), "--weights", "int8", "--html", str(page)])
    out = capsys.readouterr().out
    text = dom(page, tmp_path)
    layer_rows = [r for r in rows(text) if r and (r[0] == "embedding" or r[0].isdigit()) and len(r) == 3]
    printed = re.search(r"per layer, max relative difference: (.*)", out).group(1)  # type: ignore[union-attr]
    assert len(layer_rows) == len(printed.split(", ")) and layer_rows[0][0] == "embedding"
    position_rows = [r for r in rows(text) if len(r) == 6]
    assert len(position_rows) == 5 and all(r[4] in ("yes", "no") for r in position_rows)
    assert text.count('class="bar"') == len(layer_rows) + 5


def test_the_check_page(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "check.html"
    args = ["check", "--model", str(tiny_llama), "--continuation", "3", "--formats", "default", "weights=int8"]
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert main([*args, "--html", str(page)]) == 0
    table = [r for r in rows(dom(page, tmp_path)) if len(r) == 7]
    assert [r[0] for r in table] == ["default", "weights=int8"]
    for r, f in zip(table, data["formats"]):
        assert r[2] == f"{f['top1_agreement']:.2%}" and float(r[3]) == pytest.approx(f["mean_kl"], rel=1e-3)


def test_the_engine_page(tiny_llama: Path, tmp_path: Path) -> None:
    page = tmp_path / "engine.html"
    assert main(["trace", "--model", str(tiny_llama), "--device", "cpu", "--max-tokens", "4", "--engine", "3",
                 "--html", str(page), PROMPT]) == 0
    text = dom(page, tmp_path)
    steps = [r for r in rows(text) if len(r) == 6]
    assert steps and steps[0][2].startswith("A prefill 0-") and "A arrives" in steps[0][3]
    maps = re.findall(r'<span class="map">(.*?)</span>', text)
    assert maps and all(set(m) <= set("ABC*.") for m in maps) and "A" in maps[0]


def test_the_replay_page(tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    record = tmp_path / "a.json"
    assert main(["run", "--model", str(tiny_llama), "--weights", "fp32", "--device", "cpu", "--max-tokens", "5",
                 "--raw", "--record", str(record), PROMPT]) == 0
    data = json.loads(record.read_text())
    data["steps"][3]["token"] = (data["steps"][3]["token"] + 1) % 200  # as if the record had drawn another
    record.write_text(json.dumps(data))
    page = tmp_path / "replay.html"
    assert main(["replay", str(record), "--html", str(page)]) == 1
    capsys.readouterr()
    table = [r for r in rows(dom(page, tmp_path)) if len(r) == 6]
    assert [r[5] for r in table] == ["yes", "yes", "yes", "no", "yes"] and table[3][3].endswith("≠")
    assert "differs at step 3" in dom(page, tmp_path)

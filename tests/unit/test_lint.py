"""The code is ruff and mypy clean (STYLE.md), by the versions pinned in pyproject's test extra and its settings:
a finding fails the suite with the tool's own report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    result = run("ruff", "check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]


def test_mypy_finds_nothing_in_the_package(tmp_path: Path) -> None:
    result = run("mypy", "--cache-dir", str(tmp_path / "mypy"), "nextoken")
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout

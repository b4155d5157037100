"""The parser fuzz targets in CI: each runs under atheris for a bounded number of inputs or seconds (a fixed
libFuzzer seed; a subprocess, since atheris takes over the process it runs in). A crash writes its input, which
fails the test; the long runs are benchmarks/fuzz_parsers.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nextoken.loader.gguf import read_gguf
from tests.fuzz.targets import TARGETS, seeds

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 12  # per target; coverage-guided runs find the shallow crashes within seconds
RUNS = {"gguf": 3000, "template": 3000, "request": 20000}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz_target_survives_a_bounded_run(target: str, tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "fuzz_parsers.py"), "--target", target, "--seed", "1",
           "--runs", str(RUNS[target]), "--minutes", str(BUDGET_S / 60), "--artifacts", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=BUDGET_S + 60,
                          env={**os.environ, "NEXTOKEN_NATIVE": "0"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Done " in proc.stderr and "stat::number_of_executed_units" in proc.stderr
    assert not list(tmp_path.glob(f"{target}-*")), "a crashing input was written"


def test_gguf_seeds_are_valid_files(tmp_path: Path) -> None:
    for i, data in enumerate(seeds("gguf", tmp_path)):
        (tmp_path / f"{i}.gguf").write_bytes(data)
        assert read_gguf(tmp_path / f"{i}.gguf").tensors

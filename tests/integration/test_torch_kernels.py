"""The engine, reference and server tests again with the native kernels switched off (NEXTOKEN_NATIVE=0), in a child
process: torch's kernels then take every op, as on a machine without a C compiler, and must give the references'
answers through the same engine and server. Tests of what only the native kernels do are skipped there
(tests/conftest.py: needs_native)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITES = ["tests/unit/test_engine.py", "tests/models/test_reference.py", "tests/server/test_api.py"]


def test_engine_reference_and_server_tests_pass_on_torch_kernels() -> None:
    env = {**os.environ, "NEXTOKEN_NATIVE": "0"}
    probe = subprocess.run([sys.executable, "-c", "from nextoken.ops import native; print(native.library())"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip() == "None", probe.stderr[-3000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SUITES], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=2400)
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and " passed" in proc.stdout, report

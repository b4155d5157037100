"""OpenMP's waiting workers: importing nextoken sets libgomp's spin (GOMP_SPINCOUNT, nextoken/__init__.py) before
torch loads it, keeps a value the user set, and the workers then sleep between parallel regions instead of spinning
for milliseconds (the CPU time an idle process burns, against libgomp's own default in the same test)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import nextoken

# Ten parallel regions, each followed by 20 ms of sleep; prints the CPU time the process used while it slept.
IDLE = """
import time
import nextoken, torch
torch.set_num_threads(2)
x = torch.ones(1 << 22)
idle = 0.0
for _ in range(10):
    x.sum()
    start = time.process_time(); time.sleep(0.02); idle += time.process_time() - start
print(idle)
"""


def run(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | env
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_import_sets_the_spin_and_keeps_the_users() -> None:
    show = "import nextoken, os; print(os.environ['GOMP_SPINCOUNT'])"
    assert run(show) == nextoken.SPIN_ROUNDS
    assert run(show, GOMP_SPINCOUNT="12345") == "12345"


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs for a waiting worker")
def test_idle_workers_sleep_instead_of_spinning() -> None:
    for _ in range(3):  # a spinning worker on a loaded machine gets less of a CPU: both again until the control spins
        ours = float(run(IDLE))
        libgomp = float(run(IDLE, GOMP_SPINCOUNT="300000"))  # libgomp's own default
        if libgomp > 0.02:
            break
    print(f"CPU time while idle: {ours * 1e3:.1f} ms with nextoken's spin, {libgomp * 1e3:.1f} ms with libgomp's")
    assert libgomp > 0.02  # its workers spun (the measurement sees spinning here)
    assert ours < libgomp / 4

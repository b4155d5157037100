"""The native kernels under AddressSanitizer and UndefinedBehaviorSanitizer: the kernel tests (test_native.py), the
generated shapes and block contents (test_native_fuzz.py), the draw on every build (test_draw_routes.py) and the
grammar's mask fill (test_grammar.py) run again in a child process whose every build of the kernels is instrumented
(NEXTOKEN_NATIVE_SANITIZE=1, see ops/native SANITIZE_FLAGS) with the sanitizers' runtimes preloaded. Any out-of-bounds access, use after free or undefined
behaviour aborts the child with a report, which fails this test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def runtime(name: str) -> str:
    compiler = os.environ.get("CC") or "gcc"
    path = subprocess.run([compiler, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    assert os.path.isabs(path) and os.path.exists(path), f"{compiler} has no {name} (needed for the sanitizers)"
    return path


def test_kernels_under_address_and_undefined_behaviour_sanitizers() -> None:
    env = {**os.environ, "NEXTOKEN_NATIVE_SANITIZE": "1", "ASAN_OPTIONS": "detect_leaks=0",
           "UBSAN_OPTIONS": "print_stacktrace=1", "LD_PRELOAD": f"{runtime('libasan.so')} {runtime('libubsan.so')}"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/unit/test_native_fuzz.py",
           "tests/unit/test_native.py", "tests/unit/test_draw_routes.py",
           "tests/unit/test_grammar.py::test_the_native_mask_fill_equals_the_bits_expanded"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    report = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, report
    assert proc.returncode == 0 and " passed" in proc.stdout, report
    # the child's kernels were the instrumented ones
    probe = subprocess.run([sys.executable, "-c", "from nextoken.ops import native; import ctypes; "
                            "lib = native.library(); print(hasattr(lib, '__asan_init'))"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip() == "True", probe.stderr[-3000:]


def test_kernels_compile_without_warnings() -> None:
    """Every unit of the kernels is warning-free under -Wall -Wextra, for the host's instruction sets, for AVX2
    without AVX-512 and for plain x86-64."""
    from nextoken.ops import native

    compiler = os.environ.get("CC") or "gcc"
    for target in (["-march=native"], ["-march=native", "-mno-avx512f"], ["-mno-avx2", "-mno-fma", "-mno-f16c"]):
        for source in native.SOURCES:
            proc = subprocess.run([compiler, "-fsyntax-only", *native.WARNINGS, "-fopenmp", "-std=c11", *target,
                                   str(source)], capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-4000:]

"""Building the kernels: every unit (*.c beside this file, behind nt.h) compiled for this machine's instruction set and
linked into one shared library in the cache directory, keyed by the sources, the flags, the compiler and the CPU.

The library is built at first use, not at install: `-march=native` makes code for the CPU it runs on (AVX2 on one
machine, AVX-512 VNNI on the next) with no dispatch inside the kernels and no variants to ship, and a machine's one
build (tens of seconds, the units compiled in parallel) is cached for every later process. A wheel with prebuilt
variants per instruction set would save that first build but need a dispatcher and a build matrix; machines without
a compiler keep torch's kernels either way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nextoken import config

logger = logging.getLogger("nextoken.native")

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.c"))
# Warnings are errors: a unit that warns does not build. A compiler that warns where the tested ones do not gets a
# second build without -Werror (logged), rather than no kernels.
WARNINGS = ["-Wall", "-Wextra", "-Werror"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-fvisibility=hidden", *WARNINGS]
# Tests only: the AVX-512 routes on any x86-64 CPU (emulate512.h; SIMDe's headers, Debian's libsimde-dev), and the
# AMX route beside them (emulate_amx.h), off until nt_amx(1). -O1: the emulated intrinsics take minutes to compile
# at -O3. For AVX2 (x86-64-v3) whatever the host: an intrinsic SIMDe
# lacks, which the compiler's own header then supplies, fails the build on every machine, not only on those without
# AVX-512 (where a host with it would compile the real instruction).
EMULATED_AVX512_FLAGS = ["-O1", "-march=x86-64-v3", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-fvisibility=hidden",
                         "-DNT_EMULATE_AVX512", "-DNT_EMULATE_AMX"]
# With NEXTOKEN_NATIVE_SANITIZE=1 every build adds these (and optimizes at -O1): AddressSanitizer and
# UndefinedBehaviorSanitizer, any report fatal. The process must preload their runtimes (Python is not built with
# them): LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)", and
# ASAN_OPTIONS=detect_leaks=0 (the interpreter's own allocations are never freed). tests/unit/test_sanitized.py.
# The emulated AVX-512 build stays as it is: SIMDe's intrinsics under AddressSanitizer take minutes to compile.
SANITIZE_FLAGS = ["-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
# Flags one unit takes on top of every build's. The sampler's draw computes its weights by separately rounded fp64
# operations, the same on every build and in torch: no multiply and add may fuse there, whatever the compiler's
# default (gcc's -std=c11 already implies it; clang and gnu modes contract).
UNIT_FLAGS = {"sampling.c": ["-ffp-contract=off"]}


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return flags


def compiler() -> str:
    """The C compiler: $CC, else cc or gcc. Raises RuntimeError where there is none."""
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise RuntimeError("no C compiler found (cc or gcc; or set CC)")
    return found


def _compile(cc: str, flags: list[str], sources: list[Path], out: Path) -> None:
    """Each source to an object beside `out`, in parallel, then all of them linked into `out`. Raises RuntimeError
    with the compiler's message."""
    def run(cmd: list[str], what: str) -> None:
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed on {what}: {result.stderr.strip()[-2000:]}")

    objects = [out.with_name(f"{source.stem}.o") for source in sources]
    with ThreadPoolExecutor(max_workers=min(len(sources), os.cpu_count() or 1)) as pool:
        for job in [pool.submit(run, [cc, *flags, *UNIT_FLAGS.get(s.name, []), "-c", str(s), "-o", str(o)], s.name)
                    for s, o in zip(sources, objects)]:
            job.result()
    run([cc, *flags, *map(str, objects), "-o", str(out), "-lm"], "linking")


def build(sources: Path | list[Path] | None = None, flags: list[str] | None = None,
          cache_dir: Path | None = None) -> Path:
    """Compile `sources` (default: every unit) into a shared library, once per sources, headers, flags, compiler and
    CPU, and return its path. Raises RuntimeError naming what failed."""
    sources = SOURCES if sources is None else [sources] if isinstance(sources, Path) else list(sources)
    flags = FLAGS if flags is None else flags
    if os.environ.get("NEXTOKEN_NATIVE_SANITIZE") == "1" and "-DNT_EMULATE_AVX512" not in flags:
        flags = [f for f in flags if not f.startswith("-O")] + ["-O1", *SANITIZE_FLAGS]
    cc = compiler()
    headers = sorted({h for s in sources for h in s.parent.glob("*.h")})
    text = b"\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in [*sources, *headers])
    key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), repr(sorted(UNIT_FLAGS.items())).encode(),
                                      cc.encode(), _cpu_key().encode()]))
    root = cache_dir or config.cache_dir()
    target = root / "native" / f"{sources[0].parent.name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent first uses never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        try:
            _compile(cc, flags, sources, out)
        except RuntimeError as exc:
            if "-Werror" not in flags or "[-Werror" not in str(exc):
                raise
            logger.warning("native kernels warn under %s; building without -Werror: %s", cc, str(exc)[-500:])
            _compile(cc, [f for f in flags if f != "-Werror"], sources, out)
        os.replace(out, target)
    return target

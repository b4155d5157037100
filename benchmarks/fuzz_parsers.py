"""Coverage-guided fuzzing (atheris, libFuzzer) of one parser target from tests/fuzz/targets.py: gguf, template
or request. Runs in this process until `--runs` inputs or `--minutes` have passed; a crash (an exception that is
not nextoken's own), an input slower than `--timeout` seconds or a process above `--rss-mb` MiB stops it with a
non-zero exit and the input saved under `--artifacts`.

    NEXTOKEN_NATIVE=0 python benchmarks/fuzz_parsers.py --target gguf --minutes 30
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

# libFuzzer's memory limit reads the process's peak RSS (getrusage), which Linux carries across exec from the process
# that started this one: started by a large process (a test worker holding models), a run would be held to that
# process's size and stop at once. Such a run starts again as a child of its own, whose count begins at its own size.
FRESH = "NEXTOKEN_FUZZ_FRESH_RSS"
if __name__ == "__main__" and FRESH not in os.environ and resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 256 << 10:
    sys.exit(subprocess.call([sys.executable, *sys.argv], env={**os.environ, FRESH: "1"}))

import atheris  # noqa: E402 - after the restart above, which needs none of it

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

with atheris.instrument_imports(include=["nextoken", "jinja2"]):
    from tests.fuzz.targets import TARGETS, dictionary, seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, choices=sorted(TARGETS))
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long")
    parser.add_argument("--runs", type=int, default=None, help="stop after this many inputs")
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer's random seed (fixed: repeatable runs)")
    parser.add_argument("--timeout", type=int, default=10, help="seconds one input may take")
    parser.add_argument("--rss-mb", type=int, default=2048, help="memory limit of the whole process")
    parser.add_argument("--corpus", type=Path, default=None, help="keep the corpus here (default: a temp dir)")
    parser.add_argument("--artifacts", type=Path, default=Path("."), help="where crashing inputs are written")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix=f"fuzz-{args.target}-"))
    corpus = args.corpus or workdir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    args.artifacts.mkdir(parents=True, exist_ok=True)  # libFuzzer writes there but does not make it
    for i, data in enumerate(seeds(args.target, workdir)):
        (corpus / f"seed-{i}").write_bytes(data)
    words = workdir / "words.dict"
    words.write_text("".join(_dict_entry(word) for word in dictionary(args.target)))
    max_len = 1 << 20 if args.target == "gguf" else 1 << 14
    flags = [f"-seed={args.seed}", f"-timeout={args.timeout}", f"-rss_limit_mb={args.rss_mb}",
             f"-max_len={max_len}", f"-artifact_prefix={args.artifacts}/{args.target}-", "-print_final_stats=1",
             f"-dict={words}"]
    if args.runs is not None:
        flags.append(f"-runs={args.runs}")
    if args.minutes is not None:
        flags.append(f"-max_total_time={int(args.minutes * 60)}")
    atheris.Setup([sys.argv[0], *flags, str(corpus)], TARGETS[args.target])
    atheris.Fuzz()


def _dict_entry(word: bytes) -> str:
    """One libFuzzer dictionary line: the word in quotes, every byte hex-escaped."""
    return '"' + "".join(f"\\x{b:02x}" for b in word) + '"\n'


if __name__ == "__main__":
    main()

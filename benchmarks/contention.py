"""Decode beside another busy process: batch-1 decode tok/s of a model alone and with a second process decoding on
the same CPUs, under nextoken's OpenMP spin setting (GOMP_SPINCOUNT, nextoken/__init__.py) and under libgomp's own
default, each setting in processes of its own (one alone, a pair beside each other), all loaded at once and taking turns
generation by generation.

    python -m benchmarks.contention [--model smollm2-135m-instruct] [--rounds 5] [--steps 64] [--spins N ...]

Two processes sharing the cores can at best each run at about half the speed of one alone; the ratio "alone /
beside" says how far from that each setting lands (2.0 is a fair share, more is time lost to threads waiting on
threads that are not running).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from benchmarks.common import describe_machine, save

LIBGOMP_DEFAULT = "300000"  # libgomp's GOMP_SPINCOUNT where OMP_WAIT_POLICY is unset

CHILD = """
import sys
from nextoken import LLM, SamplingParams
llm = LLM({model!r}, kv_cache_bytes=64 << 20)
params = SamplingParams(temperature=0, max_tokens={steps} + 1, ignore_eos=True)
prompt = "Write a long story about a lighthouse keeper."
llm.generate([prompt], params, use_tqdm=False)
print("ready", flush=True)
for _ in sys.stdin:
    print(llm.generate([prompt], params, use_tqdm=False)[0].timings["decode_tokens_per_s"], flush=True)
"""


class Decoder:
    """A process holding the model loaded and warm, which decodes `steps` tokens each time it is told to."""

    def __init__(self, model: str, spin: str, steps: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD.format(model=model, steps=steps)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "GOMP_SPINCOUNT": spin})
        if self.read() != "ready":
            raise SystemExit("a decoding process failed to load its model")

    def read(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def start(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def decode_together(decoders: list[Decoder]) -> list[float]:
    """Each decoder's tok/s, all of them decoding at the same time."""
    for d in decoders:
        d.start()
    return [float(d.read()) for d in decoders]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--spins", nargs="*", default=[], help="more GOMP_SPINCOUNT values to compare")
    args = parser.parse_args()
    import nextoken

    print(describe_machine())
    settings = {"nextoken": nextoken.SPIN_ROUNDS, "libgomp default": LIBGOMP_DEFAULT,
                **{f"candidate {v}": v for v in args.spins if v not in (nextoken.SPIN_ROUNDS, LIBGOMP_DEFAULT)}}
    alone: dict[str, list[float]] = {name: [] for name in settings}
    beside: dict[str, list[float]] = {name: [] for name in settings}
    started = time.perf_counter()
    # Every process loaded at once and idle between turns, the settings taking turns generation by generation, so
    # that the machine's drift in speed falls on all of them alike.
    solo = {name: Decoder(args.model, spin, args.steps) for name, spin in settings.items()}
    pairs = {name: [Decoder(args.model, spin, args.steps) for _ in range(2)] for name, spin in settings.items()}
    for _ in range(args.rounds):
        for name in settings:
            alone[name] += decode_together([solo[name]])
            beside[name] += decode_together(pairs[name])
    for d in [*solo.values(), *(d for pair in pairs.values() for d in pair)]:
        d.close()
    print(f"{args.model}, batch-1 decode tok/s, medians of {args.rounds} rounds ({time.perf_counter() - started:.0f} s)")
    results = {}
    for name, spin in settings.items():
        a, b = statistics.median(alone[name]), statistics.median(beside[name])
        results[name] = {"spin": int(spin), "alone": a, "beside_another": b, "alone_over_beside": a / b}
        print(f"  GOMP_SPINCOUNT={spin:>7} ({name}): alone {a:6.1f}, beside another {b:6.1f}  (alone / beside "
              f"{a / b:.2f}x)")
    ours, theirs = results["nextoken"], results["libgomp default"]
    print(f"  nextoken's setting / libgomp's: alone {ours['alone'] / theirs['alone']:.2f}x, beside another "
          f"{ours['beside_another'] / theirs['beside_another']:.2f}x")
    print(f"saved {save('contention', {'model': args.model, 'steps': args.steps, 'results': results})}")


if __name__ == "__main__":
    main()

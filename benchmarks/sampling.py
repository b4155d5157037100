"""The sampler's draws: the native call (nt_sample_rows) against the torch route, on random logits of the packaged
models' vocabulary sizes, for one row and for a batch, per filter setting.

Run: .venv/bin/python -m benchmarks.sampling [--rows 1 64] [--repeats 5]
Each figure is the median of `repeats` calls, the two routes taking turns; the ratio is torch's time over the
native one's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from nextoken.engine.sampler import Sampler, SamplingRow
from nextoken.sampling_params import SamplingParams

VOCABULARIES = {"smollm2": 49_152, "gemma3": 262_144}
SETTINGS = {"temperature 1": SamplingParams(temperature=1.0),
            "t 0.7, top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
            "t 0.7, top-k 40": SamplingParams(temperature=0.7, top_k=40),
            "t 0.8, min-p 0.05": SamplingParams(temperature=0.8, min_p=0.05)}


def time_draws(sampler: Sampler, logits: torch.Tensor, params: SamplingParams) -> float:
    rows = [SamplingRow(params, None, [], []) for _ in range(logits.shape[0])]
    start = time.perf_counter()
    sampler(logits, rows)
    return time.perf_counter() - start


def measure(vocab: int, rows: int, params: SamplingParams, repeats: int) -> dict[str, float]:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    routes = {"native": Sampler(native_draws=True), "torch": Sampler(native_draws=False)}
    times: dict[str, list[float]] = {name: [] for name in routes}
    for name, sampler in routes.items():
        time_draws(sampler, logits, params)  # warm-up
    for _ in range(repeats):
        for name, sampler in routes.items():
            times[name].append(time_draws(sampler, logits, params))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'vocabulary':>10} {'rows':>4} {'setting':18} {'native ms':>9} {'torch ms':>9} {'ratio':>6}")
    for model, vocab in VOCABULARIES.items():
        for rows in args.rows:
            for setting, params in SETTINGS.items():
                m = measure(vocab, rows, params, args.repeats)
                print(f"{vocab:>10} {rows:>4} {setting:18} {m['native'] * 1e3:9.2f} {m['torch'] * 1e3:9.2f} "
                      f"{m['torch'] / m['native']:5.1f}x   ({model})")


if __name__ == "__main__":
    main()

"""Model load time: file parse + weights (fp32, bf16, and int4: the CPU default) + tokenizer, per model, and what a
fresh process pays for `LLM(model)` (what `nextoken run` and `nextoken serve` wait for).

Run: .venv/bin/python benchmarks/load.py [--repeats N]
The parts are medians of N loads in this process (its first load also pays for the page cache and fresh memory, so
one warm-up load is discarded). "fresh process" is the median of N new processes, each timing `LLM(model)` after
importing torch and nextoken (that import, timed apart, is torch's own). The anchor is transformers loading the
same GGUF.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.common import ANCHORS, describe_machine, median_time, save, versus
from nextoken.engine.model_loader import load_model
from nextoken.loader.gguf import read_gguf
from nextoken.loader.registry import resolve_model
from nextoken.models.config import ModelConfig
from nextoken.tokenizer.tokenizer import Tokenizer


FRESH = """
import time
t0 = time.perf_counter()
import torch
from nextoken import LLM
t1 = time.perf_counter()
llm = LLM({name!r}, device="cpu")  # kept: freeing it is not part of the load
print(t1 - t0, time.perf_counter() - t1)
"""


def fresh_process(name: str, repeats: int) -> tuple[float, float]:
    """(median import seconds, median LLM() seconds) over `repeats` new processes."""
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, "-c", FRESH.format(name=name)], capture_output=True, text=True,
                             check=True)
        runs.append(tuple(float(v) for v in out.stdout.split()[-2:]))
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("models", nargs="*", default=list(ANCHORS))
    args = parser.parse_args()
    print(describe_machine())
    results = {}
    print(f"{'model':24} {'dtype':9} {'parse':>7} {'weights':>8} {'tokenizer':>9} {'total':>7}  anchors")
    for name in args.models:
        path = resolve_model(name)
        # fp32, bf16, and the CPU default: the file's blocks for decode (int4) with the int8 head, beside fp32.
        for key, dtype, quant in (("fp32", torch.float32, None), ("bf16", torch.bfloat16, None),
                                  ("int4", torch.float32, "int4")):
            parts: dict[str, float] = {}

            def load() -> None:
                t0 = time.perf_counter()
                gguf = read_gguf(path)
                config = ModelConfig.from_gguf(gguf)
                t1 = time.perf_counter()
                load_model(gguf, config, dtype=dtype, quant=quant, quantize_head=quant is not None)
                t2 = time.perf_counter()
                Tokenizer.from_gguf(gguf.metadata)
                t3 = time.perf_counter()
                parts.update(parse=t1 - t0, weights=t2 - t1, tokenizer=t3 - t2)

            total = median_time(load, repeats=args.repeats)
            anchor = {k: v for k, v in ANCHORS[name]["load_s"].items() if ("bf16" if key == "bf16" else "fp32") in k}
            print(f"{name:24} {key:9} {parts['parse']:7.2f} {parts['weights']:8.2f} {parts['tokenizer']:9.2f} "
                  f"{total:7.2f}  {versus(total, anchor, higher_is_better=False)}")
            results[f"{name}/{key}"] = {"total_s": total, **{f"{k}_s": v for k, v in parts.items()}}
        imports, fresh = fresh_process(name, args.repeats)
        anchor = {k: v for k, v in ANCHORS[name]["load_s"].items() if "fp32" in k}
        print(f"{name:24} {'fresh process, LLM() (default formats)':44} {fresh:7.2f}  {versus(fresh, anchor, False)}; "
              f"importing torch and nextoken before it {imports:.2f}")
        results[f"{name}/fresh_process"] = {"total_s": fresh, "import_s": imports}
    print(f"saved {save('load', results)}")


if __name__ == "__main__":
    main()

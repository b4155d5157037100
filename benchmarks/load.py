"""Model load time: file parse + weights (fp32, bf16, and int4: the CPU default) + tokenizer, per model.

Run: .venv/bin/python benchmarks/load.py [--repeats N]
Each figure is the median of N loads in this process (the first load of a run also pays for the page cache and fresh
memory, so one warm-up load is discarded). The anchor is transformers loading the same GGUF.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import ANCHORS, median_time, save, versus
from nextoken.loader.gguf import read_gguf
from nextoken.loader.registry import resolve_model
from nextoken.models import load_model
from nextoken.models.config import ModelConfig
from nextoken.tokenizer.tokenizer import Tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("models", nargs="*", default=list(ANCHORS))
    args = parser.parse_args()
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
    print(f"saved {save('load', results)}")


if __name__ == "__main__":
    main()

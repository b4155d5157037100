"""Per-op profile of decode steps: where one step's time goes, op by op.

Run: .venv/bin/python -m benchmarks.profile_decode [--model M] [--weights int4] [--batch 1] [--steps 32]
     [--save benchmarks/profiles/NAME.txt]

A prompt of 128 tokens per sequence is prefilled first, then `steps` engine steps of pure decode (every sequence
adds one token) run under torch.profiler. Printed: the wall time per step, the number of ops per step, and the ops
by self CPU time. The whole engine step is profiled (batch building, forward, sampling), since that is what a
user waits for.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.latency import prompt_ids
from benchmarks.common import describe_machine
from nextoken import LLM, SamplingParams


def run(model: str, weights: str, batch: int, steps: int, kv_dtype: str) -> str:
    llm = LLM(model, weights=weights, kv_dtype=kv_dtype, device="cpu", enable_prefix_caching=False)
    llm.engine.runner.settle()  # the weights on huge pages before any timing
    engine = llm.engine
    ids = prompt_ids(llm, 128 + batch)
    params = SamplingParams(temperature=0, max_tokens=steps * 3 + 8, ignore_eos=True)
    for b in range(batch):
        engine.add_request(ids[b:b + 128], params)
    while any(len(r.output_ids) < 2 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(steps):  # warm-up: caches, allocator, lazy tables
        engine.step()
    running = len(engine.scheduler.running)
    if running != batch:
        raise SystemExit(f"only {running} of {batch} sequences fit the KV cache: the step would not be batch {batch}")
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    events = prof.key_averages()
    ops = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=48)
    header = (f"{model}, weights {llm.engine.runner.weights}, KV {llm.engine.runner.kv_dtype}, batch {batch}, "
              f"context ~{128 + steps * 3}: {wall * 1e3:.1f} ms per step without the profiler, "
              f"{batch / wall:.1f} tok/s; {ops:.0f} aten ops per step (profiled over {steps} steps)\n")
    return header + table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--kv-dtype", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--save", type=Path)
    args = parser.parse_args()
    print(describe_machine())
    torch.set_num_threads(min(2, torch.get_num_threads()))
    report = run(args.model, args.weights, args.batch, args.steps, args.kv_dtype)
    print(report)
    if args.save:
        args.save.parent.mkdir(parents=True, exist_ok=True)
        args.save.write_text(report)
        print(f"saved {args.save}")


if __name__ == "__main__":
    main()

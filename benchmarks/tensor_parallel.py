"""Tensor parallelism against one process, in one run: per-token decode latency at batch 1 and the prefill time of a
512-token prompt, for 1 and 2 ranks (the machine's threads shared between them), and the bytes the all-reduces move.

Run: .venv/bin/python -m benchmarks.tensor_parallel [--models smollm2-135m-instruct gemma-3-270m] [--repeats 3]

Three routes per model, in the CPU's default formats: one process as it runs by default (the fused native decode
step), one process through the torch modules (the path the ranks run, fused calls off: the fair baseline), and two
ranks on loopback. Then a gloo all-reduce of one token's hidden state between two processes on loopback, timed alone.

Bytes: each block does 2 all-reduces of [tokens, hidden] fp32, so a token moves a payload of P = layers x 2 x hidden x 4
bytes through all-reduces; a ring all-reduce sends 2 (N - 1) / N x P bytes from each rank (N = 2: P). The step's inputs,
broadcast from rank 0 first, are a few int64 per token and sequence besides.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import save
from benchmarks.latency import prompt_ids
from nextoken import LLM, SamplingParams
from nextoken.parallel.shard import RowParallel

KV_BYTES = 64 << 20
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def cpu() -> str:
    """The CPU's model name, logical CPUs and the vector flags that choose the kernels."""
    name, flags, count = "unknown CPU", set(), 0
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name, count = line.split(":", 1)[1].strip(), count + 1
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    return f"{name}, {count} logical CPUs, flags: {' '.join(f for f in FLAGS if f in flags) or 'none of ' + str(FLAGS)}"


class AllReduceClock:
    """Rank 0's time inside the all-reduces of its row-parallel projections, and their count."""

    def __init__(self, llm: LLM) -> None:
        self.seconds, self.calls = 0.0, 0
        for module in llm.engine.runner.model.modules():
            if isinstance(module, RowParallel):
                module.all_reduce = self.timed(module.all_reduce)

    def timed(self, all_reduce: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def run(x: torch.Tensor) -> None:
            start = time.perf_counter()
            all_reduce(x)
            self.seconds += time.perf_counter() - start
            self.calls += 1
        return run


def rate(timings: dict[str, float | None], key: str) -> float:
    value = timings[key]
    assert value is not None, f"no {key} in {timings}"
    return value


def measure(llm: LLM, repeats: int) -> dict[str, float | list[int]]:
    """Decode ms per token at batch 1 (128 tokens after a 64-token prompt) and prefill ms of a 512-token prompt,
    medians of `repeats`; the first run warms up."""
    short, long = prompt_ids(llm, 64), prompt_ids(llm, 512)
    decode = SamplingParams(temperature=0, max_tokens=129, ignore_eos=True)
    prefill = SamplingParams(temperature=0, max_tokens=1)
    rates: list[float] = []
    prefills: list[float] = []
    tokens: list[int] = []
    for _ in range(repeats + 1):
        out = llm.generate([short], decode, use_tqdm=False)[0]
        rates.append(rate(out.timings, "decode_tokens_per_s"))
        tokens = out.token_ids
        prefills.append(rate(llm.generate([long], prefill, use_tqdm=False)[0].timings, "prefill_tokens_per_s"))
    return {"decode_ms_per_token": 1000 / statistics.median(rates[1:]),
            "prefill_512_ms": 512 * 1000 / statistics.median(prefills[1:]), "tokens": tokens}


ALL_REDUCE = textwrap.dedent("""
    import datetime, os, sys, time, torch, torch.distributed as dist
    rank, port, numel, count = (int(v) for v in sys.argv[1:5])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=60))
    gloo = dist.ProcessGroupGloo
    opts = gloo._Options()
    opts._devices = [gloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=60)
    pg = gloo(store, rank, 2, opts)
    x = torch.ones(numel)
    for _ in range(100):
        pg.allreduce([x]).wait()
    start = time.perf_counter()
    for _ in range(count):
        pg.allreduce([x]).wait()
    if rank == 0:
        print((time.perf_counter() - start) / count * 1e6, flush=True)
    os._exit(0)  # no teardown of the group racing the peer's
""")


def all_reduce_us(hidden: int, count: int = 2000) -> float:
    """Microseconds of one gloo all-reduce of `hidden` fp32 values between two processes on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [str(port), str(hidden), str(count)]
    peer = subprocess.Popen([sys.executable, "-c", ALL_REDUCE, "1", *args])
    out = subprocess.run([sys.executable, "-c", ALL_REDUCE, "0", *args], capture_output=True, text=True, check=True)
    peer.wait()
    return float(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(cpu())
    results: dict[str, dict] = {"cpu": {"name": cpu()}}
    for model in args.models:
        rows: dict[str, dict] = {}
        one = LLM(model, kv_cache_bytes=KV_BYTES, enable_prefix_caching=False)  # repeats time every token
        cfg = one.model_config
        rows["1 rank, fused (default)"] = measure(one, args.repeats)
        one.engine.runner.settle()  # the huge-page move rebuilds the fused path: done before it is taken off
        one.engine.runner.model.fused = None
        rows["1 rank, modules"] = measure(one, args.repeats)
        one.close()
        del one
        two = LLM(model, kv_cache_bytes=KV_BYTES, tensor_parallel=2, enable_prefix_caching=False)
        rows["2 ranks"] = measure(two, args.repeats)
        clock = AllReduceClock(two)  # one more decode run, its all-reduces timed on rank 0
        decoded = two.generate([prompt_ids(two, 64)], SamplingParams(temperature=0, max_tokens=129, ignore_eos=True),
                               use_tqdm=False)[0]
        step_ms = 1000 / rate(decoded.timings, "decode_tokens_per_s")
        in_reduce_ms = clock.seconds * 1000 / clock.calls * 2 * cfg.num_layers  # per step, prefill's calls included
        two.close()
        del two
        payload = cfg.num_layers * 2 * cfg.hidden_size * 4
        per_rank = payload * 2 * (2 - 1) / 2
        us = all_reduce_us(cfg.hidden_size)
        same = len({tuple(r["tokens"]) for r in rows.values()}) == 1
        print(f"\n{model} ({cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} query heads, "
              f"{cfg.num_kv_heads} KV heads; "
              f"greedy tokens {'identical' if same else 'DIFFER'} across routes)")
        base = rows["1 rank, modules"]
        for name, r in rows.items():
            print(f"  {name:24s} decode {r['decode_ms_per_token']:6.2f} ms/token "
                  f"({r['decode_ms_per_token'] / base['decode_ms_per_token']:.2f}x modules)   "
                  f"prefill 512 {r['prefill_512_ms']:7.1f} ms ({r['prefill_512_ms'] / base['prefill_512_ms']:.2f}x)")
        print(f"  all-reduce payload per token: {payload} B ({2 * cfg.num_layers} all-reduces of {cfg.hidden_size * 4} "
              f"B); sent per rank with a ring, N = 2: {per_rank:.0f} B")
        print(f"  one {cfg.hidden_size * 4}-byte gloo all-reduce on loopback, alone: {us:.1f} us; "
              f"x {2 * cfg.num_layers} per decode step = {us * 2 * cfg.num_layers / 1000:.2f} ms")
        print(f"  2 ranks, in a decode run: {in_reduce_ms:.1f} ms of a {step_ms:.1f} ms step in rank 0's all-reduces "
              f"(waiting for rank 1 included)")
        results[model] = {"routes": {k: {m: v for m, v in r.items() if m != "tokens"} for k, r in rows.items()},
                          "allreduce_payload_bytes_per_token": payload, "sent_per_rank_bytes_per_token": per_rank,
                          "allreduce_us": us, "tokens_identical": same, "step_ms": step_ms,
                          "allreduce_ms_per_step": in_reduce_ms}
    print(f"\nsaved {save('tensor_parallel', results)}")


if __name__ == "__main__":
    main()

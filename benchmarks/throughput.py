"""Serving throughput: many requests batched by the engine, against the same requests run one by one.

Run: .venv/bin/python -m benchmarks.throughput [--weights auto|fp32|bf16|int8|int4] [--kv-dtype auto|fp32|bf16|int8]
     [--num-requests N] [--quick] [--seed S] [--transformers PYTHON [--turns N]]

Two fixed-seed workloads on one LLM (prefix cache on, as served):
  uniform  N requests of 128 prompt + 128 output tokens (greedy, ignore_eos), prompts cut from the reference texts
           at distinct offsets (like llama-batched-bench -npp 128 -ntg 128 -npl N; the "cached" column shows any
           prompt tokens they still happen to share).
  chat     N chat-template prompts of mixed lengths (one shared system prompt, user turns of 10 to 1,200
           characters), 16 to 192 output tokens each, seeded sampling (temperature 0.7, top-p 0.9, ignore_eos).
Each runs batched (all requests added at once) and then one by one in the same process (a subset when that would
take too long; its totals are scaled to N and the output says so), each from a cold prefix cache. Reported per run:
output tokens/s over the wall time; the decode-phase rate (output tokens drawn after the step that gave the last
request its first token, over the time since: the figure the anchors measure); time to first token p50/p99 (from
when the request was added: all at once when batched, so it includes queueing); time per output token p50/p99. The
anchors' aggregate-decode figures (ANCHORS.md) are printed beside the batched decode rate with ratios; with
--transformers PYTHON (a Python that has transformers, gguf and accelerate), so is transformers' batched decode on the same file,
measured in the same run (benchmarks/transformers_baseline.py).
With --turns N (and --transformers), only the uniform workload's batched decode: ours, with the default formats and
with int8 activations, and transformers bf16's, taking turns N rounds (see turns): the ratios to use on a machine
whose speed drifts.
JSON: benchmarks/results/throughput.json (one entry per model/dtype/workload size, earlier entries kept).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import ANCHORS as COMMON_ANCHORS
from benchmarks.common import TransformersWorker, default_and_int8, describe_machine, transformers_baseline
from nextoken import LLM, SamplingParams
from nextoken.engine.request import Request

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_PROMPTS = ROOT / "tests" / "data" / "reference" / "smollm2" / "hf.json"
RESULTS = Path(__file__).resolve().parent / "results" / "throughput.json"

# Aggregate decode tokens/s of B sequences x 128 new tokens, by B (benchmarks/common.py: ANCHORS.md's machine and
# the AVX2 machine's rows).
ANCHORS: dict[str, dict[int, dict[str, float]]] = {
    model: {int(key.removeprefix("decode_")): row for key, row in rows.items() if key.startswith("decode_")}
    for model, rows in COMMON_ANCHORS.items()}
SYSTEM_PROMPT = ("You are a helpful assistant. Answer the user's question accurately and concisely, and say so "
                 "when you do not know the answer.")


@dataclass
class Spec:
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class RunResult:
    mode: str  # "batched" | "one by one"
    num_requests: int  # requests actually run
    num_of: int  # requests in the workload (more than num_requests when one by one ran a subset)
    wall_s: float
    num_output_tokens: int
    output_tok_s: float
    decode_tok_s: float | None
    ttft_s: tuple[float, float]  # p50, p99
    tpot_ms: tuple[float, float]  # p50, p99
    num_preemptions: int
    num_cached_prompt_tokens: int

    @property
    def scaled_wall_s(self) -> float:
        return self.wall_s * self.num_of / self.num_requests


def percentiles(values: list[float]) -> tuple[float, float]:
    """p50 and p99 (linear interpolation; with few values p99 is close to the maximum)."""
    if len(values) == 1:
        return values[0], values[0]
    q = statistics.quantiles(values, n=100, method="inclusive")
    return statistics.median(values), q[98]


def text_pool() -> str:
    """The reference prompts and their continuations, mixed scripts (English, Chinese, code, emoji, numbers)."""
    prompts = json.loads(REFERENCE_PROMPTS.read_text("utf-8"))["prompts"]
    parts = [p.get("text") or p.get("greedy_text", "") for p in prompts] + [p["greedy_text"] for p in prompts]
    return "\n".join(parts)


def uniform_workload(llm: LLM, num: int, prompt_len: int, output_len: int, rng: random.Random) -> list[Spec]:
    text = llm.tokenizer.encode(text_pool(), add_special_tokens=False)
    stream = text * -(-(len(text) + prompt_len) // len(text))  # long enough for a window from any offset
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    offsets = rng.sample(range(len(text)), num)
    return [Spec(stream[o:o + prompt_len], params) for o in offsets]


def chat_workload(llm: LLM, num: int, rng: random.Random, seed: int, max_output: int) -> list[Spec]:
    pool = text_pool()
    specs = []
    for i in range(num):
        num_chars = int(min(1200, max(10, rng.lognormvariate(5.0, 0.9))))  # median ~150 characters
        start = rng.randrange(len(pool) - num_chars)
        messages = [{"role": "system", "content": SYSTEM_PROMPT},
                    {"role": "user", "content": pool[start:start + num_chars]}]
        _, ids = llm.render_chat(messages)
        max_tokens = min(max_output, rng.choice([16, 32, 64, 96, 128, 192]))
        specs.append(Spec(ids, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=max_tokens, seed=seed + i,
                                              ignore_eos=True)))
    return specs


def run(llm: LLM, specs: list[Spec], mode: str, num_of: int) -> RunResult:
    """Add every spec at once and step until all finish (one by one: one spec at a time, back to back)."""
    engine = llm.engine
    preemptions_before = engine.scheduler.num_preemptions
    groups = [specs] if mode == "batched" else [[s] for s in specs]
    done: list[Request] = []
    steps: list[tuple[float, int, int]] = []  # per step: when it ended, tokens drawn, first tokens among them
    start = time.perf_counter()
    for group in groups:
        for spec in group:
            engine.add_request(spec.prompt_ids, spec.params)
        while engine.has_unfinished():
            outputs = engine.step()
            steps.append((time.perf_counter(), len(outputs), sum(o.num_output_tokens == 1 for o in outputs)))
            for out in outputs:
                if out.finished and out.request is not None:
                    done.append(out.request)
    wall = time.perf_counter() - start
    num_out = sum(len(r.output_ids) for r in done)
    ttft = [r.timings.first_token - r.timings.arrival for r in done if r.timings.first_token]
    tpot = [(r.timings.finished - r.timings.first_token) / (len(r.output_ids) - 1) * 1e3
            for r in done if r.timings.finished and r.timings.first_token and len(r.output_ids) > 1]
    decode_rate = None
    if mode == "batched":
        # The decode phase: the steps after the one that drew the last request's first token.
        last = max(i for i, (_, _, num_first) in enumerate(steps) if num_first)
        after = sum(num for _, num, _ in steps[last + 1:])
        decode_s = steps[-1][0] - steps[last][0]
        decode_rate = after / decode_s if decode_s > 0 else None
    else:
        decode_s = sum(r.timings.finished - r.timings.first_token for r in done)
        decode_rate = sum(len(r.output_ids) - 1 for r in done) / decode_s if decode_s > 0 else None
    return RunResult(mode, len(specs), num_of, wall, num_out, num_out / wall, decode_rate, percentiles(ttft),
                     percentiles(tpot), engine.scheduler.num_preemptions - preemptions_before,
                     sum(r.timings.num_cached_prompt_tokens for r in done))


def nearest_anchor(model: str, batch: int) -> tuple[int, dict[str, float]] | None:
    table = ANCHORS.get(model)
    if not table:
        return None
    size = min(table, key=lambda b: abs(math.log(b / batch)))
    return size, table[size]


def print_table(name: str, results: list[RunResult]) -> None:
    print(f"\n{name}")
    print(f"  {'mode':12} {'requests':>9} {'wall s':>8} {'out tok/s':>10} {'decode tok/s':>13} "
          f"{'TTFT p50/p99 s':>16} {'TPOT p50/p99 ms':>16} {'cached':>7} {'preempt':>8}")
    for r in results:
        reqs = f"{r.num_requests}" if r.num_requests == r.num_of else f"{r.num_requests} of {r.num_of}"
        decode = f"{r.decode_tok_s:.1f}" if r.decode_tok_s else "-"
        print(f"  {r.mode:12} {reqs:>9} {r.wall_s:8.1f} {r.output_tok_s:10.1f} {decode:>13} "
              f"{r.ttft_s[0]:7.2f}/{r.ttft_s[1]:<7.2f} {r.tpot_ms[0]:7.1f}/{r.tpot_ms[1]:<7.1f} "
              f"{r.num_cached_prompt_tokens:7d} {r.num_preemptions:8d}")
    batched = next(r for r in results if r.mode == "batched")
    serial = next((r for r in results if r.mode == "one by one"), None)
    if serial is not None:
        note = "" if serial.num_requests == serial.num_of else \
            f" (one by one ran {serial.num_requests} of {serial.num_of}; its wall time scaled to all: " \
            f"{serial.scaled_wall_s:.0f} s)"
        print(f"  batched vs one by one: {batched.output_tok_s / serial.output_tok_s:.1f}x output tok/s, "
              f"{serial.scaled_wall_s / batched.wall_s:.1f}x less wall time{note}")


def print_anchors(model: str, dtype: str, batched: RunResult, serial: RunResult | None,
                  this_run: dict[str, float] | None = None) -> None:
    found = nearest_anchor(model, batched.num_requests)
    if found is None or batched.decode_tok_s is None:
        return
    size, anchors = found
    if this_run:
        anchors = {**this_run, **anchors}
    print(f"\nanchors (ANCHORS.md, 2026-11-29; the AVX2 rows: benchmarks/common.py): aggregate decode, {size} "
          f"sequences x 128 tokens, tok/s; ours = uniform batched decode phase, {batched.num_requests} sequences, "
          f"{dtype}")
    for name, value in anchors.items():
        print(f"  {name:24} {value:7.1f}   ours {batched.decode_tok_s:7.1f}   {batched.decode_tok_s / value:5.2f}x")
    single = ANCHORS[model].get(1)
    if serial is not None and serial.decode_tok_s and single:
        print(f"anchors: decode, batch 1, tok/s; ours = uniform one by one, {dtype}")
        for name, value in single.items():
            print(f"  {name:24} {value:7.1f}   ours {serial.decode_tok_s:7.1f}   {serial.decode_tok_s / value:5.2f}x")


def save(key: str, payload: dict) -> Path:
    RESULTS.parent.mkdir(exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    data[key] = payload
    RESULTS.write_text(json.dumps(data, indent=2))
    return RESULTS


def turns(model: str, rounds: int, python: str, num: int, output_len: int, kv_cache_mib: int) -> dict[str, float]:
    """Aggregate decode taking turns with transformers bf16, `rounds` times: each round its batched decode (`num`
    sequences x `output_len` greedy steps after 128-token prompts; the model loaded once, see TransformersWorker),
    then ours on the uniform workload, batched, with the default formats and again with int8 activations. On a
    machine whose speed drifts from minute to minute, the ratio of neighbours in time is the fair one: each round's
    figures are printed, then the medians of the per-round ratios."""
    llms = default_and_int8(model, device="cpu", kv_cache_bytes=kv_cache_mib << 20)
    specs = uniform_workload(llms["default"], num, 128, output_len, random.Random(0))
    for llm in llms.values():
        run(llm, [Spec(s.prompt_ids[:32], SamplingParams(temperature=0, max_tokens=4)) for s in specs[:2]],
            "batched", 2)  # warm-up
    rows: list[dict[str, float]] = []
    with TransformersWorker(python, model, torch.get_num_threads()) as worker:
        for i in range(rounds):
            row = {"transformers bf16": worker.tok_s("bf16", batch=num, steps=output_len)}
            for label, llm in llms.items():
                llm.engine.block_manager.reset_prefix_cache()
                result = run(llm, specs, "batched", num)
                row[label] = result.decode_tok_s or 0.0
            rows.append(row)
            print(f"  round {i + 1}: aggregate decode tok/s, " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
    ratios = {f"{label} / transformers bf16": statistics.median(r[label] / r["transformers bf16"] for r in rows)
              for label in llms}
    print(f"{model}, {num} sequences, taking turns ({rounds} rounds), medians of the per-round ratios:")
    for key, ratio in ratios.items():
        print(f"  {key}: {ratio:.2f}x")
    return {**{key: statistics.median(r[key] for r in rows) for key in rows[0]}, **ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--weights", choices=["auto", "fp32", "bf16", "int8", "int4"], default="auto")
    parser.add_argument("--kv-dtype", choices=["auto", "fp32", "bf16", "int8"], default="auto")
    parser.add_argument("--activations", choices=["int16", "int8"], default="int16",
                        help="how block weights meet the activations in batches of 12 or more (int8: faster)")
    parser.add_argument("--num-requests", type=int, default=None, help="requests per workload (default 64, quick 16)")
    parser.add_argument("--one-by-one", type=int, default=None,
                        help="how many of them to run one by one (default 8, quick 2; totals are scaled)")
    parser.add_argument("--quick", action="store_true", help="16 requests, 32 output tokens, 2 one by one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-mib", type=int, default=768)
    parser.add_argument("--transformers", metavar="PYTHON",
                        help="a Python with transformers, gguf and accelerate: its batched decode (bf16 and fp32, as many "
                             "sequences x 128 prompt + the output tokens) on the same file in this run")
    parser.add_argument("--turns", type=int, default=0,
                        help="with --transformers: only the uniform batched decode, ours (default and int8 "
                             "activations) and transformers bf16 taking turns N rounds")
    args = parser.parse_args()
    print(describe_machine())
    num = args.num_requests or (16 if args.quick else 64)
    num_serial = min(num, args.one_by_one or (2 if args.quick else 8))
    output_len = 32 if args.quick else 128
    if args.turns:
        if not args.transformers:
            parser.error("--turns needs --transformers")
        result = turns(args.model, args.turns, args.transformers, num, output_len, args.kv_cache_mib)
        print(f"\nsaved {save(f'{args.model}/turns/{num}x{output_len}', result)}")
        return

    start = time.perf_counter()
    llm = LLM(args.model, weights=args.weights, kv_dtype=args.kv_dtype, activations=args.activations, device="cpu",
              kv_cache_bytes=args.kv_cache_mib << 20)
    load_s = time.perf_counter() - start
    llm.engine.runner.settle()  # the weights on huge pages before any timing
    fmt = f"weights {llm.engine.runner.weights}, KV {llm.engine.runner.kv_dtype}, activations {args.activations}"
    bm = llm.engine.block_manager
    print(f"nextoken throughput: {args.model}, {fmt}, cpu, {torch.get_num_threads()} threads, seed {args.seed}, "
          f"KV pool {bm.num_blocks * bm.block_size} tokens, load {load_s:.1f} s"
          + (" [quick: 16 requests x 32 output tokens]" if args.quick and not args.num_requests else ""))
    warmup = [Spec(s.prompt_ids[:32], SamplingParams(temperature=0, max_tokens=4)) for s in
              uniform_workload(llm, 2, 128, 4, random.Random(-1))]
    run(llm, warmup, "batched", 2)

    rng = random.Random(args.seed)
    workloads = {
        f"uniform: {num} x ({128} prompt + {output_len} output) tokens, greedy":
            uniform_workload(llm, num, 128, output_len, rng),
        f"chat: {num} mixed-length chat prompts, 16-{min(192, output_len * 3 // 2)} output tokens, seeded sampling":
            chat_workload(llm, num, rng, args.seed, max(16, output_len * 3 // 2)),
    }
    payload: dict = {"model": args.model, "format": fmt, "threads": torch.get_num_threads(),
                     "seed": args.seed, "quick": args.quick, "load_s": load_s, "workloads": {}}
    first_results: list[RunResult] = []
    for name, specs in workloads.items():
        bm.reset_prefix_cache()  # every run starts with a cold cache: the batched run must not warm the serial one
        batched = run(llm, specs, "batched", num)
        bm.reset_prefix_cache()
        serial = run(llm, specs[:num_serial], "one by one", num)
        results = [batched, serial]
        print_table(name, results)
        bm.check_integrity(expected_refs={})
        payload["workloads"][name] = {
            "prompt_tokens": [len(s.prompt_ids) for s in specs],
            "runs": [{**r.__dict__, "scaled_wall_s": r.scaled_wall_s} for r in results]}
        first_results = first_results or results
    this_run = None
    if args.transformers:
        theirs = transformers_baseline(args.transformers, args.model, torch.get_num_threads(), batch=num,
                                       batch_steps=output_len)
        this_run = {f"transformers {dtype} this run": r[f"decode_{num}"] for dtype, r in theirs.items()}
        payload["transformers"] = theirs
    print_anchors(args.model, fmt, first_results[0], first_results[1], this_run)
    key = f"{args.model}/{llm.engine.runner.weights}/{llm.engine.runner.kv_dtype}/{num}x{output_len}"
    key += "/int8-activations" if args.activations == "int8" else ""
    print(f"\nsaved {save(key, payload)} [{key}]")


if __name__ == "__main__":
    main()

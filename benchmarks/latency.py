"""Single-request latency: prefill tokens/s (one 512-token prompt) and decode tokens/s (128 tokens, batch 1).

Run: .venv/bin/python -m benchmarks.latency [--weights fp32 bf16 int8 int4] [--kv-dtypes fp32 bf16 int8]
     [--models ...] [--repeats N] [--llama-bench PATH] [--transformers PYTHON] [--turns N]
Both go through the engine exactly as a user's request does. Prefill is timed from scheduling to the first token (one
forward pass over 512 tokens plus sampling); decode from the first token to the 128th, twice: after that 512-token
prompt, and from an empty context (a one-token prompt), which is what llama-bench's tg128 measures. Medians of N runs,
the prefix cache off so every run computes its whole prompt. Printed beside ANCHORS.md's figures with ratios; the
first weight format (fp32) is the in-run baseline for the others, block formats run again with int8 activation codes
(`activations="int8"`). With --llama-bench (a llama-bench binary the user built), llama.cpp runs on the same GGUF file
in the same run (`-p 512 -n 128`, the machine's thread count) and the ratios to it are printed too. Then each KV cache
format with the default weights: decode tok/s over the same 512-token context, and how many tokens a 1 GiB pool holds.
With --turns N, only the default formats (and again with int8 activations) and the baselines given (llama.cpp,
transformers bf16's prefill), taking turns N times (see head_to_head): the ratios to use on a machine whose speed
drifts. With --transformers (a Python that has transformers, gguf and accelerate), transformers
fp32 and bf16 run on the same file in the same run too (benchmarks/transformers_baseline.py) and the ratios to them
are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import (ANCHORS, TransformersWorker, default_and_int8, describe_machine, save,
                               transformers_baseline, versus)
from nextoken import LLM, SamplingParams
from nextoken.loader.registry import resolve_model

TEXTS = Path(__file__).parent.parent / "tests" / "data" / "reference" / "prompts.json"


def prompt_ids(llm: LLM, length: int) -> list[int]:
    texts = [p.get("text") or p["messages"][-1]["content"] for p in json.loads(TEXTS.read_text())["prompts"]]
    ids: list[int] = []
    while len(ids) < length:
        for text in texts:
            ids.extend(llm.tokenizer.encode(text, add_special_tokens=False))
    return ids[:length]


def measure(llm: LLM, repeats: int, prompt_len: int = 512, decode_len: int = 128) -> dict[str, float]:
    ids = prompt_ids(llm, prompt_len)
    params = SamplingParams(temperature=0, max_tokens=decode_len, ignore_eos=True)
    llm.engine.runner.settle()  # the weights on huge pages before any timing (runner.HugePageMove)
    llm.generate(ids[:64], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    # From an empty context: the prompt's one token is the first decode step; then decode_len more.
    empty = SamplingParams(temperature=0, max_tokens=decode_len + 1, ignore_eos=True)
    prefill, decode, ttft, decode_empty = [], [], [], []
    for _ in range(repeats):
        out = llm.generate(ids, params, use_tqdm=False)[0]
        assert len(out.token_ids) == decode_len
        prefill.append(out.timings["prefill_tokens_per_s"])
        decode.append(out.timings["decode_tokens_per_s"])
        ttft.append(out.timings["time_to_first_token_s"])
        decode_empty.append(llm.generate(ids[:1], empty, use_tqdm=False)[0].timings["decode_tokens_per_s"])
    return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "decode_empty_tok_s": statistics.median(decode_empty), "ttft_s": statistics.median(ttft)}


def llama_bench(binary: str, model: str, threads: int, repeats: int = 3, prompt: int = 512) -> dict[str, float]:
    """llama.cpp's pp512 (none where `prompt` is 0) and tg128 (tok/s, mean of `repeats`) on the same file, from its
    JSON output."""
    cmd = [binary, "-m", str(resolve_model(model)), "-p", str(prompt), "-n", "128", "-t", str(threads), "-r",
           str(repeats), "-o", "json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {result.stderr.strip()[-500:]}")
    figures = {}
    for test in json.loads(result.stdout):
        key = "prefill_512" if test["n_prompt"] and not test["n_gen"] else "decode_1" if test["n_gen"] else None
        if key:
            figures[key] = round(float(test["avg_ts"]), 1)
    return figures


def head_to_head(model: str, rounds: int, binary: str | None, transformers: str | None, prompt_len: int = 512,
                 decode_len: int = 128) -> dict[str, float]:
    """nextoken taking turns with the baselines, `rounds` times. Each round: one llama-bench run (pp512, tg128) where
    a binary is given; transformers bf16's prefill of 512 tokens where a Python is given (loaded once: see
    TransformersWorker); then ours (prefill 512, decode from an empty context) with the default formats, and again
    with int8 activations; every other round in the reverse order. On a machine whose speed drifts from minute to
    minute, the ratio of neighbours in time is the fair one: each round's figures are printed, then the medians of
    the per-round ratios."""
    llms = default_and_int8(model, device="cpu", enable_prefix_caching=False, kv_cache_bytes=256 << 20)
    for llm in llms.values():
        measure(llm, 1, prompt_len, decode_len)  # warm-up
    threads = torch.get_num_threads()
    worker = TransformersWorker(transformers, model, threads) if transformers else None
    rows: list[dict[str, float]] = []
    def llama_cpp(row: dict[str, float]) -> None:
        theirs = llama_bench(binary, model, threads, repeats=1)  # type: ignore[arg-type]
        row["llama.cpp prefill"], row["llama.cpp decode"] = theirs["prefill_512"], theirs["decode_1"]

    def transformers_bf16(row: dict[str, float]) -> None:
        row["transformers bf16 prefill"] = worker.tok_s("bf16", prefill=prompt_len)  # type: ignore[union-attr]

    def nextoken(label: str, llm: LLM) -> Callable[[dict[str, float]], None]:
        def run(row: dict[str, float]) -> None:
            ours = measure(llm, 1, prompt_len, decode_len)
            row[f"{label} prefill"], row[f"{label} decode"] = ours["prefill_tok_s"], ours["decode_empty_tok_s"]
        return run

    # Every other round runs in the reverse order: what runs right after a heavy neighbour (llama-bench's own
    # threads, say) may find the machine slower for a while, and no one should always be the one after.
    turns = ([llama_cpp] if binary else []) + ([transformers_bf16] if worker else [])
    turns += [nextoken(label, llm) for label, llm in llms.items()]
    try:
        for i in range(rounds):
            row: dict[str, float] = {}
            for turn in turns if i % 2 == 0 else turns[::-1]:
                turn(row)
            rows.append(row)
            print(f"  round {i + 1}: " + ", ".join(f"{key} {value:.1f}" for key, value in row.items()))
    finally:
        if worker:
            worker.close()
    ratios = {}
    for label in llms:
        for base in ("llama.cpp decode", "llama.cpp prefill", "transformers bf16 prefill", "default prefill"):
            what = base.rsplit(" ", 1)[1]
            if base in rows[0] and base != f"{label} {what}":
                ratios[f"{label} {what} / {base}"] = statistics.median(r[f"{label} {what}"] / r[base] for r in rows)
    print(f"{model} taking turns ({rounds} rounds), medians of the per-round ratios:")
    for key, ratio in ratios.items():
        print(f"  {key}: {ratio:.2f}x")
    return {**{key: statistics.median(r[key] for r in rows) for key in rows[0]}, **ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=list(ANCHORS))
    parser.add_argument("--weights", nargs="*", default=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--kv-dtypes", nargs="*", default=["fp32", "bf16", "int8"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-bench", help="a llama-bench binary: run llama.cpp on the same file in this run")
    parser.add_argument("--turns", type=int, default=0,
                        help="with --llama-bench and/or --transformers: only the default formats (and int8 "
                             "activations) and those baselines taking turns, N rounds")
    parser.add_argument("--transformers", metavar="PYTHON",
                        help="a Python with transformers, gguf and accelerate: run transformers on the same file in this run")
    args = parser.parse_args()
    print(describe_machine())
    results: dict[str, dict[str, float]] = {}
    if args.turns:
        if not args.llama_bench and not args.transformers:
            parser.error("--turns needs --llama-bench or --transformers")
        for name in args.models:
            results[f"{name}/turns"] = head_to_head(name, args.turns, args.llama_bench, args.transformers)
        print(f"saved {save('latency_turns', results)}")
        return
    for name in args.models:
        baseline: dict[str, float] | None = None
        anchors = {key: dict(value) for key, value in ANCHORS[name].items()}
        if args.llama_bench:
            measured = llama_bench(args.llama_bench, name, torch.get_num_threads())
            results[f"{name}/llama.cpp"] = measured
            print(f"{name} llama.cpp, this run: prefill 512 {measured['prefill_512']:.1f} tok/s, "
                  f"tg128 {measured['decode_1']:.1f} tok/s")
            for key, value in measured.items():
                anchors[key] = {"llama.cpp this run": value, **anchors[key]}
        if args.transformers:
            theirs = transformers_baseline(args.transformers, name, torch.get_num_threads())
            for dtype, measured in theirs.items():
                results[f"{name}/transformers {dtype}"] = measured
                print(f"{name} transformers {dtype}, this run: load {measured['load_s']:.1f} s, prefill 512 "
                      f"{measured['prefill_512']:.1f} tok/s, decode {measured['decode_1']:.1f} tok/s")
                for key in ("prefill_512", "decode_1"):
                    anchors[key] = {f"transformers {dtype} this run": measured[key], **anchors[key]}
        # Each weight format with the exact activation codes, then block formats with int8 ones (--activations int8).
        variants = [(dtype, "int16") for dtype in args.weights]
        variants += [(dtype, "int8") for dtype in args.weights if dtype in ("int4", "int8")]
        for dtype, activations in variants:
            label = dtype if activations == "int16" else f"{dtype}, int8 activations"
            try:
                llm = LLM(name, weights=dtype, activations=activations, device="cpu", enable_prefix_caching=False,
                          kv_cache_bytes=256 << 20)
            except Exception as e:  # noqa: BLE001 - a format this machine or file cannot run is reported, not fatal
                print(f"{name} {label}: skipped ({e})")
                continue
            r = measure(llm, args.repeats)
            results[f"{name}/{label}"] = r
            baseline = baseline or r
            print(f"{name} {label}")
            print(f"  prefill 512: {r['prefill_tok_s']:8.1f} tok/s   vs "
                  f"{versus(r['prefill_tok_s'], anchors['prefill_512'])}"
                  f"; {r['prefill_tok_s'] / baseline['prefill_tok_s']:.2f}x {args.weights[0]}")
            print(f"  decode   1, empty context (as tg128): {r['decode_empty_tok_s']:8.1f} tok/s   vs "
                  f"{versus(r['decode_empty_tok_s'], anchors['decode_1'])}"
                  f"; {r['decode_empty_tok_s'] / baseline['decode_empty_tok_s']:.2f}x {args.weights[0]}")
            print(f"  decode   1, after the 512-token prompt: {r['decode_tok_s']:8.1f} tok/s"
                  f"; {r['decode_tok_s'] / baseline['decode_tok_s']:.2f}x {args.weights[0]}")
            del llm
        kv_baseline: dict[str, float] | None = None
        for kv_dtype in args.kv_dtypes:
            llm = LLM(name, kv_dtype=kv_dtype, device="cpu", enable_prefix_caching=False, kv_cache_bytes=1 << 30)
            r = measure(llm, args.repeats)
            r["tokens_per_gib"] = llm.engine.runner.kv_pool.num_tokens
            results[f"{name}/kv-{kv_dtype}"] = r
            kv_baseline = kv_baseline or r
            print(f"{name} weights {llm.engine.runner.weights}, KV {kv_dtype}: decode {r['decode_tok_s']:.1f} tok/s "
                  f"({r['decode_tok_s'] / kv_baseline['decode_tok_s']:.2f}x KV {args.kv_dtypes[0]}); "
                  f"a 1 GiB pool holds {r['tokens_per_gib']:,} tokens")
            del llm
    print(f"saved {save('latency', results)}")


if __name__ == "__main__":
    main()

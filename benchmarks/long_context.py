"""Long contexts: prefill of 2,048 and 8,192 tokens, and decode at a depth of 4,096 tokens, at batch 1 with the
default formats, against llama.cpp and transformers at the same depths in the same run.

    python -m benchmarks.long_context [--models ...] [--prefill 2048 8192] [--depth 4096] [--decode 64]
        [--repeats 3] [--llama-bench PATH] [--transformers PYTHON]

nextoken's figures come from its own timings: prefill tok/s of a request of N prompt tokens (one new token; N at most
the context less one), decode tok/s of the tokens after the first of a request whose prompt is D tokens. llama.cpp
runs `llama-bench -p N -n 0` and `-n 64 -d D` on the same GGUF file; transformers (benchmarks/transformers_baseline.py, bf16) one forward pass over N
tokens and greedy steps after a D-token prompt. Prompts are the reference prompts' text repeated (random ids for the
baselines: the work per token does not depend on which).

Attention's share is estimated from how a figure moves with depth, which holds on every path (the fused native
decode step times no attention of its own apart): a decode step D deep against one 16 deep (the projections, norms
and head cost the same at both), and prefill per token at N against 256 tokens (attention grows with the length,
the rest does not).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

import torch

from benchmarks.common import TransformersWorker, describe_machine, save
from benchmarks.latency import prompt_ids
from nextoken import LLM, SamplingParams
from nextoken.loader.registry import resolve_model


def prefill_rate(llm: LLM, ids: list[int], repeats: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return statistics.median(llm.generate([ids], params, use_tqdm=False)[0].timings["prefill_tokens_per_s"]
                             for _ in range(repeats))


def decode_rate(llm: LLM, ids: list[int], steps: int, repeats: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    return statistics.median(llm.generate([ids], params, use_tqdm=False)[0].timings["decode_tokens_per_s"]
                             for _ in range(repeats))


def llama_bench(binary: str, model: str, threads: int, prefill: list[int], depth: int, steps: int
                ) -> dict[str, float]:
    """llama.cpp's pp N for each prefill length and tg `steps` at `depth` (tok/s), from its JSON output."""
    figures: dict[str, float] = {}
    for args in (["-p", ",".join(map(str, prefill)), "-n", "0"], ["-p", "0", "-n", str(steps), "-d", str(depth)]):
        cmd = [binary, "-m", str(resolve_model(model)), *args, "-t", str(threads), "-r", "2", "-o", "json"]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if result.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {result.stderr.strip()[-500:]}")
        for test in json.loads(result.stdout):
            key = f"prefill_{test['n_prompt']}" if not test["n_gen"] else f"decode_at_{test.get('n_depth', 0)}"
            figures[key] = round(float(test["avg_ts"]), 1)
    return figures


def measure(model: str, lengths: list[int], depth: int, steps: int, repeats: int) -> dict[str, float]:
    # No prefix cache: a repeat would find the prompt's blocks cached and time only its last tokens.
    llm = LLM(model, enable_prefix_caching=False)
    llm.engine.runner.settle()
    ids = prompt_ids(llm, max(lengths + [depth]))
    llm.generate([ids[:64]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    out: dict[str, float] = {}
    for n in [256] + lengths:
        # A prompt of the whole context leaves no room for the one token a request must generate: one less there
        out[f"prefill_{n}"] = prefill_rate(llm, ids[:min(n, llm.engine.max_model_len - 1)], repeats)
    out[f"decode_at_{depth}"] = decode_rate(llm, ids[:depth], steps, repeats)
    out["decode_at_16"] = decode_rate(llm, ids[:16], steps, repeats)
    # Attention's share, from the dependence on depth (the module docstring)
    out[f"attention_share_decode_at_{depth}"] = 1 - out[f"decode_at_{depth}"] / out["decode_at_16"]
    for n in lengths:
        out[f"attention_share_prefill_{n}"] = 1 - out[f"prefill_{n}"] / out["prefill_256"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma-3-270m"])
    parser.add_argument("--prefill", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--depth", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=64, help="decode steps measured at the depth")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-bench", help="a llama-bench binary: llama.cpp at the same lengths in this run")
    parser.add_argument("--transformers", metavar="PYTHON", help="a Python with transformers: its bf16 figures")
    args = parser.parse_args()
    print(describe_machine())
    threads = torch.get_num_threads()
    results: dict[str, dict[str, dict[str, float]]] = {}
    for model in args.models:
        ours = measure(model, args.prefill, args.depth, args.decode, args.repeats)
        rows = {"nextoken": ours}
        if args.llama_bench:
            rows["llama.cpp"] = llama_bench(args.llama_bench, model, threads, args.prefill, args.depth, args.decode)
        if args.transformers:
            with TransformersWorker(args.transformers, model, threads) as worker:
                theirs = {f"prefill_{n}": worker.tok_s("bf16", prefill=n) for n in args.prefill}
                theirs[f"decode_at_{args.depth}"] = worker.tok_s("bf16", decode=args.decode, depth=args.depth)
                rows["transformers bf16"] = theirs
        results[model] = rows
        print(f"\n{model} (tok/s; ratio = nextoken / other)")
        for key in [f"prefill_{n}" for n in args.prefill] + [f"decode_at_{args.depth}"]:
            others = ", ".join(f"{name} {r[key]:.1f} ({ours[key] / r[key]:.2f}x)" for name, r in rows.items()
                               if name != "nextoken" and key in r)
            print(f"  {key:16} nextoken {ours[key]:8.1f}   {others}")
        shares = {k.removeprefix("attention_share_"): v for k, v in ours.items() if k.startswith("attention_share")}
        print("  attention's share (from the dependence on depth): " +
              ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))
    print(f"saved {save('long_context', results)}")


if __name__ == "__main__":
    main()

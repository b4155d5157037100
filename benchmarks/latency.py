"""Single-request latency: prefill tokens/s (one 512-token prompt) and decode tokens/s (128 tokens, batch 1).

Run: .venv/bin/python -m benchmarks.latency [--weights fp32 bf16 int8 int4] [--kv-dtypes fp32 bf16 int8]
     [--models ...] [--repeats N]
Both go through the engine exactly as a user's request does. Prefill is timed from scheduling to the first token
(one forward pass over 512 tokens plus sampling); decode from the first token to the 128th. Medians of N runs, the
prefix cache off so every run computes its whole prompt. Printed beside ANCHORS.md's figures with ratios; the first
weight format (fp32) is the in-run baseline for the others. Then each KV cache format with the default weights:
decode tok/s over the same 512-token context, and how many tokens a 1 GiB pool holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common import ANCHORS, save, versus
from nextoken import LLM, SamplingParams

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
    llm.generate(ids[:64], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    prefill, decode, ttft = [], [], []
    for _ in range(repeats):
        out = llm.generate(ids, params, use_tqdm=False)[0]
        assert len(out.token_ids) == decode_len
        prefill.append(out.timings["prefill_tokens_per_s"])
        decode.append(out.timings["decode_tokens_per_s"])
        ttft.append(out.timings["time_to_first_token_s"])
    return {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "ttft_s": statistics.median(ttft)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="*", default=list(ANCHORS))
    parser.add_argument("--weights", nargs="*", default=["fp32", "bf16", "int8", "int4"])
    parser.add_argument("--kv-dtypes", nargs="*", default=["fp32", "bf16", "int8"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    for name in args.models:
        baseline: dict[str, float] | None = None
        for dtype in args.weights:
            try:
                llm = LLM(name, weights=dtype, device="cpu", enable_prefix_caching=False, kv_cache_bytes=256 << 20)
            except Exception as e:  # noqa: BLE001 - a format this machine or file cannot run is reported, not fatal
                print(f"{name} {dtype}: skipped ({e})")
                continue
            r = measure(llm, args.repeats)
            results[f"{name}/{dtype}"] = r
            baseline = baseline or r
            anchors = ANCHORS[name]
            print(f"{name} {dtype}")
            print(f"  prefill 512: {r['prefill_tok_s']:8.1f} tok/s   vs {versus(r['prefill_tok_s'], anchors['prefill_512'])}"
                  f"; {r['prefill_tok_s'] / baseline['prefill_tok_s']:.2f}x {args.weights[0]}")
            print(f"  decode   1: {r['decode_tok_s']:8.1f} tok/s   vs {versus(r['decode_tok_s'], anchors['decode_1'])}"
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

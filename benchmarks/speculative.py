"""Speculative decoding against plain decoding, at batch 1: edit-style prompts (rewrite code with renamed variables,
fix a paragraph, continue a list: the answer repeats much of the prompt) and open chat (greedy, and sampled at
temperature 1 with a seed: speculation draws the same tokens, so both sides decode the same text; and at temperature
1 without one, `:t1u`, where a draft model draws its proposals from its own distribution and the target keeps them by
the rejection rule: the same distribution of texts, not the same text).

Run: .venv/bin/python -m benchmarks.speculative [--model NAME] [--dtype D] [--activations int16|int8] [--max-tokens N]
     [--repeats N] [--k K] [--speculative ngram|draft:MODEL|self:L|head:N] [--fixed] [--only ...]
One process, one model loaded twice (plain, and with `speculative=...`); each prompt runs on both, taking turns
`--repeats` times, and the medians of decode tokens/s (first token to last) are compared: the ratio is the speed-up.
`--fixed` verifies every proposal at its full length K (no adaptive k): what a proposer can give where it is kept.
Acceptance: accepted / proposed tokens; mean accepted length: accepted tokens per verifying step. The outputs of both
sides are checked identical. The CPU is named (lscpu), since whether a k-row pass costs about one row's time, which
is what speculation sells, depends on it (docs/speculative.md).
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import describe_machine
from nextoken import LLM, SamplingParams

CODE = '''def total_price(data, rate):
    result = 0
    for entry in data:
        cost = entry["price"] * entry["count"]
        if entry.get("taxable", False):
            cost = cost * (1 + rate)
        result = result + cost
    return round(result, 2)


def cheapest(data):
    best = None
    for entry in data:
        if best is None or entry["price"] < best["price"]:
            best = entry
    return best
'''

PARAGRAPH = ("The comittee met on tuesday to discus the new budjet. Their was a long debate about the libary, wich "
             "many members said was to small for the growing town. In the end they agreed to spend more money on "
             "books and less on the new parking lot, altough some members was not happy about it.")

EDIT = {
    "rename": f"Rewrite this code with the variable `data` renamed to `items` and `entry` renamed to `item`. "
              f"Reply with the code only.\n\n```python\n{CODE}```",
    "fix": f"Fix the spelling and grammar mistakes in this paragraph. Reply with the corrected paragraph only.\n\n"
           f"{PARAGRAPH}",
    "list": "Continue this list in the same format up to item 30:\n1. apple (fruit)\n2. carrot (vegetable)\n"
            "3. banana (fruit)\n4. potato (vegetable)\n5. cherry (fruit)\n6. onion (vegetable)\n",
    "json": "Convert this list to JSON: name: Alice, age: 30, city: Paris; name: Bob, age: 25, city: London; "
            "name: Carol, age: 35, city: Berlin; name: Dave, age: 40, city: Madrid",
}
OPEN = {
    "story": "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "advice": "What are some good ways to stay focused while studying at home?",
}




def decode_rate(llm: LLM, prompt: str, params: SamplingParams) -> tuple[float, list[int], dict]:
    out = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)[0]
    return out.timings["decode_tokens_per_s"] or 0.0, out.token_ids, out.timings


def cases(max_tokens: int) -> list[tuple[str, str, SamplingParams]]:
    """(name, prompt, params): the edit-style and open prompts, greedy; the open ones sampled too."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=max_tokens)
    unseeded = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    return ([(f"edit:{name}", text, greedy) for name, text in EDIT.items()]
            + [(f"open:{name}", text, greedy) for name, text in OPEN.items()]
            + [(f"open:{name}:t1", text, sampled) for name, text in OPEN.items()]
            + [(f"open:{name}:t1u", text, unseeded) for name, text in OPEN.items()])


def measure(plain: LLM, spec: LLM, name: str, text: str, params: SamplingParams, repeats: int) -> dict:
    """One prompt on both engines, taking turns `repeats` times: medians of decode tokens/s, the n-gram side's
    acceptance and mean accepted length, and whether both produced the same tokens."""
    rates: dict[str, list[float]] = {"plain": [], "ngram": []}
    proposed = accepted = steps = 0
    ids: dict[str, list[int]] = {}
    for _ in range(repeats):
        for label, llm in (("plain", plain), ("ngram", spec)):
            rate, ids[label], timings = decode_rate(llm, text, params)
            rates[label].append(rate)
            if label == "ngram":
                proposed += timings["spec_proposed_tokens"]
                accepted += timings["spec_accepted_tokens"]
                mean = timings["spec_mean_accepted"]
                steps += round(timings["spec_accepted_tokens"] / mean) if mean else 0
    a, b = statistics.median(rates["plain"]), statistics.median(rates["ngram"])
    return {"name": name, "plain_tok_s": a, "ngram_tok_s": b, "speedup": b / a if a else 0.0,
            "acceptance": accepted / proposed if proposed else 0.0, "mean_accepted": accepted / steps if steps else 0.0,
            "tokens": len(ids["ngram"]), "same": ids["plain"] == ids["ngram"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", help="auto (the CPU's default formats) or float32 (fp32 weights)")
    ap.add_argument("--activations", default="int16", choices=["int16", "int8"],
                    help="int8: both engines with int8 activation codes (verifying rows cost less)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=None, help="num_speculative_tokens (default: the engine's)")
    ap.add_argument("--speculative", default="ngram", help="the proposer: ngram, draft:MODEL, self:L or head:N")
    ap.add_argument("--fixed", action="store_true",
                    help="propose K tokens at every step (no adaptive k: the proposer's ceiling, not a setting)")
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME", help="only these prompts (e.g. edit:list)")
    args = ap.parse_args()
    plain = LLM(args.model, dtype=args.dtype, activations=args.activations)
    # The plain engine's weights on their final pages first: the speculative engine times its passes as it loads,
    # and a copy running beside them would make verifying look dearer than it is
    plain.engine.runner.settle()
    spec = LLM(args.model, dtype=args.dtype, activations=args.activations, speculative=args.speculative,
               num_speculative_tokens=args.k)
    if args.fixed and spec.engine.speculator is not None:
        spec.engine.speculator.adaptive = False
    for llm in (plain, spec):
        llm.engine.runner.settle()
        llm.chat([{"role": "user", "content": "Hello!"}], SamplingParams(temperature=0, max_tokens=16),
                 use_tqdm=False)
    print(f"{describe_machine()}")
    print(f"model: {args.model} ({plain.engine.runner.weights} weights, {plain.engine.runner.lm_head} head, "
          f"{plain.engine.runner.activations} activations), "
          f"batch 1, {args.max_tokens} tokens at most, median of {args.repeats}; {args.speculative}, K = "
          f"{spec.engine.config.max_speculative_tokens}")
    print(f"{'prompt':<16}{'plain tok/s':>12}{'spec tok/s':>12}{'speed-up':>10}{'accepted':>10}{'mean len':>10}"
          f"{'tokens':>8}")
    for name, text, params in cases(args.max_tokens):
        if args.only and name not in args.only:
            continue
        r = measure(plain, spec, name, text, params, args.repeats)
        same = "" if r["same"] or params.seed is None and not params.is_greedy else "  (output differs)"
        print(f"{name:<16}{r['plain_tok_s']:>12.1f}{r['ngram_tok_s']:>12.1f}{r['speedup']:>9.2f}x"
              f"{r['acceptance']:>10.0%}{r['mean_accepted']:>10.1f}{r['tokens']:>8}{same}")


if __name__ == "__main__":
    main()

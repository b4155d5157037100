"""How close each CPU route is to the reference: the worst teacher-forced top-5 log-probability error over the
reference prompts (transformers fp32 over the same GGUF files, tests/data/reference), and whether the greedy
continuations are the reference's, for each weight format asked for.

Run: .venv/bin/python -m benchmarks.exactness [--models smollm2 gemma3] [--weights auto fp32] [--emulated-avx512]
     [--long]
`auto` is the default formats (the file's blocks, two levels of activation codes). --emulated-avx512 runs the
AVX-512 VNNI routes on any x86-64 CPU (the kernels built with -DNT_EMULATE_AVX512: SIMDe's portable intrinsics;
slow). --long adds one prompt of about 800 tokens (the reference prompts joined, past Gemma 3's 512-token window),
scored against the fp32 route, which the tests hold to the reference.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import describe_machine
from nextoken import LLM
from nextoken.ops import native
from nextoken.sampling_params import SamplingParams
from tests.conftest import REAL_MODELS, load_reference




def worst_top5(llm: LLM, prompts: list[dict]) -> tuple[float, int]:
    """The worst |log p - reference| over every position's reference top 5, and the positions whose top 1 differs."""
    worst, flips = 0.0, 0
    for prompt in prompts:
        out = llm.generate([prompt["seq_ids"]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20),
                           use_tqdm=False)[0]
        for row, ids, lps in zip(out.prompt_logprobs, prompt["top5_ids"], prompt["top5_logprobs"]):
            mine = dict(row)
            flips += row[0][0] != ids[0]
            worst = max([worst] + [abs(mine[i] - lp) if i in mine else float("inf") for i, lp in zip(ids, lps)])
    return worst, flips


def greedy_matches(llm: LLM, prompts: list[dict]) -> tuple[int, int]:
    outs = llm.generate([p["hf_ids"] for p in prompts], SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    return sum(o.token_ids == p["greedy_ids"] for o, p in zip(outs, prompts)), len(prompts)


def long_prompt_error(llm: LLM, exact: LLM, ids: list[int]) -> float:
    """The worst top-5 log-probability difference from the fp32 route over one long prompt."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    mine = llm.generate([ids], params, use_tqdm=False)[0].prompt_logprobs
    ref = exact.generate([ids], params, use_tqdm=False)[0].prompt_logprobs
    worst = 0.0
    for a, b in zip(mine, ref):
        got = dict(a)
        worst = max([worst] + [abs(got[i] - lp) if i in got else float("inf") for i, lp in b])
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=sorted(REAL_MODELS))
    parser.add_argument("--weights", nargs="+", default=["auto"])
    parser.add_argument("--emulated-avx512", action="store_true")
    parser.add_argument("--long", action="store_true")
    args = parser.parse_args()
    if args.emulated_avx512:
        native._lib = native.load(native.build(flags=native.EMULATED_AVX512_FLAGS))
        native._tried = True
    print(f"{describe_machine()}{' (AVX-512 emulated)' if args.emulated_avx512 else ''}")
    for model in args.models:
        top5 = load_reference(model, "hf_top5.json")["prompts"]
        greedy = load_reference(model, "hf.json")["prompts"]
        long_ids = [i for p in top5 for i in p["seq_ids"][1:]][:800]
        exact = LLM(REAL_MODELS[model], weights="fp32", kv_cache_bytes=256 << 20) if args.long else None
        for weights in args.weights:
            start = time.perf_counter()
            llm = LLM(REAL_MODELS[model], weights=weights, kv_cache_bytes=256 << 20)
            worst, flips = worst_top5(llm, top5)
            same, total = greedy_matches(llm, greedy)
            line = (f"{model:8} weights={weights:5} worst top-5 error {worst:.1e}, top-1 differs at {flips} "
                    f"positions, greedy {same}/{total} identical")
            if exact is not None:
                line += f", {len(long_ids)}-token prompt vs fp32 {long_prompt_error(llm, exact, long_ids):.1e}"
            print(f"{line} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()

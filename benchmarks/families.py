"""A decode step of model families beyond the packaged ones, on each path: a Qwen2-shaped model (q/k/v biases, which
the fused native step has) and a Mixtral-shaped one (a mixture of experts, which it lacks), with random weights at a
small but real shape, written as llama.cpp writes GGUF files (tests/hf_reference.py; needs transformers, a test
dependency).

Run: .venv/bin/python -m benchmarks.families [--tokens 64] [--repeats 3]
Per family: decode tokens/s at batch 1 after a 64-token prompt, through the engine as a user's request goes, for fp32
weights on the modules (the in-run baseline), int8 blocks on the modules (the fused step switched off), and int8 blocks
with the fused step where the family's recipe allows it. Medians of `repeats` runs, the CPU named.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import describe_machine
from nextoken import LLM, SamplingParams

SHAPES = {
    "qwen2": ("qwen2", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=2, max_position_embeddings=1024)),
    "moe": ("mixtral", dict(hidden_size=512, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                            max_position_embeddings=1024)),
}




def decode_rate(llm: LLM, tokens: int, repeats: int) -> float:
    prompt = list(range(3, 67))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    rates = []
    for _ in range(repeats + 1):  # the first run warms up
        rates.append(llm.generate([prompt], params, use_tqdm=False)[0].timings["decode_tokens_per_s"])
    return statistics.median(rates[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from tests.hf_reference import build, write_gguf

    print(f"{describe_machine()}; decode tokens/s at batch 1, medians of {args.repeats}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, (name, shape) in SHAPES.items():
            path = write_gguf(build(name, **shape), name, Path(tmp) / f"{label}.gguf")
            base = decode_rate(LLM(str(path), weights="fp32", kv_dtype="fp32", device="cpu",
                                   enable_prefix_caching=False), args.tokens, args.repeats)
            int8 = LLM(str(path), weights="int8", kv_dtype="fp32", device="cpu", enable_prefix_caching=False)
            fused = int8.engine.runner.model.fused
            with_fused = decode_rate(int8, args.tokens, args.repeats) if fused is not None else None
            int8.engine.runner.model.fused = None
            modules = decode_rate(int8, args.tokens, args.repeats)
            gaps = int8.model_config.recipe.native_gaps()
            print(f"{label:6s} fp32 modules {base:7.1f}  int8 modules {modules:7.1f} ({modules / base:.2f}x)  "
                  + (f"int8 fused {with_fused:7.1f} ({with_fused / base:.2f}x)" if with_fused is not None
                     else f"int8 fused: n/a (the native step has no {', '.join(gaps)})"))
            del int8
            time.sleep(0.1)


if __name__ == "__main__":
    main()

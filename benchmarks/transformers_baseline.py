"""transformers on a GGUF file, measured the way ANCHORS.md describes: the baseline that latency.py and throughput.py
run beside nextoken (their --transformers PYTHON option) instead of quoting figures taken on another machine.

Run with a Python that has torch, transformers, gguf and accelerate (transformers loads GGUF files only with it;
nextoken's own environment does not need them):
    PYTHON benchmarks/transformers_baseline.py MODEL.gguf [--dtypes fp32 bf16] [--prefill 512] [--decode 128]
        [--batch 64] [--batch-steps 128] [--threads N]

transformers loads the GGUF dequantized into the dtype, with SDPA attention, and runs a greedy loop with its KV cache
(its generate() is slower). Figures, one JSON object on stdout keyed by dtype:
  load_s         from_pretrained, seconds;
  prefill_512    tok/s of one forward pass over a prompt of that many tokens (median of 3, after one warm-up);
  decode_1       tok/s of greedy steps of one sequence from a one-token prompt (llama-bench's tg128), median of 3;
  decode_B       tok/s over all B sequences of `batch-steps` greedy steps after a 128-token prompt each (as
                 llama-batched-bench -npp 128 -ntg N -npl B counts its generation phase), one run.
Prompts are fixed-seed random token ids: the work per token does not depend on which.

With --serve it loads each dtype once, prints {"load_s": {dtype: seconds}} as one line, then answers one JSON line per
request line on stdin, {"dtype": D, "prefill": N} or {"dtype": D, "decode": N[, "depth": D]} (median of 3 after one
warm-up), or
{"dtype": D, "batch": B, "steps": N} (decode_B, one run), with {"tok_s": X}: how latency.py and throughput.py --turns
let transformers take turns with nextoken without reloading.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# This script runs under another Python, which need not have nextoken's dependencies: it imports nothing from
# nextoken or benchmarks.common, and so keeps its own timing helper (common.median_time's warm-up and median).
def _median_time(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.inference_mode()
def _greedy(model, ids: torch.Tensor, steps: int) -> float:
    """Seconds for `steps` greedy decode steps after a prefill of `ids` (not timed)."""
    out = model(input_ids=ids, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - start


def _load(path: Path, dtype: str):  # noqa: ANN202 - a transformers model
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=DTYPES[dtype],
                                                 attn_implementation="sdpa")
    return model.eval()


def _prefill(model, tokens: int, gen: torch.Generator) -> float:
    """tok/s of one forward pass over `tokens` random ids (median of 3 after a warm-up)."""
    prompt = torch.randint(10, model.config.vocab_size, (1, tokens), generator=gen)
    with torch.inference_mode():
        return tokens / _median_time(lambda: model(input_ids=prompt, use_cache=False))


def _decode(model, steps: int, gen: torch.Generator, depth: int = 1) -> float:
    """tok/s of `steps` greedy steps of one sequence after a prompt of `depth` tokens (default one: llama-bench's
    tg; llama-bench -d's depth otherwise), median of 3 after a warm-up."""
    prompt = torch.randint(10, model.config.vocab_size, (1, depth), generator=gen)
    return steps / _median_time(lambda: _greedy(model, prompt, steps))


def measure(path: Path, dtype: str, prefill: int, decode: int, batch: int, batch_steps: int) -> dict[str, float]:
    start = time.perf_counter()
    model = _load(path, dtype)
    result = {"load_s": time.perf_counter() - start}
    gen = torch.Generator().manual_seed(0)
    result[f"prefill_{prefill}"] = _prefill(model, prefill, gen)
    result["decode_1"] = _decode(model, decode, gen)
    if batch:
        result[f"decode_{batch}"] = _batched(model, batch, batch_steps, gen)
    return result


def _batched(model, batch: int, steps: int, gen: torch.Generator) -> float:
    """tok/s over all `batch` sequences of `steps` greedy steps after a 128-token prompt each (one run)."""
    prompts = torch.randint(10, model.config.vocab_size, (batch, 128), generator=gen)
    return batch * steps / _greedy(model, prompts, steps)


def serve(path: Path, dtypes: list[str]) -> None:
    """The --serve loop (see the module's docstring)."""
    models, loads = {}, {}
    for dtype in dtypes:
        start = time.perf_counter()
        models[dtype] = _load(path, dtype)
        loads[dtype] = time.perf_counter() - start
    print(json.dumps({"load_s": loads}), flush=True)
    gen = torch.Generator().manual_seed(0)
    for line in sys.stdin:
        request = json.loads(line)
        model = models[request["dtype"]]
        if "prefill" in request:
            tok_s = _prefill(model, request["prefill"], gen)
        elif "decode" in request:
            tok_s = _decode(model, request["decode"], gen, request.get("depth", 1))
        else:
            tok_s = _batched(model, request["batch"], request["steps"], gen)
        print(json.dumps({"tok_s": tok_s}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--dtypes", nargs="*", default=["fp32", "bf16"], choices=list(DTYPES))
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64, help="sequences of the batched figure (0: none)")
    parser.add_argument("--batch-steps", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--serve", action="store_true", help="load once, then measure on request (stdin, JSON lines)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.serve:
        serve(args.model, args.dtypes)
        return
    results = {dtype: measure(args.model, dtype, args.prefill, args.decode, args.batch, args.batch_steps)
               for dtype in args.dtypes}
    json.dump(results, sys.stdout)
    print()


if __name__ == "__main__":
    main()

"""Prefill and decode on a CUDA GPU: nextoken's steps replayed from CUDA graphs against the same steps run eagerly,
and against transformers (bf16, SDPA, a greedy loop with its KV cache) on the same file, all in one process.

Run (on a machine with an NVIDIA GPU): python -m benchmarks.cuda_decode [--batches 1,16,64] [--steps 64]
    [--shapes smollm2-135m-shape ...] [--real smollm2-135m-instruct ...] [--json PATH] [--profile PATH]

Models: those of SmolLM2-135M's and Gemma 3 270M's shapes with random weights (written by tests/tiny.py; a step's
speed depends on the shapes, not the values), and each packaged model named with --real that is installed there.
Prefill: one 512-token prompt, best of 3 after a warm-up. Decode: B requests of a 128-token prompt; after their
prefill, `steps` pure decode steps are timed (synchronized). nextoken runs with a bf16 KV cache and, by route:
"eager" and "graphs", the CUDA defaults (bf16 weights) with and without CUDA graphs; "sdpa", the graphs with
decode attention over the gathered context instead of the paged kernel (ops/attention.py DECODE_KERNEL); "int4" and
"int8", the block formats in their Triton kernels (ops/cuda_blocks.py: the file's blocks, fp32 activations), with
graphs. Printed: tok/s and the ratios (graphs / eager, graphs / sdpa, each route / transformers). `--device cpu` runs the same script on CPU (a check of
the script, not a figure to quote).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from nextoken import LLM, SamplingParams
from nextoken.ops import attention
from tests.tiny import write_tiny_model

SHAPES = {
    "smollm2-135m-shape": ("llama", dict(hidden=576, ffn=1536, heads=9, kv_heads=3, head_dim=64, layers=30,
                                         vocab=49152, context=2048)),
    "gemma-3-270m-shape": ("gemma3", dict(hidden=640, ffn=2048, heads=4, kv_heads=1, head_dim=256, layers=18,
                                          vocab=262144, context=2048)),
}
PROMPT = 128  # decode's prompt length
PREFILL = 512


ROUTES = {"eager": dict(cuda_graphs=False), "graphs": {}, "sdpa": {}, "int4": dict(weights="int4"),
          "int8": dict(weights="int8")}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn) -> float:  # noqa: ANN001
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def prefill_rate(llm: LLM, repeats: int = 3) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def one(seed: int) -> None:
        engine.add_request([(31 * seed + 7 * i) % 500 + 10 for i in range(PREFILL)], params)
        while engine.has_unfinished():
            engine.step()

    one(0)
    return PREFILL / min(_timed(lambda r=r: one(r + 1)) for r in range(repeats))


def decode_rate(llm: LLM, batch: int, steps: int) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for b in range(batch):
        engine.add_request([(7 * b + i) % 200 + 10 for i in range(PROMPT)], params)
    while any(len(r.output_ids) < 2 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # warm-up: captures, allocator
        engine.step()

    def run() -> None:
        for _ in range(steps):
            engine.step()

    elapsed = _timed(run)
    for r in list(engine.scheduler.running):
        engine.abort(r.request_id)
    return batch * steps / elapsed


@torch.inference_mode()
def transformers_rates(path: Path, batches: list[int], steps: int, device: str = "cuda") -> dict[str, float]:
    """transformers' figures on the same GGUF file (dequantized, bf16): prefill and greedy decode with its cache."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").to(device).eval()
    vocab = model.config.vocab_size
    ids = torch.arange(PREFILL, device=device)[None] % (vocab - 10) + 10
    model(ids, use_cache=True)
    rates = {"prefill": PREFILL / min(_timed(lambda: model(ids, use_cache=True)) for _ in range(3))}
    for batch in batches:
        rows = torch.arange(batch, device=device)[:, None]
        prompt = (torch.arange(PROMPT, device=device)[None] + 7 * rows) % 200 + 10
        out = model(prompt, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

        def step() -> None:
            nonlocal cache, token
            out = model(token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)

        for _ in range(3):
            step()
        rates[f"decode{batch}"] = batch * steps / _timed(lambda: [step() for _ in range(steps)])
    return rates


def measure(path: Path, batches: list[int], steps: int, routes: list[str], device: str = "cuda"
            ) -> dict[str, dict[str, float]]:
    figures: dict[str, dict[str, float]] = {}
    for route in routes:
        # "sdpa": the graphs' route with decode attention over the gathered context instead of the paged kernel
        attention.DECODE_KERNEL = "sdpa" if route == "sdpa" else "triton"
        llm = LLM(str(path), device=device, kv_dtype="bf16", kv_cache_bytes=2 << 30, max_num_seqs=max(batches),
                  enable_prefix_caching=False, **ROUTES[route])
        rates = {"prefill": prefill_rate(llm)}
        rates.update({f"decode{b}": decode_rate(llm, b, steps) for b in batches})
        figures[route] = rates
        attention.DECODE_KERNEL = "triton"
        del llm
        if device == "cuda":
            torch.cuda.empty_cache()
    return figures


def profile_decode(path: Path, steps: int = 20) -> str:
    """torch.profiler's table of `steps` batch-1 decode steps with the CUDA defaults (graph replays), by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(str(path), device="cuda", kv_cache_bytes=1 << 30, enable_prefix_caching=False)
    engine = llm.engine
    engine.add_request(list(range(10, 10 + PROMPT)), SamplingParams(temperature=0, max_tokens=4 * steps,
                                                                       ignore_eos=True))
    for _ in range(10):  # prefill, captures
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]  # the GPU's own events (kernels, copies)
    gpu_us = sum(e.self_device_time_total for e in kernels)
    count = sum(e.count for e in kernels)
    head = (f"{path.stem}: {steps} decode steps at batch 1 (graph replays), context ~{PROMPT + 10}; "
            f"GPU time {gpu_us / steps / 1e3:.2f} ms a step in {count / steps:.0f} kernels\n")
    return head + events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)


def table(figures: dict[str, dict[str, float]], routes: list[str]) -> str:
    """tok/s by figure (rows) and route (columns), then graphs / eager and each route / transformers."""
    hf = figures.get("transformers", {})
    ratios = [f"graphs/{r}" for r in ("eager", "sdpa") if {"graphs", r} <= set(routes)] + \
        [f"{r}/hf" for r in routes if hf and r != "eager"]
    lines = [f"{'figure':10}" + "".join(f"{r:>10}" for r in routes) + (f"{'hf':>10}" if hf else "") +
             "".join(f"{r:>13}" for r in ratios)]
    for key in figures[routes[0]]:
        line = f"{key:10}" + "".join(f"{figures[r][key]:10.1f}" for r in routes)
        if hf:
            line += f"{hf[key]:10.1f}"
        for ratio in ratios:
            top, bottom = ratio.split("/")
            line += f"{figures[top][key] / (hf if bottom == 'hf' else figures[bottom])[key]:12.2f}x"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), help="random-weight models to measure")
    parser.add_argument("--real", nargs="*", default=["smollm2-135m-instruct", "gemma-3-270m"],
                        help="packaged models to measure too, where installed (with transformers beside them)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--profile", help="write a profile of batch-1 decode steps of the first model here")
    parser.add_argument("--routes", default=",".join(ROUTES), help=f"of {', '.join(ROUTES)}")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to check the script")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    routes = args.routes.split(",")
    if unknown := set(routes) - set(ROUTES):
        raise SystemExit(f"unknown routes: {', '.join(sorted(unknown))}")
    from nextoken.loader.registry import REGISTRY, is_installed, resolve_model

    batches = [int(b) for b in args.batches.split(",")]
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (a check of the script)"
    print(f"{where}, torch {torch.__version__}; bf16 KV cache; tok/s")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = {name: lambda name=name, arch=arch, shape=shape: write_tiny_model(
            Path(tmp) / f"{name}.gguf", arch, shape=shape) for name, (arch, shape) in SHAPES.items()
            if name in args.shapes}
        for name in args.real:
            if name in REGISTRY and is_installed(REGISTRY[name]):
                models[name] = lambda name=name: resolve_model(name)
            else:
                print(f"{name}: not installed here, skipped")
        for i, (name, make) in enumerate(models.items()):
            path = make()
            if args.profile and i == 0:
                Path(args.profile).write_text(profile_decode(path))
            figures = measure(path, batches, args.steps, routes, args.device)
            if name in args.real:
                try:
                    figures["transformers"] = transformers_rates(path, batches, args.steps, args.device)
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                except Exception as exc:  # noqa: BLE001 - the baseline is optional; say why it is missing
                    print(f"{name}: transformers baseline failed: {type(exc).__name__}: {exc}")
            results[name] = figures
            print(f"\n{name}")
            print(table(figures, routes))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""Where a batch-1 decode step's time goes, against the two floors this machine puts under it.

Run: .venv/bin/python -m benchmarks.roofline [models...] [--rounds N] [--steps N] [--llama-bench PATH]

For each model in its default formats (the file's blocks, the int8 LM head), the bytes one decode step reads (the
projections' blocks and the head's), and:
- the memory floor: one pass that only reads those same tensors, on the same threads, each split between them as
  the kernels split their rows (nt_stream_read);
- the compute floor of the projections: their block products (nt_block_matmul, one activation row) over one layer's
  weights while these sit in cache (the best of several passes), times the number of layers;
- the measured step: the one native call that runs the whole step (NativeStep: embedding, every decoder block, the
  LM head, the greedy pick) and the rest (scheduling, batch building, the engine's bookkeeping: Python);
- the same steps through the modules (the engine's path where a step cannot be one call), split into the native
  call running every decoder block, the LM head, and the rest (embedding, batch building, sampling, bookkeeping).
With --llama-bench, each round also runs llama.cpp's tg128 on the same file: the memory floor's tok/s over llama.cpp's
in the same round is the most that any engine reading these bytes could reach against it.
Each round takes all of them one after another, so that they share the same minute of this machine (whose speed
drifts from minute to minute); the medians over the rounds are printed, with the tok/s each floor would allow.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import describe_machine, save
from benchmarks.latency import llama_bench
from nextoken import LLM, SamplingParams
from nextoken.ops.fused import NativeStep
from nextoken.ops import native
from nextoken.ops.quant_linear import BlockLinear

PROJECTIONS = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


class _Timed:
    """Stands in for the model's FusedDecoder, adding the time of each call to `seconds`."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        out = self.inner(*args)
        self.seconds += time.perf_counter() - start
        return out


def _block_tensors(linear: BlockLinear) -> list[torch.Tensor]:
    return [t for p in linear.parts for t in (p.qs, p.d, p.m) if t is not None]


def _hot_products(lib: Any, linears: list[BlockLinear], num_layers: int, passes: int = 6) -> float:
    """Seconds for one layer's block products with one activation row, its weights already in cache (the best of
    `passes` passes after a first one), times `num_layers`. Direct calls: no torch op between them."""
    calls: list[Callable[[], int]] = []
    for linear in linears:
        x = torch.randn(1, linear.in_features)
        out = torch.empty(1, linear.out_features)
        at = 0
        for p in linear.parts:
            args = (p.kind, x.data_ptr(), 1, linear.in_features, linear.in_features, p.rows, p.qs.data_ptr(),
                    p.d.data_ptr(), None if p.m is None else p.m.data_ptr(), out[:, at:].data_ptr(),
                    linear.out_features, torch.get_num_threads())
            calls.append(lambda args=args, keep=(x, out): lib.nt_block_matmul(*args))
            at += p.rows
    best = float("inf")
    for _ in range(passes + 1):
        start = time.perf_counter()
        for call in calls:
            call()
        best = min(best, time.perf_counter() - start)
    return best * num_layers


def measure(name: str, rounds: int, steps: int, llama: str | None = None) -> dict:
    llm = LLM(name, device="cpu", enable_prefix_caching=False)
    llm.engine.runner.settle()  # the weights on huge pages before any timing
    engine, model = llm.engine, llm.engine.runner.model
    lib = native.library()
    if lib is None or model.fused is None or model.quantized_head is None:
        raise SystemExit(f"{name}: this needs the native kernels and block weights (the CPU defaults)")
    projections = [t for layer in model.layers for n in PROJECTIONS for t in _block_tensors(layer.get_submodule(n))]
    head = [model.quantized_head.blocks.qs, model.quantized_head.blocks.d]
    nbytes = {"projections": sum(t.nbytes for t in projections), "head": sum(t.nbytes for t in head)}
    middle = model.layers[len(model.layers) // 2]
    linears = [middle.get_submodule(n) for n in PROJECTIONS]
    runner, fused = engine.runner, model.fused
    whole = NativeStep.build(model)
    if whole is None:
        raise SystemExit(f"{name}: its decode steps do not run as one native call")
    layers = model.fused = _Timed(fused)
    head_seconds, step_seconds = [0.0], [0.0]
    compute_logits, decode_step = model.compute_logits, native.decode_step

    def timed_logits(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        start = time.perf_counter()
        out = compute_logits(hidden, out)
        head_seconds[0] += time.perf_counter() - start
        return out

    def timed_step(*args: Any) -> None:
        start = time.perf_counter()
        decode_step(*args)
        step_seconds[0] += time.perf_counter() - start

    model.compute_logits, native.decode_step = timed_logits, timed_step

    def decode(one_call: bool) -> tuple[float, int]:
        """(seconds per decode step, steps timed), either way (the runner's choice pinned); the timers then hold
        their totals over those steps."""
        runner._step = (layers, whole if one_call else None)
        engine.add_request([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
        for _ in range(8):  # the prompt, then a few decode steps
            engine.step()
        layers.seconds = head_seconds[0] = step_seconds[0] = 0.0
        start, done = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            done += 1
        return (time.perf_counter() - start) / done, done

    rows = []
    try:
        for _ in range(rounds):
            stream = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                native.stream_read(lib, projections + head)
                stream = min(stream, time.perf_counter() - start)
            hot = _hot_products(lib, linears, len(model.layers))
            step, done = decode(True)
            rows.append({"stream_s": stream, "hot_products_s": hot, "step_s": step,
                         "native_s": step_seconds[0] / done})
            rows[-1]["module_step_s"], done = decode(False)
            rows[-1].update(layers_s=layers.seconds / done, head_s=head_seconds[0] / done)
            if llama is not None:
                rows[-1]["llama_tok_s"] = llama_bench(llama, name, torch.get_num_threads(), repeats=1,
                                                      prompt=0)["decode_1"]
                rows[-1]["floor_over_llama"] = 1 / stream / rows[-1]["llama_tok_s"]
                rows[-1]["ours_over_llama"] = 1 / rows[-1]["step_s"] / rows[-1]["llama_tok_s"]
    finally:
        model.fused, model.compute_logits, native.decode_step = fused, compute_logits, decode_step
        runner._step = (None, None)
    return {"bytes": nbytes, "rounds": rows,
            "median": {key: statistics.median(r[key] for r in rows) for key in rows[0]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["smollm2-135m-instruct", "gemma-3-270m"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per round")
    parser.add_argument("--llama-bench", help="a llama-bench binary: llama.cpp's tg128 on the same file, each round")
    args = parser.parse_args()
    print(describe_machine())
    results = {}
    for name in args.models:
        r = measure(name, args.rounds, args.steps, args.llama_bench)
        med, b = r["median"], r["bytes"]
        total = b["projections"] + b["head"]
        rest = med["module_step_s"] - med["layers_s"] - med["head_s"]
        print(f"{name}: a decode step reads {total / 1e6:.1f} MB ({b['projections'] / 1e6:.1f} MB of projection "
              f"blocks, {b['head'] / 1e6:.1f} MB of LM head); medians of {args.rounds} rounds on "
              f"{torch.get_num_threads()} threads:")
        print(f"  memory floor    {med['stream_s'] * 1e3:6.2f} ms  reading only, {total / med['stream_s'] / 1e9:.1f} "
              f"GB/s: at most {1 / med['stream_s']:.0f} tok/s")
        print(f"  compute floor   {med['hot_products_s'] * 1e3:6.2f} ms  the projections' products with their "
              f"weights in cache")
        print(f"  measured step   {med['step_s'] * 1e3:6.2f} ms  {1 / med['step_s']:.0f} tok/s: the one native call "
              f"{med['native_s'] * 1e3:.2f} ms, the rest {(med['step_s'] - med['native_s']) * 1e3:.2f} ms")
        print(f"  module path     {med['module_step_s'] * 1e3:6.2f} ms  {1 / med['module_step_s']:.0f} tok/s: decoder "
              f"blocks {med['layers_s'] * 1e3:.2f} ms, LM head {med['head_s'] * 1e3:.2f} ms "
              f"({b['head'] / med['head_s'] / 1e9:.1f} GB/s), the rest {rest * 1e3:.2f} ms")
        if args.llama_bench:
            print(f"  llama.cpp tg128 {med['llama_tok_s']:6.1f} tok/s in the same rounds: nextoken "
                  f"{med['ours_over_llama']:.2f}x; the memory floor {med['floor_over_llama']:.2f}x (medians of the "
                  f"rounds' ratios)")
        results[name] = r
    save("roofline", results)


if __name__ == "__main__":
    main()

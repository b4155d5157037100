"""Decode on a CUDA GPU: steps replayed from CUDA graphs against the same steps run eagerly, in one process.

Run (on a machine with an NVIDIA GPU): python -m benchmarks.cuda_decode [--batches 1,16,64] [--steps 64]

The packaged models' files do not travel to such machines, so the models are of SmolLM2-135M's and Gemma 3 270M's
shapes with random weights (written by tests/tiny.py): a decode step's speed depends on the shapes, not the values.
Each batch size runs B requests of a 128-token prompt; after their prefill, `steps` pure decode steps are timed
(synchronized). Printed: tok/s with bf16 weights (the CUDA default) with and without graphs, and the ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from nextoken import LLM, SamplingParams
from tests.tiny import write_tiny_model

SHAPES = {
    "smollm2-135m-shape": ("llama", dict(hidden=576, ffn=1536, heads=9, kv_heads=3, head_dim=64, layers=30,
                                         vocab=49152, context=2048)),
    "gemma-3-270m-shape": ("gemma3", dict(hidden=640, ffn=2048, heads=4, kv_heads=1, head_dim=256, layers=18,
                                          vocab=262144, context=2048)),
}


def decode_rate(llm: LLM, batch: int, steps: int) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for b in range(batch):
        engine.add_request([(7 * b + i) % 200 + 10 for i in range(128)], params)
    while any(len(r.output_ids) < 2 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # warm-up: captures, allocator
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    for r in list(engine.scheduler.running):
        engine.abort(r.request_id)
    return batch * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 weights, bf16 KV; decode tok/s")
    print(f"{'model':22} {'batch':>5} {'eager':>9} {'graphs':>9} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (arch, shape) in SHAPES.items():
            path = write_tiny_model(Path(tmp) / f"{name}.gguf", arch, shape=shape)
            rates = {}
            for graphs in (False, True):
                llm = LLM(str(path), device="cuda", cuda_graphs=graphs, kv_cache_bytes=2 << 30,
                          max_num_seqs=max(batches), enable_prefix_caching=False)
                rates[graphs] = [decode_rate(llm, b, args.steps) for b in batches]
                del llm
                torch.cuda.empty_cache()
            for b, eager, fast in zip(batches, rates[False], rates[True]):
                print(f"{name:22} {b:5d} {eager:9.1f} {fast:9.1f} {fast / eager:5.2f}x")


if __name__ == "__main__":
    main()

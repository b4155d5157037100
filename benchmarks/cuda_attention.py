"""Decode attention over the paged KV cache on CUDA: the paged Triton kernel (ops/cuda_attention.py, K/V read in
place) against the SDPA route (the context gathered at the block table's width, masked by length), one layer, by
rows and context length, for SmolLM2-135M's and Gemma 3 270M's heads; bf16 cache and queries, blocks of 16 tokens
scattered over the pool, the table as wide as the longest context (a CUDA graph's bucket).

Run (on a machine with an NVIDIA GPU): python -m benchmarks.cuda_attention [--rows 1,16,64] [--contexts 128,1024,4096]
Times: microseconds a call, triton.testing.do_bench's mean (launches included).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from nextoken.cache.kv_pool import KVPool, KVShape
from nextoken.ops import attention, cuda_attention

HEADS = {"smollm2": (9, 3, 64), "gemma3": (4, 1, 256)}
BLOCK = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--contexts", default="128,1024,4096")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    from triton.testing import do_bench

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us a call (one layer)")
    results = []
    for name, (heads, kv_heads, head_dim) in HEADS.items():
        for rows in [int(r) for r in args.rows.split(",")]:
            for context in [int(c) for c in args.contexts.split(",")]:
                width = context // BLOCK
                pool = KVPool(KVShape(1, kv_heads, head_dim, torch.bfloat16), rows * width + 1, BLOCK,
                              torch.device("cuda"))
                layer = pool.layers[0]
                layer.k.normal_()
                layer.v.normal_()
                tables = torch.randperm(rows * width, device="cuda").reshape(rows, width)
                lengths = torch.full((rows,), context, device="cuda")
                q = torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                scale = 1 / math.sqrt(head_dim)
                kernel = do_bench(lambda: cuda_attention.paged_decode(q, layer.k, layer.v, tables, lengths, scale,
                                                                      None), warmup=5, rep=25) * 1e3
                attention.DECODE_KERNEL = "sdpa"
                sdpa = do_bench(lambda: attention._masked_decode(q, layer, tables, lengths, context, {}, scale, None),
                                warmup=5, rep=25) * 1e3
                error = float((cuda_attention.paged_decode(q, layer.k, layer.v, tables, lengths, scale, None).float()
                               - attention._masked_decode(q.float(), layer, tables, lengths, context, {}, scale,
                                                          None)).abs().max())
                attention.DECODE_KERNEL = "triton"
                results.append({"model": name, "rows": rows, "context": context, "kernel": kernel, "sdpa": sdpa,
                                "error": error})
                print(f"{name:8} rows {rows:3} context {context:5}: kernel {kernel:8.1f}  sdpa {sdpa:8.1f}  "
                      f"sdpa/kernel {sdpa / kernel:5.2f}x  max error {error:.1e}", flush=True)
                del pool
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

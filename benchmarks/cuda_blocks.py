"""The block formats' CUDA kernel (ops/cuda_blocks.py) against torch's GEMM over the same weights in bf16 and fp32
(cuBLAS), on projections of SmolLM2-135M's and Gemma 3 270M's shapes, by rows of activations; with --sweep, the
kernel's tiles too (each checked against the fp64 product first).

Run (on a machine with an NVIDIA GPU): python -m benchmarks.cuda_blocks [--rows 1,4,16,64,512] [--sweep] [--json PATH]
Times: microseconds a product, triton.testing.do_bench's mean. `--device cpu` runs the script under Triton's
interpreter (TRITON_INTERPRET=1), a check of the script, not a figure.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nextoken.ops import cuda_blocks
from nextoken.ops.native.interface import Format

SHAPES = {"smollm2 qkv": (960, 576), "smollm2 gate_up": (3072, 576), "smollm2 down": (576, 1536),
          "gemma3 qkv": (1536, 640), "gemma3 gate_up": (4096, 640), "gemma3 down": (640, 2048)}
SWEEP = [(1, 16, 256, 4), (1, 32, 256, 4), (1, 32, 128, 4), (1, 64, 128, 4), (1, 64, 256, 8),  # vector kernel
         (16, 64, 32, 4), (32, 32, 32, 4), (32, 64, 32, 4), (64, 64, 32, 4), (64, 64, 16, 4), (64, 128, 32, 8)]


def blocks(kind: Format, n: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(n + k)
    if kind == Format.Q4:
        qs = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        d = (torch.rand(n, k // 32, generator=gen) / 50).half()
        m = (-torch.rand(n, k // 32, generator=gen) / 10).half()
        return qs.to(device), d.to(device), m.to(device)
    qs = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return qs.to(device), (torch.rand(n, k // 32, generator=gen) / 500).half().to(device), None


def bench(fn) -> float:  # noqa: ANN001
    if not torch.cuda.is_available():
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=25) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,64,512")
    parser.add_argument("--sweep", action="store_true", help="time every tile in SWEEP too")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="of: " + ", ".join(SHAPES))
    parser.add_argument("--sweep-shapes", default="smollm2", help="shapes whose names start so are swept")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    device = args.device
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU, interpreted (a check of the script)"
    print(f"{where}, torch {torch.__version__}; us a product (kernel: the tile chosen by rows)")
    results = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for kind in (Format.Q4, Format.Q8):
            qs, d, m = blocks(kind, n, k, device)
            w = cuda_blocks.dequantize(kind, qs, d, m)
            w16 = w.bfloat16()
            for rows in [int(r) for r in args.rows.split(",")]:
                x = torch.randn(rows, k, device=device)
                out = torch.empty(rows, n, device=device)
                expected = F.linear(x.double(), w.double())
                bound = F.linear(x.abs().double(), w.abs().double())
                row = {"shape": name, "kind": kind.name, "rows": rows,
                       "kernel": bench(lambda: cuda_blocks.block_matmul(x, kind, qs, d, m, out)),
                       "bf16": bench(lambda: F.linear(x.bfloat16(), w16)), "fp32": bench(lambda: F.linear(x, w))}
                cuda_blocks.block_matmul(x, kind, qs, d, m, out)
                row["error"] = float(((out.double() - expected).abs() / bound).max())
                if args.sweep and name.startswith(args.sweep_shapes):
                    for tile in SWEEP:
                        if tile[0] == 1 and rows > 16:
                            continue
                        out.zero_()
                        cuda_blocks.block_matmul(x, kind, qs, d, m, out, tile=tile)
                        error = float(((out.double() - expected).abs() / bound).max())
                        key = "x".join(map(str, tile))
                        row[key] = bench(lambda t=tile: cuda_blocks.block_matmul(x, kind, qs, d, m, out, tile=t)) \
                            if error < 1e-5 else float("nan")
                results.append(row)
                extra = " ".join(f"{key}={v:.1f}" for key, v in row.items() if "x" in key and key != "error")
                print(f"{name:16} {kind.name:3} rows {rows:4}: kernel {row['kernel']:7.1f}  bf16 {row['bf16']:7.1f}  "
                      f"fp32 {row['fp32']:7.1f}  err {row['error']:.1e}  {extra}", flush=True)
    if args.sweep:
        print("\nswept tiles by rows: geometric mean of the time over the swept shapes and kinds, us (best first)")
        for rows in sorted({r["rows"] for r in results}):
            swept = [r for r in results if r["rows"] == rows and any("x" in key for key in r)]
            keys = [key for key in swept[0] if "x" in key] if swept else []
            means = {key: math.exp(sum(math.log(r[key]) for r in swept) / len(swept)) for key in keys
                     if all(r[key] == r[key] for r in swept)}  # NaN: a tile that failed its check
            ranked = sorted(means.items(), key=lambda item: item[1])
            kernel = math.exp(sum(math.log(r["kernel"]) for r in swept) / len(swept)) if swept else 0.0
            print(f"rows {rows:4}: chosen {kernel:7.1f}  " + "  ".join(f"{k}={v:.1f}" for k, v in ranked[:4]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

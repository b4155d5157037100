"""Products over block weights on each route this CPU has: AMX-INT8 tiles against AVX-512 VNNI (the same bits, see
tests/unit/test_amx.py), with the default's exact activation codes (two levels) and int8 ones (`--activations
int8`).

Run: .venv/bin/python -m benchmarks.gemm_routes [--rows 4 8 16 64 512] [--rounds 5]

Called as the engine calls them: up to 16 rows the few-row entry (block_few; on a CPU with AMX the GEMM from 8 rows),
past that the GEMM; int8 codes with fixed outlier columns, as calibration fixes them. The AMX route is off unless
asked for (NEXTOKEN_AMX=1); this switches it on and off itself.

Beside them, from 64 rows, torch's own products on the same shapes, in the same rounds: bf16 (oneDNN; on a CPU with
AMX-BF16 on its tiles) and int8 by int8 summed in int32 (`torch._int_mm`; AMX-INT8 where there is one), with
random operands. They hold no scale per 32 values, so they are not the block formats' products: they are what a
format without one (bf16 weights, or int8 weights per row by int8 activations per token) could reach here.

One decoder block's projections of SmolLM2-135M (Q4 with fp16 scales, as its Q4_1 file) and of Gemma 3 270M (Q4
with fp32 scales and offsets, as Q4_K; its down projection Q8 in halves, as Q6_K), and Gemma 3's LM head (int8
codes, 262,144 rows) at 8, 16 and 64 rows, random weights of the real shapes. Each round times every route once per shape,
alternating, so that they share the same minute of the machine; medians over the rounds, in ms and in G products/s,
with each route's ratio to VNNI's. Where the CPU has no AMX (or the kernel does not grant the tiles) only the VNNI
route runs; without AVX-512 VNNI, the AVX2 build's routes (int8 activations change nothing there).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import describe_machine, save
from nextoken.ops import native
from nextoken.ops.quant_linear import Q4, Q4_F32, Q8, Q8_HALVES, VNNI_MAX_ROWS, q4_weight, q8_weight
from nextoken.ops.quantize import q8_codes, regroup

# (name, kind, outputs, inputs): one block's products (q, k and v fused; gate and up fused) and Gemma 3's head
SHAPES = [("SmolLM2 qkv", Q4, 960, 576), ("SmolLM2 o", Q4, 576, 576), ("SmolLM2 gate_up", Q4, 3072, 576),
          ("SmolLM2 down", Q4, 576, 1536), ("Gemma 3 qkv", Q4_F32, 1536, 640), ("Gemma 3 o", Q4_F32, 640, 1024),
          ("Gemma 3 gate_up", Q4_F32, 4096, 640), ("Gemma 3 down", Q8_HALVES, 640, 2048),
          ("Gemma 3 head", Q8, 262144, 640)]

FEW_ROWS = VNNI_MAX_ROWS  # the few-row kernels' limit with AVX-512 VNNI
OUTLIERS = torch.tensor([3, 100, 200, 301, 402, 500, 555, 570], dtype=torch.int32)  # fixed, as calibration fixes them


def weight(kind: int, n: int, k: int, gen: torch.Generator):  # noqa: ANN201 - BlockWeight
    if kind == Q4:
        return q4_weight(*regroup(torch.randn(n, k, generator=gen)))
    if kind == Q4_F32:  # scales and offsets in fp32, as Q4_K's products of two factors
        return q4_weight(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                         torch.rand(n, k // 32, generator=gen) / 50, -torch.rand(n, k // 32, generator=gen) / 50)
    if kind == Q8:
        return q8_weight(*q8_codes(None, None, torch.randn(n, k, generator=gen)))
    return q8_weight(torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8),
                     torch.rand(n, k // 16, generator=gen) / 10)


TORCH_ROWS = 64  # rows from which torch's products are timed beside ours


def torch_operands_for(rows: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random operands of a rows x k by k x n product: bf16 activations and weight, int8 ones (the weight column-major,
    as oneDNN takes it)."""
    xb, wb = torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(k, n, generator=gen).bfloat16()
    xi = torch.randint(-127, 128, (rows, k), generator=gen, dtype=torch.int8)
    wi = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).t()
    return xb, wb, xi, wi


def torch_products(xb: torch.Tensor, wb: torch.Tensor, xi: torch.Tensor,
                   wi: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    return {"bf16": lambda: xb @ wb, "int8": lambda: torch._int_mm(xi, wi)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 64, 512])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    lib = native.library()
    if lib is None:
        raise SystemExit("the native kernels did not build")
    print(describe_machine())
    had = lib.nt_amx(-1)
    routes = ["vnni", "amx"] if lib.nt_amx(1) else ["vnni"]
    lib.nt_amx(had)
    first = "VNNI" if lib.nt_has_vnni512() else "AVX2" if lib.nt_has_avx2() else "plain C"
    label = {"vnni": first, "amx": "AMX"}
    print(f"routes: {', '.join(label[r] for r in routes)}" + ("" if len(routes) > 1 else " (no AMX here)"))
    gen = torch.Generator().manual_seed(0)
    cases = []
    for rows in args.rows:
        for name, kind, n, k in SHAPES:
            if "head" in name and rows not in (8, 16, 64):
                continue
            cases.append((name, rows, weight(kind, n, k, gen), torch.randn(rows, k, generator=gen)))
    torch_operands = {rows: {name: torch_operands_for(rows, n, k, gen) for name, _, n, k in SHAPES if "head" not in name}
                      for rows in args.rows if rows >= TORCH_ROWS}
    times: dict[tuple[str, int, str, str], list[float]] = {}
    try:
        for _ in range(args.rounds):
            for name, rows, part, x in cases:
                out = torch.empty(rows, part.qs.shape[0])
                for codes in ("int16", "int8"):
                    for route in routes:
                        lib.nt_amx(1 if route == "amx" else 0)
                        start = time.perf_counter()
                        # as the engine calls them: the few-row route up to 16 rows (exact codes; int8 ones with
                        # their outlier columns fixed), the GEMM past that
                        native.block_matmul(lib, part.kind, x, part.qs, part.d, part.m, out,
                                            gemm=rows > FEW_ROWS or codes == "int8", int8_activations=codes == "int8",
                                            outliers=OUTLIERS if codes == "int8" else None)
                        times.setdefault((name, rows, codes, route), []).append(time.perf_counter() - start)
                if name in torch_operands.get(rows, {}):
                    for label_, run in torch_products(*torch_operands[rows][name]).items():
                        start = time.perf_counter()
                        run()
                        times.setdefault((name, rows, "torch", label_), []).append(time.perf_counter() - start)
    finally:
        lib.nt_amx(had)
    results = []
    print(f"{'product':18} {'rows':>5} {'codes':>6} " + " ".join(f"{label[r] + ' ms':>10} {label[r] + ' G/s':>9}"
                                                             for r in routes)
          + ("  AMX / VNNI" if len(routes) > 1 else ""))
    for name, rows, part, x in cases:
        for codes in ("int16", "int8"):
            ops = rows * part.qs.shape[0] * x.shape[1] / 1e9
            med = {r: statistics.median(times[(name, rows, codes, r)]) for r in routes}
            line = f"{name:18} {rows:5d} {codes:>6} " + " ".join(f"{med[r] * 1e3:10.2f} {ops / med[r]:9.1f}"
                                                                   for r in routes)
            if len(routes) > 1:
                line += f"  {med['vnni'] / med['amx']:.2f}x"
            print(line)
            results.append({"product": name, "rows": rows, "codes": codes, "ms": {r: med[r] * 1e3 for r in routes}})
    if torch_operands:
        print(f"\n{'torch, no block scales':24} {'rows':>5} {'bf16 ms':>9} {'G/s':>7} {'int8 ms':>9} {'G/s':>7}"
              f"  {first} int16 / bf16  {first} int8 / int8")
    for rows, by_name in torch_operands.items():
        for name, (x, w, _, _) in by_name.items():
            ops = rows * w.shape[1] * x.shape[1] / 1e9
            med = {r: statistics.median(times[(name, rows, "torch", r)]) for r in ("bf16", "int8")}
            ours = {c: statistics.median(times[(name, rows, c, "vnni")]) for c in ("int16", "int8")}
            print(f"{name:24} {rows:5d} {med['bf16'] * 1e3:9.2f} {ops / med['bf16']:7.0f} {med['int8'] * 1e3:9.2f} "
                  f"{ops / med['int8']:7.0f}  {ours['int16'] / med['bf16']:17.1f}x {ours['int8'] / med['int8']:15.1f}x")
            results.append({"product": name, "rows": rows, "codes": "torch", "ms": {r: med[r] * 1e3 for r in med}})
    save("gemm_routes", {"rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()

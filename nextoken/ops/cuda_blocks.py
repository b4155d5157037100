"""The block formats on CUDA: products of activations with a projection's blocks (ops/quant_linear.py `BlockWeight`,
the file's own Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0 blocks or weights requantized to them) in one Triton kernel.

The kernel never makes a float copy of the weight. For each block of 32 inputs (16 for Q6_K's halves) it takes the
dot product of the activations with the block's integer codes, then applies the block's scale and offset once:

    y[r, n] = sum over blocks g of  d[n, g] * (x[r, g] . q[n, g])  +  m[n, g] * sum(x[r, g])

which is the product with w = d * q + m, the file's values, summed in fp32 (the dot products as IEEE fp32
multiply-adds, not TF32: codes of at most 8 bits times fp32 activations keep every bit fp32 would). So the int4 and
int8 formats on a GPU give fp32's numbers over the file's weights, as the CPU's kernels do (docs/exactness.md),
where bf16 weights round every weight to 8 bits. Activations of any float dtype are read as fp32.

Two kernels: up to MV_ROWS rows, one program per activation row and BLOCK_N weight rows, its products and sums as
vectors (`_block_mv`); past that, tiles of BLOCK_M activation rows by BLOCK_N weight rows with dot products
(`_block_mm`). Each program walks the whole input width, so no sum is split across programs. Without a GPU
the same kernel runs under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check it on CPU.
"""

from __future__ import annotations

import torch

from nextoken.ops.native.interface import Format

try:
    import triton
    import triton.language as tl
except ImportError:  # without Triton the block formats are refused on CUDA (engine/runner.py)
    triton = None


def available() -> bool:
    """Whether the block kernels can run here (Triton is installed)."""
    return triton is not None


if triton is not None:
    @triton.jit
    def _block_mm(x_ptr, qs_ptr, d_ptr, m_ptr, out_ptr, M, N, stride_xm, stride_om,
                  K: tl.constexpr, NIBBLES: tl.constexpr, GROUP: tl.constexpr, HAS_M: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        groups: tl.constexpr = K // GROUP
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        x_rows = x_ptr + rows[:, None] * stride_xm
        if NIBBLES:  # 32 codes in 16 bytes: byte j holds code j (low nibble) and code j + 16 (high nibble)
            half = tl.arange(0, GROUP // 2)
            q_rows = qs_ptr + cols[:, None] * (K // 2) + half[None, :]
            for g in range(0, groups):
                packed = tl.load(q_rows + g * (GROUP // 2), mask=col_ok[:, None], other=0)
                low = (packed & 15).to(tl.float32)
                high = (packed >> 4).to(tl.float32)
                xa = tl.load(x_rows + g * GROUP + half[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
                xb = tl.load(x_rows + g * GROUP + GROUP // 2 + half[None, :], mask=row_ok[:, None],
                             other=0.0).to(tl.float32)
                dots = tl.dot(xa, tl.trans(low), input_precision="ieee")
                dots += tl.dot(xb, tl.trans(high), input_precision="ieee")
                d = tl.load(d_ptr + cols * groups + g, mask=col_ok, other=0.0).to(tl.float32)
                acc += dots * d[None, :]
                if HAS_M:
                    m = tl.load(m_ptr + cols * groups + g, mask=col_ok, other=0.0).to(tl.float32)
                    sums = tl.sum(xa, axis=1) + tl.sum(xb, axis=1)
                    acc += sums[:, None] * m[None, :]
        else:  # one int8 code a byte
            k = tl.arange(0, GROUP)
            q_rows = qs_ptr + cols[:, None] * K + k[None, :]
            for g in range(0, groups):
                codes = tl.load(q_rows + g * GROUP, mask=col_ok[:, None], other=0).to(tl.float32)
                xg = tl.load(x_rows + g * GROUP + k[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
                dots = tl.dot(xg, tl.trans(codes), input_precision="ieee")
                d = tl.load(d_ptr + cols * groups + g, mask=col_ok, other=0.0).to(tl.float32)
                acc += dots * d[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


    @triton.jit
    def _block_mv(x_ptr, qs_ptr, d_ptr, m_ptr, out_ptr, N, stride_xm, stride_om,
                  K: tl.constexpr, NIBBLES: tl.constexpr, GROUP: tl.constexpr, HAS_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
        """One activation row (program_id 0) against BLOCK_N weight rows: products and sums as vectors, no dot."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        groups: tl.constexpr = K // GROUP
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        x_row = x_ptr + row * stride_xm
        if NIBBLES:
            half = tl.arange(0, GROUP // 2)
            q_rows = qs_ptr + cols[:, None] * (K // 2) + half[None, :]
            for g in range(0, groups):
                packed = tl.load(q_rows + g * (GROUP // 2), mask=col_ok[:, None], other=0)
                xa = tl.load(x_row + g * GROUP + half).to(tl.float32)
                xb = tl.load(x_row + g * GROUP + GROUP // 2 + half).to(tl.float32)
                dots = tl.sum((packed & 15).to(tl.float32) * xa[None, :] + (packed >> 4).to(tl.float32) * xb[None, :],
                              axis=1)
                d = tl.load(d_ptr + cols * groups + g, mask=col_ok, other=0.0).to(tl.float32)
                acc += dots * d
                if HAS_M:
                    m = tl.load(m_ptr + cols * groups + g, mask=col_ok, other=0.0).to(tl.float32)
                    acc += (tl.sum(xa, axis=0) + tl.sum(xb, axis=0)) * m
        else:
            k = tl.arange(0, GROUP)
            q_rows = qs_ptr + cols[:, None] * K + k[None, :]
            for g in range(0, groups):
                codes = tl.load(q_rows + g * GROUP, mask=col_ok[:, None], other=0).to(tl.float32)
                xg = tl.load(x_row + g * GROUP + k).to(tl.float32)
                dots = tl.sum(codes * xg[None, :], axis=1)
                d = tl.load(d_ptr + cols * groups + g, mask=col_ok, other=0.0).to(tl.float32)
                acc += dots * d
        tl.store(out_ptr + row * stride_om + cols, acc, mask=col_ok)


# Rows up to which products take the vector kernel (each row reads the weight again, from L2), and the tiles of each
# kernel: (BLOCK_M, BLOCK_N, warps) by rows.
MV_ROWS = 4
MV_TILE = (1, 64, 4)
MM_TILES = {16: (16, 32, 4), None: (32, 64, 4)}


def block_matmul(x: torch.Tensor, kind: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 out: torch.Tensor, tile: tuple[int, int, int] | None = None) -> None:
    """out[r, n] = sum_k x[r, k] * w[n, k] for one part's blocks (`kind` a native.Format; see BlockWeight for the
    layouts). x: [M, K] floats, rows contiguous; out: [M, rows] fp32, rows contiguous (a column slice of a wider
    output is fine). `tile` (BLOCK_M, BLOCK_N, warps; BLOCK_M 1 takes the vector kernel) overrides the choice by
    rows, for benchmarks."""
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("block_matmul needs rows of x and out contiguous")
    rows, cols = x.shape[0], x.shape[1]
    nibbles = kind in (Format.Q4, Format.Q4_F32)
    group = 16 if kind == Format.Q8_HALVES else 32
    if tile is None:
        tile = MV_TILE if rows <= MV_ROWS else MM_TILES[16] if rows <= 16 else MM_TILES[None]
    block_m, block_n, warps = tile
    n = qs.shape[0]
    common = dict(K=cols, NIBBLES=nibbles, GROUP=group, HAS_M=m is not None, BLOCK_N=block_n, num_warps=warps)
    if block_m == 1:
        _block_mv[(rows, triton.cdiv(n, block_n))](x, qs, d, d if m is None else m, out, n, x.stride(0),
                                                   out.stride(0), **common)
    else:
        _block_mm[(triton.cdiv(rows, block_m), triton.cdiv(n, block_n))](
            x, qs, d, d if m is None else m, out, rows, n, x.stride(0), out.stride(0), BLOCK_M=block_m, **common)


def dequantize(kind: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """One part's fp32 weight [rows, cols] on its own device: w = d * q (+ m) per block."""
    rows = qs.shape[0]
    if kind in (Format.Q4, Format.Q4_F32):
        blocks = qs.reshape(rows, -1, 16)
        codes = torch.stack((blocks & 15, blocks >> 4), dim=2).reshape(rows, -1)
    else:
        codes = qs
    group = 16 if kind == Format.Q8_HALVES else 32
    w = codes.float().reshape(rows, -1, group) * d.float()[..., None]
    if m is not None:
        w = w + m.float()[..., None]
    return w.reshape(rows, -1)

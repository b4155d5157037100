"""The block formats on CUDA: products of activations with a projection's blocks (ops/quant_linear.py `BlockWeight`,
the file's own Q4_0 / Q4_1 / Q4_K / Q5_0 / Q6_K / Q8_0 blocks or weights requantized to them) in Triton kernels.

No float copy of the weight is kept: each program decodes the tile of weights it is about to use, w = d * q (+ m) in
fp32 from the block's codes and scales (the file's values, as the fp32 reference decodes them), and multiplies it
with the activations in fp32 (dot products as IEEE fp32 multiply-adds, not TF32). So the int4 and int8 formats on a
GPU give fp32's numbers over the file's weights, as the CPU's kernels do (docs/exactness.md), where bf16 weights
round every weight to 8 bits; at a quarter (int8) or an eighth (int4) of fp32's bytes. Activations of any float
dtype are read as fp32.

Two kernels: up to MV_ROWS rows, one program per activation row and BLOCK_N weight rows, its products and sums as
vectors (`_block_mv`); past that, tiles of BLOCK_M activation rows by BLOCK_N weight rows with dot products
(`_block_mm`). Each program walks the whole input width, so no sum is split across programs. Without a GPU the same
kernels run under Triton's interpreter (TRITON_INTERPRET=1), which is how the tests check them on CPU.
"""

from __future__ import annotations

import torch

from nextoken.ops.native.interface import Format

try:
    import triton
    import triton.language as tl
except ImportError:  # without Triton the block formats are refused on CUDA (engine/runner.py)
    triton = tl = None


def available() -> bool:
    """Whether the Triton kernels (these and ops/cuda_attention.py's) can run here: Triton is installed."""
    return triton is not None


if triton is not None:
    @triton.jit
    def _weights(qs_ptr, d_ptr, m_ptr, cols, col_ok, k, K: tl.constexpr, NIBBLES: tl.constexpr,
                 GROUP: tl.constexpr, HAS_M: tl.constexpr):
        """The fp32 weights w[n, k] = d * q (+ m) of rows `cols` at inputs `k` (k < K): the file's values."""
        ok = col_ok[:, None] & (k < K)[None, :]
        if NIBBLES:  # a block's 32 codes in 16 bytes: byte j holds code j (low nibble) and code j + 16 (high)
            byte = (k // GROUP) * (GROUP // 2) + k % (GROUP // 2)
            packed = tl.load(qs_ptr + cols[:, None] * (K // 2) + byte[None, :], mask=ok, other=0)
            codes = (packed >> ((k % GROUP) // (GROUP // 2) * 4).to(tl.uint8)[None, :]) & 15
        else:
            codes = tl.load(qs_ptr + cols[:, None] * K + k[None, :], mask=ok, other=0)
        at = cols[:, None] * (K // GROUP) + (k // GROUP)[None, :]
        w = codes.to(tl.float32) * tl.load(d_ptr + at, mask=ok, other=0.0).to(tl.float32)
        if HAS_M:
            w += tl.load(m_ptr + at, mask=ok, other=0.0).to(tl.float32)
        return w

    @triton.jit
    def _block_mv(x_ptr, qs_ptr, d_ptr, m_ptr, out_ptr, N, stride_xm, stride_om,
                  K: tl.constexpr, NIBBLES: tl.constexpr, GROUP: tl.constexpr, HAS_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One activation row (program_id 0) against BLOCK_N weight rows: products and sums as vectors."""
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            w = _weights(qs_ptr, d_ptr, m_ptr, cols, col_ok, k, K, NIBBLES, GROUP, HAS_M)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(out_ptr + row * stride_om + cols, acc, mask=col_ok)

    @triton.jit
    def _block_mm(x_ptr, qs_ptr, d_ptr, m_ptr, out_ptr, M, N, stride_xm, stride_om,
                  K: tl.constexpr, NIBBLES: tl.constexpr, GROUP: tl.constexpr, HAS_M: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """BLOCK_M activation rows against BLOCK_N weight rows: fp32 dot products (IEEE, not TF32)."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=row_ok[:, None] & (k < K)[None, :],
                        other=0.0).to(tl.float32)
            w = _weights(qs_ptr, d_ptr, m_ptr, cols, col_ok, k, K, NIBBLES, GROUP, HAS_M)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


# Rows up to which products take the vector kernel (each row's programs read the weights again, from L2), and the
# tiles: (BLOCK_M, BLOCK_N, BLOCK_K, warps), BLOCK_M 1 for the vector kernel.
MV_ROWS = 16
MV_TILE = (1, 16, 256, 4)
MM_TILES = {128: (32, 32, 32, 4), None: (64, 64, 16, 4)}  # by rows: up to 128, more


def block_matmul(x: torch.Tensor, kind: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 out: torch.Tensor, tile: tuple[int, int, int, int] | None = None) -> None:
    """out[r, n] = sum_k x[r, k] * w[n, k] for one part's blocks (`kind` a native.Format; see BlockWeight for the
    layouts). x: [M, K] floats, rows contiguous; out: [M, rows] fp32, rows contiguous (a column slice of a wider
    output is fine). `tile` (BLOCK_M, BLOCK_N, BLOCK_K, warps; BLOCK_M 1 takes the vector kernel) overrides the
    choice by rows, for benchmarks."""
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("block_matmul needs rows of x and out contiguous")
    rows, cols = x.shape[0], x.shape[1]
    nibbles = kind in (Format.Q4, Format.Q4_F32)
    group = 16 if kind == Format.Q8_HALVES else 32
    if tile is None:
        tile = MV_TILE if rows <= MV_ROWS else MM_TILES[128] if rows <= 128 else MM_TILES[None]
    block_m, block_n, block_k, warps = tile
    n = qs.shape[0]
    common = dict(K=cols, NIBBLES=nibbles, GROUP=group, HAS_M=m is not None, BLOCK_N=block_n, BLOCK_K=block_k,
                  num_warps=warps)
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

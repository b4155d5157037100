"""Decode attention over the paged KV cache on CUDA, in one Triton kernel that reads K and V in place from the blocks
each row's block table lists (no gathered copy of the context, no mask tensor).

One program per (row, KV head): the query heads that share that KV head (grouped-query attention) walk the row's
blocks in order with an online softmax (running maximum and sum, fp32), up to its context length, which is read on
the device: so a CUDA graph's replay (engine/graphs.py) serves any lengths. A sliding window starts the walk at the
first block it reaches and masks the positions before it. fp32 and bf16 caches; an int8 cache (with scales) takes
the SDPA route (ops/attention.py). Without a GPU the kernel runs under Triton's interpreter, for the tests.
"""

from __future__ import annotations

import torch

from nextoken.ops.cuda_blocks import available, tl, triton

__all__ = ["available", "paged_decode"]

if triton is not None:
    @triton.jit
    def _paged_decode(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale, window,
                      stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_or, stride_oh, stride_t,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, WINDOWED: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        s = tl.arange(0, BLOCK_SIZE)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row * stride_qr + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * scale
        seq_len = tl.load(lens_ptr + row)
        first = 0
        if WINDOWED:
            first = tl.maximum(seq_len - window, 0)
        top = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        for b in range(first // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
            block = tl.load(tables_ptr + row * stride_t + b)
            pos = b * BLOCK_SIZE + s
            ok = (pos < seq_len) & (pos >= first)
            at = block * stride_kb + s[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            keys = tl.load(k_ptr + at, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            values = tl.load(v_ptr + at, mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)  # [BLOCK_G, BLOCK_SIZE]
            scores = tl.where(ok[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            weights = tl.exp(scores - new_top[:, None])
            shrink = tl.exp(top - new_top)
            total = total * shrink + tl.sum(weights, axis=1)
            acc = acc * shrink[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
            top = new_top
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_or + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [rows, heads, head_dim] (one new token per row), caches [blocks, block_size, kv_heads, head_dim],
    block_tables [rows, width] and seq_lens [rows] (int64, tokens in context including the new one) on q's device
    -> [rows, heads, head_dim] in q's dtype."""
    rows, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or k_cache.stride() != v_cache.stride() or \
            block_tables.stride(1) != 1:
        raise ValueError("paged_decode needs head_dim and table rows contiguous, and K, V laid out alike")
    out = torch.empty_like(q)
    group = heads // kv_heads
    _paged_decode[(rows, kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, scale, sliding_window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        out.stride(1), block_tables.stride(0), GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=triton.next_power_of_2(group), BLOCK_D=triton.next_power_of_2(head_dim),
        WINDOWED=sliding_window is not None)
    return out

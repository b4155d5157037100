"""The kernels' attention and decode calls, as __init__.py's other wrappers: the paged KV cache's stores and
attention, the prefill kernel, and the fused decoder's and whole step's calls (nt_decode_layers, nt_decode_step)."""

from __future__ import annotations

import ctypes

import torch

from nextoken.ops import native
from nextoken.ops.native import PARALLEL_ROWS, _check, _f32, _i32, _i64, _indices, _ptr, _SIGNATURES
from nextoken.ops.native.interface import Cache, KVKind, Step


_KV_KINDS = {torch.float32: KVKind.F32, torch.bfloat16: KVKind.BF16, torch.int8: KVKind.INT8}


def attends(device: torch.device, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether decode_attention takes fp32 queries over caches of this kind: on CPU with the library built; an int8
    cache's scale groups must tile the head (head_dim a multiple of 32). Where it does, every attention read goes
    through it (decode rows) or an exact per-sequence gather (prefill), so unwritten slots are never read."""
    return (device.type == "cpu" and native.library() is not None and kv_dtype in _KV_KINDS
            and (kv_dtype != torch.int8 or head_dim % 32 == 0))


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                     seq_lens: torch.Tensor, tables: torch.Tensor, table_rows: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None, scale: float,
                     window: int | None) -> None:
    """Attention of one new query token per listed sequence over its paged K/V (see nt_decode_attention):
    q, out [tokens, heads, head_dim] fp32 contiguous; rows, seq_lens, table_rows [n] int64; tables [seqs, blocks]
    int64; k, v [num_blocks, block_size, kv_heads, head_dim] fp32, bf16 or int8 (with fp16 scales)."""
    _, block_size, kv_heads, head_dim = k.shape
    rows, seq_lens, tables, table_rows = (_indices(t) for t in (rows, seq_lens, tables, table_rows))
    status = lib.nt_decode_attention(
        q.data_ptr(), out.data_ptr(), rows.shape[0], rows.data_ptr(), seq_lens.data_ptr(), tables.data_ptr(),
        table_rows.data_ptr(), tables.stride(0), k.data_ptr(), v.data_ptr(),
        None if k_scales is None else k_scales.data_ptr(), None if v_scales is None else v_scales.data_ptr(),
        _KV_KINDS[k.dtype], block_size, q.shape[1], kv_heads, head_dim, scale, window or 0, torch.get_num_threads())
    if status:
        raise ValueError("decode_attention: int8 caches need a head size that is a multiple of 32, or out of memory")


_SIGNATURES["nt_store_rows"] = (None, [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i32])


def store_rows(lib: ctypes.CDLL, cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
               x: torch.Tensor) -> None:
    """x [n, kv_heads, head_dim] fp32 (rows of any stride) into `cache` [num_blocks, block_size, kv_heads,
    head_dim] (fp32, bf16, or int8 with fp16 `scales` [..., head_dim / 32]) at flat slots [n] (nt_store_rows)."""
    rows = x.reshape(x.shape[0], -1)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    _check(rows)
    if rows.shape[1] != cache.shape[2] * cache.shape[3] or slots.shape[0] != rows.shape[0]:
        raise ValueError(f"store_rows: rows {tuple(x.shape)} do not fit cache {tuple(cache.shape)} at "
                         f"{slots.shape[0]} slots")
    slots = _indices(slots)
    lib.nt_store_rows(cache.data_ptr(), None if scales is None else scales.data_ptr(), _KV_KINDS[cache.dtype],
                      slots.data_ptr(), rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0),
                      torch.get_num_threads() if rows.shape[0] >= PARALLEL_ROWS else 1)


_SIGNATURES["nt_prefill_attention"] = (_i32, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _f32, _i64, _i32])


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int | None) -> torch.Tensor | None:
    """Causal attention of one sequence's new queries q [T, heads, head_dim] over its keys and values k, v [S,
    kv_heads, head_dim] (fp32; the queries are the last T positions), optionally within a sliding window: the
    output [T, heads, head_dim], or None where the kernel does not apply (no AVX-512, head_dim not a multiple of
    16), for torch's SDPA to take over."""
    T, heads, head_dim = q.shape
    S, kv_heads = k.shape[0], k.shape[1]
    if not lib.nt_has_vnni512() or head_dim % 16 or T > S or heads % kv_heads:
        return None
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    if lib.nt_prefill_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), T, S, heads, kv_heads,
                                head_dim, scale, window or 0, torch.get_num_threads()):
        return None
    return out


_SIGNATURES["nt_decode_scratch"] = (_i64, [_ptr, _i64, _i64])
_SIGNATURES["nt_decode_layers"] = (_i32, [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64,
                                          _ptr, _ptr, _i64, _ptr, _f32, _i32, _ptr])


_SIGNATURES["nt_decode_step"] = (_i32, [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr])


def decode_step(lib: ctypes.CDLL, plan: Step, ints: ctypes.Array, rows: int, table_stride: int, logits: int,
                ldl: int, argmax: ctypes.Array | None) -> None:
    """A whole decode step of `rows` sequences (nt_decode_step): token ids, positions, cache slots and context
    lengths [rows] each then the block tables [rows, table_stride] in `ints` (int64); the logits into the fp32 rows
    at address `logits` (row stride ldl), and each row's argmax into `argmax` where given. Raw addresses and ctypes
    arrays only: no torch call, whose cost after a step's kernels have flushed the caches is the point of it."""
    status = lib.nt_decode_step(ctypes.addressof(plan), ctypes.addressof(ints), rows, table_stride, logits, ldl,
                                None if argmax is None else ctypes.addressof(argmax))
    if status == -2:
        raise IndexError(f"token id out of range for a table of {plan.vocab} rows")
    if status:
        raise RuntimeError(f"decode_step: {rows} rows past the step's buffers, or out of memory")


def cache_struct(k: torch.Tensor, v: torch.Tensor, k_scales: torch.Tensor | None,
                 v_scales: torch.Tensor | None) -> Cache:
    return Cache(k.data_ptr(), v.data_ptr(), None if k_scales is None else k_scales.data_ptr(),
                 None if v_scales is None else v_scales.data_ptr(), _KV_KINDS[k.dtype], k.shape[1])


def decode_scratch(lib: ctypes.CDLL, layers: ctypes.Array, rows: int) -> int:
    """Floats of scratch `decode_layers` needs for `rows` tokens."""
    return int(lib.nt_decode_scratch(ctypes.addressof(layers), len(layers), rows))


def decode_layers(lib: ctypes.CDLL, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                  seq_lens: torch.Tensor, tables: torch.Tensor, layers: ctypes.Array, caches: ctypes.Array,
                  rope_tables: ctypes.Array, scratch: torch.Tensor, gemm_rows: int,
                  final_norm: tuple[torch.Tensor, float] | None = None,
                  query_start: torch.Tensor | None = None, profile: ctypes.Array | None = None) -> None:
    """Every decoder block over the new tokens x [M, hidden], updated in place (nt_decode_layers): one per sequence,
    or with `query_start` [sequences + 1] (int64) each sequence's chunk of them, attended through the prefill kernel
    where longer than one (AVX-512 only); seq_lens and tables are then per sequence. scratch: fp32 of at least
    `decode_scratch` elements; products of `gemm_rows` rows or more take the GEMM over the blocks (int16 with
    AVX-512 VNNI, else fp32); final_norm: (weight, eps) of an RMSNorm applied to x last; profile: a
    `profile_buffer` whose per-layer times and BLOCKS reading the call writes (None: nothing is timed)."""
    positions, slots, seq_lens, tables = (_indices(t) for t in (positions, slots, seq_lens, tables))
    if scratch.dtype != torch.float32 or scratch.numel() < decode_scratch(lib, layers, x.shape[0]):
        raise ValueError("decode_layers: scratch is not fp32 or too small")
    if query_start is not None:
        query_start = _indices(query_start)
    status = lib.nt_decode_layers(x.data_ptr(), x.shape[0], positions.data_ptr(), slots.data_ptr(),
                                  seq_lens.data_ptr(), tables.data_ptr(), tables.stride(0),
                                  None if query_start is None else query_start.data_ptr(),
                                  x.shape[0] if query_start is None else query_start.shape[0] - 1,
                                  ctypes.addressof(layers), ctypes.addressof(caches), len(layers),
                                  ctypes.addressof(rope_tables), scratch.data_ptr(), gemm_rows,
                                  None if final_norm is None else final_norm[0].data_ptr(),
                                  0.0 if final_norm is None else final_norm[1], torch.get_num_threads(),
                                  None if profile is None else ctypes.addressof(profile))
    if status:
        raise RuntimeError("decode_layers: out of memory, or a chunk's attention without AVX-512")

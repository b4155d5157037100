"""Paged attention: writes new K/V into cache slots, then attends over each sequence's blocks. On CPU, decode rows
go through the native kernel (ops/native), which reads the blocks in place; prefill chunks, and every row where the
native kernel does not apply, go through torch's SDPA over the gathered context.

The KV cache of one layer (`KVCacheLayer`) holds K and V as [num_blocks, block_size, num_kv_heads, head_dim] (fp32,
bf16, or int8 with scales, read back as the queries' dtype); a sequence's tokens live in the blocks its block table
lists, in order. `AttentionMetadata` says, for one forward pass, where each new token's K/V goes (`slot_mapping`) and
which context each sequence attends over. Causality and sliding windows are positional: query i of a sequence sits
at position seq_len - query_len + i.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.ops import native

# Decode rows on CUDA: "triton", the paged kernel reading K/V in place (ops/cuda_attention.py), where it measured
# faster than "sdpa", the context gathered at the block table's width and masked (NEXTOKEN_CUDA_DECODE_ATTENTION
# overrides; int8 caches take sdpa). One layer on an H200, bf16, SmolLM2's and Gemma 3's heads, kernel against sdpa:
# 128-token tables 1.9-6.0x at 1 to 64 rows; 1,024 tokens 1.13-1.40x at 1 and 16 rows but 0.52x at 64; 4,096 tokens
# 0.24-0.42x (each program walks its row's blocks one at a time). So the kernel takes tables up to
# PAGED_MAX_TOKENS, or PAGED_FEW_ROWS_MAX_TOKENS for up to PAGED_FEW_ROWS rows.
DECODE_KERNEL = os.environ.get("NEXTOKEN_CUDA_DECODE_ATTENTION", "triton")
PAGED_MAX_TOKENS = 256
PAGED_FEW_ROWS, PAGED_FEW_ROWS_MAX_TOKENS = 16, 1024

# Queries per SDPA call of a prefill chunk under a sliding window shorter than its context: a quarter of the window,
# at least this many (each call attends over the keys its queries' windows reach: the window and the run). Gemma 3's
# 8,192-token prefill, runs of a whole / half / quarter window alternating: 393-435 / 414-426 / 418-476 tok/s.
WINDOW_QUERIES = 16


@dataclass
class DecodeGroup:
    index: torch.Tensor | None  # rows of the batch in this group; None: all, in order
    block_tables: torch.Tensor
    seq_lens: torch.Tensor  # [rows] int64 on the device
    max_len: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # per sliding window, built on first use


@dataclass
class StaticDecode:
    """A decode step of fixed shapes, as a CUDA graph replays it (engine/graphs.py): one new token for each of the
    batch's rows, whose context lengths live on the device, and block tables of a fixed width. Attention gathers
    every row's context at that width and masks it by length, so no step depends on Python-side lengths."""

    seq_lens: torch.Tensor  # [rows] int64 on the device: tokens in context after this step
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # per sliding window, shared by the layers


@dataclass
class AttentionMetadata:
    """One forward pass's view of the paged cache. Sequences are laid out back to back in the token dimension."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset for each new token
    query_start_loc: list[int]  # [num_seqs + 1]: sequence s owns new tokens [start[s], start[s+1])
    seq_lens: list[int]  # [num_seqs]: tokens in context after this pass (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    block_size: int
    # Per sequence: the first block id when its blocks are consecutive (the common case: a fresh pool hands them out
    # in order), so its context is a view of the cache rather than a gathered copy; None otherwise.
    first_blocks: list[int | None] | None = None
    # Set for a fixed-shape decode step (a CUDA graph's): attention then reads `static`, not the lists above.
    static: StaticDecode | None = None

    # Built on first use and shared by every layer of the pass: batched decode's groups, the native kernel's lists.
    _groups: list[DecodeGroup] | None = field(default=None, init=False, repr=False)
    _single_queries: tuple[torch.Tensor, ...] | None = field(default=None, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def decode_groups(self) -> list[DecodeGroup]:
        """Sequences grouped by context length so that padding each to its group's longest wastes little: sorted by
        length, a group closes when the next sequence is more than twice its shortest (and a block) longer. A single
        group covers every sequence in batch order (no index)."""
        if self._groups is None:
            order = sorted(range(self.num_seqs), key=self.seq_lens.__getitem__)
            runs: list[list[int]] = [[order[0]]]
            for i in order[1:]:
                if self.seq_lens[i] > 2 * self.seq_lens[runs[-1][0]] + self.block_size:
                    runs.append([])
                runs[-1].append(i)
            device = self.block_tables.device
            if len(runs) == 1:
                self._groups = [DecodeGroup(None, self.block_tables, torch.tensor(self.seq_lens, device=device),
                                            max(self.seq_lens))]
            else:
                self._groups = []
                for run in runs:
                    index = torch.tensor(run, device=device)
                    lens = [self.seq_lens[i] for i in run]
                    self._groups.append(DecodeGroup(index, self.block_tables[index],
                                                    torch.tensor(lens, device=device), max(lens)))
        return self._groups

    def single_queries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequences with one new token (decodes), as int64 tensors: (its token's row, its context length, its
        row of block_tables)."""
        if self._single_queries is None:
            starts = self.query_start_loc
            seqs = [s for s in range(self.num_seqs) if starts[s + 1] - starts[s] == 1]
            n = len(seqs)
            flat = torch.tensor([starts[s] for s in seqs] + [self.seq_lens[s] for s in seqs] + seqs, dtype=torch.int64)
            self._single_queries = (flat[:n], flat[n:2 * n], flat[2 * n:])  # one copy in, three views out
        return self._single_queries  # type: ignore[return-value]

    @property
    def is_decode_only(self) -> bool:
        return self.query_start_loc[-1] == self.num_seqs


def _gather(cache: KVCacheLayer, which: str, block_table: torch.Tensor, seq_len: int, first_block: int | None,
            dtype: torch.dtype) -> torch.Tensor:
    """One sequence's K or V -> [seq_len, kv_heads, head_dim]: a view of the cache when its blocks are consecutive
    and stored in `dtype`, else a gathered copy."""
    num_blocks = -(-seq_len // cache.k.shape[1])
    index = slice(first_block, first_block + num_blocks) if first_block is not None else block_table[:num_blocks]
    return cache.read(which, index, dtype).flatten(0, 1)[:seq_len]


def _mask(query_len: int, seq_len: int, sliding_window: int | None, device: torch.device, lo: int = 0
          ) -> torch.Tensor | None:
    """Boolean [query_len, seq_len - lo] mask (True = may attend) of the last query_len positions of a context of
    seq_len over its keys from position lo on, or None where every one of those keys is visible."""
    if query_len == 1 and (sliding_window is None or seq_len - lo <= sliding_window):
        return None
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(lo, seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= q_pos - k_pos < sliding_window
    return allowed


def _write(cache: KVCacheLayer, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache.write, through the native kernels (rows split across threads, as the fused decode step stores them)
    for fp32 rows on the CPU: index_copy_ took 10 ms of SmolLM2's 512-token prefill."""
    lib = native.library()
    if lib is None or k.dtype != torch.float32 or not native.attends(k.device, cache.k.dtype, k.shape[-1]):
        cache.write(k, v, slot_mapping)
        return
    for store, scales, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        native.store_rows(lib, store, scales, slot_mapping, x)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCacheLayer,
                    meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim] -> [num_tokens, num_heads,
    head_dim]. Writes k/v into the cache first, so each query sees itself and everything before it (as stored: a
    quantized cache's rounding applies to the new tokens too)."""
    _write(cache, k, v, meta.slot_mapping)
    if meta.static is not None:
        return _static_decode(q, cache, meta, scale, sliding_window)
    lib = native.library() if q.dtype == torch.float32 and native.attends(q.device, cache.k.dtype, q.shape[-1]) \
        else None
    if lib is None:
        if meta.is_decode_only and meta.num_seqs > 1:
            return _batched_decode(q, cache, meta, scale, sliding_window)
    starts = meta.query_start_loc
    firsts = meta.first_blocks or [None] * meta.num_seqs
    if meta.num_seqs == 1 and (lib is None or starts[1] > 1):  # one sequence through SDPA: no output copy
        return _sdpa(q, cache, meta.block_tables[0], meta.seq_lens[0], firsts[0], scale, sliding_window)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if lib is not None:
        # Every decode row in one native call that reads K/V straight from the blocks (no gather, no padding).
        rows, seq_lens, table_rows = meta.single_queries()
        if rows.shape[0]:
            native.decode_attention(lib, q.contiguous(), out, rows, seq_lens, meta.block_tables, table_rows, cache.k, cache.v,
                                    cache.k_scale, cache.v_scale, scale, sliding_window)
    for s, seq_len in enumerate(meta.seq_lens):
        start, end = starts[s], starts[s + 1]
        if lib is None or end - start > 1:
            out[start:end] = _sdpa(q[start:end], cache, meta.block_tables[s], seq_len, firsts[s], scale,
                                   sliding_window)
    return out


def _sdpa(q: torch.Tensor, cache: KVCacheLayer, block_table: torch.Tensor, seq_len: int, first_block: int | None,
          scale: float, sliding_window: int | None) -> torch.Tensor:
    """One sequence's new queries [query_len, heads, head_dim] over its context, through torch's SDPA."""
    query_len = q.shape[0]
    keys = _gather(cache, "k", block_table, seq_len, first_block, q.dtype)
    values = _gather(cache, "v", block_table, seq_len, first_block, q.dtype)
    lib = native.library() if q.device.type == "cpu" and q.dtype == torch.float32 and query_len > 1 else None
    if lib is not None:  # nextoken's causal flash attention (AVX-512): 1.75x SDPA's on SmolLM2's 512-token prefill
        out = native.prefill_attention(lib, q, keys, values, scale, sliding_window)
        if out is not None:
            return out
    if sliding_window is None or seq_len <= sliding_window or query_len == 1:
        return _sdpa_span(q, keys, values, seq_len, 0, scale, sliding_window)
    # A window shorter than the context: each run of queries attends over the keys its window reaches, not over the
    # whole context masked (Gemma 3's local layers, window 512, in a chunk 8,192 deep: a sixteenth of the keys).
    step = max(sliding_window // 4, WINDOW_QUERIES)
    first = seq_len - query_len  # the position of the first query
    runs = []
    for a in range(0, query_len, step):
        b = min(a + step, query_len)
        lo = max(0, first + a - sliding_window + 1)
        runs.append(_sdpa_span(q[a:b], keys[lo:first + b], values[lo:first + b], first + b, lo, scale,
                               sliding_window))
    return torch.cat(runs) if len(runs) > 1 else runs[0]


def _sdpa_span(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int, lo: int, scale: float,
               sliding_window: int | None) -> torch.Tensor:
    """Queries [query_len, heads, head_dim], the last of a context of `seq_len`, over its keys and values from
    position `lo` on, through torch's SDPA."""
    query_len = q.shape[0]
    # [1, heads, tokens, head_dim] for SDPA; enable_gqa lets K/V keep their fewer heads.
    qs = q.transpose(0, 1).unsqueeze(0)
    ks = keys.transpose(0, 1).unsqueeze(0)
    vs = values.transpose(0, 1).unsqueeze(0)
    is_plain_causal = lo == 0 and query_len == seq_len and (sliding_window is None or seq_len <= sliding_window)
    if is_plain_causal and query_len > 1:
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    else:
        mask = _mask(query_len, seq_len, sliding_window, q.device, lo)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _batched_decode(q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float,
                    sliding_window: int | None) -> torch.Tensor:
    """One new token per sequence. Sequences of similar context length form a group (`decode_groups`); each group's
    contexts are gathered padded to its longest, and attended in one masked SDPA call."""
    groups = meta.decode_groups()
    if groups[0].index is None:
        return _decode_group(q, cache, groups[0], meta.block_size, scale, sliding_window)
    out = torch.empty_like(q)
    for group in groups:
        out[group.index] = _decode_group(q[group.index], cache, group, meta.block_size, scale, sliding_window)
    return out


def _decode_group(q: torch.Tensor, cache: KVCacheLayer, group: DecodeGroup, block_size: int, scale: float,
                  sliding_window: int | None) -> torch.Tensor:
    table = group.block_tables[:, :-(-group.max_len // block_size)]
    return _masked_decode(q, cache, table, group.seq_lens, group.max_len, group.masks, scale, sliding_window)


def _static_decode(q: torch.Tensor, cache: KVCacheLayer, meta: AttentionMetadata, scale: float,
                   sliding_window: int | None) -> torch.Tensor:
    """One new token per row over its context gathered at the block tables' full width, masked by the lengths on
    the device (StaticDecode): the same shapes and kernels whatever the lengths."""
    static = meta.static
    assert static is not None
    width = meta.block_tables.shape[1] * meta.block_size
    return _masked_decode(q, cache, meta.block_tables, static.seq_lens, width, static.masks, scale, sliding_window)


def _masked_decode(q: torch.Tensor, cache: KVCacheLayer, table: torch.Tensor, seq_lens: torch.Tensor, length: int,
                   masks: dict[int | None, torch.Tensor], scale: float, sliding_window: int | None) -> torch.Tensor:
    """One new token per row, q [rows, heads, head_dim], over the first `length` positions of the blocks `table`
    lists ([rows, blocks]), masked by each row's context length (`seq_lens` [rows] on the device) and window, in
    one SDPA call. `masks` keeps the mask per window: every layer of a pass shares it. On CUDA, the paged kernel
    instead (DECODE_KERNEL)."""
    if _paged_kernel(q, cache, length):
        from nextoken.ops import cuda_attention  # noqa: PLC0415 - imports Triton, which CPU runs never need

        return cuda_attention.paged_decode(q, cache.k, cache.v, table, seq_lens, scale, sliding_window)
    # [rows, blocks * block_size, kv_heads, head_dim], cut to `length`
    keys = cache.read("k", table, q.dtype).flatten(1, 2)[:, :length]
    values = cache.read("v", table, q.dtype).flatten(1, 2)[:, :length]
    allowed = masks.get(sliding_window)
    if allowed is None:
        lens = seq_lens[:, None]
        k_pos = torch.arange(length, device=q.device)[None, :]
        allowed = k_pos < lens  # [rows, length]
        if sliding_window is not None:
            allowed &= (lens - 1) - k_pos < sliding_window
        allowed = masks[sliding_window] = allowed[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [rows, heads, 1, head_dim]
        keys.transpose(1, 2), values.transpose(1, 2), attn_mask=allowed, scale=scale, enable_gqa=True)
    return o.squeeze(2)


def _paged_kernel(q: torch.Tensor, cache: KVCacheLayer, length: int) -> bool:
    """Whether decode rows q over tables `length` tokens wide take the paged Triton kernel: on CUDA (or wherever
    DECODE_KERNEL is "triton-everywhere", the tests' switch for Triton's interpreter), with a float cache, where it
    measured faster (PAGED_MAX_TOKENS), where Triton is installed."""
    if cache.k_scale is not None or not (DECODE_KERNEL == "triton-everywhere" or
                                         (DECODE_KERNEL == "triton" and q.is_cuda)):
        return False
    if length > (PAGED_FEW_ROWS_MAX_TOKENS if q.shape[0] <= PAGED_FEW_ROWS else PAGED_MAX_TOKENS):
        return False
    from nextoken.ops import cuda_attention  # noqa: PLC0415

    return cuda_attention.available()

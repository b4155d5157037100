"""Decode attention on CUDA's paged kernel (ops/cuda_attention.py) against the SDPA route over the gathered context:
grouped-query heads, head sizes that are not powers of two, scattered blocks in tables wider than the contexts,
sliding windows, fp32 and bf16 caches and queries, and through `paged_attention` as a CUDA graph's fixed-shape step
calls it. Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nextoken.cache.kv_pool import KVPool, KVShape
from nextoken.ops import attention, cuda_attention
from nextoken.ops.attention import AttentionMetadata, StaticDecode, paged_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def filled_pool(heads: int, kv_heads: int, head_dim: int, block: int, dtype: torch.dtype, seed: int) -> KVPool:
    pool = KVPool(KVShape(1, kv_heads, head_dim, dtype), 40, block, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    layer = pool.layers[0]
    layer.k.copy_((torch.randn(layer.k.shape, generator=gen) * 2).to(dtype))
    layer.v.copy_(torch.randn(layer.v.shape, generator=gen).to(dtype))
    return pool


def tables_and_lengths(block: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of scattered blocks (a permutation of the pool's), 8 blocks wide, and contexts of 1 token, exactly two
    blocks, a block and a bit, and the whole width."""
    gen = torch.Generator().manual_seed(seed)
    tables = torch.randperm(40, generator=gen)[:32].reshape(4, 8)
    lengths = torch.tensor([1, 2 * block, block + 3, 8 * block])
    return tables.to(DEVICE), lengths.to(DEVICE)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block"), [(6, 2, 24, 4), (4, 1, 64, 16)])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("q_dtype", ["fp32", "bf16"])
def test_paged_kernel_matches_sdpa_over_the_gathered_context(q_dtype: str, kv_dtype: str, heads: int,
                                                             kv_heads: int, head_dim: int, block: int,
                                                             window: int | None,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    pool = filled_pool(heads, kv_heads, head_dim, block, DTYPES[kv_dtype], seed=head_dim)
    tables, lengths = tables_and_lengths(block, seed=block)
    q = torch.randn(4, heads, head_dim, generator=torch.Generator().manual_seed(1)).to(DEVICE, DTYPES[q_dtype])
    scale = 1 / math.sqrt(head_dim)
    out = cuda_attention.paged_decode(q, pool.layers[0].k, pool.layers[0].v, tables, lengths, scale, window)
    assert out.dtype == q.dtype and out.shape == q.shape
    monkeypatch.setattr(attention, "DECODE_KERNEL", "sdpa")
    expected = attention._masked_decode(q.float(), pool.layers[0], tables, lengths, tables.shape[1] * block, {},
                                        scale, window)
    tolerance = 1e-5 if q_dtype == "fp32" else 1e-2  # bf16 output: its rounding
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@settings(max_examples=30, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 5), head_dim=st.sampled_from([8, 24, 64, 80]),
       block=st.sampled_from([1, 4, 16]), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       window=st.one_of(st.none(), st.integers(1, 20)), seed=st.integers(0, 2**16))
def test_any_shape_matches_sdpa(kv_heads: int, group: int, head_dim: int, block: int, lengths: list[int],
                                window: int | None, seed: int) -> None:
    """Any grouping of query heads, head size, block size, contexts (1 token to several blocks, a table as wide as
    the longest) and window: the kernel's output is the SDPA route's."""
    heads, width = kv_heads * group, -(-max(lengths) // block)
    pool = KVPool(KVShape(1, kv_heads, head_dim, torch.float32), len(lengths) * width, block, DEVICE)
    gen = torch.Generator().manual_seed(seed)
    pool.layers[0].k.copy_(torch.randn(pool.layers[0].k.shape, generator=gen) * 2)
    pool.layers[0].v.copy_(torch.randn(pool.layers[0].v.shape, generator=gen))
    tables = torch.randperm(len(lengths) * width, generator=gen).reshape(len(lengths), width).to(DEVICE)
    seq_lens = torch.tensor(lengths).to(DEVICE)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(DEVICE)
    scale = 1 / math.sqrt(head_dim)
    out = cuda_attention.paged_decode(q, pool.layers[0].k, pool.layers[0].v, tables, seq_lens, scale, window)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention, "DECODE_KERNEL", "sdpa")
        expected = attention._masked_decode(q, pool.layers[0], tables, seq_lens, width * block, {}, scale, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_fixed_shape_decode_steps_take_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """`paged_attention` with StaticDecode metadata (a CUDA graph's step): the new tokens are written, then each
    row attends over its blocks through the kernel, as the SDPA route would."""
    heads, kv_heads, head_dim, block = 6, 2, 24, 4
    monkeypatch.setattr(attention, "DECODE_KERNEL", "triton" if DEVICE.type == "cuda" else "triton-everywhere")
    calls = []
    real = cuda_attention.paged_decode
    monkeypatch.setattr(cuda_attention, "paged_decode", lambda *args: calls.append(1) or real(*args))
    results = []
    for kernel in ("kernel", "sdpa"):
        if kernel == "sdpa":
            monkeypatch.setattr(attention, "DECODE_KERNEL", "sdpa")
        pool = filled_pool(heads, kv_heads, head_dim, block, torch.float32, seed=5)
        tables, lengths = tables_and_lengths(block, seed=6)
        slots = tables[torch.arange(4), (lengths - 1) // block] * block + (lengths - 1) % block
        gen = torch.Generator().manual_seed(2)
        q, k, v = (torch.randn(4, h, head_dim, generator=gen).to(DEVICE) for h in (heads, kv_heads, kv_heads))
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=[0, 1, 2, 3, 4], seq_lens=lengths.tolist(),
                                 block_tables=tables, block_size=block, static=StaticDecode(lengths))
        results.append(paged_attention(q, k, v, pool.layers[0], meta, 1 / math.sqrt(head_dim), None))
    assert calls == [1]
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


def test_int8_caches_and_long_tables_keep_the_sdpa_route(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel where it measured faster: float caches, tables up to 1,024 tokens for up to 16 rows, 256 for
    more."""
    monkeypatch.setattr(attention, "DECODE_KERNEL", "triton-everywhere")
    floats = KVPool(KVShape(1, 2, 64, torch.float32), 2, 4, DEVICE).layers[0]
    few, many = torch.zeros(16, 4, 64, device=DEVICE), torch.zeros(17, 4, 64, device=DEVICE)
    assert attention._paged_kernel(few, floats, 1024) and attention._paged_kernel(many, floats, 256)
    assert not attention._paged_kernel(few, floats, 1025) and not attention._paged_kernel(many, floats, 257)
    assert not attention._paged_kernel(few, KVPool(KVShape(1, 2, 64, torch.int8), 2, 4, DEVICE).layers[0], 16)
    monkeypatch.setattr(attention, "DECODE_KERNEL", "sdpa")
    assert not attention._paged_kernel(few, floats, 16)

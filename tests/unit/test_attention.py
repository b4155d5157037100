"""Paged attention against a plain per-token reference: sequences in scattered or consecutive blocks, mixed prefill
chunks and decode, batched decode, sliding windows, and every KV storage format (the reference attends over K/V
rounded as the cache stores them, so any slot, block or scale mix-up shows)."""

from __future__ import annotations

import math

import pytest
import torch

from nextoken.cache.kv_pool import KVPool, KVShape, dequantize_int8, quantize_int8
from nextoken.ops import native
from nextoken.ops.attention import WINDOW_QUERIES, AttentionMetadata, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 4


@pytest.fixture(autouse=True, params=["native", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs on the native decode kernel and on the torch path it falls back to."""
    if request.param == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    elif native.library() is None:
        pytest.fail("the native kernels did not build")
    return request.param
STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def stored(x: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    if kv_dtype == "int8":
        return dequantize_int8(*quantize_int8(x), torch.float32)
    return x.to(STORAGE[kv_dtype]).float()


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int, window: int | None
              ) -> torch.Tensor:
    """One query [heads, dim] at `position` over keys/values [>position, kv_heads, dim] of its sequence."""
    out = torch.empty(HEADS, HEAD_DIM)
    lo = 0 if window is None else max(0, position - window + 1)
    for h in range(HEADS):
        kh = h // (HEADS // KV_HEADS)
        scores = keys[lo:position + 1, kh] @ q[h] / math.sqrt(HEAD_DIM)
        out[h] = scores.softmax(0) @ values[lo:position + 1, kh]
    return out


class Sequences:
    def __init__(self, tables: list[list[int]], kv_dtype: str, window: int | None, num_blocks: int = 32) -> None:
        self.tables = tables
        self.kv_dtype, self.window = kv_dtype, window
        self.pool = KVPool(KVShape(1, KV_HEADS, HEAD_DIM, STORAGE[kv_dtype]), num_blocks, BLOCK, torch.device("cpu"))
        self.keys = [torch.empty(0, KV_HEADS, HEAD_DIM) for _ in tables]
        self.values = [torch.empty(0, KV_HEADS, HEAD_DIM) for _ in tables]

    def step(self, new_tokens: list[int], gen: torch.Generator) -> None:
        """Feed new_tokens[s] tokens to each sequence s (0: not in this pass) and check every output row."""
        seqs = [s for s, n in enumerate(new_tokens) if n]
        slots, starts, seq_lens, firsts = [], [0], [], []
        for s in seqs:
            done = len(self.keys[s])
            slots += [self.tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in range(done, done + new_tokens[s])]
            starts.append(starts[-1] + new_tokens[s])
            seq_lens.append(done + new_tokens[s])
            table = self.tables[s]
            firsts.append(table[0] if table == list(range(table[0], table[0] + len(table))) else None)
        width = max(len(self.tables[s]) for s in seqs)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), query_start_loc=starts, seq_lens=seq_lens,
            block_tables=torch.tensor([self.tables[s] + [0] * (width - len(self.tables[s])) for s in seqs]),
            block_size=BLOCK, first_blocks=firsts)
        n = starts[-1]
        q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) * 3
        v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
        out = paged_attention(q.clone(), k, v, self.pool.layers[0], meta, 1 / math.sqrt(HEAD_DIM), self.window)
        for i, s in enumerate(seqs):
            a, b = starts[i], starts[i + 1]
            self.keys[s] = torch.cat((self.keys[s], stored(k[a:b], self.kv_dtype)))
            self.values[s] = torch.cat((self.values[s], stored(v[a:b], self.kv_dtype)))
            for row in range(a, b):
                position = seq_lens[i] - (b - row)
                expected = reference(q[row], self.keys[s], self.values[s], position, self.window)
                torch.testing.assert_close(out[row], expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
def test_paged_attention_matches_reference(kv_dtype: str, window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    # Sequence 0 owns consecutive blocks (read as a view), 1 and 2 scattered ones, interleaved with each other.
    seqs = Sequences([[3, 4, 5, 6, 7], [20, 9, 31, 1, 14], [12, 0, 25, 18, 27]], kv_dtype, window)
    seqs.step([5, 9, 3], gen)  # mixed prefill of three sequences
    seqs.step([1, 1, 1], gen)  # batched decode
    seqs.step([6, 1, 0], gen)  # a prefill chunk beside a decode
    seqs.step([0, 0, 1], gen)  # one sequence alone (scattered blocks)
    seqs.step([1, 0, 0], gen)  # one sequence alone (consecutive blocks: a view of the cache)
    seqs.step([1, 1, 1], gen)  # batched decode past the window, contexts of different lengths


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_prefill_chunks_longer_than_the_window(kv_dtype: str) -> None:
    """Chunks many windows long, from the start and after cached context: their queries attend in runs, each over
    the keys its window reaches (WINDOW_QUERIES a run where the window is shorter), not over the masked context."""
    assert WINDOW_QUERIES > 6
    gen = torch.Generator().manual_seed(3)
    seqs = Sequences([list(range(16)), [30, 22, 17, 29, 21, 25, 26, 18, 16, 28, 19, 27, 24, 31, 20, 23]], kv_dtype, 6)
    seqs.step([40, 7], gen)  # from position 0: three runs of up to 16 queries, and a chunk of one run
    seqs.step([23, 33], gen)  # after 40 and 7 cached tokens, runs starting mid-context
    seqs.step([1, 1], gen)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_batched_decode_groups_far_apart_lengths(kv_dtype: str, window: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    seqs = Sequences([[30, 31], [20, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [13, 14, 15, 16, 17, 18]], kv_dtype, window)
    seqs.step([3, 40, 21], gen)
    meta_lengths = [4, 41, 22]
    # Contexts of 4, 22 and 41 tokens: padding all to 41 would be mostly waste; they decode in two groups.
    groups = AttentionMetadata(torch.zeros(3, dtype=torch.long), [0, 1, 2, 3], meta_lengths,
                               torch.zeros(3, 11, dtype=torch.long), BLOCK).decode_groups()
    assert [group.seq_lens.tolist() for group in groups] == [[4], [22, 41]]
    seqs.step([1, 1, 1], gen)
    seqs.step([1, 1, 1], gen)


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
def test_long_context_decode_split_across_threads(kv_dtype: str, window: int | None) -> None:
    """One or two sequences with hundreds of tokens: the native kernel splits each context into parts attended on
    separate threads and merges them by their softmax statistics (parts of 128 positions or more)."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(2)
    order = torch.randperm(200, generator=gen).tolist()  # scattered blocks
    seqs = Sequences([order[:100], order[100:]], kv_dtype, window, num_blocks=200)
    seqs.step([300, 0], gen)
    seqs.step([1, 0], gen)  # 301 positions: two parts of 151
    seqs.step([0, 130], gen)
    seqs.step([1, 1], gen)  # as many sequences as threads: one part each
    seqs.step([0, 1], gen)  # 132 positions: a part of 128 and one of 4


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
def test_short_context_decode_split_by_heads(kv_dtype: str) -> None:
    """One sequence whose context is too short to split into parts (16 to 127 positions): the native kernel shares
    its query heads between the threads, each reading its own heads' kv heads (heads 2 and 3 read kv head 1)."""
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(3)
    seqs = Sequences([[9, 2, 17, 5, 30, 11, 0, 23, 14, 6, 27]], kv_dtype, None)
    seqs.step([15], gen)
    seqs.step([1], gen)  # 16 positions: the first split by heads
    seqs.step([24], gen)
    seqs.step([1], gen)

"""KV blocks: a free list, reference counts, and the prefix cache (full blocks keyed by chained hashes).

Invariants (checked by `check_integrity`): every block is either referenced (ref_count > 0), or free; a free block
may still hold a cached prefix (then it sits in the LRU `evictable` list and can be revived by a hit, or handed out
once the plain free list is empty, losing its hash). A block's hash covers its parent's hash and its token ids; a hit
is confirmed against the stored token ids, so a hash collision never serves another request's blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and its KV written
    token_ids: tuple[int, ...] = ()  # the tokens the hash covers, to confirm hits


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    return hash((parent, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # never hashed, or hash dropped
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently used first
        self.cached: dict[int, int] = {}  # block hash -> block id

    # --- queries ---------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Block ids of the longest cached run of full blocks that starts `token_ids` (not yet referenced).

        At most (len - 1) tokens are covered: the last token must be computed to produce logits.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            chunk = tuple(token_ids[start:start + bs])
            h = chain_hash(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
            parent = h
        return hits

    # --- changes ---------------------------------------------------------------------------------------------

    def take_cached(self, block_ids: Sequence[int]) -> None:
        """Reference blocks found by `find_cached_prefix`."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self.evictable.pop(block_id)
            block.ref_count += 1

    def allocate(self, num_blocks: int) -> list[int] | None:
        """num_blocks fresh blocks, or None (and nothing taken) when there are not enough."""
        if num_blocks > self.num_free_blocks:
            return None
        out = []
        for _ in range(num_blocks):
            if self.free_ids:
                block_id = self.free_ids.popleft()
            else:
                block_id, _ = self.evictable.popitem(last=False)  # evict the least recently used prefix
                self._uncache(block_id)
            self.blocks[block_id].ref_count = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced cached blocks stay findable until evicted.

        Blocks are released last-first, so a sequence's tail is evicted before the prefix others may share.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)

    def cache_full_blocks(self, block_table: Sequence[int], token_ids: Sequence[int], num_cached: int,
                          num_full: int) -> None:
        """Register blocks num_cached..num_full-1 of a sequence (now full and written) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = self.blocks[block_table[num_cached - 1]].block_hash if num_cached else None
        for i in range(num_cached, num_full):
            block = self.blocks[block_table[i]]
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(parent, chunk)
            if block.block_hash is None:
                existing = self.cached.get(h)
                if existing is None or self.blocks[existing].token_ids != chunk:
                    block.block_hash, block.token_ids = h, chunk
                    self.cached[h] = block.block_id
            parent = h

    def _uncache(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
            del self.cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()

    def reset_prefix_cache(self) -> None:
        for block_id in list(self.evictable):
            self._uncache(block_id)
            self.free_ids.append(block_id)
        self.evictable.clear()

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent; `expected_refs`: block id -> references held by
        live sequences (when given, must match exactly)."""
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        assert not free & set(self.evictable), "a block is both free and evictable"
        for block in self.blocks:
            listed = block.block_id in self.evictable or block.block_id in free
            assert (block.ref_count == 0) == listed, f"block {block.block_id}: ref_count {block.ref_count}"
            if block.block_id in self.evictable:
                assert block.block_hash is not None
            if expected_refs is not None:
                assert block.ref_count == expected_refs.get(block.block_id, 0), f"block {block.block_id} refs"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == h

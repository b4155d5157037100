"""KV blocks: a free list, reference counts, and the prefix cache (full blocks keyed by chained hashes).

Invariants (checked by `check_integrity`): every block is either referenced (ref_count > 0), or free; a free block
may still hold a cached prefix (then it sits in the LRU `evictable` list and can be revived by a hit, or handed out
once the plain free list is empty, losing its hash). A block's hash covers its parent's hash and its token ids. A hit
is confirmed exactly, never by hash alone: the block's own token ids and the identity (`prefix_id`) of the prefix it
was computed after must both match, so a hash collision, of a block's tokens or of everything before them, never
serves KV computed from other tokens. Blocks holding the same prefix (two requests computed it before either
registered it) share its prefix id, and all of them can serve hits.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and its KV written
    token_ids: tuple[int, ...] = ()  # the tokens the hash covers, to confirm hits
    # Which exact prefix (every token from position 0 to this block's end) the KV belongs to, and which prefix came
    # before this block's tokens (None: a first block). Ids are never reused, so an id names one run of tokens.
    prefix_id: int | None = None
    parent_prefix_id: int | None = None


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """The prefix cache's key for a full block: its parent block's hash and its own token ids."""
    return hash((parent, tuple(token_ids)))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Holding nothing worth keeping: a stack, so that the blocks freed last are taken first. Their pages are
        # resident and maybe still in cache; a queue would walk the whole pool, touching never-written pages that
        # fault in at every new block (10 ms of a 512-token prefill until the pool has been used once).
        self.free_ids: deque[int] = deque(reversed(range(num_blocks)))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently used first
        # block hash -> the registered blocks with that hash, in registration order: copies of one prefix, or
        # (after a collision) different prefixes, told apart by `_holds`
        self.cached: dict[int, list[int]] = {}
        self._prefix_ids = itertools.count()

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
        parent_hash: int | None = None
        parent_prefix: int | None = None
        bs = self.block_size
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            chunk = tuple(token_ids[start:start + bs])
            h = chain_hash(parent_hash, chunk)
            block_id = self._lookup(h, chunk, parent_prefix)
            if block_id is None:
                break
            hits.append(block_id)
            parent_hash, parent_prefix = h, self.blocks[block_id].prefix_id
        return hits

    def _lookup(self, block_hash: int, chunk: tuple[int, ...], parent_prefix: int | None) -> int | None:
        """A registered block holding the KV of `chunk` computed right after the prefix `parent_prefix`: a
        referenced one first (taking it revives nothing), else the first registered; None if there is none."""
        found = None
        for block_id in self.cached.get(block_hash, ()):
            block = self.blocks[block_id]
            if block.token_ids == chunk and block.parent_prefix_id == parent_prefix:
                if block.ref_count > 0:
                    return block_id
                if found is None:
                    found = block_id
        return found

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
                block_id = self.free_ids.pop()
            else:
                block_id, _ = self.evictable.popitem(last=False)  # evict the least recently used prefix
                self._uncache(block_id)
            self.blocks[block_id].ref_count = 1
            out.append(block_id)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced cached blocks stay findable until evicted.

        Blocks are released last-first, so a sequence's tail is evicted before the prefix it was computed after.
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.prefix_id is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_ids.append(block_id)

    def cache_full_blocks(self, block_table: Sequence[int], token_ids: Sequence[int], num_cached: int,
                          num_full: int) -> None:
        """Register blocks num_cached..num_full-1 of a sequence (now full and written) in the prefix cache.

        Blocks 0..num_cached-1 must be registered already (by this call earlier, or as hits).
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent_hash: int | None = None
        parent_prefix: int | None = None
        if num_cached:
            parent = self.blocks[block_table[num_cached - 1]]
            assert parent.prefix_id is not None, f"block {parent.block_id} precedes new blocks but is unregistered"
            parent_hash, parent_prefix = parent.block_hash, parent.prefix_id
        for i in range(num_cached, num_full):
            block = self.blocks[block_table[i]]
            if block.prefix_id is None:
                chunk = tuple(token_ids[i * bs:(i + 1) * bs])
                h = chain_hash(parent_hash, chunk)
                same = self._lookup(h, chunk, parent_prefix)
                # A copy of a registered prefix takes its id, so blocks registered after either copy chain on both.
                block.prefix_id = self.blocks[same].prefix_id if same is not None else next(self._prefix_ids)
                block.block_hash, block.token_ids, block.parent_prefix_id = h, chunk, parent_prefix
                self.cached.setdefault(h, []).append(block.block_id)
            parent_hash, parent_prefix = block.block_hash, block.prefix_id

    def _uncache(self, block_id: int) -> None:
        """Forget what the block holds (it is about to be overwritten)."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            bucket = self.cached[block.block_hash]
            bucket.remove(block_id)
            if not bucket:
                del self.cached[block.block_hash]
        block.block_hash, block.token_ids, block.prefix_id, block.parent_prefix_id = None, (), None, None

    def reset_prefix_cache(self) -> None:
        """Drop every unreferenced cached prefix (blocks in use keep theirs)."""
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
            registered = block.prefix_id is not None
            assert registered == (block.block_hash is not None), f"block {block.block_id}: half registered"
            if block.block_hash is not None:  # registered
                assert self.cached.get(block.block_hash, []).count(block.block_id) == 1, \
                    f"block {block.block_id} is not findable by its hash"
            if block.block_id in self.evictable:
                assert registered, f"evictable block {block.block_id} holds no prefix"
            if block.block_id in free:
                assert not registered, f"free block {block.block_id} still holds a prefix"
            if expected_refs is not None:
                assert block.ref_count == expected_refs.get(block.block_id, 0), f"block {block.block_id} refs"
        for h, bucket in self.cached.items():
            assert bucket and all(self.blocks[b].block_hash == h for b in bucket), f"hash {h}: stale entries"

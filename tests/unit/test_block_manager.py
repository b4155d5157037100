"""The BlockManager against a model of its own: random allocate / find_cached_prefix + take_cached / free /
cache_full_blocks sequences, driven directly, with reference counts, prefix hits and LRU eviction predicted from the
exact token prefix each block's KV was computed from (no hashing), and every hit checked against those tokens.
With `chain_hash` forced to collide, no hit may ever serve KV computed from other tokens. Last, the same property end
to end on a tiny model, against an engine without a prefix cache.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from nextoken import LLM, SamplingParams
from nextoken.cache import block_manager
from nextoken.cache.block_manager import BlockManager

# Token ids from a small alphabet, cut from a few documents that share beginnings, so prefixes repeat often.
_rng = random.Random(7)
_STEM = [_rng.randrange(3) for _ in range(8)]
DOCUMENTS = [_STEM + [_rng.randrange(3) for _ in range(24)] for _ in range(3)] + \
    [[_rng.randrange(3) for _ in range(32)]]

# From a document's start (shared prefixes) or from its middle (a later block's tokens at position 0).
token_lists = st.builds(
    lambda doc, start, cut, tail: DOCUMENTS[doc][start:start + cut] + tail,
    st.integers(0, len(DOCUMENTS) - 1), st.sampled_from([0, 0, 2, 4, 8]), st.integers(1, 16),
    st.lists(st.integers(0, 2), max_size=4))

SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# How often the interesting paths ran over all examples of a test, checked afterwards so that a generator that no
# longer reaches hits, sharing or eviction cannot let the properties pass vacuously.
seen: Counter[str] = Counter()


@dataclass
class Seq:
    """The test's view of one sequence: its tokens, the blocks it holds, and how many tokens have KV written."""

    token_ids: list[int]
    block_table: list[int]
    num_computed: int
    num_cached: int  # leading blocks registered in the prefix cache (or taken as hits)


@dataclass
class Model:
    """What the BlockManager should hold, computed without hashes: who references each block, which full prefix
    each block's KV was computed from, which blocks are registered (findable) and in what order unreferenced ones
    age. A hit takes, for each block of the prompt, a registered block whose KV was computed from exactly that
    prefix: a referenced one first, else the earliest registered."""

    num_blocks: int
    block_size: int
    seqs: dict[int, Seq] = field(default_factory=dict)
    kv_of: dict[int, tuple] = field(default_factory=dict)  # block -> the token prefix its KV encodes
    registered: dict[int, int] = field(default_factory=dict)  # block -> registration order
    lru: list[int] = field(default_factory=list)  # unreferenced registered blocks, least recently released first
    num_registrations: int = 0

    def refs(self) -> Counter[int]:
        return Counter(b for s in self.seqs.values() for b in s.block_table)

    def plain_free(self) -> set[int]:
        held = self.refs()
        return {b for b in range(self.num_blocks) if held[b] == 0} - set(self.lru)

    def register(self, block: int) -> None:
        self.registered[block] = self.num_registrations
        self.num_registrations += 1

    def forget(self, block: int) -> None:
        self.registered.pop(block, None)
        self.kv_of.pop(block, None)

    def expected_hits(self, token_ids: Sequence[int]) -> list[int]:
        hits: list[int] = []
        held = self.refs()
        bs = self.block_size
        while (len(hits) + 1) * bs <= len(token_ids) - 1:
            prefix = tuple(token_ids[:(len(hits) + 1) * bs])
            holders = sorted((order, b) for b, order in self.registered.items() if self.kv_of[b] == prefix)
            if not holders:
                break
            in_use = [b for _, b in holders if held[b] > 0]
            hits.append(in_use[0] if in_use else holders[0][1])
        return hits

    def release(self, block_ids: Sequence[int], held: Counter[int]) -> None:
        """Blocks whose last reference went (`held` counts the references left), last block first."""
        for b in reversed(block_ids):
            if held[b] == 0 and b in self.registered and b not in self.lru:
                self.lru.append(b)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random operation sequences; after every step the manager's counts must equal the model's."""

    exact = True  # False when hashes are forced to collide: only safety is checked, not which prefixes are found

    @initialize(num_blocks=st.integers(2, 16), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.model = Model(num_blocks, block_size)
        self.next_id = 0

    def _check_hits(self, token_ids: Sequence[int], hits: Sequence[int]) -> None:
        bs = self.model.block_size
        assert len(hits) * bs <= len(token_ids) - 1, "a hit covered the last prompt token"
        for i, b in enumerate(hits):
            # The decisive check: the KV in a hit block was computed from exactly these tokens, from position 0.
            assert self.model.kv_of.get(b) == tuple(token_ids[:(i + 1) * bs]), \
                f"block {b} served as block {i} of {list(token_ids)} but holds KV of {self.model.kv_of.get(b)}"
        if self.exact:
            assert list(hits) == self.model.expected_hits(token_ids)
        seen["hit"] += bool(hits)

    def _allocate(self, num: int) -> list[int] | None:
        """bm.allocate, checked: None exactly when too few blocks; fresh blocks first, then the LRU cached ones."""
        model = self.model
        plain, lru = model.plain_free(), list(model.lru)
        got = self.bm.allocate(num)
        if num > len(plain) + len(lru):
            assert got is None
            return None
        assert got is not None and len(got) == num and len(set(got)) == num
        assert not set(got) & set(model.refs()), "allocate handed out a block someone holds"
        num_evicted = max(0, num - len(plain))
        seen["eviction"] += num_evicted > 0
        if self.exact:
            assert set(got) - plain == set(lru[:num_evicted]), "eviction did not take the least recently used"
        for b in got:
            if b in model.lru:
                model.lru.remove(b)
            model.forget(b)
        return got

    @rule(token_ids=token_lists, compute_all=st.booleans())
    def add_seq(self, token_ids: list[int], compute_all: bool) -> None:
        """Find cached blocks for a new sequence, take them, and allocate the rest (or give up if full); maybe
        compute the whole prompt at once."""
        bm, model = self.bm, self.model
        hits = bm.find_cached_prefix(token_ids)
        self._check_hits(token_ids, hits)
        bm.take_cached(hits)
        for b in hits:
            if b in model.lru:
                model.lru.remove(b)
        model.seqs[-1] = Seq(token_ids, list(hits), len(hits) * model.block_size, len(hits))  # holds the hits
        blocks = self._allocate(bm.blocks_needed(len(token_ids)) - len(hits))
        del model.seqs[-1]
        if blocks is None:
            bm.free(hits)
            model.release(hits, model.refs())
            return
        model.seqs[self.next_id] = Seq(token_ids, hits + blocks, len(hits) * model.block_size, len(hits))
        if compute_all:
            self._compute(model.seqs[self.next_id], len(token_ids))
        self.next_id += 1

    @precondition(lambda self: any(s.num_computed < len(s.token_ids) for s in self.model.seqs.values()))
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """Write KV for the next chunk of a sequence, then register its newly full blocks."""
        model = self.model
        key = data.draw(st.sampled_from(sorted(k for k, s in model.seqs.items() if s.num_computed < len(s.token_ids))))
        seq = model.seqs[key]
        self._compute(seq, seq.num_computed + data.draw(st.integers(1, len(seq.token_ids) - seq.num_computed)))

    def _compute(self, seq: Seq, end: int) -> None:
        model, bs = self.model, self.model.block_size
        held = model.refs()
        for idx in range(seq.num_computed // bs, -(-end // bs)):
            block = seq.block_table[idx]
            assert held[block] == 1, f"writing into block {block}, which {held[block]} sequences hold"
            full = (idx + 1) * bs <= end
            model.kv_of[block] = tuple(seq.token_ids[:(idx + 1) * bs]) if full else ("partial",)  # type: ignore
        seq.num_computed = end
        num_full = end // bs
        self.bm.cache_full_blocks(seq.block_table, seq.token_ids, seq.num_cached, num_full)
        for idx in range(seq.num_cached, num_full):
            model.register(seq.block_table[idx])
        seq.num_cached = num_full

    @precondition(lambda self: bool(self.model.seqs))
    @rule(data=st.data(), new_ids=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def extend(self, data: st.DataObject, new_ids: list[int]) -> None:
        """Append tokens (decode), allocating blocks for them when the last block fills up."""
        seq = self.model.seqs[data.draw(st.sampled_from(sorted(self.model.seqs)))]
        blocks = self._allocate(self.bm.blocks_needed(len(seq.token_ids) + len(new_ids)) - len(seq.block_table))
        if blocks is not None:
            seq.block_table += blocks
            seq.token_ids = seq.token_ids + new_ids

    @precondition(lambda self: bool(self.model.seqs))
    @rule(data=st.data())
    def free_seq(self, data: st.DataObject) -> None:
        seq = self.model.seqs.pop(data.draw(st.sampled_from(sorted(self.model.seqs))))
        self.bm.free(seq.block_table)
        self.model.release(seq.block_table, self.model.refs())

    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()
        for b in self.model.lru:
            self.model.forget(b)
        self.model.lru.clear()

    @invariant()
    def bookkeeping_matches_the_model(self) -> None:
        if not hasattr(self, "bm"):
            return
        refs = self.model.refs()
        self.bm.check_integrity(expected_refs=dict(refs))
        assert self.bm.num_free_blocks == self.model.num_blocks - len(refs)
        # A block in two tables must be one prefix block both sequences computed past, at the same position.
        for seq in self.model.seqs.values():
            assert len(set(seq.block_table)) == len(seq.block_table), f"a block twice in {seq.block_table}"
        for block, count in refs.items():
            if count > 1:
                seen["shared block"] += 1
                holders = [s for s in self.model.seqs.values() if block in s.block_table]
                positions = {s.block_table.index(block) for s in holders}
                assert len(positions) == 1, f"block {block} shared at different positions"
                idx = positions.pop()
                assert all(self.model.kv_of[block] == tuple(s.token_ids[:(idx + 1) * self.model.block_size])
                           for s in holders), f"block {block} shared by sequences with different prefixes"
        if self.exact:
            assert list(self.bm.evictable) == self.model.lru

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self.model.seqs.values():
            self.bm.free(seq.block_table)
        self.bm.check_integrity(expected_refs={})
        assert self.bm.num_free_blocks == self.bm.num_blocks


class CollidingBlockManagerMachine(BlockManagerMachine):
    exact = False


def test_random_operations_keep_the_model() -> None:
    seen.clear()
    run_state_machine_as_test(BlockManagerMachine, settings=SETTINGS)
    assert seen["hit"] and seen["eviction"] and seen["shared block"], dict(seen)


@pytest.mark.parametrize("colliding_hash", [lambda parent, ids: 0, lambda parent, ids: hash((parent, tuple(ids))) % 3],
                         ids=["constant", "three-values"])
def test_colliding_hashes_never_serve_other_tokens(monkeypatch: pytest.MonkeyPatch,
                                                   colliding_hash: Callable[[int | None, Sequence[int]], int]) -> None:
    monkeypatch.setattr(block_manager, "chain_hash", colliding_hash)
    seen.clear()
    run_state_machine_as_test(CollidingBlockManagerMachine, settings=SETTINGS)
    assert seen["hit"], "no hit at all: the collision test checked nothing"


# --- the same properties, spelled out on fixed examples -------------------------------------------------------


def _computed(bm: BlockManager, token_ids: list[int]) -> list[int]:
    """A sequence with every token's KV written and its full blocks registered; returns its block table."""
    blocks = bm.allocate(bm.blocks_needed(len(token_ids)))
    assert blocks is not None
    bm.cache_full_blocks(blocks, token_ids, 0, len(token_ids) // bm.block_size)
    return blocks


def test_colliding_hash_does_not_serve_a_block_computed_after_another_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same tokens, other prefix: [3, 4] computed at positions 2-3 after [1, 2] is no first block for [3, 4, ...]."""
    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, ids: 0)
    bm = BlockManager(8, 2)
    first = _computed(bm, [1, 2, 3, 4])
    assert bm.find_cached_prefix([3, 4, 9]) == []
    assert bm.find_cached_prefix([3, 3, 9]) == []
    assert bm.find_cached_prefix([1, 2, 3, 4, 9]) == first  # collisions cost lookups, not hits
    other = _computed(bm, [3, 4, 1, 2])
    assert bm.find_cached_prefix([3, 4, 1, 2, 9]) == other
    assert bm.find_cached_prefix([1, 2, 1, 2, 9]) == first[:1]


def test_duplicate_prefix_chains_later_blocks_from_the_right_prefix() -> None:
    """Two sequences computed the same prompt before either registered it; the second's later blocks must not be
    registered as if they started a sequence."""
    bm = BlockManager(10, 4)
    prompt = list(range(100, 110))
    first = _computed(bm, prompt)
    second = _computed(bm, prompt)
    second_ids = prompt + [7, 8]  # the second sequence decodes two tokens: its third block is full now
    bm.cache_full_blocks(second, second_ids, 2, 3)
    assert bm.find_cached_prefix([108, 109, 7, 8, 55]) == []
    assert bm.find_cached_prefix(second_ids + [1]) == first[:2] + [second[2]]
    bm.free(second)  # unreferenced now, the second's third block still serves hits after the first's blocks
    assert bm.find_cached_prefix(second_ids + [1]) == first[:2] + [second[2]]
    bm.free(first)
    bm.check_integrity(expected_refs={})
    assert bm.num_free_blocks == bm.num_blocks


def test_lru_evicts_the_least_recently_released_prefix_first() -> None:
    bm = BlockManager(4, 2)
    a = _computed(bm, [1, 1, 1, 1])  # two full blocks
    b = _computed(bm, [2, 2, 2, 2])
    bm.free(a)
    bm.free(b)  # evictable, oldest first: a's tail, a's head, b's tail, b's head
    hit = bm.find_cached_prefix([1, 1, 1, 1, 5])
    assert hit == a
    bm.take_cached(hit)  # a is in use again; freed later, it becomes the most recently used
    bm.free(hit)
    assert bm.allocate(1) == [b[1]]  # b's tail: the oldest release
    assert bm.find_cached_prefix([2, 2, 2, 2, 5]) == [b[0]]
    assert bm.find_cached_prefix([1, 1, 1, 1, 5]) == a
    assert bm.allocate(2) == [b[0], a[1]]
    assert bm.find_cached_prefix([1, 1, 1, 1, 5]) == [a[0]]
    assert bm.allocate(2) is None  # one block left: nothing taken
    assert bm.num_free_blocks == 1


def test_blocks_freed_last_are_taken_first() -> None:
    """Blocks holding nothing come back as a stack: a new sequence takes the blocks the last one freed (their pages
    resident, maybe cached) in its order, not blocks the pool has never written."""
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    first = bm.allocate(3)
    assert first == [0, 1, 2]  # a fresh pool hands out its blocks in order
    other = bm.allocate(2)
    bm.free(first)
    assert bm.allocate(3) == first
    bm.free(other)
    assert bm.allocate(1) == [other[0]]
    bm.check_integrity()


def test_a_hit_never_covers_the_last_token() -> None:
    bm = BlockManager(4, 2)
    _computed(bm, [1, 2, 3, 4])
    assert bm.find_cached_prefix([1, 2, 3, 4]) == [0]  # the last token must be computed to give logits
    assert bm.find_cached_prefix([1, 2, 3, 4, 5]) == [0, 1]


def test_engine_serves_no_later_block_at_position_zero(tiny_llama: Path) -> None:
    """End to end: a prompt of two full blocks, run twice (the second run recomputes its last block, a copy of the
    first run's), then a prompt made of the second run's third block. Its log-probabilities must equal those of an
    engine without a prefix cache (they did not while that copy's successors were registered as first blocks)."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_bytes=8 << 20)
    uncached = LLM(str(tiny_llama), dtype="float32", device="cpu", kv_cache_bytes=8 << 20,
                   enable_prefix_caching=False)
    prompt = list(range(10, 42))
    llm.generate(prompt, params, use_tqdm=False)
    again = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert again.timings["cached_prompt_tokens"] == 16
    probe = (prompt + again.token_ids)[32:48] + [7, 8, 9]
    got = llm.generate(probe, params, use_tqdm=False)[0]
    expected = uncached.generate(probe, params, use_tqdm=False)[0]
    assert got.timings["cached_prompt_tokens"] == 0
    assert got.token_ids == expected.token_ids
    assert got.outputs[0].logprobs is not None and expected.outputs[0].logprobs is not None
    for (mine, _), (ref, _) in zip(got.outputs[0].logprobs, expected.outputs[0].logprobs):
        assert abs(mine - ref) < 1e-5

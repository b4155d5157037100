"""The Scheduler with a real BlockManager and no model: random add / step / abort sequences, the engine simulated by
`schedule()`, writing each chunk's "KV" (the exact token prefix it encodes) into its slots, `advance(item)`, a fake
token appended when `item.samples`, and `finish` at max_tokens.

Small pools force preemption, small token budgets force chunked prefill, prompts cut from shared documents give
prefix hits. Checked at every step: block references equal what live requests' block tables hold; a request only
ever writes into blocks nobody else holds; every slot a request attends over holds KV of its own tokens; the token
budget and max_num_seqs hold; a step with unfinished requests schedules something; all requests finish within a
bound on the number of steps, leaving every block free. With speculation (SpeculativeSchedulerMachine), running
requests propose random continuations, some of them the fake model's own: the proposals' KV is written past the
known tokens, the rejected ones are taken back through `advance`, and the same checks hold (rejected slots are never
attended over, blocks past the kept tokens go back).
"""

from __future__ import annotations

import random
from collections import Counter

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

from nextoken.cache.block_manager import BlockManager
from nextoken.engine.request import Request, RequestStatus
from nextoken.engine.scheduler import ScheduledRequest, Scheduler
from nextoken.sampling_params import SamplingParams

_rng = random.Random(11)
_STEM = [_rng.randrange(3) for _ in range(6)]
DOCUMENTS = [_STEM + [_rng.randrange(3) for _ in range(30)] for _ in range(3)]

SETTINGS = settings(max_examples=200, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# How often the interesting paths ran, over all examples of a test (checked after the run: a generator that no
# longer reaches preemption, chunking or prefix hits would make the property test pass vacuously).
seen: Counter[str] = Counter()


def fake_token(all_ids: list[int]) -> int:
    """A deterministic "model": equal sequences continue equally, so identical prompts share generated blocks."""
    return (sum(all_ids[-3:]) + len(all_ids)) % 3


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 12), block_size=st.sampled_from([1, 2, 4]),
                max_num_seqs=st.integers(1, 4), budget_blocks=st.integers(1, 3),
                chunked=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks: int, block_size: int, max_num_seqs: int, budget_blocks: int, chunked: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
        self.budget = budget_blocks * block_size
        self.sched = Scheduler(self.bm, max_num_seqs, self.budget, enable_chunked_prefill=chunked)
        self.live: dict[str, Request] = {}
        self.finished: list[Request] = []
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose last token's KV it holds
        self.num_added = 0
        self.known: list[Request] = []  # every request added, for prompts cut from their tokens

    # --- the simulated engine --------------------------------------------------------------------------------

    def _slot(self, req: Request, pos: int) -> int:
        bs = self.bm.block_size
        return req.block_table[pos // bs] * bs + pos % bs

    def _step(self) -> list[ScheduledRequest]:
        sched, bm, bs = self.sched, self.bm, self.bm.block_size
        num_unfinished = sched.num_unfinished
        num_preemptions = sched.num_preemptions
        was_running = {id(req) for req in sched.running}
        self._propose()
        items = sched.schedule()
        for req in sched.running:
            req.spec_ids = []
        if sched.num_preemptions > num_preemptions:
            seen["preemption"] += 1
        assert sum(item.num_new_tokens + len(item.spec_ids) for item in items) <= self.budget, "token budget exceeded"
        assert len(sched.running) <= sched.max_num_seqs and len(items) <= sched.max_num_seqs
        assert len({id(item.request) for item in items}) == len(items), "a request scheduled twice in a step"
        assert items or not num_unfinished, f"nothing scheduled with {num_unfinished} requests unfinished"
        for item in items:
            req = item.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + item.num_new_tokens
            assert req.status is RequestStatus.RUNNING and req in sched.running
            assert 1 <= item.num_new_tokens and end <= req.num_tokens
            assert not item.spec_ids or item.samples, "proposals on a chunk that does not reach the end"
            assert len(req.block_table) * bs >= end + len(item.spec_ids), "block table too short for the chunk"
            if end < req.num_prompt_tokens:
                seen["chunked prefill"] += 1
            if start and id(req) not in was_running:
                seen["prefix hit"] += 1  # admitted with its first blocks taken from the prefix cache
            # What the request attends over: KV of exactly its own tokens, from hits and its earlier chunks.
            for pos in range(start):
                assert self.kv.get(self._slot(req, pos)) == tuple(req.all_ids[:pos + 1]), \
                    f"{req.request_id} position {pos}: slot holds KV of other tokens"
            for idx in range(start // bs, -(-(end + len(item.spec_ids)) // bs)):
                block = req.block_table[idx]
                assert bm.blocks[block].ref_count == 1, f"{req.request_id} writes into shared block {block}"
        for item in items:  # the forward pass: every chunk's KV is written before any token is sampled
            req = item.request
            ids = req.all_ids + item.spec_ids
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + item.num_new_tokens
                             + len(item.spec_ids)):
                self.kv[self._slot(req, pos)] = tuple(ids[:pos + 1])
        for item in items:
            req = item.request
            # Verification: the fake model's tokens after the known ones and after each proposal; the proposals
            # are kept while they agree, then one more token.
            kept = [fake_token(req.all_ids)] if item.samples else []
            for spec_id in item.spec_ids:
                if spec_id != kept[-1]:
                    break
                kept.append(fake_token(req.all_ids + kept))
            sched.advance(item, len(item.spec_ids) + 1 - len(kept) if item.spec_ids else 0)
            if item.spec_ids:
                seen["accepted" if len(kept) > 1 else "rejected"] += 1
            for token in kept:
                req.append_token(token)
                if len(req.output_ids) >= req.params.max_tokens:
                    sched.finish(req, "length")
                    self.finished.append(self.live.pop(req.request_id))
                    break
        return items

    def _propose(self) -> None:
        """Proposals for the running requests about to decode (none here: see SpeculativeSchedulerMachine)."""

    # --- rules -----------------------------------------------------------------------------------------------

    def _add(self, prompt: list[int], max_tokens: int) -> None:
        pool_tokens = self.bm.num_blocks * self.bm.block_size
        prompt = prompt[:max(1, pool_tokens - max_tokens)]
        max_tokens = min(max_tokens, pool_tokens - len(prompt))  # what the engine's validation lets in
        req = Request(f"r{self.num_added}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0),
                      frozenset())
        self.num_added += 1
        self.live[req.request_id] = req
        self.known.append(req)
        self.sched.add(req)

    @rule(doc=st.integers(0, len(DOCUMENTS) - 1), length=st.integers(1, 36), tail=st.lists(st.integers(0, 2),
          max_size=3), max_tokens=st.integers(1, 6))
    def add(self, doc: int, length: int, tail: list[int], max_tokens: int) -> None:
        """A prompt that starts like a document (so like many other prompts)."""
        self._add(DOCUMENTS[doc][:length] + tail, max_tokens)

    @precondition(lambda self: bool(self.known))
    @rule(data=st.data(), max_tokens=st.integers(1, 6))
    def add_from_the_middle(self, data: st.DataObject, max_tokens: int) -> None:
        """A prompt cut from another request's tokens at a block boundary: the same tokens as one of its later
        blocks, but at position 0, where that block's KV must never be served."""
        source = data.draw(st.sampled_from(self.known)).all_ids
        bs = self.bm.block_size
        start = bs * data.draw(st.integers(1, max(1, (len(source) - 1) // bs)))
        self._add(source[start:] or source[-1:], max_tokens)

    @rule()
    def step(self) -> None:
        self._step()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        req = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.sched.finish(req, "abort")
        assert req.status is RequestStatus.FINISHED and req.finish_reason == "abort" and not req.block_table

    # --- checks ----------------------------------------------------------------------------------------------

    @invariant()
    def blocks_belong_to_live_requests(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched = self.sched
        refs = Counter(b for req in sched.running for b in req.block_table)
        self.bm.check_integrity(expected_refs=dict(refs))
        assert len(sched.running) <= sched.max_num_seqs
        assert {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting} == set(self.live)
        assert len(sched.running) + len(sched.waiting) == len(self.live), "a request queued twice"
        for req in sched.waiting:
            assert req.status is RequestStatus.WAITING and not req.block_table and req.num_computed_tokens == 0
        for req in sched.running:
            assert req.status is RequestStatus.RUNNING
            # Between steps a running request holds exactly the blocks its computed tokens fill.
            assert len(req.block_table) == self.bm.blocks_needed(req.num_computed_tokens), req

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        # Every request finishes: the oldest running request advances at least one token per step and is never
        # preempted, so the number of steps is at most the tokens the unfinished requests still need.
        bound = sum(r.num_prompt_tokens + r.params.max_tokens for r in self.live.values())
        steps = 0
        while self.sched.num_unfinished:
            assert steps <= bound, f"{self.sched.num_unfinished} requests unfinished after {steps} steps"
            self._step()
            self.blocks_belong_to_live_requests()
            steps += 1
        assert not self.live
        for req in self.finished:
            assert req.finish_reason == "length" and len(req.output_ids) == req.params.max_tokens
        self.bm.check_integrity(expected_refs={})
        assert self.bm.num_free_blocks == self.bm.num_blocks


class SpeculativeSchedulerMachine(SchedulerMachine):
    """The same, with proposals: each running request about to decode proposes up to 4 tokens (as the engine's
    proposer, never more than max_tokens leaves room for), the fake model's continuation with a random token
    swapped in at a random place, or none."""

    @initialize(seed=st.integers(0, 2**16))
    def seed_proposals(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def _propose(self) -> None:
        for req in self.sched.running:
            room = min(4, req.params.max_tokens - len(req.output_ids) - 1)
            if req.num_computed_tokens != req.num_tokens - 1 or room <= 0:
                continue
            proposal: list[int] = []
            for _ in range(self.rng.randint(0, room)):
                proposal.append(fake_token(req.all_ids + proposal))
            if proposal and self.rng.random() < 0.5:
                proposal[self.rng.randrange(len(proposal))] = self.rng.randrange(3)
            req.spec_ids = proposal


def test_random_add_step_abort_sequences() -> None:
    seen.clear()
    run_state_machine_as_test(SchedulerMachine, settings=SETTINGS)
    assert seen["preemption"] and seen["chunked prefill"] and seen["prefix hit"], dict(seen)


def test_random_sequences_with_speculation_leak_nothing() -> None:
    seen.clear()
    run_state_machine_as_test(SpeculativeSchedulerMachine, settings=SETTINGS)
    assert seen["preemption"] and seen["prefix hit"] and seen["accepted"] and seen["rejected"], dict(seen)


# --- fixed cases -----------------------------------------------------------------------------------------------


def _request(request_id: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), frozenset())


def test_samples_is_fixed_when_scheduled() -> None:
    """The engine reads `samples` after `advance` (which moves num_computed_tokens on); it must not change."""
    sched = Scheduler(BlockManager(8, 4), max_num_seqs=2, max_num_batched_tokens=4)
    req = _request("a", list(range(6)), 2)
    sched.add(req)
    first, = sched.schedule()
    assert first.num_new_tokens == 4 and not first.samples
    sched.advance(first)
    assert not first.samples
    second, = sched.schedule()
    assert second.num_new_tokens == 2 and second.samples
    sched.advance(second)
    assert second.samples


def test_prompt_longer_than_budget_without_chunked_prefill_is_not_stuck() -> None:
    """Without chunked prefill a prompt that no step's budget can hold used to wait forever, blocking the queue."""
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    long, short = _request("long", list(range(12)), 1), _request("short", [1, 2], 1)
    sched.add(long)
    sched.add(short)
    for _ in range(6):
        for item in sched.schedule():
            sched.advance(item)
            if item.samples:
                item.request.append_token(0)
                sched.finish(item.request, "length")
    assert long.is_finished and short.is_finished


def test_whole_prompt_waits_for_room_without_chunked_prefill() -> None:
    """A prompt that fits one step's budget is not split when chunked prefill is off: it waits for the next step."""
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    sched.add(_request("a", list(range(5)), 4))
    sched.add(_request("b", list(range(10, 16)), 4))
    items = sched.schedule()
    assert [(i.request.request_id, i.num_new_tokens) for i in items] == [("a", 5)]


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    """Preemption frees the newest request's blocks; its full blocks stay cached, so it resumes with a hit."""
    bm = BlockManager(4, 2)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8)
    old, new = _request("old", [1, 2, 3, 4], 4), _request("new", [4, 5, 6, 8], 2)
    sched.add(old)
    sched.add(new)
    for item in sched.schedule():  # both prompts at once: 2 blocks each, the pool is full
        sched.advance(item)
        item.request.append_token(7)
    first_block = new.block_table[0]
    items = sched.schedule()  # old needs a third block for position 4: new is preempted
    assert [(i.request.request_id, i.num_new_tokens) for i in items] == [("old", 1)]
    assert sched.num_preemptions == 1 and new.num_preemptions == 1
    assert new.status is RequestStatus.WAITING and not new.block_table and sched.waiting[0] is new
    # new's blocks were released tail first, so old's new block evicted [6, 8]; [4, 5] is still cached.
    assert bm.find_cached_prefix(new.all_ids) == [first_block]
    bm.check_integrity(expected_refs={b: 1 for b in old.block_table})

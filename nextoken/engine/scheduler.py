"""The scheduler decides, each step, which requests advance and by how many tokens; it never touches tensors.

Running requests go first (in arrival order), then waiting ones (first come, first served), within a per-step
token budget. A request's chunk is `num_tokens - num_computed_tokens` cut to the budget, so decode (one token),
a whole prompt, a prompt's next chunk and a resumed preempted request are all the same case. When blocks run out,
the most recently arrived running request is preempted: its blocks are freed and it will be recomputed (its
prefix blocks often survive in the prefix cache). While anything was preempted this step, nothing new is admitted.
Without chunked prefill a waiting request is admitted only when its whole prompt fits in the step, except one that
could never fit in any step's budget: that one is still chunked, rather than blocking the queue forever.
A running request's proposed tokens (`Request.spec_ids`, engine/speculative.py) ride on its last chunk when budget
and free blocks allow, never at the cost of a preemption; `advance` takes the rejected ones back.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

from nextoken.cache.block_manager import BlockManager
from nextoken.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # known tokens (prompt and output) computed in this chunk
    # Proposed tokens computed after them (speculative decoding), each with its logits row to verify it.
    spec_ids: list[int] = field(default_factory=list)
    # True when this chunk reaches the end of the known tokens, so a new token is drawn after it. Fixed when the
    # chunk is scheduled: `advance` moves num_computed_tokens on, and must not change what this chunk was.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_finished: Counter[str] = Counter()  # requests ended, by finish reason (stop, length, abort, error)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 0:  # nothing to compute yet: a beam waiting for the rest of its group (engine/beam.py)
                i += 1
                continue
            need = self.bm.blocks_needed(req.num_computed_tokens + num_new) - len(req.block_table)
            spec: list[int] = []
            if req.spec_ids and num_new == req.num_tokens - req.num_computed_tokens:
                # Proposals only where their blocks are free now: speculation never preempts anyone.
                spec = req.spec_ids[:budget - num_new]
                spec_need = self.bm.blocks_needed(req.num_computed_tokens + num_new + len(spec)) - len(req.block_table)
                if spec_need <= self.bm.num_free_blocks:
                    need = spec_need
                else:
                    spec = []
            while need > self.bm.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break
            if need > 0:
                blocks = self.bm.allocate(need)
                assert blocks is not None
                req.block_table.extend(blocks)
            scheduled.append(ScheduledRequest(req, num_new, spec))
            budget -= num_new + len(spec)
            i += 1

        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # Prompt log-probabilities need every prompt position computed, so those requests skip the cache.
            use_cache = req.num_computed_tokens == 0 and req.params.prompt_logprobs is None
            hits = self.bm.find_cached_prefix(req.all_ids) if use_cache else []
            num_computed = len(hits) * self.bm.block_size
            num_new = req.num_tokens - num_computed
            if num_new > budget and not self.enable_chunked_prefill and num_new <= self.max_num_batched_tokens:
                break  # wait for a step with room for the whole prompt
            num_new = min(num_new, budget)
            need = self.bm.blocks_needed(num_computed + num_new) - len(hits)
            # Hit blocks nobody references count as free until taken.
            revived = sum(1 for b in hits if self.bm.blocks[b].ref_count == 0)
            if need + revived > self.bm.num_free_blocks:
                break
            self.waiting.popleft()
            self.bm.take_cached(hits)
            blocks = self.bm.allocate(need)
            assert blocks is not None
            req.block_table = hits + blocks
            req.num_computed_tokens = num_computed
            req.num_cached_blocks = len(hits)
            if req.timings.first_scheduled is None:
                req.timings.first_scheduled = time.perf_counter()
                req.timings.num_cached_prompt_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
        return scheduled

    def _preempt(self, req: Request) -> None:
        self.bm.free(req.block_table)
        req.spec_ids = []
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def advance(self, item: ScheduledRequest, num_rejected: int = 0) -> None:
        """Record that a scheduled chunk was computed; register newly full blocks in the prefix cache.

        A chunk's proposed tokens were computed too, but only the first len(spec_ids) - num_rejected of them were
        accepted: the counter takes the rejected ones back (their KV slots are overwritten by the next tokens
        computed there) and whole blocks past the kept tokens go back to the pool, as after any other step. Accepted
        proposals are the request's next tokens; they are registered here before the engine appends them.
        """
        req = item.request
        assert 0 <= num_rejected <= len(item.spec_ids)
        num_accepted = len(item.spec_ids) - num_rejected
        req.num_computed_tokens += item.num_new_tokens + len(item.spec_ids) - num_rejected
        num_full = req.num_computed_tokens // self.bm.block_size
        if num_full > req.num_cached_blocks:
            ids = req.all_ids + item.spec_ids[:num_accepted] if num_accepted else req.all_ids
            self.bm.cache_full_blocks(req.block_table, ids, req.num_cached_blocks, num_full)
            req.num_cached_blocks = num_full
        # Blocks past the computed tokens: rejected proposals', or those a head draft took for proposals this step
        # had no room to verify (engine/head_draft.py).
        keep = self.bm.blocks_needed(req.num_computed_tokens)
        if len(req.block_table) > keep:
            self.bm.free(req.block_table[keep:])
            del req.block_table[keep:]

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request wherever it is (running or waiting) and give its blocks back at once."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self.bm.free(req.block_table)
        req.block_table = []
        req.finish(reason, stop_reason)
        self.num_finished[reason] += 1

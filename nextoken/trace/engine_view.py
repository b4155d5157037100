"""`nextoken trace --engine N`: the engine's side of a batch, step by step: which requests each step ran and how
(a prefill chunk, its range, or a decode), prefix-cache hits, preemptions, finished requests, the KV blocks each
request holds (a block map of the pool), and each step's time.

N requests of the prompt (seeds 0..N-1) arrive one every `arrive_every` steps, as a server's would, so the view shows
continuous batching: a prompt's chunks beside other requests' decodes, later copies of the prompt served from the
prefix cache, and, with a small KV pool (`kv_cache_bytes`), preemption. The engine is observed from outside
(`EngineObserver` wraps its scheduler's `schedule`, reads requests and the block manager between steps): it runs
exactly as it runs unobserved.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from nextoken.engine.inputs import Chat
from nextoken.engine.request import Request, RequestStatus
from nextoken.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nextoken.llm import LLM

_ids = itertools.count()
LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass
class Ran:
    label: str
    kind: str  # "prefill" or "decode"
    first: int  # the first position computed
    count: int  # tokens computed
    cached: int = 0  # prompt tokens served by the prefix cache when it was admitted this step


@dataclass
class EngineStep:
    index: int
    seconds: float
    ran: list[Ran] = field(default_factory=list)
    arrived: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[tuple[str, str]] = field(default_factory=list)  # (label, finish reason)
    waiting: list[str] = field(default_factory=list)
    blocks: dict[str, list[int]] = field(default_factory=dict)  # label -> its block table after the step
    free_blocks: int = 0


class EngineObserver:
    """Watches an engine's steps from outside: the scheduler's decisions, the requests' states, the block pool."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.labels: dict[str, str] = {}
        self.requests: dict[str, Request] = {}
        self.steps: list[EngineStep] = []
        self._arrived: list[str] = []
        self._scheduled: list[tuple[Any, int]] = []  # this step's chunks, and where each started
        scheduler = self.engine.scheduler
        self._inner = scheduler.schedule

        def schedule() -> list[Any]:
            scheduled = self._inner()
            # Where each chunk starts, read now: after the step a request's counter has moved on (or back, where
            # proposed tokens were rejected).
            self._scheduled = [(item, item.request.num_computed_tokens) for item in scheduled]
            return scheduled

        scheduler.schedule = schedule  # type: ignore[method-assign]

    def detach(self) -> None:
        self.engine.scheduler.schedule = self._inner  # type: ignore[method-assign]

    def add(self, prompt_ids: list[int], params: SamplingParams) -> str:
        request_id = self.engine.add_request(prompt_ids, params, f"engine-view-{next(_ids)}")
        label = LABELS[len(self.labels) % len(LABELS)] + ("" if len(self.labels) < len(LABELS) else
                                                         str(len(self.labels) // len(LABELS)))
        self.labels[request_id] = label
        request = self.engine.get_request(request_id)
        assert request is not None
        self.requests[request_id] = request
        self._arrived.append(label)
        return request_id

    def step(self) -> None:
        engine = self.engine
        before = {rid: (r.status, r.num_computed_tokens) for rid, r in self.requests.items()}
        self._scheduled = []
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        record = EngineStep(len(self.steps), seconds, arrived=self._arrived)
        self._arrived = []
        for item, first in self._scheduled:
            req = item.request
            label = self.labels.get(req.request_id, req.request_id)
            status, _ = before.get(req.request_id, (RequestStatus.WAITING, 0))
            cached = first if status is RequestStatus.WAITING else 0  # admitted now: a hit moved the counter
            kind = "prefill" if first < req.num_prompt_tokens else "decode"
            record.ran.append(Ran(label, kind, first, item.num_new_tokens, cached))
        for rid, req in self.requests.items():
            status, computed = before[rid]
            if status is RequestStatus.RUNNING and req.status is RequestStatus.WAITING:
                record.preempted.append(self.labels[rid])
        for out in outputs:
            if out.finished and out.request_id in self.labels:
                record.finished.append((self.labels[out.request_id], out.finish_reason or ""))
        record.waiting = [self.labels[r.request_id] for r in engine.scheduler.waiting if r.request_id in self.labels]
        record.blocks = {self.labels[rid]: list(r.block_table) for rid, r in self.requests.items()
                         if r.block_table and not r.is_finished}
        record.free_blocks = engine.block_manager.num_free_blocks
        self.steps.append(record)


def run_engine_view(llm: LLM, prompt: str, params: SamplingParams, num_requests: int, *, arrive_every: int = 2,
                    raw: bool = False, system: str | None = None) -> EngineObserver:
    """N requests of the prompt, seeds 0..N-1, one arriving every `arrive_every` steps, run to the end, observed."""
    engine = llm.engine
    _, prompt_ids = llm.inputs.prompt_ids(prompt if raw else Chat.turn(prompt, system), special_tokens=True)
    observer = EngineObserver(llm)
    try:
        added = 0
        while added < num_requests or engine.has_unfinished():
            if added < num_requests and len(observer.steps) >= added * arrive_every:
                observer.add(prompt_ids, replace(params, seed=added))
                added += 1
            observer.step()
    finally:
        observer.detach()
        for rid, req in observer.requests.items():
            if not req.is_finished:
                engine.abort(rid)
        engine.release_threads()
    return observer


def block_map(step: EngineStep, num_blocks: int, width: int = 96) -> list[str]:
    """The pool after a step as lines of one character per block: the holding request's letter ('*': shared by
    several), '.' free or cached."""
    owner: dict[int, str] = {}
    for label, table in step.blocks.items():
        for b in table:
            owner[b] = label[0] if b not in owner else "*"
    cells = "".join(owner.get(b, ".") for b in range(num_blocks))
    return [cells[i:i + width] for i in range(0, len(cells), width)]


def describe_ran(ran: Ran) -> str:
    if ran.kind == "decode":
        return f"{ran.label} decode @{ran.first}"
    hit = f" (cache hit: {ran.cached})" if ran.cached else ""
    return f"{ran.label} prefill {ran.first}-{ran.first + ran.count - 1}{hit}"


def print_engine_view(console: Any, observer: EngineObserver, num_blocks: int, block_size: int) -> None:
    from rich.table import Table
    from rich.text import Text

    table = Table(show_edge=False, title="the engine, step by step: what each step ran, what happened, who holds "
                  "which KV blocks", title_justify="left")
    for col in ("step", "ms", "ran", "events", "blocks held", "free"):
        table.add_column(col, justify="right" if col in ("step", "ms", "free") else "left")
    for s in observer.steps:
        events = [f"{x} arrives" for x in s.arrived] + [f"{x} preempted" for x in s.preempted] + \
            [f"{x} finished ({why})" for x, why in s.finished] + ([f"waiting: {' '.join(s.waiting)}"] if s.waiting else [])
        table.add_row(str(s.index), f"{s.seconds * 1e3:.1f}", Text(", ".join(describe_ran(r) for r in s.ran)),
                      Text("; ".join(events)), " ".join(f"{k}:{len(v)}" for k, v in s.blocks.items()),
                      str(s.free_blocks))
    console.print(table)
    busiest = max(observer.steps, key=lambda s: sum(len(v) for v in s.blocks.values()))
    console.print(f"block map after step {busiest.index} (the fullest; {num_blocks} blocks of {block_size} tokens; "
                  "a letter: the request holding it, *: shared, .: free or cached):")
    lines = block_map(busiest, num_blocks)
    used = max((i for i, line in enumerate(lines) if line.strip(".")), default=0) + 1
    for line in lines[:used]:
        console.print(Text(line, style="cyan"))
    if used < len(lines):
        console.print(f"... and {num_blocks - used * len(lines[0]):,} more blocks, all free or cached")

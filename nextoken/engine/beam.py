"""Beam search: the `beam_width` most likely continuations kept at every step, each a request of its own over the
paged cache, sharing the blocks of the prefix they have in common.

A group starts as one request (the prompt). Each of its live beams is computed as any decode row, its sampler row
asked for the top 2W log-probabilities of the model's own distribution (W = beam_width). Once every live beam has
its candidates (beams are scheduled together; one computed ahead of the others waits with nothing to compute), the
group advances: candidates ranked by cumulative log-probability; an end token among the best W ends a hypothesis
(scored by cumulative log-probability / length ** length_penalty); the best W others become the next beams. A beam
chosen once takes its token in place; a beam chosen again is forked (`fork`): the new request references the
parent's full blocks (reference counts in the block manager) and gets a copy of its last, partly filled block, the
one both will write next (copy-on-write, done at the fork since the write is certain). Beams not chosen are freed.

The group ends when W hypotheses are finished and, without `early_stopping`, no live beam can still beat the worst
of them (HuggingFace's rule), or when the beams reach max_tokens (they then end as hypotheses too); its n best
hypotheses are the result. With W = 1 it is greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from nextoken.cache.block_manager import BlockManager
from nextoken.engine.request import Request, RequestOutput, RequestStatus
from nextoken.engine.scheduler import Scheduler
from nextoken.sampling_params import SamplingParams


# A token's log-probability and the top ones at its position (SamplingParams.logprobs of them).
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class Hypothesis:
    token_ids: list[int]  # the output tokens, the end token included where one ended it
    cumulative_logprob: float
    finish_reason: str  # "stop" | "length"
    logprobs: list[TokenLogprob] | None = None  # per token, where the search's params ask for logprobs

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / max(len(self.token_ids), 1) ** length_penalty


@dataclass
class Beam:
    request: Request
    cumulative_logprob: float = 0.0
    candidates: list[tuple[int, float]] | None = None  # this step's top (token, log p), once computed
    logprobs: list[TokenLogprob] = field(default_factory=list)  # its tokens' so far, where the search asks for them


@dataclass
class BeamGroup:
    request_id: str
    params: SamplingParams  # the caller's
    prompt_ids: list[int]
    beams: list[Beam] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    num_forks: int = 0

    @property
    def width(self) -> int:
        return self.params.beam_width or 1

    @staticmethod
    def beam_params(params: SamplingParams) -> SamplingParams:
        """What each beam's request runs with: no draw of its own, the top 2W log-probabilities of its row, or the
        top `logprobs` where the caller asks for more (a plain request to the engine: the search is its group's)."""
        return replace(params, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                       presence_penalty=0.0, frequency_penalty=0.0, n=1, seed=None,
                       logprobs=max(2 * (params.beam_width or 1), params.logprobs or 0), stop=(), beam_width=None)

    def ready(self) -> bool:
        return all(b.candidates is not None for b in self.beams)

    def record(self, request: Request, top: list[tuple[int, float]]) -> None:
        for beam in self.beams:
            if beam.request is request:
                beam.candidates = top
                return

    def advance(self, scheduler: Scheduler, bm: BlockManager, copy_block: Callable[[int, int], None],
                eog_ids: frozenset[int]) -> bool:
        """One step of the search over the beams' candidates; returns whether the group is done (its beams freed)."""
        width, params = self.width, self.params
        # Each beam's top 2W alone: a longer list (asked for logprobs) must not change the search.
        ranked = sorted(((b.cumulative_logprob + lp, -i, token, b, lp) for i, b in enumerate(self.beams)
                         for token, lp in (b.candidates or [])[:2 * width]), key=lambda c: (c[0], c[1]), reverse=True)
        chosen: list[tuple[Beam, int, float]] = []
        scored: dict[tuple[int, int], list[TokenLogprob]] = {}  # (beam, token) -> its tokens' logprobs, where asked
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eog_ids)
        for rank, (score, _, token, beam, lp) in enumerate(ranked):
            if token in stops and rank >= width:
                continue
            if params.logprobs is not None:
                scored[id(beam), token] = beam.logprobs + [(lp, (beam.candidates or [])[:params.logprobs])]
            if token in stops:  # an end among the best W: a finished hypothesis
                self.finished.append(Hypothesis(beam.request.output_ids + [token], score, "stop",
                                                scored.get((id(beam), token))))
                continue
            chosen.append((beam, token, score))
            if len(chosen) == width:
                break
        at_length = bool(chosen) and len(chosen[0][0].request.output_ids) + 1 >= params.max_tokens
        done = not chosen or at_length or self._converged(chosen)
        if done:
            if at_length:
                self.finished += [Hypothesis(b.request.output_ids + [t], s, "length", scored.get((id(b), t)))
                                  for b, t, s in chosen]
            for beam in self.beams:
                scheduler.finish(beam.request, "abort")
            self.beams = []
            return True
        kept: dict[int, tuple[Beam, int, float]] = {}  # each chosen beam's first continuation: taken in place
        forks: list[tuple[Beam, int, float]] = []  # its others: new requests
        for beam, token, score in chosen:
            if id(beam) in kept:
                forks.append((beam, token, score))
            else:
                kept[id(beam)] = (beam, token, score)
        placed: list[tuple[Request, int, float, list[TokenLogprob]]] = []
        for beam, token, score in forks:  # before any parent takes this step's token
            child = self._fork(beam.request, scheduler, bm, copy_block)
            if child is not None:  # else no block for the copy: the search goes on narrower this step
                placed.append((child, token, score, scored.get((id(beam), token), [])))
        placed += [(beam.request, token, score, scored.get((id(beam), token), []))
                   for beam, token, score in kept.values()]
        for beam in self.beams:
            if id(beam) not in kept:
                scheduler.finish(beam.request, "abort")
        next_beams = []
        for request, token, score, logprobs in sorted(placed, key=lambda p: p[2], reverse=True):
            request.append_token(token)
            next_beams.append(Beam(request, score, logprobs=logprobs))
        self.beams = next_beams
        return False

    def _converged(self, chosen: list[tuple[Beam, int, float]]) -> bool:
        """W hypotheses finished, and (without early stopping) the best live beam cannot beat the worst of them."""
        width, lp = self.width, self.params.length_penalty
        if len(self.finished) < width:
            return False
        if self.params.early_stopping:
            return True
        worst = sorted(h.score(lp) for h in self.finished)[-width]
        best_live = max(s for _, _, s in chosen)
        length = len(chosen[0][0].request.output_ids) + 1
        # Log-probabilities only fall: with a length penalty > 0 the best a live beam can reach is at max_tokens.
        reach = length if lp <= 0 else max(length, self.params.max_tokens)
        return best_live / reach ** lp <= worst

    def _fork(self, parent: Request, scheduler: Scheduler, bm: BlockManager,
              copy_block: Callable[[int, int], None]) -> Request | None:
        """A new request continuing `parent`: its full blocks shared, its partly filled last block copied."""
        self.num_forks += 1
        child = Request(f"{self.request_id}#{self.num_forks}", parent.prompt_ids, parent.params, frozenset())
        child.output_ids, child.all_ids = list(parent.output_ids), list(parent.all_ids)
        child.stop_ids, child.timings = parent.stop_ids, parent.timings
        if parent.status is not RequestStatus.RUNNING:  # preempted: it computes everything again anyway
            scheduler.waiting.appendleft(child)
            return child
        full, partial = divmod(parent.num_computed_tokens, bm.block_size)
        shared = parent.block_table[:full]
        copy: list[int] = []
        if partial:
            fresh = bm.allocate(1)
            if fresh is None:
                return None
            copy = fresh
            copy_block(parent.block_table[full], fresh[0])
        bm.take_cached(shared)
        child.block_table = shared + copy
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_blocks = min(parent.num_cached_blocks, full)
        child.status = RequestStatus.RUNNING
        scheduler.running.append(child)
        return child

    def result(self, eog_ids: frozenset[int], decode: Callable[..., str]) -> RequestOutput:
        """The ended search as its request's one output: the n best hypotheses in `beams`, the best one's tokens and
        text (`decode`: the tokenizer's) as the output's."""
        best = self.best()
        root = Request(self.request_id, self.prompt_ids, self.params, eog_ids)
        root.beams = best
        if best:
            root.output_ids = list(best[0].token_ids)
        root.finish(best[0].finish_reason if best else "stop")
        return RequestOutput(request_id=self.request_id, new_token_ids=root.output_ids,
                             new_text=decode(root.output_ids, skip_special_tokens=self.params.skip_special_tokens),
                             finished=True, finish_reason=root.finish_reason, num_prompt_tokens=len(root.prompt_ids),
                             num_output_tokens=len(root.output_ids), request=root)

    def best(self) -> list[Hypothesis]:
        """The n best hypotheses, best first."""
        lp = self.params.length_penalty
        return sorted(self.finished, key=lambda h: h.score(lp), reverse=True)[:self.params.n]

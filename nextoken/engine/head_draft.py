"""Self-speculation through the whole model (`speculative="head:N"`): the model drafts for itself, every block
included, with its LM head cut to the N tokens it deems likeliest; verifying then costs little more than the full
head over the drafted rows.

A decode step reads every weight once: the blocks, then the head over the whole vocabulary, which for a model of
large vocabulary and few layers is much of the step (Gemma 3 270M: 262,144 x 640 of its 430 M weights). Here each
proposal is one pass through the blocks over the request's own KV cache, at the position plain decoding would
compute it, then the head's rows for the N likeliest tokens alone (a 16th of the head at N = 16384 for Gemma 3).
The passes keep their final norm's rows (`Request.spec_hidden`); the verifying step runs the blocks only over the
last proposal (ModelRunner._verify_drafted) and the full head over all the rows at once, where a batch of rows costs
less than as many single rows. Nothing else changes: the rows are those plain decoding computes for the same
tokens (the same one-row passes, the same cache), the rejected proposals' KV slots are taken back as any other's,
and a draft that is not accepted costs its passes. Where the most likely token is among the N, the draft proposes
it (greedy); an unseeded sampled request draws from the N tokens' distribution after its own penalties and filters,
and the rejection rule keeps a proposal with probability min(1, p / q): the share of p on the N tokens, about.

The N tokens: those with the largest mean probability over the model's own predictions at every position of a
fixed conversation (ops/calibration.CALIBRATION_CHAT): the tokens a model's answers are made of, whatever the
order of its vocabulary (frequency-ranked drafting, as in FR-Spec, Zhao et al. 2025, with the model's predictions
standing in for a corpus's counts), and every end-of-generation token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from nextoken.cache.block_manager import BlockManager
from nextoken.engine.batch import ForwardBatch
from nextoken.engine.rejection import distributions, draw, uses_sampled_draft
from nextoken.engine.request import Request
from nextoken.engine.runner import ModelRunner
from nextoken.engine.sampler import Sampler, SamplingRow, argmax
from nextoken.errors import NextokenError
from nextoken.models.base import CausalLM
from nextoken.ops import calibration
from nextoken.ops.quant_head import Int8GroupHead


def token_ranking(runner: ModelRunner, token_ids: list[int]) -> torch.Tensor:
    """Every token id, by mean probability over the model's predictions at every position of `token_ids` (one pass
    on a private cache), the largest first (ties: the lower id). Cached on disk by model file, formats and tokens,
    as the int8 route's outlier columns are (ops/calibration.py): Gemma 3's pass takes about 2 s."""
    vocab = runner.model_config.vocab_size
    path = runner.calibration_path("ranking", token_ids, ".npy")
    order = calibration.load_ranking(path, vocab) if path is not None else None
    if order is None:
        mass = torch.softmax(runner.score(token_ids).float(), dim=-1).mean(dim=0).cpu()
        order = torch.sort(mass, descending=True, stable=True).indices
        if path is not None and len(order) == vocab:
            calibration.save_ranking(path, order)
    return order


def likeliest_tokens(runner: ModelRunner, token_ids: list[int], size: int, always: Sequence[int]) -> torch.Tensor:
    """The `size` token ids (ascending) first in `token_ranking`, those of `always` included."""
    order = token_ranking(runner, token_ids)
    first = torch.tensor(list(dict.fromkeys(always))[:size], dtype=torch.long)
    rest = order[~torch.isin(order, first)][:size - len(first)]
    return torch.cat([first, rest]).sort().values


def sub_head(model: CausalLM, ids: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The LM head's rows `ids` alone: hidden [rows, hidden] -> logits [rows, len(ids)] fp32. Over the int8 head's
    own blocks where it has them (the same kernels, without rescoring candidates: a draft needs no exact logits),
    else over the float head's rows."""
    head = model.quantized_head
    if isinstance(head, Int8GroupHead) and head.lib is not None:
        return Int8GroupHead(head.blocks.qs[ids], head.blocks.d[ids])
    weight = head.weight if isinstance(head, Int8GroupHead) and head.weight is not None else model.head_weight
    rows = weight[ids.to(weight.device)].contiguous()
    return lambda hidden: torch.nn.functional.linear(hidden.to(rows.dtype), rows).float()


class HeadDraft:
    """The `draft` of a Speculator (engine/speculative.py) for speculative="head:N": proposes through the target's
    own runner and cache. It has no cache of its own to bring level (`behind` is 0)."""

    catch_up_seconds = 0.0

    def __init__(self, runner: ModelRunner, blocks: BlockManager, vocab: torch.Tensor) -> None:
        self.runner = runner
        self.blocks = blocks  # the engine's: the draft's passes write into the requests' own blocks
        self.vocab = vocab  # [N] int64, ascending
        self.head = sub_head(runner.model, vocab)
        self.step_seconds = 0.0  # a draft pass's time, a moving average; 0: not measured yet

    @classmethod
    def build(cls, runner: ModelRunner, size: int, blocks: BlockManager, text: list[int],
              eog_ids: Sequence[int]) -> HeadDraft:
        vocab = runner.model_config.vocab_size
        if not 1 <= size < vocab:
            raise NextokenError(f"speculative=head:{size}: the draft's tokens must be from 1 to {vocab - 1} (the "
                                f"vocabulary has {vocab})")
        always = [t for t in eog_ids if 0 <= t < vocab][:size]
        return cls(runner, blocks, likeliest_tokens(runner, text, size, always))

    def verify_costs(self, rows: Sequence[int], context: int = 64) -> dict[int, float]:
        """Seconds of a verifying step with n rows, for each n of `rows`: a one-token pass through the blocks after
        `context` cached tokens (a private cache) and the full head over n rows; sets the draft pass's first
        estimate (that pass and the N tokens' head over one row). The faster of two runs each."""
        model, device, config = self.runner.model, self.runner.device, self.runner.model_config
        pool, _ = self.runner.score_cache(context + 1)  # its slots unwritten before the position timed, as calibrate's
        # An ordinary token (a run of token 0 can drive activations into slow subnormal arithmetic).
        last = ForwardBatch.single_tokens([(list(range(pool.num_blocks)), 7919 % config.vocab_size, context)],
                                          self.runner.block_size, device)

        def best(run: Callable[[], object]) -> float:
            times = []
            for _ in range(2):
                start = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - start)
            return min(times)

        with torch.inference_mode():
            hidden = model(last.input_ids, last.positions, pool.layers, last.attn, head=False)
            layers = best(lambda: model(last.input_ids, last.positions, pool.layers, last.attn, head=False))
            x = hidden.expand(max(rows), -1).contiguous()
            out = torch.empty(max(rows), config.vocab_size, device=device)  # as the engine's buffer: no page faults
            heads = {n: best(lambda: model.compute_logits(x[:n], out)) for n in rows}  # best calls each at once
            small = best(lambda: self.head(x[:1]))
        self.step_seconds = self.step_seconds or layers + small
        return {n: layers + seconds for n, seconds in heads.items()}

    def behind(self, req: Request) -> int:
        return 0

    def release(self, keep: set[str]) -> None:
        """Nothing to release: the proposals' blocks are the requests' own (Scheduler.advance frees them)."""

    def _room(self, req: Request, k: int) -> int:
        """Blocks for the request's k proposals and the verifying pass after them (positions up to
        num_computed_tokens + k), taken from the free ones only: the k they allow."""
        first = req.num_computed_tokens
        while k > 0:
            need = self.blocks.blocks_needed(first + k + 1) - len(req.block_table)
            if need <= 0:
                return k
            if need <= self.blocks.num_free_blocks:
                got = self.blocks.allocate(need)
                assert got is not None
                req.block_table.extend(got)
                return k
            k -= 1
        return 0

    def propose(self, requests: Sequence[Request], ks: Sequence[int],
                generator: torch.Generator | None) -> list[list[int]]:
        """Up to ks[i] tokens to follow each decoding request's known tokens (fewer where the pool is short of
        blocks), one batched pass per token over the sequences still drafting, each through every block at its
        position in its own cache: greedy over the N tokens, or (given a generator) for an unseeded sampled request
        a draw from their distribution after the request's penalties, processors and filters, kept in `spec_q` for
        the rejection rule. Each drafting request keeps its passes' rows in `spec_hidden`."""
        out: list[list[int]] = [[] for _ in requests]
        rows: list[list[torch.Tensor]] = [[] for _ in requests]
        sampled = [generator is not None and uses_sampled_draft(req.params) for req in requests]
        for req in requests:
            req.spec_q, req.spec_hidden = [], None
        ks = [self._room(req, k) if k > 0 else 0 for req, k in zip(requests, ks)]
        model, runner = self.runner.model, self.runner
        vocab_size = runner.model_config.vocab_size
        for j in range(max(ks, default=0)):
            live = [i for i, k in enumerate(ks) if j < k]
            start = time.perf_counter()
            batch = ForwardBatch.single_tokens(
                [(requests[i].block_table, out[i][-1] if j else requests[i].all_ids[-1],
                  requests[i].num_computed_tokens + j) for i in live], runner.block_size, runner.device)
            with torch.inference_mode():
                hidden = model(batch.input_ids, batch.positions, runner.kv_pool.layers, batch.attn, head=False)
                logits = self.head(hidden)
            tokens = self.vocab[argmax(logits)].tolist()
            drawing = [n for n, i in enumerate(live) if sampled[i]]
            if drawing:
                targets = [requests[live[n]] for n in drawing]
                params = [req.params for req in targets]
                if any(p.has_penalties or p.has_processors for p in params):  # they need the whole vocabulary
                    full = torch.full((len(drawing), vocab_size), float("-inf"))
                    full[:, self.vocab] = logits[drawing].float().cpu()
                    q = distributions(Sampler.processed(full, [
                        SamplingRow(req.params, None, req.prompt_ids, req.output_ids + out[live[n]], req.stop_ids)
                        for n, req in zip(drawing, targets)]), params)
                else:  # the filters over the N tokens alone: the same distribution, 0 elsewhere
                    q = torch.zeros(len(drawing), vocab_size, dtype=torch.float64)
                    q[:, self.vocab] = distributions(logits[drawing].float().cpu(), params)
                for n, req, dist in zip(drawing, targets, q):
                    tokens[n] = draw(dist, generator)  # type: ignore[arg-type]
                    req.spec_q.append(dist)
            seconds = time.perf_counter() - start
            self.step_seconds = seconds if not self.step_seconds else 0.8 * self.step_seconds + 0.2 * seconds
            for n, i in enumerate(live):
                out[i].append(tokens[n])
                rows[i].append(hidden[n].clone())  # the pass's rows may be a buffer the next pass reuses
        for req, k, drafted, kept in zip(requests, ks, out, rows):
            if k:
                req.spec_hidden = (req.num_computed_tokens, list(drafted), torch.stack(kept))
        return out

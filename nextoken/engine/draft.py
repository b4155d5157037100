"""A draft model for speculative decoding: another model sharing the target's vocabulary (a smaller one, or the
same one in a cheaper format: SmolLM2 in int4 drafting for SmolLM2 in fp32), or the target's own first layers with
its final norm and head (self-speculation, `EarlyExit`), proposes each sequence's next tokens greedily, from its own
paged KV cache.

Each target request being drafted has a shadow `Request` here whose tokens are the target's known tokens and then
the draft's proposals; its `num_computed_tokens` counts what the draft's cache holds. Before each step the shadow is
brought level with the target (tokens the target accepted or sampled since are computed in one chunk; proposals the
target rejected are taken back: the counter falls to the common prefix and whole blocks past it are freed), then
decodes its k tokens, one batched pass per token over every sequence still drafting. Shadows of requests no longer
decoding (finished, aborted, preempted) give their blocks back at the next step; a sequence the draft's pool cannot
hold is not drafted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from nextoken.cache.block_manager import BlockManager
from nextoken.cache.kv_pool import KVPool, KVShape
from nextoken.config import EngineConfig
from nextoken.engine.batch import DecodeBatch, ForwardBatch
from nextoken.engine.request import Request
from nextoken.engine.runner import ModelRunner
from nextoken.engine.rejection import distributions, draw, uses_sampled_draft
from nextoken.engine.sampler import Sampler, SamplingRow, argmax
from nextoken.engine.scheduler import ScheduledRequest
from nextoken.errors import NextokenError
from nextoken.loader.registry import open_model, resolve_model
from nextoken.models.config import ModelConfig
from nextoken.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=1)


class EarlyExit:
    """Self-speculation's draft: the target's own first `num_layers` blocks, then its final norm and head (an early
    exit), over a KV pool of their own; no second file. Run through the modules (the fused decoder covers every
    block), with the runner's `execute` interface."""

    def __init__(self, target: ModelRunner, num_layers: int) -> None:
        self.model, self.device, self.block_size = target.model, target.device, target.block_size
        self.num_blocks = target.num_blocks
        shape = target.kv_shape
        self.kv_pool = KVPool(KVShape(num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype), self.num_blocks,
                              self.block_size, self.device)

    def settle(self) -> None:
        """Nothing to settle: the target's weights are its own."""

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, torch.Tensor]:
        batch = ForwardBatch.build(scheduled, self.block_size, self.device)
        # The model runs one block per cache it is given: these caches stop it after the first num_layers.
        return batch, self.model(batch.input_ids, batch.positions, self.kv_pool.layers, batch.attn,
                                 batch.logits_indices, modules=True)


class DraftModel:
    def __init__(self, runner: ModelRunner | EarlyExit) -> None:
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=False)
        self.shadows: dict[str, Request] = {}
        self.step_seconds = 0.0  # a draft pass's time, a moving average (the proposals' cost); 0: not measured yet
        self.catch_up_seconds = 0.0  # per token, of a chunk bringing a shadow level (timed by `time_catch_up`)

    @classmethod
    def load(cls, name: str, target: EngineConfig, target_vocab: int, max_model_len: int) -> DraftModel:
        """Another model (`speculative="draft:NAME"`), in the default formats for the target's device."""
        gguf = open_model(resolve_model(name))
        config = ModelConfig.from_gguf(gguf)
        if config.vocab_size != target_vocab:
            raise NextokenError(f"draft model {name!r} has a vocabulary of {config.vocab_size} tokens, the target's "
                                f"has {target_vocab}: a draft must share the target's vocabulary")
        draft = EngineConfig(model=name, device=target.device, block_size=target.block_size,
                             max_num_seqs=target.max_num_seqs, kv_cache_fraction=target.kv_cache_fraction,
                             threads=target.threads)
        return cls(ModelRunner(gguf, config, draft, max_model_len))

    @classmethod
    def early_exit(cls, target: ModelRunner, num_layers: int) -> DraftModel:
        """The target's first layers (`speculative="self:L"`)."""
        total = target.model_config.num_layers
        if not 1 <= num_layers < total:
            raise NextokenError(f"speculative=self:{num_layers}: the draft's layers must be from 1 to {total - 1} "
                                f"(the model has {total})")
        return cls(EarlyExit(target, num_layers))

    def time_passes(self, num_tokens: int = 32) -> None:
        """Time a chunk of num_tokens through the draft, as a shadow's catch-up runs, and a one-token pass after it,
        on blocks given back after (best of two): `catch_up_seconds` per token, and `step_seconds` until the
        drafting passes measure it."""
        probe = Request("catch-up", [0] * (num_tokens + 1), GREEDY, frozenset())
        if not self._room(probe, num_tokens + 1):
            return
        try:
            chunk = step = float("inf")
            for _ in range(2):
                probe.num_computed_tokens = 0
                start = time.perf_counter()
                self.runner.execute([ScheduledRequest(probe, num_tokens)])
                probe.num_computed_tokens = num_tokens
                middle = time.perf_counter()
                self.runner.execute([ScheduledRequest(probe, 1)])
                chunk, step = min(chunk, middle - start), min(step, time.perf_counter() - middle)
        finally:
            self.blocks.free(probe.block_table)
            probe.block_table = []
        self.catch_up_seconds = chunk / num_tokens
        self.step_seconds = self.step_seconds or step

    def behind(self, req: Request) -> int:
        """Tokens of the request its shadow has yet to compute (all of them before it first drafts)."""
        shadow = self.shadows.get(req.request_id)
        return req.num_tokens - (shadow.num_computed_tokens if shadow is not None else 0)

    def release(self, keep: set[str]) -> None:
        """Free the shadows of requests not in `keep`."""
        for request_id in [r for r in self.shadows if r not in keep]:
            self.blocks.free(self.shadows.pop(request_id).block_table)

    def _level(self, req: Request) -> Request:
        """The request's shadow, its tokens the target's known ones and its cache cut to their common prefix."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = self.shadows[req.request_id] = Request(req.request_id, req.all_ids, GREEDY, frozenset())
        common = 0
        # The last known token is always computed again: its logits give the first proposal.
        limit = min(shadow.num_computed_tokens, len(req.all_ids) - 1)
        while common < limit and shadow.all_ids[common] == req.all_ids[common]:
            common += 1
        shadow.num_computed_tokens = common
        shadow.all_ids = list(req.all_ids)
        keep = self.blocks.blocks_needed(common)
        if len(shadow.block_table) > keep:
            self.blocks.free(shadow.block_table[keep:])
            del shadow.block_table[keep:]
        return shadow

    def _room(self, shadow: Request, num_tokens: int) -> bool:
        """Blocks for the shadow's first `num_tokens` tokens, allocated where missing; False if the pool is full."""
        need = self.blocks.blocks_needed(num_tokens) - len(shadow.block_table)
        if need <= 0:
            return True
        got = self.blocks.allocate(need)
        if got is None:
            return False
        shadow.block_table.extend(got)
        return True

    def propose(self, requests: Sequence[Request], ks: Sequence[int],
                generator: torch.Generator | None) -> list[list[int]]:
        """Up to ks[i] tokens to follow each request's known tokens (fewer where the draft's pool is full): greedy
        ones, or (given a generator) for an unseeded sampled request draws from the draft's distribution after the
        request's own penalties, processors and filters, each distribution kept in the request's `spec_q` for the
        target's rejection rule (engine/rejection.py)."""
        out: list[list[int]] = [[] for _ in requests]
        sampled = [generator is not None and uses_sampled_draft(req.params)
                   for req in requests]
        for req in requests:
            req.spec_q = []
        live = [(i, self._level(req)) for i, (req, k) in enumerate(zip(requests, ks)) if k > 0]
        for j in range(max(ks, default=0)):
            items = []
            for i, shadow in live:
                if len(out[i]) < ks[i] and len(out[i]) == j and self._room(shadow, shadow.num_tokens):
                    items.append((i, ScheduledRequest(shadow, shadow.num_tokens - shadow.num_computed_tokens)))
            if not items:
                break
            start = time.perf_counter()
            batch, logits = self.runner.execute([item for _, item in items])
            picked = [row for row in batch.sample_rows if row is not None]
            tokens = batch.argmax_ids if isinstance(batch, DecodeBatch) and batch.argmax_ids is not None else \
                argmax(logits[picked])
            drawing = [n for n, (i, _) in enumerate(items) if sampled[i]]
            if drawing:
                targets = [requests[items[n][0]] for n in drawing]
                q = distributions(Sampler.processed(logits[[picked[n] for n in drawing]], [
                    SamplingRow(req.params, None, req.prompt_ids, req.output_ids + out[items[n][0]], req.stop_ids)
                    for n, req in zip(drawing, targets)]), [req.params for req in targets])
                tokens = list(tokens)
                for n, req, dist in zip(drawing, targets, q):
                    tokens[n] = draw(dist, generator)  # type: ignore[arg-type]
                    req.spec_q.append(dist)
            if all(item.num_new_tokens == 1 for _, item in items):  # a decode pass (catch-up chunks are longer)
                seconds = time.perf_counter() - start
                self.step_seconds = seconds if not self.step_seconds else 0.8 * self.step_seconds + 0.2 * seconds
            for (i, item), token in zip(items, tokens):
                item.request.num_computed_tokens += item.num_new_tokens
                item.request.append_token(token)
                out[i].append(token)
        return out

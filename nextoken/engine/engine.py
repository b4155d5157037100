"""LLMEngine: add_request / step / abort, in one process. Each step schedules, runs the model once, samples, and
reports every request that advanced as a RequestOutput (new token ids and UTF-8-safe text since the last report).

Requests are validated when added (empty prompts, ids outside the vocabulary, prompt + max_tokens beyond the
context, a request larger than the whole KV pool, a full queue), so nothing that is queued can get stuck. A request
that finishes or is aborted gives its KV blocks back in the same call.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from nextoken.cache.block_manager import BlockManager
from nextoken.config import EngineConfig
from nextoken.engine.batch import DecodeBatch
from nextoken.engine.beam import Beam, BeamGroup
from nextoken.engine.inputs import InputProcessor, Limits
from nextoken.engine.output import TextStream
from nextoken.engine.request import Request, RequestOutput, RequestStatus
from nextoken.engine.runner import ModelRunner
from nextoken.engine.sampler import SampleResult, Sampler, SamplingRow, prompt_logprobs, sample_isolating, take_rows
from nextoken.engine.scheduler import Scheduler
from nextoken.engine.speculative import Speculator, first_rows, kept_logprobs, sampling_rows
from nextoken.errors import InvalidInput, NextokenError, PromptTooLong
from nextoken.loader.registry import model_name_for, no_collection, open_model, resolve_model
from nextoken.models.config import ModelConfig
from nextoken.ops import native
from nextoken.parallel.group import rank_threads, torchrun_rank
from nextoken.sampling_params import SamplingParams
from nextoken.loader.text_side import load_text_side
from nextoken.ops.calibration import calibration_ids

log = logging.getLogger("nextoken.engine")


class EngineBusy(NextokenError):
    """The waiting queue is full; try again later."""

    http_status = 503


@dataclass
class _Live:
    request: Request
    text: TextStream


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.tensor_parallel > 1:
            torch.set_num_threads(rank_threads(config))  # each rank its share of the cores
            if (torchrun_rank() or 0) > 0:
                # A launcher started this process as a worker rank: it runs its share of rank 0's passes, then ends.
                from nextoken.parallel.worker import run_launched

                run_launched(config)
                raise SystemExit(0)
        elif config.threads is not None:  # before loading, whose conversions run on the same threads
            torch.set_num_threads(config.threads)
        self.model_path = resolve_model(config.model)
        self.model_name = model_name_for(self.model_path) if config.model != str(self.model_path) \
            else self.model_path.name if self.model_path.is_dir() else self.model_path.stem
        with no_collection():
            gguf = open_model(self.model_path)
            self.model_config = ModelConfig.from_gguf(gguf)
            self.max_model_len = min(config.max_model_len or self.model_config.context_length,
                                     self.model_config.context_length)
            # The tokenizer is built beside the weights: its Python parts run while the weight conversions (numpy,
            # torch, native code) have the GIL released (Gemma 3's 262k vocabulary: about 0.9 s of a fresh load).
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="nextoken-tokenizer") as pool:
                text_side = pool.submit(load_text_side, gguf, self.model_config)
                self.runner = ModelRunner(gguf, self.model_config, config, self.max_model_len)
                self.tokenizer, self.chat_template = text_side.result()
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        # Prompts in: templates, encoding, the vocabulary and the limits every caller (CLI, LLM, server) checks.
        pool_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        self.inputs = InputProcessor(self.tokenizer, self.chat_template, self.model_config.vocab_size,
                                     Limits(self.max_model_len, pool_tokens, config.max_tokens_default),
                                     end_ids=self.model_config.eog_ids)
        if config.activations == "int8":  # each product's outlier columns fixed once (ops/calibration.py)
            self.runner.calibrate(calibration_ids(self.inputs))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill)
        self.sampler = Sampler()
        # Speculative decoding (engine/speculative.py), its verifying passes timed now for the choice of k.
        self.speculator = Speculator.build(config, self.runner, self.max_model_len, self.block_manager,
                                           lambda: calibration_ids(self.inputs))
        self.eog_ids = frozenset(self.model_config.eog_ids)
        self._live: dict[str, _Live] = {}
        self._beam_groups: dict[str, BeamGroup] = {}  # beam searches by request id (engine/beam.py)
        # Requests waiting for another's prompt blocks (add_request's share_prompt_with), by that request's id.
        self._followers: dict[str, list[Request]] = {}
        self._ids = itertools.count()
        self.observe_schedule = False  # set by an observer that reads last_schedule after each step
        self.last_schedule: list[tuple[str, int, int]] = []
        self.release_threads()  # the loading thread's: whichever thread steps next does not share the CPUs with them

    # --- requests --------------------------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    share_prompt_with: str | None = None) -> str:
        """Queue a request; returns its id. `share_prompt_with`: an earlier request of the same prompt (another choice
        of it) whose prompt blocks this one takes once they are computed, computing only its last prompt token
        itself (`_share_prompt`); where that request is gone, this one computes its prompt as any other."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._live:
            raise NextokenError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise InvalidInput("the prompt is empty")
        self.inputs.check_ids(prompt_ids)
        self.inputs.check_processor_ids(params)
        num_prompt = len(prompt_ids)
        if num_prompt >= self.max_model_len:
            raise PromptTooLong(f"the prompt has {num_prompt} tokens but the context holds {self.max_model_len}")
        if num_prompt + params.max_tokens > self.max_model_len:
            raise PromptTooLong(f"the prompt has {num_prompt} tokens and max_tokens is {params.max_tokens}: "
                                f"{num_prompt + params.max_tokens} exceeds the context length {self.max_model_len}")
        pool_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        if num_prompt + params.max_tokens > pool_tokens:
            raise PromptTooLong(f"the request needs {num_prompt + params.max_tokens} tokens of KV cache but the "
                                f"whole pool holds {pool_tokens}")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise EngineBusy(f"the waiting queue is full ({self.config.max_waiting} requests)")
        if params.beam_width is not None:
            if params.beam_width * (num_prompt + params.max_tokens) > pool_tokens:
                raise PromptTooLong(f"{params.beam_width} beams of {num_prompt + params.max_tokens} tokens need more "
                                    f"KV cache than the whole pool holds ({pool_tokens} tokens)")
            if request_id in self._beam_groups:
                raise NextokenError(f"request id {request_id!r} is already in use")
            root = Request(f"{request_id}#0", prompt_ids, BeamGroup.beam_params(params), self.eog_ids)
            group = BeamGroup(request_id, params, list(prompt_ids), [Beam(root)])
            self._beam_groups[request_id] = group
            self.scheduler.add(root)
            return request_id
        req = Request(request_id, prompt_ids, params, self.eog_ids)
        if params.structured_outputs is not None:
            req.grammar = self.inputs.grammars.matcher(params.structured_outputs)
        stream = TextStream(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens,
                            params.include_stop_str_in_output)
        self._live[request_id] = _Live(req, stream)
        leader = self._live.get(share_prompt_with) if share_prompt_with is not None else None
        if (leader is not None and leader.request.prompt_ids == req.prompt_ids and len(prompt_ids) > 1
                and leader.request.num_computed_tokens < leader.request.num_prompt_tokens):
            self._followers.setdefault(leader.request.request_id, []).append(req)
        else:
            self.scheduler.add(req)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it is unknown or already finished."""
        group = self._beam_groups.pop(request_id, None)
        if group is not None:
            for beam in group.beams:
                self.scheduler.finish(beam.request, "abort")
            return True
        live = self._live.pop(request_id, None)
        if live is None:
            return False
        for followers in self._followers.values():
            if live.request in followers:  # never queued: nothing to free
                followers.remove(live.request)
                live.request.finish("abort")
                return True
        self.scheduler.finish(live.request, "abort")
        self._release_followers(request_id)
        if self.speculator is not None:
            self.speculator.release(self.scheduler.running)
        return True

    def _release_followers(self, request_id: str) -> None:
        """A request ended before its prompt was computed: those waiting for its blocks compute their own."""
        for req in self._followers.pop(request_id, []):
            self.scheduler.add(req)

    def _share_prompt(self, leader: Request) -> None:
        """The requests waiting for `leader`'s prompt take its blocks: references to those before the last prompt
        token, a copy of the block holding it (each recomputes that token for logits of its own, and a block being
        written is never shared), and run from there, with the leader's prompt scores where they asked for them;
        without a free block, one computes its whole prompt."""
        bs = self.block_manager.block_size
        last = leader.num_prompt_tokens - 1  # the position each follower computes itself
        full = last // bs
        for req in self._followers.pop(leader.request_id, []):
            fresh = self.block_manager.allocate(1) if len(leader.block_table) > full else None
            if fresh is None:
                self.scheduler.add(req)
                continue
            self.runner.copy_block(leader.block_table[full], fresh[0])
            self.block_manager.take_cached(leader.block_table[:full])
            req.block_table = leader.block_table[:full] + fresh
            req.num_computed_tokens = last
            if req.params.prompt_logprobs is not None:  # the same prompt: the same scores (its own span is past them)
                req.prompt_logprobs = list(leader.prompt_logprobs)
                req.prompt_token_logprobs = list(leader.prompt_token_logprobs)
            req.num_cached_blocks = min(leader.num_cached_blocks, full)
            req.timings.first_scheduled = time.perf_counter()
            req.timings.num_cached_prompt_tokens = last
            req.status = RequestStatus.RUNNING
            self.scheduler.running.append(req)

    def get_request(self, request_id: str) -> Request | None:
        live = self._live.get(request_id)
        return live.request if live else None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def release_threads(self) -> None:
        """Let the calling thread's OpenMP workers go (see nt_release_threads): for a thread that is done stepping
        for now, so that the next thread to step, another one perhaps, runs at full speed. Its next step on this
        thread starts new workers (a thread start, tens of microseconds)."""
        lib = native.library() if self.runner.device.type == "cpu" else None
        if lib is not None:
            lib.nt_release_threads()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (they also stop when this process exits)."""
        self.runner.close()

    def idle_work(self) -> bool:
        """Work for a moment without requests: the weights' move onto huge pages, applied once its copy is ready
        (otherwise the first step after it applies it). Returns whether some is still pending."""
        return self.runner.settle(wait=False)

    # --- the loop --------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:  # proposals for the scheduler to fit in (beams and grammars never propose)
            self.speculator.propose([r for r in self.scheduler.running if r.request_id in self._live
                                     and r.grammar is None], self.max_model_len)
        scheduled = self.scheduler.schedule()
        if self.observe_schedule:  # for the server's /debug/engine: (request id, first position, tokens)
            self.last_schedule = [(i.request.request_id, i.request.num_computed_tokens,
                                   i.num_new_tokens + len(i.spec_ids)) for i in scheduled]
        if self.speculator is not None:
            for req in self.scheduler.running:
                req.spec_ids, req.spec_rule = [], None  # taken into this step's chunks, or dropped
        if not scheduled:
            return []
        started = time.perf_counter()
        batch, logits = self.runner.execute(scheduled)
        sampling = [(i, row) for i, row in enumerate(batch.sample_rows) if row is not None]
        result: SampleResult | None = None
        failed: set[int] = set()
        saved: dict[int, torch.Tensor] = {}  # seeded generators' states before verifying rows drew (by item)
        rows: list[SamplingRow] = []
        sampled_logits = logits
        if isinstance(batch, DecodeBatch) and batch.argmax_ids is not None:  # as the sampler allowed (argmax_only)
            result = Sampler.from_argmax(batch.argmax_ids)
        elif sampling:
            rows, picked, saved = sampling_rows(scheduled, sampling)  # one more per proposal (speculative.py)
            sampled_logits = take_rows(logits, picked)
            result, failed = sample_isolating(self.sampler, sampled_logits, rows)
        token_for = first_rows(scheduled, sampling)  # item -> its first row in the result
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        stepped: list[BeamGroup] = []
        for i, item in enumerate(scheduled):
            req = item.request
            kept: list[int] = []  # with proposals: the tokens this step yields (accepted ones, then one sampled)
            if item.spec_ids and self.speculator is not None and result is not None:
                kept = self.speculator.verify(item, result.token_ids, token_for[i], failed, saved.get(i),
                                              self.scheduler, sampled_logits, rows)
            else:
                self.scheduler.advance(item)
            live = self._live.get(req.request_id)
            if live is None:
                # A beam's id is its search's, then "#k" (the search's own id may hold a "#" too).
                group = self._beam_groups.get(req.request_id.rpartition("#")[0]) if "#" in req.request_id else None
                if group is not None and i in token_for and result is not None:
                    logprob = result.logprobs[token_for[i]]
                    group.record(req, logprob[1] if logprob is not None else [])
                    if group not in stepped:
                        stepped.append(group)
                continue
            span = batch.prompt_logprob_rows[i]
            if span is not None:
                row, count, first_pos = span
                # After a preemption the prompt is recomputed: keep only positions not reported yet.
                skip = max(0, len(req.prompt_logprobs) - first_pos)
                top, actual = prompt_logprobs(logits[row + skip:row + count], req.prompt_ids,
                                               first_pos + skip, req.params.prompt_logprobs or 0)
                req.prompt_logprobs.extend(top)
                if not req.prompt_token_logprobs:
                    req.prompt_token_logprobs.append(None)  # the first token: nothing before it to predict it
                req.prompt_token_logprobs.extend(actual)
            # After its prompt's scores: the followers take them with its blocks.
            if req.request_id in self._followers and req.num_computed_tokens >= req.num_prompt_tokens:
                self._share_prompt(req)
            if i not in token_for or result is None:
                continue
            k = token_for[i]
            if k in failed or (item.spec_ids and not kept):
                outputs.append(self._fail(live))
                continue
            try:
                if kept:
                    outputs.append(self._accept_run(live, kept, kept_logprobs(result, k, kept, sampled_logits), now))
                else:
                    outputs.append(self._accept(live, result.token_ids[k], result.logprobs[k], now))
            except Exception as exc:  # one request's detokenization or stop check must not take the batch down
                log.error("request %s failed: %s", req.request_id, type(exc).__name__)
                outputs.append(self._fail(live))
        for group in stepped:
            if group.ready():
                outputs.extend(self._advance_beams(group))
        if self.speculator is not None:
            if all(item.num_new_tokens == 1 for item in scheduled):
                self.speculator.observe(sum(1 + len(item.spec_ids) for item in scheduled),
                                        time.perf_counter() - started, any(item.spec_ids for item in scheduled))
            self.speculator.release(self.scheduler.running)
        return outputs

    def _accept_run(self, live: _Live, token_ids: list[int], logprobs: list, now: float) -> RequestOutput:
        """A verified step's tokens accepted in order, as one output; an end token, stop string or max_tokens
        among them ends the request there and the tokens after it are dropped."""
        out = self._accept(live, token_ids[0], logprobs[0], now)
        for token_id, logprob in zip(token_ids[1:], logprobs[1:]):
            if out.finished:
                break
            more = self._accept(live, token_id, logprob, now)
            out.new_token_ids += more.new_token_ids
            out.new_text += more.new_text
            out.new_logprobs += more.new_logprobs
            out.finished, out.finish_reason, out.num_output_tokens = more.finished, more.finish_reason, \
                more.num_output_tokens
        return out

    def _advance_beams(self, group: BeamGroup) -> list[RequestOutput]:
        """A beam search's step, once every live beam has its candidates; its result when it ends."""
        if not group.advance(self.scheduler, self.block_manager, self.runner.copy_block, self.eog_ids):
            return []
        del self._beam_groups[group.request_id]
        return [group.result(self.eog_ids, self.tokenizer.decode)]

    def _fail(self, live: _Live, error: NextokenError | None = None) -> RequestOutput:
        """End a request whose processing raised: finish_reason "error", blocks freed, the others go on. `error`:
        where the request's own settings caused it, what its caller is told (Request.error)."""
        req = live.request
        req.error = error
        self._live.pop(req.request_id, None)
        if not req.is_finished:
            self.scheduler.finish(req, "error")
        self._release_followers(req.request_id)
        return RequestOutput(request_id=req.request_id, new_token_ids=[], new_text="", finished=True,
                             finish_reason="error", num_prompt_tokens=req.num_prompt_tokens,
                             num_output_tokens=len(req.output_ids), request=req)

    def _accept(self, live: _Live, token_id: int, logprob: tuple | None, now: float) -> RequestOutput:
        req = live.request
        req.append_token(token_id)
        if req.timings.first_token is None:
            req.timings.first_token = now
        if logprob is not None:
            req.logprobs.append(logprob)
        stop: tuple[str, int | str | None] | None = None
        if req.grammar is not None and not req.grammar.accept(token_id):
            # Only where other processors banned every token the grammar allowed (or a fault): never silently
            # past the grammar.
            log.error("request %s: token %d breaks its grammar (%s)", req.request_id, token_id, req.grammar.error)
            return self._fail(live, InvalidInput(
                f"no token is left at output position {len(req.output_ids) - 1}: the structured output's grammar and the "
                f"request's other token constraints (allowed_token_ids, bad_words, logit_bias, min_tokens) exclude "
                f"every token", param="structured_outputs"))
        if token_id in req.stop_ids:
            stop = ("stop", token_id)
            delta = live.text.finish()
        else:
            delta, stop_str = live.text.add(token_id)
            if stop_str is not None:
                stop = ("stop", stop_str)
            elif req.grammar is not None and req.grammar.is_stopped:
                stop = ("stop", None)  # the grammar is complete and nothing may follow
                delta += live.text.finish()
            elif len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
                stop = ("length", None)
                delta += live.text.finish()
        if stop is not None:
            self.scheduler.finish(req, *stop)
            del self._live[req.request_id]
        return RequestOutput(
            request_id=req.request_id, new_token_ids=[token_id], new_text=delta,
            finished=req.status is RequestStatus.FINISHED, finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_output_tokens=len(req.output_ids),
            new_logprobs=[logprob] if logprob is not None else [], request=req)


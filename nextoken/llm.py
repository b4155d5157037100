"""The Python API: `LLM(model).generate(prompts, SamplingParams(...))`, `.chat(messages, ...)` and `.stream(...)`.

Everything runs through one LLMEngine: many prompts are batched by its scheduler, a single one is the same path
with one request. Chat messages go through the model's template; their contents are marked untrusted so that
special-token text typed by a user never becomes a control token.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nextoken.config import EngineConfig
from nextoken.engine.engine import LLMEngine
from nextoken.engine.inputs import Chat, PreparedPrompt, prompt_list
from nextoken.engine.reasoning import opened_by_prompt, split
from nextoken.engine.record import (ReplayResult, check_model, compare, make_bundle, read_bundle, with_logprobs,
                                    write_bundle)
from nextoken.engine.scoring import Perplexity, perplexity
from nextoken.engine.request import Request, RequestOutput
from nextoken.engine.tools import Tool, ToolCall, ToolCallParser, ToolSetup, prepare_messages, template_renders_tools
from nextoken.errors import InvalidInput, NextokenError
from nextoken.sampling_params import SamplingParams

Prompt = str | list[int]  # text, or token ids
Messages = list[dict[str, Any]]


@dataclass
class Completion:
    """One generated sequence."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    cumulative_logprob: float | None = None  # a beam's: the sum of its tokens' log-probabilities
    # A reasoning model's chat: the thinking section (None where the answer has none) and the rest of the text.
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # a chat with tools: the calls parsed out of the text (engine/tools.py)


@dataclass
class GenerationOutput:
    """One prompt's result: its `n` completions, usage and timings (`text`/`token_ids` are of the first)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    timings: dict[str, float | None]
    prompt_logprobs: list[list[tuple[int, float]]] | None = None  # per position: the top-K after it
    # Per position: (log p of the prompt's own token there, its rank); None at position 0. With prompt_logprobs.
    prompt_token_logprobs: list[tuple[float, int] | None] | None = None
    usage: dict[str, int] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def request_timings(req: Request) -> dict[str, float | None]:
    """Time to first token, prefill and decode rates of a finished request (seconds, tokens/s), and its
    speculative decoding counts."""
    t = req.timings
    ttft = t.first_token - t.arrival if t.first_token is not None else None
    prefill_s = t.first_token - t.first_scheduled if t.first_token and t.first_scheduled else None
    num_computed_prompt = req.num_prompt_tokens - t.num_cached_prompt_tokens
    decode_s = t.finished - t.first_token if t.finished and t.first_token else None
    num_decode = len(req.output_ids) - 1
    return {
        "time_to_first_token_s": ttft,
        "prefill_tokens_per_s": num_computed_prompt / prefill_s if prefill_s else None,
        "decode_tokens_per_s": num_decode / decode_s if decode_s and num_decode > 0 else None,
        "total_s": t.finished - t.arrival if t.finished else None,
        "cached_prompt_tokens": t.num_cached_prompt_tokens,
        # Speculative decoding: tokens proposed and accepted, and accepted per verifying step.
        "spec_proposed_tokens": t.num_spec_proposed,
        "spec_accepted_tokens": t.num_spec_accepted,
        "spec_mean_accepted": t.num_spec_accepted / t.num_spec_steps if t.num_spec_steps else None,
    }


class LLM:
    def __init__(self, model: str = "smollm2-135m-instruct", *, dtype: str = "auto", weights: str = "auto",
                 kv_dtype: str = "auto", device: str = "auto", **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, weights=weights, kv_dtype=kv_dtype,
                                             device=device, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self.chat_template = self.engine.chat_template
        self.inputs = self.engine.inputs
        self.model_config = self.engine.model_config
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel workers (`tensor_parallel` > 1), which also stop when this process exits."""
        self.engine.close()

    # --- prompts ---------------------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's ids as generate() takes them: text with the file's BOS/EOS rules, its special-token text as
        control tokens (the caller's own text); ids as given."""
        if isinstance(prompt, str):
            return self.inputs.encode(prompt, special_tokens=True)
        return list(prompt)

    def render_chat(self, messages: Messages, add_generation_prompt: bool = True) -> tuple[str, list[int]]:
        """Messages -> (prompt text, token ids), special tokens parsed only where the template wrote them."""
        return self.inputs.render_chat(messages, add_generation_prompt)

    # --- generation ------------------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, *,
                 use_tqdm: bool | None = None, record: str | Path | None = None) -> list[GenerationOutput]:
        """`record`: write the request (one prompt, one choice) as a bundle to replay (engine/record.py)."""
        params = params or SamplingParams()
        return self._run([self.inputs.process(p, params, special_tokens=True) for p in prompt_list(prompts)],
                         params, use_tqdm, record)

    def chat(self, messages: Messages | Sequence[Messages], params: SamplingParams | None = None, *,
             use_tqdm: bool | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: str | Mapping[str, Any] | None = None,
             parallel_tool_calls: bool | None = None, record: str | Path | None = None) -> list[GenerationOutput]:
        """Conversations through the chat template (`chat_template_kwargs`: more template variables, as Qwen3's
        {"enable_thinking": False}); a reasoning model's completions carry `reasoning` and `content` apart. `tools`,
        `tool_choice` and `parallel_tool_calls` as OpenAI's (messages may carry `tool_calls` and the `tool` role):
        completions then carry `tool_calls` and the rest as `content` (engine/tools.py). `record`: as generate's."""
        params = params or SamplingParams()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        setup = ToolSetup.from_request([Tool.from_openai(t) for t in tools or ()], tool_choice, parallel_tool_calls)
        native = template_renders_tools(self.inputs.chat_template.source)
        if setup is not None and setup.constraint() is not None:
            params = replace(params, structured_outputs=setup.constraint())
        prepared = []
        for c in conversations:
            shown, tool_vars = prepare_messages(list(c), setup, native)  # type: ignore[arg-type]
            chat = Chat(shown, template_kwargs={**(chat_template_kwargs or {}), **tool_vars})
            prepared.append(self.inputs.process(chat, params))
        results = self._run(prepared, params, use_tqdm, record)
        for result in results:
            for completion in result.outputs:
                if self.inputs.thinks:
                    completion.reasoning, completion.content = split(completion.text, opened_by_prompt(result.prompt))
                if setup is not None and not setup.calls_possible:
                    if completion.content is None:
                        completion.content = completion.text
                    completion.tool_calls = []
                elif setup is not None:
                    parser = ToolCallParser()
                    content = parser.feed(completion.content if completion.content is not None
                                          else completion.text)[0] + parser.finish()[0]
                    completion.tool_calls = parser.calls
                    completion.content = content if content.strip() or not parser.calls else None
                    if parser.calls and completion.finish_reason == "stop":
                        completion.finish_reason = "tool_calls"
        return results

    def perplexity(self, text: str, *, context: int | None = None, stride: int | None = None,
                   progress: Callable[[Perplexity, int, int], None] | None = None) -> Perplexity:
        """The model's perplexity on `text` (with the file's BOS rule), scored in windows of `context` tokens
        (default: the context length, at most 1024) starting `stride` apart (default: half a window); see
        engine/scoring.py."""
        ids = self.inputs.encode(text, special_tokens=True)
        context = context or min(self.engine.max_model_len, 1024)
        if context > self.engine.max_model_len:
            raise InvalidInput(f"a window of {context} tokens exceeds the context length {self.engine.max_model_len}",
                               "context")
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

        def score(windows: list[list[int]]) -> list[list[float | None]]:
            outs = self.generate(windows, params, use_tqdm=False)
            return [[None if e is None else e[0] for e in out.prompt_token_logprobs or []] for out in outs]

        return perplexity(ids, context, stride or max(1, context // 2), score, progress=progress)

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Run one request, yielding its RequestOutput after every step; aborts it if the caller stops early."""
        params = params or SamplingParams()
        request_id = self.engine.add_request(prompt_ids, params, f"stream-{next(self._ids)}")
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                self.engine.abort(request_id)
            self.engine.release_threads()  # the next call may come from another thread

    def replay(self, path: str | Path) -> ReplayResult:
        """Run a recorded request again on this model (refused if it is another model file) and compare it with
        the record step by step (engine/record.py)."""
        bundle = read_bundle(path)
        check_model(bundle, self.engine)
        out = self.generate([bundle.prompt_ids], with_logprobs(bundle.params), use_tqdm=False)[0].outputs[0]
        return compare(bundle, out.token_ids, out.logprobs or [], out.finish_reason, self.tokenizer.display_piece)

    def _run(self, prompts: list[PreparedPrompt], params: SamplingParams,
             use_tqdm: bool | None, record: str | Path | None = None) -> list[GenerationOutput]:
        engine = self.engine
        if record is not None:
            if len(prompts) != 1 or len(prompts[0].params) != 1 or params.beam_width is not None:
                raise InvalidInput("record= writes one request: give one prompt, n=1 and no beam search", "record")
            prompts = [replace(prompts[0], params=[with_logprobs(prompts[0].params[0])])]
        groups: list[list[str]] = []
        added: list[str] = []
        try:
            for prompt in prompts:
                group: list[str] = []
                for choice in prompt.params:  # a prompt's other choices take its blocks from the first
                    rid = engine.add_request(prompt.prompt_ids, choice, f"gen-{next(self._ids)}",
                                             share_prompt_with=group[0] if group else None)
                    added.append(rid)
                    group.append(rid)
                groups.append(group)
        except NextokenError:
            for rid in added:
                engine.abort(rid)
            raise
        texts: dict[str, list[str]] = {rid: [] for g in groups for rid in g}
        done: dict[str, Request] = {}
        progress = _Progress(len(texts), enabled=use_tqdm)
        try:
            while len(done) < len(texts):
                for out in engine.step():
                    if out.request_id not in texts:
                        continue
                    texts[out.request_id].append(out.new_text)
                    progress.tokens += len(out.new_token_ids)
                    if out.finished and out.request is not None:
                        done[out.request_id] = out.request
                        progress.advance()
        finally:
            progress.close()
            for rid in texts:
                if rid not in done:
                    engine.abort(rid)
            engine.release_threads()  # the next call may come from another thread
        failed = [rid for rid, req in done.items() if req.finish_reason == "error"]
        for rid in failed:
            error = done[rid].error
            if error is not None:  # the request's own settings: its error, not the engine's
                raise error
        if failed:
            raise NextokenError(f"generation failed inside the engine for request(s) {', '.join(failed)}; "
                                "see the nextoken.engine log")
        results = []
        for prompt, group in zip(prompts, groups):
            ids = prompt.prompt_ids
            reqs = [done[rid] for rid in group]
            first = reqs[0]
            if first.beams is not None:  # a beam search: its n best hypotheses
                decode = self.tokenizer.decode
                completions = [Completion(i, decode(h.token_ids, skip_special_tokens=params.skip_special_tokens),
                                          list(h.token_ids), h.finish_reason, h.logprobs,
                                          cumulative_logprob=h.cumulative_logprob)
                               for i, h in enumerate(first.beams)]
            else:
                completions = [Completion(i, "".join(texts[r.request_id]), list(r.output_ids), r.finish_reason,
                                          r.logprobs if params.logprobs is not None else None)
                               for i, r in enumerate(reqs)]
            if record is not None:
                write_bundle(record, make_bundle(engine, first, prompt.text, completions[0].text, params))
            num_out = sum(len(c.token_ids) for c in completions)
            results.append(GenerationOutput(
                request_id=first.request_id, prompt=prompt.text, prompt_token_ids=ids, outputs=completions,
                timings=request_timings(first),
                prompt_logprobs=first.prompt_logprobs if params.prompt_logprobs is not None else None,
                prompt_token_logprobs=first.prompt_token_logprobs if params.prompt_logprobs is not None else None,
                usage={"prompt_tokens": len(ids), "completion_tokens": num_out, "total_tokens": len(ids) + num_out},
            ))
        return results


class _Progress:
    """A rich progress bar (requests done, output tokens/s), shown only for batches that take a while."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        self.total, self.done, self.tokens = total, 0, 0
        self.enabled = enabled if enabled is not None else total > 1
        self.start = time.perf_counter()
        self._bar: Any = None

    def advance(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is None and time.perf_counter() - self.start > 2.0:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("gen", total=self.total, rate="")
        if self._bar is not None:
            rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
            self._bar.update(self._task, completed=self.done, rate=f"{rate:,.0f} tok/s")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()

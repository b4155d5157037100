"""Tracers: what the engine's forward passes and sampler did, observed on the path each step really takes.

`NullTracer` (the default) attaches nothing and records nothing: an untraced run pays a few no-op calls per step.
`RecordingTracer` sets the model's probe (a PassRecorder, passes.py: the native calls' own counters, the module
path's boundaries and hooks on its attention and MLP modules) and wraps the engine's sampler call. Where attention
maps are asked for, a hook on the rotary modules keeps q and k; a step that ran fused is re-run on the module path
over a private copy of its cache for them (replay.py), and how far the two came apart is recorded. `detach()` removes
the probe and every hook and restores the sampler. A traced run takes the paths an untraced one takes and computes
exactly what it computes. Invariants: one request at a time and one forward pass per step (every pass is taken to be
this request's); all times are seconds since `start()`, read with perf_counter (after a device sync on CUDA) or
converted from the native calls' CLOCK_MONOTONIC readings.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from nextoken.engine.rejection import RuleTrail
from nextoken.engine.request import Request
from nextoken.engine.sampler import SampleResult, SamplingRow
from nextoken.models.probe import MODULES
from nextoken.trace.attention import DEFAULT_BUDGET, AttentionCapture
from nextoken.trace.passes import PassRecorder, StepRecord
from nextoken.trace.probs import SampleRecord, describe_sample
from nextoken.trace.replay import Agreement, replay_on_modules
from nextoken.trace.speculation import SpecRecord

if TYPE_CHECKING:
    from nextoken.engine.engine import LLMEngine

# Pipeline order. "schedule": scheduler + batch building; "detokenize": the engine's update after sampling (text
# delta, stop checks, bookkeeping); "trace": the tracer's own work between steps, which an untraced run never does.
STAGES = ("tokenize", "schedule", "embedding", "blocks", "lm_head", "sampling", "detokenize", "trace")


class NullTracer:
    """Records nothing; every method is a no-op. Subclasses override what they observe."""

    def attach(self, engine: LLMEngine) -> None:
        """Hook into `engine` (its model and sampler) for one run."""

    def detach(self) -> None:
        """Remove everything `attach` added; safe to call twice."""

    def start(self, origin: float) -> None:
        """Set the clock origin (a perf_counter reading) of the run."""

    def record(self, stage: str, start: float, end: float) -> None:
        """A span measured by the caller, in perf_counter readings (e.g. tokenization, before any step)."""

    def begin_request(self, request: Request) -> None:
        """The request just added; every following forward pass belongs to it."""

    def begin_step(self) -> None:
        """Right before `engine.step()`."""

    def end_step(self) -> None:
        """Right after `engine.step()` returned."""


class _SamplerProbe:
    """Stands in for the engine's sampler: times the call and keeps a copy of the logits row it was given."""

    def __init__(self, inner: Any, tracer: RecordingTracer) -> None:
        self.inner = inner
        self._tracer = tracer

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        tracer = self._tracer
        start = tracer.now()
        result = self.inner(logits, rows)
        end = tracer.now()
        tracer.on_sample(start, end, logits, rows, result)
        return result

    def __getattr__(self, name: str) -> Any:  # the sampler's other attributes (its default generator...)
        return getattr(self.inner, name)


class RecordingTracer(NullTracer):
    """Spans per step, per-layer attention/MLP times, top-K candidates per sampled token, optional attention; the
    path every step took.

    One instance records one run: make a new one for the next.
    """

    def __init__(self, top_k: int = 5, capture_attention: bool = False,
                 attention_budget: int = DEFAULT_BUDGET) -> None:
        self.top_k = top_k
        self.capture_attention = capture_attention
        self.attention_budget = attention_budget
        self.spans: dict[str, tuple[float, float]] = {}  # run-level spans (tokenize)
        self.steps: list[StepRecord] = []
        self.attention: AttentionCapture | None = None
        self.engine: LLMEngine | None = None
        self._passes = PassRecorder(0, self.now, self._from_monotonic, keep_logits=False)  # sized in attach
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._origin = 0.0
        self._monotonic_shift = 0.0  # perf_counter - CLOCK_MONOTONIC (the native calls' clock)
        self._sync = False
        self._request: Request | None = None
        self._step: StepRecord | None = None
        self._num_output = 0  # the request's tokens before this step
        # This step's sampled rows of the request (one, or one per proposal more): logits, row, output, drawn, mask.
        self._pending: list[tuple[torch.Tensor, SamplingRow, list[int], int, Any]] = []

    @property
    def max_blocks(self) -> int:
        """KV blocks this request held at most."""
        return self._passes.max_blocks

    # --- clock -------------------------------------------------------------------------------------------

    def now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()  # kernels run asynchronously: wait so the time covers their work
        return time.perf_counter() - self._origin

    def start(self, origin: float) -> None:
        self._origin = origin
        # Where perf_counter reads another clock than the native calls' (not on Linux), the two are lined up here.
        if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
            self._monotonic_shift = time.perf_counter() - time.clock_gettime(time.CLOCK_MONOTONIC)

    def record(self, stage: str, start: float, end: float) -> None:
        self.spans[stage] = (start - self._origin, end - self._origin)

    def _from_monotonic(self, reading: float) -> float:
        return reading + self._monotonic_shift - self._origin

    # --- attaching ---------------------------------------------------------------------------------------

    def attach(self, engine: LLMEngine) -> None:
        if self.engine is not None or self.steps or self.spans:
            raise RuntimeError("a RecordingTracer records one run; make a new one")
        if engine.runner.model.probe is not None:
            raise RuntimeError("the model is already watched by another probe")
        self.engine = engine
        try:
            self._attach(engine)
        except BaseException:
            self.detach()  # all or nothing: no hook outlives a failed attach
            raise

    def _attach(self, engine: LLMEngine) -> None:
        model = engine.runner.model
        self._sync = engine.runner.device.type == "cuda"
        layers = list(model.layers)
        self._passes = PassRecorder(len(layers), self.now, self._from_monotonic, keep_logits=self.capture_attention)
        # No hook on the model or its blocks: the fused paths stand down for those (whoever hooks them expects to
        # see them run), and the probe sees every path.
        self._handles += self._passes.hook(layers)
        ropes = {id(r): r for r in (getattr(layer.attn, "rope", None) for layer in layers) if r is not None}
        for rope in ropes.values():  # Llama shares one rotary module across layers: hooked once
            self._handles.append(rope.register_forward_hook(self._on_rope, with_kwargs=True))
        model.probe = self._passes
        self._inner_sampler = engine.sampler
        engine.sampler = _SamplerProbe(engine.sampler, self)  # type: ignore[assignment]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.engine is not None:
            model = self.engine.runner.model
            if model.probe is self._passes:
                model.probe = None
            if isinstance(self.engine.sampler, _SamplerProbe):
                self.engine.sampler = self._inner_sampler
        self.engine = None

    # --- per request and step ----------------------------------------------------------------------------

    def begin_request(self, request: Request) -> None:
        self._request = request
        engine = self.engine
        if self.capture_attention and engine is not None:
            cfg = engine.model_config
            attns = [layer.attn for layer in engine.runner.model.layers]
            self.attention = AttentionCapture(
                cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                scales=[float(getattr(a, "scale", cfg.query_scale)) for a in attns],
                windows=[getattr(a, "sliding_window", None) for a in attns],
                num_prompt_tokens=request.num_prompt_tokens, max_tokens=request.params.max_tokens,
                budget=self.attention_budget)

    def begin_step(self) -> None:
        n = self._passes.num_layers
        self._step = StepRecord(index=len(self.steps), attn_s=[0.0] * n, mlp_s=[0.0] * n, block_s=[0.0] * n)
        self._passes.start_step(self._step, self._request, self.now())
        self._pending = []
        self._num_output = len(self._request.output_ids) if self._request is not None else 0

    def end_step(self) -> None:
        step, marks = self._step, self._passes.marks
        if step is None:
            return
        end = self.now()
        after = marks.get("sample_end", marks.get("model_end", marks["step"]))
        step.spans["detokenize"] = (after, end)
        if self._pending:
            # Row j verifies proposal j + 1: the tokens the rows after it were given (their outputs' last).
            proposed = [output_ids[-1] for _, _, output_ids, _, _ in self._pending[1:]]
            tokens = [token_id for _, _, _, token_id, _ in self._pending]
            # Under the rejection rule (a sampled draft) the step yields the proposals it kept, then a residual
            # draw or the last row's own: rows 0..m describe those tokens.
            trail = self._request.spec_rule if self._request is not None and proposed else None
            if trail is not None:
                kept = next((j for j, d in enumerate(trail.decisions) if not d.kept), len(trail.decisions))
                tokens[:kept + 1] = proposed[:kept] + [trail.last]
            records = [describe_sample(logits, row.params, row.prompt_ids, output_ids, tokens[j], self.top_k,
                                       row.stop_ids, allowed, probs_of=proposed[j:j + 1])
                       for j, (logits, row, output_ids, _, allowed) in enumerate(self._pending)]
            step.sample = records[0]
            step.speculation = self._speculation(records, proposed, self._pending[0][1].params.is_greedy, trail)
            self._pending = []
        elif self._passes.greedy:
            step.sample = self._argmax_sample()
            if step.sample is not None:  # a step that proposed nothing (under speculation: why)
                step.speculation = self._speculation([step.sample], [], True)
        if self.attention is not None:
            if "model" in marks and step.path != MODULES:
                step.replay = self._replay(step)
            self.attention.flush()
        if "model" in marks:  # a step that ran no forward pass (nothing scheduled) is not worth a record
            self.steps.append(step)
        step.spans["trace"] = (end, self.now())
        self._step = None
        self._passes.start_step(None, self._request, end)

    def _speculation(self, records: list[SampleRecord], proposed: list[int], greedy: bool,
                     trail: RuleTrail | None = None) -> SpecRecord | None:
        """A decode step's proposals, judged by its rows, with what the speculator chose (engine/spec_policy.py)."""
        engine, req, step = self.engine, self._request, self._step
        if engine is None or req is None or step is None or engine.speculator is None or step.phase != "decode":
            return None
        state = req.spec_state
        ids = req.all_ids[:req.num_prompt_tokens + self._num_output]  # the sequence as the proposer saw it
        match = None
        if engine.speculator.draft is None and state is not None and proposed:
            found = state.index.match(ids)
            match = (found[0], found[1]) if found is not None else None
        return SpecRecord.build(engine.config.speculative or "", state.choice if state is not None else None,
                                match, records, proposed, greedy, trail)

    def _argmax_sample(self) -> SampleRecord | None:
        """The candidates of a step whose native call took the argmax (no sampler ran), from the logits it wrote."""
        req, logits = self._request, self._passes.logits
        if req is None or logits is None or len(req.output_ids) != self._num_output + 1:
            return None
        return describe_sample(logits[0], req.params, req.prompt_ids, req.output_ids[:-1], req.output_ids[-1],
                               self.top_k)

    def _replay(self, step: StepRecord) -> Agreement | None:
        """Re-run a fused step on the module path (its attention maps come from there) and compare the two."""
        engine, req, table = self.engine, self._request, self._passes.block_table
        if engine is None or req is None or table is None:
            return None
        runner = engine.runner
        ids = req.all_ids[step.first_position:step.first_position + step.num_tokens]
        self._passes.paused = True
        try:
            return replay_on_modules(runner.model, runner.kv_pool, table, ids, step.first_position,
                                     self._passes.logits, runner.activations == "int8")
        finally:
            self._passes.paused = False

    # --- hooks ---------------------------------------------------------------------------------------------

    def _on_rope(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        capture, layer = self.attention, self._passes.current_layer
        if capture is None or self._step is None or not capture.wants(layer):
            return
        if not (isinstance(output, tuple) and len(output) == 2):
            return  # not the (q, k) this capture understands: show no attention rather than break the run
        positions = args[0] if args else kwargs["positions"]
        capture.add(layer, positions, output[0], output[1])

    def on_sample(self, start: float, end: float, logits: torch.Tensor, rows: list[SamplingRow],
                  result: SampleResult) -> None:
        """From the sampler probe: keep a copy of this request's logits row and what was drawn."""
        step = self._step
        if step is None:
            return
        step.spans["sampling"] = (start, end)
        self._passes.marks["sample_end"] = end
        req = self._request
        # The engine hands each row its request's own output list: find ours by identity.
        idx = next((i for i, r in enumerate(rows) if req is not None and r.output_ids is req.output_ids), None)
        if idx is None and len(rows) == 1:
            idx = 0
        if idx is None:
            return
        # The rows verifying this request's proposals follow its first (engine/speculative.py sampling_rows): the
        # same prompt, the output one proposal longer each.
        end = idx + 1
        while (end < len(rows) and rows[end].prompt_ids is rows[idx].prompt_ids
               and len(rows[end].output_ids) == len(rows[idx].output_ids) + end - idx):
            end += 1
        for j in range(idx, end):
            # Copies: the engine appends the drawn token to output_ids right after, and penalties need the before.
            # A grammar's mask now, before the drawn token advances its matcher.
            grammar = rows[j].grammar
            self._pending.append((logits[j].detach().float().cpu().clone(), rows[j], list(rows[j].output_ids),
                                  result.token_ids[j], grammar.allowed() if grammar is not None else None))

    # --- summaries ---------------------------------------------------------------------------------------

    def stage_seconds(self, phase: str | None = None) -> dict[str, float]:
        """Seconds per stage over all steps, or the steps of one phase (run-level spans such as tokenization come
        before the first token, so they count as prefill)."""
        totals = dict.fromkeys(STAGES, 0.0)
        if phase in (None, "prefill"):
            for stage, (start, end) in self.spans.items():
                totals[stage] += end - start
        for step in self.steps:
            if phase is None or step.phase == phase:
                for stage, (start, end) in step.spans.items():
                    totals[stage] += end - start
        return totals

    def layer_seconds(self, phase: str) -> dict[str, list[float]]:
        """Per-layer seconds summed over one phase's steps: attn, mlp and other (norms, residual adds)."""
        n = self._passes.num_layers
        out = {"attn": [0.0] * n, "mlp": [0.0] * n, "other": [0.0] * n}
        for step in self.steps:
            if step.phase != phase:
                continue
            for i in range(n):
                out["attn"][i] += step.attn_s[i]
                out["mlp"][i] += step.mlp_s[i]
                out["other"][i] += max(0.0, step.block_s[i] - step.attn_s[i] - step.mlp_s[i])
        return out

    @property
    def samples(self) -> list[SampleRecord]:
        """One per generated token, in order (a verifying step yields several)."""
        return [rec for s in self.steps for rec in s.samples]

    @property
    def speculation(self) -> list[tuple[int, SpecRecord]]:
        """(the index of its first token, the record) of each decode step under speculative decoding."""
        out, at = [], 0
        for s in self.steps:
            if s.speculation is not None:
                out.append((at, s.speculation))
            at += len(s.samples)
        return out

    def paths(self, phase: str | None = None) -> Counter[str]:
        """Steps per path (models.probe.PATHS) over all steps, or the steps of one phase."""
        return Counter(step.path for step in self.steps if phase is None or step.phase == phase)

    @property
    def replays(self) -> list[Agreement]:
        """The fused steps' re-runs on the module path (for their attention maps), in step order."""
        return [s.replay for s in self.steps if s.replay is not None]

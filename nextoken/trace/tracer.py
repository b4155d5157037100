"""Tracers: what the engine's forward passes and sampler did, observed from outside through hooks.

`NullTracer` (the default) attaches nothing and records nothing: an untraced run pays a few no-op calls per step.
`RecordingTracer` registers PyTorch forward hooks on the model (the model itself, each block, its attention and
MLP, the rotary modules) and wraps the engine's sampler call; `detach()` removes every hook and restores the sampler.
Hooks only read tensors and copy what they keep, so a traced run computes exactly what an untraced one does.
Invariants: one request at a time and one forward pass per step (every pass is taken to be this request's); all
times are seconds since `start()`, read with perf_counter after a device sync on CUDA.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from nextoken.engine.request import Request
from nextoken.engine.sampler import SampleResult, SamplingRow
from nextoken.trace.attention import DEFAULT_BUDGET, AttentionCapture
from nextoken.trace.probs import SampleRecord, describe_sample

if TYPE_CHECKING:
    from nextoken.engine.engine import LLMEngine

# Pipeline order. "schedule": scheduler + batch building; "detokenize": the engine's update after sampling (text
# delta, stop checks, bookkeeping); "trace": the tracer's own work between steps, which an untraced run never does.
STAGES = ("tokenize", "schedule", "embedding", "blocks", "lm_head", "sampling", "detokenize", "trace")


@dataclass
class StepRecord:
    """One engine step. `spans[stage] = (start, end)`; per-layer lists hold seconds, index = layer."""

    index: int
    first_position: int = 0
    num_tokens: int = 0
    phase: str = "prefill"  # "prefill" while the prompt is being computed, then "decode"
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    attn_s: list[float] = field(default_factory=list)
    mlp_s: list[float] = field(default_factory=list)
    block_s: list[float] = field(default_factory=list)
    sample: SampleRecord | None = None

    def seconds(self, stage: str) -> float:
        start, end = self.spans.get(stage, (0.0, 0.0))
        return end - start


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
    """Spans per step, per-layer attention/MLP times, top-K candidates per sampled token, optional attention.

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
        self.max_blocks = 0  # KV blocks this request held at most
        self.engine: LLMEngine | None = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._origin = 0.0
        self._sync = False
        self._request: Request | None = None
        self._step: StepRecord | None = None
        self._marks: dict[str, float] = {}
        self._layer_start: list[float] = []
        self._current_layer = -1
        self._pending_sample: tuple[torch.Tensor, SamplingRow, list[int], int] | None = None

    # --- clock -------------------------------------------------------------------------------------------

    def now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()  # kernels run asynchronously: wait so the time covers their work
        return time.perf_counter() - self._origin

    def start(self, origin: float) -> None:
        self._origin = origin

    def record(self, stage: str, start: float, end: float) -> None:
        self.spans[stage] = (start - self._origin, end - self._origin)

    # --- attaching ---------------------------------------------------------------------------------------

    def attach(self, engine: LLMEngine) -> None:
        if self.engine is not None or self.steps or self.spans:
            raise RuntimeError("a RecordingTracer records one run; make a new one")
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
        self._layer_start = [0.0] * len(layers)
        hook = self._handles.append
        hook(model.register_forward_pre_hook(self._on_model_start, with_kwargs=True))
        hook(model.register_forward_hook(self._on_model_end))
        ropes: dict[int, torch.nn.Module] = {}
        for i, layer in enumerate(layers):
            hook(layer.register_forward_pre_hook(self._timer_start(i)))
            hook(layer.register_forward_hook(self._timer_end(i, "block_s")))
            hook(layer.attn.register_forward_pre_hook(self._attn_start(i)))
            hook(layer.attn.register_forward_hook(self._timer_end(i, "attn_s", "attn")))
            hook(layer.mlp.register_forward_pre_hook(self._mark(f"mlp{i}")))
            hook(layer.mlp.register_forward_hook(self._timer_end(i, "mlp_s", f"mlp{i}")))
            rope = getattr(layer.attn, "rope", None)
            if rope is not None:
                ropes[id(rope)] = rope  # Llama shares one rotary module across layers: hook it once
        for rope in ropes.values():
            hook(rope.register_forward_hook(self._on_rope, with_kwargs=True))
        self._inner_sampler = engine.sampler
        engine.sampler = _SamplerProbe(engine.sampler, self)  # type: ignore[assignment]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.engine is not None and isinstance(self.engine.sampler, _SamplerProbe):
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
        n = len(self._layer_start)
        self._step = StepRecord(index=len(self.steps), attn_s=[0.0] * n, mlp_s=[0.0] * n, block_s=[0.0] * n)
        self._marks = {"step": self.now()}
        self._pending_sample = None

    def end_step(self) -> None:
        step, marks = self._step, self._marks
        if step is None:
            return
        end = self.now()
        after = marks.get("sample_end", marks.get("model_end", marks["step"]))
        step.spans["detokenize"] = (after, end)
        if self._pending_sample is not None:
            logits, row, output_ids, token_id = self._pending_sample
            step.sample = describe_sample(logits, row.params, row.prompt_ids, output_ids, token_id, self.top_k)
            self._pending_sample = None
        if self.attention is not None:
            self.attention.flush()
        if "model" in marks:  # a step that ran no forward pass (nothing scheduled) is not worth a record
            self.steps.append(step)
        step.spans["trace"] = (end, self.now())
        self._step = None

    # --- hooks -------------------------------------------------------------------------------------------

    def _on_model_start(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        now = self.now()
        step = self._step
        if step is None:
            return
        self._marks["model"] = now
        step.spans["schedule"] = (self._marks["step"], now)
        positions = args[1] if len(args) > 1 else kwargs["positions"]
        step.num_tokens = int(positions.numel())
        step.first_position = int(positions[0]) if step.num_tokens else 0
        req = self._request
        if req is not None:
            step.phase = "prefill" if step.first_position < req.num_prompt_tokens else "decode"
            self.max_blocks = max(self.max_blocks, len(req.block_table))

    def _on_model_end(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        now = self.now()
        if self._step is None:
            return
        self._marks["model_end"] = now
        self._step.spans["lm_head"] = (self._marks.get("blocks_end", now), now)

    def _timer_start(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            now = self.now()
            self._layer_start[layer] = now
            if layer == 0 and self._step is not None:
                self._marks["blocks"] = now
                self._step.spans["embedding"] = (self._marks.get("model", now), now)
        return hook

    def _attn_start(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self._current_layer = layer  # the rotary hook that follows belongs to this layer
            self._marks["attn"] = self.now()
        return hook

    def _mark(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self._marks[name] = self.now()
        return hook

    def _timer_end(self, layer: int, field_name: str, mark: str | None = None) -> Any:
        last = len(self._layer_start) - 1

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            now = self.now()
            step = self._step
            if step is None:
                return
            start = self._marks.get(mark, now) if mark is not None else self._layer_start[layer]
            getattr(step, field_name)[layer] += now - start
            if field_name == "block_s" and layer == last:
                self._marks["blocks_end"] = now
                step.spans["blocks"] = (self._marks.get("blocks", now), now)
        return hook

    def _on_rope(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        capture = self.attention
        if capture is None or self._step is None or not capture.wants(self._current_layer):
            return
        if not (isinstance(output, tuple) and len(output) == 2):
            return  # not the (q, k) this capture understands: show no attention rather than break the run
        positions = args[0] if args else kwargs["positions"]
        capture.add(self._current_layer, positions, output[0], output[1])

    def on_sample(self, start: float, end: float, logits: torch.Tensor, rows: list[SamplingRow],
                  result: SampleResult) -> None:
        """From the sampler probe: keep a copy of this request's logits row and what was drawn."""
        step = self._step
        if step is None:
            return
        step.spans["sampling"] = (start, end)
        self._marks["sample_end"] = end
        req = self._request
        # The engine hands each row its request's own output list: find ours by identity.
        idx = next((i for i, r in enumerate(rows) if req is not None and r.output_ids is req.output_ids), None)
        if idx is None and len(rows) == 1:
            idx = 0
        if idx is not None:
            # Copies: the engine appends the drawn token to output_ids right after, and penalties need the before.
            self._pending_sample = (logits[idx].detach().float().cpu().clone(), rows[idx],
                                    list(rows[idx].output_ids), result.token_ids[idx])

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
        n = len(self._layer_start)
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
        return [s.sample for s in self.steps if s.sample is not None]

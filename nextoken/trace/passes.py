"""One engine step's forward pass as the model's probe reports it (models/probe.py): the path it took, the spans of
its stages and each layer's attention, MLP and block seconds.

On the native paths the figures are the calls' own counters (the profile they time into from inside their one call);
on the module path, the probe's boundaries and forward hooks on the attention and MLP modules, which fire only where
the modules run. Invariants: one pass per step; every time is on the tracer's clock (native CLOCK_MONOTONIC readings
converted to it); while `paused` (the tracer re-running the step on the modules) nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from nextoken.engine.request import Request
from nextoken.models.probe import FUSED_BLOCKS, MODULES, NATIVE_STEP, ForwardProbe
from nextoken.ops import native
from nextoken.ops.native import LayerTime, ProfileSlot
from nextoken.trace.probs import SampleRecord
from nextoken.trace.replay import Agreement
from nextoken.trace.speculation import SpecRecord

if TYPE_CHECKING:
    from nextoken.models.layers import MoE


@dataclass
class StepRecord:
    """One engine step. `spans[stage] = (start, end)`; per-layer lists hold seconds, index = layer."""

    index: int
    first_position: int = 0
    num_tokens: int = 0
    phase: str = "prefill"  # "prefill" while the prompt is being computed, then "decode"
    path: str = MODULES  # the path its forward pass took: models.probe.PATHS
    spans: dict[str, tuple[float, float]] = field(default_factory=dict)
    attn_s: list[float] = field(default_factory=list)
    mlp_s: list[float] = field(default_factory=list)
    block_s: list[float] = field(default_factory=list)
    sample: SampleRecord | None = None
    # Mixture-of-experts layers: per layer, the experts the step's last token took and their weights (empty: none).
    router: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    # A fused step re-run on the module path for its attention maps: how the two compare (None: not re-run).
    replay: Agreement | None = None
    # Under speculative decoding, a decode step's proposals and their verdicts (trace/speculation.py).
    speculation: SpecRecord | None = None

    @property
    def samples(self) -> list[SampleRecord]:
        """The tokens this step yielded, each as its row was sampled: one, or with accepted proposals several."""
        if self.sample is None:
            return []
        return [self.sample] + (self.speculation.kept if self.speculation is not None else [])

    def seconds(self, stage: str) -> float:
        start, end = self.spans.get(stage, (0.0, 0.0))
        return end - start


class PassRecorder(ForwardProbe):
    """The model's probe during a trace. `keep_logits`: keep each fused pass's logits (a re-run compares with them);
    a greedy native step's are kept anyway (no sampler sees them, and its candidates come from them)."""

    def __init__(self, num_layers: int, now: Callable[[], float], from_monotonic: Callable[[float], float],
                 keep_logits: bool) -> None:
        self.profile = native.profile_buffer(num_layers)
        self.num_layers = num_layers
        self.now, self._from_monotonic = now, from_monotonic
        self.keep_logits = keep_logits
        self.paused = False
        self.current_layer = -1  # the layer whose attention runs (its rotary hook belongs to it)
        self.max_blocks = 0  # KV blocks the request held at most
        self.step: StepRecord | None = None
        self.request: Request | None = None
        self.marks: dict[str, float] = {}  # this step's points in time: "step", "model", "model_end", "sample_end"...
        self.block_table: list[int] | None = None  # the request's, as this step's pass began
        self.logits: torch.Tensor | None = None  # this step's logits rows, where kept
        self.greedy = False  # whether this step's native call took the argmax

    def start_step(self, step: StepRecord | None, request: Request | None, at: float) -> None:
        self.step, self.request, self.marks = step, request, {"step": at}
        self.block_table, self.logits, self.greedy = None, None, False

    def hook(self, layers: Sequence[torch.nn.Module]) -> list[torch.utils.hooks.RemovableHandle]:
        """Timers on each block's attention and MLP modules (which the fused paths never call)."""
        handles = []
        for i, layer in enumerate(layers):
            attn, mlp = cast(torch.nn.Module, layer.attn), cast(torch.nn.Module, layer.mlp)
            handles += [attn.register_forward_pre_hook(self._attn_start(i)),
                        attn.register_forward_hook(self._timer_end(i, "attn_s", "attn")),
                        mlp.register_forward_pre_hook(self._mark(f"mlp{i}")),
                        mlp.register_forward_hook(self._timer_end(i, "mlp_s", f"mlp{i}"))]
            if hasattr(mlp, "last_choice"):  # a mixture of experts: its router's choice
                handles.append(mlp.register_forward_hook(self._router(i)))
        return handles

    def _router(self, layer: int) -> Any:
        def hook(module: MoE, args: tuple, output: Any) -> None:
            step = self._recording()
            if step is None or module.last_choice is None:
                return
            chosen, weights = module.last_choice
            step.router[layer] = (chosen[-1].tolist(), weights[-1].float().tolist())
        return hook

    def _recording(self) -> StepRecord | None:
        return None if self.paused else self.step

    def _reading(self, slot: ProfileSlot) -> float:
        return self._from_monotonic(self.profile[slot])

    def _pass_begins(self, start: float, first_position: int, num_tokens: int) -> StepRecord | None:
        step = self._recording()
        if step is None:
            return None
        self.marks["model"] = start
        step.spans["schedule"] = (self.marks["step"], start)
        step.num_tokens, step.first_position = num_tokens, first_position
        req = self.request
        if req is not None:
            step.phase = "prefill" if first_position < req.num_prompt_tokens else "decode"
            self.max_blocks = max(self.max_blocks, len(req.block_table))
            self.block_table = list(req.block_table)  # a request that finishes in this step frees its blocks
        return step

    def _read_layers(self, step: StepRecord) -> None:
        """The per-layer seconds a native call left in the profile."""
        for i in range(self.num_layers):
            at = ProfileSlot.LAYERS + i * LayerTime.TIMES
            step.attn_s[i] = self.profile[at + LayerTime.ATTENTION]
            step.mlp_s[i] = self.profile[at + LayerTime.MLP]
            step.block_s[i] = self.profile[at + LayerTime.BLOCK]

    # --- ForwardProbe ------------------------------------------------------------------------------------

    def begin(self, positions: torch.Tensor) -> None:
        num_tokens = int(positions.numel())
        self._pass_begins(self.now(), int(positions[0]) if num_tokens else 0, num_tokens)

    def embedded(self, path: str) -> None:
        step = self._recording()
        if step is None:
            return
        now = self.now()
        step.path = path
        self.marks["blocks"] = self.marks["layer"] = now
        step.spans["embedding"] = (self.marks.get("model", now), now)

    def layer_done(self, layer: int) -> None:
        step = self._recording()
        if step is None:
            return
        now = self.now()
        step.block_s[layer] += now - self.marks["layer"]
        self.marks["layer"] = now

    def blocks_done(self) -> None:
        step = self._recording()
        if step is None:
            return
        now = self.now()
        if step.path == FUSED_BLOCKS:  # the blocks end before the final norm, as on the module path
            now = self._reading(ProfileSlot.BLOCKS)
            self._read_layers(step)
        self.marks["blocks_end"] = now
        step.spans["blocks"] = (self.marks.get("blocks", now), now)

    def end(self, logits: torch.Tensor) -> None:
        step = self._recording()
        if step is None:
            return
        now = self.now()
        self.marks["model_end"] = now
        step.spans["lm_head"] = (self.marks.get("blocks_end", now), now)
        if self.keep_logits and step.path == FUSED_BLOCKS:
            self.logits = logits.detach().float().cpu().clone()

    def native_step(self, positions: Sequence[int], logits: torch.Tensor, greedy: bool) -> None:
        step = self._pass_begins(self._reading(ProfileSlot.START), positions[0], len(positions))
        if step is None:
            return
        step.path = NATIVE_STEP
        readings = [self._reading(slot) for slot in (ProfileSlot.START, ProfileSlot.EMBEDDING, ProfileSlot.BLOCKS,
                                                     ProfileSlot.HEAD, ProfileSlot.ARGMAX)]
        for stage, span in zip(("embedding", "blocks", "lm_head", "sampling"), zip(readings, readings[1:])):
            if stage != "sampling" or greedy:  # the argmax is this step's sampling; otherwise the sampler's is
                step.spans[stage] = span
        self.marks["blocks_end"], self.marks["model_end"] = readings[2], readings[3]
        if greedy:
            self.marks["sample_end"] = readings[4]
        self._read_layers(step)
        self.greedy = greedy
        if greedy or self.keep_logits:
            self.logits = logits.detach().float().clone()

    # --- hooks on the attention and MLP modules (the module path) ----------------------------------------

    def _attn_start(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self.current_layer = layer  # a re-run's too: the attention capture reads it
            if not self.paused:
                self.marks["attn"] = self.now()
        return hook

    def _mark(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple) -> None:
            if not self.paused:
                self.marks[name] = self.now()
        return hook

    def _timer_end(self, layer: int, field_name: str, mark: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            step = self._recording()
            if step is None:
                return
            now = self.now()
            getattr(step, field_name)[layer] += now - self.marks.get(mark, now)
        return hook

"""The figures a trace report shows, computed once from a traced run (and an untraced one of the same request), so
the terminal and HTML renderers print the same numbers. Times are seconds, sizes bytes, rates per second.

The measured total is the traced run's wall time; `coverage` is the share of it the measured stages explain (the
rest: the driver loop and the few engine lines between spans). Achieved rates divide the FLOPs and bytes of
cost.ModelCost by the forward-pass time (embedding + blocks + LM head) of the same steps. `paths` says which path the
steps of each phase took (models/probe.py), `replay` how the fused steps re-run on the modules compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from nextoken.ops.quant_head import BlockEmbedding
from nextoken.ops.quant_linear import BlockLinear
from nextoken.trace.cost import MachinePeaks, ModelCost
from nextoken.trace.replay import Agreement
from nextoken.trace.run import RunResult
from nextoken.trace.tracer import RecordingTracer

FORWARD_STAGES = ("embedding", "blocks", "lm_head")


@dataclass(frozen=True)
class ReplaySummary:
    """The fused steps re-run on the module path for their attention maps: how many, whether every one agreed with
    its fused step, and the step that came closest to its bar (its differences and bars: Agreement)."""

    num_steps: int
    agree: bool
    closest: Agreement

    @classmethod
    def of(cls, replays: list[Agreement]) -> ReplaySummary | None:
        if not replays:
            return None

        def share(a: Agreement) -> float:  # of its bar, the larger of the two differences
            logits = 0.0 if a.logits_diff is None else a.logits_diff / a.logits_bar
            return max(logits, a.kv_diff / a.kv_bar)

        return cls(len(replays), all(a.agrees for a in replays), max(replays, key=share))


@dataclass
class Summary:
    model_name: str
    stage_s: dict[str, float]  # whole run, per stage
    stage_prefill_s: dict[str, float]
    stage_decode_s: dict[str, float]
    total_s: float
    coverage: float  # sum(stage_s) / total_s
    num_prefill_tokens: int
    num_decode_steps: int
    prefill_flops: int
    decode_flops: int
    prefill_bytes: int
    decode_bytes: int
    prefill_forward_s: float
    decode_forward_s: float
    kv_bytes_per_token: int
    kv_pool_bytes: int
    kv_block_bytes: int
    blocks_used: int
    embedding: dict[str, Any]
    lm_head: dict[str, Any]
    cost: ModelCost
    peaks: MachinePeaks | None
    baseline_s: float | None
    same_tokens: bool | None
    timings: dict[str, float | None]
    baseline_timings: dict[str, float | None] | None
    deterministic: bool  # greedy or seeded: an untraced run must draw the same tokens
    paths: dict[str, dict[str, int]]  # phase -> steps per path (models.probe.PATHS)
    native_gaps: list[str]  # the model's parts the fused native step lacks (models/recipe.py): why it runs the modules
    replay: ReplaySummary | None  # None: no step re-run (no attention maps asked for, or none ran fused)

    @property
    def prefill_gflops(self) -> float | None:
        return _giga_per_s(self.prefill_flops, self.prefill_forward_s)

    @property
    def decode_gflops(self) -> float | None:
        return _giga_per_s(self.decode_flops, self.decode_forward_s)

    @property
    def decode_gbps(self) -> float | None:
        return _giga_per_s(self.decode_bytes, self.decode_forward_s)

    @property
    def prefill_gbps(self) -> float | None:
        return _giga_per_s(self.prefill_bytes, self.prefill_forward_s)


def _giga_per_s(amount: float, seconds: float) -> float | None:
    return amount / seconds / 1e9 if seconds > 0 else None


def _describe(table: torch.Tensor | BlockEmbedding) -> dict[str, Any]:
    """Shape, dtype and bytes of an embedding table or head: a tensor, or the file's blocks."""
    if isinstance(table, BlockEmbedding):
        return {"shape": (table.num_embeddings, table.embedding_dim), "dtype": "q8_0 blocks", "bytes": table.nbytes}
    return {"shape": tuple(table.shape), "dtype": str(table.dtype).removeprefix("torch."), "bytes": table.nbytes}


def summarize(llm: Any, run: RunResult, baseline: RunResult | None = None,
              peaks: MachinePeaks | None = None) -> Summary:
    """The figures of a RecordingTracer's run; `baseline` (the same request untraced) gives the overhead."""
    tracer = run.tracer
    assert isinstance(tracer, RecordingTracer), "summaries need a RecordingTracer's records"
    engine = llm.engine
    model = engine.runner.model
    cfg = engine.model_config
    projection = model.layers[0].attn.qkv_proj
    # Block-quantized projections and head: what their decode path reads per weight, scales included.
    if isinstance(projection, BlockLinear):
        projection_bytes = projection.bytes_per_weight
    else:
        projection_bytes = projection.weight.element_size()
    table = model.embed_tokens if isinstance(model.embed_tokens, BlockEmbedding) else model.embed_tokens.weight
    head = table if model.lm_head is None else model.lm_head.weight
    # A block-held table's tied head is always the quantized head: `head` is a tensor where it is read here.
    head_bytes = (model.quantized_head.bytes_per_weight if model.quantized_head is not None
                  else cast(torch.Tensor, head).element_size())
    pool = engine.runner.kv_pool
    cost = ModelCost.from_config(cfg, projection_bytes=projection_bytes, head_bytes=head_bytes,
                                 kv_bytes_per_token=pool.shape.bytes_per_token)
    prefill_flops = decode_flops = prefill_bytes = decode_bytes = 0
    num_prefill = num_decode = 0
    for step in tracer.steps:
        # Logits rows: the sampled one, and under speculative decoding one per verified proposal.
        rows = 0 if step.sample is None else 1 + (len(step.speculation.verdicts) if step.speculation else 0)
        flops = cost.forward_flops(step.first_position, step.num_tokens, rows)
        traffic = cost.forward_bytes(step.first_position, step.num_tokens)
        if step.phase == "prefill":
            prefill_flops, prefill_bytes, num_prefill = prefill_flops + flops, prefill_bytes + traffic, \
                num_prefill + step.num_tokens
        else:
            decode_flops, decode_bytes, num_decode = decode_flops + flops, decode_bytes + traffic, num_decode + 1
    stage_s = tracer.stage_seconds()
    prefill_s, decode_s = tracer.stage_seconds("prefill"), tracer.stage_seconds("decode")
    return Summary(
        model_name=engine.model_name, stage_s=stage_s, stage_prefill_s=prefill_s, stage_decode_s=decode_s,
        total_s=run.total_s, coverage=sum(stage_s.values()) / run.total_s if run.total_s > 0 else 0.0,
        num_prefill_tokens=num_prefill, num_decode_steps=num_decode,
        prefill_flops=prefill_flops, decode_flops=decode_flops, prefill_bytes=prefill_bytes,
        decode_bytes=decode_bytes,
        prefill_forward_s=sum(prefill_s[s] for s in FORWARD_STAGES),
        decode_forward_s=sum(decode_s[s] for s in FORWARD_STAGES),
        kv_bytes_per_token=cost.kv_bytes_per_token, kv_pool_bytes=pool.nbytes,
        kv_block_bytes=cost.kv_bytes_per_token * engine.runner.block_size, blocks_used=tracer.max_blocks,
        embedding={**_describe(table), "scale": cfg.embedding_scale},
        lm_head={**_describe(head), "tied": model.lm_head is None,
                 "quantized": model.quantized_head is not None},
        cost=cost, peaks=peaks,
        baseline_s=baseline.total_s if baseline is not None else None,
        same_tokens=baseline.output_ids == run.output_ids if baseline is not None else None,
        timings=run.timings, baseline_timings=baseline.timings if baseline is not None else None,
        deterministic=run.params.is_greedy or run.params.seed is not None,
        paths={phase: dict(tracer.paths(phase)) for phase in ("prefill", "decode")},
        native_gaps=cfg.recipe.native_gaps(),
        replay=ReplaySummary.of(tracer.replays),
    )


def layer_runs(flags: list[bool]) -> list[tuple[bool, str]]:
    """[True, True, False, True] -> [(True, "0-1, 3"), (False, "2")]: layer ranges grouped by a per-layer flag."""
    groups: dict[bool, list[str]] = {}
    start = 0
    for i in range(1, len(flags) + 1):
        if i == len(flags) or flags[i] != flags[start]:
            groups.setdefault(flags[start], []).append(str(start) if i - 1 == start else f"{start}-{i - 1}")
            start = i
    return [(flag, ", ".join(ranges)) for flag, ranges in groups.items()]


def positional_scheme(cfg: Any) -> list[dict[str, Any]]:
    """One entry per group of layers sharing a RoPE configuration and attention span."""
    out = []
    for sliding, layers in layer_runs(list(cfg.layer_is_sliding)):
        rope = cfg.rope_local if sliding and cfg.rope_local is not None else cfg.rope
        out.append({"layers": layers, "attention": f"local, window {cfg.sliding_window}" if sliding else "global",
                    "theta": rope.theta, "rotated_dims": rope.dim, "head_dim": cfg.head_dim,
                    "scaling": rope.scaling_type if rope.scaling_type == "none" else
                    f"{rope.scaling_type} x{rope.scaling_factor:g}"})
    return out


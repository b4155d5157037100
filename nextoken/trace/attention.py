"""Attention weights for display, recomputed from the post-RoPE q and k the model produced.

The model's attention kernel never materializes its weights (SDPA and the native kernels fuse them away), so the
tracer keeps q and k as the rotary module returns them (for a step that ran fused, in its re-run on the modules:
replay.py) and computes softmax(q·kᵀ · scale) under the same causal and sliding-window mask between steps, outside
every timed span. Memory stays bounded: keys of the selected layers (as much as this
request's own KV cache), one fp16 row per kept query position, and at most `budget` weights in all; when the full
set would not fit, an evenly spaced subset of layers is kept (always the first and the last).
"""

from __future__ import annotations

import torch

DEFAULT_BUDGET = 8_000_000  # fp16 weights kept at most (16 MB), summed over layers, heads and query rows
MAX_PREFILL_ROWS = 256  # prompt query rows kept (the last ones); every decode row is kept


class AttentionCapture:
    """Collects q/k of one request's forward passes and turns them into per-query-position weight rows.

    `rows[p]` is [len(layers), num_heads, p + 1] fp16: the attention of the query at position p over positions
    0..p (zero where the mask hides a key). Positions below `first_row` keep no row.
    """

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scales: list[float], windows: list[int | None], num_prompt_tokens: int, max_tokens: int,
                 budget: int = DEFAULT_BUDGET, max_prefill_rows: int = MAX_PREFILL_ROWS) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        # The query that would follow the last generated token never runs: max_tokens - 1 decode positions.
        self.max_context = num_prompt_tokens + max_tokens
        self.first_row = max(0, num_prompt_tokens - max_prefill_rows)
        last_row = num_prompt_tokens + max_tokens - 2
        per_layer = num_heads * sum(p + 1 for p in range(self.first_row, last_row + 1))
        self.layers = select_layers(num_layers, max(1, budget // max(per_layer, 1)))
        self._slot = {layer: i for i, layer in enumerate(self.layers)}
        self._scales = scales
        self._windows = windows
        # [max_context, kv_heads, head_dim] fp32 per kept layer: every key a later query may attend to.
        self._keys = {layer: torch.zeros(self.max_context, num_kv_heads, head_dim) for layer in self.layers}
        self._known = {layer: torch.zeros(self.max_context, dtype=torch.bool) for layer in self.layers}
        self._pending: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        self.rows: dict[int, torch.Tensor] = {}

    def wants(self, layer: int) -> bool:
        return layer in self._slot

    def add(self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Called from the rotary hook: q [num_tokens, heads, head_dim], k [num_tokens, kv_heads, head_dim].

        Only copies (the model may reuse its buffers once the hook returns); the work waits for `flush`, so the
        attention time measured around this hook stays close to the untraced one.
        """
        self._pending.setdefault(layer, []).append((positions.detach().clone(), q.detach().clone(),
                                                    k.detach().clone()))

    def flush(self) -> None:
        """Turn this step's queries into weight rows (between steps, outside the timed spans)."""
        for layer, chunks in self._pending.items():
            for positions, q, k in chunks:
                pos = positions.to("cpu", torch.long)
                inside = pos < self.max_context  # a longer run than announced: keep what fits
                pos, q, k = pos[inside], q.cpu().float()[inside], k.cpu().float()[inside]
                self._keys[layer].index_copy_(0, pos, k)
                self._known[layer][pos] = True
                keep = pos >= self.first_row
                if bool(keep.any()):
                    self._rows_for(layer, pos[keep], q[keep])
        self._pending.clear()

    def _rows_for(self, layer: int, pos: torch.Tensor, q: torch.Tensor) -> None:
        context = int(pos.max()) + 1
        keys = self._keys[layer][:context]  # [context, kv_heads, head_dim]
        # Grouped-query attention: query head h reads kv head h // group, as SDPA's enable_gqa does.
        keys = keys.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # [context, heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * self._scales[layer]  # [heads, num_q, context]
        k_pos = torch.arange(context)[None, :]
        q_pos = pos[:, None]
        allowed = (k_pos <= q_pos) & self._known[layer][:context][None, :]
        window = self._windows[layer]
        if window is not None:
            allowed &= q_pos - k_pos < window
        weights = scores.masked_fill(~allowed[None], float("-inf")).softmax(dim=-1)
        weights = weights.nan_to_num(0.0).to(torch.float16)  # a row with no known key is all zeros, not NaN
        slot = self._slot[layer]
        for j, p in enumerate(pos.tolist()):
            row = self.rows.get(p)
            if row is None:
                row = self.rows[p] = torch.zeros(len(self.layers), self.num_heads, p + 1, dtype=torch.float16)
            row[slot] = weights[:, j, :p + 1]

    @property
    def num_weights(self) -> int:
        return sum(r.numel() for r in self.rows.values())


def select_layers(num_layers: int, count: int) -> list[int]:
    """`count` layer indices spread evenly over [0, num_layers), first and last included."""
    if count >= num_layers:
        return list(range(num_layers))
    if count == 1:
        return [num_layers - 1]
    step = (num_layers - 1) / (count - 1)
    return sorted({round(i * step) for i in range(count)})

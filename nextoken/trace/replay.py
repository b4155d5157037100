"""A fused step re-run on the module path, for the views that need tensors inside its layers (attention maps): the
fused calls keep their q and k to themselves, the modules hand them to the tracer's rotary hook.

The re-run reads a private copy of the request's KV blocks and writes only there, so the engine's cache, logits and
outputs stay exactly as the fused step left them. It reports how far the two paths came apart (`Agreement`): the
last token's logits, and the K and V each wrote for the step's tokens, against a bar taken from the unit tests that
hold the fused path to the modules (tests/unit/test_native.py, _assert_same_step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nextoken.cache.kv_pool import KVCacheLayer, KVPool, dequantize_int8
from nextoken.models.base import CausalLM
from nextoken.ops.attention import AttentionMetadata

# What each value may differ by between the two paths, as the unit tests hold them (assert_close's atol + rtol * |value|
# per value): an absolute part per KV storage (the same formulas in another order, and activation codes that may round
# a last bit apart, which a narrow cache may store a step apart) and a relative part; an int8 cache's values may also
# land a code step apart (two with int8 activation codes), a step being their group's scale.
ABSOLUTE_BAR = {torch.float32: 2e-3, torch.bfloat16: 1e-2, torch.int8: 5e-2}
INT8_ACTIVATIONS_BAR = 1e-1  # int8 activation codes: one that rounds the other way moves a value by a code step
LOGITS_RELATIVE_BAR = 1e-3
KV_RELATIVE_BAR = 1e-2


@dataclass(frozen=True)
class Agreement:
    """How a fused step and its re-run on the module path compare, value by value against each value's bar: for the
    last token's logits (None where the step computed none: a prompt chunk that samples nothing) and for the K and V
    written for the step's tokens (every layer, dequantized), the |difference| and the bar of the value that came
    closest to its bar (or went furthest past it)."""

    logits_diff: float | None
    logits_bar: float
    kv_diff: float
    kv_bar: float

    @property
    def agrees(self) -> bool:
        return (self.logits_diff is None or self.logits_diff <= self.logits_bar) and self.kv_diff <= self.kv_bar


def _closest(diff: torch.Tensor, bar: torch.Tensor) -> tuple[float, float]:
    """(|difference|, bar) of the value with the least room under its bar."""
    i = int((diff - bar).flatten().argmax())
    return float(diff.flatten()[i]), float(bar.flatten()[i])


@torch.inference_mode()
def replay_on_modules(model: CausalLM, pool: KVPool, block_table: list[int], token_ids: list[int],
                      first_position: int, fused_logits: torch.Tensor | None, int8_activations: bool) -> Agreement:
    """Run the step that computed `token_ids` at positions first_position... (one sequence, its blocks
    `block_table` in `pool`) again, every block through its modules, over a private copy of those blocks; compare
    with what the fused step left: `fused_logits` (its last row is the last token's; None or empty: no logits) and
    the K and V in `pool`. Whoever watches the modules (hooks) sees them run."""
    num_tokens = len(token_ids)
    bs = pool.block_size
    device = pool.layers[0].k.device
    blocks = torch.tensor(block_table, dtype=torch.long, device=device)
    # [len(block_table), block_size, kv_heads, head_dim] per layer: the request's context as the fused step left it
    # (the re-run overwrites this step's own slots with what the modules compute).
    private = KVPool(pool.shape, len(block_table), bs, device)
    for mine, theirs in zip(private.layers, pool.layers):
        for name in ("k", "v", "k_scale", "v_scale"):
            if getattr(theirs, name) is not None:
                getattr(mine, name).copy_(getattr(theirs, name).index_select(0, blocks))
    positions = torch.arange(first_position, first_position + num_tokens, device=device)
    # Block i of the private pool is block_table[i]: a position's slot there is the position itself.
    meta = AttentionMetadata(slot_mapping=positions, query_start_loc=[0, num_tokens],
                             seq_lens=[first_position + num_tokens],
                             block_tables=torch.arange(len(block_table), device=device)[None], block_size=bs)
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    last = torch.tensor([num_tokens - 1], device=device)
    logits = model(ids, positions, private.layers, meta, last, modules=True)
    absolute = INT8_ACTIVATIONS_BAR if int8_activations else ABSOLUTE_BAR[pool.shape.dtype]
    logits_diff, logits_bar = None, absolute
    if fused_logits is not None and fused_logits.shape[0] > 0:
        fused_row = fused_logits[-1].float().to(device)  # [vocab]
        logits_diff, logits_bar = _closest((logits[0].float() - fused_row).abs(),
                                           absolute + LOGITS_RELATIVE_BAR * fused_row.abs())
    real_slots = torch.tensor([block_table[p // bs] * bs + p % bs for p in positions.tolist()], device=device)
    steps = 2 if int8_activations else 1  # code steps an int8 cache's value may land apart
    closest = (0.0, absolute)
    for mine, theirs in zip(private.layers, pool.layers):
        for which in ("k", "v"):
            kept, step = _rows(theirs, which, real_slots)  # [num_tokens, kv_heads, head_dim] each
            got, _ = _rows(mine, which, positions)
            here = _closest((got - kept).abs(), absolute + KV_RELATIVE_BAR * kept.abs() + steps * step)
            closest = max(closest, here, key=lambda c: c[0] - c[1])
    return Agreement(logits_diff=logits_diff, logits_bar=logits_bar, kv_diff=closest[0], kv_bar=closest[1])


def _rows(layer: KVCacheLayer, which: str, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V at flat `slots` as fp32 [len(slots), kv_heads, head_dim], dequantized where stored as int8, and each
    value's code step there (its group's scale; zero for a float cache)."""
    cache, scales = (layer.k, layer.k_scale) if which == "k" else (layer.v, layer.v_scale)
    values = cache.view(-1, *cache.shape[2:]).index_select(0, slots)
    if scales is None:
        return values.float(), torch.zeros((), device=values.device)
    groups = scales.view(-1, *scales.shape[2:]).index_select(0, slots)
    step = dequantize_int8(torch.ones_like(values), groups, torch.float32)  # each value's group scale
    return dequantize_int8(values, groups, torch.float32), step

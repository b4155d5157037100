"""Tensor parallelism as module surgery after loading: a loaded `CausalLM` cut down to one rank's share.

Each block's first products are column-parallel (q/k/v and gate/up: the rank keeps its output rows), its second
row-parallel (o_proj and down: the rank keeps the matching input columns, and its partial sums are added across
ranks by one all-reduce). So each block half moves one [num_tokens, hidden] fp32 all-reduce, and everything else
(embedding, norms, final norm, LM head) stays whole on every rank.

Invariants: a rank's query heads are those of its KV heads (whole grouped-query groups), or, where there are fewer
KV heads than ranks, a share of one KV head's group with that KV head replicated; the ranks together cover every
query head and feed-forward column once; a row-parallel split of a block-quantized projection falls on a 32-value
block boundary (refused otherwise). Shares may be uneven.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nextoken.errors import NextokenError
from nextoken.models.base import CausalLM, DecoderBlock
from nextoken.models.config import ModelConfig
from nextoken.models.layers import GatedMLP, Linear, PlainMLP, SelfAttention
from nextoken.ops.quant_linear import GROUP_SIZE, NIBBLE_KINDS, Q8_HALVES, BlockLinear, BlockWeight

AllReduce = Callable[[torch.Tensor], None]  # sums a tensor across the ranks, in place


class ShardError(NextokenError):
    """A model that cannot be split across this many ranks: names the count and what does not divide."""


@dataclass(frozen=True)
class Shard:
    """One rank's share: [start, end) of the query heads, the KV heads and the feed-forward columns."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ffn: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    """[0, count) in `parts` contiguous ranges, the first `count % parts` one longer."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds, bounds[1:]))


def plan_shards(cfg: ModelConfig, world_size: int, block_weights: bool) -> list[Shard]:
    """Each rank's share of `cfg`'s heads and feed-forward columns; `block_weights`: the projections are held in
    blocks of 32 inputs, so a row-parallel split must fall on a multiple of 32. Raises ShardError naming what does
    not split."""
    n = world_size
    if cfg.recipe.mlp == "moe":
        raise ShardError(f"tensor_parallel={n}: mixture-of-experts layers ({cfg.architecture}) are not split across "
                         "ranks")
    heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    group = heads // kv_heads  # query heads per KV head
    if kv_heads >= n:  # whole groups: each rank its KV heads and their query heads
        kv = _split(kv_heads, n)
        q = [(a * group, b * group) for a, b in kv]
    else:  # each KV head replicated on n / kv_heads ranks, its group's query heads split among them
        copies = n // kv_heads
        if n % kv_heads or group < copies:
            raise ShardError(f"tensor_parallel={n} does not split {heads} query heads over {kv_heads} KV heads "
                             f"(with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and at "
                             f"most {heads} query heads)")
        kv, q = [], []
        for r in range(n):
            head, part = divmod(r, copies)
            a, b = _split(group, copies)[part]
            kv.append((head, head + 1))
            q.append((head * group + a, head * group + b))
    q_size = heads * head_dim
    if block_weights and q_size % GROUP_SIZE == 0:
        for a, _ in q:
            if a * head_dim % GROUP_SIZE:
                raise ShardError(f"tensor_parallel={n}: query head {a} starts at column {a * head_dim} of the output "
                                 f"projection, inside a block of {GROUP_SIZE} (head_dim {head_dim}); use fp32 "
                                 "weights or another count")
    ffn = cfg.ffn_size
    unit = GROUP_SIZE if block_weights and ffn % GROUP_SIZE == 0 else 1  # columns moved as one
    if ffn // unit < n:
        raise ShardError(f"tensor_parallel={n} exceeds the {ffn // unit} feed-forward column groups of {unit}")
    cols = [(a * unit, b * unit) for a, b in _split(ffn // unit, n)]
    return [Shard(q[r], kv[r], cols[r]) for r in range(n)]


class RowParallel(nn.Module):
    """A row-parallel projection: this rank's partial product [num_tokens, out], summed across the ranks."""

    def __init__(self, inner: nn.Module, all_reduce: AllReduce) -> None:
        super().__init__()
        self.inner = inner
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)  # [num_tokens, out]: a fresh tensor, summed in place
        self.all_reduce(out)
        return out


def take_rows(proj: nn.Module, rows: torch.Tensor) -> nn.Module:
    """The projection's output rows `rows` (int64 indices, in order): a column-parallel share."""
    if isinstance(proj, BlockLinear):
        parts, at = [], 0
        for p in proj.parts:
            local = rows[(rows >= at) & (rows < at + p.rows)] - at
            at += p.rows
            if local.numel():
                parts.append(BlockWeight(p.kind, p.qs[local].contiguous(), p.d[local].contiguous(),
                                         None if p.m is None else p.m[local].contiguous()))
        return _rebuilt(proj, parts, lambda w: w[rows], (len(rows), proj.in_features))
    assert isinstance(proj, Linear), f"no tensor-parallel split for {type(proj).__name__}"
    return _linear(proj.weight[rows])


def take_columns(proj: nn.Module, start: int, end: int) -> nn.Module:
    """The projection's input columns [start, end): a row-parallel share (its product is a partial sum)."""
    if isinstance(proj, BlockLinear):
        if start % GROUP_SIZE or (end % GROUP_SIZE and end != proj.in_features):
            raise ShardError(f"columns [{start}, {end}) of a projection in blocks of {GROUP_SIZE} cut a block")
        parts = []
        for p in proj.parts:
            per_code = 2 if p.kind in NIBBLE_KINDS else 1  # values per byte of qs
            per_scale = 16 if p.kind == Q8_HALVES else GROUP_SIZE  # values per scale
            scales = slice(start // per_scale, end // per_scale)
            parts.append(BlockWeight(p.kind, p.qs[:, start // per_code:end // per_code].contiguous(),
                                     p.d[:, scales].contiguous(), None if p.m is None else p.m[:, scales].contiguous()))
        return _rebuilt(proj, parts, lambda w: w[:, start:end], (proj.out_features, end - start))
    assert isinstance(proj, Linear), f"no tensor-parallel split for {type(proj).__name__}"
    return _linear(proj.weight[:, start:end])


def _linear(weight: torch.Tensor) -> Linear:
    with torch.device("meta"):  # no storage for a weight replaced at once
        linear = Linear(weight.shape[1], weight.shape[0])
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    return linear


def _rebuilt(proj: BlockLinear, parts: list[BlockWeight], cut: Callable[[torch.Tensor], torch.Tensor],
             shape: tuple[int, int]) -> BlockLinear:
    """A BlockLinear of `parts` that runs as `proj` does: the fp32 weight beside the blocks (its `cut`) where `proj`
    keeps one, else the blocks alone."""
    dense = cut(proj.weight).contiguous() if proj.dense is not None else None
    out = BlockLinear(parts, dense, shape, kernels=proj.kernels)
    out.activations = proj.activations
    return out


def shard_model(model: CausalLM, shard: Shard, all_reduce: AllReduce) -> None:
    """Cut `model` down to `shard`, in place: attention to its heads (the KV pool must then hold only its KV heads),
    the feed-forward layers to its columns, each row-parallel product followed by `all_reduce`. The fused decode
    path is dropped (its one native call has no place for the all-reduces)."""
    model.fused = None
    for block in model.layers:
        assert isinstance(block, DecoderBlock)
        _shard_attention(block.attn, shard, all_reduce)
        _shard_mlp(block.mlp, shard, all_reduce)


def _shard_attention(attn: SelfAttention, shard: Shard, all_reduce: AllReduce) -> None:
    d = attn.head_dim
    (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
    # qkv rows: [q heads | k heads | v heads], head_dim rows each
    rows = torch.cat((torch.arange(q0 * d, q1 * d), attn.q_size + torch.arange(k0 * d, k1 * d),
                      attn.q_size + attn.kv_size + torch.arange(k0 * d, k1 * d)))
    attn.register_module("qkv_proj", take_rows(attn.qkv_proj, rows))
    if attn.qkv_bias is not None:
        attn.qkv_bias = nn.Parameter(attn.qkv_bias[rows].contiguous(), requires_grad=False)
    attn.register_module("o_proj", RowParallel(take_columns(attn.o_proj, q0 * d, q1 * d), all_reduce))
    attn.num_heads, attn.num_kv_heads = shard.num_heads, shard.num_kv_heads
    attn.q_size, attn.kv_size = shard.num_heads * d, shard.num_kv_heads * d


def _shard_mlp(mlp: nn.Module, shard: Shard, all_reduce: AllReduce) -> None:
    a, b = shard.ffn
    if isinstance(mlp, GatedMLP):  # gate_up rows: [gate ffn | up ffn]
        gate_up = torch.cat((torch.arange(a, b), mlp.ffn + torch.arange(a, b)))
        mlp.register_module("gate_up_proj", take_rows(mlp.gate_up_proj, gate_up))
    elif isinstance(mlp, PlainMLP):
        mlp.register_module("up_proj", take_rows(mlp.up_proj, torch.arange(a, b)))
        if mlp.up_bias is not None:
            mlp.up_bias = nn.Parameter(mlp.up_bias[a:b].contiguous(), requires_grad=False)
    else:
        raise ShardError(f"no tensor-parallel split for {type(mlp).__name__}")
    mlp.register_module("down_proj", RowParallel(take_columns(mlp.down_proj, a, b), all_reduce))
    mlp.ffn = b - a

"""The KV pool: one preallocated K and V tensor per layer, [num_blocks, block_size, num_kv_heads, head_dim].

Sized once at start from a byte budget. Stored as fp32, bf16 or int8; int8 keeps one fp16 scale per group of
`KV_GROUP` values of every token and head (as GGML's Q8_0: w = scale * code, scale = absmax / 127), so a token's
codes are final when written and never requantized as its block fills. (Groups of every (head_dim / 32)-th
dimension instead of 32 neighbours measured better on SmolLM2 and worse on Gemma 3: KL 4.9e-4 / 9.8e-4 against
6.6e-4 / 4.4e-4.) `bytes_per_token` is 2 x layers x kv_heads x (head_dim x dtype bytes + int8's scales). Blocks
are zero-filled so that padding slots read by batched attention never hold NaN garbage, unless the caller says its
attention reads only written slots (`zero_fill=False`): then pages are touched as blocks are first written, and a
1 GiB pool costs nothing up front (zero-filling it takes over a second on a small VM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_GROUP = 32  # int8: values per scale
KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # storage: float32, bfloat16 or int8

    @property
    def is_quantized(self) -> bool:
        return self.dtype == torch.int8

    @property
    def num_groups(self) -> int:
        return -(-self.head_dim // KV_GROUP)

    @property
    def bytes_per_token(self) -> int:
        per_head = self.head_dim * torch.empty(0, dtype=self.dtype).element_size()
        if self.is_quantized:
            per_head += self.num_groups * 2  # fp16 scales
        return 2 * self.num_layers * self.num_kv_heads * per_head


@dataclass
class KVCacheLayer:
    """One layer's K and V. For int8, `k_scale`/`v_scale` [num_blocks, block_size, kv_heads, groups] (fp16)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new tokens' K/V ([num_tokens, kv_heads, head_dim], float) into slots block_id * block_size + offset."""
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            flat = cache.view(-1, *cache.shape[2:])
            if scales is None:
                flat.index_copy_(0, slot_mapping, x.to(cache.dtype))
            else:
                codes, s = quantize_int8(x)
                flat.index_copy_(0, slot_mapping, codes)
                scales.view(-1, *scales.shape[2:]).index_copy_(0, slot_mapping, s)

    def read(self, which: str, index: slice | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K or V of the blocks `index` selects (along dim 0), as `dtype`: [..., block_size, kv_heads, head_dim]."""
        cache, scales = (self.k, self.k_scale) if which == "k" else (self.v, self.v_scale)
        values = cache[index]
        if scales is None:
            return values if values.dtype == dtype else values.to(dtype)
        return dequantize_int8(values, scales[index], dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., head_dim] float -> (int8 codes, fp16 scales [..., groups]) with round-to-nearest, scale absmax/127.

    The int8 cache's one definition: the native kernels' own stores (nt_store_rows, which ops/attention.py and the fused
    step take on the CPU) are held to it bit for bit (tests/unit/test_native.py, the KV store test)."""
    head_dim = x.shape[-1]
    groups = -(-head_dim // KV_GROUP)
    xf = x.float()
    if head_dim % KV_GROUP:
        xf = torch.nn.functional.pad(xf, (0, groups * KV_GROUP - head_dim))
    xg = xf.unflatten(-1, (groups, KV_GROUP))
    scale = (xg.abs().amax(-1) / 127).to(torch.float16)
    inverse = torch.where(scale > 0, 1 / scale.float(), 0.0)
    codes = (xg * inverse[..., None]).round_().clamp_(-127, 127).to(torch.int8).flatten(-2)[..., :head_dim]
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    head_dim = codes.shape[-1]
    groups = scales.shape[-1]
    if head_dim == groups * KV_GROUP:
        return (codes.unflatten(-1, (groups, KV_GROUP)).to(dtype) * scales[..., None].to(dtype)).flatten(-2)
    return codes.to(dtype) * scales.to(dtype).repeat_interleave(KV_GROUP, dim=-1)[..., :head_dim]


class KVPool:
    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device,
                 zero_fill: bool = True) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        scale_dims = (num_blocks, block_size, shape.num_kv_heads, shape.num_groups)

        new = torch.zeros if zero_fill else torch.empty

        def scales() -> torch.Tensor | None:
            return new(scale_dims, dtype=torch.float16, device=device) if shape.is_quantized else None

        self.layers: list[KVCacheLayer] = [
            KVCacheLayer(new(dims, dtype=shape.dtype, device=device), new(dims, dtype=shape.dtype, device=device),
                         scales(), scales())
            for _ in range(shape.num_layers)
        ]

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.layers
                   for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None)

"""The KV pool: one preallocated K and V tensor per layer, [num_blocks, block_size, num_kv_heads, head_dim].

Sized once at start from a byte budget; `bytes_per_token` is 2 x layers x kv_heads x head_dim x dtype bytes.
Blocks are zero-filled so that padding slots read by batched attention never hold NaN garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8


class KVPool:
    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(dims, dtype=shape.dtype, device=device), torch.zeros(dims, dtype=shape.dtype, device=device))
            for _ in range(shape.num_layers)
        ]

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

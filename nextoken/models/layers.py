"""Building blocks shared by the model files: RMSNorm, rotary embedding, gated MLP, self-attention.

Every block works on a flat token dimension ([num_tokens, hidden]): sequences of a batch are laid out back to back
and only attention needs to know where one ends (through `AttentionMetadata`). Activations (the residual stream,
norms, attention) stay in fp32; only projection weights take the model's weight dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextoken.models.config import RopeConfig
from nextoken.ops.attention import AttentionMetadata, paged_attention


class Linear(nn.Linear):
    """A bias-free projection whose weight may be stored in a lower precision than the activations (bf16 weights,
    fp32 residual stream): the input is cast to the weight's dtype for the matmul and the result cast back."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension. GGUF files store Gemma's (1 + w) already added."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op (same formula, same float32 result as the three-step form the reference writes out).
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, "neox" layout: dimension i pairs with i + dim/2.

    cos/sin are tabulated in fp32 and grown by doubling as positions get longer, so a 32k-context model does not
    allocate its whole table up front (and a model built on the meta device holds no rotary state to lose).
    """

    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.dim = rope.dim
        self.head_dim = head_dim
        self.theta = rope.theta
        self.scaling_factor = rope.scaling_factor if rope.scaling_type == "linear" else 1.0
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._last_positions: torch.Tensor | None = None
        self._last: tuple[torch.Tensor, torch.Tensor] = (self._cos, self._sin)

    def _table(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < length or self._cos.device != device:
            size = max(256, 1 << (length - 1).bit_length())
            exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim
            inv_freq = 1.0 / (self.theta ** exponents) / self.scaling_factor  # [dim/2]
            positions = torch.arange(size, dtype=torch.float32, device=device)
            freqs = torch.outer(positions, inv_freq)  # [size, dim/2]
            self._cos, self._sin = freqs.cos(), freqs.sin()
        return self._cos, self._sin

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, heads, head_dim], k [num_tokens, kv_heads, head_dim]; positions [num_tokens]."""
        cos, sin = self._lookup(positions)
        # One rotation over q and k side by side: half the small ops of rotating each (decode is op-bound).
        rotated = self._rotate(torch.cat((q, k), dim=1), cos, sin)  # [num_tokens, heads + kv_heads, head_dim]
        return rotated[:, :q.shape[1]], rotated[:, q.shape[1]:]

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Every layer of one forward pass passes the same positions tensor: gather cos/sin once, not per layer.
        if positions is not self._last_positions:
            cos_table, sin_table = self._table(int(positions.max()) + 1, positions.device)
            self._last_positions = positions
            self._last = (cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1))  # [tokens, 1, dim/2]
        return self._last

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:self.dim]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.dim < self.head_dim:  # partial rotary: the rest passes through
            rotated = torch.cat((rotated, xf[..., self.dim:]), dim=-1)
        return rotated.to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul: SwiGLU (silu) or GeGLU (gelu tanh)."""

    def __init__(self, hidden: int, ffn: int, activation: str) -> None:
        super().__init__()
        self.ffn = ffn
        self.gate_up_proj = Linear(hidden, 2 * ffn)
        self.down_proj = Linear(ffn, hidden)
        if activation == "silu":
            self.act = F.silu
        elif activation == "gelu_tanh":
            self.act = lambda x: F.gelu(x, approximate="tanh")
        else:
            raise ValueError(f"unknown activation {activation!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * ffn]
        gate, up = gate_up.split(self.ffn, dim=-1)
        return self.down_proj(self.act(gate) * up)


class SelfAttention(nn.Module):
    """Causal (optionally sliding-window) grouped-query attention over the paged KV cache.

    q, k and v come from one fused projection; optional per-head RMSNorm of q and k (Gemma 3) runs before RoPE.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: RotaryEmbedding,
                 scale: float, sliding_window: int | None = None, qk_norm_eps: float | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, hidden)
        self.rope = rope
        self.scale = scale
        self.sliding_window = sliding_window
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(positions, q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

"""The parts decoder blocks are made of (models/recipe.py names them): RMSNorm and LayerNorm, rotary embedding, gated
and plain MLPs, self-attention.

Every block works on a flat token dimension ([num_tokens, hidden]): sequences of a batch are laid out back to back
and only attention needs to know where one ends (through `AttentionMetadata`). Activations (the residual stream,
norms, attention) stay in fp32; only projection weights take the model's weight dtype.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.models.recipe import RopeConfig
from nextoken.ops import native
from nextoken.ops.attention import AttentionMetadata, paged_attention


class Linear(nn.Linear):
    """A bias-free projection whose weight may be stored in a lower precision than the activations (bf16 weights,
    fp32 residual stream): the input is cast to the weight's dtype for the matmul and the result cast back.

    fp32 products on the CPU go through the native row-major kernel (ops/native matmul_rowmajor) where it is built:
    each output is one fixed sequence of multiply-adds, the same bits whatever the thread count or the batch, which
    torch's BLAS does not promise (its split of the sum follows the thread count for some shapes)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.lib = native.library()

    def reset_parameters(self) -> None:
        """No random init: every weight comes from the file. (On the meta device torch's init runs through its
        decompositions, whose first use imports torch._dynamo: 3 s of a fresh process's model load.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if native.repeatable(self.lib, x, self.weight):
            return native.matmul_rowmajor(self.lib, x, self.weight)
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dimension. GGUF files store Gemma's (1 + w) already added.

    On CPU, fp32 rows go through one native call (`ops/native`), which can also add the residual first (`add`);
    torch's CPU rms_norm is half a dozen ops of several microseconds each, at every norm of every decode step."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self.lib = native.library()

    def _native(self, x: torch.Tensor) -> bool:
        return self.lib is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._native(x):
            return native.rms_norm(cast(ctypes.CDLL, self.lib), x, self.weight, self.eps)
        # One fused op (same formula, same float32 result as the three-step form the reference writes out).
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm): the residual add and the next norm in one pass. x may be updated in place."""
        if self._native(x) and self._native(delta) and delta.shape == x.shape:
            return x, native.rms_norm(cast(ctypes.CDLL, self.lib), x, self.weight, self.eps, residual=delta)
        x = x + delta
        return x, self(x)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dimension (GPT-2's norm), in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.weight.shape, self.weight, self.bias, self.eps).to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its norm), as RMSNorm.add."""
        x = x + delta
        return x, self(x)


def make_norm(kind: str, dim: int, eps: float) -> RMSNorm | LayerNorm:
    """A recipe's norm: "rms" or "layer"."""
    return RMSNorm(dim, eps) if kind == "rms" else LayerNorm(dim, eps)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in one of two layouts of a head's dimensions:

    - "interleaved": dimensions (2i, 2i+1) form pair i (GGML's layout for Llama-family Q/K rows). A head is then a
      vector of complex numbers and rotating it is one complex multiplication.
    - "neox": dimension i pairs with i + dim/2 (the half-split layout; also used for partial rotary).

    Attention only uses dot products of q and k, so any layout works as long as q's and k's rows (and per-head norm
    weights) agree; models pick interleaved, the cheaper one, where they can. cos/sin are tabulated in fp32 and
    grown by doubling as positions get longer, so a 32k-context model does not allocate its whole table up front (and
    a model built on the meta device holds no rotary state to lose).
    """

    def __init__(self, rope: RopeConfig, head_dim: int, layout: str = "neox") -> None:
        super().__init__()
        if layout not in ("neox", "interleaved") or (layout == "interleaved" and rope.dim != head_dim):
            raise ValueError(f"unsupported rotary layout {layout!r} for {rope.dim} of {head_dim} dimensions")
        self.dim = rope.dim
        self.head_dim = head_dim
        self.layout = layout
        self.theta = rope.theta
        self.scaling_factor = rope.scaling_factor if rope.scaling_type == "linear" else 1.0
        self.freq_factors = rope.freq_factors
        self.attention_factor = rope.attention_factor
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._cis = torch.empty(0, dtype=torch.complex64)
        self._last_positions: torch.Tensor | None = None
        self._last: tuple[torch.Tensor, ...] = ()

    def tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [positions, dim / 2] fp32, grown to cover positions below `length`."""
        if self._cos.shape[0] < length or self._cos.device != device:
            size = max(256, 1 << (length - 1).bit_length())
            exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=device).float() / self.dim
            inv_freq = 1.0 / (self.theta ** exponents) / self.scaling_factor  # [dim/2]
            if self.freq_factors is not None:
                inv_freq = inv_freq / torch.tensor(self.freq_factors, dtype=torch.float32, device=device)
            positions = torch.arange(size, dtype=torch.float32, device=device)
            freqs = torch.outer(positions, inv_freq)  # [size, dim/2]
            self._cos, self._sin = freqs.cos(), freqs.sin()
            if self.attention_factor != 1.0:
                self._cos, self._sin = self._cos * self.attention_factor, self._sin * self.attention_factor
            self._cis = torch.complex(self._cos, self._sin)
        return self._cos, self._sin

    def forward(self, positions: torch.Tensor, qk: torch.Tensor, num_q_heads: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [num_tokens, heads + kv_heads, head_dim] (q's heads, then k's); positions [num_tokens] -> rotated
        (q [num_tokens, heads, head_dim], k [num_tokens, kv_heads, head_dim]), both fp32."""
        # One rotation over q and k side by side: half the small ops of rotating each (decode is op-bound).
        rotated = self._interleaved(positions, qk) if self.layout == "interleaved" else self._neox(positions, qk)
        return rotated[:, :num_q_heads], rotated[:, num_q_heads:]

    def _lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Every layer of one forward pass passes the same positions tensor: gather the table once, not per layer.
        if positions is not self._last_positions:
            # A step being captured into a CUDA graph may not read back from the device; its tables were grown
            # to the longest context before capture.
            if not (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
                self.tables(int(positions.max()) + 1, positions.device)
            self._last_positions = positions
            if self.layout == "interleaved":
                self._last = (self._cis[positions].unsqueeze(1),)  # [tokens, 1, dim/2] complex
            else:
                self._last = (self._cos[positions].unsqueeze(1), self._sin[positions].unsqueeze(1))
        return self._last

    def _interleaved(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        (cis,) = self._lookup(positions)
        x = qk.float()
        if x.stride(-1) != 1 or x.storage_offset() % 2 or any(st % 2 for st in x.stride()[:-1]):
            x = x.contiguous()
        pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))  # [tokens, heads, dim/2]
        return torch.view_as_real(pairs * cis).flatten(-2)

    def _neox(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        cos, sin = self._lookup(positions)
        half = self.dim // 2
        xf = qk.float()
        x1, x2 = xf[..., :half], xf[..., half:self.dim]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.dim < self.head_dim:  # partial rotary: the rest passes through
            rotated = torch.cat((rotated, xf[..., self.dim:]), dim=-1)
        return rotated


def rotary_rows(w: torch.Tensor, num_heads: int, to: str) -> torch.Tensor:
    """Reorder a head's rows (dim 0 of [heads * head_dim, ...]) between the rotary layouts: half-split order
    (head, 2, pair) -> interleaved (head, pair, 2) with to="interleaved", and back with to="neox"."""
    pairs = w.shape[0] // num_heads // 2
    split = (num_heads, 2, pairs) if to == "interleaved" else (num_heads, pairs, 2)
    return w.reshape(*split, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A recipe's activation: "silu", or "gelu_tanh" (GELU, tanh approximation: Gemma's GeGLU, GPT-2's MLP)."""
    if name == "silu":
        return F.silu
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unknown activation {name!r}")


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul: SwiGLU (silu) or GeGLU (gelu tanh)."""

    def __init__(self, hidden: int, ffn: int, activation: str) -> None:
        super().__init__()
        self.ffn = ffn
        self.gate_up_proj = Linear(hidden, 2 * ffn)
        self.down_proj = Linear(ffn, hidden)
        self.activation = activation
        self.lib = native.library()
        self.act = activation_fn(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * ffn]
        if (self.lib is not None and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu"
                and gate_up.dim() == 2 and gate_up.is_contiguous()):
            # One native pass, split across threads: torch's activation then product are two passes and a
            # tensor more (SmolLM2's 512-token prefill: 29 ms of them).
            return self.down_proj(native.gated_rows(self.lib, native.ACTIVATIONS[self.activation], gate_up))
        gate, up = gate_up.split(self.ffn, dim=-1)
        return self.down_proj(self.act(gate) * up)


class PlainMLP(nn.Module):
    """down(act(up(x) + up_bias)) + down_bias: GPT-2's MLP (GELU, tanh approximation), biases where the recipe has
    them."""

    def __init__(self, hidden: int, ffn: int, activation: str, bias: bool) -> None:
        super().__init__()
        self.ffn = ffn
        self.up_proj = Linear(hidden, ffn)
        self.down_proj = Linear(ffn, hidden)
        self.activation = activation
        self.up_bias = nn.Parameter(torch.zeros(ffn), requires_grad=False) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(hidden), requires_grad=False) if bias else None
        self.act = activation_fn(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)
        if self.up_bias is not None:
            h = h + self.up_bias
        out = self.down_proj(self.act(h))
        return out if self.down_bias is None else out + self.down_bias


class Experts(nn.Module):
    """The routed experts' gated MLPs, stacked as llama.cpp stores them: gate and up [experts, ffn, hidden], down
    [experts, hidden, ffn]."""

    def __init__(self, num_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.empty(num_experts, ffn, hidden), requires_grad=False)
        self.up = nn.Parameter(torch.empty(num_experts, ffn, hidden), requires_grad=False)
        self.down = nn.Parameter(torch.empty(num_experts, hidden, ffn), requires_grad=False)


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer: a router's softmax over the experts, each token's top `k` of them
    (their weights renormalized to sum to 1 where the family does: Mixtral), each expert a gated MLP; plus, where the
    family has one, a shared expert every token takes, scaled by sigmoid of its own gate (Qwen2-MoE).

    A step's tokens are grouped by expert: one product per expert over all the rows that chose it, never a loop over
    tokens. `last_choice` keeps the latest call's (experts, weights) per token for a tracer to show."""

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, activation: str, renormalize: bool,
                 shared_ffn: int = 0) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.router = Linear(hidden, num_experts)
        self.experts = Experts(num_experts, hidden, ffn)
        self.act = activation_fn(activation)
        self.shared = GatedMLP(hidden, shared_ffn, activation) if shared_ffn else None
        self.shared_gate = Linear(hidden, 1) if shared_ffn else None
        self.last_choice: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).float().softmax(dim=-1)  # [tokens, experts]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [tokens, k]
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.last_choice = (chosen, weights)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        scale = weights.reshape(-1)
        out = torch.zeros_like(x)
        e = self.experts
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            pairs = order[start:start + n]
            start += n
            tokens = pairs // self.top_k
            h = x[tokens]
            y = F.linear(self.act(F.linear(h, e.gate[expert])) * F.linear(h, e.up[expert]), e.down[expert])
            out.index_add_(0, tokens, y * scale[pairs, None])
        if self.shared is not None and self.shared_gate is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


class SelfAttention(nn.Module):
    """Causal (optionally sliding-window) grouped-query attention over the paged KV cache.

    q, k and v come from one fused projection; optional per-head RMSNorm of q and k (Gemma 3) runs before RoPE.
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: RotaryEmbedding | None,
                 scale: float, sliding_window: int | None = None, qk_norm_eps: float | None = None,
                 qkv_bias: bool = False, o_bias: bool = False) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size)
        self.o_proj = Linear(self.q_size, hidden)
        # Biases beside the projections, not in them: a projection is a weight in whatever format it runs in.
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size), requires_grad=False) \
            if qkv_bias else None
        self.o_bias = nn.Parameter(torch.zeros(hidden), requires_grad=False) if o_bias else None
        self.rope = rope
        self.scale = scale
        self.sliding_window = sliding_window
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCacheLayer,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        if self.rope is not None:
            q, k = self.rope(positions, qk, self.num_heads)
        else:  # learned positions: added to the token rows already
            q, k = qk[:, :self.num_heads].float().contiguous(), qk[:, self.num_heads:].float().contiguous()
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.sliding_window)
        out = self.o_proj(out.reshape(num_tokens, self.q_size))
        return out if self.o_bias is None else out + self.o_bias

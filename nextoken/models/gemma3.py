"""Gemma 3: embeddings scaled by sqrt(hidden), "sandwich" norms (before and after both attention and MLP), RMSNorm
of q and k per head, a GeGLU MLP, and interleaved local (sliding-window, RoPE base 10k) and global layers.
"""

from __future__ import annotations

import torch
from torch import nn

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.models.base import CausalLM
from nextoken.models.config import ModelConfig
from nextoken.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, SelfAttention, rotary_rows
from nextoken.ops.attention import AttentionMetadata


class Gemma3Block(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        eps = cfg.norm_eps
        self.input_norm = RMSNorm(cfg.hidden_size, eps)
        self.attn = SelfAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rope,
                                  scale=cfg.query_scale, sliding_window=sliding_window, qk_norm_eps=eps)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, eps)
        self.pre_mlp_norm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.ffn_size, activation="gelu_tanh")
        self.post_mlp_norm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCacheLayer,
                meta: AttentionMetadata) -> torch.Tensor:
        x, h = self.pre_mlp_norm.add(x, self.post_attn_norm(self.attn(self.input_norm(x), positions, kv_cache, meta)))
        return self.post_mlp_norm(self.mlp(h)).add_(x)  # in place (LlamaBlock)


    def fused_norms(self) -> dict[str, RMSNorm | None]:
        """The block's norms by role, for the fused decode path (ops/fused.py)."""
        return {"attn_in": self.input_norm, "attn_out": self.post_attn_norm, "mlp_in": self.pre_mlp_norm,
                "mlp_out": self.post_mlp_norm}


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # The file stores Q/K in the half-split ("neox") layout; where every dimension rotates they are loaded in the
        # interleaved layout instead (one complex multiplication per rotation; see RotaryEmbedding).
        local = config.rope_local or config.rope
        self.interleave = config.rope.dim == local.dim == config.head_dim
        layout = "interleaved" if self.interleave else "neox"
        global_rope = RotaryEmbedding(config.rope, config.head_dim, layout)
        local_rope = RotaryEmbedding(local, config.head_dim, layout)
        self.layers = nn.ModuleList(
            Gemma3Block(config, local_rope, config.sliding_window) if sliding else
            Gemma3Block(config, global_rope, None)
            for sliding in config.layer_is_sliding
        )

    def layer_tensor_map(self) -> dict[str, tuple[str, ...]]:
        return {
            "input_norm.weight": ("attn_norm.weight",),
            "attn.qkv_proj.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
            "attn.q_norm.weight": ("attn_q_norm.weight",),
            "attn.k_norm.weight": ("attn_k_norm.weight",),
            "attn.o_proj.weight": ("attn_output.weight",),
            "post_attn_norm.weight": ("post_attention_norm.weight",),
            "pre_mlp_norm.weight": ("ffn_norm.weight",),
            "mlp.gate_up_proj.weight": ("ffn_gate.weight", "ffn_up.weight"),
            "mlp.down_proj.weight": ("ffn_down.weight",),
            "post_mlp_norm.weight": ("post_ffw_norm.weight",),
        }

    def row_order(self, gguf_name: str, num_rows: int) -> torch.Tensor | None:
        if not self.interleave:
            return None
        cfg = self.config
        if gguf_name.endswith("attn_q.weight"):
            return rotary_rows(torch.arange(num_rows), cfg.num_heads, to="interleaved")
        if gguf_name.endswith("attn_k.weight"):
            return rotary_rows(torch.arange(num_rows), cfg.num_kv_heads, to="interleaved")
        if gguf_name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):  # per head dimension: same order
            return rotary_rows(torch.arange(num_rows), 1, to="interleaved")
        return None

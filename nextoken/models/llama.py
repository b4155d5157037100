"""The Llama family (SmolLM2, Llama 2/3, Mistral-style): pre-norm blocks of RMSNorm, RoPE grouped-query attention
and a SwiGLU MLP, with residuals around both; embeddings tied to the LM head when the file has no `output.weight`.
"""

from __future__ import annotations

import torch
from torch import nn

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.models.base import CausalLM
from nextoken.models.config import ModelConfig
from nextoken.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, SelfAttention, rotary_rows
from nextoken.ops.attention import AttentionMetadata


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = SelfAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rope,
                                  scale=cfg.query_scale)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.ffn_size, activation="silu")

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCacheLayer,
                meta: AttentionMetadata) -> torch.Tensor:
        x, h = self.post_attn_norm.add(x, self.attn(self.input_norm(x), positions, kv_cache, meta))
        return self.mlp(h).add_(x)  # in place: a fresh sum's pages would fault in at every layer


    def fused_norms(self) -> dict[str, RMSNorm | None]:
        """The block's norms by role, for the fused decode path (ops/fused.py)."""
        return {"attn_in": self.input_norm, "attn_out": None, "mlp_in": self.post_attn_norm, "mlp_out": None}


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        # One table shared by every layer. The file's Q/K rows are already in the interleaved layout (see below).
        self.rope_layout = "interleaved" if config.rope.dim == config.head_dim else "neox"
        rope = RotaryEmbedding(config.rope, config.head_dim, self.rope_layout)
        self.layers = nn.ModuleList(LlamaBlock(config, rope) for _ in range(config.num_layers))

    def layer_tensor_map(self) -> dict[str, tuple[str, ...]]:
        return {
            "input_norm.weight": ("attn_norm.weight",),
            "attn.qkv_proj.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
            "attn.o_proj.weight": ("attn_output.weight",),
            "post_attn_norm.weight": ("ffn_norm.weight",),
            "mlp.gate_up_proj.weight": ("ffn_gate.weight", "ffn_up.weight"),
            "mlp.down_proj.weight": ("ffn_down.weight",),
        }

    def row_order(self, gguf_name: str, num_rows: int) -> torch.Tensor | None:
        # llama.cpp's converter permutes the rows of Q and K so that its interleaved RoPE (pairs 2i, 2i+1) equals
        # the original half-split RoPE. Our interleaved rotary takes them as they are; partial rotary runs in the
        # half-split ("neox") layout, so there the permutation is undone.
        cfg = self.config
        if self.rope_layout == "interleaved":
            return None
        if gguf_name.endswith("attn_q.weight"):
            return rotary_rows(torch.arange(num_rows), cfg.num_heads, to="neox")
        if gguf_name.endswith("attn_k.weight"):
            return rotary_rows(torch.arange(num_rows), cfg.num_kv_heads, to="neox")
        return None

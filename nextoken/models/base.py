"""The decoder-only model every architecture shares: embed (plus learned positions) -> blocks -> final norm -> LM head,
each block built from the architecture's recipe (models/recipe.py): pre-norm attention and MLP with residuals, norms
of their outputs where the recipe has them.

The recipe also names the file tensors that make each parameter (concatenated along the output dimension, so q/k/v
and gate/up load straight into fused projections), and `row_order` puts the rows of q and k in the rotary layout the
model runs. The math only: a model is built on the meta device, the loader attaches the file's tensors as stored
(loader/weights.py), and a pass gives each module the format it runs in (ops/quantize.py: dense, block-quantized
projections, a Q8 token table, an int8 LM head, a fused decode path).
"""

from __future__ import annotations

import ctypes

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.models.config import ModelConfig
from nextoken.models.layers import (GatedMLP, Linear, MoE, PlainMLP, RotaryEmbedding, SelfAttention, make_norm,
                                    rotary_rows)
from nextoken.models.probe import FUSED_BLOCKS, MODULES, ForwardProbe
from nextoken.ops import native
from nextoken.ops.attention import AttentionMetadata

if TYPE_CHECKING:
    from nextoken.ops.quant_head import Int8GroupHead


class FusedPath(Protocol):
    """A faster route through every block of a model and its final norm (ops/fused.py), built over its modules'
    tensors: it runs where `applies` says, with the same results as the modules."""

    def applies(self, x: torch.Tensor, kv_caches: list[KVCacheLayer], meta: AttentionMetadata) -> bool: ...

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                 meta: AttentionMetadata, profile: ctypes.Array | None = None) -> torch.Tensor: ...

    def rebuilt(self) -> FusedPath | None:
        """The same path over the modules as they are now (None where it no longer applies)."""


class DecoderBlock(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)): each output normed first where the recipe says (`sandwich`)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding | None, sliding_window: int | None) -> None:
        super().__init__()
        recipe, eps = cfg.recipe, cfg.norm_eps
        self.input_norm = make_norm(recipe.norm, cfg.hidden_size, eps)
        self.attn = SelfAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rope,
                                  scale=cfg.query_scale, sliding_window=sliding_window,
                                  qk_norm_eps=eps if recipe.qk_norm else None, qkv_bias=recipe.qkv_bias,
                                  o_bias=recipe.o_bias)
        self.post_attn_norm = make_norm(recipe.norm, cfg.hidden_size, eps) if recipe.sandwich else None
        self.pre_mlp_norm = make_norm(recipe.norm, cfg.hidden_size, eps)
        if recipe.mlp == "moe":
            self.mlp: nn.Module = MoE(cfg.hidden_size, cfg.expert_ffn_size, cfg.num_experts, cfg.experts_per_token,
                                      recipe.activation, recipe.moe_renormalize,
                                      cfg.shared_expert_ffn_size if recipe.shared_expert else 0)
        elif recipe.mlp == "gated":
            self.mlp = GatedMLP(cfg.hidden_size, cfg.ffn_size, recipe.activation)
        else:
            self.mlp = PlainMLP(cfg.hidden_size, cfg.ffn_size, recipe.activation, recipe.mlp_bias)
        self.post_mlp_norm = make_norm(recipe.norm, cfg.hidden_size, eps) if recipe.sandwich else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: KVCacheLayer,
                meta: AttentionMetadata) -> torch.Tensor:
        h = self.attn(self.input_norm(x), positions, kv_cache, meta)
        if self.post_attn_norm is not None:
            h = self.post_attn_norm(h)
        x, h = self.pre_mlp_norm.add(x, h)
        h = self.mlp(h)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return h.add_(x)  # in place: a fresh sum's pages would fault in at every layer


class CausalLM(nn.Module):
    """A decoder-only language model of any family: its blocks as `config.recipe` declares them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        recipe = config.recipe
        # Built with an empty weight (no random init: see Linear.reset_parameters); filled from the file. The
        # quantization pass may hold it in blocks instead (ops/quantize.py).
        self.embed_tokens: nn.Module = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.embed_positions: nn.Module | None = None
        if recipe.positions == "learned":
            self.embed_positions = nn.Embedding(config.context_length, config.hidden_size,
                                                _weight=torch.empty(config.context_length, config.hidden_size))
        self.norm = make_norm(recipe.norm, config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        # The LM head for decode rows, where the quantization pass gives one: called as (hidden, out) -> logits.
        self.quantized_head: Int8GroupHead | None = None
        self.fused: FusedPath | None = None  # set by the quantization pass where every projection is in blocks
        self.probe: ForwardProbe | None = None  # an observer of forward passes (a tracer's), on whichever path
        # Rotary q/k in the interleaved layout (one complex multiplication) where every dimension rotates, else
        # half-split; the loader orders the file's q and k rows to match (row_order).
        self.rope_layout: str | None = None
        global_rope = local_rope = None
        if recipe.positions == "rope":
            local = config.rope_local or config.rope
            self.rope_layout = "interleaved" if config.rope.dim == local.dim == config.head_dim else "neox"
            global_rope = RotaryEmbedding(config.rope, config.head_dim, self.rope_layout)
            local_rope = global_rope if config.rope_local is None else \
                RotaryEmbedding(config.rope_local, config.head_dim, self.rope_layout)
        self.layers = nn.ModuleList(
            DecoderBlock(config, local_rope, config.sliding_window) if sliding else
            DecoderBlock(config, global_rope, None) for sliding in config.layer_is_sliding)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The token rows [num_tokens, hidden] (scaled where the family scales them), plus the rows of their
        `positions` where the model learned absolute ones."""
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.config.embedding_scale != 1.0:
            x = x * self.config.embedding_scale
        if self.embed_positions is not None:
            assert positions is not None, "a model with learned positions embeds tokens at their positions"
            x = x + self.embed_positions(positions)
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[num_rows, hidden] -> fp32 logits [num_rows, vocab], written into `out` ([at least num_rows, vocab] fp32,
        contiguous, on the head's device) where given and the head can."""
        if self.quantized_head is not None:
            return self.quantized_head(hidden, out)
        weight = self.head_weight
        lib = native.library()
        if native.repeatable(lib, hidden, weight):  # the same bits on any thread count (Linear)
            rows = hidden.shape[0]
            fits = out is not None and out.dtype == torch.float32 and out.stride(-1) == 1 and out.shape[0] >= rows
            return native.matmul_rowmajor(lib, hidden, weight, out[:rows] if fits and out is not None else None)
        if out is not None and weight.dtype == hidden.dtype == out.dtype and weight.device == out.device:
            return torch.mm(hidden, weight.t(), out=out[:hidden.shape[0]])
        return torch.nn.functional.linear(hidden, weight).float()

    def set_activations(self, activations: str) -> None:
        """How the GEMM over block weights meets the activations, in the projections and the LM head over the
        file's blocks: "int16" or "int8" codes per 32 values (BlockLinear.activations). The fused decoder's structs
        are rebuilt to carry the choice."""
        for module in self.modules():
            if hasattr(module, "activations"):  # a block module that offers the choice (ops/quant_linear.py)
                setattr(module, "activations", activations)
        if self.fused is not None:
            self.fused = self.fused.rebuilt()

    @property
    def head_weight(self) -> torch.Tensor:
        """The fp32 head (a block embedding has none: its tied head is always the `quantized_head`)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        weight = getattr(head, "weight", None)
        assert isinstance(weight, torch.Tensor), "a block-held table's head is the quantized head"
        return weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                meta: AttentionMetadata, logits_indices: torch.Tensor | None = None,
                logits_out: torch.Tensor | None = None, *, modules: bool = False, head: bool = True) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> logits [len(logits_indices) or num_tokens, vocab] (fp32), in
        `logits_out` where given (compute_logits).

        Only the rows named by `logits_indices` go through the LM head: in prefill, usually just each sequence's
        last token. With `modules`, every block runs through its torch modules even where the fused decoder would
        take them (a tracer re-running a fused step to look inside its layers). Without `head`, the rows stop
        before it: the final norm's output [rows, hidden], what compute_logits takes (a pass whose head comes
        later, engine/head_draft.py; no probe sees it). A probe, where set, is told of each stage (ForwardProbe).
        """
        probe = self.probe if head else None
        if probe is not None:
            probe.begin(positions)
        x = self.embed(input_ids, positions)
        fused = not modules and self.fused is not None and self.fused.applies(x, kv_caches, meta)
        if probe is not None:
            probe.embedded(FUSED_BLOCKS if fused else MODULES)
        if fused:
            # The final norm included; a probe's profile gets the blocks' times.
            assert self.fused is not None
            x = self.fused(x, positions, kv_caches, meta, None if probe is None else probe.profile)
        else:
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                x = layer(x, positions, kv_cache, meta)
                if probe is not None:
                    probe.layer_done(i)
        if probe is not None:
            probe.blocks_done()
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        if not head:
            return x if fused else self.norm(x)
        logits = self.compute_logits(x if fused else self.norm(x), logits_out)
        if probe is not None:
            probe.end(logits)
        return logits

    # --- the file's tensors --------------------------------------------------------------------------------

    def gguf_tensor_map(self) -> dict[str, tuple[str, ...]]:
        """Parameter name -> GGUF tensor names concatenated (dim 0) to form it."""
        cfg = self.config
        names: dict[str, tuple[str, ...]] = {
            "embed_tokens.weight": ("token_embd.weight",),
            "norm.weight": ("output_norm.weight",),
        }
        if cfg.recipe.norm == "layer":
            names["norm.bias"] = ("output_norm.bias",)
        if self.embed_positions is not None:
            names["embed_positions.weight"] = ("position_embd.weight",)
        if self.lm_head is not None:
            names["lm_head.weight"] = ("output.weight",)
        for i in range(cfg.num_layers):
            for param, files in cfg.recipe.layer_tensors().items():
                names[f"layers.{i}.{param}"] = tuple(f"blk.{i}.{f}" for f in files)
        return names

    def row_order(self, gguf_name: str, num_rows: int) -> torch.Tensor | None:
        """The order in which the model takes a file tensor's rows (dim 0; a vector's elements), where it differs
        from the file's: q's and k's rows (and their biases and per-head norm weights) from the layout the file
        stores them in to the model's rotary layout, applied alike to decoded values and to block codes. None: as
        stored."""
        cfg = self.config
        stored = cfg.recipe.gguf_rope_rows
        if self.rope_layout is None or self.rope_layout == stored:
            return None
        kind = gguf_name.rsplit(".", 2)[-2] if gguf_name.count(".") >= 2 else ""
        rows = torch.arange(num_rows)
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        if kind == "attn_q":
            return rotary_rows(rows, cfg.num_heads, to=self.rope_layout)
        if kind == "attn_k":
            return rotary_rows(rows, cfg.num_kv_heads, to=self.rope_layout)
        if kind in ("attn_q_norm", "attn_k_norm"):  # per head dimension: the same order in every head
            return rotary_rows(rows, 1, to=self.rope_layout)
        if kind == "attn_qkv" and num_rows == q_size + 2 * kv_size:
            return torch.cat((rotary_rows(rows[:q_size], cfg.num_heads, to=self.rope_layout),
                              rotary_rows(rows[q_size:q_size + kv_size], cfg.num_kv_heads, to=self.rope_layout),
                              rows[q_size + kv_size:]))
        return None

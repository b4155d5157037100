"""A decoder block declared once: which norm, positions, attention and feed-forward parts an architecture's blocks are
made of. The module path builds its blocks from a recipe (models/base.py `DecoderBlock`), the loader takes the file's
tensors by the names the recipe implies (llama.cpp's GGUF names), and the fused native step (ops/fused.py) runs a
model whose recipe it covers (`native_gaps` says what it does not; such a model runs on the modules).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    theta: float  # base of the rotary frequencies
    dim: int  # rotated dimensions per head (<= head_dim)
    scaling_type: str = "none"  # "none" | "linear"
    scaling_factor: float = 1.0
    # Per-frequency divisors of the rotary frequencies ([dim / 2]; Llama 3's `rope_freqs`, Phi-3's longrope factors),
    # and a factor on cos and sin (longrope's attention scaling).
    freq_factors: tuple[float, ...] | None = None
    attention_factor: float = 1.0


@dataclass(frozen=True)
class Recipe:
    norm: str = "rms"  # "rms": RMSNorm | "layer": LayerNorm with a bias
    sandwich: bool = False  # also a norm of the attention's and of the MLP's output, before each residual add
    positions: str = "rope"  # "rope": rotary q/k | "learned": an absolute position table added to the token rows
    qkv_bias: bool = False  # biases on q, k and v
    o_bias: bool = False  # a bias on the attention's output projection
    qk_norm: bool = False  # RMSNorm of q and k per head, before RoPE
    mlp: str = "gated"  # "gated": down(act(gate(x)) * up(x)) | "plain": down(act(up(x))) | "moe": gated experts
    moe_renormalize: bool = True  # the chosen experts' router weights rescaled to sum to 1 (Mixtral; not Qwen2-MoE)
    shared_expert: bool = False  # beside the routed experts, one every token takes, scaled by its own sigmoid gate
    activation: str = "silu"  # "silu" | "gelu_tanh"
    mlp_bias: bool = False  # biases on the MLP's projections (plain MLPs)
    fused_qkv: bool = False  # the file holds q, k and v as one tensor (attn_qkv)
    fused_gate_up: bool = False  # the file holds gate and up as one tensor (ffn_up, gate first)
    # How a GGUF file orders each head's q/k rows: "interleaved" where llama.cpp's converter permuted them for its
    # pairwise RoPE (the Llama family), else "neox" (half-split, as the original checkpoints).
    gguf_rope_rows: str = "neox"

    def native_gaps(self) -> list[str]:
        """The parts the fused native step does not have (empty: it runs this recipe)."""
        gaps = []
        if self.norm != "rms":
            gaps.append("LayerNorm")
        if self.positions != "rope":
            gaps.append("learned positions")
        if self.o_bias:
            gaps.append("an attention output bias")
        if self.mlp != "gated" or self.mlp_bias:
            gaps.append({"plain": "a plain MLP", "moe": "mixture-of-experts"}.get(self.mlp, "MLP biases"))
        return gaps

    def layer_tensors(self) -> dict[str, tuple[str, ...]]:
        """A block's parameters -> the GGUF tensors (names after `blk.N.`) stacked along dim 0 to make each."""
        names: dict[str, tuple[str, ...]] = {"input_norm.weight": ("attn_norm.weight",)}
        if self.fused_qkv:
            names["attn.qkv_proj.weight"] = ("attn_qkv.weight",)
        else:
            names["attn.qkv_proj.weight"] = ("attn_q.weight", "attn_k.weight", "attn_v.weight")
        if self.qkv_bias:
            names["attn.qkv_bias"] = ("attn_qkv.bias",) if self.fused_qkv else \
                ("attn_q.bias", "attn_k.bias", "attn_v.bias")
        if self.qk_norm:
            names["attn.q_norm.weight"] = ("attn_q_norm.weight",)
            names["attn.k_norm.weight"] = ("attn_k_norm.weight",)
        names["attn.o_proj.weight"] = ("attn_output.weight",)
        if self.o_bias:
            names["attn.o_bias"] = ("attn_output.bias",)
        if self.sandwich:
            names["post_attn_norm.weight"] = ("post_attention_norm.weight",)
            names["post_mlp_norm.weight"] = ("post_ffw_norm.weight",)
        names["pre_mlp_norm.weight"] = ("ffn_norm.weight",)
        if self.mlp == "moe":  # llama.cpp's stacked experts [experts, rows, cols]
            names.update({"mlp.router.weight": ("ffn_gate_inp.weight",), "mlp.experts.gate": ("ffn_gate_exps.weight",),
                          "mlp.experts.up": ("ffn_up_exps.weight",), "mlp.experts.down": ("ffn_down_exps.weight",)})
            if self.shared_expert:
                names.update({"mlp.shared.gate_up_proj.weight": ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
                              "mlp.shared.down_proj.weight": ("ffn_down_shexp.weight",),
                              "mlp.shared_gate.weight": ("ffn_gate_inp_shexp.weight",)})
        elif self.mlp == "gated":
            names["mlp.gate_up_proj.weight"] = ("ffn_up.weight",) if self.fused_gate_up else \
                ("ffn_gate.weight", "ffn_up.weight")
            names["mlp.down_proj.weight"] = ("ffn_down.weight",)
        else:
            names["mlp.up_proj.weight"] = ("ffn_up.weight",)
            names["mlp.down_proj.weight"] = ("ffn_down.weight",)
        if self.mlp_bias:
            names["mlp.up_bias"] = ("ffn_up.bias",)
            names["mlp.down_bias"] = ("ffn_down.bias",)
        if self.norm == "layer":
            names["input_norm.bias"] = ("attn_norm.bias",)
            names["pre_mlp_norm.bias"] = ("ffn_norm.bias",)
        return names


@dataclass(frozen=True)
class Family:
    """An architecture as GGUF files name it (`general.architecture`): its block's recipe, and where it has any, the
    settings of its own that the metadata every family shares does not carry (`configure`, called by
    ModelConfig.from_gguf with a reader of the file's `{arch}.*` keys and the fields read so far, which it updates)."""

    name: str
    recipe: Recipe
    configure: Callable[[Callable[..., Any], dict[str, Any]], None] | None = None

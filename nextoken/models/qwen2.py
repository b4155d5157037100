"""Qwen2 (and Qwen2.5): the Llama block with biases on q, k and v; half-split RoPE. Qwen2-MoE: the same attention,
and a mixture of experts whose router weights are not renormalized, beside a shared expert with its own gate."""

from __future__ import annotations

from nextoken.models.recipe import Family, Recipe

QWEN2 = Family("qwen2", Recipe(qkv_bias=True))
QWEN2MOE = Family("qwen2moe", Recipe(qkv_bias=True, mlp="moe", moe_renormalize=False, shared_expert=True))

"""Qwen2 (and Qwen2.5): the Llama block with biases on q, k and v; half-split RoPE."""

from __future__ import annotations

from nextoken.models.recipe import Family, Recipe

QWEN2 = Family("qwen2", Recipe(qkv_bias=True))

"""Qwen3 (dense): the Llama block without biases, with RMSNorm of q and k per head before RoPE; half-split RoPE."""

from __future__ import annotations

from nextoken.models.recipe import Family, Recipe

QWEN3 = Family("qwen3", Recipe(qk_norm=True))

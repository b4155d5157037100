"""GPT-2: learned absolute positions added to the token rows, LayerNorm with a bias, q, k and v in one projection with a
bias, a plain MLP (GELU, tanh approximation) with biases, and the LM head tied to the token table."""

from __future__ import annotations

from nextoken.models.recipe import Family, Recipe

GPT2 = Family("gpt2", Recipe(norm="layer", positions="learned", qkv_bias=True, o_bias=True, mlp="plain",
                             activation="gelu_tanh", mlp_bias=True, fused_qkv=True))

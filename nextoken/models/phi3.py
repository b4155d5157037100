"""Phi-3: the Llama block with q, k and v in one tensor (`attn_qkv`) and gate and up in one (`ffn_up`, gate first);
half-split RoPE. Its long-context ("longrope") scaling comes as per-frequency factors, `rope_factors_short` and
`rope_factors_long` (models/config.py reads them for any family)."""

from __future__ import annotations

from nextoken.models.recipe import Family, Recipe

PHI3 = Family("phi3", Recipe(fused_qkv=True, fused_gate_up=True))

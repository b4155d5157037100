"""Gemma 3: embeddings scaled by sqrt(hidden), "sandwich" norms (before and after both attention and MLP), RMSNorm
of q and k per head, a GeGLU MLP, and interleaved local (sliding-window, RoPE base 10k) and global layers. GGUF files
store Gemma's norm weights with its (1 + w) already added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nextoken.models.recipe import Family, Recipe, RopeConfig


def configure(get: Callable[..., Any], fields: dict[str, Any]) -> None:
    """The sliding window and its layers, the local layers' RoPE and the embedding scale. Where the file leaves them
    implicit, Gemma 3's published configuration: five local layers, then one global (layer i is global when
    (i + 1) % 6 == 0), the local layers' RoPE base 10,000."""
    num_layers = fields["num_layers"]
    fields["sliding_window"] = get("attention.sliding_window")
    pattern = get("attention.sliding_window_pattern", None, kind=list)
    if pattern is not None and len(pattern) == num_layers:
        fields["layer_is_sliding"] = tuple(bool(x) for x in pattern)
    else:
        fields["layer_is_sliding"] = tuple((i + 1) % 6 != 0 for i in range(num_layers))
    fields["rope_local"] = RopeConfig(theta=get("rope.freq_base_swa", 10_000.0, kind=float),
                                      dim=fields["rope"].dim)
    fields["embedding_scale"] = fields["hidden_size"] ** 0.5


GEMMA3 = Family("gemma3", Recipe(sandwich=True, qk_norm=True, activation="gelu_tanh"), configure)

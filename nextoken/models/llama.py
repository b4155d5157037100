"""The Llama family (SmolLM2, Llama 2 and 3, Mistral): pre-norm blocks of RMSNorm, RoPE grouped-query attention and a
SwiGLU MLP, with residuals around both; embeddings tied to the LM head when the file has no `output.weight`.

llama.cpp's converter permutes the rows of Q and K so that its pairwise RoPE equals the original half-split one: the
file's rows are in the interleaved layout. Llama 3's frequency scaling comes as the `rope_freqs` tensor, and a
Mistral-style sliding window as `attention.sliding_window` (models/config.py reads both for any family).
"""

from __future__ import annotations

from nextoken.models.recipe import Family, Recipe

LLAMA = Family("llama", Recipe(gguf_rope_rows="interleaved"))

"""Model definitions: the math of one forward pass, nothing else (no requests, no scheduling, no file formats).

One model class, `CausalLM` (base.py), built from its family's recipe (recipe.py); each family is one short file
declaring it (llama.py, gemma3.py, qwen2.py, qwen3.py, phi3.py, gpt2.py), registered in config.py's `FAMILIES`
under the `general.architecture` its GGUF files carry.
"""

from __future__ import annotations

from nextoken.models.base import CausalLM
from nextoken.models.config import FAMILIES, ModelConfig

__all__ = ["FAMILIES", "CausalLM", "ModelConfig"]

"""Model definitions: the math of one forward pass, nothing else (no requests, no scheduling, no file formats).

`ARCHITECTURES` maps a file's `general.architecture` to its class; engine/model_loader.py builds one from a GGUF file.
"""

from __future__ import annotations

from nextoken.models.base import CausalLM
from nextoken.models.gemma3 import Gemma3ForCausalLM
from nextoken.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}

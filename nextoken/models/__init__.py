"""Model definitions: the math of one forward pass, nothing else (no requests, no scheduling).

`ARCHITECTURES` maps a file's `general.architecture` to its class; `load_model` builds one from a GGUF file.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nextoken.errors import ModelLoadError
from nextoken.loader.gguf import GGUFFile
from nextoken.models.base import CausalLM
from nextoken.models.config import ModelConfig
from nextoken.models.gemma3 import Gemma3ForCausalLM
from nextoken.models.llama import LlamaForCausalLM

ARCHITECTURES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def load_model(gguf: GGUFFile, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", progress: Callable[[str], None] | None = None,
               quant: str | None = None, quantize_head: bool = False) -> CausalLM:
    cls = ARCHITECTURES.get(config.architecture)
    if cls is None:
        raise ModelLoadError(gguf.path, f"unknown architecture {config.architecture!r}")
    device = torch.device(device)
    with torch.device("meta"):
        model = cls(config)
    model.load_gguf(gguf, dtype=dtype, device=device, progress=progress, quant=quant,
                     quantize_head=quantize_head)
    return model.eval()

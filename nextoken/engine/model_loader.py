"""A model from a GGUF file, in the formats it runs in: built on the meta device (no memory spent on initial values
that are overwritten anyway), its weights attached as the file stores them (loader/weights.py), then each module given
its format by the quantization pass (ops/quantize.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nextoken.loader.gguf import ModelFile
from nextoken.loader.weights import load_weights
from nextoken.models.base import CausalLM
from nextoken.models.config import ModelConfig
from nextoken.ops.quantize import WeightFormats, quantize_model


def load_model(gguf: ModelFile, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", progress: Callable[[str], None] | None = None,
               quant: str | None = None, quantize_head: bool = False) -> CausalLM:
    """The model of `gguf` on `device`, in eval mode: dense projections in `dtype`, or with `quant` ("int4", "int8")
    block-quantized ones; with `quantize_head` the int8 LM head for decode rows (see WeightFormats). `progress` is
    called with each parameter's name as the file's tensors are attached."""
    with torch.device("meta"):
        model = CausalLM(config)
    load_weights(model, gguf, progress)
    quantize_model(model, WeightFormats(dtype, torch.device(device), quant, quantize_head))
    return model.eval()

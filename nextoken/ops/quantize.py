"""The quantization pass: module surgery after loading (gpt-fast's way). Each module the loader left in the file's own
storage (loader/weights.py `FileBacked`) becomes the one it runs as, chosen by `WeightFormats`:

- projections: dense weights in `dtype`, or with `quant` block-quantized ones for decode (`BlockLinear`). int4: 4-bit
  blocks (Q4_0, Q4_1, Q4_K) keep their codes; Q5_0, Q6_K and Q8_0 tensors (llama.cpp's mixes keep some so) become
  int8 blocks exactly; other types are requantized to int8, float files regrouped into 4 bits. int8: int8 blocks
  everywhere (Q5_0, Q6_K, Q8_0 exactly). Projections whose blocks are exactly their weights (EXACT_PANEL_TYPES) are
  not dequantized at all on CPU: the native kernels build their GEMM panels from the blocks, or need none. On CUDA
  no projection keeps a float copy: the blocks go to the device and run in Triton kernels (ops/cuda_blocks.py).
- with `quantize_head`, decode rows go through `Int8GroupHead` (CPU only), and a Q8_0 token table stays in its blocks
  (`BlockEmbedding`): no fp32 copy, and a tied head rescores its candidates from the same blocks.
- everything else (norms, the LM head's weight, a float token table) in fp32.

All on `device`; with `quant` on CPU the fused decoder (ops/fused.py) is built over the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from nextoken.loader.codec import q8_0_codes
from nextoken.loader.weights import FileBacked, FileTensor
from nextoken.ops.fused import FusedDecoder
from nextoken.ops.quant_head import BlockEmbedding, Int8GroupHead
from nextoken.ops.quant_linear import (FLOAT_TYPES, GROUP_SIZE, Q4_TYPES, BlockLinear, BlockWeight, block_only_types,
                                       q4_packed, q4_weight, q8_weight)

if TYPE_CHECKING:
    from nextoken.models.base import CausalLM

_Q = GGMLQuantizationType


@dataclass(frozen=True)
class WeightFormats:
    """What the pass makes of a loaded model's weights (see the module's docstring)."""

    dtype: torch.dtype = torch.float32  # of dense projections: float32 or bfloat16
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    quant: str | None = None  # "int4" | "int8": block-quantized projections
    quantize_head: bool = False  # the int8 LM head for decode rows, over the Q8_0 table's own blocks where it has one

    @property
    def block_kernels(self) -> str:
        """What runs the blocks: "triton" on CUDA (ops/cuda_blocks.py), else "native" (ops/native)."""
        return "triton" if self.device.type == "cuda" else "native"


def quantize_model(model: CausalLM, formats: WeightFormats) -> None:
    """Give every module of `model` still in the file's storage the format it runs in, in place."""
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    assert isinstance(head, FileBacked) and isinstance(model.embed_tokens, FileBacked), \
        "quantize_model takes a model as loader/weights.py leaves it"
    head_file = head.tensors["weight"][0]  # the head's file tensor: the LM head's own, or the tied table's
    table = model.embed_tokens.tensors["weight"][0]
    grouped = model.config.hidden_size % GROUP_SIZE == 0  # int8 groups along the hidden size
    table_in_blocks = formats.quantize_head and table.qtype == _Q.Q8_0 and grouped
    # Projections whose file blocks hold their weights exactly skip the fp32 copy (BlockLinear without `dense`).
    exact_types = block_only_types(formats.quant, formats.block_kernels)
    for name, module in list(model.named_modules()):
        if not isinstance(module, FileBacked):
            continue
        if module is model.embed_tokens and table_in_blocks:
            converted: nn.Module = BlockEmbedding(*table.codes())
        elif name.endswith("_proj"):
            converted = _projection(module, formats, exact_types)
        else:
            converted = _dense(module, torch.float32, formats.device)
        model.set_submodule(name, converted)
    for param in model.parameters():  # the vectors the loader decoded
        if param.device != formats.device:
            param.data = param.data.to(formats.device)
    model.requires_grad_(False)
    if formats.quantize_head and grouped:
        model.quantized_head = _int8_head(model, head_file)
    if formats.quant is not None and formats.block_kernels == "native":
        model.fused = FusedDecoder.build(model)


def _dense(module: FileBacked, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The module the architecture built, its parameters decoded to `dtype` on `device`."""
    for param in module.tensors:
        setattr(module.module, param, nn.Parameter(module.floats(param, dtype).to(device), requires_grad=False))
    return module.module


def _projection(module: FileBacked, formats: WeightFormats, exact_types: tuple[GGMLQuantizationType, ...]
                ) -> nn.Module:
    """A projection in `formats`: a dense Linear, or blocks, with the fp32 weight beside them where the kernels need
    it (parts requantized from it, on the native route; see block_only_types)."""
    files = module.tensors["weight"]
    linear = cast(nn.Linear, module.module)  # a projection: the architecture's Linear
    shape = (linear.out_features, linear.in_features)
    if formats.quant is None or shape[1] % GROUP_SIZE:  # blocks group 32 inputs: other widths stay dense
        return _dense(module, formats.dtype, formats.device)
    weight = None if all(t.qtype in exact_types for t in files) else module.floats()  # fp32, to requantize from
    parts, at = [], 0
    for t in files:
        parts.append(_blocks(t, formats.quant, None if weight is None else weight[at:at + t.shape[0]]))
        at += t.shape[0]
    if formats.block_kernels == "triton":  # every product reads the blocks, on the device
        return BlockLinear([p.to(formats.device) for p in parts], None, shape, kernels="triton")
    dense = None if weight is None else weight.to(device=formats.device, dtype=formats.dtype)
    return BlockLinear(parts, dense, shape)


def _blocks(tensor: FileTensor, quant: str, weight: torch.Tensor | None) -> BlockWeight:
    """One file tensor's rows as `quant` blocks: its own blocks where they hold it exactly, else requantized from its
    fp32 `weight` (rows in the model's order; None only where the blocks are exact)."""
    if quant == "int4" and tensor.qtype in Q4_TYPES:
        return q4_packed(*tensor.codes())
    if quant == "int4" and tensor.qtype in FLOAT_TYPES:
        assert weight is not None
        return q4_weight(*regroup(weight))
    if tensor.qtype in (_Q.Q5_0, _Q.Q6_K, _Q.Q8_0):
        return q8_weight(*tensor.codes())
    assert weight is not None  # only exact types come without their float weight
    return q8_weight(*q8_codes(None, None, weight))


def _int8_head(model: CausalLM, head_file: FileTensor) -> Int8GroupHead:
    """The decode head over int8 blocks: the block table's own when tied to it, the file's Q8_0 blocks (exactly the
    head's values), or blocks requantized from the fp32 head weight, which rescores the candidates."""
    table = model.embed_tokens
    if model.lm_head is None and isinstance(table, BlockEmbedding):
        return Int8GroupHead(table.codes, table.scales)
    if head_file.qtype == _Q.Q8_0:
        codes, scales = head_file.codes()
        return Int8GroupHead(codes, scales)
    return Int8GroupHead(*q8_codes(None, None, model.head_weight), model.head_weight)


def regroup(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weight [rows, cols] -> Q4 (codes, d, m) over blocks of 32 (min/max in 15 steps; d and m rounded to
    fp16, as Q4 keeps them, before the codes are chosen)."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    lo, hi = groups.amin(-1), groups.amax(-1)  # [rows, groups]
    d = ((hi - lo) / 15).clamp(min=1e-7).half().float()
    lo = lo.half().float()
    codes = torch.round((groups - lo[..., None]) / d[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(rows, cols), d, lo


def q8_codes(raw: np.ndarray | None, qtype: GGMLQuantizationType | None, weight: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [rows, cols], fp32 scales [rows, cols / 32]): read from Q8_0 blocks when the tensor is stored
    so, else quantized from `weight` (absmax / 127 per block). Scales are rounded to fp16 (as the kernels keep
    them) before the codes are chosen."""
    rows, cols = weight.shape
    if qtype == _Q.Q8_0 and raw is not None:
        return q8_0_codes(raw, (rows, cols))
    groups = weight.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    # Round the scale up past fp16's half step, so the largest value still fits in 127.
    scales = (groups.abs().amax(-1) / 127 * (1 + 2**-10)).to(torch.float16).float()
    codes = torch.where(scales[..., None] > 0, groups / scales[..., None], 0.0).round().clamp(-127, 127)
    return codes.to(torch.int8).reshape(rows, cols), scales

"""Weight-only int4 projections for decode, swapped in after loading (model files stay float-only).

Decode multiplies one row per sequence by every weight: it is bound by the bytes it reads. `Int4Linear` keeps the
weight as 4-bit codes with a bf16 scale and zero per group of 32 (w = (q - 8) * scale + zero, torch's int4 CPU
kernel layout) and uses torch's fused int4 kernel for up to `FUSED_MAX_ROWS` rows; batches larger than that are
bound by compute instead, where a dense fp32 GEMM wins, so it keeps the fp32 weight for them as well.

GGUF Q4_0 and Q4_1 blocks are groups of 32 with exactly this form, so their codes are taken as they are: the int4
weights equal the file's up to rounding the scales to bf16. Other types are regrouped from their float values
(per group: min/max over 15 steps).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

GROUP_SIZE = 32
# Up to this many rows the fused int4 kernel beats an fp32 GEMM over weights streamed from memory (measured with 30
# layers of SmolLM2's shapes on a 2-core AVX2 machine: 1 row 9.0 vs 28.6 ms, 16 rows 47 vs 65 ms, 64 rows 188 vs
# 129 ms).
FUSED_MAX_ROWS = 16


class Int4Linear(nn.Module):
    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dense: torch.Tensor) -> None:
        """codes [out, in] ints in 0..15; scales, zeros [out, in / 32]; dense [out, in] fp32 for large batches."""
        super().__init__()
        out_features, in_features = codes.shape
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        # [in / 32, out, 2]: the kernel's layout of (scale, zero) per group.
        self.register_buffer("scales_zeros", torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16)
                             .contiguous())
        self.weight = nn.Parameter(dense, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= FUSED_MAX_ROWS:
            out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP_SIZE,
                                                    self.scales_zeros)
            return out.to(x.dtype)
        return F.linear(x, self.weight)


def q4_codes(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes [rows, cols], scales, zeros [rows, cols / 32]) read straight from Q4_0 / Q4_1 blocks, else None.

    Q4_0 block (18 bytes): fp16 d, 16 bytes of nibbles; w = d * (q - 8).
    Q4_1 block (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m = (q - 8) * d + (m + 8 d).
    Element j of a block is the low nibble of byte j, element j + 16 the high nibble.
    """
    if qtype not in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
        return None
    rows, cols = shape
    head = 2 if qtype == GGMLQuantizationType.Q4_0 else 4
    blocks = np.asarray(raw).reshape(rows, cols // GROUP_SIZE, head + 16)  # [rows, groups, bytes]
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, groups]
    nibbles = blocks[..., head:]
    codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, cols)
    if qtype == GGMLQuantizationType.Q4_0:
        zeros = np.zeros_like(d)
    else:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zeros = m + 8 * d
    return torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(zeros)


def regroup(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weight [rows, cols] -> int4 (codes, scales, zeros) over groups of 32 (min/max in 15 steps)."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    lo, hi = groups.amin(-1), groups.amax(-1)  # [rows, groups]
    scales = ((hi - lo) / 15).clamp(min=1e-10)
    codes = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(rows, cols), scales, lo + 8 * scales

"""Weight-only int4 and int8 projections for decode, swapped in after loading (model files stay float-only).

Decode multiplies one row per sequence by every weight: it is bound by the bytes it reads. `Int4Linear` keeps the
weight as 4-bit codes with a bf16 scale and zero per group of 32 (w = (q - 8) * scale + zero, torch's int4 CPU
kernel layout); `Int8Linear` as int8 codes with one scale per output channel (w = q * scale). Both use torch's fused
kernels (bf16 activations in, fp32 accumulation) for up to `FUSED_MAX_ROWS` rows; batches larger than that are bound
by compute instead, where a dense fp32 GEMM wins, so they keep the fp32 weight for them as well.

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
# Up to this many rows the fused kernels beat an fp32 GEMM over weights streamed from memory (measured with 30
# layers of SmolLM2's shapes on a 2-core AVX2 machine: int4 1 row 9.0 vs 28.6 ms, 16 rows 47 vs 65 ms, 64 rows 188
# vs 129 ms; int8 1 row 13 ms, 16 rows 72 ms).
FUSED_MAX_ROWS = 16


class _DecodeLinear(nn.Module):
    """A projection with a fused integer kernel for up to FUSED_MAX_ROWS rows and the dense fp32 `weight` above."""

    weight: nn.Parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= FUSED_MAX_ROWS:
            return self.fused(x.to(torch.bfloat16)).to(x.dtype)
        return F.linear(x, self.weight)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(_DecodeLinear):
    """Per-channel symmetric int8: scale = max |w| of the row / 127, codes round(w / scale)."""

    def __init__(self, dense: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = dense.shape
        # The kernel takes bf16 scales: round each up (by more than bf16's half step) so the largest weight still
        # fits in 127, and quantize against the scale as stored.
        scales = (dense.abs().amax(dim=1).clamp(min=1e-12) / 127 * (1 + 2**-8)).to(torch.bfloat16)
        codes = (dense / scales.float()[:, None]).round().clamp(-127, 127)
        self.register_buffer("codes", codes.to(torch.int8))
        self.register_buffer("scales", scales)
        self.weight = nn.Parameter(dense, requires_grad=False)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.codes, self.scales)


class Int4Linear(_DecodeLinear):
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

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP_SIZE, self.scales_zeros)


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


class Int8GroupHead(nn.Module):
    """The LM head for decode: a cheap pass over the whole vocabulary, then the best candidates rescored exactly.

    The head weight [vocab, hidden] is held as int8 codes with a scale per 32 values (GGML's Q8_0: taken from the
    file's blocks where the head is Q8_0, else quantized with absmax / 127). No torch CPU kernel takes group-wise
    int8, but an int8 code is two 4-bit ones, c = 16 * hi + lo (hi in -8..7, lo in 0..15), so the head runs as two
    calls of the fused int4 kernel: a quarter of fp32's bytes. That kernel rounds activations and outputs to bf16
    (about 0.05 on a logit of 20), enough to swap near-tied tokens; so the `num_exact` highest logits of each row are
    recomputed in fp32 from the float weight (which the embedding keeps anyway when tied). Greedy picks the same
    token as the fp32 head unless the best one is not among those candidates; the tail of the distribution keeps
    the bf16-level error.
    """

    def __init__(self, weight: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, num_exact: int = 32) -> None:
        """weight: the fp32 head [vocab, hidden]; codes [vocab, hidden] int8 and scales [vocab, hidden / 32]."""
        super().__init__()
        self.weight = weight  # shared with the embedding when tied: not a parameter of this module
        self.num_exact = num_exact
        self.vocab_size = codes.shape[0]
        pad = -self.vocab_size % 16  # the kernel packs output rows in sixteens
        codes = F.pad(codes.to(torch.int32), (0, 0, 0, pad))
        scales = F.pad(scales.float(), (0, 0, 0, pad))
        hi, lo = codes >> 4, codes & 0x0F  # arithmetic shift: hi in -8..7
        zeros = torch.zeros_like(scales)
        # int4 kernel: w = (c - 8) * scale + zero. hi part: codes hi + 8, scale 16 d. lo part: codes lo, scale d,
        # zero 8 d.
        self.register_buffer("hi", torch._convert_weight_to_int4pack_for_cpu(hi + 8, 1))
        self.register_buffer("lo", torch._convert_weight_to_int4pack_for_cpu(lo, 1))
        self.register_buffer("hi_scales", _scales_zeros(16 * scales, zeros))
        self.register_buffer("lo_scales", _scales_zeros(scales, 8 * scales))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] fp32 -> fp32 logits [rows, vocab]."""
        if x.shape[0] > FUSED_MAX_ROWS:
            return F.linear(x, self.weight)
        xb = x.to(torch.bfloat16)
        logits = torch._weight_int4pack_mm_for_cpu(xb, self.hi, GROUP_SIZE, self.hi_scales).float()
        logits += torch._weight_int4pack_mm_for_cpu(xb, self.lo, GROUP_SIZE, self.lo_scales)
        logits = logits[:, :self.vocab_size]
        candidates = logits.topk(min(self.num_exact, logits.shape[1]), dim=-1).indices  # [rows, k]
        exact = torch.bmm(self.weight[candidates], x.unsqueeze(-1)).squeeze(-1)  # [rows, k, hidden] @ [rows, hidden]
        return logits.scatter_(1, candidates, exact)


def _scales_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[rows, groups] each -> the int4 kernel's [groups, rows, 2] bf16 layout."""
    return torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()


def q8_codes(raw: np.ndarray | None, qtype: GGMLQuantizationType | None, weight: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [rows, cols], fp32 scales [rows, cols / 32]): read from Q8_0 blocks (fp16 d, 32 int8 codes;
    w = d * q) when the tensor is stored so, else quantized from `weight` (absmax / 127 per group of 32)."""
    rows, cols = weight.shape
    if qtype == GGMLQuantizationType.Q8_0 and raw is not None:
        blocks = np.asarray(raw).reshape(rows, cols // GROUP_SIZE, 2 + GROUP_SIZE)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        codes = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
        return torch.from_numpy(codes), torch.from_numpy(d)
    groups = weight.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    scales = groups.abs().amax(-1) / 127
    codes = torch.where(scales[..., None] > 0, groups / scales[..., None], 0.0).round().clamp(-127, 127)
    return codes.to(torch.int8).reshape(rows, cols), scales

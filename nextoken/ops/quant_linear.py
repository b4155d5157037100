"""Block-quantized modules for decode: projections, the LM head, the token table. The quantization pass swaps them in
after loading (ops/quantize.py); the file's blocks reach them through the codec (loader/codec.py).

Decode multiplies one row per sequence by every weight: it is bound by the bytes it reads. `BlockLinear` holds a
projection in GGML-style blocks along its input (see `BlockWeight`): 4-bit codes with a scale and offset per 32
(GGUF Q4_0, Q4_1 and Q4_K blocks all have this form, Q4_K per 32-value sub-block, so their codes are taken as they
are; float weights are regrouped, min/max over 15 steps), or int8 codes with a scale per 32 (Q8_0's form; other
weights are quantized with absmax / 127) or per 16 (Q6_K's blocks, exactly). A fused projection may mix them: the
Q4_K_M files keep some V and down projections in 6 bits.

The products run in nextoken's own kernels (`ops/native`), which quantize activations on the fly to two levels of
codes per 32 values (int16 codes, then int8 codes of what they leave: each value within 2^-24 of its block's
largest), which keeps the models' outputs as close to the fp32 reference as fp32 weights are (docs/exactness.md).
Batches of more than `NATIVE_MAX_ROWS` rows are bound by compute instead, where a GEMM over the blocks wins: byte
multiply-adds on those codes with AVX-512 VNNI, else fp32 multiply-adds over panels each thread dequantizes from the
blocks as it goes (no fp32 copy is kept). Where the native kernels cannot be built, all-Q4 projections run on
torch's fused int4 kernel (bf16 activations; 4-bit codes with a bf16 scale and zero per 32) and others on the dense
weight, with torch's GEMM for large batches.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from nextoken.loader.codec import pack_nibbles, unpack_nibbles
from nextoken.ops import native

GROUP_SIZE = 32
# Rows up to which the block kernels beat the GEMM without AVX-512 VNNI: the fp32 one, each thread dequantizing 16
# weight rows at a time into a panel of its own (nt_block_gemm), whose tiles of 6 rows cost the same from 1 to 6 rows.
# SmolLM2's 30 layers' projections on 2 Zen 3 cores, ms, block kernels vs GEMM (medians of 7 alternating rounds): 3
# rows 24.4 vs 33.8, 4 rows 30.8 vs 34.7, 5 rows 35.8 vs 34.2, 8 rows 52.4-63.3 vs 40.9-52.8, 16 rows 99 vs 53.
# Fused decode steps use the same threshold.
NATIVE_MAX_ROWS = 4
# With AVX-512 VNNI the few-row kernel has the int16 GEMM's bits from 2 rows on (block_rows16 in ops/native/gemm.c):
# the two cross near 16-20 rows (SmolLM2's 30 layers' projections on 2 Zen 5 cores, ms, rows kernel vs GEMM: 8 rows
# 10.0 vs 13.8, 12 rows 13.9 vs 16.3, 16 rows 17.3 vs 20.3, 20 rows 27.3 vs 25.4; Gemma 3's 16 rows 16.4 vs 18.2).
VNNI_MAX_ROWS = 16
# Over the LM head's own blocks the native GEMM (16 head rows dequantized at a time) keeps no fp32 copy. Without
# AVX-512 VNNI it overtakes the Q8 kernel from HEAD_GEMM_ROWS rows (SmolLM2's 49152 x 576 head on 2 Zen 3 cores, ms:
# 4 rows 6.5 vs 6.9, 6 rows 9.1 vs 6.9, 8 rows 12.9 vs 9.6, 12 rows 19.2 vs 9.8). With AVX-512 VNNI the two give the
# same bits from 2 rows on and cross near 20 rows (2 Zen 5 cores, SmolLM2's head 16 rows 3.8 vs 4.0, 20 rows 4.6 vs
# 4.4, 32 rows 7.3 vs 6.4; Gemma 3's 16 rows 23.1 vs 26.1, 24 rows 32.2 vs 31.5).
HEAD_NATIVE_MAX_ROWS = 128
HEAD_GEMM_ROWS = 5
VNNI_HEAD_GEMM_ROWS = 20

# The same for torch's int4 kernel (int4 1 row 9.0 vs fp32 28.6 ms, 16 rows 47 vs 65 ms, 64 rows 188 vs 129 ms).
TORCH_INT4_MAX_ROWS = 16


def native_max_rows(lib: ctypes.CDLL | None) -> int:
    """Rows up to which a projection's products take the block kernels on this build, the GEMM beyond."""
    return VNNI_MAX_ROWS if lib is not None and lib.nt_has_vnni512() else NATIVE_MAX_ROWS


def head_gemm_rows(lib: ctypes.CDLL | None) -> int:
    """Rows from which the head over the file's blocks takes the native GEMM on this build."""
    return VNNI_HEAD_GEMM_ROWS if lib is not None and lib.nt_has_vnni512() else HEAD_GEMM_ROWS

# Activations meet the blocks as two levels of codes per 32 values by default: results within fp32 rounding of
# fp32 over the file's weights. `activations="int8"` takes one level of int8 codes instead, its outlier columns in
# fp32 (nt_block_gemm8): faster where compute bounds the products. With the columns fixed by calibration
# (`outliers`, ops/calibration.py) every product of any number of rows takes it, so that a row's numbers do not
# depend on its batch; without them, products of many rows choose their own over their rows.

_Q = GGMLQuantizationType
Q4_TYPES = (_Q.Q4_0, _Q.Q4_1, _Q.Q4_K)
FLOAT_TYPES = (_Q.F32, _Q.F16, _Q.BF16)
EXACT_BLOCK_TYPES = (*Q4_TYPES, _Q.Q5_0, _Q.Q6_K, _Q.Q8_0)  # held without requantizing (Q4 or int8 blocks)
# Held as exactly the file's weights, scales included: their fp32 weight comes from the blocks themselves
# (BlockLinear without `dense`).
EXACT_PANEL_TYPES = {"int4": (_Q.Q4_0, _Q.Q4_1, _Q.Q4_K, _Q.Q5_0, _Q.Q6_K, _Q.Q8_0),
                     "int8": (_Q.Q5_0, _Q.Q6_K, _Q.Q8_0)}


Q4, Q4_F32, Q8, Q8_HALVES = native.Format.Q4, native.Format.Q4_F32, native.Format.Q8, native.Format.Q8_HALVES
NIBBLE_KINDS = (Q4, Q4_F32)


@dataclass
class BlockWeight:
    """Rows of a projection in one block format:
    Q4: qs uint8 [rows, cols / 2] nibbles, d and m fp16 [rows, cols / 32]; w = d * q + m.
    Q4_F32: as Q4, d and m fp32 (Q4_K's sub-block scales d * sc and dmin * mn need up to 17 bits).
    Q8: qs int8 [rows, cols], d fp16 [rows, cols / 32]; w = d * q.
    Q8_HALVES: qs int8 [rows, cols], d fp32 [rows, cols / 16]; w = d * q (holds Q6_K blocks exactly)."""

    kind: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.qs.shape[0]

    @property
    def bytes_per_weight(self) -> float:
        cols = self.qs.shape[1] * (2 if self.kind in NIBBLE_KINDS else 1)
        extra = 0 if self.m is None else self.m.nbytes
        return (self.qs.nbytes + self.d.nbytes + extra) / (self.rows * cols)

    def to(self, device: torch.device | str) -> BlockWeight:
        """The same blocks on `device`."""
        m = None if self.m is None else self.m.to(device)
        return BlockWeight(self.kind, self.qs.to(device), self.d.to(device), m)


def q4_weight(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> BlockWeight:
    """From codes [rows, cols] 0..15 and d, m [rows, cols / 32] (w = d * q + m): see `q4_packed`."""
    return q4_packed(pack_nibbles(codes), d, m)


def q4_packed(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> BlockWeight:
    """From codes two a byte in GGML's nibble order, [rows, cols / 2] contiguous (loader/codec.py pack_nibbles), and
    d, m [rows, cols / 32] (w = d * q + m): scales in fp16 where fp16 holds them exactly (Q4_0, Q4_1, regrouped
    weights), else in fp32 (Q4_K's)."""
    d16, m16 = d.to(torch.float16), m.to(torch.float16)
    if torch.equal(d16.float(), d.float()) and torch.equal(m16.float(), m.float()):
        return BlockWeight(Q4, qs, d16.contiguous(), m16.contiguous())
    return BlockWeight(Q4_F32, qs, d.float().contiguous(), m.float().contiguous())


def q8_weight(codes: torch.Tensor, d: torch.Tensor) -> BlockWeight:
    """From int8 codes [rows, cols] and d [rows, cols / 32], or [rows, cols / 16] (kept fp32: exact for Q6_K)."""
    halves = d.shape[1] * 16 == codes.shape[1]
    return BlockWeight(Q8_HALVES if halves else Q8, codes.to(torch.int8).contiguous(),
                       d.to(torch.float32 if halves else torch.float16).contiguous())


def _merge(parts: list[BlockWeight]) -> list[BlockWeight]:
    """Neighbouring parts of one format become one (fewer kernel calls)."""
    merged = [parts[0]]
    for part in parts[1:]:
        last = merged[-1]
        if part.kind == last.kind:
            merged[-1] = BlockWeight(last.kind, torch.cat((last.qs, part.qs)), torch.cat((last.d, part.d)),
                                     None if last.m is None else torch.cat((last.m, part.m)))  # type: ignore[arg-type]
        else:
            merged.append(part)
    return merged


def block_only_types(quant: str | None, kernels: str = "native") -> tuple[GGMLQuantizationType, ...]:
    """The file types whose projections load as blocks alone, never dequantized to an fp32 copy: those the blocks
    hold exactly (EXACT_PANEL_TYPES), where the kernels need no float weight: the native ones build their GEMM panels
    from the blocks (or with AVX-512 VNNI need none), Triton's read the blocks in every product. Without the native
    kernels, none (torch's GEMM takes the float weight)."""
    if kernels == "native" and native.library() is None:
        return ()
    return EXACT_PANEL_TYPES.get(quant or "", ())


class BlockLinear(nn.Module):
    """A projection held as block-quantized parts (stacked output rows, each in its own format). Up to `max_rows`
    rows take the block kernels; larger batches, with the native kernels, the GEMM over the blocks (int16 with
    AVX-512 VNNI, else fp32 over panels each thread dequantizes as it goes), and without the native kernels torch's
    GEMM over `dense`. No fp32 copy of the weight is kept for the GEMM: on AVX2 the GEMM over the blocks was as fast
    as one over panels packed at load (2 Zen 3 cores, the time of a 512-token prefill 0.999x and 1.05x in two runs,
    decode of 8 / 16 / 64 sequences 1.02-1.10x / 1.01-1.10x / 1.00-1.03x the tokens a second for SmolLM2; Gemma 3, one
    run, 1.01x and 0.93x / 0.97x / 1.00x), and `LLM()`'s peak memory fell without them (SmolLM2 977 -> 574 MB, Gemma
    3 1,647 -> 1,263 MB). Every product meets the blocks' values, so a prompt's prefill and its decode steps meet the
    same weight.

    `dense` is the fp32 weight [out, in], needed only without the native kernels (torch's GEMM); None where the
    parts hold the weight exactly (the file's own blocks, see EXACT_PANEL_TYPES; `shape` gives its size); `weight`
    dequantizes the blocks when asked. With `kernels="triton"` (CUDA) every product runs in ops/cuda_blocks.py's
    kernels over the parts on the device, and no dense weight is kept."""

    # torch's int4 kernel's route (no native kernels): the codes packed for it and their (scale, zero) pairs.
    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, parts: list[BlockWeight], dense: torch.Tensor | None,
                 shape: tuple[int, int] | None = None, kernels: str = "native") -> None:
        super().__init__()
        if dense is None and shape is None:
            raise ValueError("a projection without its fp32 weight needs its shape")
        self.out_features, self.in_features = dense.shape if dense is not None else shape  # type: ignore[misc]
        if sum(p.rows for p in parts) != self.out_features:
            raise ValueError("block parts do not add up to the projection's rows")
        self.parts = _merge(parts)
        # "triton": every product in ops/cuda_blocks.py's kernel, on the parts' device (CUDA; on CPU under Triton's
        # interpreter, for tests); no float copy of the weight.
        self.kernels = kernels
        # How activations meet the blocks in the GEMM over them (products of more than max_rows rows):
        # "int16" codes per 32 values, or "int8" ones (faster, less precise; see nt_block_gemm8).
        self.activations = "int16"
        # Under "int8", the outlier columns fixed by a calibration pass (int32, ascending; ops/calibration.py): every
        # product then takes the int8 GEMM whatever its rows, so that a row's numbers do not depend on its batch.
        self.outliers: torch.Tensor | None = None
        self.lib = native.library() if kernels == "native" else None
        if kernels == "triton":
            from nextoken.ops import cuda_blocks  # noqa: PLC0415 - imports Triton, which CPU runs never need

            self.triton = cuda_blocks
            if not cuda_blocks.available():
                raise ValueError("the block formats on CUDA need Triton")
            self.max_rows = 0
            dense = None
        elif dense is None and (self.lib is None or len(self.parts) > native.MAX_PARTS):
            raise ValueError("a projection without its fp32 weight needs the native kernels")
        elif self.lib is not None and len(self.parts) <= native.MAX_PARTS:
            self.max_rows = native_max_rows(self.lib)
            dense = None
        elif all(p.kind in NIBBLE_KINDS for p in self.parts):  # torch's int4 kernel (bf16 activations)
            self.lib = None
            self.max_rows = TORCH_INT4_MAX_ROWS
            codes = torch.cat([unpack_nibbles(p.qs) for p in self.parts])
            d = torch.cat([p.d for p in self.parts]).float()
            m = torch.cat([p.m for p in self.parts if p.m is not None]).float()
            self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
            # torch's form w = (q - 8) * scale + zero, as [in / 32, out, 2] pairs (scale, zero).
            self.register_buffer("scales_zeros", int4pack_scales(d, m + 8 * d))
        else:
            self.lib = None
            self.max_rows = 0  # no kernel for these formats here: the dense weight
        self.dense = None if dense is None else nn.Parameter(dense, requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The fp32 weight [out, in]: the fp32 copy, or dequantized from the blocks (through the GEMM's panels)."""
        if self.dense is not None:
            return self.dense
        if self.kernels == "triton":
            return torch.cat([self.triton.dequantize(p.kind, p.qs, p.d, p.m) for p in self.parts])
        assert self.lib is not None  # without a dense weight the native kernels hold the blocks (__init__)
        panels = native.pack_blocks(self.lib, [(p.kind, p.qs, p.d, p.m) for p in self.parts], self.out_features,
                                    self.in_features)
        return native.unpack(panels, self.out_features, self.in_features)

    @property
    def kinds(self) -> set[int]:
        return {p.kind for p in self.parts}

    @property
    def bytes_per_weight(self) -> float:
        """What the block path reads per weight, scales included."""
        return sum(p.bytes_per_weight * p.rows for p in self.parts) / self.out_features

    @property
    def fixed_int8(self) -> bool:
        """Whether every product takes the int8 GEMM with fixed outlier columns (see `outliers`)."""
        return self.activations == "int8" and self.outliers is not None and self.lib is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels == "triton":
            return self._triton(x)
        gemm = x.shape[0] > self.max_rows or self.fixed_int8
        if self.lib is None:
            if gemm:
                assert self.dense is not None  # kept where the native kernels are not (__init__)
                return F.linear(x, self.dense)
            out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scales_zeros)
            return out.to(x.dtype)
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        at = 0
        for p in self.parts:
            native.block_matmul(self.lib, p.kind, x, p.qs, p.d, p.m, out[:, at:at + p.rows], gemm=gemm,
                                int8_activations=self.activations == "int8", outliers=self.outliers)
            at += p.rows
        return out

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        at = 0
        for p in self.parts:
            self.triton.block_matmul(x, p.kind, p.qs, p.d, p.m, out[:, at:at + p.rows])
            at += p.rows
        return out


def int4pack_scales(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[rows, groups] each -> the int4 kernel's [groups, rows, 2] bf16 layout."""
    return torch.stack((scales.t(), zeros.t()), dim=-1).to(torch.bfloat16).contiguous()

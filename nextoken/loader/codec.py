"""GGUF's block formats, in one place: each ggml type's blocks unpacked to integer codes and per-group factors, from
which come both the floats (`dequantize`) and the codes the block kernels hold as they are (`q4_codes` / `q4_nibbles`,
`q5_codes`, `q6_codes`, `q8_0_codes`; GGML's nibble order: `pack_nibbles`, `unpack_nibbles`).

Invariants: floats are bit-exact to ggml's reference dequantization (same float32 order of operations: the code
times its scale, then the offset added), and codes with their factors give exactly those floats; the input bytes are
never written (read-only memmaps are wrapped without copying) and no result aliases them. Floats are decoded a chunk
at a time, which bounds the temporaries.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from nextoken.errors import ModelLoadError
from nextoken.ops import native

_Q = GGMLQuantizationType
# An unpacker turns blocks [nb, type_size] uint8 into (codes [nb, block_size] int8 or uint8, scales [nb, groups] fp32,
# offsets [nb, groups] fp32 or None): element j of group g is scale_g * code_j (+ offset_g), in that order.
Unpacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
_Unpacker = Callable[[torch.Tensor], Unpacked]

_CHUNK_ELEMS = 1 << 20  # output elements per chunk (4 MiB of float32): bigger chunks pay less per-op overhead
GROUP = 32  # values per group of every 4-, 5- and 8-bit block (a K-quant's sub-block)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte `offset` of every block, as float32 of shape (nb, 1)."""
    return blocks[:, offset : offset + 2].view(torch.float16).float()  # needs an even storage offset


# Widest integer view first: fewer, longer elements make the strided nibble/bit ops much cheaper.
_WIDE = ((torch.int64, 0x0F0F0F0F0F0F0F0F), (torch.int32, 0x0F0F0F0F), (torch.int16, 0x0F0F), (torch.uint8, 0x0F))


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(..., n) uint8 -> (..., 2, n) uint8: the low nibbles, then the high nibbles."""
    out = torch.empty((*qs.shape[:-1], 2, qs.shape[-1]), dtype=torch.uint8)
    for wide, mask in _WIDE:
        try:
            x, o = qs.view(wide), out.view(wide)
        except RuntimeError:  # strides or offset not a multiple of the wider size
            continue
        torch.bitwise_and(x, mask, out=o[..., 0, :])
        torch.bitwise_and(x >> 4, mask, out=o[..., 1, :])  # the mask also drops sign-extended bits
        break
    return out


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """(nb, 4) uint8, a 32-bit mask -> (nb, 32) uint8 holding bit i of the mask at bit 4 of byte i.

    Each nibble n is spread over the 4 bytes of an int32 by n * 0x02040810 (bit j lands on bit 8j + 4, no
    carries since n < 16); the byte order of that int32 makes this little-endian only, like gguf itself.
    """
    x = qh.int()
    spread = torch.stack([x & 0x0F, x >> 4], dim=2).mul_(0x02040810).bitwise_and_(0x10101010)  # (nb, 4, 2)
    return spread.view(torch.uint8).view(-1, 32)


def _q8_0(blocks: torch.Tensor) -> Unpacked:
    # 34 bytes: d f16 | qs int8[32];  x = d * q  (the codes: a view of the blocks)
    return blocks[:, 2:].view(torch.int8), _f16(blocks, 0), None


def _q4_0(blocks: torch.Tensor) -> Unpacked:
    # 18 bytes: d f16 | qs[16] (x[j] = low nibble of qs[j], x[j+16] = high nibble);  x = d * (q - 8)
    q = _nibbles(blocks[:, 2:]).view(torch.int8).sub_(8)  # (nb, 2, 16)
    return q.view(-1, 32), _f16(blocks, 0), None


def _q4_1(blocks: torch.Tensor) -> Unpacked:
    # 20 bytes: d f16 | m f16 | qs[16] (nibbles as Q4_0);  x = d * q + m
    return _nibbles(blocks[:, 4:]).view(-1, 32), _f16(blocks, 0), _f16(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> Unpacked:
    # 22 bytes: d f16 | qh u32 (bit j = 5th bit of x[j]) | qs[16] (nibbles as Q4_0);  x = d * (q - 16)
    q = _nibbles(blocks[:, 6:]).view(-1, 32)
    q.bitwise_or_(_bits32(blocks[:, 2:6])).view(torch.int8).sub_(16)
    return q.view(torch.int8), _f16(blocks, 0), None


def _q5_1(blocks: torch.Tensor) -> Unpacked:
    # 24 bytes: d f16 | m f16 | qh u32 | qs[16] (as Q5_0);  x = d * q + m
    q = _nibbles(blocks[:, 8:]).view(-1, 32)
    return q.bitwise_or_(_bits32(blocks[:, 4:8])), _f16(blocks, 0), _f16(blocks, 2)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K scales: 12 bytes holding eight 6-bit scales and eight 6-bit mins -> two (nb, 8) uint8.

    Bytes 0-3 hold scale 0-3 (low 6 bits) and the top 2 bits of scale 4-7; bytes 4-7 the same for the
    mins; bytes 8-11 hold the low 4 bits of scale 4-7 (low nibble) and of min 4-7 (high nibble).
    """
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], dim=1)
    mn = torch.cat([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], dim=1)
    return sc, mn


def _k_factors(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K per-sub-block scale d*sc and offset -dmin*m as float32 (nb, 8): both products exact in fp32, and
    adding -y is subtracting y, bit for bit."""
    sc, mn = _k_scale_min(blocks[:, 4:16])
    return _f16(blocks, 0) * sc.float(), (_f16(blocks, 2) * mn.float()).neg_()


def _q4_k(blocks: torch.Tensor) -> Unpacked:
    # 144 bytes: d f16 | dmin f16 | scales[12] | qs[128] as 4 x 32 bytes; chunk j's low nibbles are
    # sub-block 2j, its high nibbles sub-block 2j+1 (8 sub-blocks of 32);  x = d*sc[s] * q - dmin*m[s]
    nb = blocks.shape[0]
    q = _nibbles(blocks[:, 16:].view(nb, 4, 32))  # (nb, 4, 2, 32)
    return (q.view(nb, 256), *_k_factors(blocks))


_SHIFT8 = torch.arange(8, dtype=torch.int32)[:, None]  # (8, 1)


def _q5_k(blocks: torch.Tensor) -> Unpacked:
    # 176 bytes: d f16 | dmin f16 | scales[12] | qh[32] | qs[128] (as Q4_K); the 5th bit of sub-block
    # s, element l is bit s of qh[l];  x = d*sc[s] * q - dmin*m[s]
    nb = blocks.shape[0]
    q = _nibbles(blocks[:, 48:].view(nb, 4, 32)).view(nb, 8, 32)
    qh = blocks[:, 16:48].view(torch.int32).view(nb, 1, 8)  # 4 bytes l at a time; shifts stay inside bytes
    hb = ((qh >> _SHIFT8) & 0x01010101) << 4  # (nb, 8, 8) int32 = (nb, 8, 32) bytes
    q.bitwise_or_(hb.view(torch.uint8).view(nb, 8, 32))
    return (q.view(nb, 256), *_k_factors(blocks))


_SHIFT_Q6 = torch.tensor([0, 2, 4, 6], dtype=torch.int16)[:, None]  # (4, 1)


def _q6_k(blocks: torch.Tensor) -> Unpacked:
    # 210 bytes: ql[128] | qh[64] | scales int8[16] | d f16, in two halves of 128 values. Half n, group g
    # (of 4 x 32): low 4 bits are the low (g < 2) or high (g >= 2) nibbles of ql[64n + 32(g%2) + l], top
    # 2 bits are bits 2g, 2g+1 of qh[32n + l]; sub-block k of 16 uses scales[k];  x = d*sc[k] * (q - 32)
    nb = blocks.shape[0]
    q = _nibbles(blocks[:, :128].view(nb, 2, 64)).view(nb, 2, 4, 32)  # (nb, half, g, l)
    qh = blocks[:, 128:192].view(torch.int16).view(nb, 2, 1, 16)  # 2 bytes l at a time
    hb = ((qh >> _SHIFT_Q6) & 0x0303) << 4  # (nb, 2, 4, 16) int16 = (nb, half, g, l) bytes
    q.bitwise_or_(hb.view(torch.uint8).view(nb, 2, 4, 32)).view(torch.int8).sub_(32)
    sc = blocks[:, 192:208].view(torch.int8).float()
    return q.view(torch.int8).view(nb, 256), _f16(blocks, 208) * sc, None  # d * sc: exact in fp32


_UNPACKERS: dict[GGMLQuantizationType, _Unpacker] = {
    _Q.Q8_0: _q8_0,
    _Q.Q4_0: _q4_0,
    _Q.Q4_1: _q4_1,
    _Q.Q5_0: _q5_0,
    _Q.Q5_1: _q5_1,
    _Q.Q4_K: _q4_k,
    _Q.Q5_K: _q5_k,
    _Q.Q6_K: _q6_k,
}
_FLOATS: dict[GGMLQuantizationType, torch.dtype] = {
    _Q.F32: torch.float32,
    _Q.F16: torch.float16,
    _Q.BF16: torch.bfloat16,
}

SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(_FLOATS) | frozenset(_UNPACKERS)


def dequantize_supported(qtype: GGMLQuantizationType | int) -> bool:
    """Whether `dequantize` handles this GGML type."""
    try:
        return _Q(qtype) in SUPPORTED_TYPES
    except ValueError:
        return False


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over `raw`'s bytes, sharing memory where possible (never written to)."""
    if isinstance(raw, torch.Tensor):
        t = raw.detach().cpu().contiguous().reshape(-1)
        return t if t.dtype == torch.uint8 else t.view(torch.uint8)
    arr = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    with warnings.catch_warnings():  # read-only memmap: torch warns, but we only ever read it
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _supported(qtype: GGMLQuantizationType | int, name: str) -> GGMLQuantizationType:
    try:
        qtype = _Q(qtype)
    except ValueError:
        raise ModelLoadError(name, f"unknown GGML tensor type {qtype!r}") from None
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ModelLoadError(name, f"unsupported tensor type {qtype.name} (supported: {supported})")
    return qtype


def check(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType | int, shape: tuple[int, ...],
          name: str = "tensor") -> tuple[GGMLQuantizationType, tuple[int, ...]]:
    """The (type, shape) of one GGUF tensor's bytes, validated: raises ModelLoadError (naming `name`) for an unsupported
    type, a row length that is not a multiple of the block size, or a byte count that does not match the shape."""
    qtype = _supported(qtype, name)
    shape = tuple(int(n) for n in shape)
    if not shape or min(shape) < 0:
        raise ModelLoadError(name, f"invalid tensor shape {shape}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block_size:
        reason = f"row length {shape[-1]} of shape {shape} is not a multiple of the {qtype.name} block size"
        raise ModelLoadError(name, f"{reason} {block_size}")
    n_bytes = raw.nbytes if isinstance(raw, np.ndarray) else raw.numel() * raw.element_size()
    expected = math.prod(shape) // block_size * type_size
    if n_bytes != expected:
        raise ModelLoadError(name, f"{qtype.name} tensor of shape {shape} needs {expected} bytes, got {n_bytes}")
    return qtype, shape


def _bytes(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """`raw` as flat uint8, aligned for the dtype views the unpackers take."""
    data = _as_bytes(raw)
    if data.storage_offset() % 8 or (qtype in _FLOATS and data.data_ptr() % GGML_QUANT_SIZES[qtype][1]):
        data = data.clone()  # dtype views need an aligned storage offset (and floats an aligned start)
    return data


def dequantize(
    raw: np.ndarray | torch.Tensor,
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
    *,
    name: str = "tensor",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode the bytes of one GGUF tensor of numpy-order `shape` (last dim contiguous) into `dtype`, in `out` where
    given (contiguous, of that shape and dtype: rows of a larger tensor, say).

    Raises ModelLoadError (naming `name`) as `check` does.
    """
    qtype = _supported(qtype, name)
    if not dtype.is_floating_point:
        raise ValueError(f"dequantize needs a floating-point dtype, got {dtype}")
    qtype, shape = check(raw, qtype, shape, name)
    data = _bytes(raw, qtype)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    elif out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"dequantize into {tuple(out.shape)} {out.dtype}: needs a contiguous {shape} {dtype}")
    if qtype in _FLOATS:
        out.copy_(data.view(_FLOATS[qtype]).view(shape))
        return out
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_blocks = math.prod(shape) // block_size
    blocks, flat = data.view(n_blocks, type_size), out.view(n_blocks, block_size)
    unpack, step = _UNPACKERS[qtype], max(1, _CHUNK_ELEMS // block_size)
    tmp = None if dtype == torch.float32 else torch.empty(min(step, n_blocks), block_size)
    for start in range(0, n_blocks, step):
        stop = min(start + step, n_blocks)
        codes, scales, offsets = unpack(blocks[start:stop])
        part = flat[start:stop] if tmp is None else tmp[: stop - start]
        groups = part.view(stop - start, scales.shape[1], -1)  # [blocks, groups, values per group]
        groups.copy_(codes.view(groups.shape))
        groups.mul_(scales.unsqueeze(2))
        if offsets is not None:
            groups.add_(offsets.unsqueeze(2))
        if tmp is not None:
            flat[start:stop].copy_(part)
    return out


def _unpack_rows(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A whole 2-D tensor's (codes [rows, cols], scales and offsets [rows, groups])."""
    qtype, (rows, cols) = check(raw, qtype, shape)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = _bytes(raw, qtype).view(-1, type_size)
    codes, scales, offsets = _UNPACKERS[qtype](blocks)
    if codes.untyped_storage().data_ptr() == blocks.untyped_storage().data_ptr():  # Q8_0's: a view of the blocks
        codes = codes.clone(memory_format=torch.contiguous_format)
    groups = cols // block_size * scales.shape[1]
    return (codes.reshape(rows, cols), scales.reshape(rows, groups),
            None if offsets is None else offsets.reshape(rows, groups))


def q4_codes(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes [rows, cols] uint8 0..15, d, m [rows, cols / 32] fp32) with w = d * q + m, read from Q4_0, Q4_1 or
    Q4_K blocks; None for other types. Q4_0's w = d * (q - 8) becomes m = -8 d (exact); Q4_K's sub-blocks of 32 each
    have their own d * sc and -dmin * mn."""
    if qtype not in (_Q.Q4_0, _Q.Q4_1, _Q.Q4_K):
        return None
    codes, d, m = _unpack_rows(raw, qtype, shape)
    if qtype == _Q.Q4_0:
        codes, m = codes.add_(8), -8 * d  # codes: a fresh tensor
    assert m is not None
    return codes.view(torch.uint8), d, m


def q4_nibbles(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """As `q4_codes`, the codes two a byte in GGML's nibble order (`pack_nibbles`): [rows, cols / 2] uint8. Q4_0's and
    Q4_1's blocks hold them so already, and their bytes are copied as they are; Q4_K's runs (a sub-block's codes in
    the low or the high nibbles of 32 bytes) are regrouped."""
    if qtype == _Q.Q4_K:
        unpacked = q4_codes(raw, qtype, shape)
        assert unpacked is not None
        codes, d, m = unpacked
        return pack_nibbles(codes), d, m
    if qtype not in (_Q.Q4_0, _Q.Q4_1):
        return None
    qtype, (rows, cols) = check(raw, qtype, shape)
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = _bytes(raw, qtype).view(-1, type_size)
    qs = torch.empty(rows, cols // 2, dtype=torch.uint8)
    qs.view(-1, GROUP // 2).copy_(blocks[:, type_size - GROUP // 2:])  # after the fp16 d (and m)
    d = _f16(blocks, 0).view(rows, cols // GROUP)
    return qs, d, -8 * d if qtype == _Q.Q4_0 else _f16(blocks, 2).view(rows, cols // GROUP)


def _unpacked_in_c(kind: str, raw: np.ndarray | torch.Tensor, shape: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 codes [rows, cols], fp32 scales [rows, cols / 32]) of Q8_0 or Q5_0 blocks in one pass of the native
    kernels, the GIL released (native.unpack_blocks); None without them (torch takes several)."""
    lib = native.library()
    if lib is None:
        return None
    rows, cols = shape
    codes, d16 = native.unpack_blocks(lib, kind, np.ascontiguousarray(raw).reshape(-1))
    return codes.view(rows, cols), d16.float().view(rows, cols // GROUP)


def _int8_codes(raw: np.ndarray | torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scales, _ = _unpack_rows(raw, qtype, shape)
    return codes.view(torch.int8), scales


def q8_0_codes(raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [rows, cols], fp32 scales [rows, cols / 32]) of Q8_0 blocks (fp16 d, 32 int8 codes; w = d * q)."""
    return _unpacked_in_c("q8_0", raw, shape) or _int8_codes(raw, _Q.Q8_0, shape)  # a 262k-token table: 168 MB


def q5_codes(raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [rows, cols] in -16..15, fp32 scales [rows, cols / 32]) of Q5_0 blocks, exactly: w = d * q."""
    return _unpacked_in_c("q5_0", raw, shape) or _int8_codes(raw, _Q.Q5_0, shape)


def q6_codes(raw: np.ndarray | torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [rows, cols] in -32..31, fp32 scales [rows, cols / 16]) of Q6_K blocks, exactly: w = d * q (a
    sub-block's d * sc is exact in fp32)."""
    return _int8_codes(raw, _Q.Q6_K, shape)


def unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[rows, cols / 2] uint8 in GGML's nibble order (see `pack_nibbles`) -> codes [rows, cols] 0..15."""
    rows = qs.shape[0]
    return _nibbles(qs.reshape(rows, -1, GROUP // 2)).reshape(rows, -1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes 0..15 -> [rows, cols / 2] uint8, GGML's order: byte j of a block holds element j in its
    low nibble and element j + 16 in its high one."""
    rows, cols = codes.shape
    blocks = codes.to(torch.uint8).reshape(rows, cols // GROUP, 2, GROUP // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()

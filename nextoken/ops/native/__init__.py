"""nextoken's own CPU kernels: a C library (nt.h and its units beside this file) compiled for this machine at first
use (build.py) and called through ctypes.

torch's CPU ops cost microseconds each before doing any work, and a decode step is thousands of small ops; its
int4 kernel wants bf16 activations and reads at a fraction of memory bandwidth on AVX2. These kernels do what a
decode step needs in single calls: block-quantized matrix products (Q4 and int8 weights, activations quantized to
int16 blocks on the fly), an fp32 GEMM over weights packed in panels (for batches bound by compute, where it beats
torch's on skinny shapes), RMSNorm fused with the residual add, paged decode attention, gated activations, and every
decoder block of a decode step at once (`decode_layers`, used by ops/fused.py), or the whole step with the token
table and the LM head (`decode_step`).

The library links the OpenMP runtime torch already loaded, so both share one thread pool. Where there is no
compiler, or NEXTOKEN_NATIVE=0, the callers keep torch's kernels: `library()` returns None and says why once in the
log. The ctypes mirrors of nt.h's structs and enums below are checked against the compiler's own layout
(`layout`, tests/unit/test_native_layout.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import TypeGuard

import numpy as np
import torch

from nextoken.ops.native.interface import (ENUMS, ISA, MAX_PARTS, OUTLIER_MAX, Activation, Cache,  # noqa: F401
                                          Format, KVKind, Layer, LayerTime, Matrix, Part, ProfileSlot, Step, _LayoutEntry, layout,
                                          profile_buffer)
from nextoken.ops.native.build import (EMULATED_AVX512_FLAGS, FLAGS, SANITIZE_FLAGS, SOURCES, WARNINGS,  # noqa: F401
                                       build)

logger = logging.getLogger("nextoken.native")


_lib: ctypes.CDLL | None = None
_tried = False

_i64: type[ctypes.c_int64] = ctypes.c_int64
_i32: type[ctypes.c_int] = ctypes.c_int
_f32: type[ctypes.c_float] = ctypes.c_float
_ptr: type[ctypes.c_void_p] = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[type[ctypes._SimpleCData] | None, list[type[ctypes._SimpleCData]]]] = {
    "nt_block_matmul": (_i32, [_i32, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i32]),
    "nt_rms_norm": (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32]),
    "nt_isa": (_i32, []),
    "nt_layout": (_ptr, []),
    "nt_has_avx2": (_i32, []),
    "nt_has_vnni512": (_i32, []),
    "nt_amx": (_i32, [_i32]),
    "nt_release_threads": (None, []),
    "nt_decode_attention": (_i32, [_ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i32,
                                   _i64, _i64, _i64, _i64, _f32, _i64, _i32]),
}


def load(path: os.PathLike) -> ctypes.CDLL:
    torch.ones(2).sum()  # make sure torch's OpenMP runtime is loaded first, so the library binds to it
    lib = ctypes.CDLL(str(path))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they are switched off or cannot be built (logged once)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("NEXTOKEN_NATIVE", "1") == "0":
            logger.info("native kernels switched off (NEXTOKEN_NATIVE=0): using torch's")
        else:
            try:
                _lib = load(build())
                # AMX tiles decided once, here, before any thread runs a product: off unless NEXTOKEN_AMX=1 (the
                # same bits as the VNNI route, which measured the faster on Sapphire Rapids: docs/design-cpu.md)
                _lib.nt_amx(1 if os.environ.get("NEXTOKEN_AMX") == "1" else 0)
            except (RuntimeError, OSError) as exc:
                logger.warning("native kernels unavailable, using torch's: %s", exc)
    return _lib


def _indices(t: torch.Tensor) -> torch.Tensor:
    """An index tensor as the kernels read it through a raw pointer: int64, contiguous (a no-op when it is)."""
    return t.to(torch.int64).contiguous()


def _check(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(-1) != 1:
        raise ValueError(f"native kernels take fp32 CPU rows with unit stride, got {x.dtype} on {x.device}")


# The kernels' block formats (nt_block_matmul): codes' dtype, values per code byte, scales' dtype, values per scale.
BLOCK_FORMATS: dict[int, tuple[torch.dtype, int, torch.dtype, int]] = {
    Format.Q4: (torch.uint8, 2, torch.float16, 32), Format.Q4_F32: (torch.uint8, 2, torch.float32, 32),
    Format.Q8: (torch.int8, 1, torch.float16, 32), Format.Q8_HALVES: (torch.int8, 1, torch.float32, 16)}


def _check_blocks(kind: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, k: int, where: str) -> None:
    """Raise ValueError unless (qs, d, m) are a weight of k inputs in block format `kind`, as the kernels read it
    through raw pointers: contiguous CPU tensors of the format's dtypes and shapes (m for the Q4 formats only)."""
    if kind not in BLOCK_FORMATS:
        raise ValueError(f"{where}: unknown block format {kind}")
    codes, per_byte, scales, group = BLOCK_FORMATS[kind]
    if k <= 0 or k % 32:
        raise ValueError(f"{where}: input size {k} is not a positive multiple of 32")
    n = qs.shape[0] if qs.dim() == 2 else -1
    expect: list[tuple[str, torch.Tensor | None, torch.dtype, tuple[int, int]]] = [
        ("codes", qs, codes, (n, k // per_byte)), ("scales", d, scales, (n, k // group))]
    if per_byte == 2:
        expect.append(("offsets", m, scales, (n, k // group)))
    elif m is not None:
        raise ValueError(f"{where}: format {kind} has no offsets")
    for name, t, dtype, shape in expect:
        if (t is None or t.dtype != dtype or tuple(t.shape) != shape or t.device.type != "cpu"
                or not t.is_contiguous()):
            got = "none" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"
            raise ValueError(f"{where}: format {kind} needs {name} {dtype} {shape}, contiguous on the CPU; got {got}")


def block_matmul(lib: ctypes.CDLL, kind: int, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor,
                 m: torch.Tensor | None, out: torch.Tensor, gemm: bool = False, int8_activations: bool = False,
                 outliers: torch.Tensor | None = None) -> None:
    """out [M, N] (a view with unit column stride) = x [M, K] fp32 @ W^T for a block-quantized W [N, K]:
    kind 4 (qs nibbles [N, K / 2], d and m fp16 [N, K / 32]), 5 (as 4, d and m fp32), 8 (qs int8 [N, K], d fp16
    [N, K / 32]) or 6 (qs int8, d fp32 [N, K / 16]); see nt_block_matmul and BLOCK_FORMATS. gemm: through a GEMM
    instead, for batches bound by compute, with no fp32 copy of the weight (nt_block_gemm); with int8_activations,
    where the CPU has AVX-512 VNNI, the GEMM meets the weights with int8 activation codes instead of int16
    (nt_block_gemm8: faster, less precise); `outliers` (int32, ascending): its outlier columns, fixed, where
    without them each product chooses its own over its rows."""
    _check(x)
    rows, k = x.shape
    _check_blocks(kind, qs, d, m, k, "block_matmul")
    if out.dtype != torch.float32 or out.shape != (rows, qs.shape[0]) or out.stride(-1) != 1:
        raise ValueError(f"block_matmul: out {out.dtype} {tuple(out.shape)} does not fit [{rows}, {qs.shape[0]}] fp32 "
                         "with unit column stride")
    args = (kind, x.data_ptr(), rows, k, x.stride(0), qs.shape[0], qs.data_ptr(), d.data_ptr(),
            None if m is None else m.data_ptr(), out.data_ptr(), out.stride(0), torch.get_num_threads())
    if gemm and int8_activations:
        if outliers is not None and (outliers.dtype != torch.int32 or not outliers.is_contiguous()):
            raise ValueError("block_matmul: outliers must be contiguous int32 columns")
        status = lib.nt_block_gemm8(*args, None if outliers is None else outliers.data_ptr(),
                                    -1 if outliers is None else outliers.numel())
    else:
        status = (lib.nt_block_gemm if gemm else lib.nt_block_matmul)(*args)
    if status:
        raise ValueError(f"block_matmul: input size {k} is not a multiple of 32, outlier columns out of order or "
                         f"more than {OUTLIER_MAX}, or out of memory")


_SIGNATURES["nt_stream_read"] = (ctypes.c_uint64, [_ptr, _ptr, _i64, _i32])


def stream_read(lib: ctypes.CDLL, tensors: list[torch.Tensor]) -> int:
    """The XOR of every 64-bit word of the tensors' bytes (a tail under 8 bytes left out), read once on the kernels'
    threads (nt_stream_read): a pass that does nothing but read, to time against the kernels that read the same."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("stream_read takes contiguous CPU tensors")
    ptrs = (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])
    sizes = (ctypes.c_int64 * len(tensors))(*[t.nbytes for t in tensors])
    return int(lib.nt_stream_read(ptrs, sizes, len(tensors), torch.get_num_threads()))


_SIGNATURES["nt_sgemm"] = (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i32])
_SIGNATURES["nt_sgemm_pack"] = (None, [_ptr, _i64, _i64, _ptr, _i32])
_SIGNATURES["nt_sgemm_packed_size"] = (_i64, [_i64, _i64])
_SIGNATURES["nt_block_gemm"] = _SIGNATURES["nt_block_matmul"]
_SIGNATURES["nt_block_gemm8"] = (_SIGNATURES["nt_block_matmul"][0], [*_SIGNATURES["nt_block_matmul"][1], _ptr, _i64])


PANEL = 16  # output columns per panel of a packed weight (nt_sgemm_pack)


def pack(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """A dense fp32 weight [N, K] as the fp32 GEMM's panels: [ceil(N / 16), K, 16] (zeros past N), flat."""
    weight = weight.float().contiguous()
    n, k = weight.shape
    panels = torch.empty(lib.nt_sgemm_packed_size(n, k))
    lib.nt_sgemm_pack(weight.data_ptr(), n, k, panels.data_ptr(), torch.get_num_threads())
    return panels


_SIGNATURES["nt_sgemm_pack_blocks"] = (_i32, [_i32, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i32])


def pack_blocks(lib: ctypes.CDLL, parts: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]], n: int,
                k: int) -> torch.Tensor:
    """The panels `pack` makes of a weight [n, k] stacked from block-quantized parts (kind, qs, d, m; formats as
    block_matmul takes them, rows in order), dequantized straight into place: no dense fp32 copy is ever made."""
    held = sum(qs.shape[0] for _, qs, _, _ in parts)
    if held != n:
        raise ValueError(f"pack_blocks: parts hold {held} rows, expected {n}")
    for kind, qs, d, m in parts:
        _check_blocks(kind, qs, d, m, k, "pack_blocks")
    panels = torch.empty(lib.nt_sgemm_packed_size(n, k))
    if n % PANEL:  # the last panel's columns past n
        panels[n // PANEL * PANEL * k:] = 0.0
    first = 0
    for kind, qs, d, m in parts:
        if lib.nt_sgemm_pack_blocks(kind, qs.data_ptr(), d.data_ptr(), None if m is None else m.data_ptr(),
                                    qs.shape[0], k, panels.data_ptr(), first, torch.get_num_threads()):
            raise ValueError(f"pack_blocks: format {kind} or input size {k} unsupported, or out of memory")
        first += qs.shape[0]
    return panels


def unpack(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The dense [n, k] weight that `pack` made `panels` from."""
    return panels.view(-1, k, PANEL).transpose(1, 2).reshape(-1, k)[:n]


def sgemm(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """out [M, n] (a view with unit column stride) = x [M, K] fp32 @ W^T, for W [n, K] as `pack` left it."""
    _check(x)
    rows, k = x.shape
    if panels.numel() != lib.nt_sgemm_packed_size(n, k) or out.shape != (rows, n) or out.stride(-1) != 1:
        raise ValueError(f"sgemm: panels of {panels.numel()} floats or out {tuple(out.shape)} do not fit "
                         f"x {tuple(x.shape)} and {n} outputs")
    lib.nt_sgemm(x.data_ptr(), rows, k, x.stride(0), panels.data_ptr(), n, out.data_ptr(), out.stride(0),
                 torch.get_num_threads())


_SIGNATURES["nt_matmul_rowmajor"] = (None, [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i32])


def repeatable(lib: ctypes.CDLL | None, x: torch.Tensor, weight: torch.Tensor) -> TypeGuard[ctypes.CDLL]:
    """Whether x @ weight^T runs on matmul_rowmajor: fp32 CPU rows and a row-major fp32 CPU weight, the kernels
    built."""
    return (lib is not None and x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and x.dim() == 2 and weight.stride(-1) == 1)


def matmul_rowmajor(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """x [M, K] fp32 @ weight^T for a row-major fp32 weight [N, K] (rows of any stride, unit column stride), into
    `out` ([M, N], unit column stride) where given: every output the same bits whatever the thread count, the batch
    around its row or the instruction set (nt_matmul_rowmajor)."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    _check(x)
    _check(weight)
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"matmul_rowmajor: x {tuple(x.shape)} does not meet a weight {tuple(weight.shape)}")
    if out is None:
        out = torch.empty(rows, n)
    elif out.shape != (rows, n) or out.stride(-1) != 1 or out.dtype != torch.float32:
        raise ValueError(f"matmul_rowmajor: out {tuple(out.shape)} does not fit [{rows}, {n}] fp32")
    lib.nt_matmul_rowmajor(x.data_ptr(), rows, k, x.stride(0), weight.data_ptr(), n, weight.stride(0),
                           out.data_ptr(), out.stride(0), torch.get_num_threads())
    return out


_SIGNATURES["nt_gated"] = (None, [_i64, _ptr, _ptr, _ptr, _i64])
ACTIVATIONS = {"silu": Activation.SILU, "gelu_tanh": Activation.GELU_TANH}


def gated(lib: ctypes.CDLL, activation: int, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for contiguous fp32 tensors of one shape: silu (0) or gelu with tanh (1)."""
    gate, up = gate.contiguous(), up.contiguous()
    _check(gate)
    _check(up)
    if gate.shape != up.shape:
        raise ValueError(f"gated: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    out = torch.empty_like(gate)
    lib.nt_gated(activation, gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


_SIGNATURES["nt_unpack_q8_0"] = (None, [_ptr, _i64, _ptr, _ptr, _i32])
_SIGNATURES["nt_unpack_q5_0"] = (None, [_ptr, _i64, _ptr, _ptr, _i32])
_BLOCK_BYTES = {"q8_0": 34, "q5_0": 22}


def unpack_blocks(lib: ctypes.CDLL, kind: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor's Q8_0 or Q5_0 file blocks (`kind` "q8_0" or "q5_0"; raw: contiguous uint8, as the file holds them,
    read-only is fine) -> (int8 codes [blocks, 32], fp16 scales [blocks]) with w = scale * code, Q5_0's codes shifted
    to -16..15. One pass in C with the GIL released, where numpy takes several over the whole tensor."""
    size = _BLOCK_BYTES[kind]
    if raw.dtype != np.uint8 or not raw.flags.c_contiguous or raw.size % size:
        raise ValueError(f"unpack_blocks: {kind} blocks must be contiguous bytes, a multiple of {size}")
    n = raw.size // size
    codes, d = torch.empty(n, 32, dtype=torch.int8), torch.empty(n, dtype=torch.float16)
    getattr(lib, f"nt_unpack_{kind}")(raw.ctypes.data, n, codes.data_ptr(), d.data_ptr(), torch.get_num_threads())
    return codes, d


_SIGNATURES["nt_embed_q8"] = (_i32, [_ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr])


def embed_q8(lib: ctypes.CDLL, codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` [n] of a Q8 table (codes int8 [vocab, K], scales fp32 [vocab, K / 32], both contiguous) as fp32
    [n, K]: the values torch's int8 * fp32 scale gives, in one call instead of five ops."""
    ids = _indices(ids)
    out = torch.empty(ids.shape[0], codes.shape[1])
    if lib.nt_embed_q8(codes.data_ptr(), scales.data_ptr(), codes.shape[0], codes.shape[1], ids.data_ptr(),
                       ids.shape[0], out.data_ptr()):
        raise IndexError(f"token id out of range for a table of {codes.shape[0]} rows")
    return out


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension of contiguous fp32 x [..., K]; with `residual` (x's shape), x += residual
    first, in place."""
    out = torch.empty_like(x)
    size = x.shape[-1]
    rows = x.numel() // size
    lib.nt_norm_rows(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                     out.data_ptr(), rows, size, eps, torch.get_num_threads() if rows >= PARALLEL_ROWS else 1)
    return out


# Rows from which the row-wise kernels (norms, gated activations) split them across threads: below, waking the
# other threads costs more than it saves.
PARALLEL_ROWS = 16

_SIGNATURES["nt_norm_rows"] = (None, [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32, _i32])
_SIGNATURES["nt_gated_rows"] = (None, [_i64, _ptr, _i64, _i64, _ptr, _i32])


def gated_rows(lib: ctypes.CDLL, activation: int, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up [rows, F] of contiguous fp32 rows [rows, 2F] of gate then up: silu (0) or gelu with tanh (1)."""
    _check(gate_up)
    if not gate_up.is_contiguous() or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gated_rows: {tuple(gate_up.shape)} is not contiguous rows of gate and up")
    rows, f = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, f)
    lib.nt_gated_rows(activation, gate_up.data_ptr(), rows, f, out.data_ptr(),
                      torch.get_num_threads() if rows >= PARALLEL_ROWS else 1)
    return out


# The sampler's wrappers (draws.py) and the attention and decode ones (decoding.py) register their signatures as
# they are imported.
from nextoken.ops.native.draws import argmax_rows, kept_weights, mask_rows, sample_rows  # noqa: E402,F401
from nextoken.ops.native.decoding import (_KV_KINDS, attends, cache_struct, decode_attention, decode_layers,  # noqa: E402,F401
                                          decode_scratch, decode_step, prefill_attention, store_rows)

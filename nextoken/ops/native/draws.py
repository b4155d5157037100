"""The sampler's native calls (sampling.c): each row's argmax, the draw, the draw's kept weights, and a grammar's
masks applied to the logits; all on fp32 CPU rows, one call per step."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from nextoken.ops.native import _SIGNATURES, _check, _i32, _i64, _ptr


_SIGNATURES["nt_argmax_rows"] = (None, [_ptr, _i64, _i64, _i64, _ptr, _i32])


def argmax_rows(lib: ctypes.CDLL, x: torch.Tensor) -> list[int]:
    """Each row's first largest entry of fp32 x [M, N] (a NaN counts as largest), as torch's argmax: what a greedy
    decode step picks (nt_decode_step)."""
    _check(x)
    out = (ctypes.c_int64 * x.shape[0])()
    lib.nt_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), ctypes.addressof(out),
                       torch.get_num_threads())
    return list(out)


_SIGNATURES["nt_sample_rows"] = (_i32, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i32])


def sample_rows(lib: ctypes.CDLL, logits: torch.Tensor, temperature: list[float], top_k: list[int],
                top_p: list[float], min_p: list[float], uniforms: list[float]) -> list[int]:
    """Per row of fp32 logits [M, N] (unit column stride), the token drawn at uniforms[r] in [0, 1) after temperature
    (> 0), top-k (0: none), top-p (1: none) and min-p (0: none), as engine/sampler.py defines the draw
    (nt_sample_rows): the token ops/sampling.py draws, in one call."""
    _check(logits)
    if logits.shape[1] >= 2**31:
        raise ValueError(f"sample_rows: rows of {logits.shape[1]} tokens; the kernels take fewer than 2^31")
    rows = logits.shape[0]
    i64, f64 = ctypes.c_int64 * rows, ctypes.c_double * rows
    arrays = f64(*temperature), i64(*top_k), f64(*top_p), f64(*min_p), f64(*uniforms)
    out = i64()
    if lib.nt_sample_rows(logits.data_ptr(), rows, logits.shape[1], logits.stride(0),
                          *(ctypes.addressof(a) for a in arrays), ctypes.addressof(out), torch.get_num_threads()):
        raise MemoryError(f"sample_rows: no memory for the scratch of {logits.shape[1]}-entry rows")
    return list(out)


_SIGNATURES["nt_kept_weights"] = (_i32, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i32])


def kept_weights(lib: ctypes.CDLL, logits: torch.Tensor, temperature: list[float], top_k: list[int],
                 top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Per row of fp32 logits [M, N] (unit column stride), the weights [M, N] (fp64, units of 2^-Q) its draw takes
    after temperature, top-k, top-p and min-p, 0 for the tokens they drop (nt_kept_weights): ops/sampling.py's
    kept_weights, in one call."""
    _check(logits)
    if logits.shape[1] >= 2**31:
        raise ValueError(f"kept_weights: rows of {logits.shape[1]} tokens; the kernels take fewer than 2^31")
    rows = logits.shape[0]
    i64, f64 = ctypes.c_int64 * rows, ctypes.c_double * rows
    arrays = f64(*temperature), i64(*top_k), f64(*top_p), f64(*min_p)
    out = torch.empty(rows, logits.shape[1], dtype=torch.float64)  # [M, N]: every entry written
    if lib.nt_kept_weights(logits.data_ptr(), rows, logits.shape[1], logits.stride(0),
                           *(ctypes.addressof(a) for a in arrays), out.data_ptr(), out.stride(0),
                           torch.get_num_threads()):
        raise MemoryError(f"kept_weights: no memory for the scratch of {logits.shape[1]}-entry rows")
    return out


_SIGNATURES["nt_mask_rows"] = (None, [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64])


def mask_rows(lib: ctypes.CDLL, logits: torch.Tensor, rows: list[int], masks: np.ndarray) -> None:
    """-inf in fp32 logits [R, N] (unit column stride), in place, wherever row rows[k]'s bit is 0 in masks[k]
    (a C-contiguous uint32 array [len(rows), words], llguidance's bitmask layout; entries past 32 * words too)."""
    _check(logits)
    assert masks.dtype.itemsize == 4 and masks.flags["C_CONTIGUOUS"] and masks.shape[0] == len(rows)
    index = (ctypes.c_int64 * len(rows))(*rows)
    lib.nt_mask_rows(logits.data_ptr(), len(rows), logits.shape[1], logits.stride(0), ctypes.addressof(index),
                     masks.ctypes.data, masks.shape[1])

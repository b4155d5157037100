"""The native kernels: the portable C build (no AVX2) agrees with the vectorized one, RMSNorm matches torch's, the
library is skipped cleanly where it cannot be built, and a fused decode step gives the module path's logits and
cache contents on tiny Llama and Gemma 3 models (batched, in every KV format, across Gemma's sliding window), and
decode attention's row requests survive the compiler.

The AVX-512 VNNI routes run on every machine: on the host's build where the CPU has those instructions, else on a
build that emulates them (`vnni`, emulate512.h)."""

from __future__ import annotations

import ctypes
import logging
import math
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from nextoken.cache.kv_pool import KV_DTYPES, KVCacheLayer, KVPool, KVShape, dequantize_int8, quantize_int8
from nextoken.engine.model_loader import load_model
from nextoken.loader.gguf import read_gguf
from nextoken.models.config import ModelConfig
from nextoken.ops import native, quant_linear
from nextoken.ops.native.build import HERE, compiler
from nextoken.ops.attention import AttentionMetadata
from nextoken.ops.fused import FusedDecoder
from nextoken.ops.quant_linear import (Q4, Q4_F32, Q8, Q8_HALVES, BlockLinear,
                                       BlockWeight, q4_weight, q8_weight)
from nextoken.ops.quantize import q8_codes, regroup
from tests.unit.conftest import use_library
from tests.unit.test_native_fuzz import dequantized
from tests.unit.test_sampler import grid_frequencies, reference_distribution

PORTABLE_FLAGS = ["-O2", "-fopenmp", "-fPIC", "-shared", "-std=c11", "-mno-avx2", "-mno-fma", "-mno-f16c"]
AVX2_FLAGS = [*native.FLAGS, "-mno-avx512f"]  # the host's build without AVX-512: the int16 route for every product


@pytest.fixture(scope="module")
def portable(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return native.load(native.build(flags=PORTABLE_FLAGS, cache_dir=tmp_path_factory.mktemp("native")))


@pytest.fixture(scope="module")
def avx2(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return native.load(native.build(flags=AVX2_FLAGS, cache_dir=tmp_path_factory.mktemp("native")))


def q4k_weight(n: int, k: int, gen: torch.Generator) -> BlockWeight:
    """Q4 blocks with Q4_K's scales: d * sc and -dmin * mn per 32 values, an fp16 times a 6-bit integer (more bits
    than fp16 holds, so kept in fp32)."""
    d = torch.rand(n, k // 256 + 1, generator=gen).half().float().repeat_interleave(8, dim=1)[:, :k // 32] / 50
    dmin = torch.rand(n, k // 256 + 1, generator=gen).half().float().repeat_interleave(8, dim=1)[:, :k // 32] / 50
    sc = torch.randint(0, 64, d.shape, generator=gen).float()
    mn = torch.randint(0, 64, d.shape, generator=gen).float()
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return q4_weight(codes, d * sc, -dmin * mn)


def level_error(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How far the exact route's activation codes may move each product x @ w.t(): every activation within 2^-24 of
    its block's largest (the second level's int8 codes, half a step of at most absmax / 32767 / 254), times its
    weight's magnitude, summed. Against a value a thousand times the rest of its block, that is more than fp32's own
    rounding of the others (about 14 significant bits are left to them), and what the tests allow on top of it."""
    blocks = x.double().abs().unflatten(-1, (-1, 32))
    largest = blocks.amax(-1, keepdim=True).expand_as(blocks).flatten(-2)
    return (largest @ w.double().abs().t()) * 2.0 ** -24


def loud_blocks(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """x with one value of every other block of 32 a thousand times its size (as RMSNorm weights and gated products
    make some columns): one level of int16 codes per block then leaves that block's other values few bits."""
    x = x.clone()
    cols = torch.arange(0, x.shape[1], 64) + torch.randint(0, 32, (x.shape[1] // 64 + 1,), generator=gen)[:1]
    x[:, cols[cols < x.shape[1]]] *= 1000
    return x


@pytest.mark.parametrize("kind", [Q4, Q4_F32, Q8, Q8_HALVES])
@pytest.mark.parametrize("rows", [1, 6])
def test_block_products_on_vnni(kind: int, rows: int, vnni: ctypes.CDLL, avx2: ctypes.CDLL,
                                 portable: ctypes.CDLL) -> None:
    """With AVX-512 VNNI, activation rows meet Q4 weights through byte multiply-adds on the codes as bytes (a
    first level's int16 codes two planes, a second level's int8 codes one), and int8 weights (Q8, Q8 in halves)
    through 512-bit multiply-adds of int16 pairs: the same integer sums as the AVX2 build's int16 route, so the three
    builds agree to the float sums' order, and all are within fp32 rounding plus the codes' own error (level_error)
    of a float64 product over the dequantized weight, with a value a thousand times the others' in every other block.
    On VNNI a batch's rows (two or more) have the GEMM's bits
    (test_few_rows_have_the_gemms_bits). Weight row counts past whole tiles of four and thread chunks of 16; 1 to 4
    blocks in a last quad of blocks, odd block counts (K = 32 ... 1536); 1-3 threads."""
    assert avx2.nt_has_avx2() == 1 and avx2.nt_has_vnni512() == 0
    gen = torch.Generator().manual_seed(5)
    for n, k in ((1, 32), (3, 64), (17, 96), (43, 128), (64, 160), (35, 576), (21, 640), (50, 1536)):
        w = torch.randn(n, k, generator=gen)
        w[0, :32] = 0  # a block whose scale is zero
        if kind == Q4:
            part = q4_weight(*regroup(w))
        elif kind == Q4_F32:
            part = q4k_weight(n, k, gen)
        elif kind == Q8:
            part = q8_weight(*q8_codes(None, None, w))
        else:  # Q6_K's form: codes over -32..31, an fp32 scale per 16
            part = q8_weight(torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8),
                             torch.rand(n, k // 16, generator=gen) / 10)
        assert part.kind == kind
        dense = dequantized(part, dtype=torch.float32)
        x = loud_blocks(torch.randn(rows, k, generator=gen) * torch.rand(rows, k, generator=gen) * 4, gen)
        x[0, 32:64] = 0  # an activation block of zeros (its scale is zero)
        expected = (x.double() @ dense.double().t()).float()
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            try:
                outs = []
                for library in (vnni, avx2, portable):
                    out = torch.full((rows, n), float("nan"))
                    native.block_matmul(library, kind, x, part.qs, part.d, part.m, out)
                    outs.append(out)
            finally:
                torch.set_num_threads(2)
            size = (x.abs() @ dense.abs().t()).float()
            bound = 1e-5 * size + 2 * level_error(x, dense).float() + 1e-6
            for out in outs:  # fp32 rounding (4e-7 of the size) and the codes' own error
                assert ((out - expected).abs() <= bound).all(), (n, k, threads)
            for out in outs[1:]:  # the same integer sums; float sums of k / 32 block products in another order,
                # whose terms (Q4's offsets against the loud value's block) cancel to far less than their size
                assert ((out - outs[0]).abs() <= 1e-5 * size + 1e-7).all(), (n, k, threads)


def test_the_emulated_avx512_build_compiles_on_any_host(vnni: ctypes.CDLL) -> None:
    """The AVX-512 routes build with their instructions emulated (emulate512.h) for an AVX2 target on every machine,
    so an intrinsic missing from the emulation fails here even on a CPU with AVX-512 (whose `vnni` build is the
    host's own); on a CPU without it this is the build the `vnni` tests run."""
    emulated = native.load(native.build(flags=native.EMULATED_AVX512_FLAGS))
    assert emulated.nt_has_vnni512() == 1 and "-march=x86-64-v3" in native.EMULATED_AVX512_FLAGS
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 64, generator=gen)
    for part in (q4_weight(*regroup(torch.randn(5, 64, generator=gen))), q4k_weight(5, 64, gen)):  # fp16, fp32 scales
        dense = dequantized(part, dtype=torch.float32).double()
        outs = []
        for library in (emulated, vnni):
            outs.append(torch.full((3, 5), float("nan")))
            native.block_matmul(library, part.kind, x, part.qs, part.d, part.m, outs[-1])
        bound = 1e-5 * (x.abs().double() @ dense.abs().t()) + 1e-6
        assert ((outs[0].double() - x.double() @ dense.t()).abs() <= bound).all()  # the few-row kernel's products
        assert torch.equal(outs[0], outs[1])  # and its bits, emulated or not (the same build on a CPU without VNNI)


def test_decode_attention_keeps_its_row_requests(lib: ctypes.CDLL) -> None:
    """Decode attention requests the next group's K/V rows while it computes one (prefetch_share): 2 request sites on
    the AVX2 route, 3 more on the AVX-512 one. Requests are no-ops to a compiler, which may delete them as dead code
    (gcc 12 did, for a helper it had not inlined): the kernel then ran at about 0.8x with every other test passing."""
    source = HERE / "attention.c"
    for flags, sites in ((AVX2_FLAGS, 2), (native.FLAGS, 5 if lib.nt_has_vnni512() else 2)):
        cmd = [compiler(), *[f for f in flags if f != "-shared"], "-S", "-o", "-", str(source)]
        asm = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        assert asm.count("prefetcht") >= sites, flags


@pytest.mark.parametrize("k", [96, 256, 320, 352])  # blocks per row: 3 (scales one by one), 8 (whole vectors), 10, 11
def test_portable_build_agrees_with_the_vectorized_one(k: int, lib: ctypes.CDLL, portable: ctypes.CDLL) -> None:
    assert portable.nt_has_avx2() == 0
    gen = torch.Generator().manual_seed(0)
    parts = [q4_weight(*regroup(torch.randn(43, k, generator=gen))),  # rows past whole tiles of four
             q8_weight(*q8_codes(None, None, torch.randn(21, k, generator=gen))),
             q8_weight(torch.randint(-32, 32, (7, k), generator=gen, dtype=torch.int8),
                       torch.rand(7, k // 16, generator=gen) / 10),
             q4k_weight(9, k, gen)]
    assert [p.kind for p in parts] == [Q4, Q8, Q8_HALVES, Q4_F32]
    for rows in (1, 3, 6):
        x = torch.randn(rows, k, generator=gen)
        for part in parts:
            outs = []
            for library in (lib, portable):
                out = torch.empty(rows, part.rows)
                native.block_matmul(library, part.kind, x, part.qs, part.d, part.m, out)
                outs.append(out)
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=3e-5)  # sums of k products, two orders
    x, w, residual = torch.randn(5, 64, generator=gen), torch.rand(64, generator=gen), torch.randn(5, 64)
    expected = F.rms_norm(x + residual, (64,), w, 1e-6)
    for library in (lib, portable):
        stream = x.clone()
        torch.testing.assert_close(native.rms_norm(library, stream, w, 1e-6, residual=residual), expected)
        torch.testing.assert_close(stream, x + residual)  # the residual stream is updated in place


@pytest.mark.parametrize("build", ["vectorized", "portable"])
def test_gated_activations_match_torch(build: str, lib: ctypes.CDLL, portable: ctypes.CDLL) -> None:
    """The MLP's act(gate) * up, silu and tanh-gelu, over the whole float range: within 1e-5 of the formula in
    float64 (the vectorized exp is a polynomial), within fp32 rounding of torch's modules, NaN carried through."""
    kernels = lib if build == "vectorized" else portable
    gen = torch.Generator().manual_seed(2)
    gate = torch.cat([torch.randn(997, generator=gen) * 4, torch.linspace(-120, 120, 2001),
                      torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.5, -88.5, 89.0, -89.0])])
    up = torch.randn(gate.shape, generator=gen)
    g = gate.double()
    for activation, module in ((0, F.silu), (1, lambda x: F.gelu(x, approximate="tanh"))):
        z = g if activation == 0 else 2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)  # gelu = x sigmoid(z)
        exact = g * torch.sigmoid(z) * up.double()
        got = native.gated(kernels, activation, gate, up)
        normal = exact.abs() > 1e-30  # beyond: underflow, where any tiny value is as good
        assert ((got.double() - exact).abs() <= 1e-5 * exact.abs())[normal].all()
        assert (got.abs() <= 1e-30)[~normal].all()
        # torch's tanh form rounds 1 + tanh(t) to 0 sooner: the two agree to fp32 rounding of the inputs' scale.
        torch.testing.assert_close(got, module(gate) * up, rtol=1e-5, atol=1e-6)
        assert native.gated(kernels, activation, torch.tensor([float("nan")] * 9), torch.ones(9)).isnan().all()


@pytest.mark.parametrize("build", ["vectorized", "portable"])
def test_fp32_gemm_over_packed_panels(build: str, lib: ctypes.CDLL, portable: ctypes.CDLL) -> None:
    """Every tile shape: rows past and short of the 6-row tiles, columns short of a 16-column panel, any K; rows of
    x and out with strides of their own. Within fp32 rounding of a float64 product; the panels unpack to W. The same
    GEMM over block weights (block_matmul with gemm=True)."""
    kernels = lib if build == "vectorized" else portable
    gen = torch.Generator().manual_seed(3)
    for n, k in ((5, 7), (16, 64), (37, 96), (100, 33)):
        w = torch.randn(n, k, generator=gen)
        panels = native.pack(kernels, w)
        assert panels.numel() == -(-n // 16) * 16 * k and torch.equal(native.unpack(panels, n, k), w)
        for rows in (1, 5, 6, 7, 13):
            x = torch.randn(rows, k + 3, generator=gen)[:, 2:2 + k]  # a row stride that is not k
            out = torch.full((rows, n + 4), float("nan"))
            native.sgemm(kernels, x, panels, n, out[:, 1:1 + n])
            torch.testing.assert_close(out[:, 1:1 + n], (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)
            assert out[:, 0].isnan().all() and out[:, 1 + n:].isnan().all()  # nothing written past the view
    # Block weights dequantized 16 rows at a time into the same GEMM: every format, within fp32 rounding of the
    # product over the dequantized weight.
    parts = [q4_weight(*regroup(torch.randn(43, 96, generator=gen))),  # rows past whole tiles of four
             q8_weight(*q8_codes(None, None, torch.randn(21, 96, generator=gen))),
             q8_weight(torch.randint(-32, 32, (7, 96), generator=gen, dtype=torch.int8),
                       torch.rand(7, 6, generator=gen) / 10),
             q4k_weight(20, 96, gen)]
    for part in parts:
        w = dequantized(part, dtype=torch.float32)
        for rows in (1, 7, 12):
            x = loud_blocks(torch.randn(rows, 96, generator=gen), gen)
            out = torch.empty(rows, part.rows)
            native.block_matmul(kernels, part.kind, x, part.qs, part.d, part.m, out, gemm=True)
            # fp32 over the dequantized rows
            size = (x.abs().double() @ w.abs().double().t()).float()
            bound = 1e-5 * size + 2 * level_error(x, w).float() + 1e-5
            assert ((out - (x.double() @ w.double().t()).float()).abs() <= bound).all()
    with pytest.raises(ValueError, match="do not fit"):
        native.sgemm(kernels, torch.randn(2, 8), native.pack(kernels, torch.randn(4, 9)), 4, torch.empty(2, 4))


def gemm_cases(seed: int, outliers: bool = False):  # noqa: ANN201 - yields (BlockWeight, Tensor, Tensor)
    """(part, its dequantized weight in float64, x) for products of many rows: every block format (Q4 with its
    offsets, Q8, Q8 in halves with codes over their whole range), column counts past whole pairs of 16-column
    panels, row counts past whole tiles of six, rows of x with a stride of their own; with `outliers`, one column of
    x in 24 runs 20 times larger than the rest (as models have them: more than int8 codes take out at 576)."""
    gen = torch.Generator().manual_seed(seed)
    for n, k in ((5, 32), (33, 96), (70, 576), (16, 1536)):
        parts = [q4_weight(*regroup(torch.randn(n, k, generator=gen))),
                 q8_weight(*q8_codes(None, None, torch.randn(n, k, generator=gen))),
                 q8_weight(torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                           torch.rand(n, k // 16, generator=gen) / 10),
                 q4k_weight(n, k, gen)]
        loud = torch.randperm(k, generator=gen)[:max(1, k // 24)] + 1
        for part in parts:
            w = dequantized(part, dtype=torch.float32).double()
            for rows in (1, 5, 6, 13, 40):
                x = torch.randn(rows, k + 3, generator=gen)
                if outliers:
                    x[:, loud] *= 20
                yield part, w, x[:, 1:1 + k]


def gemm_out(library: ctypes.CDLL, part: BlockWeight, x: torch.Tensor, threads: int,
             int8_activations: bool = False) -> torch.Tensor:
    """block_matmul(gemm=True) on `threads` threads into a view with a column of NaN on each side, which must stay
    untouched."""
    n = part.qs.shape[0]
    out = torch.full((x.shape[0], n + 2), float("nan"))
    torch.set_num_threads(threads)
    try:
        native.block_matmul(library, part.kind, x, part.qs, part.d, part.m, out[:, 1:1 + n], gemm=True,
                            int8_activations=int8_activations)
    finally:
        torch.set_num_threads(2)
    assert out[:, 0].isnan().all() and out[:, 1 + n].isnan().all()  # nothing past the view
    return out[:, 1:1 + n]


def test_exact_gemm_over_block_weights(vnni: ctypes.CDLL, avx2: ctypes.CDLL) -> None:
    """With AVX-512 VNNI, products of many rows over block weights (block_matmul with gemm=True) meet the weights'
    integer codes with two levels of activation codes in byte multiply-adds (three planes of bytes): within fp32
    rounding of a float64 product over the dequantized weight, as is the fp32 GEMM of the AVX2 build. gemm_cases'
    shapes, with loud columns, 1-3 threads."""
    for part, w, x in gemm_cases(6, outliers=True):
        expected = (x.double() @ w.t()).float()
        bound = 1e-5 * (x.abs().double() @ w.abs().t()).float() + 2 * level_error(x, w).float() + 1e-6
        for threads in (1, 2, 3):
            for library in (vnni, avx2):
                got = gemm_out(library, part, x, threads)
                assert ((got - expected).abs() <= bound).all(), (part.kind, tuple(w.shape), x.shape[0])


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [rows, K] as int8 codes per 32 values (absmax / 127, rounded to nearest even, in float32 as the kernel
    computes it), dequantized in float64."""
    b = x.float().unflatten(1, (-1, 32))
    amax = b.abs().amax(-1, keepdim=True)
    codes = torch.where(amax > 0, torch.round(b * (torch.full_like(amax, 127.0) / amax)), torch.zeros_like(b))
    return (codes.double() * (amax / 127).double()).flatten(1)


OUTLIER_MAX, OUTLIER_RATIO, ROWS8_MAX = 16, 3.0, 16  # ops/native/gemm.c


def outlier_columns(x: torch.Tensor) -> torch.Tensor:
    """The columns that int8 codes leave out: the OUTLIER_MAX whose largest magnitude over the rows exceeds
    OUTLIER_RATIO times the median column's (rank K / 2) by the most, ascending."""
    colmax = x.abs().amax(0)
    limit = torch.tensor(OUTLIER_RATIO, dtype=torch.float32) * colmax.sort().values[x.shape[1] // 2]
    above = torch.nonzero(colmax > limit).flatten()
    return above[colmax[above].argsort(descending=True)[:OUTLIER_MAX]].sort().values


def test_few_rows_have_the_gemms_bits(vnni: ctypes.CDLL) -> None:
    """With AVX-512 VNNI, products of 2 to 11 rows (block_matmul without gemm: a small batch, a sequence's verified
    proposals) stream the weights as stored, yet give every output the int16 GEMM's bits: the same int32 sum per
    scale group from byte multiply-adds on the codes' two bytes, then gemm_tile's float operations in its order. So
    a row's numbers are the same in any batch of two rows or more, whichever route its size takes. Every block
    format, gemm_cases' shapes (past whole blocks of 16 weight rows, rows of x with a stride), 1-3 threads, each
    row count from 2 to 11 at both ends of a batch of 40."""
    checked = 0
    for part, _, x in gemm_cases(10, outliers=True):
        n = part.qs.shape[0]
        for threads in (1, 2, 3):
            batch = gemm_out(vnni, part, x, threads)
            torch.set_num_threads(threads)
            try:
                for rows in range(2, min(11, x.shape[0]) + 1):
                    for r0 in {0, x.shape[0] - rows}:
                        few = torch.full((rows, n), float("nan"))
                        native.block_matmul(vnni, part.kind, x[r0:r0 + rows], part.qs, part.d, part.m, few)
                        assert torch.equal(few, batch[r0:r0 + rows]), (part.kind, tuple(part.qs.shape), rows, threads)
                        checked += 1
            finally:
                torch.set_num_threads(2)
    assert checked > 1000


def test_int8_activation_gemm_over_block_weights(vnni: ctypes.CDLL, avx2: ctypes.CDLL) -> None:
    """block_matmul(gemm=True, int8_activations=True): with AVX-512 VNNI the activations meet the weights' codes as
    int8 codes per 32 values in byte multiply-adds (signed weights against codes plus 128, that excess taken out
    again), all but the outlier columns, whose products are fp32: the float64 product of those rounded activations
    and the dequantized weight plus the outlier columns' exact products, to float rounding, and measurably apart
    from the int16 route's result. gemm_cases' shapes (outlier columns more than are taken out, or fewer), 1-3
    threads. Without VNNI (the AVX2 build) the setting changes nothing: the result is the int16 route's, bit for
    bit."""
    counts = set()
    for part, w, x in gemm_cases(8, outliers=True):
        loud = outlier_columns(x)
        counts.add(len(loud))
        rest = x.clone()
        rest[:, loud] = 0
        expected = (int8_blocks(rest) @ w.t() + x[:, loud].double() @ w[:, loud].t()).float()
        bound = 1e-6 * (x.abs().double() @ w.abs().t()).float() + 1e-6
        for threads in (1, 2, 3):
            assert torch.equal(gemm_out(avx2, part, x, threads, True), gemm_out(avx2, part, x, threads))
            got = gemm_out(vnni, part, x, threads, True)
            assert ((got - expected).abs() <= bound).all(), (part.kind, tuple(w.shape), x.shape[0], threads)
            assert (got - gemm_out(vnni, part, x, threads)).abs().max() > 100 * bound.max()  # not int16's
    assert OUTLIER_MAX in counts and len(counts) > 3  # the cap reached, and many counts under it


def test_int8_gemm_with_fixed_outlier_columns_gives_each_row_its_bits_in_any_batch(vnni: ctypes.CDLL) -> None:
    """block_matmul(gemm=True, int8_activations=True, outliers=...): with the outlier columns fixed, a row's result
    is the same bits alone, in up to ROWS8_MAX rows (the kernel that streams the weights as stored) and in a batch
    of up to 40 (the GEMM over panels), on 1-3 threads: within float rounding of the float64 product of the int8 codes without
    those columns plus the columns' exact products. The fixed columns are not the batch's own choice (one left
    out, an ordinary one in). Out-of-order, out-of-range or too many columns are refused; no rows is nothing to do."""
    cases = 0
    for part, w, x in gemm_cases(9, outliers=True):
        k = x.shape[1]
        chosen = outlier_columns(x)
        fixed = torch.cat([chosen[1:], torch.tensor([k // 2])]).unique().sort().values[:OUTLIER_MAX]
        rest = x.clone()
        rest[:, fixed] = 0
        expected = (int8_blocks(rest) @ w.t() + x[:, fixed].double() @ w[:, fixed].t()).float()
        bound = 1e-6 * (x.abs().double() @ w.abs().t()).float() + 1e-6
        columns = fixed.to(torch.int32)
        n = part.qs.shape[0]
        for threads in (1, 3):
            torch.set_num_threads(threads)
            try:
                batch = torch.full((x.shape[0], n), float("nan"))
                native.block_matmul(vnni, part.kind, x, part.qs, part.d, part.m, batch, gemm=True,
                                    int8_activations=True, outliers=columns)
                assert ((batch - expected).abs() <= bound).all(), (part.kind, tuple(w.shape), x.shape[0])
                for rows in range(1, min(ROWS8_MAX, x.shape[0]) + 1):
                    for r0 in {0, x.shape[0] - rows}:
                        few = torch.full((rows, n), float("nan"))
                        native.block_matmul(vnni, part.kind, x[r0:r0 + rows], part.qs, part.d, part.m, few,
                                            gemm=True, int8_activations=True, outliers=columns)
                        assert torch.equal(few, batch[r0:r0 + rows]), (part.kind, tuple(w.shape), rows, threads)
                        cases += 1
            finally:
                torch.set_num_threads(2)
    assert cases > 500
    part, _, x = next(gemm_cases(9))
    out = torch.empty(x.shape[0], part.qs.shape[0])
    native.block_matmul(vnni, part.kind, x[:0], part.qs, part.d, part.m, out[:0], gemm=True, int8_activations=True,
                        outliers=torch.tensor([1], dtype=torch.int32))  # no rows (a chunk that needs no logits)
    for bad in ([3, 1], [0, 0], [-1], [x.shape[1]], list(range(OUTLIER_MAX + 1))):
        with pytest.raises(ValueError, match="outlier columns"):
            native.block_matmul(vnni, part.kind, x, part.qs, part.d, part.m, out, gemm=True, int8_activations=True,
                                outliers=torch.tensor(bad, dtype=torch.int32))


@pytest.mark.parametrize("build", ["vectorized", "portable"])
def test_stream_read_reads_every_word_once(build: str, lib: ctypes.CDLL, portable: ctypes.CDLL) -> None:
    """The bandwidth floor's pass: the XOR of every 64-bit word of each tensor (a tail under 8 bytes left out),
    whatever the tensors' sizes and the thread split. A word read twice or skipped changes it."""
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-128, 128, (n,), generator=gen, dtype=torch.int8) for n in (8, 13, 4096, 100_003)]
    tensors.append(torch.randn(3, 577, generator=gen))
    expected = 0
    for t in tensors:
        words = t.reshape(-1).view(torch.uint8)[: t.nbytes // 8 * 8].numpy().view("<u8")
        expected ^= int(np.bitwise_xor.reduce(words)) if words.size else 0
    library = lib if build == "vectorized" else portable
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        try:
            assert native.stream_read(library, tensors) == expected
        finally:
            torch.set_num_threads(2)
    assert native.stream_read(library, tensors[:1]) != native.stream_read(library, tensors[:2])
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        native.stream_read(library, [torch.randn(4, 8).t()])


@pytest.mark.parametrize("rows", [3, native.PARALLEL_ROWS, 53])
def test_row_kernels_split_across_threads_give_the_one_thread_result(rows: int, lib: ctypes.CDLL) -> None:
    """Norms and gated activations over many rows (a prefill's) split them across threads: the same values as row by
    row on one thread (the rows are independent), and as torch's modules."""
    gen = torch.Generator().manual_seed(3)
    x, residual, w = torch.randn(rows, 96, generator=gen), torch.randn(rows, 96, generator=gen), torch.rand(96)
    gate_up = torch.randn(rows, 2 * 80, generator=gen) * 3
    expected_norm = torch.cat([native.rms_norm(lib, (x[r:r + 1] + residual[r:r + 1]).contiguous(), w, 1e-6)
                               for r in range(rows)])
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        try:
            stream = x.clone()
            assert torch.equal(native.rms_norm(lib, stream, w, 1e-6, residual=residual), expected_norm)
            for activation, name in ((0, "silu"), (1, "gelu_tanh")):
                assert native.ACTIVATIONS[name] == activation
                got = native.gated_rows(lib, activation, gate_up)
                assert torch.equal(got, native.gated(lib, activation, gate_up[:, :80], gate_up[:, 80:]))
                # against the formulas in float64: torch's fp32 tanh form rounds 1 + tanh(t) to 0 for very negative
                # inputs, where the kernels' sigmoid form keeps the tiny true value
                module = F.silu if activation == 0 else (lambda t: F.gelu(t, approximate="tanh"))
                expected = module(gate_up[:, :80].double()) * gate_up[:, 80:].double()
                torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
        finally:
            torch.set_num_threads(2)
    with pytest.raises(ValueError, match="rows of gate and up"):
        native.gated_rows(lib, 0, torch.randn(4, 7))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_native_kv_stores_write_what_the_cache_writes(kv_dtype: torch.dtype, lib: ctypes.CDLL) -> None:
    """Rows stored into the paged cache by the kernels (rows of any stride, slots in any order, split across
    threads) hold what KVCacheLayer.write stores, and touch no other slot."""
    blocks, block_size, kv_heads, head_dim, n = 6, 4, 2, 32, 19
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(n, 3 * kv_heads * head_dim, generator=gen) * 2
    k = qkv[:, :kv_heads * head_dim].unflatten(1, (kv_heads, head_dim))  # a strided view, as the model's
    v = qkv[:, kv_heads * head_dim:2 * kv_heads * head_dim].unflatten(1, (kv_heads, head_dim))
    slots = torch.randperm(blocks * block_size, generator=gen)[:n]

    def layer() -> KVCacheLayer:
        shape = (blocks, block_size, kv_heads, head_dim)
        scales = (lambda: torch.zeros(blocks, block_size, kv_heads, head_dim // 32, dtype=torch.float16)) \
            if kv_dtype == torch.int8 else (lambda: None)
        return KVCacheLayer(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype), scales(), scales())

    expected, got = layer(), layer()
    expected.write(k, v, slots)
    native.store_rows(lib, got.k, got.k_scale, slots, k)
    native.store_rows(lib, got.v, got.v_scale, slots, v)
    for a, b in ((expected.k, got.k), (expected.v, got.v), (expected.k_scale, got.k_scale)):
        if a is not None:
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="do not fit"):
        native.store_rows(lib, got.k, got.k_scale, slots[:3], k)


def test_rms_norm_over_heads(lib: ctypes.CDLL) -> None:
    x, w = torch.randn(2, 3, 32), torch.rand(32)
    torch.testing.assert_close(native.rms_norm(lib, x, w, 1e-6), F.rms_norm(x, (32,), w, 1e-6))


def test_unbuildable_library_is_reported_and_skipped(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(RuntimeError, match="failed on broken.c"):
        (tmp_path / "broken.c").write_text("this is not C\n")
        native.build(tmp_path / "broken.c", cache_dir=tmp_path)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("NEXTOKEN_CACHE_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="nextoken.native"):
        assert native.library() is None
    assert "native kernels unavailable" in caplog.text


# --- fused decode against the modules -------------------------------------------------------------------------

BLOCK = 16
CONTEXTS = [3, 12, 21]  # tokens already in each sequence's cache; Gemma's tiny window is 8


def decode_step(net: torch.nn.Module, cfg: ModelConfig, pool: KVPool, tokens: list[int], lengths: list[int]
                ) -> torch.Tensor:
    """One decode token per sequence (sequence s owns blocks 4s..4s+3) -> logits."""
    n = len(tokens)
    slots = [4 * s * BLOCK + lengths[s] for s in range(n)]
    meta = AttentionMetadata(torch.tensor(slots), list(range(n + 1)), [length + 1 for length in lengths],
                             torch.tensor([[4 * s + b for b in range(4)] for s in range(n)]), BLOCK)
    return net(torch.tensor(tokens), torch.tensor(lengths), pool.layers, meta)


def _twin(pool: KVPool) -> KVPool:
    """A second pool holding what `pool` holds (the module path's, for the same step)."""
    twin = KVPool(pool.shape, pool.num_blocks, BLOCK, torch.device("cpu"))
    for mine, other in zip(pool.layers, twin.layers):
        for name in ("k", "v", "k_scale", "v_scale"):
            if getattr(mine, name) is not None:
                getattr(other, name).copy_(getattr(mine, name))
    return twin


# Families the native step runs besides the tiny Llama and Gemma files: transformers' tiny models written as llama.cpp
# does (tests/hf_reference.py): q/k/v biases, q/k norms of 24-value heads, fused QKV and gate/up, Llama 3 frequencies.
FAMILIES = ["qwen2", "qwen3", "phi3", "llama3"]


@pytest.fixture(scope="module")
def family_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.hf_reference import build, write_gguf

    out = tmp_path_factory.mktemp("families")
    return {name: write_gguf(build(name), name, out / f"{name}.gguf") for name in FAMILIES}


def _tiny_file(arch: str, tiny_llama: Path, tiny_gemma: Path, request: pytest.FixtureRequest) -> Path:
    if arch in FAMILIES:
        return request.getfixturevalue("family_files")[arch]
    return tiny_llama if arch == "llama" else tiny_gemma


def _assert_same_step(got: torch.Tensor, expected: torch.Tensor, pool: KVPool, twin: KVPool, kv_dtype: str,
                      int8_activations: bool = False) -> None:
    """A fused step's logits and cache writes against the modules'. Same formulas in a different order (and int16
    activation blocks that may round a last bit differently; a narrow cache may then store a value one step apart:
    2^-8 in bf16, a code in int8, up to 1/254 of its group's largest value, which moves a tiny model's logits by up
    to a few hundredths). A misplaced window or slot moves logits by ~1. With int8 activation codes, one that rounds
    the other way moves a K or V value by up to one of their steps (0.009 in a tiny Gemma's fp32 cache), which an
    int8 cache may store two codes apart, and its row's logits by a few hundredths (0.044 for that Gemma, measured
    on AVX-512 hardware); a misplaced window or slot still moves them by ~1."""
    atol = {"fp32": 2e-3, "bf16": 1e-2, "int8": 5e-2}[kv_dtype]
    if int8_activations:
        atol = 1e-1
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=atol)
    for mine, other in zip(pool.layers, twin.layers):
        for name in ("k", "v", "k_scale", "v_scale"):
            if getattr(mine, name) is not None:
                a, b = getattr(mine, name), getattr(other, name)
                codes = a.dtype == torch.int8
                torch.testing.assert_close(a.float(), b.float(), rtol=0 if codes else 1e-2,
                                           atol=(2 if int8_activations else 1) if codes
                                           else 5e-2 if int8_activations else 2e-3)


@pytest.mark.parametrize("products", ["blocks", "gemm", "int16", "int8"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma", *FAMILIES])
@torch.inference_mode()
def test_fused_decode_matches_the_modules(arch: str, kv_dtype: str, products: str, tiny_llama: Path,
                                          tiny_gemma: Path, monkeypatch: pytest.MonkeyPatch,
                                          request: pytest.FixtureRequest) -> None:
    """products "gemm": the fused step takes this CPU's GEMM over each projection's blocks (int16 with AVX-512 VNNI,
    else fp32 over panels dequantized as it goes), as it does for batches past the block kernels (here from one row
    on), and so do the modules. "int16": the AVX-512 VNNI build (emulated where the CPU has none), its int16 GEMM
    over the blocks from one row on, in the step and the modules; "int8": the same with int8 activation codes
    (set_activations), which the fused step's structs carry."""
    if products in ("int16", "int8"):  # the AVX-512 VNNI routes, emulated where the CPU has none
        use_library(monkeypatch, request.getfixturevalue("vnni"))
    gguf = read_gguf(_tiny_file(arch, tiny_llama, tiny_gemma, request))
    cfg = ModelConfig.from_gguf(gguf)
    net = load_model(gguf, cfg, quant="int4", quantize_head=True)
    assert net.fused is not None
    if products == "int8":
        net.set_activations("int8")
        assert all(layer.attn.qkv_proj.activations == "int8" for layer in net.layers)
        assert all(m.int8_activations for layer in net.fused.layers for m in (layer.qkv, layer.o, layer.gate_up,
                                                                               layer.down))
    if products != "blocks":
        for module in net.modules():
            if isinstance(module, BlockLinear):
                module.max_rows = 0
        net.fused = FusedDecoder.build(net)
        net.fused.gemm_rows = 1
    runs = []
    real = FusedDecoder.__call__
    monkeypatch.setattr(FusedDecoder, "__call__", lambda self, *args: runs.append(1) or real(self, *args))
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, KV_DTYPES[kv_dtype]), 4 * len(CONTEXTS),
                  BLOCK, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    # Prefill each sequence through the modules.
    fused, net.fused = net.fused, None
    for s, length in enumerate(CONTEXTS):
        ids = torch.randint(3, cfg.vocab_size, (length,), generator=gen)
        meta = AttentionMetadata(torch.arange(length) + 4 * s * BLOCK, [0, length], [length],
                                 torch.tensor([[4 * s + b for b in range(4)]]), BLOCK)
        net(ids, torch.arange(length), pool.layers, meta)
    net.fused = fused
    lengths = list(CONTEXTS)
    for _ in range(3):
        tokens = torch.randint(3, cfg.vocab_size, (len(lengths),), generator=gen).tolist()
        twin = _twin(pool)
        fused, net.fused = net.fused, None
        expected = decode_step(net, cfg, twin, tokens, lengths)
        net.fused = fused
        got = decode_step(net, cfg, pool, tokens, lengths)
        _assert_same_step(got, expected, pool, twin, kv_dtype, int8_activations=products == "int8")
        lengths = [length + 1 for length in lengths]
    # An int8 cache needs heads of a multiple of 32 values natively (tiny Llama's are 16): the modules run it.
    assert len(runs) == (0 if kv_dtype == "int8" and cfg.head_dim % 32 else 3)


@pytest.mark.parametrize("build", ["host", "avx512"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma", *FAMILIES])
@torch.inference_mode()
def test_fused_chunks_match_the_modules(arch: str, kv_dtype: str, build: str, tiny_llama: Path, tiny_gemma: Path,
                                        monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Batches with chunks of several tokens run fused too where the prefill kernel does (AVX-512, emulated on the
    avx512 build where the CPU has none): one batch holds a fresh prompt, a chunk that continues a cached prefix
    (chunked prefill, past Gemma's 8-token window) and a decode token; its logits and cache writes are the module
    path's."""
    if build == "avx512":
        use_library(monkeypatch, request.getfixturevalue("vnni"))
    gguf = read_gguf(_tiny_file(arch, tiny_llama, tiny_gemma, request))
    cfg = ModelConfig.from_gguf(gguf)
    net = load_model(gguf, cfg, quant="int4", quantize_head=True)
    runs = []
    real = FusedDecoder.__call__
    monkeypatch.setattr(FusedDecoder, "__call__", lambda self, *args: runs.append(1) or real(self, *args))
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, KV_DTYPES[kv_dtype]), 12, BLOCK,
                  torch.device("cpu"))
    gen = torch.Generator().manual_seed(2)
    tables = torch.tensor([[4 * s + b for b in range(4)] for s in range(3)])
    fused, net.fused = net.fused, None
    cached = [0, 9, 12]  # tokens already in each sequence's cache, written through the modules
    for s, length in enumerate(cached):
        if length:
            meta = AttentionMetadata(torch.arange(length) + 4 * s * BLOCK, [0, length], [length], tables[s:s + 1],
                                     BLOCK)
            net(torch.randint(3, cfg.vocab_size, (length,), generator=gen), torch.arange(length), pool.layers, meta)
    new = [5, 7, 1]
    ids = torch.randint(3, cfg.vocab_size, (sum(new),), generator=gen)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)])
    slots = torch.cat([4 * s * BLOCK + torch.arange(c, c + n) for s, (c, n) in enumerate(zip(cached, new))])
    starts = [0, 5, 12, 13]
    twin = _twin(pool)
    lens = [c + n for c, n in zip(cached, new)]
    expected = net(ids, positions, twin.layers, AttentionMetadata(slots, starts, lens, tables, BLOCK))
    net.fused = fused
    got = net(ids, positions, pool.layers, AttentionMetadata(slots, starts, lens, tables, BLOCK))
    _assert_same_step(got, expected, pool, twin, kv_dtype)
    native_attends = not (kv_dtype == "int8" and cfg.head_dim % 32)
    assert len(runs) == int(fused.chunks and native_attends)
    # The prefill kernel takes heads of a multiple of 16 values (not the tiny Qwen3's 24): the modules run those chunks.
    assert fused.chunks == (bool(native.library().nt_has_vnni512()) and cfg.head_dim % 16 == 0)


def test_fused_decode_follows_a_new_pool(tiny_llama: Path) -> None:
    """The kernel structs hold raw pointers: a new pool (even one whose K tensors land where a freed pool's were)
    gets structs of its own, and the pool they point into stays alive while they are in use."""
    gguf = read_gguf(tiny_llama)
    cfg = ModelConfig.from_gguf(gguf)
    net = load_model(gguf, cfg, quant="int4", quantize_head=True)
    shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    first = KVPool(shape, 4, BLOCK, torch.device("cpu"))
    structs = net.fused._cache_structs(first.layers)
    assert net.fused._cache_structs(first.layers) is structs  # the same caches: built once
    second = KVPool(shape, 7, BLOCK, torch.device("cpu"))
    structs = net.fused._cache_structs(second.layers)
    for struct, layer in zip(structs, second.layers):
        assert (struct.k, struct.v) == (layer.k.data_ptr(), layer.v.data_ptr())


@torch.inference_mode()
def test_a_profile_times_the_fused_blocks_and_changes_nothing(tiny_gemma: Path) -> None:
    """Handed a profile (a tracer's), the fused call times each block's attention, MLP and whole (each above zero,
    the parts inside the whole) and reads the clock after the last block, inside the call; its logits and cache
    writes are the same bits as an untimed call's. Untimed, it writes nothing into the profile it was not given."""
    gguf = read_gguf(tiny_gemma)
    cfg = ModelConfig.from_gguf(gguf)
    net = load_model(gguf, cfg, quant="int4", quantize_head=True)
    assert net.fused is not None
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32), 4 * len(CONTEXTS), BLOCK,
                  torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    fused, net.fused = net.fused, None
    for s, length in enumerate(CONTEXTS):
        meta = AttentionMetadata(torch.arange(length) + 4 * s * BLOCK, [0, length], [length],
                                 torch.tensor([[4 * s + b for b in range(4)]]), BLOCK)
        net(torch.randint(3, cfg.vocab_size, (length,), generator=gen), torch.arange(length), pool.layers, meta)
    twin = _twin(pool)
    n = len(CONTEXTS)
    tokens = torch.randint(3, cfg.vocab_size, (n,), generator=gen)
    meta = AttentionMetadata(torch.tensor([4 * s * BLOCK + length for s, length in enumerate(CONTEXTS)]),
                             list(range(n + 1)), [length + 1 for length in CONTEXTS],
                             torch.tensor([[4 * s + b for b in range(4)] for s in range(n)]), BLOCK)
    positions = torch.tensor(CONTEXTS)
    profile = native.profile_buffer(cfg.num_layers)
    start = time.clock_gettime(time.CLOCK_MONOTONIC)
    timed = fused(net.embed(tokens), positions, pool.layers, meta, profile)
    end = time.clock_gettime(time.CLOCK_MONOTONIC)
    untimed = fused(net.embed(tokens), positions, twin.layers, meta)
    assert torch.equal(timed, untimed)
    for mine, other in zip(pool.layers, twin.layers):
        assert torch.equal(mine.k, other.k) and torch.equal(mine.v, other.v)
    times = list(profile)
    assert start < times[native.ProfileSlot.BLOCKS] < end  # the clock Python's time.CLOCK_MONOTONIC reads
    layers = [times[native.ProfileSlot.LAYERS + i * native.LayerTime.TIMES:][:native.LayerTime.TIMES]
              for i in range(cfg.num_layers)]
    for attention, mlp, block in layers:
        assert 0 < attention and 0 < mlp and attention + mlp < block
    assert sum(block for _, _, block in layers) < end - start
    assert all(t == 0 for slot, t in enumerate(times) if slot < native.ProfileSlot.LAYERS
               and slot != native.ProfileSlot.BLOCKS)  # the step's own readings: nt_decode_step's


@pytest.mark.parametrize("build", ["host", "avx2", "portable"])
def test_argmax_rows_is_numpys(build: str, lib: ctypes.CDLL, avx2: ctypes.CDLL, portable: ctypes.CDLL) -> None:
    """A greedy native step's pick (nt_argmax_rows) is the sampler's: the first largest entry, a NaN counting as
    largest (its first one), over rows whose length is not a multiple of the vector width too."""
    built = {"host": lib, "avx2": avx2, "portable": portable}[build]
    gen = torch.Generator().manual_seed(0)
    for n in (1, 5, 16, 17, 33, 1000, 4099):
        x = torch.randn(9, n, generator=gen).round(decimals=1)  # rounded: ties for the largest value
        x[1] = float("-inf")
        x[2, n // 2:] = float("inf")
        x[3, -1] = float("nan")
        x[4, n // 3] = x[4, -1] = float("nan")
        x[5] = 0.0
        x[6, 0] = float("nan")
        x[7] = x[7].clamp(max=0.3)  # many ties at the top
        got = native.argmax_rows(built, x)
        assert got == x.numpy().argmax(-1).tolist(), n
        wide = torch.zeros(9, n + 7)  # rows with a stride past their length
        wide[:, :n] = x
        wide[:, n:] = float("nan")
        assert native.argmax_rows(built, wide[:, :n]) == got


def test_no_cpu_keeps_gemm_panels(lib: ctypes.CDLL, avx2: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> None:
    """A projection keeps its blocks alone, with AVX-512 VNNI and without (where the fp32 GEMM dequantizes its panels
    as it goes): no fp32 copy even when given its fp32 weight, and its products are the blocks' values, not that
    weight's. 4-bit files load without a float copy either way (Q4_K included: its scales are kept in fp32)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 64, generator=gen)
    parts = [q4_weight(*regroup(weight))]
    for kernels in (lib, avx2):
        monkeypatch.setattr(native, "library", lambda kernels=kernels: kernels)
        layer = BlockLinear(parts, weight)
        assert layer.dense is None and not [name for name, _ in layer.named_buffers()]
        assert GGMLQuantizationType.Q4_K in quant_linear.block_only_types("int4")
        assert GGMLQuantizationType.Q4_K not in quant_linear.block_only_types("int8")
        assert torch.equal(layer.weight, dequantized(parts[0], dtype=torch.float32))
        assert not torch.equal(layer.weight, weight)
        # two levels of int16 activation codes over the blocks, or the fp32 GEMM: either way fp32 rounding
        for rows in (1, layer.max_rows + 5):
            x = torch.randn(rows, 64, generator=gen)
            reference = F.linear(x, layer.weight)
            bound = 1e-6 * (x.abs() @ layer.weight.abs().t()) + 1e-6
            assert ((layer(x) - reference).abs() <= bound).all()


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
def test_decode_attention_kernels_agree(kv_dtype: str, vnni: ctypes.CDLL, avx2: ctypes.CDLL,
                                        portable: ctypes.CDLL) -> None:
    """One query token per sequence over paged K/V in scattered blocks: the AVX-512 kernel (16 positions a group,
    head sizes that are multiples of 16), the AVX2 one (8, multiples of 8) and the portable loop all match a float64
    softmax over the cache's stored values, contexts past whole groups and a sliding window included; a head size of
    96 is a multiple of 32 (int8) and 16 but not of 64, one of 40 (fp32) of 8 but not 16."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, block = 6, 2, 16
    for head_dim in ((64, 96) if kv_dtype == "int8" else (64, 96, 40)):
        lens = [1, 15, 16, 17, 40, 100, 600]  # 600: three parts, merged
        num_blocks = sum(-(-n // block) for n in lens) + 3
        k = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen)
        v = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen)
        k_scales = v_scales = None
        if kv_dtype == "int8":
            (k, k_scales), (v, v_scales) = quantize_int8(k), quantize_int8(v)
            k_values, v_values = dequantize_int8(k, k_scales, torch.float32), dequantize_int8(v, v_scales, torch.float32)
        else:
            k, v = k.to(KV_DTYPES[kv_dtype]), v.to(KV_DTYPES[kv_dtype])
            k_values, v_values = k.float(), v.float()
        order = torch.randperm(num_blocks, generator=gen)
        width = max(-(-n // block) for n in lens)
        tables = torch.zeros(len(lens), width, dtype=torch.int64)
        at = 0
        for s, n in enumerate(lens):
            tables[s, :-(-n // block)] = order[at:at + -(-n // block)]
            at += -(-n // block)
        q = torch.randn(len(lens), heads, head_dim, generator=gen)
        for window in (None, 24):
            expected = torch.empty(q.shape, dtype=torch.float64)
            for s, n in enumerate(lens):
                keys = k_values[tables[s]].flatten(0, 1)[:n].double()
                values = v_values[tables[s]].flatten(0, 1)[:n].double()
                lo = 0 if window is None else max(0, n - window)
                for h in range(heads):
                    g = h // (heads // kv_heads)
                    weights = (keys[lo:, g] @ q[s, h].double() / math.sqrt(head_dim)).softmax(0)
                    expected[s, h] = weights @ values[lo:, g]
            rows = torch.arange(len(lens))
            for kernels in (vnni, avx2, portable):
                out = torch.full_like(q, float("nan"))
                native.decode_attention(kernels, q, out, rows, torch.tensor(lens), tables, rows, k, v, k_scales,
                                        v_scales, 1 / math.sqrt(head_dim), window)
                torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(5, 5, 4, 2, 16, None), (40, 40, 3, 1, 32, None), (70, 100, 4, 2, 64, None),
                                   (130, 130, 9, 3, 64, None), (100, 150, 4, 4, 48, 20), (33, 33, 2, 1, 64, 7),
                                   (1, 45, 2, 2, 32, None)],
                         ids=lambda s: "T{}-S{}-H{}-KV{}-D{}-window{}".format(*s))
def test_prefill_attention_matches_a_float64_softmax(shape: tuple, vnni: ctypes.CDLL, avx2: ctypes.CDLL) -> None:
    """Causal flash attention of T new queries (the last T of S positions) with AVX-512: queries past whole tasks
    of 64 and tiles of 8, keys past whole steps of 32, GQA, a sliding window, a chunk after earlier context; within
    fp32 rounding of a float64 softmax. Without AVX-512, or for head sizes that are not a multiple of 16, it
    declines (None), and torch's SDPA runs."""
    T, S, heads, kv_heads, head_dim, window = shape
    gen = torch.Generator().manual_seed(T * S)
    q, k, v = (torch.randn(n, h, head_dim, generator=gen) for n, h in ((T, heads), (S, kv_heads), (S, kv_heads)))
    scale = 1 / math.sqrt(head_dim)
    expected = torch.empty(T, heads, head_dim, dtype=torch.float64)
    for t in range(T):
        pos = S - T + t
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(heads):
            g = h // (heads // kv_heads)
            weights = (k[lo:pos + 1, g].double() @ q[t, h].double() * scale).softmax(0)
            expected[t, h] = weights @ v[lo:pos + 1, g].double()
    assert native.prefill_attention(avx2, q, k, v, scale, window) is None
    assert native.prefill_attention(vnni, q[..., :8], k[..., :8], v[..., :8], scale, window) is None
    out = native.prefill_attention(vnni, q, k, v, scale, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    strided = native.prefill_attention(vnni, q.transpose(0, 1).contiguous().transpose(0, 1), k, v, scale, window)
    assert torch.equal(strided, out)


@pytest.mark.parametrize("build", ["avx512", "avx2", "portable"])
def test_sampled_draws_on_every_build(build: str, vnni: ctypes.CDLL, avx2: ctypes.CDLL,
                                      portable: ctypes.CDLL) -> None:
    """nt_sample_rows on each route (its exps, sums and candidate gathering by AVX-512, AVX2 or plain C): draws at
    evenly spaced uniforms land on each token as often as the reference filter's probability."""
    kernels = {"avx512": vnni, "avx2": avx2, "portable": portable}[build]
    gen = torch.Generator().manual_seed(17)
    row = torch.randn(3001, generator=gen) * 3  # not a multiple of 16: the scalar tails too
    n = 8000
    for p in ((1.0, 0, 1.0, 0.0), (0.8, 50, 0.9, 0.0), (1.1, 0, 0.95, 0.02)):
        want = reference_distribution(row.double().numpy(), *p)
        got = grid_frequencies(kernels, row, p, n)
        assert got[want == 0].sum() == 0
        np.testing.assert_allclose(got, want, atol=1.5 / n + 1e-6, err_msg=f"{build} {p}")


def test_rowmajor_products_are_the_same_bits_everywhere(lib: ctypes.CDLL, vnni: ctypes.CDLL, avx2: ctypes.CDLL,
                                                        portable: ctypes.CDLL) -> None:
    """The fp32 route's products (matmul_rowmajor): within fp32 rounding of a float64 product, and the same bits
    for any thread count, for a row alone or in any batch, on every build (portable, AVX2, the host's): a run
    repeats exactly. Input sizes past whole vectors of 8, output counts past whole tiles, rows of any stride."""
    gen = torch.Generator().manual_seed(11)
    for n, k in ((1, 7), (5, 32), (33, 100), (640, 2048)):
        w = torch.randn(n, k + 2, generator=gen)[:, 1:1 + k]  # rows with a stride of their own
        x = torch.randn(9, k, generator=gen)
        expected = x.double() @ w.double().t()
        reference = native.matmul_rowmajor(portable, x, w)
        bound = 1e-6 * (x.abs().double() @ w.abs().double().t()) + 1e-7
        assert ((reference.double() - expected).abs() <= bound).all(), (n, k)
        for kernels in (lib, vnni, avx2, portable):
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                try:
                    assert torch.equal(native.matmul_rowmajor(kernels, x, w), reference), (n, k, threads)
                    for rows in (slice(0, 1), slice(3, 4), slice(2, 7)):
                        assert torch.equal(native.matmul_rowmajor(kernels, x[rows], w), reference[rows])
                finally:
                    torch.set_num_threads(2)
    with pytest.raises(ValueError, match="does not meet"):
        native.matmul_rowmajor(lib, torch.randn(2, 8), torch.randn(3, 9))


def test_decode_attention_is_the_same_bits_for_any_threads_and_batch(lib: ctypes.CDLL) -> None:
    """A sequence's decode attention does not depend on the thread count or on the other sequences of its batch:
    contexts split in parts (long ones), shared out by heads (short ones at small batches), or whole."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, block = 4, 2, 64, 16
    lens = [3, 40, 300, 700, 1500]
    width = max(-(-n // block) for n in lens)
    num_blocks = width * len(lens)
    k = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, block, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).reshape(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)

    def attend(seqs: list[int], threads: int, window: int | None) -> torch.Tensor:
        out = torch.full((len(seqs), heads, head_dim), float("nan"))
        index = torch.tensor(seqs)
        torch.set_num_threads(threads)
        try:
            native.decode_attention(lib, q[index].contiguous(), out, torch.arange(len(seqs)),
                                    torch.tensor([lens[s] for s in seqs]), tables, index, k, v, None, None,
                                    1 / math.sqrt(head_dim), window)
        finally:
            torch.set_num_threads(2)
        return out

    for window in (None, 512):
        batch = attend(list(range(len(lens))), 2, window)
        for threads in (1, 2, 3):
            assert torch.equal(attend(list(range(len(lens))), threads, window), batch), threads
            for s in range(len(lens)):
                assert torch.equal(attend([s], threads, window)[0], batch[s]), (s, threads, window)

"""The native kernels' Python entry points under generated shapes and block contents (hypothesis): every block format,
row and column counts off every tile and panel edge, input sizes of 1 to 48 blocks, strided rows, 1-3 threads, codes
over their whole range and scales with zeros among them. Each result is held to a float64 product over the
dequantized weight; inputs the kernels cannot take raise ValueError before any pointer reaches C. Run under
AddressSanitizer and UndefinedBehaviorSanitizer by tests/unit/test_sanitized.py, which is where an out-of-bounds
access would show.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nextoken.ops import native
from nextoken.loader.codec import pack_nibbles
from nextoken.ops.quant_linear import NIBBLE_KINDS, Q4, Q4_F32, Q8, Q8_HALVES, BlockWeight

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def random_part(kind: int, n: int, k: int, seed: int) -> BlockWeight:
    """Codes over the format's whole range; scales of mixed size, one in five zero (their blocks contribute 0)."""
    gen = torch.Generator().manual_seed(seed)
    _, _, scale_dtype, group = native.BLOCK_FORMATS[kind]
    scales = torch.rand(n, k // group, generator=gen) * 10 ** torch.randint(-3, 2, (n, k // group), generator=gen)
    scales[torch.rand(n, k // group, generator=gen) < 0.2] = 0
    if kind in NIBBLE_KINDS:
        codes = pack_nibbles(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8))
        offsets = -scales * torch.randint(0, 16, scales.shape, generator=gen)
        return BlockWeight(kind, codes, scales.to(scale_dtype), offsets.to(scale_dtype))
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return BlockWeight(kind, codes, scales.to(scale_dtype))


def dequantized(part: BlockWeight, magnitude: bool = False, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The weight a part holds, d q + m (in `dtype`: fp32 rounds d q, then the sum, as the kernels do); with
    `magnitude`, |d q| + |m|: the size of the terms the kernels sum in fp32 (a Q4 weight near 0 can be two large
    terms that cancel), to which their rounding is relative."""
    group = native.BLOCK_FORMATS[part.kind][3]
    if part.kind in NIBBLE_KINDS:
        blocks = part.qs.reshape(part.rows, -1, 16)
        codes = torch.cat((blocks & 0x0F, blocks >> 4), dim=2).reshape(part.rows, -1).to(dtype)
    else:
        codes = part.qs.to(dtype)
    w = (codes.unflatten(1, (-1, group)) * part.d.to(dtype).unsqueeze(-1)).flatten(1)
    if part.m is not None:
        m = part.m.to(dtype).repeat_interleave(group, dim=1)
        w = w.abs() + m.abs() if magnitude else w + m
    return w.abs() if magnitude else w


products = st.fixed_dictionaries({
    "kind": st.sampled_from([Q4, Q4_F32, Q8, Q8_HALVES]),
    "n": st.integers(1, 70),
    "blocks": st.integers(1, 48),
    "rows": st.integers(1, 24),
    "pad": st.integers(0, 5),  # extra columns of x's rows: a row stride that is not k
    "threads": st.integers(1, 3),
    "gemm": st.booleans(),
    "seed": st.integers(0, 2**31 - 1),
})


@SETTINGS
@given(case=products)
def test_block_products_hold_for_any_shape(lib: ctypes.CDLL, case: dict) -> None:
    k = 32 * case["blocks"]
    part = random_part(case["kind"], case["n"], k, case["seed"])
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(case["rows"], k + case["pad"], generator=gen)[:, :k]
    x[:, torch.randint(0, k, (1,), generator=gen)] *= 1000  # one loud column
    out = torch.full((case["rows"], case["n"] + 2), float("nan"))
    torch.set_num_threads(case["threads"])
    try:
        native.block_matmul(lib, part.kind, x, part.qs, part.d, part.m, out[:, 1:-1], gemm=case["gemm"])
    finally:
        torch.set_num_threads(2)
    assert out[:, 0].isnan().all() and out[:, -1].isnan().all()  # nothing written past the view
    expected = x.double() @ dequantized(part).t()
    bound = 1e-5 * (x.double().abs() @ dequantized(part, magnitude=True).t()) + 1e-5
    assert ((out[:, 1:-1].double() - expected).abs() <= bound).all()


@SETTINGS
@given(kinds=st.lists(st.sampled_from([Q4, Q4_F32, Q8, Q8_HALVES]), min_size=1, max_size=4),
       rows=st.lists(st.integers(1, 40), min_size=4, max_size=4), blocks=st.integers(1, 24),
       seed=st.integers(0, 2**31 - 1))
def test_panels_from_any_stack_of_parts(lib: ctypes.CDLL, kinds: list[int], rows: list[int], blocks: int,
                                        seed: int) -> None:
    """Parts of any formats and row counts (panels shared by neighbouring parts, a last partial panel) dequantize
    into exactly the panels of their stacked weight."""
    k = 32 * blocks
    parts = [random_part(kind, n, k, seed + i) for i, (kind, n) in enumerate(zip(kinds, rows))]
    weight = torch.cat([dequantized(p, dtype=torch.float32) for p in parts])
    panels = native.pack_blocks(lib, [(p.kind, p.qs, p.d, p.m) for p in parts], weight.shape[0], k)
    assert torch.equal(panels, native.pack(lib, weight))


@SETTINGS
@given(rows=st.integers(1, 20), n=st.integers(1, 70), k=st.integers(1, 300), pad=st.integers(0, 3),
       threads=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_rowmajor_products_hold_for_any_shape(lib: ctypes.CDLL, rows: int, n: int, k: int, pad: int, threads: int,
                                              seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + pad, generator=gen)[:, :k]
    w = torch.randn(n, k + pad, generator=gen)[:, :k]
    torch.set_num_threads(threads)
    try:
        out = native.matmul_rowmajor(lib, x, w)
    finally:
        torch.set_num_threads(2)
    bound = 1e-5 * (x.double().abs() @ w.double().abs().t()) + 1e-6
    assert ((out.double() - x.double() @ w.double().t()).abs() <= bound).all()


@pytest.mark.parametrize("kind", [Q4, Q4_F32, Q8, Q8_HALVES])
def test_blocks_that_do_not_fit_are_refused_before_c(lib: ctypes.CDLL, kind: int) -> None:
    """Every mismatch between the blocks and the format, the input size or the output is a ValueError naming it."""
    part = random_part(kind, 8, 64, 0)
    x, out = torch.randn(2, 64), torch.empty(2, 8)
    m_like = part.m if part.m is not None else part.d
    bad = {
        "scales": (part.qs, part.d[:, :-1].contiguous(), part.m),
        "codes": (part.qs[:, :-1].contiguous(), part.d, part.m),
        "float32" if part.d.dtype == torch.float16 else "float16":
            (part.qs, part.d.to(torch.float32 if part.d.dtype == torch.float16 else torch.float16), part.m),
        "offsets" if kind in NIBBLE_KINDS else "no offsets": (part.qs, part.d, None if part.m is not None else m_like),
    }
    for what, (qs, d, m) in bad.items():
        with pytest.raises(ValueError, match="block_matmul: format"):
            native.block_matmul(lib, kind, x, qs, d, m, out)
        del what
    with pytest.raises(ValueError, match="input size 48"):
        native.block_matmul(lib, kind, torch.randn(2, 48), part.qs, part.d, part.m, out)
    with pytest.raises(ValueError, match="out"):
        native.block_matmul(lib, kind, x, part.qs, part.d, part.m, torch.empty(2, 7))
    with pytest.raises(ValueError, match="unknown block format 7"):
        native.block_matmul(lib, 7, x, part.qs, part.d, part.m, out)
    with pytest.raises(ValueError, match="pack_blocks: format"):
        native.pack_blocks(lib, [(kind, part.qs, part.d[:, :-1].contiguous(), part.m)], 8, 64)

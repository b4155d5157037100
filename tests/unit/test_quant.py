"""Block-quantized weights: codes read from every supported GGUF block type reproduce the loader's (ggml-exact)
dequantization; `BlockLinear` matches a dense matmul over those weights on the native kernels, the torch int4
fallback and the dense path; the int8 head keeps the fp32 head's best logits exactly."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from nextoken.loader.codec import (dequantize, pack_nibbles, q4_codes, q4_nibbles, q5_codes, q6_codes, q8_0_codes,
                                   unpack_nibbles)
from nextoken.ops import native
from nextoken.ops.quant_head import BlockEmbedding, Int8GroupHead
from nextoken.ops.quant_linear import (EXACT_PANEL_TYPES, NATIVE_MAX_ROWS, Q4, Q4_F32, Q8, VNNI_MAX_ROWS,
                                        Q8_HALVES, BlockLinear, BlockWeight, q4_weight, q8_weight)
from nextoken.ops.quantize import q8_codes, regroup

_Q = GGMLQuantizationType


def random_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw blocks of `qtype` (random codes and scales; every fp16 field a sane positive number)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    halves = {_Q.Q4_K: (0, 2), _Q.Q6_K: (208,)}[qtype]
    for at in halves:
        raw[:, at:at + 2] = rng.uniform(0.001, 0.05, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(-1)


def rebuild_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)


def rebuild_q8(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return codes.float() * d.float().repeat_interleave(codes.shape[1] // d.shape[1], 1)


@pytest.mark.parametrize("qtype", [_Q.Q4_0, _Q.Q4_1, _Q.Q4_K])
def test_q4_codes_reproduce_dequantized_weights(qtype: GGMLQuantizationType) -> None:
    rows, cols = 48, 256
    if qtype == _Q.Q4_K:
        raw = random_blocks(qtype, rows, cols)
    else:
        raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32),
                                   qtype).reshape(-1)
    expected = dequantize(raw, qtype, (rows, cols))
    codes, d, m = q4_codes(raw, qtype, (rows, cols))
    assert int(codes.max()) <= 15
    torch.testing.assert_close(rebuild_q4(codes, d, m), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("unpacker", ["native", "numpy"])
def test_q5_0_and_q6_k_and_q8_0_codes_are_exact(unpacker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Codes and scales reproduce the loader's (ggml-exact) weights, unpacked in C or, without the native kernels,
    by numpy."""
    if unpacker == "numpy":
        monkeypatch.setattr(native, "library", lambda: None)
    else:
        assert native.library() is not None
    rows, cols = 24, 256
    weight = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
    for qtype in (_Q.Q5_0, _Q.Q8_0, _Q.Q6_K):
        raw = random_blocks(qtype, rows, cols) if qtype == _Q.Q6_K else gguf.quants.quantize(weight, qtype).reshape(-1)
        expected = dequantize(raw, qtype, (rows, cols))
        if qtype == _Q.Q5_0:
            codes, d = q5_codes(raw, (rows, cols))
        elif qtype == _Q.Q6_K:
            codes, d = q6_codes(raw, (rows, cols))
            assert d.shape == (rows, cols // 16) and int(codes.min()) >= -32 and int(codes.max()) <= 31
        else:
            codes, d = q8_codes(raw, qtype, expected)
        torch.testing.assert_close(rebuild_q8(codes, d), expected, rtol=0, atol=1e-7)


def test_q4_k_codes_are_not_taken_from_other_types() -> None:
    raw = gguf.quants.quantize(np.ones((4, 32), np.float32), _Q.Q8_0).reshape(-1)
    assert q4_codes(raw, _Q.Q8_0, (4, 32)) is None


def test_regroup_error_is_within_half_a_step() -> None:
    w = torch.randn(16, 64)
    codes, d, m = regroup(w)
    assert ((rebuild_q4(codes, d, m) - w).abs() <= d.repeat_interleave(32, 1) / 2 + 1e-6).all()


def test_q8_codes_from_floats_stay_within_half_a_step() -> None:
    w = torch.randn(40, 96) * torch.logspace(-3, 1, 40)[:, None]
    codes, d = q8_codes(None, None, w)
    assert int(codes.abs().max()) <= 127
    assert ((rebuild_q8(codes, d) - w).abs() <= d.repeat_interleave(32, 1) / 2 + 1e-6).all()


def mixed_projection(seed: int = 0, cols: int = 96) -> tuple[BlockLinear, torch.Tensor]:
    """A fused projection of three parts: Q4 rows, Q8 rows and Q8-in-halves rows (as a Q4_K_M QKV can be)."""
    gen = torch.Generator().manual_seed(seed)
    q4 = regroup(torch.randn(43, cols, generator=gen))  # 43, 21, 7: rows past whole tiles of four
    q8 = q8_codes(None, None, torch.randn(21, cols, generator=gen))
    halves = (torch.randint(-32, 32, (7, cols), generator=gen, dtype=torch.int8), torch.rand(7, cols // 16) / 10)
    dense = torch.cat((rebuild_q4(*q4), rebuild_q8(*q8), rebuild_q8(*halves)))
    parts = [q4_weight(*q4), q8_weight(*q8), q8_weight(*halves)]
    # The module keeps scales in fp16 (Q4, Q8) as the kernels read them: compare with those weights.
    exact = torch.cat((rebuild_q4(unpack_nibbles(parts[0].qs), parts[0].d.float(), parts[0].m.float()),
                       rebuild_q8(parts[1].qs, parts[1].d), rebuild_q8(parts[2].qs, parts[2].d)))
    assert (exact - dense).abs().max() < 1e-2  # only fp16 rounding of the scales
    return BlockLinear(parts, exact), exact


@pytest.mark.parametrize("cols", [96, 320])  # 3 or 10 blocks per row: scales one by one, or in vectors and a last one
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, NATIVE_MAX_ROWS, VNNI_MAX_ROWS])
def test_block_linear_matches_dense_on_native_kernels(rows: int, cols: int) -> None:
    layer, dense = mixed_projection(cols=cols)
    assert layer.lib is not None and [p.kind for p in layer.parts] == [Q4, Q8, Q8_HALVES]
    x = torch.randn(rows, cols) * 3
    expected = F.linear(x.double(), dense.double())
    # two levels of activation codes: each activation moves by at most 2^-24 of its block's largest, so the error is
    # well under 5e-5 of the sum of the products' sizes (that of bf16 activations is about 4e-3).
    bound = F.linear(x.abs().double(), dense.abs().double()) * 5e-5
    assert ((layer(x).double() - expected).abs() <= bound).all()


def exact_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, seed: int) -> tuple[BlockWeight, torch.Tensor]:
    """File blocks of `qtype` as the loader converts them without a float weight, and their dequantized weight."""
    raw = (random_blocks(qtype, rows, cols, seed) if qtype in (_Q.Q4_K, _Q.Q6_K) else gguf.quants.quantize(
        np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32), qtype).reshape(-1))
    if qtype in (_Q.Q4_0, _Q.Q4_1, _Q.Q4_K):
        block = q4_weight(*q4_codes(raw, qtype, (rows, cols)))  # type: ignore[misc]
    else:
        codes = {_Q.Q5_0: q5_codes, _Q.Q6_K: q6_codes, _Q.Q8_0: q8_0_codes}[qtype](raw, (rows, cols))
        block = q8_weight(*codes)
    return block, dequantize(raw, qtype, (rows, cols))


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_exact_blocks_give_the_panels_without_an_fp32_copy(quant: str) -> None:
    """A fused projection of every type whose blocks hold the weight exactly (int4: Q4_0, Q4_1, Q4_K, Q5_0, Q6_K,
    Q8_0; int8: the 5-, 6- and 8-bit ones): without its fp32 weight, the GEMM panels dequantized from the blocks are
    bit-identical to those packed from the loader's dequantization, panels shared by two parts included."""
    lib = native.library()
    assert lib is not None
    # neighbours of one kernel format merge into one part (at most four parts): Q6_K before the two Q8 ones
    types = [t for t in (_Q.Q4_0, _Q.Q4_1, _Q.Q4_K, _Q.Q6_K, _Q.Q5_0, _Q.Q8_0) if t in EXACT_PANEL_TYPES[quant]]
    assert set(types) == set(EXACT_PANEL_TYPES[quant])
    made = [exact_blocks(qtype, rows, 256, seed=rows) for qtype, rows in zip(types, (13, 21, 11, 7, 18, 5))]
    if quant == "int4":
        assert made[2][0].kind == Q4_F32  # Q4_K: its scales need fp32
    weight = torch.cat([w for _, w in made])
    layer = BlockLinear([b for b, _ in made], None, tuple(weight.shape))
    panels = native.pack_blocks(lib, [(p.kind, p.qs, p.d, p.m) for p in layer.parts], weight.shape[0], 256)
    assert layer.dense is None and torch.equal(panels, native.pack(lib, weight))
    assert torch.equal(layer.weight, weight)
    x = torch.randn(layer.max_rows + 3, 256, generator=torch.Generator().manual_seed(1))
    # Two fp32 GEMMs summing in different orders: apart by rounding, relative to the size of the products' sum.
    bound = F.linear(x.abs().double(), weight.abs().double()) * 1e-5
    assert ((layer(x).double() - F.linear(x.double(), weight.double())).abs() <= bound).all()
    with pytest.raises(ValueError, match="rows"):
        native.pack_blocks(lib, [(p.kind, p.qs, p.d, p.m) for p in layer.parts], weight.shape[0] + 1, 256)


def test_a_projection_keeps_only_its_blocks() -> None:
    """On every CPU a projection keeps neither GEMM panels nor its fp32 weight, even when given one. Batches past
    the block kernels take the GEMM over the blocks: the int16 one with AVX-512 VNNI, else the fp32 one over panels
    each thread dequantizes as it goes, with the bits of the fp32 GEMM over panels packed from the weight (its own
    sums); `weight` dequantizes the blocks."""
    layer, exact = mixed_projection()
    assert layer.dense is None and not [name for name, _ in layer.named_buffers()]
    assert torch.equal(layer.weight, exact)
    vnni = bool(native.library().nt_has_vnni512())
    panels = native.pack(layer.lib, exact)
    for rows in (1, layer.max_rows, layer.max_rows + 1, 40):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
        bound = 3e-5 * (x.abs() @ exact.abs().t()) + 1e-6
        assert ((layer(x) - F.linear(x, exact)).abs() <= bound).all()
        if rows > layer.max_rows and not vnni:
            expected = torch.empty(rows, exact.shape[0])
            native.sgemm(layer.lib, x, panels, exact.shape[0], expected)
            assert torch.equal(layer(x), expected)


def test_block_linear_without_its_weight_needs_the_native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    block, weight = exact_blocks(_Q.Q8_0, 8, 64, seed=0)
    monkeypatch.setattr(native, "library", lambda: None)
    with pytest.raises(ValueError, match="native kernels"):
        BlockLinear([block], None, tuple(weight.shape))


def test_block_linear_takes_a_gemm_for_large_batches() -> None:
    """More than max_rows rows: the GEMM over the blocks (with AVX-512 VNNI two levels of activation codes: within
    their rounding, like the block kernels; without, fp32 over rows dequantized from the blocks)."""
    layer, dense = mixed_projection()
    for x in [torch.randn(rows, 96) for rows in (layer.max_rows + 1, 96)]:
        bound = 3e-5 * (x.abs() @ dense.abs().t()) + 1e-6
        assert ((layer(x) - F.linear(x, dense)).abs() <= bound).all()


def test_block_linear_falls_back_to_torch_int4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "library", lambda: None)
    codes, d, m = regroup(torch.randn(96, 128))
    part = q4_weight(codes, d, m)
    dense = rebuild_q4(unpack_nibbles(part.qs), part.d.float(), part.m.float())
    layer = BlockLinear([part], dense)
    assert layer.lib is None and layer.max_rows > 0
    few = torch.randn(3, 128)
    # bf16 activations, scales and output: errors of a few parts in a thousand of the outputs.
    torch.testing.assert_close(layer(few), F.linear(few, dense), rtol=2e-2, atol=0.15)
    mixed, exact = mixed_projection()
    assert mixed.max_rows == 0 and torch.equal(mixed(few[:, :96]), F.linear(few[:, :96], exact))


def _int8_head(vocab: int, hidden: int, exact_blocks: bool, num_exact: int,
               gen: torch.Generator) -> tuple[Int8GroupHead, torch.Tensor]:
    """A random head as Int8GroupHead and its dense fp32 weight: the file's own Q8_0 blocks (no float weight), or
    blocks requantized from the float weight."""
    w = torch.randn(vocab, hidden, generator=gen) * 0.05
    if not exact_blocks:
        return Int8GroupHead(*q8_codes(None, None, w), w, num_exact=num_exact), w
    raw = gguf.quants.quantize(w.numpy(), _Q.Q8_0).reshape(-1)
    dense = dequantize(raw, _Q.Q8_0, (vocab, hidden))  # the head as the file stores it
    return Int8GroupHead(*q8_0_codes(raw, (vocab, hidden)), num_exact=num_exact), dense


@pytest.mark.parametrize("exact_blocks", [False, True], ids=["requantized", "file-blocks"])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_int8_group_head_rescores_its_best_candidates_exactly(kernels: str, exact_blocks: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Requantized blocks rescore from the float weight; the file's own Q8_0 blocks (no float weight) from
    themselves. Either way the best logits are the fp32 head's."""
    if kernels == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    gen = torch.Generator().manual_seed(0)
    hidden = 128
    head, dense = _int8_head(4096, hidden, exact_blocks, 32, gen)
    x = torch.randn(4, hidden, generator=gen) * 3
    exact = F.linear(x, dense)
    out = head(x)
    # bf16 activations on torch's kernel; int8 rounding of the weights where requantized.
    bound = 1e-3 if kernels == "native" and exact_blocks else 0.06
    torch.testing.assert_close(out, exact, rtol=0, atol=bound)
    # The 32 best by the cheap pass are recomputed in fp32 (near its boundary one may swap with the 33rd), unless
    # the native pass ran over the file's own blocks, which is as close already: greedy and the top log-probs match
    # the dense head.
    top = exact.topk(16, dim=-1).indices
    close = 2e-4 if kernels == "native" and exact_blocks else 1e-5
    torch.testing.assert_close(out.gather(1, top), exact.gather(1, top), rtol=close, atol=close)
    assert torch.equal(out.argmax(-1), exact.argmax(-1))
    # Batches bound by compute: a GEMM over the blocks when exact (the native one from gemm_rows rows on, with
    # AVX-512 VNNI on two levels of activation codes; else fp32 over vocabulary slices), over the float weight past
    # the cheap pass's rows.
    monkeypatch.setattr(Int8GroupHead, "VOCAB_SLICE", 1000)  # slices that do not divide the vocabulary
    sizes = [head.gemm_rows, head.gemm_rows + 7, head.max_rows + 1] if head.lib is not None else [head.max_rows + 1]
    for rows in sizes:
        many = torch.randn(rows, hidden, generator=gen)
        if rows <= head.max_rows and not exact_blocks:  # requantized: the cheap pass and its rescoring
            assert torch.equal(head(many).argmax(-1), F.linear(many, dense).argmax(-1))
        elif exact_blocks and head.lib is not None:  # the native GEMM over the blocks (exact codes with VNNI)
            bound = 3e-5 * (many.abs() @ dense.abs().t()) + 1e-5
            assert ((head(many) - F.linear(many, dense)).abs() <= bound).all()
        else:
            torch.testing.assert_close(head(many), F.linear(many, dense), rtol=1e-5, atol=1e-5)


def test_int8_group_head_takes_int8_activations_from_gemm_rows() -> None:
    """With activations "int8", the head over the file's blocks runs its GEMM rows (from gemm_rows) on int8
    activation codes (nt_block_gemm8), and fewer rows on the int16 block kernels as before."""
    lib = native.library()
    if lib is None or not lib.nt_has_vnni512():
        pytest.skip("without AVX-512 VNNI int8 activations change nothing (test_native checks that)")
    gen = torch.Generator().manual_seed(2)
    head, _ = _int8_head(512, 128, True, 8, gen)
    few, many = torch.randn(3, 128, generator=gen), torch.randn(head.gemm_rows + 2, 128, generator=gen)
    int16 = head(few), head(many)
    head.activations = "int8"
    assert torch.equal(head(few), int16[0])
    expected = torch.empty_like(int16[1])
    native.block_matmul(lib, Q8, many, head.blocks.qs, head.blocks.d, None, expected, gemm=True,
                        int8_activations=True)
    assert torch.equal(head(many), expected) and not torch.equal(expected, int16[1])


@pytest.mark.parametrize("exact_blocks", [False, True], ids=["requantized", "file-blocks"])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_int8_group_head_writes_into_a_given_buffer(kernels: str, exact_blocks: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every route of the head (the cheap pass and its rescoring, the GEMM over the blocks, the float GEMM) fills
    the first rows of a given buffer with what it returns without one."""
    if kernels == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    gen = torch.Generator().manual_seed(1)
    vocab, hidden = 1000, 64
    head, _ = _int8_head(vocab, hidden, exact_blocks, 8, gen)
    buffer = torch.full((head.max_rows + 4, vocab), float("nan"))
    for rows in sorted({1, 3, head.gemm_rows + 1, head.max_rows + 1}):
        x = torch.randn(rows, hidden, generator=gen)
        out = head(x, buffer)
        assert out.data_ptr() == buffer.data_ptr()
        assert torch.equal(out, head(x)) and out.shape == (rows, vocab)


def test_block_embedding_rows_are_the_files_values() -> None:
    vocab, hidden = 300, 96
    w = np.random.default_rng(3).standard_normal((vocab, hidden)).astype(np.float32)
    raw = gguf.quants.quantize(w, _Q.Q8_0).reshape(-1)
    table = BlockEmbedding(*q8_0_codes(raw, (vocab, hidden)))
    dense = dequantize(raw, _Q.Q8_0, (vocab, hidden))
    ids = torch.tensor([[0, 299, 7], [7, 150, 1]])
    assert torch.equal(table(ids), F.embedding(ids, dense))  # bit for bit: one rounding, d * q
    assert table.lib is not None  # a step's ids (one dimension) take the native lookup: the same values
    assert torch.equal(table(ids[0]), F.embedding(ids[0], dense))
    with pytest.raises(IndexError, match="out of range"):
        table(torch.tensor([3, vocab]))
    assert table.nbytes == raw.nbytes and table.nbytes < dense.nbytes / 3.7


@pytest.mark.parametrize("qtype", [_Q.Q4_0, _Q.Q4_1, _Q.Q4_K])
def test_q4_nibbles_are_the_codes_packed(qtype: GGMLQuantizationType) -> None:
    """The kernels' Q4 form straight from the file (Q4_0's and Q4_1's bytes as they are) is the codes, packed."""
    rows, cols = 12, 256
    raw = random_blocks(qtype, rows, cols) if qtype == _Q.Q4_K else gguf.quants.quantize(
        np.random.default_rng(2).standard_normal((rows, cols)).astype(np.float32), qtype).reshape(-1)
    codes, d, m = q4_codes(raw, qtype, (rows, cols))
    qs, d2, m2 = q4_nibbles(raw, qtype, (rows, cols))
    assert torch.equal(qs, pack_nibbles(codes)) and torch.equal(d2, d) and torch.equal(m2, m)
    assert torch.equal(unpack_nibbles(qs), codes)

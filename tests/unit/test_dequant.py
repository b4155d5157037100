"""Dequantization: bit-exact against the gguf package's numpy reference for every supported type, plus
shapes, output dtypes, read-only memmaps, chunking and the errors a bad tensor raises."""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from nextoken.errors import ModelLoadError
from nextoken.loader import codec as dequant
from nextoken.loader.codec import SUPPORTED_TYPES, dequantize, dequantize_supported

FLOAT_TYPES = [Q.F32, Q.F16, Q.BF16]
BLOCK_TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of the fp16 scale/min fields inside one block; random bytes there could be inf or NaN.
F16_FIELDS = {
    Q.Q8_0: [0],
    Q.Q4_0: [0],
    Q.Q4_1: [0, 2],
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}


def random_blocks(qtype: Q, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bytes for a block type (every bit pattern is a valid block) with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (int(np.prod(shape)) // block_size, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, off : off + 2] = scales.view(np.uint8)
    return blocks.reshape(-1)


def quantized(qtype: Q, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Realistic bytes: normal data through gguf's own quantizer (raises NotImplementedError for K-quants)."""
    data = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return data.view(np.uint8).reshape(-1)
    return np.ascontiguousarray(gguf.quants.quantize(data, qtype)).view(np.uint8).reshape(-1)


def reference(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """gguf's numpy dequantization of `raw`, as a float32 tensor of `shape`."""
    rows = raw.reshape(-1, raw.size // int(np.prod(shape[:-1])))
    if qtype == Q.F32:
        rows = rows.view(np.float32)
    out = np.asarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(shape)


def shape_for(qtype: Q, lead: tuple[int, ...], blocks_per_row: int) -> tuple[int, ...]:
    return (*lead, GGML_QUANT_SIZES[qtype][0] * blocks_per_row)


def assert_exact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert not torch.isnan(got).any()
    assert torch.equal(got, want), f"max diff {(got - want).abs().max().item()}"


def test_supported_types() -> None:
    assert SUPPORTED_TYPES == frozenset(FLOAT_TYPES + BLOCK_TYPES)
    assert dequantize_supported(Q.Q4_K) and dequantize_supported(int(Q.Q6_K))
    assert not dequantize_supported(Q.IQ2_XXS)
    assert not dequantize_supported(999)


@pytest.mark.parametrize("qtype", FLOAT_TYPES + BLOCK_TYPES[:5], ids=lambda t: t.name)
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)], ids=["row", "rows", "3d"])
def test_quantized_matches_gguf(qtype: Q, lead: tuple[int, ...]) -> None:
    shape = shape_for(qtype, lead, 64 if qtype in FLOAT_TYPES else 3)
    raw = quantized(qtype, shape)
    assert_exact(dequantize(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", BLOCK_TYPES[5:])
def test_gguf_cannot_quantize_k_quants(qtype: Q) -> None:
    # If this starts failing, gguf gained a K-quant quantizer: use it in test_quantized_matches_gguf too.
    with pytest.raises(NotImplementedError):
        quantized(qtype, (1, 256))


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("lead", [(1,), (5,), (2, 3)], ids=["row", "rows", "3d"])
def test_random_blocks_match_gguf(qtype: Q, lead: tuple[int, ...]) -> None:
    shape = shape_for(qtype, lead, 2 if GGML_QUANT_SIZES[qtype][0] == 256 else 5)
    raw = random_blocks(qtype, shape, seed=len(lead) * 10 + lead[0])
    assert_exact(dequantize(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", FLOAT_TYPES + BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_outputs_are_the_float32_result_cast(qtype: Q, dtype: torch.dtype) -> None:
    shape = shape_for(qtype, (3,), 256 if qtype in FLOAT_TYPES else 2)
    raw = quantized(qtype, shape) if qtype in FLOAT_TYPES else random_blocks(qtype, shape)
    got = dequantize(raw, qtype, shape, dtype)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, dequantize(raw, qtype, shape).to(dtype))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_chunks_with_a_short_tail(qtype: Q, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    shape = shape_for(qtype, (7,), 1)  # 7 blocks in chunks of 2
    raw = random_blocks(qtype, shape, seed=3)
    monkeypatch.setattr(dequant, "_CHUNK_ELEMS", 2 * GGML_QUANT_SIZES[qtype][0])
    assert torch.equal(dequantize(raw, qtype, shape, dtype), reference(raw, qtype, shape).to(dtype))


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_K], ids=lambda t: t.name)
def test_read_only_memmap_at_an_odd_offset(qtype: Q, tmp_path: Path) -> None:
    shape = shape_for(qtype, (4,), 32 if qtype in FLOAT_TYPES else 2)
    raw = quantized(qtype, shape) if qtype in (Q.F32, Q.F16) else random_blocks(qtype, shape)
    path = tmp_path / "model.bin"
    path.write_bytes(b"x" * 7 + raw.tobytes() + b"y" * 5)
    region = np.memmap(path, dtype=np.uint8, mode="r")[7 : 7 + raw.size]
    assert not region.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dequant._as_bytes(region).data_ptr() == region.ctypes.data  # wrapped, not copied
        got = dequantize(region, qtype, shape)
    assert_exact(got, reference(raw, qtype, shape))
    got.add_(1.0)  # the result owns its memory
    assert path.read_bytes() == b"x" * 7 + raw.tobytes() + b"y" * 5
    del region


def test_result_never_aliases_the_input() -> None:
    raw = quantized(Q.F32, (2, 8))
    got = dequantize(raw, Q.F32, (2, 8))
    got.zero_()
    assert np.array_equal(raw, quantized(Q.F32, (2, 8)))
    assert not torch.equal(got, reference(raw, Q.F32, (2, 8)))


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q5_0], ids=lambda t: t.name)
def test_torch_input_with_an_odd_storage_offset(qtype: Q) -> None:
    shape = shape_for(qtype, (2,), 32 if qtype in FLOAT_TYPES else 2)
    raw = quantized(qtype, shape)
    buf = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buf[1:] = torch.from_numpy(raw)
    assert_exact(dequantize(buf[1:], qtype, shape), reference(raw, qtype, shape))


def test_gguf_reader_style_row_arrays() -> None:
    # GGUFReader hands quantized tensors over as (rows, bytes per row) and F32 ones as float32 arrays.
    raw = random_blocks(Q.Q4_0, (3, 64))
    assert_exact(dequantize(raw.reshape(3, 36), Q.Q4_0, (3, 64)), reference(raw, Q.Q4_0, (3, 64)))
    floats = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert torch.equal(dequantize(floats, Q.F32, (2, 3)), torch.from_numpy(floats))


def test_empty_tensor() -> None:
    assert dequantize(np.zeros(0, np.uint8), Q.Q8_0, (0, 32)).shape == (0, 32)


def test_unsupported_type_names_the_type_and_tensor() -> None:
    with pytest.raises(ModelLoadError, match="IQ2_XXS") as info:
        dequantize(np.zeros(66, np.uint8), Q.IQ2_XXS, (1, 256), name="blk.0.attn_q.weight")
    assert info.value.path == "blk.0.attn_q.weight"
    assert str(info.value).startswith("cannot load model file blk.0.attn_q.weight: unsupported tensor type IQ2_XXS")
    with pytest.raises(ModelLoadError, match="999"):
        dequantize(np.zeros(4, np.uint8), 999, (1,))  # type: ignore[arg-type]


def test_wrong_byte_count_names_expected_and_actual() -> None:
    with pytest.raises(ModelLoadError, match=r"Q8_0 tensor of shape \(2, 64\) needs 136 bytes, got 135") as info:
        dequantize(np.zeros(135, np.uint8), Q.Q8_0, (2, 64), name="token_embd.weight")
    assert info.value.path == "token_embd.weight"
    with pytest.raises(ModelLoadError, match="needs 24 bytes, got 32"):
        dequantize(torch.zeros(32, dtype=torch.uint8), Q.F16, (3, 4))


def test_row_not_a_multiple_of_the_block_size() -> None:
    with pytest.raises(ModelLoadError, match="row length 100 .* not a multiple of the Q4_K block size 256"):
        dequantize(np.zeros(144, np.uint8), Q.Q4_K, (1, 100))
    with pytest.raises(ModelLoadError, match="row length 48 .* Q4_0 block size 32"):
        dequantize(np.zeros(36, np.uint8), Q.Q4_0, (2, 48))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_into_the_rows_of_a_given_tensor(dtype: torch.dtype) -> None:
    """`out`: a fused projection's parts decode straight into their rows, the values a fresh tensor gets."""
    shapes = [(3, 64), (5, 64)]
    raws = [random_blocks(Q.Q4_1, shape, seed=i) for i, shape in enumerate(shapes)]
    stacked = torch.full((8, 64), float("nan"), dtype=dtype)
    assert dequantize(raws[0], Q.Q4_1, shapes[0], dtype, out=stacked[:3]).data_ptr() == stacked.data_ptr()
    dequantize(raws[1], Q.Q4_1, shapes[1], dtype, out=stacked[3:])
    assert torch.equal(stacked, torch.cat([dequantize(r, Q.Q4_1, s, dtype) for r, s in zip(raws, shapes)]))
    with pytest.raises(ValueError, match="needs a contiguous"):
        dequantize(raws[0], Q.Q4_1, shapes[0], dtype, out=stacked[:3, :32])

"""The block formats on CUDA (ops/cuda_blocks.py): the Triton kernel over the file's blocks gives fp32's products with
the file's weights, for every block type and fused mixes of them, at decode and prefill row counts; a whole model in
int4 and int8 through it matches the same model in fp32. On a machine without a GPU the kernel runs under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET), on one with a GPU compiled, on the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from nextoken import LLM, SamplingParams
from nextoken.engine.runner import resolve_weights
from nextoken.errors import NextokenError
from nextoken.loader.gguf import read_gguf
from nextoken.config import EngineConfig
from nextoken.ops import cuda_blocks
from nextoken.ops.quant_linear import Q4, Q4_F32, Q8, Q8_HALVES, BlockLinear, BlockWeight
from nextoken.ops.quantize import WeightFormats
from tests.tiny import write_tiny_model
from tests.unit.test_quant import exact_blocks

_Q = GGMLQuantizationType
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TYPES = (_Q.Q4_0, _Q.Q4_1, _Q.Q4_K, _Q.Q6_K, _Q.Q5_0, _Q.Q8_0)


@pytest.mark.parametrize("rows", [1, 5, 40])  # the vector kernel (up to 16 rows), the dot one (tiles of 32 rows)
def test_blocks_give_fp32_products_with_the_files_weights(rows: int) -> None:
    """A fused projection of every block type (Q4_0 / Q4_1 as fp16 scales, Q4_K as fp32 ones, Q6_K in halves, Q5_0
    and Q8_0 as int8 codes), weight rows past whole tiles: its products are the loader's dequantized weights' within
    fp32 rounding, and its weight is theirs."""
    made = [exact_blocks(qtype, n, 256, seed=n) for qtype, n in zip(TYPES, (13, 21, 11, 7, 18, 37))]
    layer = BlockLinear([b.to(DEVICE) for b, _ in made], None, (107, 256), kernels="triton")
    assert [p.kind for p in layer.parts] == [Q4, Q4_F32, Q8_HALVES, Q8]
    weight = torch.cat([w for _, w in made])
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)) * 3
    out = layer(x.to(DEVICE))
    assert out.dtype == torch.float32 and out.device.type == DEVICE.type
    expected = F.linear(x.double(), weight.double())
    bound = F.linear(x.abs().double(), weight.abs().double()) * 1e-6  # fp32 sums of 256 products: about 1e-7
    assert ((out.cpu().double() - expected).abs() <= bound).all()
    torch.testing.assert_close(layer.weight.cpu(), weight, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rows", [3, 20])  # each kernel
def test_activations_of_any_float_dtype_are_read_as_fp32(rows: int) -> None:
    """bf16 activations, and a width (96) that leaves the last tile of inputs partly filled."""
    block, weight = exact_blocks(_Q.Q4_1, 40, 96, seed=3)
    layer = BlockLinear([block.to(DEVICE)], None, (40, 96), kernels="triton")
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    expected = F.linear(x.double(), weight.double())
    bound = F.linear(x.abs().double(), weight.abs().double()) * 1e-6
    assert ((layer(x.to(DEVICE)).cpu().double() - expected).abs() <= bound).all()
    with pytest.raises(ValueError, match="contiguous"):
        cuda_blocks.block_matmul(x.to(DEVICE).t(), Q4, block.qs, block.d, block.m, torch.empty(96, 40))


@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from([Q4, Q4_F32, Q8, Q8_HALVES]), rows=st.integers(1, 40), out_rows=st.integers(1, 70),
       blocks=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_any_shape_gives_fp32_products(kind: int, rows: int, out_rows: int, blocks: int, seed: int) -> None:
    """Any rows (both kernels), weight rows and width in blocks of 32 (tiles partly filled on every side), any block
    format with random codes and scales: the products of the weights `dequantize` gives, within fp32 rounding."""
    gen = torch.Generator().manual_seed(seed)
    cols = 32 * blocks
    if kind in (Q4, Q4_F32):
        qs = torch.randint(0, 256, (out_rows, cols // 2), dtype=torch.uint8, generator=gen)
        scale_type = torch.float16 if kind == Q4 else torch.float32
        d = (torch.rand(out_rows, blocks, generator=gen) / 20).to(scale_type)
        m = (-torch.rand(out_rows, blocks, generator=gen) / 5).to(scale_type)
    else:
        qs = torch.randint(-127, 128, (out_rows, cols), dtype=torch.int8, generator=gen)
        groups = 2 * blocks if kind == Q8_HALVES else blocks
        d = (torch.rand(out_rows, groups, generator=gen) / 200).to(torch.float32 if kind == Q8_HALVES else torch.float16)
        m = None
    part = BlockWeight(kind, qs, d, m).to(DEVICE)
    layer = BlockLinear([part], None, (out_rows, cols), kernels="triton")
    weight = cuda_blocks.dequantize(kind, qs, d, m).double()
    x = torch.randn(rows, cols, generator=gen)
    bound = F.linear(x.abs().double(), weight.abs()) * 1e-6 + 1e-30
    assert ((layer(x.to(DEVICE)).cpu().double() - F.linear(x.double(), weight)).abs() <= bound).all()


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cuda-blocks") / "tiny-q4.gguf", "llama", projections=_Q.Q4_1)


@pytest.mark.parametrize("weights", ["int4", "int8"])  # the file's Q4_1 blocks; int8 ones requantized from them
def test_a_model_in_block_formats_matches_fp32(weights: str, tiny_q4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole model with its projections in the kernel (as on CUDA; interpreted here without a GPU): int4 keeps the
    file's Q4_1 blocks, so its log-probabilities and greedy tokens are those of fp32 weights; int8 requantizes them
    (absmax / 127 per 32), to the same codes the CPU's native kernels take, whose route it then matches."""
    prompt = list(range(3, 40))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=5, logprobs=5)
    kwargs = dict(kv_dtype="fp32", kv_cache_bytes=8 << 20, enable_prefix_caching=False)
    reference = LLM(str(tiny_q4), weights="fp32" if weights == "int4" else "int8", device="cpu", **kwargs)
    ref = reference.generate([prompt], params, use_tqdm=False)[0]
    monkeypatch.setattr(WeightFormats, "block_kernels", property(lambda self: "triton"))
    blocks = LLM(str(tiny_q4), weights=weights, device=DEVICE.type, **kwargs)
    layers = [m for m in blocks.engine.runner.model.modules() if isinstance(m, BlockLinear)]
    assert layers and all(m.kernels == "triton" and m.dense is None for m in layers)
    assert blocks.engine.runner.model.fused is None
    mine = blocks.generate([prompt], params, use_tqdm=False)[0]
    assert mine.token_ids == ref.token_ids
    worst = 0.0
    for ours, theirs in zip(mine.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert ours[0][0] == theirs[0][0]
        worst = max(worst, max(abs(a - b) for (_, a), (_, b) in zip(ours, theirs)))
    assert worst < 1e-4


def test_block_formats_on_cuda_need_triton(tiny_q4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = read_gguf(tiny_q4)
    config = EngineConfig(model=str(tiny_q4), weights="int4")
    assert resolve_weights(config, torch.device("cuda"), gguf) == "int4"
    monkeypatch.setattr(cuda_blocks, "available", lambda: False)
    with pytest.raises(NextokenError, match="weights=int4 on cuda needs CUDA and Triton"):
        resolve_weights(config, torch.device("cuda"), gguf)

"""The KV cache's storage formats: int8 codes with a fp16 scale per 32 values round-trip within half a step, bytes
per token and pool sizes follow from the format, and the engine reads a narrow cache back correctly through every
attention path (single sequence, batched decode, chunked prefill)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.cache.kv_pool import KV_GROUP, KVPool, KVShape, dequantize_int8, quantize_int8
from nextoken.errors import NextokenError


@pytest.mark.parametrize("head_dim", [64, 48, 32, 16])
def test_int8_round_trip_within_half_a_step(head_dim: int) -> None:
    x = torch.randn(5, 3, head_dim) * torch.logspace(-3, 2, 3)[None, :, None]  # heads of very different scales
    x[0, 0] = 0.0  # an all-zero group must not divide by zero
    codes, scales = quantize_int8(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert scales.shape == (5, 3, -(-head_dim // KV_GROUP))
    back = dequantize_int8(codes, scales, torch.float32)
    step = scales.float().repeat_interleave(KV_GROUP, dim=-1)[..., :head_dim]
    assert torch.all((back - x).abs() <= step / 2 + 1e-3 * step + 1e-12)
    assert torch.all(back[0, 0] == 0)
    # The largest value of each group is a code of +-127: the whole int8 range is used.
    assert int(codes.abs().amax()) == 127


@pytest.mark.parametrize(("dtype", "value_bytes"), [(torch.float32, 4 * 64), (torch.bfloat16, 2 * 64),
                                                    (torch.int8, 64 + 2 * 2)])
def test_bytes_per_token_and_pool_size(dtype: torch.dtype, value_bytes: int) -> None:
    shape = KVShape(num_layers=30, num_kv_heads=3, head_dim=64, dtype=dtype)
    assert shape.bytes_per_token == 2 * 30 * 3 * value_bytes
    pool = KVPool(shape, num_blocks=4, block_size=16, device=torch.device("cpu"))
    assert pool.nbytes == pool.num_tokens * shape.bytes_per_token


def _llm(path: Path, kv_dtype: str, **options: object) -> LLM:
    return LLM(str(path), dtype="float32", kv_dtype=kv_dtype, device="cpu", kv_cache_bytes=4 << 20, **options)


def test_same_budget_holds_more_tokens(tiny_llama: Path) -> None:
    tokens = {kv: _llm(tiny_llama, kv).engine.runner.kv_pool.num_tokens for kv in ("fp32", "bf16", "int8")}
    assert tokens["bf16"] == 2 * tokens["fp32"]
    assert 3.5 * tokens["fp32"] < tokens["int8"] <= 4 * tokens["fp32"]


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_narrow_cache_decode_close_to_fp32(tiny_llama: Path, tiny_gemma: Path, kv_dtype: str) -> None:
    """The engine end to end with a narrow cache (single and batched decode, chunked prefill, past Gemma's sliding
    window): each step's log-probs stay close to the fp32 cache's for the same tokens. These tiny random models barely
    depend on attention, so this catches wiring faults (a cache not read back, the wrong format), not rounding;
    test_attention.py checks the reads exactly."""
    tolerance = 2e-3  # measured: at most 1.1e-4 (these tiny random models barely depend on attention)
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1, ignore_eos=True)
    prompts = ["the cat sat", "in the beginning there was the word", "a"]
    for path in (tiny_llama, tiny_gemma):
        reference = _llm(path, "fp32").engine.runner
        narrow = _llm(path, kv_dtype, max_num_batched_tokens=16)
        assert narrow.engine.runner.kv_pool.layers[0].k.dtype == {"bf16": torch.bfloat16, "int8": torch.int8}[kv_dtype]
        for out in narrow.generate(prompts, params, use_tqdm=False):  # together: batched decode, chunked prefill
            full = reference.score(out.prompt_token_ids + out.token_ids).log_softmax(-1)
            n = len(out.prompt_token_ids)
            for step, (chosen, _) in enumerate(out.outputs[0].logprobs or []):
                assert abs(chosen - float(full[n - 1 + step, out.token_ids[step]])) < tolerance


def test_bad_kv_dtype_is_named() -> None:
    with pytest.raises(NextokenError, match="kv_dtype='fp8'"):
        LLM("smollm2-135m-instruct", kv_dtype="fp8")

"""Integer projections: int4 codes read from Q4_0/Q4_1 blocks reproduce the file's weights exactly; int8 codes are
within half a step of the weights; both modules match a dense matmul within bf16 rounding on the fused path and
exactly on the dense path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from nextoken.loader.dequant import dequantize
from nextoken.ops.quant_linear import (FUSED_MAX_ROWS, Int4Linear, Int8GroupHead, Int8Linear, q4_codes, q8_codes,
                                        regroup)


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_q4_codes_reproduce_dequantized_weights(qtype: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((48, 128)).astype(np.float32)
    raw = gguf.quants.quantize(weight, qtype).reshape(-1)
    expected = dequantize(raw, qtype, (48, 128))
    codes, scales, zeros = q4_codes(raw, qtype, (48, 128))
    rebuilt = (codes.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    torch.testing.assert_close(rebuilt, expected, rtol=0, atol=1e-6)


def test_other_types_are_not_read_as_q4() -> None:
    raw = gguf.quants.quantize(np.ones((4, 32), np.float32), GGMLQuantizationType.Q8_0).reshape(-1)
    assert q4_codes(raw, GGMLQuantizationType.Q8_0, (4, 32)) is None


def test_regroup_error_is_within_half_a_step() -> None:
    w = torch.randn(16, 64)
    codes, scales, zeros = regroup(w)
    rebuilt = (codes.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    assert ((rebuilt - w).abs() <= scales.repeat_interleave(32, 1) / 2 + 1e-6).all()


def test_int4_linear_fused_and_dense_paths() -> None:
    w = torch.randn(96, 128)
    codes, scales, zeros = regroup(w)
    dense = (codes.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)
    layer = Int4Linear(codes, scales, zeros, dense)
    few = torch.randn(3, 128)
    # bf16 activations, scales and output: errors of a few parts in a thousand of the outputs (~11 here).
    torch.testing.assert_close(layer(few), F.linear(few, dense), rtol=2e-2, atol=0.15)
    many = torch.randn(FUSED_MAX_ROWS + 1, 128)
    assert torch.equal(layer(many), F.linear(many, dense))


def test_int8_linear_codes_and_paths() -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 128) * torch.logspace(-2, 1, 96)[:, None]  # rows of very different scales
    layer = Int8Linear(w)
    scales = layer.scales.float()[:, None]
    assert layer.codes.dtype == torch.int8 and int(layer.codes.abs().amax()) >= 126
    assert ((layer.codes.float() * scales - w).abs() <= scales * 0.5 + 1e-6).all()
    few = torch.randn(3, 128)
    # bf16 activations and output: each product off by a few parts in a thousand of its size.
    bound = F.linear(few.abs(), w.abs()) * 2**-7
    assert ((layer(few) - F.linear(few, layer.codes.float() * scales)).abs() <= bound).all()
    many = torch.randn(FUSED_MAX_ROWS + 1, 128)
    assert torch.equal(layer(many), F.linear(many, w))


def test_q8_codes_from_blocks_and_from_floats() -> None:
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((40, 96)).astype(np.float32)
    raw = gguf.quants.quantize(weight, GGMLQuantizationType.Q8_0).reshape(-1)
    expected = dequantize(raw, GGMLQuantizationType.Q8_0, (40, 96))
    codes, scales = q8_codes(raw, GGMLQuantizationType.Q8_0, expected)
    assert codes.dtype == torch.int8
    torch.testing.assert_close(codes.float() * scales.repeat_interleave(32, 1), expected, rtol=0, atol=0)
    w = torch.from_numpy(weight)
    codes, scales = q8_codes(None, None, w)
    assert ((codes.float() * scales.repeat_interleave(32, 1) - w).abs() <= scales.repeat_interleave(32, 1) / 2
            + 1e-6).all()


def test_int8_group_head_rescores_its_best_candidates_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, hidden = 4096, 128
    w = torch.randn(vocab, hidden, generator=gen) * 0.05
    codes, scales = q8_codes(None, None, w)
    dense = codes.float() * scales.repeat_interleave(32, 1)  # the head as the file stores it
    head = Int8GroupHead(dense, codes, scales, num_exact=32)
    x = torch.randn(4, hidden, generator=gen) * 3
    exact = F.linear(x, dense)
    out = head(x)
    # Everywhere: the two 4-bit halves give the int8 product up to bf16 activations and outputs.
    torch.testing.assert_close(out, exact, rtol=0, atol=0.05)
    # The 32 best by the cheap pass are recomputed in fp32: near its boundary one may swap with the 33rd, but the
    # truly best are exact, so greedy and the top log-probs match the dense head.
    top = exact.topk(16, dim=-1).indices
    torch.testing.assert_close(out.gather(1, top), exact.gather(1, top), rtol=1e-5, atol=1e-5)
    assert torch.equal(out.argmax(-1), exact.argmax(-1))
    many = torch.randn(FUSED_MAX_ROWS + 1, hidden, generator=gen)
    assert torch.equal(head(many), F.linear(many, dense))

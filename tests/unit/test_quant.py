"""int4 projections: codes read from Q4_0/Q4_1 blocks reproduce the file's weights exactly; the module matches a
dense matmul within bf16 rounding on the fused path and exactly on the dense path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from nextoken.loader.dequant import dequantize
from nextoken.ops.quant_linear import FUSED_MAX_ROWS, Int4Linear, q4_codes, regroup


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

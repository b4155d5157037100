"""The token table and the LM head over Q8 blocks (int8 codes, a scale per 32): `BlockEmbedding` looks rows up
from the file's blocks, `Int8GroupHead` runs decode's head over them (or over blocks requantized from a float head,
whose best candidates it rescores exactly). Their kernels are the projections' (ops/quant_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nextoken.ops import native
from nextoken.ops.quant_linear import (
    GROUP_SIZE,
    HEAD_NATIVE_MAX_ROWS,
    Q8,
    TORCH_INT4_MAX_ROWS,
    head_gemm_rows,
    int4pack_scales,
    q8_weight,
)


class BlockEmbedding(nn.Module):
    """A token table held as the file's Q8_0 blocks (int8 codes [vocab, hidden], a scale per 32): a lookup
    dequantizes only the rows it reads, to exactly the values an fp32 table would hold, at a quarter of its memory
    (Gemma 3's 262k x 640 table: 176 MB instead of 671 MB). A tied LM head reads the same blocks."""

    codes: torch.Tensor  # int8 [vocab, hidden]
    scales: torch.Tensor  # fp32 [vocab, hidden / 32]

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = codes.shape
        # Not in the state dict: filled from the file's blocks, not from a checkpoint.
        self.register_buffer("codes", codes.to(torch.int8).contiguous(), persistent=False)
        self.register_buffer("scales", scales.float().contiguous(), persistent=False)  # [vocab, hidden / 32]
        self.lib = native.library()

    @property
    def nbytes(self) -> int:
        """Bytes of the file's blocks (fp16 scales)."""
        return self.codes.nbytes + self.scales.numel() * 2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> fp32 rows [..., hidden]."""
        if self.lib is not None and ids.dim() == 1 and ids.device.type == "cpu":
            return native.embed_q8(self.lib, self.codes, self.scales, ids)
        return rows_of(self.codes, self.scales, ids)


def rows_of(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor | slice) -> torch.Tensor:
    """fp32 rows `ids` of Q8 blocks: codes int8 [rows, cols] times scales [rows, cols / 32] (d * q, one rounding,
    as the file's dequantization)."""
    q, d = codes[ids], scales[ids]
    return (q.unflatten(-1, (-1, GROUP_SIZE)) * d.unsqueeze(-1)).flatten(-2)  # int8 * fp32 scales: fp32


class Int8GroupHead(nn.Module):
    """The LM head for decode: a cheap pass over the whole vocabulary, then the best candidates rescored exactly.

    The head weight [vocab, hidden] is held as Q8 blocks: the file's own where the head is Q8_0 (`weight` None: on
    the native kernel the pass is then as exact as the projections, fp32 over those blocks), else
    quantized with absmax / 127, a quarter of fp32's bytes. Requantized blocks move logits by int8 rounding of the
    weights, enough to swap near-tied tokens; so the `num_exact` highest logits of each row are recomputed in fp32
    from the float `weight` (which the embedding keeps anyway when tied), as they are after torch's bf16 pass.
    Greedy picks the same token as the fp32 head unless the best one is not among those candidates. Batches of more
    than `max_rows` rows take an fp32 GEMM over the float weight; over the file's blocks, the native GEMM that
    dequantizes them as it goes takes batches from `gemm_rows` rows (torch's over dequantized slices of the
    vocabulary without native kernels).

    Without native kernels the pass runs on torch's int4 kernel: an int8 code is two 4-bit ones, c = 16 * hi + lo
    (hi in -8..7, lo in 0..15), so it is two calls of that kernel (bf16 activations and outputs).
    """

    VOCAB_SLICE = 16384  # rows dequantized at a time for a large batch without a float weight
    # torch's int4 kernel's route (no native kernels): an int8 code's two nibbles packed for it, their pairs.
    hi: torch.Tensor
    lo: torch.Tensor
    hi_scales: torch.Tensor
    lo_scales: torch.Tensor

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor | None = None,
                 num_exact: int = 32) -> None:
        """codes [vocab, hidden] int8 and scales [vocab, hidden / 32]; weight: the fp32 head, where the blocks were
        requantized (shared with the embedding when tied: not a parameter of this module)."""
        super().__init__()
        self.weight = weight
        # Without a float weight, the blocks are the exact rows (kept as given: shared with a block embedding).
        self.codes: torch.Tensor | None = codes if weight is None else None
        self.scales: torch.Tensor | None = scales if weight is None else None
        self.num_exact = num_exact
        self.vocab_size = codes.shape[0]
        # How the GEMM over the file's blocks (from gemm_rows rows) meets the activations: "int16" or "int8"
        # codes per 32 values, as the projections' (BlockLinear.activations).
        self.activations = "int16"
        self.outliers: torch.Tensor | None = None  # as BlockLinear's: under "int8", fixed by calibration
        self.lib = native.library()
        self.max_rows = HEAD_NATIVE_MAX_ROWS if self.lib is not None else TORCH_INT4_MAX_ROWS
        self.gemm_rows = head_gemm_rows(self.lib)  # over the file's blocks, the native GEMM from this many rows
        if self.lib is not None:
            self.blocks = q8_weight(codes, scales)
            return
        pad = -self.vocab_size % 16  # the kernel packs output rows in sixteens
        wide = F.pad(codes.to(torch.int32), (0, 0, 0, pad))
        padded_scales = F.pad(scales.float(), (0, 0, 0, pad))
        hi, lo = wide >> 4, wide & 0x0F  # arithmetic shift: hi in -8..7
        zeros = torch.zeros_like(padded_scales)
        # int4 kernel: w = (c - 8) * scale + zero. hi part: codes hi + 8, scale 16 d. lo part: codes lo, scale d,
        # zero 8 d.
        self.register_buffer("hi", torch._convert_weight_to_int4pack_for_cpu(hi + 8, 1))
        self.register_buffer("lo", torch._convert_weight_to_int4pack_for_cpu(lo, 1))
        self.register_buffer("hi_scales", int4pack_scales(16 * padded_scales, zeros))
        self.register_buffer("lo_scales", int4pack_scales(padded_scales, 8 * padded_scales))

    @property
    def bytes_per_weight(self) -> float:
        return self.blocks.bytes_per_weight if self.lib is not None else 2 * (0.5 + 4 / GROUP_SIZE)

    @property
    def fixed_int8(self) -> bool:
        """Whether every product over the file's blocks takes the int8 GEMM with fixed outlier columns."""
        return self.activations == "int8" and self.outliers is not None and self.lib is not None \
            and self.weight is None

    def exact_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 head rows `ids`: the float weight's, or the exact blocks'."""
        return self.weight[ids] if self.weight is not None else self._file_rows(ids)

    def _file_rows(self, ids: torch.Tensor | slice) -> torch.Tensor:
        """fp32 rows `ids` of the file's own blocks (a head without a float weight)."""
        assert self.codes is not None and self.scales is not None  # kept where there is no float weight
        return rows_of(self.codes, self.scales, ids)

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, hidden] fp32 -> fp32 logits [rows, vocab], in `out` ([at least rows, vocab] fp32, contiguous)
        where given: a step's logits are tens of MB (Gemma 3 at 64 rows: 67), and a fresh buffer's pages fault in
        at 4 KB each on first write, 15 ms of a 160 ms step."""
        logits = out[:x.shape[0]] if out is not None else torch.empty(x.shape[0], self.vocab_size)
        if self.lib is not None and self.weight is None and (x.shape[0] >= self.gemm_rows or self.fixed_int8):
            native.block_matmul(self.lib, Q8, x.contiguous(), self.blocks.qs, self.blocks.d, None, logits, gemm=True,
                                int8_activations=self.activations == "int8", outliers=self.outliers)
            return logits
        if x.shape[0] > self.max_rows:
            if self.weight is not None:
                return torch.mm(x, self.weight.t(), out=logits)
            for at in range(0, self.vocab_size, self.VOCAB_SLICE):
                part = slice(at, min(at + self.VOCAB_SLICE, self.vocab_size))
                logits[:, part] = x @ self._file_rows(part).t()
            return logits
        if self.lib is not None:
            native.block_matmul(self.lib, Q8, x.contiguous(), self.blocks.qs, self.blocks.d, None, logits)
            if self.weight is None:  # the file's own blocks: already fp32 over them, as projections are
                return logits
        else:
            xb = x.to(torch.bfloat16)
            wide = torch._weight_int4pack_mm_for_cpu(xb, self.hi, GROUP_SIZE, self.hi_scales).float()
            wide += torch._weight_int4pack_mm_for_cpu(xb, self.lo, GROUP_SIZE, self.lo_scales)
            logits.copy_(wide[:, :self.vocab_size])
        candidates = logits.topk(min(self.num_exact, logits.shape[1]), dim=-1).indices  # [rows, k]
        exact = torch.bmm(self.exact_rows(candidates), x.unsqueeze(-1)).squeeze(-1)  # [rows, k, hidden] @ [rows, hidden]
        return logits.scatter_(1, candidates, exact)

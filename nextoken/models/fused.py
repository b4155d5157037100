"""Decode steps in one native call: every decoder block of the model, for one new token per sequence.

A decode step of a small model is thousands of tiny ops; on a CPU each costs microseconds in dispatch before it
does any work, which is most of the step. `FusedDecoder` hands the whole stack of blocks to `nt_decode_layers`
(ops/native/kernels.c), which runs, per block: RMSNorm, the fused QKV projection, per-head q/k norms where the
model has them, rotary embedding, the K/V write into the paged cache, attention over each sequence's blocks, the
output projection, the residual add, and the gated MLP, with the same formulas as the torch modules in layers.py.

Small batches are bound by the bytes of the weights, and their products run on the block kernels. From
`GEMM_MIN_ROWS` rows on they are bound by compute, where a GEMM is faster: the native fp32 GEMM over each
projection's packed panels (the ones its module uses for prefill), or with AVX-512 VNNI, where projections keep no
panels, the int16 GEMM over the blocks; the step stays one native call either way.

It is only a faster route through the same model: the modules stay the definition (prefill, GPUs and traced runs
use them; `nextoken trace` hooks them to show each stage), and tests hold the two to the same outputs. It applies
when every projection is block-quantized on the native kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import TYPE_CHECKING

import torch

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.ops import native
from nextoken.ops.attention import AttentionMetadata
from nextoken.ops.quant_linear import NATIVE_MAX_ROWS, BlockLinear

if TYPE_CHECKING:
    from nextoken.models.base import CausalLM
    from nextoken.models.layers import RMSNorm, RotaryEmbedding

GEMM_MIN_ROWS = NATIVE_MAX_ROWS + 1  # rows from which a fused step's products take the fp32 GEMM (measured there)


def _matrix(projection: torch.nn.Module) -> native.Matrix | None:
    if not isinstance(projection, BlockLinear) or projection.lib is None:
        return None
    parts = [native.Part(p.kind, p.rows, projection.in_features, p.qs.data_ptr(), p.d.data_ptr(),
                         None if p.m is None else p.m.data_ptr()) for p in projection.parts]
    return native.Matrix(len(parts), projection.out_features, (native.Part * native.MAX_PARTS)(*parts),
                         None if projection.panels is None else projection.panels.data_ptr(),
                         int(projection.activations == "int8"))


def _norm(norm: RMSNorm | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


class FusedDecoder:
    def __init__(self, lib: ctypes.CDLL, model: CausalLM) -> None:
        """Use `build`, which returns None where the model cannot run fused."""
        self.lib = lib
        self.model = model
        self.ropes: list[RotaryEmbedding] = []
        layers = []
        for block in model.layers:
            attn, mlp = block.attn, block.mlp
            norms = block.fused_norms()
            matrices = [_matrix(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(m is None for m in matrices):
                raise ValueError("a projection is not block-quantized on the native kernels")
            if attn.rope not in self.ropes:
                self.ropes.append(attn.rope)
            layers.append(native.Layer(
                block.input_norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.ffn,
                attn.sliding_window or 0, norms["attn_in"].eps, attn.scale, native.ACTIVATIONS[mlp.activation],
                int(attn.rope.layout == "interleaved"), attn.rope.dim, self.ropes.index(attn.rope),
                _norm(norms["attn_in"]), _norm(norms["attn_out"]), _norm(norms["mlp_in"]), _norm(norms["mlp_out"]),
                _norm(attn.q_norm), _norm(attn.k_norm), *matrices))
        self.layers = (native.Layer * len(layers))(*layers)
        self.final_norm = (model.norm.weight, model.norm.eps)  # applied in the same native call
        self._caches: tuple[tuple[KVCacheLayer, ...], ctypes.Array] | None = None
        self.gemm_rows = GEMM_MIN_ROWS
        self._scratch = torch.empty(0)

    @classmethod
    def build(cls, model: CausalLM) -> FusedDecoder | None:
        lib = native.library()
        if lib is None or not all(hasattr(block, "fused_norms") for block in model.layers):
            return None
        try:
            return cls(lib, model)
        except ValueError:
            return None

    def applies(self, x: torch.Tensor, kv_caches: list[KVCacheLayer], meta: AttentionMetadata) -> bool:
        """Decode-only batches of fp32 CPU rows over a cache the native attention reads, with no hooks on the blocks
        (a tracer watching them sees the modules run)."""
        watched = (self.model.layers[0], self.model.norm)
        return (meta.is_decode_only and x.dtype == torch.float32
                and native.attends(x.device, kv_caches[0].k.dtype, kv_caches[0].k.shape[-1])
                and not any(m._forward_hooks or m._forward_pre_hooks for m in watched))

    def _cache_structs(self, kv_caches: list[KVCacheLayer]) -> ctypes.Array:
        """The layers' caches as the kernel's structs, rebuilt when other cache objects come in. The structs hold
        raw pointers, so the layers they point into are kept referenced here for as long as the structs are used
        (comparing addresses instead could match a new pool allocated where a freed one was)."""
        if self._caches is None or len(self._caches[0]) != len(kv_caches) or any(
                a is not b for a, b in zip(self._caches[0], kv_caches)):
            structs = [native.cache_struct(c.k, c.v, c.k_scale, c.v_scale) for c in kv_caches]
            self._caches = (tuple(kv_caches), (native.Cache * len(structs))(*structs))
        return self._caches[1]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                 meta: AttentionMetadata) -> torch.Tensor:
        """x [num_seqs, hidden] (one new token per sequence) -> the residual stream after the last block, through the
        model's final norm."""
        top = max(meta.seq_lens)  # a decode token's position is its sequence's length - 1
        tables = []
        for rope in self.ropes:
            tables += [t.data_ptr() for t in rope.tables(top, positions.device)]
        _, seq_lens, _ = meta.single_queries()
        x = x.contiguous()
        caches, rope_tables = self._cache_structs(kv_caches), (ctypes.c_void_p * len(tables))(*tables)
        need = native.decode_scratch(self.lib, self.layers, x.shape[0])
        # Kept between steps (a fresh buffer each step would fault its pages in); steps run one at a time.
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        # Named in profiles (benchmarks/), only while torch.profiler records: entering a name costs 0.1 ms a step.
        recording = torch.autograd.profiler._is_profiler_enabled
        with torch.profiler.record_function("nextoken::decode_layers") if recording else contextlib.nullcontext():
            native.decode_layers(self.lib, x, positions, meta.slot_mapping, seq_lens, meta.block_tables,
                                 self.layers, caches, rope_tables, self._scratch, self.gemm_rows,
                                 self.final_norm)
        return x

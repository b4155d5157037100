"""Forward passes in one native call: every decoder block of the model, for one new token per sequence (decode) or,
where the CPU has AVX-512, for any batch of chunks (prefill, chunked prefill mixed with decodes).

A decode step of a small model is thousands of tiny ops; on a CPU each costs microseconds in dispatch before it
does any work, which is most of the step. `FusedDecoder` hands the whole stack of blocks to `nt_decode_layers`
(ops/native/decode.c), which runs, per block: RMSNorm, the fused QKV projection, per-head q/k norms where the
model has them, rotary embedding, the K/V write into the paged cache, attention over each sequence's blocks (a
chunk of several tokens through the prefill kernel, over its context gathered from the cache as the modules gather
it), the output projection, the residual add, and the gated MLP, with the same formulas as the torch modules in
layers.py. Prefill through it: SmolLM2 1.03x, Gemma 3 1.08x (512 tokens, alternating with the modules, medians of 8
rounds): its norms, rotary embedding and gated activations run on warm rows in one call.

Small batches are bound by the bytes of the weights, and their products run on the block kernels. From
`gemm_rows` rows on (quant_linear.native_max_rows) they are bound by compute, where a GEMM over the blocks is
faster (int16 with AVX-512 VNNI, else fp32 over panels dequantized as it goes); the step stays one native call
either way.

It is only a faster route through the same model: the modules stay the definition (GPUs use them, and so does a
tracer that re-runs a fused step to show its attention), and tests hold the two to the same outputs. It applies when
every projection is block-quantized on the native kernels. A traced run takes it too: both calls time their stages
into a probe's profile (models/probe.py) where one is set, and time nothing otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.ops import native
from nextoken.ops.attention import AttentionMetadata
from nextoken.ops.quant_head import BlockEmbedding
from nextoken.ops.quant_linear import HEAD_NATIVE_MAX_ROWS, BlockLinear, native_max_rows

if TYPE_CHECKING:
    from nextoken.models.base import CausalLM, DecoderBlock
    from nextoken.models.layers import GatedMLP, RMSNorm, RotaryEmbedding

KEPT_SCRATCH_ROWS = HEAD_NATIVE_MAX_ROWS  # tokens whose scratch the decoder keeps between steps


def _matrix(projection: torch.nn.Module) -> native.Matrix | None:
    if not isinstance(projection, BlockLinear) or projection.lib is None:
        return None
    parts = [native.Part(p.kind, p.rows, projection.in_features, p.qs.data_ptr(), p.d.data_ptr(),
                         None if p.m is None else p.m.data_ptr()) for p in projection.parts]
    outliers = projection.outliers if projection.fixed_int8 else None
    return native.Matrix(len(parts), projection.out_features, (native.Part * native.MAX_PARTS)(*parts),
                         int(projection.activations == "int8"),
                         outliers.data_ptr() if outliers is not None else None,
                         outliers.numel() if outliers is not None else -1)


def _norm(norm: RMSNorm | None) -> int | None:
    return None if norm is None else norm.weight.data_ptr()


def _hooked(*modules: torch.nn.Module) -> bool:
    """Whether something hooks these modules, and so expects to see them run. (The tracer does not hook them: it
    watches every path through the model's probe, and its hooks on the attention and MLP modules fire only where
    the modules run.)"""
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _named(name: str) -> contextlib.AbstractContextManager:
    """A span named in profiles (benchmarks/), only while torch.profiler records: entering a name costs 0.1 ms."""
    return torch.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled else \
        contextlib.nullcontext()


class FusedDecoder:
    def __init__(self, lib: ctypes.CDLL, model: CausalLM) -> None:
        """Use `build`, which returns None where the model cannot run fused."""
        self.lib = lib
        self.model = model
        self.ropes: list[RotaryEmbedding] = []
        layers = []
        for block in cast("Iterable[DecoderBlock]", model.layers):
            attn, mlp = block.attn, cast("GatedMLP", block.mlp)  # gated: the recipe has no gaps (build)
            norms = cast("dict[str, RMSNorm | None]",  # RMS norms: the recipe has no gaps (build)
                         {"attn_in": block.input_norm, "attn_out": block.post_attn_norm, "mlp_in": block.pre_mlp_norm,
                          "mlp_out": block.post_mlp_norm})
            matrices = [_matrix(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            if any(m is None for m in matrices):
                raise ValueError("a projection is not block-quantized on the native kernels")
            assert attn.rope is not None, "rotary positions: the recipe has no gaps (build)"
            if attn.rope not in self.ropes:
                self.ropes.append(attn.rope)
            layers.append(native.Layer(
                block.input_norm.weight.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.ffn,
                attn.sliding_window or 0, block.input_norm.eps, attn.scale, native.ACTIVATIONS[mlp.activation],
                int(attn.rope.layout == "interleaved"), attn.rope.dim, self.ropes.index(attn.rope),
                _norm(norms["attn_in"]), _norm(norms["attn_out"]), _norm(norms["mlp_in"]), _norm(norms["mlp_out"]),
                _norm(attn.q_norm), _norm(attn.k_norm),
                None if attn.qkv_bias is None else attn.qkv_bias.data_ptr(), *matrices))
        self.layers = (native.Layer * len(layers))(*layers)
        self.final_norm = (model.norm.weight, model.norm.eps)  # applied in the same native call
        self._caches: tuple[tuple[KVCacheLayer, ...], ctypes.Array] | None = None
        self.gemm_rows = native_max_rows(lib) + 1  # rows from which the products take a GEMM
        self._scratch = torch.empty(0)
        # Whether chunks of several tokens per sequence (prefill) run here too: their attention is the native prefill
        # kernel's, which needs AVX-512 and head sizes that are a multiple of 16 (elsewhere the modules run them).
        self.chunks = bool(lib.nt_has_vnni512()) and all(layer.head_dim % 16 == 0 for layer in layers)

    @classmethod
    def build(cls, model: CausalLM) -> FusedDecoder | None:
        lib = native.library()
        if lib is None or model.config.recipe.native_gaps():  # the recipe has parts the native step lacks
            return None
        try:
            return cls(lib, model)
        except ValueError:
            return None

    def rebuilt(self) -> FusedDecoder | None:
        """The decoder over the model's modules as they are now (their tensors or settings changed)."""
        return FusedDecoder.build(self.model)

    def applies(self, x: torch.Tensor, kv_caches: list[KVCacheLayer], meta: AttentionMetadata) -> bool:
        """Batches of fp32 CPU rows over a cache the native attention reads, decode-only or (where the prefill kernel
        runs: AVX-512, head sizes a multiple of 16) any, with no hooks on the blocks (whoever hooks them expects
        to see them run)."""
        return ((meta.is_decode_only or self.chunks) and x.dtype == torch.float32
                and native.attends(x.device, kv_caches[0].k.dtype, kv_caches[0].k.shape[-1])
                and not _hooked(self.model.layers[0], self.model.norm))

    def rope_tables(self, length: int) -> tuple[ctypes.Array, list[torch.Tensor]]:
        """The (cos, sin) tables of every rotary module, grown to cover positions below `length`: their addresses as
        the kernel reads them, and the tensors (which must outlive any use of the addresses)."""
        tables = [t for rope in self.ropes for t in rope.tables(length, torch.device("cpu"))]
        return (ctypes.c_void_p * len(tables))(*(t.data_ptr() for t in tables)), tables

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
                 meta: AttentionMetadata, profile: ctypes.Array | None = None) -> torch.Tensor:
        """x [tokens, hidden] (the batch's new tokens, laid out as meta says) -> the residual stream after the last
        block, through the model's final norm; each block timed into `profile` where given (native.profile_buffer)."""
        rope_tables, _ = self.rope_tables(max(meta.seq_lens))  # a token's position is below its sequence's length
        if meta.is_decode_only:
            _, seq_lens, _ = meta.single_queries()
            query_start = None
        else:
            seq_lens, query_start = torch.tensor(meta.seq_lens), torch.tensor(meta.query_start_loc)
        x = x.contiguous()
        caches = self._cache_structs(kv_caches)
        need = native.decode_scratch(self.lib, self.layers, x.shape[0])
        # Kept between steps (a fresh buffer each step would fault its pages in; steps run one at a time), up to a
        # batch of decode rows' size: a long prompt's chunk takes a buffer of its own (Gemma 3 at 2048 tokens: 134 MB).
        scratch = self._scratch
        if scratch.numel() < need:
            scratch = torch.empty(need)
            if x.shape[0] <= KEPT_SCRATCH_ROWS:
                self._scratch = scratch
        with _named("nextoken::decode_layers"):
            native.decode_layers(self.lib, x, positions, meta.slot_mapping, seq_lens, meta.block_tables,
                                 self.layers, caches, rope_tables, scratch, self.gemm_rows, self.final_norm,
                                 query_start, profile)
        return x


class NativeStep:
    """A whole decode step in one native call (nt_decode_step): the token rows from the file's Q8 table, every
    decoder block through the final norm (as FusedDecoder), the LM head over the file's int8 blocks into the
    engine's logits buffer, and, where every row is greedy, each row's argmax.

    Why one call: a decode step's kernels stream every weight through the caches, and on this kind of CPU (a small
    VM's share of its cores) what runs after them finds every cache cold. The step's Python and torch calls then
    cost 5-30x their warm time: a torch op that takes 6 us warm took 150-180 us after 7 ms of other work, and
    around the fused decoder a step spent 0.8-0.9 ms outside its kernels (Gemma 3 and SmolLM2 at batch 1, 8-11% of
    the step). Here the engine builds one flat list of ints per step and makes one ctypes call; no torch op runs
    between two steps unless a request samples or asks for log-probabilities.

    It applies where the FusedDecoder does, with the token table held as Q8 blocks (BlockEmbedding) and the head
    reading the file's own blocks (Int8GroupHead without a float weight: a requantized head rescores its candidates
    in torch), for up to HEAD_NATIVE_MAX_ROWS rows. The numbers are those of the module path: the same kernels in
    the same order (tests/unit/test_engine.py holds the results equal).
    """

    def __init__(self, lib: ctypes.CDLL, model: CausalLM, fused: FusedDecoder) -> None:
        """Use `build`."""
        self.lib, self.model, self.fused = lib, model, fused
        embed, head = model.embed_tokens, model.quantized_head
        assert isinstance(embed, BlockEmbedding) and head is not None
        self._watched_blocks = (model.layers[0], model.norm)
        self.plan = native.Step(
            layers=ctypes.addressof(fused.layers), num_layers=len(fused.layers), gemm_rows=fused.gemm_rows,
            final_norm=fused.final_norm[0].data_ptr(), final_eps=fused.final_norm[1],
            embed_scale=model.config.embedding_scale, embed_codes=embed.codes.data_ptr(),
            embed_scales=embed.scales.data_ptr(), vocab=embed.num_embeddings, head_kind=head.blocks.kind,
            head_qs=head.blocks.qs.data_ptr(), head_d=head.blocks.d.data_ptr(), head_rows=head.vocab_size,
            head_gemm_rows=head.gemm_rows, head_int8_activations=int(head.activations == "int8"),
            head_outliers=head.outliers.data_ptr() if head.fixed_int8 and head.outliers is not None else None,
            head_num_outliers=head.outliers.numel() if head.fixed_int8 and head.outliers is not None else -1,
            threads=torch.get_num_threads())
        # What the plan points into, kept referenced here: the table and head are the model's.
        self._x = self._scratch = torch.empty(0)
        self._argmax = (ctypes.c_int64 * 0)()
        self._rope_rows = 0  # positions the rope tables in the plan cover
        self._rope_tables: list[torch.Tensor] = []
        self._ropes: ctypes.Array | None = None
        self._caches: ctypes.Array | None = None
        self._attends: tuple[list[KVCacheLayer], bool] | None = None  # (the caches checked, whether the kernel reads them)
        self._logits: tuple[torch.Tensor, int, int] | None = None  # (the buffer, its address, its row stride)

    @classmethod
    def build(cls, model: CausalLM) -> NativeStep | None:
        """None where the model's step cannot run in one call (see the class)."""
        fused, embed, head = model.fused, model.embed_tokens, model.quantized_head
        if (not isinstance(fused, FusedDecoder) or not isinstance(embed, BlockEmbedding) or embed.lib is None
                or head is None or head.weight is not None or head.lib is None):
            return None
        return cls(fused.lib, model, fused)

    def applies(self, rows: int, kv_caches: list[KVCacheLayer]) -> bool:
        """As FusedDecoder.applies, for `rows` sequences (the model itself hooked too: this step bypasses its
        forward)."""
        if self._attends is None or self._attends[0] is not kv_caches:
            k = kv_caches[0].k
            self._attends = (kv_caches, native.attends(k.device, k.dtype, k.shape[-1]))
        return rows <= HEAD_NATIVE_MAX_ROWS and self._attends[1] and not _hooked(self.model, *self._watched_blocks)

    def run(self, ints: list[int], rows: int, table_stride: int, kv_caches: list[KVCacheLayer],
            logits: torch.Tensor, greedy: bool) -> list[int] | None:
        """The step over `rows` sequences whose token ids, positions, cache slots, context lengths ([rows] each) and
        block tables ([rows, table_stride], padded) are `ints` in that order (the engine's DecodeBatch), their caches
        in `kv_caches`; the logits into `logits` ([at least rows, vocab] fp32, contiguous rows). Returns each row's
        argmax with `greedy`, else None. Where the model has a probe, the step times itself into the probe's profile
        and tells the probe (the only work this adds untraced: two tests of an attribute)."""
        plan = self.plan
        if rows > plan.max_rows:
            self._grow(rows)
        top = max(ints[3 * rows:4 * rows])  # the longest context: the rope tables cover the positions below it
        if top > self._rope_rows:
            self._ropes, self._rope_tables = self.fused.rope_tables(top)
            self._rope_rows = min(t.shape[0] for t in self._rope_tables)
            plan.rope_tables = ctypes.addressof(self._ropes)
        caches = self.fused._cache_structs(kv_caches)
        if caches is not self._caches:
            self._caches = caches
            plan.caches = ctypes.addressof(caches)
        if self._logits is None or self._logits[0] is not logits:
            self._logits = (logits, logits.data_ptr(), logits.stride(0))
        _, address, stride = self._logits
        inputs = (ctypes.c_int64 * len(ints))(*ints)
        argmax = self._argmax if greedy else None
        probe = self.model.probe
        if probe is not None:
            plan.profile = ctypes.addressof(probe.profile)
        try:
            with _named("nextoken::decode_step"):
                native.decode_step(self.lib, plan, inputs, rows, table_stride, address, stride, argmax)
        finally:
            if probe is not None:
                plan.profile = None  # the plan outlives this probe: no later step times into its buffer
        if probe is not None:
            probe.native_step(ints[rows:2 * rows], logits[:rows], greedy)
        return argmax[:rows] if argmax is not None else None

    def _grow(self, rows: int) -> None:
        """Buffers for `rows` sequences: the residual stream, the decoder's scratch, the argmax rows."""
        plan = self.plan
        self._x = torch.empty(rows, self.model.config.hidden_size)
        self._scratch = torch.empty(native.decode_scratch(self.lib, self.fused.layers, rows))
        self._argmax = (ctypes.c_int64 * rows)()
        plan.x, plan.scratch, plan.max_rows = self._x.data_ptr(), self._scratch.data_ptr(), rows

"""The decoder-only skeleton every architecture shares: embed -> blocks -> final norm -> LM head.

An architecture file supplies its decoder block and `gguf_tensor_map` (parameter name -> the file tensors that make
it, concatenated along the output dimension, so q/k/v and gate/up load straight into fused projections). Weights are
dequantized from the memory-mapped file; projections into the requested weight dtype, everything else fp32. The model
is built on the meta device first so no memory is spent on initial values that are overwritten anyway.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType
from torch import nn

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.errors import ModelLoadError
from nextoken.loader.codec import dequantize, q4_codes, q5_codes, q6_codes, q8_0_codes
from nextoken.loader.gguf import GGUFFile
from nextoken.models.config import ModelConfig
from nextoken.ops.fused import FusedDecoder
from nextoken.models.layers import Linear, RMSNorm
from nextoken.ops import native
from nextoken.ops.attention import AttentionMetadata
from nextoken.ops.quant_linear import (FLOAT_TYPES, GROUP_SIZE, Q4_TYPES, BlockEmbedding, BlockLinear, Int8GroupHead,
                                       block_only_types, q4_weight, q8_codes, q8_weight, regroup)


class CausalLM(nn.Module):
    """Base class: subclasses set `self.layers` (blocks called as layer(x, positions, kv_cache, meta))."""

    layers: nn.ModuleList

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built with an empty weight (no random init: see Linear.reset_parameters); filled from the file.
        self.embed_tokens: nn.Embedding | BlockEmbedding = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        self.quantized_head: Int8GroupHead | None = None  # set by load_gguf(quantize_head=True)
        self.fused: FusedDecoder | None = None  # set by load_gguf where every projection is block-quantized

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.config.embedding_scale != 1.0:
            x = x * self.config.embedding_scale
        return x

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[num_rows, hidden] -> fp32 logits [num_rows, vocab], written into `out` ([at least num_rows, vocab] fp32,
        contiguous, on the head's device) where given and the head can."""
        if self.quantized_head is not None:
            return self.quantized_head(hidden, out)
        weight = self.head_weight
        lib = native.library()
        if native.repeatable(lib, hidden, weight):  # the same bits on any thread count (Linear)
            rows = hidden.shape[0]
            fits = out is not None and out.dtype == torch.float32 and out.stride(-1) == 1 and out.shape[0] >= rows
            return native.matmul_rowmajor(lib, hidden, weight, out[:rows] if fits else None)
        if out is not None and weight.dtype == hidden.dtype == out.dtype and weight.device == out.device:
            return torch.mm(hidden, weight.t(), out=out[:hidden.shape[0]])
        return torch.nn.functional.linear(hidden, weight).float()

    def set_activations(self, activations: str) -> None:
        """How the GEMM over block weights meets the activations, in the projections and the LM head over the
        file's blocks: "int16" or "int8" codes per 32 values (BlockLinear.activations). The fused decoder's structs
        are rebuilt to carry the choice."""
        for module in self.modules():
            if isinstance(module, (BlockLinear, Int8GroupHead)):
                module.activations = activations
        if self.fused is not None:
            self.fused = FusedDecoder.build(self)

    @property
    def head_weight(self) -> torch.Tensor:
        """The fp32 head (a block embedding has none: its tied head is always the `quantized_head`)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        assert not isinstance(head, BlockEmbedding), "a block-held table's head is the quantized head"
        return head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                meta: AttentionMetadata, logits_indices: torch.Tensor | None = None,
                logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> logits [len(logits_indices) or num_tokens, vocab] (fp32), in
        `logits_out` where given (compute_logits).

        Only the rows named by `logits_indices` go through the LM head: in prefill, usually just each sequence's
        last token.
        """
        x = self.embed(input_ids)
        fused = self.fused is not None and self.fused.applies(x, kv_caches, meta)
        if fused:
            x = self.fused(x, positions, kv_caches, meta)  # the final norm included
        else:
            for layer, kv_cache in zip(self.layers, kv_caches):
                x = layer(x, positions, kv_cache, meta)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return self.compute_logits(x if fused else self.norm(x), logits_out)

    # --- loading -------------------------------------------------------------------------------------------

    def gguf_tensor_map(self) -> dict[str, tuple[str, ...]]:
        """Parameter name -> GGUF tensor names concatenated (dim 0) to form it."""
        cfg = self.config
        names: dict[str, tuple[str, ...]] = {
            "embed_tokens.weight": ("token_embd.weight",),
            "norm.weight": ("output_norm.weight",),
        }
        if self.lm_head is not None:
            names["lm_head.weight"] = ("output.weight",)
        for i in range(cfg.num_layers):
            for param, files in self.layer_tensor_map().items():
                names[f"layers.{i}.{param}"] = tuple(f"blk.{i}.{f}" for f in files)
        return names

    def layer_tensor_map(self) -> dict[str, tuple[str, ...]]:
        raise NotImplementedError

    def transform_tensor(self, gguf_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Hook for per-architecture layout fixes of one file tensor (e.g. undoing a permutation)."""
        return tensor

    def load_gguf(self, gguf: GGUFFile, dtype: torch.dtype, device: torch.device,
                  progress: Callable[[str], None] | None = None, quant: str | None = None,
                  quantize_head: bool = False) -> None:
        """Fill every parameter from the file. With `quant` "int4" or "int8", projections also get block codes for
        decode (see ops/quant_linear.py). int4: 4-bit blocks (Q4_0, Q4_1, Q4_K) keep their codes; Q5_0, Q6_K and
        Q8_0 tensors (llama.cpp's mixes keep some so) become int8 blocks exactly; other types are requantized to
        int8, float files regrouped into 4 bits. int8: int8 blocks everywhere (Q5_0, Q6_K, Q8_0 exactly). With
        `quantize_head`, decode rows go through `Int8GroupHead` (CPU only), and a Q8_0 token table stays in its
        blocks (`BlockEmbedding`): no fp32 copy, and a tied head rescores its candidates from the same blocks.
        Projections whose blocks are exactly their weights (EXACT_PANEL_TYPES: every type int4 keeps) are not
        dequantized at all on CPU: the native kernels build their GEMM panels from the blocks, or need none."""
        state: dict[str, torch.Tensor] = {}
        sources: dict[str, list[tuple[str, torch.Tensor]]] = {}  # projection -> (file tensor, transformed weight)
        embedding = gguf.tensors.get("token_embd.weight")
        if (quantize_head and embedding is not None and embedding.qtype == GGMLQuantizationType.Q8_0
                and tuple(embedding.shape) == (self.config.vocab_size, self.config.hidden_size)
                and self.config.hidden_size % GROUP_SIZE == 0):
            self.embed_tokens = BlockEmbedding(*q8_0_codes(gguf.raw(embedding.name), embedding.shape))
        expected = dict(self.named_parameters())
        # Projections whose file blocks hold their weights exactly skip the fp32 copy: the native kernels dequantize
        # their GEMM panels straight from the blocks, or with AVX-512 VNNI need none (BlockLinear).
        exact_types = block_only_types(quant) if device.type == "cpu" else ()
        for param, files in self.gguf_tensor_map().items():
            if param == "embed_tokens.weight" and isinstance(self.embed_tokens, BlockEmbedding):
                continue
            infos = []
            for name in files:
                info = gguf.tensors.get(name)
                if info is None:
                    raise ModelLoadError(gguf.path, f"missing tensor {name!r}")
                infos.append(info)
            # Checked on the file's shapes, before anything is read: tensors stacked into one parameter (a fused
            # projection) must agree past their rows, and together match this configuration.
            shapes = [tuple(info.shape) for info in infos]
            want = tuple(expected[param].shape)
            if (sum(s[0] for s in shapes), *shapes[0][1:]) != want or any(s[1:] != shapes[0][1:] for s in shapes):
                raise ModelLoadError(gguf.path, f"tensor(s) {', '.join(files)} have shape(s) {shapes}, expected "
                                                f"{want} for this configuration")
            if param.endswith("_proj.weight") and all(info.qtype in exact_types for info in infos):
                sources[param] = [(name, None) for name in files]
                state[param] = torch.empty(want)  # a placeholder: its BlockLinear replaces it below
                if progress is not None:
                    progress(param)
                continue
            parts = []
            for name, info in zip(files, infos):
                t = dequantize(gguf.raw(name), info.qtype, info.shape, dtype=torch.float32, name=name)
                parts.append(self.transform_tensor(name, t))  # layout fixes permute; shapes stay
                if quant is not None and param.endswith("_proj.weight"):
                    sources.setdefault(param, []).append((name, parts[-1]))
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            # Only the blocks' projections take the weight dtype. Embedding, LM head and norms stay fp32: rounding
            # the LM head or the residual stream to bf16 flips near-tied top-1 tokens (SmolLM2: 97.4% top-1
            # agreement with everything in bf16, 99.5% with bf16 projections only).
            is_projection = param.endswith("_proj.weight")
            state[param] = tensor.to(device=device, dtype=dtype if is_projection else torch.float32)
            if progress is not None:
                progress(param)
        self.load_state_dict(state, strict=True, assign=True)
        self.requires_grad_(False)
        for param, parts in sources.items():
            owner, attr, dense = self._projection(param)
            exact = parts[0][1] is None  # the blocks alone hold the weight
            setattr(owner, attr, self._block_projection(gguf, parts, None if exact else dense, quant, dense.shape))
        if quantize_head and self.config.hidden_size % GROUP_SIZE == 0:  # int8 groups along the hidden size
            if self.lm_head is None and isinstance(self.embed_tokens, BlockEmbedding):
                self.quantized_head = Int8GroupHead(self.embed_tokens.codes, self.embed_tokens.scales)
            else:
                name = "token_embd.weight" if self.lm_head is None else "output.weight"
                info = gguf.tensors[name]
                codes, scales = q8_codes(gguf.raw(name), info.qtype, self.head_weight)
                exact = info.qtype == GGMLQuantizationType.Q8_0  # the blocks are the head's own values
                self.quantized_head = Int8GroupHead(codes, scales, None if exact else self.head_weight)
        if quant is not None and device.type == "cpu":
            self.fused = FusedDecoder.build(self)

    def _projection(self, param: str) -> tuple[nn.Module, str, torch.Tensor]:
        owner_name, _, attr = param.rpartition(".weight")[0].rpartition(".")
        owner = self.get_submodule(owner_name)
        return owner, attr, getattr(owner, attr).weight.data

    def _block_projection(self, gguf: GGUFFile, parts: list[tuple[str, torch.Tensor | None]],
                          dense: torch.Tensor | None, quant: str | None, shape: tuple[int, ...]) -> BlockLinear:
        """One fused projection from its file tensors (and their transformed float weights; None where the blocks
        are exactly the weight, see EXACT_PANEL_TYPES) as `quant` blocks."""
        blocks = []
        for name, weight in parts:
            info = gguf.tensors[name]
            if quant == "int4" and info.qtype in Q4_TYPES:
                direct = q4_codes(gguf.raw(name), info.qtype, info.shape)
                blocks.append(q4_weight(*self._reorder(name, direct)))  # type: ignore[arg-type]
            elif quant == "int4" and info.qtype in FLOAT_TYPES:
                blocks.append(q4_weight(*regroup(weight)))  # `weight` already has the layout fix applied
            elif info.qtype == GGMLQuantizationType.Q5_0:
                blocks.append(q8_weight(*self._reorder(name, q5_codes(gguf.raw(name), info.shape))))
            elif info.qtype == GGMLQuantizationType.Q6_K:
                blocks.append(q8_weight(*self._reorder(name, q6_codes(gguf.raw(name), info.shape))))
            elif info.qtype == GGMLQuantizationType.Q8_0:
                blocks.append(q8_weight(*self._reorder(name, q8_0_codes(gguf.raw(name), info.shape))))
            else:
                assert weight is not None  # only exact types come without their float weight
                blocks.append(q8_weight(*q8_codes(None, None, weight)))
        return BlockLinear(blocks, dense, (shape[0], shape[1]))

    def _reorder(self, name: str, rows_first: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Apply the architecture's layout fix (a permutation of rows) to codes and scales read from the file: find
        it by transforming the row indices."""
        num_rows = rows_first[0].shape[0]
        rows = torch.arange(num_rows, dtype=torch.float32)[:, None]
        order = self.transform_tensor(name, rows)[:, 0]
        if torch.equal(order, rows[:, 0]):
            return rows_first  # no layout fix for this tensor
        return tuple(t[order.long()] for t in rows_first)

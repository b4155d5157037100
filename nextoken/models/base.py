"""The decoder-only skeleton every architecture shares: embed -> blocks -> final norm -> LM head.

An architecture file supplies its decoder block, `layer_tensor_map` (parameter name -> the file tensors that make it,
concatenated along the output dimension, so q/k/v and gate/up load straight into fused projections) and `row_order`
(its layout fixes of a file tensor's rows). The math only: a model is built on the meta device, the loader attaches the
file's tensors as stored (loader/weights.py), and a pass gives each module the format it runs in (ops/quantize.py:
dense, block-quantized projections, a Q8 token table, an int8 LM head, a fused decode path).
"""

from __future__ import annotations

import ctypes

from typing import Protocol

import torch
from torch import nn

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.models.config import ModelConfig
from nextoken.models.layers import Linear, RMSNorm
from nextoken.models.probe import FUSED_BLOCKS, MODULES, ForwardProbe
from nextoken.ops import native
from nextoken.ops.attention import AttentionMetadata


class FusedPath(Protocol):
    """A faster route through every block of a model and its final norm (ops/fused.py), built over its modules'
    tensors: it runs where `applies` says, with the same results as the modules."""

    def applies(self, x: torch.Tensor, kv_caches: list[KVCacheLayer], meta: AttentionMetadata) -> bool: ...

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                 meta: AttentionMetadata, profile: ctypes.Array | None = None) -> torch.Tensor: ...

    def rebuilt(self) -> FusedPath | None:
        """The same path over the modules as they are now (None where it no longer applies)."""


class CausalLM(nn.Module):
    """Base class: subclasses set `self.layers` (blocks called as layer(x, positions, kv_cache, meta))."""

    layers: nn.ModuleList

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built with an empty weight (no random init: see Linear.reset_parameters); filled from the file. The
        # quantization pass may hold it in blocks instead (ops/quantize.py).
        self.embed_tokens: nn.Module = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size)
        # The LM head for decode rows, where the quantization pass gives one: called as (hidden, out) -> logits.
        self.quantized_head: nn.Module | None = None
        self.fused: FusedPath | None = None  # set by the quantization pass where every projection is in blocks
        self.probe: ForwardProbe | None = None  # an observer of forward passes (a tracer's), on whichever path

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
            if hasattr(module, "activations"):  # a block module that offers the choice (ops/quant_linear.py)
                module.activations = activations
        if self.fused is not None:
            self.fused = self.fused.rebuilt()

    @property
    def head_weight(self) -> torch.Tensor:
        """The fp32 head (a block embedding has none: its tied head is always the `quantized_head`)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        weight = getattr(head, "weight", None)
        assert isinstance(weight, torch.Tensor), "a block-held table's head is the quantized head"
        return weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCacheLayer],
                meta: AttentionMetadata, logits_indices: torch.Tensor | None = None,
                logits_out: torch.Tensor | None = None, *, modules: bool = False) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> logits [len(logits_indices) or num_tokens, vocab] (fp32), in
        `logits_out` where given (compute_logits).

        Only the rows named by `logits_indices` go through the LM head: in prefill, usually just each sequence's
        last token. With `modules`, every block runs through its torch modules even where the fused decoder would
        take them (a tracer re-running a fused step to look inside its layers). A probe, where set, is told of each
        stage (ForwardProbe).
        """
        probe = self.probe
        if probe is not None:
            probe.begin(positions)
        x = self.embed(input_ids)
        fused = not modules and self.fused is not None and self.fused.applies(x, kv_caches, meta)
        if probe is not None:
            probe.embedded(FUSED_BLOCKS if fused else MODULES)
        if fused:
            # The final norm included; a probe's profile gets the blocks' times.
            x = self.fused(x, positions, kv_caches, meta, None if probe is None else probe.profile)
        else:
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                x = layer(x, positions, kv_cache, meta)
                if probe is not None:
                    probe.layer_done(i)
        if probe is not None:
            probe.blocks_done()
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        logits = self.compute_logits(x if fused else self.norm(x), logits_out)
        if probe is not None:
            probe.end(logits)
        return logits

    # --- the file's tensors --------------------------------------------------------------------------------

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

    def row_order(self, gguf_name: str, num_rows: int) -> torch.Tensor | None:
        """The order in which this architecture takes a file tensor's rows (dim 0; the elements of a vector), where it
        differs from the file's: a layout fix such as undoing a permutation, applied alike to decoded values and to
        block codes. None: as stored."""
        return None

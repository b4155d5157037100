"""ForwardProbe: how an observer (the tracer) watches a model's forward passes on whichever path each one takes,
without changing the path or its numbers.

A model calls its probe (`CausalLM.probe`, None unless an observer set one) at the boundaries of each pass, and the
native paths time themselves into the probe's `profile` (nt.h: nt_profile_slot, nt_layer_time) from inside their
one call. Invariants: a probe only reads what it is handed; with no probe a pass tests one attribute at each
boundary and hands the native calls a null profile, so nothing is timed.
"""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

# The paths a forward pass takes, fastest first: the whole decode step as one native call (NativeStep), the
# decoder blocks as one native call inside the model's forward (FusedDecoder), or every torch module in turn.
NATIVE_STEP, FUSED_BLOCKS, MODULES = "native step", "fused blocks", "modules"
PATHS = (NATIVE_STEP, FUSED_BLOCKS, MODULES)


class ForwardProbe(ABC):
    """Told of each forward pass, in this order:

    - a pass through the model's forward: `begin`, `embedded` (naming FUSED_BLOCKS or MODULES), `layer_done` per
      block (MODULES only), `blocks_done` (FUSED_BLOCKS: `profile` now holds the blocks' times and the BLOCKS
      reading), `end`;
    - a whole step as one native call: `native_step` alone, once `profile` holds every reading of the step.

    `profile` must stay the same object while the probe is set: the native calls write through its address.
    """

    profile: ctypes.Array  # ops.native.profile_buffer(num_layers)

    @abstractmethod
    def begin(self, positions: torch.Tensor) -> None:
        """A pass over the tokens at `positions` ([num_tokens] int64) starts, before the embedding."""

    @abstractmethod
    def embedded(self, path: str) -> None:
        """The token rows are in the residual stream; the blocks run on `path`."""

    @abstractmethod
    def layer_done(self, layer: int) -> None:
        """Block `layer` is done (the module path: fused blocks time themselves)."""

    @abstractmethod
    def blocks_done(self) -> None:
        """Every block is done; the final norm and the LM head come next."""

    @abstractmethod
    def end(self, logits: torch.Tensor) -> None:
        """The pass is done: `logits` [rows, vocab] fp32 are its rows (read them before the next pass: the engine
        reuses the buffer)."""

    @abstractmethod
    def native_step(self, positions: Sequence[int], logits: torch.Tensor, greedy: bool) -> None:
        """A whole decode step ran as one native call over tokens at `positions`: `profile` holds its readings,
        `logits` [rows, vocab] its rows, and with `greedy` the call took each row's argmax (no sampler runs)."""

"""Decode steps replayed from CUDA graphs.

On a GPU, a decode step of a small model is a few hundred kernel launches of a few microseconds of CPU time each,
and the GPU spends most of the step waiting for them. A CUDA graph records one step's kernels once and replays
them all with one launch. A graph fixes shapes and addresses, so `DecodeGraphs` keeps static inputs per bucket of
(batch rows, block-table width):

- a decode step's batch is padded up to the next row bucket. Padding rows write their K/V into a block reserved
  for them (`pad_block`, never handed to a request) and attend to that block alone;
- block tables are padded to the next width bucket (in blocks); attention takes the fixed-shape path
  (ops/attention.py, `StaticDecode`): each row's context gathered at that width, masked by its length on the device.
  Masked slots get zero weight, so the pool must hold finite values everywhere: it starts zero-filled;
- rotary tables are grown to the longest context before any capture.

A bucket is captured the first time a step needs it. Steps that are not pure decode, that are wider than the
largest bucket, or whose capture fails run the model directly, as before. With `capture=False` the same padded
fixed-shape step runs eagerly: that is how the tests hold it to the normal path on a machine without a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from nextoken.cache.kv_pool import KVCacheLayer
from nextoken.engine.batch import ForwardBatch
from nextoken.models.layers import RotaryEmbedding
from nextoken.ops.attention import AttentionMetadata, StaticDecode

logger = logging.getLogger("nextoken.engine")

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size that holds n, or None."""
    return next((size for size in sizes if size >= n), None)


def width_buckets(max_blocks: int) -> tuple[int, ...]:
    """Block-table widths: powers of two up to the widest table a sequence can have, then that width."""
    sizes = []
    width = 4
    while width < max_blocks:
        sizes.append(width)
        width *= 2
    return (*sizes, max_blocks)


@dataclass
class _Step:
    """A bucket's static inputs and outputs (and its graph, where captured)."""

    input_ids: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    slots: torch.Tensor  # [rows]
    seq_lens: torch.Tensor  # [rows]
    tables: torch.Tensor  # [rows, width]
    logits: torch.Tensor | None = None  # [rows, vocab], written by each replay
    graph: object | None = None  # torch.cuda.CUDAGraph


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_layers: list[KVCacheLayer], block_size: int, pad_block: int,
                 max_blocks: int, max_rows: int, max_model_len: int, device: torch.device,
                 capture: bool = True) -> None:
        self.model = model
        self.kv_layers = kv_layers
        self.block_size = block_size
        self.pad_block = pad_block
        self.rows = tuple(size for size in ROW_BUCKETS if size < max_rows) + (max_rows,)
        self.widths = width_buckets(max_blocks)
        self.max_model_len = max_model_len
        self.device = device
        self.capture = capture
        self.steps: dict[tuple[int, int], _Step | None] = {}  # None: capture failed, run eagerly
        self._pool: torch.cuda._POOL_HANDLE | None = None  # graphs share one memory pool: only one replays at a time

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [num_seqs, vocab] of a pure decode step (every row one new token that samples), or None where the
        step does not fit a bucket: the caller then runs the model itself."""
        meta = batch.attn
        n = meta.num_seqs
        if (not meta.is_decode_only or batch.sample_rows != list(range(n))
                or any(row is not None for row in batch.prompt_logprob_rows)):
            return None
        rows, width = bucket(n, self.rows), bucket(meta.block_tables.shape[1], self.widths)
        if rows is None or width is None:
            return None
        key = (rows, width)
        if key not in self.steps:
            self.steps[key] = self._build(rows, width)
        step = self.steps[key]
        if step is None:
            return None
        self._fill(step, batch, n)
        if step.graph is not None:
            step.graph.replay()  # type: ignore[attr-defined]
            logits = step.logits
        else:
            logits = self._forward(step, rows)
        assert logits is not None
        return logits[:n].clone()

    def _fill(self, step: _Step, batch: ForwardBatch, n: int) -> None:
        """The batch into the bucket's first n rows; padding rows at position 0 of the reserved block."""
        meta = batch.attn
        step.input_ids[:n].copy_(batch.input_ids)
        step.positions[:n].copy_(batch.positions)
        step.slots[:n].copy_(meta.slot_mapping)
        step.seq_lens[:n].copy_(torch.tensor(meta.seq_lens, dtype=torch.long))
        step.tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        step.tables[:n, meta.block_tables.shape[1]:].fill_(self.pad_block)
        step.input_ids[n:].zero_()
        step.positions[n:].zero_()
        step.slots[n:].fill_(self.pad_block * self.block_size)
        step.seq_lens[n:].fill_(1)
        step.tables[n:].fill_(self.pad_block)

    def _forward(self, step: _Step, rows: int) -> torch.Tensor:
        # Fresh views each call: per-pass caches keyed by tensor identity (rotary lookups) then see new values.
        meta = AttentionMetadata(
            slot_mapping=step.slots[:], query_start_loc=list(range(rows + 1)), seq_lens=[1] * rows,
            block_tables=step.tables[:], block_size=self.block_size, static=StaticDecode(step.seq_lens[:]))
        return self.model(step.input_ids[:], step.positions[:], self.kv_layers, meta)

    def _build(self, rows: int, width: int) -> _Step | None:
        as_long: dict[str, Any] = dict(dtype=torch.long, device=self.device)
        step = _Step(torch.zeros(rows, **as_long), torch.zeros(rows, **as_long),
                     torch.full((rows,), self.pad_block * self.block_size, **as_long), torch.ones(rows, **as_long),
                     torch.full((rows, width), self.pad_block, **as_long))
        if not self.capture:
            return step
        try:
            for module in self.model.modules():  # no table growth (a read-back) inside the capture
                if isinstance(module, RotaryEmbedding):
                    module.tables(self.max_model_len, self.device)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
                for _ in range(2):
                    self._forward(step, rows)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                step.logits = self._forward(step, rows)
            step.graph = graph
            return step
        except Exception as exc:  # a model or driver that cannot be captured still runs, eagerly
            logger.warning("CUDA graph capture for %d rows x %d blocks failed (%s); those steps run eagerly",
                           rows, width, exc)
            return None

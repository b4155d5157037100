"""ForwardBatch: one step's scheduled chunks turned into the flat tensors a forward pass takes.

Tokens of all scheduled requests are laid back to back. `logits_indices` keeps only the rows whose logits are used:
the last token of every chunk that samples, and every token of a prompt whose prompt log-probabilities were asked
for. `sample_rows[i]` is the position in the logits of request i's sampling row (None if it does not sample);
`prompt_logprob_rows[i]` the (first row, count, first position) of its prompt positions. A chunk's proposed tokens
(speculative decoding) follow its known ones, and each has a row after its sampling row: 1 + len(spec_ids) rows in
order, the distributions after the last known token and after each proposal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from nextoken.engine.scheduler import ScheduledRequest
from nextoken.ops.attention import AttentionMetadata


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor | None  # [num_logits] int64; None: every token's row
    sample_rows: list[int | None]  # per scheduled request
    prompt_logprob_rows: list[tuple[int, int, int] | None]  # per request: (first row, rows, first position)

    @classmethod
    def build(cls, scheduled: list[ScheduledRequest], block_size: int, device: torch.device) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int | None] = []
        prompt_rows: list[tuple[int, int, int] | None] = []
        for item in scheduled:
            req = item.request
            start = req.num_computed_tokens
            end = start + item.num_new_tokens + len(item.spec_ids)
            offset = len(input_ids)
            input_ids.extend(req.all_ids[start:start + item.num_new_tokens])
            input_ids.extend(item.spec_ids)
            positions.extend(range(start, end))
            table = req.block_table
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                # Every prompt position in this chunk: row p holds the distribution of token p + 1.
                count = min(end, req.num_prompt_tokens) - start
                prompt_rows.append((len(logits_indices), count, start))
                logits_indices.extend(range(offset, offset + count))
            else:
                prompt_rows.append(None)
            if item.samples:
                sample_rows.append(len(logits_indices))
                logits_indices.extend(range(len(input_ids) - 1 - len(item.spec_ids), len(input_ids)))
            else:
                sample_rows.append(None)
        tables = [item.request.block_table for item in scheduled]
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        as_long: dict[str, Any] = dict(dtype=torch.long, device=device)
        n = len(input_ids)
        flat = torch.tensor(input_ids + positions + slots, **as_long)  # one copy in, three views out
        return cls(
            input_ids=flat[:n],
            positions=flat[n:2 * n],
            attn=AttentionMetadata(
                slot_mapping=flat[2 * n:],
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_tables=block_tables.to(device),
                block_size=block_size,
                first_blocks=first_blocks(tables),
            ),
            # None where every row is wanted in order (decode steps): no gathered copy then.
            logits_indices=None if logits_indices == list(range(len(input_ids))) else torch.tensor(logits_indices,
                                                                                                    **as_long),
            sample_rows=sample_rows,
            prompt_logprob_rows=prompt_rows,
        )

    @classmethod
    def single_tokens(cls, rows: list[tuple[list[int], int, int]], block_size: int,
                      device: torch.device) -> ForwardBatch:
        """One token per sequence, given as (its block table, the token, its position): written into those blocks
        at that position, attending over every position before it, a logits row each. The passes of the head
        draft (engine/head_draft.py): a drafted token, or the last token of a chunk whose others it computed."""
        tables = [table for table, _, _ in rows]
        ids = [token for _, token, _ in rows]
        positions = [p for _, _, p in rows]
        slots = [table[p // block_size] * block_size + p % block_size for table, _, p in rows]
        n = len(rows)
        max_blocks = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        flat = torch.tensor(ids + positions + slots, dtype=torch.long, device=device)
        meta = AttentionMetadata(slot_mapping=flat[2 * n:], query_start_loc=list(range(n + 1)),
                                 seq_lens=[p + 1 for p in positions], block_tables=block_tables.to(device),
                                 block_size=block_size, first_blocks=first_blocks(tables))
        return cls(flat[:n], flat[n:2 * n], meta, None, list(range(n)), [None] * n)


def first_blocks(tables: list[list[int]]) -> list[int | None]:
    """Per block table, its first block where its blocks are consecutive (AttentionMetadata.first_blocks)."""
    return [t[0] if t and t[-1] - t[0] == len(t) - 1 and all(b - a == 1 for a, b in zip(t, t[1:])) else None
            for t in tables]


@dataclass
class DecodeBatch:
    """A step of one new token per sequence, each drawing the next, for the native decode step (ops/fused.py,
    NativeStep): its inputs as one flat list of ints, laid out as the kernel reads them (token ids, positions, cache
    slots and context lengths [rows] each, then the block tables [rows, table_stride], padded with 0). The engine
    reads the same `sample_rows` and `prompt_logprob_rows` as a ForwardBatch's; its tensors (`input_ids`...) are
    built only if something asks for them (the module path run over the same step, in tests)."""

    ints: list[int]
    rows: int
    table_stride: int
    table_lens: list[int]  # blocks in each table
    block_size: int
    sample_rows: list[int | None]
    prompt_logprob_rows: list[tuple[int, int, int] | None]
    # Each row's argmax, where the step took it because the sampler said nothing else is needed (argmax_only).
    argmax_ids: list[int] | None = None
    logits: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def build(cls, scheduled: list[ScheduledRequest], block_size: int) -> DecodeBatch | None:
        """None unless every chunk is one token that draws the next (and asks for no prompt log-probabilities)."""
        ids, positions, slots, lens, tables = [], [], [], [], []
        for item in scheduled:
            req = item.request
            p = req.num_computed_tokens
            if item.num_new_tokens != 1 or not item.samples or item.spec_ids or (req.params.prompt_logprobs is not None
                                                               and p < req.num_prompt_tokens):
                return None
            table = req.block_table
            ids.append(req.all_ids[p])
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
            lens.append(p + 1)
            tables.append(table)
        stride = max(len(t) for t in tables)
        ints = ids + positions + slots + lens
        for t in tables:
            ints += t
            ints += [0] * (stride - len(t))
        n = len(scheduled)
        return cls(ints, n, stride, [len(t) for t in tables], block_size, list(range(n)), [None] * n)

    @cached_property
    def _tensors(self) -> ForwardBatch:
        n, stride = self.rows, self.table_stride
        flat = torch.tensor(self.ints, dtype=torch.long)
        tables = [self.ints[4 * n + i * stride:4 * n + i * stride + count] for i, count in enumerate(self.table_lens)]
        meta = AttentionMetadata(slot_mapping=flat[2 * n:3 * n], query_start_loc=list(range(n + 1)),
                                 seq_lens=self.ints[3 * n:4 * n], block_tables=flat[4 * n:].view(n, stride),
                                 block_size=self.block_size, first_blocks=first_blocks(tables))
        return ForwardBatch(flat[:n], flat[n:2 * n], meta, None, self.sample_rows, self.prompt_logprob_rows)

    @property
    def input_ids(self) -> torch.Tensor:
        return self._tensors.input_ids

    @property
    def positions(self) -> torch.Tensor:
        return self._tensors.positions

    @property
    def attn(self) -> AttentionMetadata:
        return self._tensors.attn

    @property
    def logits_indices(self) -> None:
        return None

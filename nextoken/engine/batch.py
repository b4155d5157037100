"""ForwardBatch: one step's scheduled chunks turned into the flat tensors a forward pass takes.

Tokens of all scheduled requests are laid back to back. `logits_indices` keeps only the rows whose logits are used:
the last token of every chunk that samples, and every token of a prompt whose prompt log-probabilities were asked
for. `sample_rows[i]` is the position in the logits of request i's sampling row (None if it does not sample);
`prompt_logprob_rows[i]` the (first row, count, first position) of its prompt positions.
"""

from __future__ import annotations

from dataclasses import dataclass

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
            end = start + item.num_new_tokens
            offset = len(input_ids)
            input_ids.extend(req.all_ids[start:end])
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
                logits_indices.append(len(input_ids) - 1)
            else:
                sample_rows.append(None)
        first_blocks = [table[0] if table and table[-1] - table[0] == len(table) - 1 and
                        all(b - a == 1 for a, b in zip(table, table[1:])) else None
                        for table in (item.request.block_table for item in scheduled)]
        max_blocks = max(len(item.request.block_table) for item in scheduled)
        tables = [item.request.block_table for item in scheduled]
        block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        as_long = dict(dtype=torch.long, device=device)
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
                first_blocks=first_blocks,
            ),
            # None where every row is wanted in order (decode steps): no gathered copy then.
            logits_indices=None if logits_indices == list(range(len(input_ids))) else torch.tensor(logits_indices,
                                                                                                    **as_long),
            sample_rows=sample_rows,
            prompt_logprob_rows=prompt_rows,
        )

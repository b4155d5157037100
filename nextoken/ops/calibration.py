"""Fixed outlier columns for int8 activations, chosen once per product from a calibration pass.

Under `activations="int8"` a GEMM over block weights meets its activations as int8 codes per 32 values, but for a
few columns that run far above the rest (the norms' weights and the gated products put some in every layer), which
are multiplied in fp32 instead (nt_block_gemm8). Chosen over each product's own rows, those columns would depend on
the rows beside a sequence's, and so would its numbers: its output would change with the batch it shares a step
with. Here they are chosen once per product instead, at load: a fixed conversation (`CALIBRATION_CHAT`, through the
model's chat template) runs through the model's modules with exact (int16) products, each block product's input
columns' largest magnitudes are recorded, and the kernel's own rule picks the columns (more than OUTLIER_RATIO times
the median column's largest value; the OUTLIER_MAX largest). Every product of any number of rows, a decode step's
included, then takes the int8 GEMM with them: a sequence's numbers are the same alone and in any batch.

The columns are cached as JSON under `cache_dir()/calibration`, keyed by the model file, its formats and the
calibration tokens, so a model is calibrated once per machine; so is the head draft's token ranking (one pass over the
same conversation, engine/head_draft.py), as an .npy array.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from nextoken.config import cache_dir
from nextoken.errors import NextokenError
from nextoken.ops import native
from nextoken.ops.quant_head import Int8GroupHead
from nextoken.ops.quant_linear import BlockLinear


class ChatInputs(Protocol):
    """What calibration needs of the engine's input processor (engine/inputs.py InputProcessor)."""

    def render_chat(self, messages: Any, add_generation_prompt: bool = True) -> tuple[str, list[int]]: ...

    def encode(self, text: str) -> list[int]: ...

logger = logging.getLogger("nextoken.calibration")

OUTLIER_RATIO = 3.0  # as gemm.c's OUTLIER_RATIO
VERSION = 1  # of the rule and the cached files' layout

# Prose, code, numbers, a list and Chinese, in turns: the kinds of text the models meet.
CALIBRATION_CHAT = (
    {"role": "user", "content": "What is the capital of France, and why did it become the capital?"},
    {"role": "assistant", "content": "The capital of France is Paris. It grew on an island in the Seine where "
                                     "trade routes crossed, and the kings of France made it their seat in the "
                                     "Middle Ages, so the government, the universities and the courts gathered "
                                     "there."},
    {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."},
    {"role": "assistant", "content": "```python\ndef fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in "
                                     "range(n):\n        a, b = b, a + b\n    return a\n```\nFor example, "
                                     "fibonacci(10) returns 55."},
    {"role": "user", "content": "List three prime numbers and add them up. Then translate 'good morning' into "
                                "Spanish."},
    {"role": "assistant", "content": "1. 2\n2. 3\n3. 5\n\n2 + 3 + 5 = 10. 'Good morning' in Spanish is "
                                     "'buenos días'."},
    {"role": "user", "content": "今天天气怎么样?"},
    {"role": "assistant", "content": "我无法查看实时天气, 但你可以看看天气预报或者窗外的天空。"},
)


def outlier_columns(colmax: torch.Tensor) -> torch.Tensor:
    """The outlier columns of one product's input, given each column's largest magnitude [K]: int32, ascending."""
    k = colmax.numel()
    limit = OUTLIER_RATIO * colmax.sort().values[k // 2]
    above = (colmax > limit).nonzero().flatten()
    if above.numel() > native.OUTLIER_MAX:
        above = above[colmax[above].topk(native.OUTLIER_MAX).indices]
    return above.sort().values.to(torch.int32)


def block_products(model: nn.Module) -> dict[str, BlockLinear | Int8GroupHead]:
    """The modules whose products can take int8 activations: projections over blocks and a head over the file's
    blocks."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, BlockLinear) and module.lib is not None
            or isinstance(module, Int8GroupHead) and module.lib is not None and module.weight is None}


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Within: the model's block products run exactly (two levels of codes) and each one's input columns' largest
    magnitudes are recorded, by module name, into the dict it yields."""
    seen: dict[str, torch.Tensor] = {}

    def record(name: str, module: nn.Module, args: tuple) -> None:
        x = args[0].detach()
        colmax = x.reshape(-1, x.shape[-1]).abs().amax(0).float().cpu()
        seen[name] = colmax if name not in seen else torch.maximum(seen[name], colmax)

    set_activations(model, "int16")
    handles = [module.register_forward_pre_hook(lambda m, a, name=name: record(name, m, a))
               for name, module in block_products(model).items()]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def columns_of(seen: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """The outlier columns of each product from the maxima `recording` saw."""
    return {name: outlier_columns(colmax).tolist() for name, colmax in seen.items()}


def fix_outliers(model: nn.Module, columns: Mapping[str, Sequence[int]], every_product: bool = True) -> None:
    """int8 activations with these outlier columns (by module name) in the block products. `every_product`: each
    must have its columns (else those without keep choosing theirs per product: a tensor-parallel worker's head,
    which never runs)."""
    products = block_products(model)
    missing = sorted(set(products) - set(columns))
    if missing and every_product:
        raise ValueError(f"no calibrated outlier columns for {', '.join(missing[:3])}")
    unknown = sorted(set(columns) - set(products))
    if unknown:
        raise ValueError(f"outlier columns for {', '.join(unknown[:3])}, which is not a block product")
    products = {name: module for name, module in products.items() if name in columns}
    for name, module in products.items():
        width = module.in_features if isinstance(module, BlockLinear) else module.blocks.qs.shape[1]
        if any(not 0 <= c < width for c in columns[name]):
            raise ValueError(f"outlier columns of {name} outside its {width} inputs")
    for name, module in products.items():
        module.outliers = torch.tensor(list(columns[name]), dtype=torch.int32)
    set_activations(model, "int8")


def set_activations(model: nn.Module, activations: str) -> None:
    setter = getattr(model, "set_activations", None)
    if setter is not None:
        setter(activations)  # CausalLM: rebuilds the fused decoder's structs
    else:
        for module in block_products(model).values():
            module.activations = activations


def calibration_ids(inputs: ChatInputs) -> list[int]:
    """CALIBRATION_CHAT through the model's chat template, or, where the template refuses it, its contents as plain
    text."""
    try:
        return inputs.render_chat(CALIBRATION_CHAT, add_generation_prompt=False)[1]
    except NextokenError:
        return inputs.encode("\n\n".join(m["content"] for m in CALIBRATION_CHAT))


def cache_path(model_path: Path, formats: str, token_ids: Sequence[int], what: str = "columns",
               suffix: str = ".json") -> Path:
    """Where `what` (the outlier columns; the head draft's token ranking, engine/head_draft.py) of this model file
    (by path, size and modification time; a directory's by its files'), formats and calibration tokens is kept."""
    files = sorted(f for f in model_path.iterdir() if f.is_file()) if model_path.is_dir() else [model_path]
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = json.dumps([VERSION, what, str(model_path.resolve()), stats, formats, list(token_ids)])
    return cache_dir() / "calibration" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}{suffix}"


def load_columns(path: Path) -> dict[str, list[int]] | None:
    """The cached columns, or None where there are none or they cannot be read."""
    try:
        columns = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    valid = isinstance(columns, dict) and all(
        isinstance(v, list) and len(v) <= native.OUTLIER_MAX and all(isinstance(c, int) and c >= 0 for c in v)
        and v == sorted(set(v)) for v in columns.values())
    return columns if valid else None


def save_columns(path: Path, columns: dict[str, list[int]]) -> None:
    """Keep the columns for the next load; a cache that cannot be written only costs the next load a pass."""
    _keep(path, json.dumps(columns).encode())


def load_ranking(path: Path, vocab_size: int) -> torch.Tensor | None:
    """A cached token ranking (every id of the vocabulary once, int64), or None where there is none or it is not
    one."""
    try:
        order = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        return None
    if order.shape != (vocab_size,) or order.dtype != np.int64 or not np.array_equal(np.sort(order),
                                                                                     np.arange(vocab_size)):
        return None
    return torch.from_numpy(order)


def save_ranking(path: Path, order: torch.Tensor) -> None:
    """Keep a token ranking for the next load, as an .npy array."""
    buffer = io.BytesIO()
    np.save(buffer, order.numpy().astype(np.int64), allow_pickle=False)
    _keep(path, buffer.getvalue())


def _keep(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all (readers never see half a file); a cache that cannot be written
    only costs the next load its pass."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_bytes(data)
        temporary.replace(path)
    except OSError as exc:
        logger.info("calibration not cached (%s)", exc)

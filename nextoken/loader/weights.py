"""A model's weights in the file's own storage: every parameter an architecture maps to file tensors is checked against
its configuration, and each matrix (projections, the token table, the LM head) is attached as the file stores it
(`FileTensor`: the raw blocks in the memory map, their type and shape, the model's order of their rows), undecoded, its
module wrapped in a `FileBacked`. Which format each runs in is chosen afterwards, by a pass over the modules
(ops/quantize.py). Vectors (norm weights) have no such choice: they are decoded to fp32 here. A model left as loaded
still runs, decoding its matrices (loader/codec.py) on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from nextoken.errors import ModelLoadError
from nextoken.loader.codec import check, dequantize, q4_nibbles, q5_codes, q6_codes, q8_0_codes
from nextoken.loader.gguf import ModelFile

if TYPE_CHECKING:
    from nextoken.models.base import CausalLM

_Q = GGMLQuantizationType


@dataclass(frozen=True, eq=False)
class FileTensor:
    """One tensor as the file stores it: `raw`, its bytes (a read-only view into the memory map), its GGML type and
    numpy-order shape, and `row_order`, the order in which the model takes its rows (dim 0; None: as stored), which
    applies to whatever is decoded from them."""

    name: str
    raw: np.ndarray
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    row_order: torch.Tensor | None = None

    def floats(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values (bit-exact to ggml's dequantization, rounded to `dtype`), rows in the model's order; in `out`
        where given."""
        if self.row_order is None:
            return dequantize(self.raw, self.qtype, self.shape, dtype, name=self.name, out=out)
        values = dequantize(self.raw, self.qtype, self.shape, dtype, name=self.name)
        return values[self.row_order] if out is None else torch.index_select(values, 0, self.row_order, out=out)

    def codes(self) -> tuple[torch.Tensor, ...]:
        """A 2-D tensor's blocks as the codes and factors that give its values exactly (loader/codec.py), rows in the
        model's order: Q4_0, Q4_1, Q4_K -> (codes 0..15 two a byte in GGML's nibble order [rows, cols / 2], d, m),
        w = d * q + m; Q5_0, Q6_K, Q8_0 -> (int8 codes [rows, cols], d)."""
        rows, cols = self.shape
        q4 = q4_nibbles(self.raw, self.qtype, (rows, cols))  # None unless Q4_0, Q4_1 or Q4_K
        if q4 is not None:
            codes: tuple[torch.Tensor, ...] = q4
        elif self.qtype in _INT8_CODES:
            codes = _INT8_CODES[self.qtype](self.raw, (rows, cols))
        else:
            raise ValueError(f"{self.name}: {self.qtype.name} blocks have no exact codes")
        return codes if self.row_order is None else tuple(t[self.row_order] for t in codes)


_INT8_CODES = {_Q.Q5_0: q5_codes, _Q.Q6_K: q6_codes, _Q.Q8_0: q8_0_codes}


class FileBacked(nn.Module):
    """A module whose parameters still lie in the file: `module`, as the architecture built it (on the meta device;
    one called only through `forward`: a Linear, an Embedding), and `tensors`, each parameter's file tensors, stacked
    along dim 0 (a fused projection's q, k and v). It runs as `module` with its parameters decoded to fp32 on every
    call."""

    def __init__(self, module: nn.Module, tensors: dict[str, tuple[FileTensor, ...]]) -> None:
        super().__init__()
        self.module = module
        self.tensors = tensors

    def floats(self, param: str = "weight", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Parameter `param` in `dtype`: its file tensors decoded, each straight into its rows."""
        tensors = self.tensors[param]
        if len(tensors) == 1:
            return tensors[0].floats(dtype)
        stacked = torch.empty(sum(t.shape[0] for t in tensors), *tensors[0].shape[1:], dtype=dtype)  # [rows, cols]
        at = 0
        for t in tensors:
            t.floats(dtype, out=stacked[at:at + t.shape[0]])
            at += t.shape[0]
        return stacked

    @property
    def weight(self) -> torch.Tensor:
        """The fp32 weight, decoded (an LM head's, which the model reads as a tensor)."""
        return self.floats("weight")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        params = {name: self.floats(name) for name in self.tensors}
        return torch.func.functional_call(self.module, params, args, kwargs)


def load_weights(model: CausalLM, gguf: ModelFile, progress: Callable[[str], None] | None = None) -> None:
    """Fill `model` (built on the meta device) from `gguf`: each module holding a matrix becomes a `FileBacked` over
    the file's tensors, vectors become fp32 parameters. Raises ModelLoadError for a missing tensor, a type that cannot
    be decoded, or shapes that do not make this configuration's parameter; `progress` is called with each parameter's
    name."""
    expected = dict(model.named_parameters())
    tensor_map = model.gguf_tensor_map()
    unmapped = set(expected) - set(tensor_map)
    assert not unmapped, f"parameters no file tensor fills: {sorted(unmapped)}"  # the architecture's map is complete
    owners: dict[str, dict[str, tuple[FileTensor, ...]]] = {}
    for param, files in tensor_map.items():
        infos = []
        for name in files:
            info = gguf.tensors.get(name)
            if info is None:
                raise ModelLoadError(gguf.path, f"missing tensor {name!r}")
            infos.append(info)
        # Checked on the file's shapes: tensors stacked into one parameter (a fused projection) must agree past their
        # rows, and together match this configuration.
        shapes = [tuple(info.shape) for info in infos]
        want = tuple(expected[param].shape)
        if (sum(s[0] for s in shapes), *shapes[0][1:]) != want or any(s[1:] != shapes[0][1:] for s in shapes):
            raise ModelLoadError(gguf.path, f"tensor(s) {', '.join(files)} have shape(s) {shapes}, expected "
                                            f"{want} for this configuration")
        tensors = []
        for info in infos:
            raw = gguf.raw(info.name)
            check(raw, info.qtype, info.shape, name=info.name)  # a type we cannot decode fails here, not later
            tensors.append(FileTensor(info.name, raw, info.qtype, info.shape,
                                      model.row_order(info.name, info.shape[0])))
        owner, _, attr = param.rpartition(".")
        if len(want) == 1:  # a norm's weight: fp32 in every format
            vector = tensors[0].floats() if len(tensors) == 1 else torch.cat([t.floats() for t in tensors])
            setattr(model.get_submodule(owner), attr, nn.Parameter(vector, requires_grad=False))
        else:
            owners.setdefault(owner, {})[attr] = tuple(tensors)
        if progress is not None:
            progress(param)
    for owner, params in owners.items():
        model.set_submodule(owner, FileBacked(model.get_submodule(owner), params))

"""A Hugging Face model directory, presented as the GGUF file llama.cpp's converter (convert_hf_to_gguf.py) would write
from it, without writing anything: `read_hf_directory(path) -> HFDirectory`, with GGUFFile's interface (`metadata`
under llama.cpp's keys, `tensors` under its names and layouts, `raw(name)`), so that ModelConfig.from_gguf and
load_weights read it unchanged.

Only .safetensors weights are read (pickle files can run code when loaded); their headers are checked, and every
tensor is mapped and shape-checked against config.json, when the directory is opened. Tensor bytes stay in the
memory-mapped shards until `raw` asks for one; a tensor the conversion changes (permuted, transposed, stacked, made
float32) is computed on each call. Every problem raises ModelLoadError naming the file at fault.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, LlamaFileType
from safetensors import SafetensorError, safe_open

from nextoken.errors import ModelLoadError
from nextoken.loader.gguf import ModelFile, TensorInfo
from nextoken.loader.hf_conventions import (
    FAMILIES,
    Family,
    Hparams,
    expected_shapes,
    llama3_rope_factors,
    longrope_factors,
    permute_qk,
)
from nextoken.tokenizer.from_hf import HFTokenizerFiles, read_hf_tokenizer, read_json

_Q = GGMLQuantizationType
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Stored dtypes read as they are (their GGML types) and as torch reads them.
DTYPES = {"F32": (_Q.F32, torch.float32), "F16": (_Q.F16, torch.float16), "BF16": (_Q.BF16, torch.bfloat16)}
FILE_TYPES = {_Q.F32: LlamaFileType.ALL_F32, _Q.F16: LlamaFileType.MOSTLY_F16, _Q.BF16: LlamaFileType.MOSTLY_BF16}
# Buffers llama.cpp's converter drops (recomputed at run time).
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias", ".attn.bias",
                    ".attn.masked_bias")
# Tensors llama.cpp always stores in float32, besides vectors and norms.
F32_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "position_embd.weight")
# One expert's projection (Mixtral's w1/w2/w3, Qwen2-MoE's gate/up/down_proj), stacked into one 3-D tensor.
_EXPERT = re.compile(r"(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight")
# transformers 5's fused experts: gate_up_proj [experts, 2 * ffn, hidden] and down_proj [experts, hidden, ffn].
_FUSED_EXPERTS = re.compile(r"(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(\.weight)?")


@dataclass(frozen=True)
class Source:
    """One tensor of a .safetensors shard, from its header."""

    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Plan:
    """How one GGUF tensor is made: `make` over its sources' values (several: experts, stacked), then `qtype`."""

    sources: tuple[Source, ...]
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    make: Callable[[list[torch.Tensor]], torch.Tensor]


class HFDirectory(ModelFile):
    """A model directory as a GGUF file: `path` (the directory), `metadata`, `tensors`, `raw(name)` as GGUFFile's;
    `sources` (each GGUF tensor's Hugging Face tensors, none for one computed from config.json) and `tokenizer_files`
    (tokenizer.json and the spec derived from it, for the text side)."""

    def __init__(self, path: Path, metadata: dict[str, Any], plans: dict[str, Plan],
                 handles: Mapping[Path, Any], tokenizer_files: HFTokenizerFiles) -> None:
        self.path = path
        self.metadata = metadata
        self.tokenizer_files = tokenizer_files
        self._plans = plans
        self._handles = handles  # shard -> its open safe_open handle
        self.tensors = {name: TensorInfo(name, p.shape, p.qtype, 0, _nbytes(p.shape, p.qtype))
                        for name, p in plans.items()}  # offset 0: the bytes lie in no single file
        self.sources = {name: tuple(s.name for s in p.sources) for name, p in plans.items()}

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes in its GGML type, read-only: a view into the shard's memory map where the conversion
        leaves it as stored, else computed now."""
        plan = self._plans[name]
        values = plan.make([self._load(s) for s in plan.sources])
        out = values.to(DTYPES[plan.qtype.name][1]).contiguous().reshape(-1).view(torch.uint8).numpy()
        out.flags.writeable = False
        return out

    def _load(self, source: Source) -> torch.Tensor:
        try:
            return self._handles[source.file].get_tensor(source.name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(source.file, f"cannot read tensor {source.name!r}: {exc}") from None

    def __repr__(self) -> str:
        return f"HFDirectory({str(self.path)!r}, {self.architecture}, tensors={len(self.tensors)})"


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    return int(np.prod(shape, dtype=np.int64)) * gguf.GGML_QUANT_SIZES[qtype][1]


def read_hf_directory(path: str | os.PathLike[str]) -> HFDirectory:
    """Open a Hugging Face model directory (config.json, .safetensors weights, tokenizer.json) as llama.cpp's
    converter would write it; raises ModelLoadError naming the file at fault."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(path, "is not a directory")
    config_path = path / "config.json"
    if not config_path.exists():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; for a GGUF file, pass its path ({ggufs[0]} is here)" if ggufs else ""
        raise ModelLoadError(config_path, f"missing: a Hugging Face model directory holds config.json, .safetensors "
                                          f"weights and tokenizer.json{hint}")
    config = read_json(config_path, required=True)
    assert config is not None
    if config.get("quantization_config") is not None:
        raise ModelLoadError(config_path, "quantized checkpoints (quantization_config) are not supported; use the "
                                          "model's float32, float16 or bfloat16 weights")
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ModelLoadError(config_path, f"model_type {model_type!r} is not supported "
                                          f"(supported: {', '.join(FAMILIES)})")
    try:
        hp = Hparams(config)
        arch_metadata = family.metadata(hp, family.name)
        extra = {"rope_freqs.weight": llama3_rope_factors(hp), **longrope_factors(hp)}
        vocab_size = hp.vocab_size
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelLoadError(config_path, f"{exc}") from None
    handles, sources = _open_shards(path)
    tokenizer = read_hf_tokenizer(path, config, vocab_size, trim=family.trim_vocab)
    num_tokens = len(tokenizer.spec.tokens)
    plans = _adjust(family, _plan(family, hp, sources, {n: t for n, t in extra.items() if t is not None}), num_tokens)
    _check_shapes(plans, expected_shapes(hp, num_tokens), config, next(iter(handles)))
    metadata: dict[str, Any] = {
        "general.architecture": family.name,
        "general.type": "model",
        "general.name": path.resolve().name,
        **arch_metadata,
        "general.file_type": int(_file_type(plans)),
        **tokenizer.metadata,
        "tokenizer.ggml.eog_token_ids": np.asarray(tokenizer.eog_ids, dtype=np.uint32),
    }
    return HFDirectory(path, metadata, plans, handles, tokenizer)


def _shard_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    """The .safetensors files (from the index where there is one) and the index's tensor -> file map."""
    index_path = path / INDEX
    index = read_json(index_path, required=False)
    if index is not None:
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or \
                not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise ModelLoadError(index_path, "weight_map must map tensor names to file names")
        for name in sorted(set(weight_map.values())):
            if Path(name).name != name or name in ("", ".", ".."):
                raise ModelLoadError(index_path, f"names {name!r}, which is not a file in the directory")
            if not (path / name).is_file():
                raise ModelLoadError(path / name, f"missing: {INDEX} places tensors in it")
        return [path / n for n in sorted(set(weight_map.values()))], weight_map
    shards = sorted(p for p in path.glob("model*.safetensors") if p.is_file())
    if shards:
        return shards, {}
    pickles = sorted((p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES),
                     key=lambda p: (not p.name.startswith(("pytorch_model", "model")), p.name))  # weights first
    if pickles:
        raise ModelLoadError(pickles[0], "refusing pickle-based weights: loading them can run code; use the "
                                         "model's .safetensors files")
    raise ModelLoadError(path, "no model.safetensors (or model.safetensors.index.json and its shards)")


def _open_shards(path: Path) -> tuple[dict[Path, Any], dict[str, Source]]:
    """Each shard opened (its header validated against its size) and every tensor's header entry."""
    files, weight_map = _shard_files(path)
    handles: dict[Path, Any] = {}
    sources: dict[str, Source] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
            entries = [(name, handle.get_slice(name)) for name in handle.keys()]
            headers = [(name, tuple(s.get_shape()), s.get_dtype()) for name, s in entries]
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(file, f"not a readable .safetensors file: {exc}") from None
        handles[file] = handle
        for name, shape, dtype in headers:
            if name in sources:
                raise ModelLoadError(file, f"tensor {name!r} is also in {sources[name].file.name}")
            if dtype not in DTYPES:
                raise ModelLoadError(file, f"tensor {name!r} is stored as {dtype}; nextoken reads F32, F16 and "
                                           f"BF16")
            sources[name] = Source(file, name, shape, dtype)
    for name, file_name in weight_map.items():
        if name not in sources:
            raise ModelLoadError(path / file_name, f"lacks tensor {name!r}, which {INDEX} places in it")
    return handles, sources


def _qtype(gguf_name: str, ndim: int, stored: str) -> GGMLQuantizationType:
    """llama.cpp's choice: vectors, norms, routers, position tables and biases in F32; other matrices as stored."""
    kind = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
    if ndim <= 1 or gguf_name.endswith("_norm.weight") or kind in F32_TENSORS or not gguf_name.endswith(".weight"):
        return _Q.F32
    return DTYPES[stored][0]


def _plan(family: Family, hp: Hparams, sources: dict[str, Source],
          extra: dict[str, torch.Tensor]) -> dict[str, Plan]:
    """Every GGUF tensor: its name through the gguf package's map for the architecture, and llama.cpp's layout."""
    names = gguf.get_tensor_name_map(family.arch, hp.num_layers)
    plans: dict[str, Plan] = {}
    experts: dict[tuple[str, str], dict[int, Source]] = {}

    def add(hf_name: str, srcs: tuple[Source, ...], shape: tuple[int, ...],
            make: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ModelLoadError(srcs[0].file, f"tensor {srcs[0].name!r} has no {family.name} GGUF name (llama.cpp's "
                                               f"converter refuses it too)")
        if gguf_name in plans:
            raise ModelLoadError(srcs[0].file, f"tensors {plans[gguf_name].sources[0].name!r} and "
                                               f"{srcs[0].name!r} both make {gguf_name}")
        plans[gguf_name] = Plan(srcs, shape, _qtype(gguf_name, len(shape), srcs[0].dtype), make)

    for name, src in sorted(sources.items()):
        if name.endswith(SKIPPED_SUFFIXES) or name in family.skipped:
            continue
        if (m := _EXPERT.fullmatch(name)) is not None:
            experts.setdefault((m["prefix"], m["proj"]), {})[int(m["expert"])] = src
        elif (m := _FUSED_EXPERTS.fullmatch(name)) is not None and len(src.shape) == 3 and m["proj"] == "gate_up_proj":
            num, rows, cols = src.shape  # gate's rows, then up's
            for k, proj in enumerate(("gate_proj", "up_proj")):
                add(f"{m['prefix']}.{proj}.weight", (src,), (num, rows // 2, cols),
                    partial(_rows, k * rows // 2, (k + 1) * rows // 2))
        elif m is not None and len(src.shape) == 3:
            add(f"{m['prefix']}.down_proj.weight", (src,), src.shape, _stored)
        elif family.permute_qk and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = hp.num_heads if ".q_proj." in name else hp.num_kv_heads
            add(name, (src,), src.shape, partial(_permuted, heads))
        elif name.endswith(family.conv1d) and len(src.shape) == 2:
            add(name, (src,), src.shape[::-1], _transposed)
        else:
            add(name, (src,), src.shape, _stored)
    num_experts = hp.opt("num_local_experts", "num_experts") or 0
    for (prefix, proj), group in sorted(experts.items()):
        first = group[min(group)]
        if sorted(group) != list(range(num_experts)):
            raise ModelLoadError(first.file, f"{prefix}.*.{proj} holds experts {sorted(group)}; config.json has "
                                             f"{num_experts}")
        srcs = tuple(group[e] for e in range(num_experts))
        odd = next((s for s in srcs if (s.shape, s.dtype) != (first.shape, first.dtype)), None)
        if odd is not None:
            raise ModelLoadError(odd.file, f"tensor {odd.name!r} is {odd.dtype} {list(odd.shape)}, unlike "
                                           f"{first.name!r} ({first.dtype} {list(first.shape)})")
        add(f"{prefix}.{proj}.weight", srcs, (num_experts, *first.shape), torch.stack)
    for name, values in extra.items():
        plans[name] = Plan((), tuple(values.shape), _Q.F32, partial(_constant, values))
    return plans


# How a GGUF tensor is made from its sources' values (`Plan.make`).
def _stored(values: list[torch.Tensor]) -> torch.Tensor:
    return values[0]


def _transposed(values: list[torch.Tensor]) -> torch.Tensor:
    return values[0].t()


def _permuted(num_heads: int, values: list[torch.Tensor]) -> torch.Tensor:
    return permute_qk(values[0], num_heads)


def _rows(start: int, stop: int, values: list[torch.Tensor]) -> torch.Tensor:
    return values[0][:, start:stop]  # [experts, stop - start, cols]


def _constant(constant: torch.Tensor, values: list[torch.Tensor]) -> torch.Tensor:
    return constant


def _first_rows(num_rows: int, make: Callable[[list[torch.Tensor]], torch.Tensor],
                values: list[torch.Tensor]) -> torch.Tensor:
    return make(values)[:num_rows]


def _shifted(shift: float, make: Callable[[list[torch.Tensor]], torch.Tensor],
             values: list[torch.Tensor]) -> torch.Tensor:
    return make(values).float() + shift  # in fp32, as llama.cpp adds it


def _adjust(family: Family, plans: dict[str, Plan], num_tokens: int) -> dict[str, Plan]:
    """What the family's conversion changes in values: Gemma's norms stored as 1 + w, its token table cut to the
    tokenizer's `num_tokens` ids."""
    embd = plans.get("token_embd.weight")
    if family.trim_vocab and embd is not None and embd.shape[0] > num_tokens:  # rows no token reaches
        plans["token_embd.weight"] = replace(embd, shape=(num_tokens, *embd.shape[1:]),
                                             make=partial(_first_rows, num_tokens, embd.make))
    if family.norm_shift:
        for name, plan in plans.items():
            if name.endswith("norm.weight"):
                plans[name] = replace(plan, make=partial(_shifted, family.norm_shift, plan.make))
    return plans


def _check_shapes(plans: Mapping[str, Plan], shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any],
                  weights: Path) -> None:
    """Each tensor's shape against config.json's; and an untied model must have its LM head."""
    for name, plan in plans.items():
        want = shapes.get(re.sub(r"^blk\.\d+\.", "", name))
        if want is not None and plan.shape != want:
            src = plan.sources[0]
            raise ModelLoadError(src.file, f"tensor {src.name!r} has shape {list(src.shape)}, making {name} "
                                           f"{list(plan.shape)} where config.json gives {list(want)}")
    if config.get("tie_word_embeddings") is False and "output.weight" not in plans:
        raise ModelLoadError(weights, "has no lm_head.weight, but config.json sets tie_word_embeddings to false")


def _file_type(plans: Mapping[str, Plan]) -> LlamaFileType:
    """general.file_type: the type holding most of the matrices' elements."""
    counts: dict[GGMLQuantizationType, int] = {}
    for plan in plans.values():
        if len(plan.shape) >= 2:
            counts[plan.qtype] = counts.get(plan.qtype, 0) + int(np.prod(plan.shape, dtype=np.int64))
    return FILE_TYPES[max(counts, key=counts.__getitem__)] if counts else LlamaFileType.ALL_F32

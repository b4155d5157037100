"""`nextoken convert DIR OUT.gguf`: a Hugging Face directory written as the GGUF file llama.cpp's converter would
write: the directory's view (loader/hf.py: llama.cpp's tensor names, layouts and metadata keys) with each matrix in
the asked type, by the `gguf` package's writer and its own quantizers.

Types, as llama.cpp's `--outtype`: f32, f16, bf16, q8_0 (8-bit blocks of 32) and q4_0 (4-bit blocks of 32). Vectors
(norms, biases), the RoPE factor tables and a mixture's routers stay F32, as llama.cpp keeps them; a matrix whose rows
blocks of 32 cannot tile falls back to F16.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, LlamaFileType

from nextoken.errors import ModelLoadError, NextokenError
from nextoken.loader.codec import dequantize
from nextoken.loader.hf import read_hf_directory

_Q = GGMLQuantizationType
TYPES: dict[str, tuple[GGMLQuantizationType, LlamaFileType]] = {
    "f32": (_Q.F32, LlamaFileType.ALL_F32), "f16": (_Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (_Q.BF16, LlamaFileType.MOSTLY_BF16), "q8_0": (_Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (_Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
KEEP_F32 = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight", "ffn_gate_inp.weight",
            "ffn_gate_inp_shexp.weight")


@dataclass(frozen=True)
class Converted:
    path: Path
    architecture: str
    tensors: int
    bytes: int
    types: dict[str, int]  # GGML type name -> tensors written in it


def tensor_type(name: str, shape: tuple[int, ...], wanted: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type one tensor is written in."""
    if len(shape) == 1 or name.endswith(KEEP_F32):
        return _Q.F32
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    return wanted if shape[-1] % block == 0 else _Q.F16


def convert(directory: str | os.PathLike[str], out: str | os.PathLike[str], outtype: str = "f16",
            progress: Callable[[str], None] | None = None) -> Converted:
    """Write `directory` as a GGUF file at `out` with its matrices in `outtype` (TYPES)."""
    if outtype not in TYPES:
        raise NextokenError(f"unknown type {outtype!r} (choose from {', '.join(TYPES)})")
    wanted, file_type = TYPES[outtype]
    view = read_hf_directory(directory)
    out = Path(out)
    if out.exists() and out.is_dir():
        raise NextokenError(f"{out} is a directory; give the path of the .gguf file to write")
    writer = gguf.GGUFWriter(str(out), view.architecture)
    for key, value in view.metadata.items():
        if key == "general.architecture":
            continue  # the writer's own first key
        _add(writer, key, file_type.value if key == "general.file_type" else value)
    counts: dict[str, int] = {}
    for name, info in view.tensors.items():
        values = dequantize(view.raw(name), info.qtype, info.shape, name=name).numpy()
        qtype = tensor_type(name, info.shape, wanted)
        if qtype == _Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
        elif qtype == _Q.F16:
            writer.add_tensor(name, values.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        if progress is not None:
            progress(name)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except OSError as exc:
        writer.close()
        out.unlink(missing_ok=True)  # never leave half a file that looks like a model
        raise NextokenError(f"cannot write {out}: {exc.strerror}") from None
    writer.close()
    return Converted(out, view.architecture, len(view.tensors), out.stat().st_size, counts)


def _add(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    """One metadata value in the GGUF type llama.cpp gives such a value: counts and ids uint32, reals float32."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        if 0 <= value < 2**32:
            writer.add_uint32(key, value)
        else:
            writer.add_int64(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise ModelLoadError(key, f"metadata of type {type(value).__name__} has no GGUF type")

"""GGUF files in: a validating, memory-mapped reader built on the `gguf` package's type tables.

Every count, length, shape and offset is checked with Python integers against the file's size before anything is
allocated, so a malformed file raises `ModelLoadError` naming the file and the field, never an IndexError, a huge
allocation or a read outside the file. Tensor bytes stay in the memory map until a loader asks for them.

Why not `gguf.GGUFReader` itself: it builds a numpy view per array element (4.5 s for SmolLM2's 49k-token
vocabulary, 20 s for Gemma 3's 262k) and trusts every count in the file; this walk does both jobs in one pass.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from nextoken.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 4  # real files nest at most 1 deep; this stops a crafted file recursing thousands deep
MAX_KEY_BYTES = 65_536
INT64_MAX = 2**63 - 1

# Fixed-size scalar types: struct format (little-endian) and numpy dtype.
_SCALARS: dict[GGUFValueType, tuple[str, str]] = {
    GGUFValueType.UINT8: ("<B", "<u1"),
    GGUFValueType.INT8: ("<b", "<i1"),
    GGUFValueType.UINT16: ("<H", "<u2"),
    GGUFValueType.INT16: ("<h", "<i2"),
    GGUFValueType.UINT32: ("<I", "<u4"),
    GGUFValueType.INT32: ("<i", "<i4"),
    GGUFValueType.FLOAT32: ("<f", "<f4"),
    GGUFValueType.BOOL: ("<?", "<u1"),
    GGUFValueType.UINT64: ("<Q", "<u8"),
    GGUFValueType.INT64: ("<q", "<i8"),
    GGUFValueType.FLOAT64: ("<d", "<f8"),
}
_VALUE_TYPES = {int(t): t for t in GGUFValueType}
_QUANT_TYPES = {int(t): t for t in GGMLQuantizationType}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's place in the file. `shape` is numpy order: the last dimension is the contiguous row."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class ModelFile:
    """What the rest of nextoken reads of a model: metadata under GGUF keys, tensors under GGUF names and layouts, and
    their bytes (`raw`). A GGUF file (`GGUFFile`) and a Hugging Face directory read as one (loader/hf.py
    `HFDirectory`) are both one."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]

    def raw(self, name: str) -> np.ndarray:
        raise NotImplementedError

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def num_parameters(self) -> int:
        return sum(t.num_elements for t in self.tensors.values())


class GGUFFile(ModelFile):
    """A parsed, validated GGUF file: `metadata` (key -> value) and `tensors` (name -> TensorInfo).

    Scalars become Python values, arrays of strings `list[str]`, numeric arrays numpy arrays. `raw(name)` returns a
    read-only uint8 view of a tensor's bytes inside the memory map (no copy).
    """

    def __init__(self, path: Path, version: int, metadata: dict[str, Any], tensors: dict[str, TensorInfo],
                 data_offset: int, alignment: int, file_size: int, buffer: mmap.mmap) -> None:
        self.path = path
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.data_offset = data_offset
        self.alignment = alignment
        self.file_size = file_size
        self._buffer = buffer

    def raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return np.frombuffer(self._buffer, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, version={self.version}, tensors={len(self.tensors)})"


class _Cursor:
    """Bounds-checked reads over the mapped file; every failure names the field being read."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path) -> None:
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = 0

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(self.path, what)

    def need(self, nbytes: int, what: str) -> None:
        if nbytes < 0 or self.pos + nbytes > self.size:
            raise self.fail(f"truncated: {what} needs {nbytes} bytes at offset {self.pos}, "
                            f"but the file has {self.size} bytes")

    def scalar(self, fmt: str, nbytes: int, what: str) -> Any:
        self.need(nbytes, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += nbytes
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar("<I", 4, what))

    def u64(self, what: str) -> int:
        return int(self.scalar("<Q", 8, what))

    def string(self, what: str, max_len: int | None = None) -> str:
        length = self.u64(f"length of {what}")
        if max_len is not None and length > max_len:
            raise self.fail(f"{what} is {length} bytes long (at most {max_len} allowed)")
        self.need(length, what)
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: GGUFValueType, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            fmt, dtype = _SCALARS[vtype]
            value = self.scalar(fmt, np.dtype(dtype).itemsize, what)
            return bool(value) if vtype == GGUFValueType.BOOL else value
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what, depth + 1)
        raise self.fail(f"{what} has unknown value type {int(vtype)}")

    def value_type(self, what: str) -> GGUFValueType:
        code = self.u32(f"type of {what}")
        if code not in _VALUE_TYPES:
            raise self.fail(f"{what} has unknown value type {code}")
        return _VALUE_TYPES[code]

    def array(self, what: str, depth: int) -> Any:
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(f"{what} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        etype = self.value_type(f"elements of {what}")
        count = self.u64(f"length of {what}")
        remaining = self.size - self.pos
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1])
            nbytes = count * dtype.itemsize  # Python int: cannot overflow
            self.need(nbytes, f"{what} ({count} elements)")
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += nbytes
            return arr.astype(bool) if etype == GGUFValueType.BOOL else arr
        # Strings take at least 8 bytes (their length), nested arrays at least 12: a count that could not fit in
        # the rest of the file is rejected before any list is built.
        min_size = 8 if etype == GGUFValueType.STRING else 12
        if count * min_size > remaining:
            raise self.fail(f"{what} claims {count} elements, more than the {remaining} bytes left can hold")
        if etype == GGUFValueType.STRING:
            return self._strings(count, what)
        return [self.value(etype, f"{what}[{i}]", depth) for i in range(count)]

    def _strings(self, count: int, what: str) -> list[str]:
        # The hot loop of a load (262k vocabulary strings) only reads lengths: past the end of the file, unpack_from
        # raises, and a last length too long leaves pos past it; either way a second walk names the string. The
        # strings are then decoded in one call, joined by NUL, which ends any UTF-8 sequence as a string's end does.
        buf, size, pos = self.buf, self.size, self.pos
        start = pos
        unpack = struct.Struct("<Q").unpack_from
        lengths: list[int] = []
        append = lengths.append
        try:
            for _ in range(count):
                (length,) = unpack(buf, pos)
                append(length)
                pos += 8 + length
        except (struct.error, OverflowError):  # an offset past the end, or past any index
            pos = size + 1
        if pos > size:
            self._truncated_string(start, count, what)
        self.pos = pos
        if count == 0:
            return []
        region = np.frombuffer(buf, dtype=np.uint8, count=pos - start, offset=start).copy()
        lens = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(lens + 8)  # each string's end within the region
        heads = ends - lens - 8  # where its 8-byte length field starts
        keep = np.ones(region.size, dtype=bool)
        keep[(heads[:, None] + np.arange(1, 8)).ravel()] = False
        region[heads] = 0  # each length field's first byte becomes the separator
        out = region[keep][1:].tobytes().decode("utf-8", errors="replace").split("\0")
        if len(out) == count:
            return out
        # A string holding NUL itself: one decode per string.
        return [buf[start + h + 8:start + e].decode("utf-8", errors="replace")
                for h, e in zip(heads.tolist(), ends.tolist())]

    def _truncated_string(self, pos: int, count: int, what: str) -> NoReturn:
        """Raise naming the first of `count` strings from `pos` that does not fit in the file."""
        for i in range(count):
            if pos + 8 > self.size:
                self.pos = pos
                raise self.fail(f"truncated: length of {what}[{i}] at offset {pos} is past the end of the file")
            (length,) = struct.unpack_from("<Q", self.buf, pos)
            pos += 8
            if pos + length > self.size:
                raise self.fail(f"truncated: {what}[{i}] needs {length} bytes at offset {pos}, "
                                f"but the file has {self.size} bytes")
            pos += length
        raise AssertionError("called for strings that fit")


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse and validate a GGUF file; raises ModelLoadError naming the file and the problem."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(path, "no such file")
    if path.is_dir():
        raise ModelLoadError(path, "is a directory, not a GGUF file")
    if not path.is_file():
        raise ModelLoadError(path, "is not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise ModelLoadError(path, "the file is empty")
    try:
        with open(path, "rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ModelLoadError(path, f"cannot be opened: {e.strerror}") from None
    cur = _Cursor(buf, size, path)
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise ModelLoadError(path, f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (a big-endian file?)" if version >= 1 << 16 else ""
        raise ModelLoadError(path, f"unsupported GGUF version {version}{hint}; supported: {SUPPORTED_VERSIONS}")
    num_tensors = cur.u64("tensor count")
    num_kv = cur.u64("metadata count")
    # A metadata entry takes at least 13 bytes (key length, type, one-byte value) and a tensor entry at least 32.
    if num_kv * 13 + num_tensors * 32 > size - cur.pos:
        raise ModelLoadError(path, f"header claims {num_kv} metadata entries and {num_tensors} tensors, "
                                   f"more than a {size}-byte file can hold")

    metadata: dict[str, Any] = {}
    for i in range(num_kv):
        key = cur.string(f"metadata key #{i}", max_len=MAX_KEY_BYTES)
        if key in metadata:
            raise ModelLoadError(path, f"duplicate metadata key {key!r}")
        metadata[key] = cur.value(cur.value_type(key), key)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if isinstance(alignment, (bool, np.ndarray, str, float, list)) or not isinstance(alignment, int) \
            or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(path, f"general.alignment must be a positive power of two, got {alignment!r}")

    infos = [_read_tensor_info(cur, i) for i in range(num_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, qtype, rel_offset in infos:
        if name in tensors:
            raise ModelLoadError(path, f"duplicate tensor name {name!r}")
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block_size:
            raise ModelLoadError(path, f"tensor {name!r}: row length {shape[-1]} is not a multiple of "
                                       f"{qtype.name}'s block size {block_size}")
        if rel_offset % alignment:
            raise ModelLoadError(path, f"tensor {name!r}: offset {rel_offset} is not aligned to {alignment}")
        num_elements = 1
        for d in shape:
            num_elements *= d
        nbytes = num_elements // block_size * type_size
        offset = data_offset + rel_offset
        if offset + nbytes > size:
            raise ModelLoadError(path, f"tensor {name!r}: data [{offset}, {offset + nbytes}) lies beyond the "
                                       f"end of the file ({size} bytes)")
        tensors[name] = TensorInfo(name, shape, qtype, offset, nbytes)
    _check_overlaps(path, tensors)
    return GGUFFile(path, version, metadata, tensors, data_offset, alignment, size, buf)


def _read_tensor_info(cur: _Cursor, i: int) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string(f"name of tensor #{i}", max_len=MAX_KEY_BYTES)
    num_dims = cur.u32(f"dimension count of tensor {name!r}")
    if not 1 <= num_dims <= MAX_DIMS:
        raise cur.fail(f"tensor {name!r} has {num_dims} dimensions (1 to {MAX_DIMS} supported)")
    dims = [cur.u64(f"dimension {d} of tensor {name!r}") for d in range(num_dims)]
    num_elements = 1
    for d in dims:
        if d == 0:
            raise cur.fail(f"tensor {name!r} has a zero dimension {dims}")
        num_elements *= d
    if num_elements > INT64_MAX:
        raise cur.fail(f"tensor {name!r}: dimensions {dims} overflow 64 bits")
    code = cur.u32(f"type of tensor {name!r}")
    if code not in _QUANT_TYPES or _QUANT_TYPES[code] not in GGML_QUANT_SIZES:
        raise cur.fail(f"tensor {name!r} has unknown quantization type {code}")
    rel_offset = cur.u64(f"offset of tensor {name!r}")
    # GGUF lists dimensions fastest-first (ne[0] is the row length); numpy order is the reverse.
    return name, tuple(reversed(dims)), _QUANT_TYPES[code], rel_offset


def _check_overlaps(path: Path, tensors: dict[str, TensorInfo]) -> None:
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (_, end, name), (start, _, next_name) in zip(spans, spans[1:]):
        if start < end:
            raise ModelLoadError(path, f"tensors {name!r} and {next_name!r} overlap in the file")

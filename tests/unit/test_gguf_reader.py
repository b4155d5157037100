"""The GGUF reader against the `gguf` package's own reader, and every malformed-file case raising ModelLoadError."""

from __future__ import annotations

import resource
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nextoken.errors import ModelLoadError, NextokenError
from nextoken.loader.gguf import read_gguf
from nextoken.models.config import ModelConfig
from tests.tiny import write_tiny_model


def test_matches_gguf_package_reader(tiny_gemma: Path) -> None:
    ours = read_gguf(tiny_gemma)
    theirs = gguf.GGUFReader(tiny_gemma)
    assert len(ours.tensors) == len(theirs.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.offset == t.data_offset and mine.nbytes == t.n_bytes
        assert mine.shape == tuple(reversed([int(d) for d in t.shape]))
        assert np.array_equal(ours.raw(t.name), t.data.reshape(-1).view(np.uint8))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = ours.metadata[key]
        expected = field.contents()
        if isinstance(value, np.ndarray):
            np.testing.assert_allclose(value, expected)
        elif isinstance(value, float):
            assert value == pytest.approx(expected)
        else:
            assert value == expected


def test_model_config_of_tiny_models(tiny_llama: Path, tiny_gemma: Path) -> None:
    llama = ModelConfig.from_gguf(read_gguf(tiny_llama))
    assert (llama.architecture, llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == \
        ("llama", 2, 4, 2, 16)
    assert llama.tie_word_embeddings and llama.eos_id == 2 and 2 in llama.eog_ids
    gemma = ModelConfig.from_gguf(read_gguf(tiny_gemma))
    assert gemma.sliding_window == 8
    assert gemma.layer_is_sliding == (True,) * 5 + (False,)
    assert gemma.rope_local is not None and gemma.rope_local.theta == 10_000.0
    assert gemma.embedding_scale == pytest.approx(64 ** 0.5)
    assert set(gemma.eog_ids) == {1, 5}  # <eos> and <end_of_turn>


# --- malformed files ----------------------------------------------------------------------------------------


def _header(version: int = 3, num_tensors: int = 0, num_kv: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, num_tensors, num_kv)


def _string(s: str | bytes) -> bytes:
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def _kv_u32(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<I", 4) + struct.pack("<I", value)


def _tensor_info(name: str, dims: list[int], qtype: int = 0, offset: int = 0) -> bytes:
    return _string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", qtype, offset)


def _file_with_tensor(dims: list[int], qtype: int = 0, data_bytes: int = 64, offset: int = 0) -> bytes:
    head = _header(num_tensors=1, num_kv=1) + _kv_u32("general.alignment", 32) + \
        _tensor_info("t", dims, qtype, offset)
    pad = -len(head) % 32
    return head + b"\0" * pad + b"\0" * data_bytes


CASES: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "empty"),
    "wrong magic": (b"GGML" + b"\0" * 40, "not a GGUF file"),
    "version 1": (_header(version=1) + b"\0" * 16, "unsupported GGUF version 1"),
    "version 4": (_header(version=4) + b"\0" * 16, "unsupported GGUF version 4"),
    "big endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
    "truncated header": (_header()[:10], "truncated"),
    "huge metadata count": (_header(num_kv=2**63) + b"\0" * 16, "more than"),
    "huge tensor count": (_header(num_tensors=2**62) + b"\0" * 16, "more than"),
    "huge string": (_header(num_kv=1) + struct.pack("<Q", 2**62) + b"abc" + b"\0" * 16, "at most"),
    "string past end": (_header(num_kv=1) + struct.pack("<Q", 40) + b"general.name", "truncated"),
    "unknown value type": (_header(num_kv=1) + _string("k") + struct.pack("<I", 99) + b"\0" * 8,
                           "unknown value type 99"),
    "huge array": (_header(num_kv=1) + _string("k") + struct.pack("<IIQ", 9, 4, 2**61), "truncated"),
    "huge string array": (_header(num_kv=1) + _string("k") + struct.pack("<IIQ", 9, 8, 2**60) + b"\0" * 32,
                          "more than"),
    "array string past end": (_header(num_kv=1) + _string("k") + struct.pack("<IIQ", 9, 8, 3) + _string("ab") +
                              struct.pack("<Q", 40) + b"\0" * 16, "k[1] needs 40 bytes"),
    "array length past end": (_header(num_kv=1) + _string("k") + struct.pack("<IIQ", 9, 8, 3) + _string("ab") +
                              _string("c" * 9) + b"\0" * 4, "length of k[2]"),
    "array string length huge": (_header(num_kv=1) + _string("k") + struct.pack("<IIQ", 9, 8, 2) +
                                 struct.pack("<Q", 2**63) + b"\0" * 16, "k[0] needs"),
    "deeply nested arrays": (_header(num_kv=1) + _string("k") + struct.pack("<I", 9) +
                             struct.pack("<IQ", 9, 1) * 5000 + b"\0" * 64, "nests arrays"),
    "duplicate key": (_header(num_kv=2) + _kv_u32("a", 1) + _kv_u32("a", 2), "duplicate metadata key"),
    "alignment zero": (_header(num_kv=1) + _kv_u32("general.alignment", 0), "alignment"),
    "alignment not power of two": (_header(num_kv=1) + _kv_u32("general.alignment", 24), "alignment"),
    "alignment wrong type": (_header(num_kv=1) + _string("general.alignment") + struct.pack("<I", 8) +
                             _string("32"), "alignment"),
    "zero dimension": (_file_with_tensor([0, 4]), "zero dimension"),
    "too many dimensions": (_file_with_tensor([1, 1, 1, 1, 1]), "5 dimensions"),
    "overflowing dimensions": (_file_with_tensor([2**32, 2**32]), "overflow"),
    "unknown quantization": (_file_with_tensor([32], qtype=77), "unknown quantization type 77"),
    "row not multiple of block": (_file_with_tensor([33], qtype=8), "not a multiple"),
    "data beyond end": (_file_with_tensor([1024], qtype=0, data_bytes=64), "beyond the end"),
    "misaligned offset": (_file_with_tensor([4], offset=3), "not aligned"),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(strings=st.lists(st.binary(max_size=8) | st.sampled_from([b"\xe4\xbb", b"\xf0\x9f\x98", b"\x80", b"\0"]),
                        max_size=40))
def test_string_arrays_decode_each_string_alone(tmp_path: Path, strings: list[bytes]) -> None:
    """Invalid UTF-8 (cut sequences, stray continuation bytes) and NUL bytes read as each string decoded alone."""
    path = tmp_path / "strings.gguf"
    array = _string("tokens") + struct.pack("<IIQ", 9, 8, len(strings)) + b"".join(_string(s) for s in strings)
    path.write_bytes(_header(num_kv=2) + array + _kv_u32("after", 7))
    metadata = read_gguf(path).metadata
    assert metadata["tokens"] == [s.decode("utf-8", errors="replace") for s in strings]
    assert metadata["after"] == 7  # the walk ends where the array does


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_file_raises_model_load_error(tmp_path: Path, case: str) -> None:
    data, message = CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ModelLoadError) as err:
        read_gguf(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_directory_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a directory"):
        read_gguf(tmp_path)
    with pytest.raises(ModelLoadError, match="no such file"):
        read_gguf(tmp_path / "nope.gguf")


def test_duplicate_and_overlapping_tensors(tmp_path: Path) -> None:
    head = _header(num_tensors=2) + _tensor_info("a", [8]) + _tensor_info("a", [8], offset=32)
    path = tmp_path / "dup.gguf"
    path.write_bytes(head + b"\0" * (-len(head) % 32) + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="duplicate tensor name"):
        read_gguf(path)
    head = _header(num_tensors=2) + _tensor_info("a", [16]) + _tensor_info("b", [16], offset=32)
    path.write_bytes(head + b"\0" * (-len(head) % 32) + b"\0" * 128)
    with pytest.raises(ModelLoadError, match="overlap"):
        read_gguf(path)


@pytest.mark.parametrize(("overrides", "drop", "message"), [
    ({"general.architecture": ("string", "mamba9")}, (), "unknown architecture 'mamba9'"),
    ({}, ("llama.block_count",), "missing required metadata 'llama.block_count'"),
    ({}, ("llama.embedding_length",), "missing required metadata 'llama.embedding_length'"),
    ({"tokenizer.ggml.token_type": ("int32s", [1, 1, 1])}, (), "'tokenizer.ggml.token_type' has 3 entries"),
    ({"tokenizer.ggml.eos_token_id": ("uint32", 10**6)}, (), "outside the vocabulary"),
    ({"llama.attention.head_count_kv": ("uint32", 3)}, (), "not a multiple"),
    ({"llama.block_count": ("string", "two")}, (), "must be a int"),
    ({"llama.attention.head_count": ("uint32", 128)}, (), "'llama.attention.head_count' is 128, more heads than "
                                                        "'llama.embedding_length' (64) has values"),
    ({"llama.block_count": ("uint32", 822_083_585)}, (), "'llama.block_count' is 822083585, but the file holds "
                                                        "tensors for 2 blocks"),
])
def test_bad_metadata_raises_model_load_error(tmp_path: Path, overrides: dict, drop: tuple, message: str) -> None:
    path = tmp_path / "m.gguf"
    if "general.architecture" in overrides:
        # The writer fixes the architecture key from its constructor; patch the bytes instead.
        write_tiny_model(path, "llama")
        data = path.read_bytes().replace(_string("general.architecture") + struct.pack("<I", 8) + _string("llama"),
                                         _string("general.architecture") + struct.pack("<I", 8) + _string("mamba9"))
        path.write_bytes(data)
    else:
        write_tiny_model(path, "llama", overrides=overrides, drop=drop)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_gguf(read_gguf(path))
    assert message in str(err.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 << 10  # KiB: nothing sized by the bad value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_files_raise_only_nextoken_errors(tmp_path: Path, tiny_llama: Path, data: st.DataObject) -> None:
    """Bit flips, truncations and overwritten fields: the loader either succeeds or raises a NextokenError."""
    raw = bytearray(tiny_llama.read_bytes())
    header_end = 4096  # metadata and tensor infos live here; mutating weights only changes numbers
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "truncate", "u64"]))
        pos = data.draw(st.integers(0, min(header_end, len(raw) - 9)))
        if kind == "flip":
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "truncate":
            del raw[pos:]
            break
        else:
            raw[pos:pos + 8] = struct.pack("<Q", data.draw(st.sampled_from([0, 1, 2**31, 2**63 - 1, 2**64 - 1])))
    path = tmp_path / "mutated.gguf"
    path.write_bytes(bytes(raw))
    try:
        g = read_gguf(path)
        ModelConfig.from_gguf(g)
    except NextokenError:
        pass

"""GGUF tokenizer metadata -> a validated `TokenizerSpec`, a Hugging Face `tokenizers.Tokenizer`, and a piece table.

Every field is checked before use, so a malformed file raises `TokenizerError` naming the field, never a KeyError or a
Rust panic. The built encoder matches what transformers/llama.cpp produce for the same file; the piece table (token
id -> the exact bytes it stands for) is what decoding uses, so streaming and whole-sequence decoding agree by design.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from nextoken.config import cache_dir
from nextoken.errors import TokenizerError

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPM_SPACE = "\u2581"  # "▁": SentencePiece's stand-in for a space inside vocabulary strings
MERGES_CACHE_VERSION = "1"  # bump when the merge-generation rule changes: old cache files are then never read
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")

# Byte-level BPE (tokenizer.ggml.model == "gpt2"): pre-tokenizer regex by tokenizer.ggml.pre, as llama.cpp groups them.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_GROUPS: dict[str, tuple[str, ...]] = {
    "gpt2": ("gpt2", "gpt-2", "phi-2"),
    "digits+gpt2": ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
    "llama3": ("llama3", "llama-v3", "llama-bpe"),
    "qwen2": ("qwen2", "deepseek-r1-qwen"),
}
_PRE_KIND = {name: kind for kind, names in _PRE_GROUPS.items() for name in names}


@dataclass(frozen=True, eq=False)
class TokenizerSpec:
    """Validated tokenizer metadata. `kind` is "bpe" (byte-level, model "gpt2") or "spm" (model "llama")."""

    kind: str
    pre: str
    tokens: list[str]
    types: np.ndarray  # int32, one per token (all NORMAL when the file has no token_type array)
    scores: np.ndarray | None  # float32, one per token
    merges: list[tuple[str, str]] | None  # None: "spm" file without merges, generated from scores
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    source: str = "model"
    token_index: dict[str, int] = field(default_factory=dict, repr=False)  # string -> id, last duplicate wins


def _fail(source: str, key: str, reason: str) -> TokenizerError:
    return TokenizerError(f"{source}: tokenizer metadata field {key}: {reason}")


def _optional_id(md: Mapping[str, Any], key: str, n: int, source: str) -> int | None:
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _fail(source, key, f"expected an integer token id, got {value!r}")
    if not 0 <= int(value) < n:
        raise _fail(source, key, f"token id {int(value)} is outside the vocabulary (size {n})")
    return int(value)


def _optional_bool(md: Mapping[str, Any], key: str, default: bool, source: str) -> bool:
    value = md.get(key, default)
    if not isinstance(value, (bool, np.bool_)):
        raise _fail(source, key, f"expected a boolean, got {value!r}")
    return bool(value)


def _per_token_array(md: Mapping[str, Any], key: str, n: int, dtype: str, source: str) -> np.ndarray | None:
    value = md.get(key)
    if value is None:
        return None
    try:
        arr = np.asarray(value)
        if arr.ndim != 1 or arr.dtype.kind not in "iuf" or (dtype == "int32" and arr.dtype.kind == "f"):
            raise ValueError
        arr = arr.astype(dtype)
    except (TypeError, ValueError, OverflowError):
        raise _fail(source, key, f"expected a numeric array, got {type(value).__name__}") from None
    if len(arr) != n:
        raise _fail(source, key, f"has {len(arr)} entries but tokenizer.ggml.tokens has {n}")
    return arr


def parse_metadata(md: Mapping[str, Any], source: str = "model") -> TokenizerSpec:
    """Validate the tokenizer.* fields of a GGUF metadata dict; raises TokenizerError naming the bad field."""
    model = md.get("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise _fail(source, "tokenizer.ggml.model", f"unsupported tokenizer model {model!r} (supported: gpt2, llama)")
    kind = "bpe" if model == "gpt2" else "spm"

    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise _fail(source, "tokenizer.ggml.tokens", "missing")
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= {str}:  # map: no Python loop over 262k
        raise _fail(source, "tokenizer.ggml.tokens", "expected an array of strings")
    n = len(tokens)
    if n == 0:
        raise _fail(source, "tokenizer.ggml.tokens", "empty vocabulary")

    types = _per_token_array(md, "tokenizer.ggml.token_type", n, "int32", source)
    if types is None:
        types = np.full(n, NORMAL, dtype=np.int32)
    elif types.min() < 0 or types.max() > BYTE:
        bad = int(np.flatnonzero((types < 0) | (types > BYTE))[0])
        raise _fail(source, "tokenizer.ggml.token_type", f"token {bad} has unknown type {int(types[bad])}")
    scores = _per_token_array(md, "tokenizer.ggml.scores", n, "float32", source)
    if scores is not None and not np.isfinite(scores).all():
        bad = int(np.flatnonzero(~np.isfinite(scores))[0])
        raise _fail(source, "tokenizer.ggml.scores", f"token {bad} has non-finite score {scores[bad]}")
    for i in np.flatnonzero(types == BYTE).tolist():
        if not _BYTE_TOKEN.fullmatch(tokens[i]):
            raise _fail(source, "tokenizer.ggml.token_type",
                        f"token {i} {tokens[i]!r} has type byte (6) but is not of the form <0xHH>")

    index = dict(zip(tokens, range(n)))  # a repeated string keeps its last id, as in transformers and llama.cpp
    merges = _parse_merges(md.get("tokenizer.ggml.merges"), index, source)
    if merges is None and kind == "bpe":
        raise _fail(source, "tokenizer.ggml.merges", "missing (a gpt2 byte-level BPE tokenizer needs its merges)")
    if merges is None and scores is None:
        raise _fail(source, "tokenizer.ggml.scores", "missing (needed to derive merges: the file has none)")
    pre = md.get("tokenizer.ggml.pre", "default")
    if kind == "bpe" and (not isinstance(pre, str) or pre not in _PRE_KIND):
        raise _fail(source, "tokenizer.ggml.pre", f"unsupported pre-tokenizer {pre!r} "
                    f"(supported: {', '.join(sorted(_PRE_KIND))})")
    return TokenizerSpec(
        kind=kind, pre=str(pre), tokens=tokens, types=types, scores=scores, merges=merges,
        bos_id=_optional_id(md, "tokenizer.ggml.bos_token_id", n, source),
        eos_id=_optional_id(md, "tokenizer.ggml.eos_token_id", n, source),
        unk_id=_optional_id(md, "tokenizer.ggml.unknown_token_id", n, source),
        pad_id=_optional_id(md, "tokenizer.ggml.padding_token_id", n, source),
        # Defaults are llama.cpp's: SentencePiece-style files add BOS and a prefix space unless told otherwise.
        add_bos=_optional_bool(md, "tokenizer.ggml.add_bos_token", kind == "spm", source),
        add_eos=_optional_bool(md, "tokenizer.ggml.add_eos_token", False, source),
        add_space_prefix=_optional_bool(md, "tokenizer.ggml.add_space_prefix", kind == "spm", source),
        source=source, token_index=index,
    )


def _parse_merges(value: Any, index: dict[str, int], source: str) -> list[tuple[str, str]] | None:
    if value is None:
        return None
    key = "tokenizer.ggml.merges"
    if not isinstance(value, list):
        raise _fail(source, key, f"expected an array of strings, got {type(value).__name__}")
    merges = []
    for i, merge in enumerate(value):
        parts = merge.split(" ") if isinstance(merge, str) else ()
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise _fail(source, key, f"entry {i} {merge!r} is not of the form 'left right'")
        for piece in (parts[0], parts[1], parts[0] + parts[1]):
            if piece not in index:
                raise _fail(source, key, f"entry {i} {merge!r} names {piece!r}, which is not in the vocabulary")
        merges.append((parts[0], parts[1]))
    return merges


def spec_fingerprint(spec: TokenizerSpec) -> str:
    """sha256 over everything merge generation reads; a changed file therefore never hits a stale cache entry."""
    h = hashlib.sha256(f"nextoken-merges-v{MERGES_CACHE_VERSION}\0{spec.kind}\0".encode())
    h.update(np.fromiter(map(len, spec.tokens), dtype=np.int64, count=len(spec.tokens)).tobytes())
    h.update("\0".join(spec.tokens).encode("utf-8", "surrogatepass"))  # the lengths above make the join unambiguous
    h.update(spec.types.astype("<i4").tobytes())
    if spec.scores is not None:
        h.update(spec.scores.astype("<f4").tobytes())
    return h.hexdigest()


def generate_merges(spec: TokenizerSpec) -> np.ndarray:
    """Merges for a SentencePiece-style vocabulary without any, as (left_id, right_id) rows in rank order.

    The rule transformers applies: every split of a token into two vocabulary tokens is a merge, ranked by the merged
    token's score (highest first), then by vocabulary position, then by the pieces' scores, then split position.
    Control and byte tokens never become merge results, and user-defined tokens neither (they are matched as added
    tokens before BPE runs, so such merges could never fire): this keeps a literal "<start_of_turn>" in user text
    from being BPE-assembled into the control token, and byte tokens from being spelled out of "<0x41>".
    """
    tokens, index = spec.tokens, spec.token_index
    assert spec.scores is not None
    scores = spec.scores.astype(np.float64)
    eligible = ~np.isin(spec.types, (CONTROL, BYTE, USER_DEFINED))
    merged_ids: list[int] = []
    lefts: list[int] = []
    rights: list[int] = []
    cuts: list[int] = []
    get = index.get
    for mid in np.flatnonzero(eligible).tolist():
        tok = tokens[mid]
        if len(tok) < 2 or index[tok] != mid:  # a duplicate string: only its last occurrence is in the vocabulary
            continue
        for k in range(1, len(tok)):
            left = get(tok[:k])
            if left is None:
                continue
            right = get(tok[k:])
            if right is not None:
                merged_ids.append(mid)
                lefts.append(left)
                rights.append(right)
                cuts.append(k)
    m, left_a, right_a = np.array(merged_ids, np.int64), np.array(lefts, np.int64), np.array(rights, np.int64)
    # np.lexsort sorts by the LAST key first.
    order = np.lexsort((np.array(cuts, np.int64), -scores[right_a], -scores[left_a], m, -scores[m]))
    return np.stack([left_a[order], right_a[order]], axis=1).astype(np.int32)


def _load_cached_merges(path: Path, n_tokens: int) -> np.ndarray | None:
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    ok = arr.ndim == 2 and arr.shape[1] == 2 and arr.dtype == np.int32 and (arr.size == 0 or (
        arr.min() >= 0 and arr.max() < n_tokens))
    return arr if ok else None  # a truncated or foreign file is regenerated, never trusted


def _store_cached_merges(path: Path, arr: np.ndarray) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass  # an unwritable cache only costs speed


def spm_merges(spec: TokenizerSpec, stats: dict[str, Any]) -> list[tuple[str, str]]:
    """The merge list for a "spm" spec: the file's own, or generated (and cached under `cache_dir()`)."""
    if spec.merges is not None:
        return spec.merges
    path = cache_dir() / "tokenizer" / f"{spec_fingerprint(spec)}.merges.npy"
    arr = _load_cached_merges(path, len(spec.tokens)) if path.is_file() else None
    stats["merges_cache"] = "hit" if arr is not None else "miss"
    if arr is None:
        t0 = time.perf_counter()
        arr = generate_merges(spec)
        stats["merges_generate_s"] = time.perf_counter() - t0
        _store_cached_merges(path, arr)
    table = np.array(spec.tokens, dtype=object)  # fancy-indexing an object array beats a Python loop 5x here
    return list(zip(table[arr[:, 0]].tolist(), table[arr[:, 1]].tolist()))


def _byte_level_pre_tokenizer(pre: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, ignore_merges) for a byte-level BPE `pre` name."""
    group = _PRE_KIND[pre]
    if group == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if group == "digits+gpt2":  # every digit its own pre-token, then the GPT-2 regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), False
    regex = _LLAMA3_REGEX if group == "llama3" else _QWEN2_REGEX
    split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return pre_tokenizers.Sequence([split, byte_level]), group == "llama3"  # llama3 maps whole known words directly


def build_hf_tokenizer(spec: TokenizerSpec, stats: dict[str, Any]) -> HFTokenizer:
    """The encoder. Control tokens become special added tokens, user-defined ones plain added tokens."""
    vocab = dict(spec.token_index)
    t0 = time.perf_counter()
    try:
        if spec.kind == "bpe":
            pre, ignore_merges = _byte_level_pre_tokenizer(spec.pre)
            # A merge that would build a control token is dropped, so untrusted text can never be BPE-assembled
            # into one (real files have none: their control tokens were added after training).
            assert spec.merges is not None
            control = set(special_token_ids(spec))
            merges = [m for m in spec.merges if spec.token_index[m[0] + m[1]] not in control]
            tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
            tok.pre_tokenizer = pre
            tok.decoder = decoders.ByteLevel()
        else:
            merges = spm_merges(spec, stats)
            t0 = time.perf_counter()
            unk = spec.tokens[spec.unk_id] if spec.unk_id is not None else None
            tok = HFTokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
            steps = [normalizers.Prepend(SPM_SPACE)] if spec.add_space_prefix else []
            tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPM_SPACE)])
            # Set for completeness of the object; nextoken decodes through its own piece table instead.
            strip = [decoders.Strip(" ", 1, 0)] if spec.add_space_prefix else []
            tok.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                             *strip])
    except Exception as exc:  # the Rust side reports bad vocab/merges as plain Exception
        raise _fail(spec.source, "tokenizer.ggml.merges", f"tokenizers rejected the vocabulary: {exc}") from None
    add_added_tokens(tok, spec)
    stats["build_bpe_s"] = time.perf_counter() - t0
    return tok


def add_added_tokens(tok: HFTokenizer, spec: TokenizerSpec) -> None:
    """Register control (special) and user-defined (non-special) tokens, matched on the raw, unnormalized text."""
    for wanted, special in ((CONTROL, True), (USER_DEFINED, False)):
        contents = [spec.tokens[i] for i in np.flatnonzero(spec.types == wanted).tolist()]
        added = [AddedToken(c, special=special, normalized=False) for c in contents if c]  # "" would match anywhere
        if added:
            (tok.add_special_tokens if special else tok.add_tokens)(added)


def clone_hf_tokenizer(tok: HFTokenizer, spec: TokenizerSpec) -> HFTokenizer:
    """A second tokenizer sharing `tok`'s model (no rebuild: the Rust model sits behind a shared, read-locked Arc)."""
    other = HFTokenizer(tok.model)
    other.normalizer = tok.normalizer
    other.pre_tokenizer = tok.pre_tokenizer
    other.decoder = tok.decoder
    add_added_tokens(other, spec)
    return other


def _byte_level_table() -> dict[int, int]:
    """GPT-2's byte <-> printable-character map, as codepoint -> byte (printable bytes stand for themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: b for b in keep}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[256 + shifted] = b
            shifted += 1
    return table


# Codepoints below 256 that are NOT in the alphabet map to a non-latin-1 character, so that encoding fails for them too.
_BYTE_LEVEL_TRANSLATE = {**{cp: "\uffff" for cp in range(256)}, **{cp: chr(b) for cp, b in _byte_level_table().items()}}


def piece_table(spec: TokenizerSpec) -> list[bytes]:
    """token id -> the UTF-8 bytes it stands for; control and user-defined tokens stand for their own text."""
    types = spec.types.tolist()
    if spec.kind == "spm":
        # One replace/encode/split over the joined vocabulary instead of 262k small ones; then fix up the rest. A
        # token holding the separator itself splits into more pieces than there are tokens: then one by one.
        out = "\0".join(spec.tokens).replace(SPM_SPACE, " ").encode("utf-8", "surrogatepass").split(b"\0")
        if len(out) == len(spec.tokens):
            for i in np.flatnonzero(spec.types != NORMAL).tolist():
                out[i] = _piece(spec, spec.tokens[i], types[i])
            return out
    return [_piece(spec, tok, ttype) for tok, ttype in zip(spec.tokens, types)]


def _piece(spec: TokenizerSpec, tok: str, ttype: int) -> bytes:
    if ttype in (CONTROL, USER_DEFINED):
        return tok.encode("utf-8", "surrogatepass")
    if ttype == BYTE:
        return bytes([int(tok[3:5], 16)])
    if spec.kind == "spm":
        return tok.replace(SPM_SPACE, " ").encode("utf-8", "surrogatepass")
    # Map each character back to its byte via latin-1; a character outside the byte-level alphabet means the token
    # is not byte-level encoded, and (as in transformers) its text is taken as UTF-8 instead.
    try:
        return tok.translate(_BYTE_LEVEL_TRANSLATE).encode("latin-1")
    except UnicodeEncodeError:
        return tok.encode("utf-8", "surrogatepass")


def special_token_ids(spec: TokenizerSpec) -> Sequence[int]:
    return np.flatnonzero(spec.types == CONTROL).tolist()

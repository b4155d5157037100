"""A Hugging Face model directory's tokenizer files -> a `TokenizerSpec`, the two `tokenizers` encoders, and the GGUF
tokenizer metadata llama.cpp's converter (convert_hf_to_gguf.py) would write for them.

Encoding runs on tokenizer.json itself, so ids are exactly Hugging Face's. The spec carries what decoding and the chat
layer need: every id's text and type (special added tokens and those that look special are control, other added tokens
user-defined, ids tokenizer.json lacks up to config.json's vocab_size unused "[PADi]"), BOS/EOS, and whether encoding
adds them, as the file's post-processor does. Every problem raises ModelLoadError naming the file at fault.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from nextoken.errors import ModelLoadError
from nextoken.tokenizer.from_gguf import (
    _LLAMA3_REGEX,
    _QWEN2_REGEX,
    _BYTE_TOKEN,
    BYTE,
    CONTROL,
    NORMAL,
    SPM_SPACE,
    UNUSED,
    USER_DEFINED,
    TokenizerSpec,
)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
SPECIAL_ROLES = ("bos", "eos", "unk", "pad")


def read_json(path: Path, *, required: bool) -> dict[str, Any] | None:
    """A JSON object file; None when absent and not required. Raises ModelLoadError naming the file."""
    if not path.is_file():
        if required:
            raise ModelLoadError(path, "missing" if not path.exists() else "is not a regular file")
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(path, f"is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(path, f"must hold a JSON object, not {type(value).__name__}")
    return value


@dataclass(frozen=True, eq=False)
class HFTokenizerFiles:
    """The parsed files: `spec` for nextoken's Tokenizer, `json_text` (tokenizer.json, for the encoder), `metadata`
    (the tokenizer.* GGUF keys) and `eog_ids` (every id that ends generation: EOS and generation_config's)."""

    spec: TokenizerSpec
    json_text: str
    metadata: dict[str, Any]
    eog_ids: tuple[int, ...]


def read_hf_tokenizer(directory: Path, config: Mapping[str, Any], vocab_size: int, *,
                      trim: bool = False) -> HFTokenizerFiles:
    """The tokenizer of `directory` for a model of `vocab_size` embedding rows (`config`: its config.json). With
    `trim`, as llama.cpp converts Gemma 3: only as many ids as tokenizer.json's vocabulary and added tokens count."""
    path = directory / TOKENIZER_JSON
    if not path.is_file():
        raise ModelLoadError(path, "missing: nextoken reads a directory's tokenizer from tokenizer.json")
    try:
        json_text = path.read_text(encoding="utf-8")
        data = json.loads(json_text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(path, f"is not valid JSON ({exc})") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        kind = model.get("type") if isinstance(model, dict) else None
        raise ModelLoadError(path, f"tokenizer model {kind!r} is not supported (BPE only)")
    tok_config = read_json(directory / TOKENIZER_CONFIG, required=False) or {}
    gen_config = read_json(directory / GENERATION_CONFIG, required=False) or {}

    kind = _kind(data, path)
    if trim:
        vocab_size = min(vocab_size, len(model["vocab"]) + len(data.get("added_tokens") or []))
    tokens, types = _vocabulary(data, path, vocab_size, kind)
    index = dict(zip(tokens, range(len(tokens))))
    merges = _merge_strings(model.get("merges", []), path)
    ids = _special_ids(tok_config, (config, gen_config), index, vocab_size, path)
    ids, add_bos, add_eos = _post_processor(data.get("post_processor"), ids, index, path)
    eog = _eog_ids(ids["eos"], (config, directory / "config.json"), (gen_config, directory / GENERATION_CONFIG),
                   vocab_size=vocab_size)
    pre = _pre_name(data.get("pre_tokenizer")) if kind == "bpe" else "default"
    # No merges in the spec: they serve from_gguf's encoder, and here the encoder is tokenizer.json's own.
    spec = TokenizerSpec(
        kind=kind, pre=pre or "default", tokens=tokens, types=types, scores=None, merges=None,
        bos_id=ids["bos"], eos_id=ids["eos"], unk_id=ids["unk"], pad_id=ids["pad"], add_bos=add_bos,
        add_eos=add_eos, add_space_prefix=kind == "spm" and _prepends_space(data), source=str(path),
        token_index=index)

    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2" if kind == "bpe" else "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": add_bos,
        "tokenizer.ggml.add_eos_token": add_eos,
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    if kind == "spm":
        metadata["tokenizer.ggml.add_space_prefix"] = spec.add_space_prefix
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id")):
        if ids[role] is not None:
            metadata[f"tokenizer.ggml.{key}"] = ids[role]
    metadata.update(_chat_templates(tok_config, directory))
    return HFTokenizerFiles(spec, json_text, metadata, eog)


def build_encoders(spec: TokenizerSpec, json_text: str) -> tuple[HFTokenizer, HFTokenizer]:
    """(encoder, plain encoder) from tokenizer.json's text. The plain one matches no control token (untrusted text):
    control tokens the file does not mark special (those that only look special) are marked special there."""
    try:
        hf = HFTokenizer.from_str(json_text)
    except Exception as exc:  # the Rust side reports a bad file as plain Exception
        raise ModelLoadError(spec.source, f"the tokenizers library rejected it: {exc}") from None
    hf.no_truncation()  # as transformers encodes unless asked: whole texts, unpadded
    hf.no_padding()
    added = sorted(hf.get_added_tokens_decoder().items())
    # The library gives an added token outside the model's vocabulary the next free id, whatever the file says.
    moved = next(((t.content, spec.token_index.get(t.content), i) for i, t in added
                  if i >= len(spec.tokens) or spec.tokens[i] != t.content), None)
    if moved is not None:
        raise ModelLoadError(spec.source, f"added token {moved[0]!r} has id {moved[1]} in the file, but the "
                                          f"tokenizers library gives it {moved[2]}")
    plain = HFTokenizer(hf.model)  # the same model, shared (building a second costs as much as the first)
    plain.normalizer, plain.pre_tokenizer, plain.decoder = hf.normalizer, hf.pre_tokenizer, hf.decoder
    plain.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                                         normalized=t.normalized, special=t.special or spec.types[i] == CONTROL)
                              for i, t in added])
    assert all(plain.token_to_id(t.content) == i for i, t in added), "ids are given in the same order"
    plain.encode_special_tokens = True
    return hf, plain


def _kind(data: Mapping[str, Any], path: Path) -> str:
    """"bpe" for byte-level BPE (GGUF model "gpt2"), "spm" for SentencePiece-style BPE with byte fallback ("llama")."""
    if "ByteLevel" in _component_types(data.get("pre_tokenizer")) | _component_types(data.get("decoder")):
        return "bpe"
    if data["model"].get("byte_fallback"):
        return "spm"
    raise ModelLoadError(path, "a BPE tokenizer that is neither byte-level nor SentencePiece-style (byte fallback) "
                               "is not supported")


def _component_types(node: Any) -> set[str]:
    """Every "type" in a (possibly nested Sequence) pre-tokenizer, normalizer or decoder."""
    if isinstance(node, list):
        return set().union(*(_component_types(n) for n in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    inner = [v for k, v in node.items() if k in ("pretokenizers", "normalizers", "decoders", "processors")]
    return {str(node.get("type"))} | _component_types(inner)


def _looks_special(text: str) -> bool:
    """llama.cpp's rule for added tokens some files fail to mark special: <|...|>, <｜...｜>, <unused...>, and a few
    names."""
    return text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or any(
        text.startswith(a) and text.endswith(b) for a, b in (("<|", "|>"), ("<｜", "｜>"), ("<unused", ">")))


def _vocabulary(data: Mapping[str, Any], path: Path, vocab_size: int, kind: str) -> tuple[list[str], np.ndarray]:
    """Token text and type by id, for all `vocab_size` ids."""
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = np.full(vocab_size, UNUSED, dtype=np.int32)
    entries: list[tuple[Any, Any]] = list(data["model"]["vocab"].items())
    added = data.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(a, dict) for a in added):
        raise ModelLoadError(path, "added_tokens must be a list of objects")
    entries += [(a.get("content"), a.get("id")) for a in added]
    for text, i in entries:
        if not isinstance(text, str) or isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ModelLoadError(path, f"token {text!r} has an invalid id {i!r}")
        if i >= vocab_size:
            raise ModelLoadError(path, f"token {text!r} has id {i}, beyond config.json's vocab_size {vocab_size}")
        tokens[i] = text
        types[i] = BYTE if kind == "spm" and _BYTE_TOKEN.fullmatch(text) else NORMAL
    for a in added:
        types[a["id"]] = CONTROL if a.get("special") or _looks_special(a["content"]) else USER_DEFINED
    return tokens, types


def _merge_strings(value: Any, path: Path) -> list[str]:
    """tokenizer.ggml.merges from either of tokenizer.json's forms ("a b", or ["a", "b"] since transformers 4.45):
    "left right", a space inside a piece written as U+0120, as llama.cpp writes them. (The tokenizers library checks
    each merge against the vocabulary when it builds the encoder.)"""
    if not isinstance(value, list):
        raise ModelLoadError(path, "model.merges must be a list")
    if not value or isinstance(value[0], str):
        merges = value
    else:
        try:
            merges = [a + " " + b for a, b in value]
        except (TypeError, ValueError):
            raise ModelLoadError(path, "model.merges must hold pairs of pieces") from None
        if "\n".join(merges).count(" ") != len(merges):  # a piece holding a space: the slow path, rarely taken
            merges = [" ".join(p.replace(" ", "\u0120") for p in pair) for pair in value]
    if not all(isinstance(m, str) for m in merges):
        raise ModelLoadError(path, "model.merges must hold strings or pairs of pieces")
    return merges


def _special_ids(tok_config: Mapping[str, Any], configs: tuple[Mapping[str, Any], ...], index: Mapping[str, int],
                 vocab_size: int, path: Path) -> dict[str, int | None]:
    """BOS/EOS/UNK/PAD: tokenizer_config.json's `{role}_token` texts, else the first `{role}_token_id` of
    config.json, then generation_config.json (the first of a list)."""
    ids: dict[str, int | None] = {}
    for role in SPECIAL_ROLES:
        entry = tok_config.get(f"{role}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        token_id = index.get(text) if isinstance(text, str) else None
        if isinstance(text, str) and token_id is None:
            raise ModelLoadError(path.with_name(TOKENIZER_CONFIG), f"{role}_token {text!r} is not in {path.name}")
        for config in configs:
            value = config.get(f"{role}_token_id")
            value = value[0] if isinstance(value, list) and value else value
            if token_id is None and isinstance(value, int) and not isinstance(value, bool) and \
                    0 <= value < vocab_size:
                token_id = value
        ids[role] = token_id
    return ids


def _post_processor(node: Any, ids: dict[str, int | None], index: Mapping[str, int],
                    path: Path) -> tuple[dict[str, int | None], bool, bool]:
    """(ids, add_bos, add_eos) as the post-processor adds tokens around one sequence: a token it puts first becomes
    BOS and one it puts last EOS, so that nextoken's encode adds exactly what Hugging Face's does."""
    ids = dict(ids)
    lead: list[str] = []
    trail: list[str] = []
    for proc in (node.get("processors") or [node]) if isinstance(node, dict) else []:
        kind = proc.get("type") if isinstance(proc, dict) else None
        if kind == "TemplateProcessing":
            items = proc.get("single") or []
            seq = [k for k, item in enumerate(items) if isinstance(item, dict) and "Sequence" in item]
            if len(seq) != 1:
                raise ModelLoadError(path, "post_processor's single template must hold one sequence")
            specials = proc.get("special_tokens") or {}

            def texts(part: list[Any]) -> list[str]:
                names = [item["SpecialToken"]["id"] for item in part if isinstance(item, dict) and
                         "SpecialToken" in item]
                return [t for n in names for t in specials.get(n, {}).get("tokens", [n])]

            lead, trail = texts(items[:seq[0]]), texts(items[seq[0] + 1:])
        elif kind in ("BertProcessing", "RobertaProcessing"):
            lead, trail = [proc["cls"][0]], [proc["sep"][0]]
    for role, added in (("bos", lead), ("eos", trail)):
        if len(added) > 1:
            raise ModelLoadError(path, f"post_processor adds {added} around a sequence; nextoken supports one "
                                       f"BOS and one EOS")
        if added:
            if added[0] not in index:
                raise ModelLoadError(path, f"post_processor adds {added[0]!r}, which is not in the vocabulary")
            ids[role] = index[added[0]]
    return ids, bool(lead), bool(trail)


def _eog_ids(eos_id: int | None, *sources: tuple[Mapping[str, Any], Path], vocab_size: int) -> tuple[int, ...]:
    """EOS and every `eos_token_id` (an id or a list) of config.json and generation_config.json."""
    eog = set() if eos_id is None else {eos_id}
    for config, path in sources:
        value = config.get("eos_token_id")
        for i in value if isinstance(value, list) else [] if value is None else [value]:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
                raise ModelLoadError(path, f"eos_token_id {i!r} is not a token id (0..{vocab_size - 1})")
            eog.add(i)
    return tuple(sorted(eog))


def _pre_name(node: Any) -> str | None:
    """The tokenizer.ggml.pre name of the byte-level pre-tokenizer, one for each of nextoken's groups
    (tokenizer/from_gguf.py); None for one it does not know."""
    if not isinstance(node, dict):
        return None
    steps = node.get("pretokenizers", [node]) if node.get("type") == "Sequence" else [node]
    shape = [(s.get("type"), s.get("individual_digits"), s.get("use_regex"),
              (s.get("pattern") or {}).get("Regex")) for s in steps if isinstance(s, dict)]
    if shape == [("ByteLevel", None, True, None)]:
        return "gpt-2"
    if shape == [("Digits", True, None, None), ("ByteLevel", None, True, None)]:
        return "smollm"
    if len(shape) == 2 and shape[0][0] == "Split" and shape[1][:3] == ("ByteLevel", None, False):
        return {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}.get(shape[0][3] or "")
    return None


def _prepends_space(data: Mapping[str, Any]) -> bool:
    """Whether a SentencePiece-style tokenizer puts "▁" before the text (Prepend normalizer, or a Metaspace
    pre-tokenizer that prepends): decoding then drops one leading space."""
    def nodes(node: Any) -> list[dict[str, Any]]:
        if not isinstance(node, dict):
            return []
        inner = node.get("normalizers") or node.get("pretokenizers") or []
        return [node, *(n for child in inner for n in nodes(child))]

    for node in nodes(data.get("normalizer")) + nodes(data.get("pre_tokenizer")):
        if node.get("type") == "Prepend" and node.get("prepend") == SPM_SPACE:
            return True
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") != "never" and \
                node.get("add_prefix_space", True):
            return True
    return False


def _chat_templates(tok_config: Mapping[str, Any], directory: Path) -> dict[str, Any]:
    """tokenizer.chat_template (and named ones) from tokenizer_config.json, else chat_template.jinja or
    chat_template.json, as llama.cpp reads them."""
    template: Any = tok_config.get("chat_template")
    source = directory / TOKENIZER_CONFIG
    if template is None and (directory / "chat_template.jinja").is_file():
        source = directory / "chat_template.jinja"
        try:
            template = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(source, f"cannot be read ({exc})") from None
    elif template is None:
        source = directory / "chat_template.json"
        template = (read_json(source, required=False) or {}).get("chat_template")
    if template is None:
        return {}
    if isinstance(template, str):
        return {"tokenizer.chat_template": template}
    if not isinstance(template, list) or not all(isinstance(t, dict) and isinstance(t.get("template"), str)
                                                 for t in template):
        raise ModelLoadError(source, "chat_template must be a string or a list of {name, template} objects")
    out: dict[str, Any] = {}
    names = []
    for choice in template:
        name = "".join(c if c.isascii() and c.isalnum() else "_" for c in str(choice.get("name", "")))
        if name == "default":
            out["tokenizer.chat_template"] = choice["template"]
        elif name:
            names.append(name)
            out[f"tokenizer.chat_template.{name}"] = choice["template"]
    if names:
        out["tokenizer.chat_templates"] = names
    return out

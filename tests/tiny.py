"""Tiny models with random weights, written as real GGUF files with the `gguf` package's writer.

`write_tiny_model(path, arch)` makes a Llama-family or Gemma 3 file small enough that a forward pass takes
milliseconds, with a byte-level BPE (Llama) or SentencePiece-style (Gemma) vocabulary, so the whole engine runs on
it. `overrides` replaces metadata values, `drop` removes keys, for the loader's error tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

SPECIALS_CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SPECIALS_GEMMA = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for every byte (byte-level BPE vocabularies are written in these)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    byte_chars = _bytes_to_unicode()
    tokens = list(SPECIALS_CHATML) + [byte_chars[b] for b in range(256)]
    types = [3] * len(SPECIALS_CHATML) + [1] * 256
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "a t", "e n"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
        types.append(1)
    return tokens, types, merges


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = list(SPECIALS_GEMMA)
    types = [3] * len(SPECIALS_GEMMA)
    scores = [0.0] * len(SPECIALS_GEMMA)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)
        scores.append(0.0)
    pieces = ["▁", "e", "t", "a", "o", "h", "n", "s", "▁t", "he", "▁the", "in", "er", "▁a", "on", "at", "en"]
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(1)
        scores.append(-float(i))
    return tokens, scores, types


def write_tiny_model(path: Path, arch: str = "llama", *, seed: int = 0, overrides: dict[str, Any] | None = None,
                     drop: tuple[str, ...] = (), num_layers: int | None = None,
                     shape: dict[str, int] | None = None, projections: gguf.GGMLQuantizationType | None = None,
                     wrong_shape: tuple[str, int, int] | None = None,
                     table: gguf.GGMLQuantizationType | None = None, loud_columns: tuple[int, ...] = ()) -> Path:
    """`shape` gives a model of real size with random weights (for speed, not answers): any of hidden, ffn, heads,
    kv_heads, head_dim, layers, context, and vocab (the vocabulary padded with plain tokens up to that size).
    `projections`: a block type the projection weights are stored in (gguf's own quantizer), `table` the same for
    the token table; `wrong_shape`: (a
    tensor name, an axis, a count), that tensor written with `count` more along the axis. `loud_columns`: columns
    of the hidden state whose RMSNorm weights are 8 times the others (as real models have some), so that int8
    activations have outlier columns to take out."""
    rng = np.random.default_rng(seed)
    overrides = overrides or {}
    hidden, ffn = 64, 128
    if arch == "gemma3":
        num_heads, num_kv_heads, head_dim, layers = 2, 1, 32, num_layers or 6
    else:
        num_heads, num_kv_heads, head_dim, layers = 4, 2, 16, num_layers or 2
    shape = shape or {}
    hidden, ffn = shape.get("hidden", hidden), shape.get("ffn", ffn)
    num_heads, num_kv_heads = shape.get("heads", num_heads), shape.get("kv_heads", num_kv_heads)
    head_dim, layers = shape.get("head_dim", head_dim), shape.get("layers", layers)
    w = gguf.GGUFWriter(str(path), arch)
    md: dict[str, Any] = {
        f"{arch}.block_count": ("uint32", layers),
        f"{arch}.context_length": ("uint32", shape.get("context", 256)),
        f"{arch}.embedding_length": ("uint32", hidden),
        f"{arch}.feed_forward_length": ("uint32", ffn),
        f"{arch}.attention.head_count": ("uint32", num_heads),
        f"{arch}.attention.head_count_kv": ("uint32", num_kv_heads),
        f"{arch}.attention.layer_norm_rms_epsilon": ("float32", 1e-6),
        f"{arch}.rope.freq_base": ("float32", 10000.0),
        "general.name": ("string", f"tiny-{arch}"),
    }
    if arch == "gemma3":
        tokens, scores, types = _spm_vocab()
        md.update({
            f"{arch}.attention.key_length": ("uint32", head_dim),
            f"{arch}.attention.value_length": ("uint32", head_dim),
            f"{arch}.attention.sliding_window": ("uint32", 8),
            "tokenizer.ggml.model": ("string", "llama"),
            "tokenizer.ggml.pre": ("string", "default"),
            "tokenizer.ggml.tokens": ("strings", tokens),
            "tokenizer.ggml.scores": ("float32s", scores),
            "tokenizer.ggml.token_type": ("int32s", types),
            "tokenizer.ggml.bos_token_id": ("uint32", 2),
            "tokenizer.ggml.eos_token_id": ("uint32", 1),
            "tokenizer.ggml.unknown_token_id": ("uint32", 3),
            "tokenizer.ggml.padding_token_id": ("uint32", 0),
            "tokenizer.ggml.add_bos_token": ("bool", True),
            "tokenizer.ggml.add_space_prefix": ("bool", False),
        })
    else:
        tokens, types, merges = _bpe_vocab()
        md.update({
            f"{arch}.rope.dimension_count": ("uint32", head_dim),
            "tokenizer.ggml.model": ("string", "gpt2"),
            "tokenizer.ggml.pre": ("string", "smollm"),
            "tokenizer.ggml.tokens": ("strings", tokens),
            "tokenizer.ggml.token_type": ("int32s", types),
            "tokenizer.ggml.merges": ("strings", merges),
            "tokenizer.ggml.bos_token_id": ("uint32", 1),
            "tokenizer.ggml.eos_token_id": ("uint32", 2),
            "tokenizer.ggml.add_bos_token": ("bool", False),
            "tokenizer.chat_template": ("string", "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + "
                                                  "m['content'] + '<|im_end|>\n'}}{% endfor %}"
                                                  "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}"
                                                  "{% endif %}"),
        })
    if len(tokens) < shape.get("vocab", 0):
        extra = shape["vocab"] - len(tokens)
        tokens = tokens + [f"<plain{i}>" for i in range(extra)]  # never built by a merge: plain, unused tokens
        types = list(types) + [1] * extra
        if arch == "gemma3":
            scores = list(scores) + [-1000.0] * extra
            md["tokenizer.ggml.scores"] = ("float32s", scores)
        md["tokenizer.ggml.tokens"] = ("strings", tokens)
        md["tokenizer.ggml.token_type"] = ("int32s", types)
    vocab = len(tokens)
    for key, value in overrides.items():
        md[key] = value
    for key, (kind, value) in md.items():
        if key in drop:
            continue
        if kind == "uint32":
            w.add_uint32(key, value)
        elif kind == "float32":
            w.add_float32(key, value)
        elif kind == "string":
            w.add_string(key, value)
        elif kind == "bool":
            w.add_bool(key, value)
        elif kind in ("strings", "float32s", "int32s"):
            w.add_array(key, value)
        else:
            raise ValueError(kind)

    def tensor(name: str, *shape: int, scale: float = 0.08, around: float = 0.0) -> None:
        if wrong_shape is not None and name == wrong_shape[0]:
            shape = tuple(n + wrong_shape[2] * (axis == wrong_shape[1]) for axis, n in enumerate(shape))
        values = (around + scale * rng.standard_normal(shape)).astype(np.float32)
        if loud_columns and name.endswith("norm.weight") and len(shape) == 1 and shape[0] == hidden:
            values[list(loud_columns)] *= 8
        qtype = table if name == "token_embd.weight" else projections if name.startswith("blk.") else None
        if qtype is not None and len(shape) == 2:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, values)

    tensor("token_embd.weight", vocab, hidden, scale=0.5)
    tensor("output_norm.weight", hidden, scale=0.05, around=1.0)
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden, scale=0.05, around=1.0)
        tensor(f"blk.{i}.attn_q.weight", q, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, q)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, scale=0.05, around=1.0)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
        if arch == "gemma3":
            tensor(f"blk.{i}.attn_q_norm.weight", head_dim, scale=0.05, around=1.0)
            tensor(f"blk.{i}.attn_k_norm.weight", head_dim, scale=0.05, around=1.0)
            tensor(f"blk.{i}.post_attention_norm.weight", hidden, scale=0.05, around=1.0)
            tensor(f"blk.{i}.post_ffw_norm.weight", hidden, scale=0.05, around=1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

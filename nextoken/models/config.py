"""ModelConfig: the hyperparameters of one model, read from its file's metadata and never guessed from names.

Where a GGUF file leaves a value implicit, the architecture's published configuration supplies it (Gemma 3: every
sixth layer global, local RoPE base 10,000, query scale 1/sqrt(head_dim)); each such default is marked below.
Missing required keys and inconsistent tokenizer arrays raise ModelLoadError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from nextoken.errors import ModelLoadError
from nextoken.loader.gguf import ModelFile

SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

# Text of tokens that end a turn in the chat formats we know; the file's EOS id always ends generation too.
END_OF_TURN_TEXTS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|eom_id|>")

# general.file_type -> the name llama.cpp gives the file's dominant quantization.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 32: "BF16"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float  # base of the rotary frequencies
    dim: int  # rotated dimensions per head (<= head_dim)
    scaling_type: str = "none"  # "none" | "linear"
    scaling_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    num_layers: int
    hidden_size: int
    ffn_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    vocab_size: int
    norm_eps: float
    rope: RopeConfig
    rope_local: RopeConfig | None  # RoPE of sliding-window layers where it differs (Gemma 3)
    sliding_window: int | None
    layer_is_sliding: tuple[bool, ...]  # per layer: attends to the last `sliding_window` tokens only
    query_scale: float  # multiplies q·k before softmax
    embedding_scale: float  # multiplies the token embeddings (Gemma: sqrt(hidden_size))
    tie_word_embeddings: bool
    bos_id: int | None
    eos_id: int | None
    eog_ids: tuple[int, ...]  # every id that ends generation
    chat_template: str | None
    quantization: str
    num_parameters: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for every layer, in fp32 (multiply by dtype bytes / 4 for others)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_gguf(cls, gguf: ModelFile) -> ModelConfig:
        md = gguf.metadata
        arch = md.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(gguf.path, "missing required metadata 'general.architecture'")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(gguf.path, f"unknown architecture {arch!r} "
                                            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

        def get(key: str, default: Any = None, *, kind: type = int) -> Any:
            full = f"{arch}.{key}"
            value = md.get(full, default)
            if value is None:
                raise ModelLoadError(gguf.path, f"missing required metadata {full!r}")
            if isinstance(value, (np.ndarray, list)) and kind is not list:
                raise ModelLoadError(gguf.path, f"metadata {full!r} must be a single {kind.__name__}")
            try:
                value = kind(value)
            except (TypeError, ValueError):
                raise ModelLoadError(gguf.path, f"metadata {full!r} must be a {kind.__name__}, "
                                                f"got {value!r}") from None
            if kind is int and value <= 0:
                raise ModelLoadError(gguf.path, f"metadata {full!r} must be positive, got {value}")
            return value

        num_layers = get("block_count")
        hidden = get("embedding_length")
        num_heads = get("attention.head_count")
        num_kv_heads = get("attention.head_count_kv", num_heads)
        head_dim = get("attention.key_length", hidden // num_heads)
        if get("attention.value_length", head_dim) != head_dim:
            raise ModelLoadError(gguf.path, "key and value head sizes differ; not supported")
        if num_heads % num_kv_heads:
            raise ModelLoadError(gguf.path, f"{num_heads} attention heads are not a multiple of "
                                            f"{num_kv_heads} KV heads")
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelLoadError(gguf.path, "missing or empty 'tokenizer.ggml.tokens'")
        for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            if key in md and len(md[key]) != len(tokens):
                raise ModelLoadError(gguf.path, f"{key!r} has {len(md[key])} entries but "
                                                f"'tokenizer.ggml.tokens' has {len(tokens)}")
        embd = gguf.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelLoadError(gguf.path, "missing tensor 'token_embd.weight'")
        vocab_size = get("vocab_size", len(tokens))
        if embd.shape != (vocab_size, hidden) or vocab_size != len(tokens):
            raise ModelLoadError(gguf.path, f"token_embd.weight has shape {embd.shape}, expected "
                                            f"({vocab_size}, {hidden}) for {len(tokens)} tokens")

        special: dict[str, int | None] = {}
        for role in ("bos", "eos", "eot", "eom"):
            value = md.get(f"tokenizer.ggml.{role}_token_id")
            if value is not None and not 0 <= int(value) < vocab_size:
                raise ModelLoadError(gguf.path, f"tokenizer.ggml.{role}_token_id {value} is outside the "
                                                f"vocabulary (0..{vocab_size - 1})")
            special[role] = None if value is None else int(value)
        token_types = md.get("tokenizer.ggml.token_type")
        eog = {i for i in (special["eos"], special["eot"], special["eom"]) if i is not None}
        # nextoken's own key, not llama.cpp's: every id that ends generation, where a Hugging Face directory lists
        # several (generation_config.json's eos_token_id; loader/hf.py).
        for value in md.get("tokenizer.ggml.eog_token_ids", ()):
            if not 0 <= int(value) < vocab_size:
                raise ModelLoadError(gguf.path, f"tokenizer.ggml.eog_token_ids holds {int(value)}, outside the "
                                                f"vocabulary (0..{vocab_size - 1})")
            eog.add(int(value))
        for i, text in enumerate(tokens):
            # Only control/user-defined tokens (types 3, 4) can be end-of-turn markers.
            if text in END_OF_TURN_TEXTS and (token_types is None or int(token_types[i]) in (3, 4)):
                eog.add(i)

        rope_dim = get("rope.dimension_count", head_dim)
        scaling = md.get(f"{arch}.rope.scaling.type", "none")
        factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        rope = RopeConfig(theta=get("rope.freq_base", 10_000.0, kind=float), dim=rope_dim,
                          scaling_type=str(scaling), scaling_factor=factor)
        if rope.scaling_type not in ("none", "linear"):
            raise ModelLoadError(gguf.path, f"RoPE scaling {rope.scaling_type!r} is not supported")

        sliding_window: int | None = None
        layer_is_sliding = (False,) * num_layers
        rope_local: RopeConfig | None = None
        query_scale = head_dim ** -0.5
        embedding_scale = 1.0
        if arch == "gemma3":
            sliding_window = get("attention.sliding_window")
            pattern = md.get(f"{arch}.attention.sliding_window_pattern")
            if pattern is not None and len(pattern) == num_layers:
                layer_is_sliding = tuple(bool(x) for x in pattern)
            else:
                # Gemma 3's published configuration: five local layers, then one global (layer i is global
                # when (i + 1) % 6 == 0); the local layers use RoPE base 10,000.
                layer_is_sliding = tuple((i + 1) % 6 != 0 for i in range(num_layers))
            rope_local = RopeConfig(theta=float(md.get(f"{arch}.rope.freq_base_swa", 10_000.0)), dim=rope_dim)
            embedding_scale = hidden ** 0.5

        file_type = md.get("general.file_type")
        return cls(
            architecture=arch,
            name=str(md.get("general.name", gguf.path.stem)),
            num_layers=num_layers,
            hidden_size=hidden,
            ffn_size=get("feed_forward_length"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            context_length=get("context_length"),
            vocab_size=vocab_size,
            norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6, kind=float),
            rope=rope,
            rope_local=rope_local,
            sliding_window=sliding_window,
            layer_is_sliding=layer_is_sliding,
            query_scale=query_scale,
            embedding_scale=embedding_scale,
            tie_word_embeddings="output.weight" not in gguf.tensors,
            bos_id=special["bos"],
            eos_id=special["eos"],
            eog_ids=tuple(sorted(eog)),
            chat_template=md.get("tokenizer.chat_template"),
            quantization=FILE_TYPES.get(int(file_type), f"type {file_type}") if file_type is not None
            else _dominant_type(gguf),
            num_parameters=gguf.num_parameters,
        )


def _dominant_type(gguf: ModelFile) -> str:
    counts: dict[str, int] = {}
    for t in gguf.tensors.values():
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + t.num_elements
    return max(counts, key=counts.__getitem__) if counts else "none"

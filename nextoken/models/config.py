"""ModelConfig: the hyperparameters of one model, read from its file's metadata and never guessed from names.

The keys every family shares (llama.cpp's `{arch}.block_count`, `embedding_length`, ...) are read here; a family's own
settings by its file's `configure` (models/gemma3.py), which also marks where the file leaves a value implicit and the
architecture's published configuration supplies it. Missing required keys and inconsistent tokenizer arrays raise
ModelLoadError naming the key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from nextoken.errors import ModelLoadError
from nextoken.loader.gguf import ModelFile
from nextoken.models.gemma3 import GEMMA3
from nextoken.models.gpt2 import GPT2
from nextoken.models.llama import LLAMA
from nextoken.models.phi3 import PHI3
from nextoken.models.qwen2 import QWEN2, QWEN2MOE
from nextoken.models.qwen3 import QWEN3
from nextoken.models.recipe import Family, Recipe, RopeConfig

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, GEMMA3, QWEN2, QWEN2MOE, QWEN3, PHI3, GPT2)}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

# Text of tokens that end a turn in the chat formats we know; the file's EOS id always ends generation too.
END_OF_TURN_TEXTS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|eom_id|>")

# general.file_type -> the name llama.cpp gives the file's dominant quantization.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
              18: "Q6_K", 32: "BF16"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    recipe: Recipe  # what the blocks are made of (models/recipe.py)
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
    # Mixture-of-experts layers (recipe.mlp "moe"): experts, how many each token takes, their and the shared
    # expert's hidden sizes.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_size: int = 0
    shared_expert_ffn_size: int = 0

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
        family = FAMILIES.get(arch)
        if family is None:
            raise ModelLoadError(gguf.path, f"unknown architecture {arch!r} "
                                            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        recipe = family.recipe
        required = object()

        def get(key: str, default: Any = required, *, kind: type = int) -> Any:
            full = f"{arch}.{key}"
            value = md.get(full)
            if value is None:
                if default is required:
                    raise ModelLoadError(gguf.path, f"missing required metadata {full!r}")
                return default
            if kind is list:
                if not isinstance(value, (np.ndarray, list)):
                    raise ModelLoadError(gguf.path, f"metadata {full!r} must be an array")
                return list(value)
            if isinstance(value, (np.ndarray, list)):
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
        # Bounded by the file before anything is sized by it (a tuple per layer below, the blocks built later): a
        # count of a billion in a 30 KB file would otherwise take gigabytes before any tensor is found missing.
        held = {name.split(".")[1] for name in gguf.tensors if name.startswith("blk.")}
        if num_layers > len(held):
            raise ModelLoadError(gguf.path, f"metadata '{arch}.block_count' is {num_layers}, but the file holds "
                                            f"tensors for {len(held)} blocks")
        hidden = get("embedding_length")
        num_heads = get("attention.head_count")
        num_kv_heads = get("attention.head_count_kv", num_heads)
        head_dim = get("attention.key_length", hidden // num_heads)
        if head_dim <= 0:  # no key_length, and more heads than the hidden size has values
            raise ModelLoadError(gguf.path, f"metadata '{arch}.attention.head_count' is {num_heads}, more heads than "
                                            f"'{arch}.embedding_length' ({hidden}) has values, and no "
                                            f"'{arch}.attention.key_length' gives their size")
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
        scaling = str(get("rope.scaling.type", "none", kind=str))
        if scaling not in ("none", "linear", "longrope"):
            raise ModelLoadError(gguf.path, f"RoPE scaling {scaling!r} is not supported")
        factors, attention_factor = _rope_factors(gguf, get, rope_dim)
        rope = RopeConfig(theta=get("rope.freq_base", 10_000.0, kind=float), dim=rope_dim,
                          scaling_type="linear" if scaling == "linear" else "none",
                          scaling_factor=(get("rope.scaling.factor", 1.0, kind=float) or 1.0) if scaling == "linear" else 1.0,
                          freq_factors=factors, attention_factor=attention_factor)
        # A window on every layer, where set (Mistral, Phi-3); 0, as converters write "none", is no window.
        window = get("attention.sliding_window", None) if md.get(f"{arch}.attention.sliding_window") else None
        eps_key = "attention.layer_norm_rms_epsilon" if recipe.norm == "rms" else "attention.layer_norm_epsilon"
        fields: dict[str, Any] = dict(
            num_layers=num_layers, hidden_size=hidden, num_heads=num_heads, head_dim=head_dim, rope=rope,
            rope_local=None, sliding_window=window, layer_is_sliding=(window is not None,) * num_layers,
            query_scale=head_dim ** -0.5, embedding_scale=1.0, norm_eps=get(eps_key, 1e-6 if recipe.norm == "rms"
                                                                              else 1e-5, kind=float))
        experts = get("expert_count", None)
        if experts is not None:  # Mixtral is a Llama file with experts
            recipe = dataclasses.replace(recipe, mlp="moe")
            used = get("expert_used_count")
            if used > experts:
                raise ModelLoadError(gguf.path, f"{arch}.expert_used_count {used} exceeds {arch}.expert_count "
                                                f"{experts}")
            fields.update(num_experts=experts, experts_per_token=used,
                          expert_ffn_size=get("expert_feed_forward_length", get("feed_forward_length")),
                          shared_expert_ffn_size=get("expert_shared_feed_forward_length", 0)
                          if recipe.shared_expert else 0)
        elif recipe.mlp == "moe":
            raise ModelLoadError(gguf.path, f"missing required metadata '{arch}.expert_count'")
        if family.configure is not None:
            family.configure(get, fields)

        file_type = md.get("general.file_type")
        return cls(
            architecture=arch,
            recipe=recipe,
            name=str(md.get("general.name", gguf.path.stem)),
            ffn_size=get("feed_forward_length"),
            num_kv_heads=num_kv_heads,
            context_length=get("context_length"),
            vocab_size=vocab_size,
            tie_word_embeddings="output.weight" not in gguf.tensors,
            bos_id=special["bos"],
            eos_id=special["eos"],
            eog_ids=tuple(sorted(eog)),
            chat_template=md.get("tokenizer.chat_template"),
            quantization=FILE_TYPES.get(int(file_type), f"type {file_type}") if file_type is not None
            else _dominant_type(gguf),
            num_parameters=gguf.num_parameters,
            **fields,
        )


def _rope_factors(gguf: ModelFile, get: Any, rope_dim: int) -> tuple[tuple[float, ...] | None, float]:
    """(per-frequency divisors, the factor on cos and sin) from the file's extra RoPE tensors: Llama 3's `rope_freqs`,
    or Phi-3's longrope pair, of which the long factors apply where the model's context is longer than the one it
    was trained at (llama.cpp's choice: by the context, not by each sequence's length)."""
    names = ["rope_freqs.weight"]
    if "rope_factors_long.weight" in gguf.tensors:
        original = get("rope.scaling.original_context_length", None)
        long = original is not None and get("context_length") > original
        names = ["rope_factors_long.weight" if long else "rope_factors_short.weight"]
    for name in names:
        info = gguf.tensors.get(name)
        if info is None:
            continue
        if info.shape != (rope_dim // 2,):
            raise ModelLoadError(gguf.path, f"tensor {name!r} has shape {info.shape}, expected ({rope_dim // 2},)")
        if info.qtype.name not in ("F32", "F16"):  # as llama.cpp writes them: a few floats, never in blocks
            raise ModelLoadError(gguf.path, f"tensor {name!r} is {info.qtype.name}; expected F32 or F16")
        values = gguf.raw(name).view(np.float32 if info.qtype.name == "F32" else np.float16)
        return tuple(float(v) for v in values.tolist()), get("rope.scaling.attn_factor", 1.0, kind=float)
    return None, 1.0


def _dominant_type(gguf: ModelFile) -> str:
    counts: dict[str, int] = {}
    for t in gguf.tensors.values():
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + t.num_elements
    return max(counts, key=counts.__getitem__) if counts else "none"

"""llama.cpp's converter conventions (convert_hf_to_gguf.py), per Hugging Face `model_type`: the GGUF architecture, the
`{arch}.*` metadata it writes from config.json, the changes it makes to tensors (Llama's Q/K row permutation, GPT-2's
transposed Conv1D weights, Gemma's norms as 1 + w), the tensors it adds (Llama 3's `rope_freqs`, Phi-3's long/short
factors), and the shape every GGUF tensor must have for the configuration. Pure functions of config.json; no file is
read here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, Keys


class ConfigError(ValueError):
    """A config.json value that is missing or wrong; the caller names the file."""


class Hparams:
    """config.json, with `text_config` lifted to the top as llama.cpp does, and its RoPE settings in one place
    (`rope`): transformers 5's `rope_parameters` or the older `rope_theta` + `rope_scaling`."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        text = config.get("text_config")
        self.values: dict[str, Any] = {**config, **text} if isinstance(text, dict) else dict(config)
        rope = self.values.get("rope_parameters") or self.values.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters must be an object, got {rope!r}")
        local = rope.get("sliding_attention") or {}  # per layer type: sliding-window layers' own (Gemma 3)
        rope = dict(rope.get("full_attention", rope))
        if "rope_theta" not in rope and self.values.get("rope_theta") is not None:
            rope["rope_theta"] = self.values["rope_theta"]
        if "rope_type" not in rope and "type" in rope:
            rope["rope_type"] = rope["type"]
        self.rope: dict[str, Any] = rope
        self.local_rope_theta: float | None = local.get("rope_theta", self.values.get("rope_local_base_freq"))

    def opt(self, *keys: str, kind: type = int) -> Any:
        """The first of `keys` present and not null, as `kind` (a non-negative number); None when none is."""
        for key in keys:
            value = self.values.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or \
                        (kind is int and value != int(value)):
                    raise ConfigError(f"{key} must be a non-negative {kind.__name__}, got {value!r}")
                return kind(value)
        return None

    def find(self, *keys: str, default: Any = None, kind: type = int) -> Any:
        """`opt`, else `default`; without a default one of `keys` is required."""
        value = self.opt(*keys, kind=kind)
        if value is None and default is None:
            raise ConfigError(f"missing {' or '.join(keys)}")
        return default if value is None else value

    @property
    def num_layers(self) -> int:
        return self.find("num_hidden_layers", "n_layer", "num_layers")

    @property
    def hidden(self) -> int:
        return self.find("hidden_size", "n_embd")

    @property
    def num_heads(self) -> int:
        return self.find("num_attention_heads", "n_head")

    @property
    def num_kv_heads(self) -> int:
        return self.find("num_key_value_heads", "n_head_kv", default=self.num_heads)

    @property
    def head_dim(self) -> int:
        return self.find("head_dim", default=self.hidden // self.num_heads)

    @property
    def ffn(self) -> int:
        return self.find("intermediate_size", "n_inner", default=4 * self.hidden)

    @property
    def vocab_size(self) -> int:
        return self.find("vocab_size")


@dataclass(frozen=True)
class Family:
    """How llama.cpp converts one model_type: `arch`, whether Q/K rows are permuted (LlamaModel.permute), the Conv1D
    weights to transpose (name suffixes), what is added to norm weights (Gemma's (1 + w) stored whole), whether the
    token table keeps only the tokenizer's rows, the tensors it drops, and the `{arch}.*` metadata."""

    arch: MODEL_ARCH
    metadata: Callable[[Hparams, str], dict[str, Any]]
    permute_qk: bool = False
    conv1d: tuple[str, ...] = field(default=())
    norm_shift: float = 0.0
    trim_vocab: bool = False
    skipped: tuple[str, ...] = ()  # tensors llama.cpp leaves out

    @property
    def name(self) -> str:
        return MODEL_ARCH_NAMES[self.arch]


def f32(value: float) -> float:
    """A float as a GGUF file holds it (float32), so that the view reads as the written file would."""
    return float(np.float32(value))


def _keys(arch: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """Key templates ("{arch}.block_count") -> keys, floats rounded to float32, None values dropped."""
    return {k.format(arch=arch): f32(v) if isinstance(v, float) else v for k, v in values.items() if v is not None}


def _text_model(hp: Hparams, arch: str) -> dict[str, Any]:
    """TextModel.set_gguf_parameters: the keys every text model gets from the config names it knows."""
    llm, att, rope = Keys.LLM, Keys.Attention, Keys.Rope
    values: dict[str, Any] = {
        llm.BLOCK_COUNT: hp.num_layers,
        llm.CONTEXT_LENGTH: hp.opt("max_position_embeddings", "n_ctx", "n_positions"),
        llm.EMBEDDING_LENGTH: hp.hidden,
        llm.FEED_FORWARD_LENGTH: hp.opt("intermediate_size", "n_inner"),
        att.HEAD_COUNT: hp.num_heads,
        att.HEAD_COUNT_KV: hp.opt("num_key_value_heads", "n_kv_heads"),
        rope.FREQ_BASE: None if hp.rope.get("rope_theta") is None else float(hp.rope["rope_theta"]),
        att.LAYERNORM_RMS_EPS: hp.opt("rms_norm_eps", "norm_eps", kind=float),
        att.LAYERNORM_EPS: hp.opt("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon", kind=float),
        llm.EXPERT_COUNT: hp.opt("num_local_experts", "num_experts"),
        llm.EXPERT_USED_COUNT: hp.opt("num_experts_per_tok", "num_experts_per_token"),
    }
    if hp.values.get("head_dim") is not None:
        values[att.KEY_LENGTH] = values[att.VALUE_LENGTH] = hp.head_dim
    values.update(_rope_scaling(hp))
    return _keys(arch, values)


def _rope_scaling(hp: Hparams) -> dict[str, Any]:
    """rope.scaling.* for linear and YaRN scaling; longrope only names its type (its factors are tensors), llama3 is
    a tensor alone (`rope_freqs`)."""
    rope, kind, factor = Keys.Rope, str(hp.rope.get("rope_type", "")).lower(), hp.rope.get("factor")
    if kind == "linear" and factor is not None:
        return {rope.SCALING_TYPE: "linear", rope.SCALING_FACTOR: float(factor)}
    if kind == "yarn" and factor is not None:
        return {rope.SCALING_TYPE: "yarn", rope.SCALING_FACTOR: float(factor),
                rope.SCALING_ORIG_CTX_LEN: hp.rope.get("original_max_position_embeddings"),
                rope.SCALING_YARN_EXT_FACTOR: hp.rope.get("extrapolation_factor"),
                rope.SCALING_YARN_ATTN_FACTOR: hp.rope.get("attention_factor", hp.rope.get("attn_factor")),
                rope.SCALING_YARN_BETA_FAST: hp.rope.get("beta_fast"),
                rope.SCALING_YARN_BETA_SLOW: hp.rope.get("beta_slow")}
    if kind in ("su", "longrope"):
        return {rope.SCALING_TYPE: "longrope"}
    if kind not in ("", "default", "llama3"):
        raise ConfigError(f"RoPE type {kind!r} is not supported (default, linear, yarn, llama3, longrope)")
    return {}


def _sliding_window(hp: Hparams) -> dict[str, Any]:
    """attention.sliding_window where the config sets one that applies (Qwen2's only with use_sliding_window)."""
    window = hp.values.get("sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0 or \
            hp.values.get("use_sliding_window") is False:
        return {}
    return {Keys.Attention.SLIDING_WINDOW: window}


def _llama(hp: Hparams, arch: str) -> dict[str, Any]:
    """LlamaModel (llama, mistral, mixtral): the vocabulary size and the rotated dimensions too."""
    return {**_text_model(hp, arch), **_keys(arch, {Keys.LLM.VOCAB_SIZE: hp.vocab_size,
                                                    Keys.Rope.DIMENSION_COUNT: hp.head_dim,
                                                    **_sliding_window(hp)})}


def _qwen2(hp: Hparams, arch: str) -> dict[str, Any]:
    return {**_text_model(hp, arch), **_keys(arch, _sliding_window(hp))}


def _qwen2_moe(hp: Hparams, arch: str) -> dict[str, Any]:
    return {**_qwen2(hp, arch), **_keys(arch, {
        Keys.LLM.EXPERT_FEED_FORWARD_LENGTH: hp.opt("moe_intermediate_size"),
        Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH: hp.opt("shared_expert_intermediate_size")})}


def _rope_dims(hp: Hparams) -> int:
    """Rotated dimensions per head under partial rotary (Phi-3: int(factor * hidden) // heads)."""
    factor = hp.rope.get("partial_rotary_factor", hp.values.get("partial_rotary_factor", 1.0))
    return int(float(factor) * hp.hidden) // hp.num_heads


def _original_context(hp: Hparams) -> int:
    return int(hp.rope.get("original_max_position_embeddings") or
               hp.find("original_max_position_embeddings", "max_position_embeddings"))


def _phi3(hp: Hparams, arch: str) -> dict[str, Any]:
    """Phi3MiniModel writes its own set, sliding_window always (0: none), and the long-context attention factor."""
    llm, att, rope = Keys.LLM, Keys.Attention, Keys.Rope
    context, original = hp.find("n_positions", "max_position_embeddings"), _original_context(hp)
    values: dict[str, Any] = {
        llm.CONTEXT_LENGTH: context, rope.SCALING_ORIG_CTX_LEN: original, llm.EMBEDDING_LENGTH: hp.hidden,
        llm.FEED_FORWARD_LENGTH: hp.find("intermediate_size"), llm.BLOCK_COUNT: hp.num_layers,
        att.HEAD_COUNT: hp.num_heads, att.HEAD_COUNT_KV: hp.num_kv_heads,
        att.LAYERNORM_RMS_EPS: hp.find("rms_norm_eps", kind=float), rope.DIMENSION_COUNT: _rope_dims(hp),
        rope.FREQ_BASE: float(hp.rope.get("rope_theta", 10_000.0)),
        att.SLIDING_WINDOW: hp.find("sliding_window", default=0)}
    if hp.rope.get("long_factor"):
        scale = context / original
        kind = str(hp.rope.get("rope_type", "")).lower()
        if kind in ("su", "longrope"):
            values[rope.SCALING_ATTN_FACTOR] = math.sqrt(1 + math.log(scale) / math.log(original)) \
                if scale > 1.0 else 1.0
        elif kind == "yarn":
            values[rope.SCALING_ATTN_FACTOR] = 0.1 * math.log(scale) + 1.0 if scale > 1.0 else 1.0
        else:
            raise ConfigError(f"RoPE type {kind!r} with long/short factors is not supported")
    return _keys(arch, values)


def _gpt2(hp: Hparams, arch: str) -> dict[str, Any]:
    """GPT2Model writes these alone; the MLP is n_inner wide where set, else 4 * n_embd."""
    return _keys(arch, {
        Keys.LLM.BLOCK_COUNT: hp.num_layers, Keys.LLM.CONTEXT_LENGTH: hp.find("n_ctx", "n_positions"),
        Keys.LLM.EMBEDDING_LENGTH: hp.hidden, Keys.LLM.FEED_FORWARD_LENGTH: hp.ffn,
        Keys.Attention.HEAD_COUNT: hp.num_heads,
        Keys.Attention.LAYERNORM_EPS: hp.find("layer_norm_epsilon", kind=float)})


def _gemma3(hp: Hparams, arch: str) -> dict[str, Any]:
    """Gemma3Model: the text model's keys with Gemma 3's defaults, the local layers' RoPE base, the window, and (not
    llama.cpp's for Gemma 3, which assumes five local layers then a global one) which layers are local."""
    llm, att, rope = Keys.LLM, Keys.Attention, Keys.Rope
    head_dim = hp.find("head_dim", default=256)
    values: dict[str, Any] = {
        llm.CONTEXT_LENGTH: hp.find("max_position_embeddings", default=131_072),
        att.HEAD_COUNT: hp.find("num_attention_heads", default=8),
        att.HEAD_COUNT_KV: hp.find("num_key_value_heads", default=4),
        att.LAYERNORM_RMS_EPS: hp.find("rms_norm_eps", default=1e-6, kind=float),
        att.KEY_LENGTH: head_dim, att.VALUE_LENGTH: head_dim,
        rope.FREQ_BASE: float(hp.rope.get("rope_theta", 1_000_000.0)),
        rope.FREQ_BASE_SWA: None if hp.local_rope_theta is None else float(hp.local_rope_theta),
        llm.FINAL_LOGIT_SOFTCAPPING: hp.opt("final_logit_softcapping", kind=float) or None,
    }
    if hp.values.get("sliding_window_pattern") != 1:
        values[att.SLIDING_WINDOW] = hp.find("sliding_window")
    layer_types = hp.values.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == hp.num_layers:
        values[att.SLIDING_WINDOW_PATTERN] = [t == "sliding_attention" for t in layer_types]
    return {**_text_model(hp, arch), **_keys(arch, values)}


_LLAMA = Family(MODEL_ARCH.LLAMA, _llama, permute_qk=True)
FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "mixtral": _LLAMA,
    "qwen2": Family(MODEL_ARCH.QWEN2, _qwen2),
    "qwen3": Family(MODEL_ARCH.QWEN3, _qwen2),
    "qwen2_moe": Family(MODEL_ARCH.QWEN2MOE, _qwen2_moe),
    "phi3": Family(MODEL_ARCH.PHI3, _phi3),
    "gpt2": Family(MODEL_ARCH.GPT2, _gpt2,
                   conv1d=(".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")),
    "gemma3_text": Family(MODEL_ARCH.GEMMA3, _gemma3, norm_shift=1.0, trim_vocab=True, skipped=("lm_head.weight",)),
}


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: within each head, rows (the two halves of the rotated dimensions, as Hugging
    Face's half-split RoPE pairs them) are interleaved, so that GGML's adjacent-pair RoPE gives the same rotation."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(
        weight.shape)


def llama3_rope_factors(hp: Hparams) -> torch.Tensor | None:
    """`rope_freqs.weight` for "llama3" RoPE scaling: per rotated pair, the divisor of its base frequency. Pairs of
    short wavelength keep theirs (1), long ones are divided by `factor`, and those between blend smoothly."""
    if str(hp.rope.get("rope_type", "")).lower() != "llama3":
        return None
    dim = hp.head_dim
    base = float(hp.rope.get("rope_theta", 10_000.0))
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # [dim / 2]
    factor = float(hp.rope.get("factor", 8.0))
    low, high = float(hp.rope.get("low_freq_factor", 1.0)), float(hp.rope.get("high_freq_factor", 4.0))
    original = float(hp.rope.get("original_max_position_embeddings") or
                     hp.find("original_max_position_embeddings", default=8192))
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < original / high, torch.ones_like(wavelen),
                       torch.where(wavelen > original / low, torch.full_like(wavelen, factor), blended))


def longrope_factors(hp: Hparams) -> dict[str, torch.Tensor]:
    """Phi-3's `rope_factors_long` / `rope_factors_short` ([rotated dims / 2] each), where the config has them."""
    long, short = hp.rope.get("long_factor"), hp.rope.get("short_factor")
    if not long:
        return {}
    half = _rope_dims(hp) // 2
    if not isinstance(long, list) or not isinstance(short, list) or len(long) != half or len(short) != half:
        raise ConfigError(f"rope long_factor and short_factor must be lists of {half} numbers")
    return {"rope_factors_long.weight": torch.tensor(long, dtype=torch.float32),
            "rope_factors_short.weight": torch.tensor(short, dtype=torch.float32)}


def expected_shapes(hp: Hparams, vocab: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name (block tensors without their "blk.N." prefix) -> the numpy-order shape the configuration
    gives it, for a token table of `vocab` rows. Names not listed are not checked."""
    hidden, hd, ffn = hp.hidden, hp.head_dim, hp.ffn
    q, kv = hp.num_heads * hd, hp.num_kv_heads * hd
    experts = hp.opt("num_local_experts", "num_experts")
    expert_ffn = hp.find("moe_intermediate_size", default=ffn)
    shared_ffn = hp.opt("shared_expert_intermediate_size")
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden), "output_norm.weight": (hidden,),
        "output_norm.bias": (hidden,), "attn_norm.weight": (hidden,), "attn_norm.bias": (hidden,),
        "ffn_norm.weight": (hidden,), "ffn_norm.bias": (hidden,),
        "attn_q.weight": (q, hidden), "attn_q.bias": (q,), "attn_k.weight": (kv, hidden), "attn_k.bias": (kv,),
        "attn_v.weight": (kv, hidden), "attn_v.bias": (kv,), "attn_qkv.weight": (q + 2 * kv, hidden),
        "attn_qkv.bias": (q + 2 * kv,), "attn_output.weight": (hidden, q), "attn_output.bias": (hidden,),
        "attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,), "post_attention_norm.weight": (hidden,),
        "post_ffw_norm.weight": (hidden,),
        "ffn_gate.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn), "ffn_down.bias": (hidden,),
        "ffn_up.weight": (ffn, hidden), "ffn_up.bias": (ffn,),
    }
    if hp.values.get("model_type") == "phi3":  # gate and up fused into one ffn_up
        shapes["ffn_up.weight"] = (2 * ffn, hidden)
    if hp.values.get("model_type") == "gpt2":
        shapes["position_embd.weight"] = (hp.find("n_positions", "n_ctx"), hidden)
    if experts:
        shapes.update({"ffn_gate_inp.weight": (experts, hidden),
                       "ffn_gate_exps.weight": (experts, expert_ffn, hidden),
                       "ffn_up_exps.weight": (experts, expert_ffn, hidden),
                       "ffn_down_exps.weight": (experts, hidden, expert_ffn)})
    if shared_ffn:
        shapes.update({"ffn_gate_shexp.weight": (shared_ffn, hidden), "ffn_up_shexp.weight": (shared_ffn, hidden),
                       "ffn_down_shexp.weight": (hidden, shared_ffn), "ffn_gate_inp_shexp.weight": (1, hidden)})
    return shapes

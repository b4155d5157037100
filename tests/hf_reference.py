"""Tiny random models of each architecture, built by transformers itself (the reference implementation), and the same
weights written as a GGUF file the way llama.cpp's converter writes them: its tensor names (the `gguf` package's map),
its metadata keys, and its layout changes (the Llama family's q/k row permutation for its pairwise RoPE, GPT-2's
transposed Conv1D weights, Llama 3's frequency factors as the `rope_freqs` tensor).

The weights are redrawn larger than transformers' initialization (which leaves every distribution nearly flat, where
the order of near-equal tokens is noise), so that teacher-forced top-5 comparisons are meaningful.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from tests.tiny import _bpe_vocab

TOKENS, TOKEN_TYPES, MERGES = _bpe_vocab()
VOCAB = len(TOKENS)
BOS, EOS = 1, 2
CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# Phi-3's long-context scaling: long factors past 32 tokens (where the model's 256-token context is longer), short
# ones within; an attention factor from the ratio.
LONGROPE = {"rope_type": "longrope", "rope_theta": 10_000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}
# name -> (transformers config class, its arguments, the GGUF architecture)
ARCHS: dict[str, tuple[str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", dict(COMMON, rms_norm_eps=1e-6, tie_word_embeddings=False), "llama"),
    "llama3": ("LlamaConfig", dict(COMMON, rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE), "llama"),
    "mistral": ("MistralConfig", dict(COMMON, rms_norm_eps=1e-6, sliding_window=12, head_dim=16), "llama"),
    "qwen2": ("Qwen2Config", dict(COMMON, rms_norm_eps=1e-6, tie_word_embeddings=True), "qwen2"),
    "qwen3": ("Qwen3Config", dict(COMMON, rms_norm_eps=1e-6, head_dim=24, tie_word_embeddings=False), "qwen3"),
    "phi3": ("Phi3Config", dict(COMMON, rms_norm_eps=1e-5, pad_token_id=0, tie_word_embeddings=False), "phi3"),
    "phi3-longrope": ("Phi3Config", dict(COMMON, rms_norm_eps=1e-5, pad_token_id=0, tie_word_embeddings=False,
                                         rope_parameters=LONGROPE, original_max_position_embeddings=32), "phi3"),
    "mixtral": ("MixtralConfig", dict(COMMON, rms_norm_eps=1e-6, num_local_experts=4, num_experts_per_tok=2,
                                      tie_word_embeddings=False), "llama"),
    "qwen2moe": ("Qwen2MoeConfig", dict(COMMON, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                        norm_topk_prob=False, tie_word_embeddings=False), "qwen2moe"),
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                activation_function="gelu_new", bos_token_id=BOS, eos_token_id=EOS), "gpt2"),
}
LLAMA_FAMILY = ("llama", "llama3", "mistral", "mixtral")
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
             "phi3": gguf.MODEL_ARCH.PHI3, "gpt2": gguf.MODEL_ARCH.GPT2,
             "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE}


def build(name: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """The transformers model of architecture `name`, fp32, eval mode, with weights drawn by `seed`; `overrides`
    change its configuration (a larger shape for a benchmark)."""
    import transformers

    cls, kwargs, _ = ARCHS[name]
    config = getattr(transformers, cls)(**{**kwargs, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # norms around 1, biases around 0
                around = 0.0 if pname.endswith("bias") else 1.0
                p.copy_(around + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in pname or pname.endswith(("wte.weight", "wpe.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "wpe" in pname else 1.0))
            else:
                fan_in = p.shape[0] if name == "gpt2" else p.shape[-1]  # GPT-2's Conv1D is [in, out]
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(fan_in)))
    return model


def save_directory(model: torch.nn.Module, path: Path) -> Path:
    """The model as a Hugging Face directory (safetensors, config.json, generation_config.json)."""
    model.save_pretrained(path)
    return path


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for the Llama family: each head's half-split rows (pair i at rows i and
    i + d/2) interleaved (pair i at rows 2i, 2i+1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(rope: dict[str, Any], dim: int) -> np.ndarray:
    """Llama 3's per-frequency divisors: 1 for short wavelengths, `factor` for long ones, a smooth blend between."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for f in 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim):
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model: torch.nn.Module, name: str, path: Path) -> Path:
    """The model's weights as llama.cpp would convert them, with the tiny byte-level BPE vocabulary."""
    cfg = model.config
    arch = ARCHS[name][2]
    gpt2 = arch == "gpt2"
    hidden = cfg.n_embd if gpt2 else cfg.hidden_size
    heads = cfg.n_head if gpt2 else cfg.num_attention_heads
    kv_heads = heads if gpt2 else cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    layers = cfg.n_layer if gpt2 else cfg.num_hidden_layers
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{name}")
    w.add_block_count(layers)
    w.add_context_length(cfg.n_positions if gpt2 else cfg.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden if gpt2 else cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if gpt2:
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        rope = cfg.rope_parameters
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if head_dim != hidden // heads:
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        if getattr(cfg, "sliding_window", None) and name == "mistral":
            w.add_sliding_window(cfg.sliding_window)
        if rope.get("rope_type") == "llama3":
            w.add_tensor("rope_freqs.weight", _llama3_factors(rope, head_dim))
        if rope.get("rope_type") == "longrope":
            original = rope["original_max_position_embeddings"]
            scale = cfg.max_position_embeddings / original
            w.add_rope_scaling_orig_ctx_len(original)
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen2moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and getattr(cfg, "tie_word_embeddings", True):
            continue  # tied: the table is the head
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # GPT-2's causal-mask buffers in older checkpoints
        values = tensor.detach().float().numpy().copy()
        layer = hf_name.split(".")[2] if ".layers." in hf_name else ""
        if hf_name.endswith("mlp.experts.gate_up_proj"):  # transformers' fused experts, gate first
            half = values.shape[1] // 2
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(values[:, :half]))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(values[:, half:]))
            continue
        if hf_name.endswith("mlp.experts.down_proj"):
            w.add_tensor(f"blk.{layer}.ffn_down_exps.weight", values)
            continue
        if hf_name.endswith("mlp.gate.weight"):  # the router
            w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", values)
            continue
        new = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert new is not None, f"no GGUF name for {hf_name}"
        if gpt2 and values.ndim == 2 and ".h." in f".{hf_name}" and "c_" in hf_name:
            values = np.ascontiguousarray(values.T)  # Conv1D stores [in, out]
        if name in LLAMA_FAMILY and new.endswith("attn_q.weight"):
            values = _permute(values, heads)
        if name in LLAMA_FAMILY and new.endswith("attn_k.weight"):
            values = _permute(values, kv_heads)
        w.add_tensor(new, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids` [len, vocab]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def reference_greedy(model: torch.nn.Module, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of `ids` (token by token with its own KV cache; no early stop at EOS)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                             pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()

"""A tiny reasoning model whose answer is fixed: its weights make each token's successor a function of the token alone,
so after the generation prompt's last newline it writes `<think>ab</think>cd` and ends the turn.

Every block's projections are zero, so the residual stream is the token's embedding; chain token i embeds as the i-th
unit vector, and the LM head's row for its successor is that vector: the successor's logit is sqrt(hidden) * 10, every
other 0. `<think>` and `</think>` are user-defined tokens, as in Qwen3's vocabulary, and the chat template is a ChatML
one with Qwen3's `enable_thinking` switch (false: an empty section written into the prompt).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from tests.tiny import _bpe_vocab

TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}"
            "{% if enable_thinking is defined and enable_thinking is false %}{{'<think>\\n\\n</think>\\n\\n'}}"
            "{% endif %}{% endif %}")
EOS = 2  # <|im_end|>


def write_thinker(path: Path) -> Path:
    tokens, types, merges = _bpe_vocab()
    think, end_think = len(tokens), len(tokens) + 1
    tokens, types = tokens + ["<think>", "</think>"], types + [4, 4]
    byte = lambda ch: 3 + ord(ch)  # noqa: E731 - the tiny vocabulary's byte tokens follow its 3 specials
    chain = [byte("\n"), think, byte("a"), byte("b"), end_think, byte("c"), byte("d"), EOS]
    hidden, ffn, heads, kv_heads, head_dim, vocab = 64, 64, 4, 2, 16, len(tokens)
    rng = np.random.default_rng(0)
    embed = (0.01 * rng.standard_normal((vocab, hidden))).astype(np.float32)
    head = np.zeros((vocab, hidden), np.float32)
    for i, (token, successor) in enumerate(zip(chain, chain[1:])):
        embed[token] = 0.0
        embed[token, i] = 1.0
        head[successor, i] = 10.0
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-thinker")
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    ones = np.ones(hidden, np.float32)
    w.add_tensor("token_embd.weight", embed)
    w.add_tensor("output.weight", head)
    w.add_tensor("output_norm.weight", ones)
    q, kv = heads * head_dim, kv_heads * head_dim
    for name, shape in (("attn_q", (q, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                        ("attn_output", (hidden, q)), ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                        ("ffn_down", (hidden, ffn))):
        w.add_tensor(f"blk.0.{name}.weight", np.zeros(shape, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", ones)
    w.add_tensor("blk.0.ffn_norm.weight", ones)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path

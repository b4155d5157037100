"""int4 weights (SmolLM2's Q4_1 blocks taken as int4 codes) through the decode path, against the reference:
teacher-forced top-1 agreement of at least 99%, and the mean KL from our fp32 reported."""

from __future__ import annotations

import torch

from nextoken.cache.kv_pool import KVPool, KVShape
from nextoken.loader.gguf import read_gguf
from nextoken.loader.registry import resolve_model
from nextoken.models import load_model
from nextoken.models.config import ModelConfig
from nextoken.ops.attention import AttentionMetadata
from nextoken.ops.quant_linear import Int4Linear
from tests.conftest import agreement_and_kl, load_reference


@torch.inference_mode()
def decode_logprobs(model: torch.nn.Module, cfg: ModelConfig, ids: list[int]) -> torch.Tensor:
    """Feed ids one per forward pass, as decode does (one row: the fused int4 kernel)."""
    num_blocks = -(-len(ids) // 16)
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32), num_blocks, 16,
                  torch.device("cpu"))
    table = torch.arange(num_blocks)[None]
    rows = []
    for i, token in enumerate(ids):
        meta = AttentionMetadata(torch.tensor([i]), [0, 1], [i + 1], table, 16)
        rows.append(model(torch.tensor([token]), torch.tensor([i]), pool.layers, meta))
    return torch.cat(rows).log_softmax(-1)


def test_smollm2_int4_decode_matches_reference() -> None:
    gguf = read_gguf(resolve_model("smollm2-135m-instruct"))
    cfg = ModelConfig.from_gguf(gguf)
    model = load_model(gguf, cfg, int4=True)
    assert isinstance(model.layers[0].mlp.gate_up_proj, Int4Linear)
    prompts = load_reference("smollm2", "hf_top5.json")["prompts"][:6]
    agreement, mean_kl = agreement_and_kl("smollm2", lambda ids: decode_logprobs(model, cfg, ids), prompts)
    print(f"smollm2 int4: top-1 agreement {agreement:.2%}, mean KL from fp32 {mean_kl:.2e} nats")
    assert agreement >= 0.99
    assert mean_kl < 0.01

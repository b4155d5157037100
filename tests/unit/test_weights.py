"""The loader keeps a model's weights in the file's own storage (loader/weights.py): nothing is decoded until the
quantization pass, and a module left as loaded computes what the fp32 format computes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from nextoken.cache.kv_pool import KVPool, KVShape
from nextoken.engine.model_loader import load_model
from nextoken.errors import ModelLoadError
from nextoken.loader.gguf import read_gguf
from nextoken.loader.weights import FileBacked, load_weights
from nextoken.models import CausalLM
from nextoken.models.config import ModelConfig
from nextoken.ops.attention import AttentionMetadata
from tests.tiny import write_tiny_model

_Q = GGMLQuantizationType
PARTIAL_ROTARY = {"llama.rope.dimension_count": ("uint32", 8)}  # half-split rotary: Q and K rows reordered


def loaded(path: Path) -> tuple[torch.nn.Module, ModelConfig]:
    gguf = read_gguf(path)
    config = ModelConfig.from_gguf(gguf)
    with torch.device("meta"):
        model = CausalLM(config)
    load_weights(model, gguf)
    return model, config


@torch.inference_mode()
def logits(model: torch.nn.Module, config: ModelConfig, ids: list[int]) -> torch.Tensor:
    pool = KVPool(KVShape(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32), 2, 16,
                  torch.device("cpu"))
    meta = AttentionMetadata(torch.arange(len(ids)), [0, len(ids)], [len(ids)], torch.arange(2)[None], 16)
    return model(torch.tensor(ids), torch.arange(len(ids)), pool.layers, meta)


@pytest.mark.parametrize(("arch", "qtype", "overrides"), [("llama", _Q.Q4_1, PARTIAL_ROTARY),
                                                          ("llama", _Q.Q8_0, None), ("gemma3", _Q.Q5_0, None)])
def test_weights_stay_in_the_file_until_the_pass(arch: str, qtype: GGMLQuantizationType, overrides: dict | None,
                                                 tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", arch, projections=qtype, table=_Q.Q8_0, overrides=overrides)
    model, config = loaded(path)
    held = [m for m in model.modules() if isinstance(m, FileBacked)]
    # Every matrix left undecoded (its module's parameters still on the meta device), the norms' vectors in fp32.
    assert {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, FileBacked)} == {
        "embed_tokens", "qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert all((p.device.type == "meta") == (p.dim() == 2) for p in model.parameters())
    for module in held:
        for tensors in module.tensors.values():
            assert all(not t.raw.flags.writeable and t.raw.base is not None for t in tensors)  # views of the map
    # Decoded on each call, the file's values run the fp32 format's math exactly.
    ids = [3, 17, 40, 5, 99, 12]
    assert torch.equal(logits(model, config, ids), logits(load_model(read_gguf(path), config), config, ids))


def test_codes_and_floats_agree_in_the_models_row_order(tmp_path: Path) -> None:
    """The architecture's row order applies alike to decoded values and to block codes."""
    path = write_tiny_model(tmp_path / "m.gguf", "llama", projections=_Q.Q8_0, overrides=PARTIAL_ROTARY)
    model, _ = loaded(path)
    q = model.layers[0].attn.qkv_proj.tensors["weight"][0]
    assert q.name.endswith("attn_q.weight") and q.row_order is not None
    assert not torch.equal(q.row_order, torch.arange(q.shape[0]))
    codes, scales = q.codes()
    assert torch.equal(codes.float() * scales.repeat_interleave(32, dim=1), q.floats())


def test_a_type_that_cannot_be_decoded_fails_the_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_model(tmp_path / "m.gguf", "llama", projections=_Q.Q8_0)
    gguf = read_gguf(path)
    info = gguf.tensors["blk.1.ffn_up.weight"]
    monkeypatch.setitem(gguf.tensors, info.name, type(info)(info.name, info.shape, _Q.IQ2_XXS, info.offset,
                                                            info.nbytes))
    config = ModelConfig.from_gguf(gguf)
    with torch.device("meta"):
        model = CausalLM(config)
    with pytest.raises(ModelLoadError, match="blk.1.ffn_up.weight: unsupported tensor type IQ2_XXS"):
        load_weights(model, gguf)
    assert np.frombuffer(gguf.raw("token_embd.weight"), np.uint8).size > 0

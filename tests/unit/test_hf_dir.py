"""Hugging Face model directories read as llama.cpp's converter would write them (nextoken/loader/hf.py).

Tiny random models are saved by transformers itself; the references are transformers (its forward pass, greedy
continuation, AutoTokenizer, chat template and RoPE factors) and the safetensors values, against which every layout
change of the view (Llama's Q/K permutation, GPT-2's transposes, stacked experts) is undone.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nextoken import LLM, SamplingParams
from nextoken.loader.text_side import load_text_side
from nextoken.errors import ModelLoadError
from nextoken.loader.codec import dequantize
from nextoken.loader.gguf import read_gguf
from nextoken.loader.hf import HFDirectory, read_hf_directory
from nextoken.loader.registry import resolve_model
from nextoken.models.config import ModelConfig
from nextoken.tokenizer.from_hf import read_hf_tokenizer
from nextoken.tokenizer.tokenizer import Tokenizer
from tests.tiny import SPECIALS_CHATML, _bpe_vocab

TEXTS = ["Hello, world! 12345", "<|im_start|>user\nWhat's 2+2?<|im_end|>\n", "naïve café, 日本語 🤗",
         "  spaces\tand\nnew lines  ", "<|im_end|><|endoftext|>x", "emoji 🚀🦙 and ZWJ 😶\u200d🌫️"]


# --- building directories ----------------------------------------------------------------------------------------

def smollm2_tokenizer(directory: Path, *, bos_by_post_processor: bool = False) -> None:
    """SmolLM2's tokenizer (from its packaged GGUF file) as a Hugging Face directory holds it: tokenizer.json,
    tokenizer_config.json, the chat template in chat_template.jinja, and generation_config.json with two EOS ids."""
    metadata = read_gguf(resolve_model("smollm2-135m-instruct")).metadata
    tok = Tokenizer.from_gguf(metadata)._hf
    byte_level = processors.ByteLevel(trim_offsets=False)
    tok.post_processor = processors.Sequence([byte_level, processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B", special_tokens=[("<|im_start|>", 1)])]) \
        if bos_by_post_processor else byte_level
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    (directory / "chat_template.jinja").write_text(metadata["tokenizer.chat_template"])
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))


def tiny_tokenizer(directory: Path) -> None:
    """A byte-level BPE of 269 tokens (tests/tiny.py's), for models of 300 embedding rows: ids 269..299 are padding."""
    tokens, _, merges = _bpe_vocab()
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS_CHATML])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


def save(model: Any, directory: Path, **kwargs: Any) -> Path:
    model.save_pretrained(directory, **kwargs)
    return directory


COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10_000.0}
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=LLAMA3_ROPE),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=32),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=24),
    "phi3": lambda: transformers.Phi3Config(**COMMON, pad_token_id=0, original_max_position_embeddings=64,
                                            rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0,
                                                             "long_factor": [1.0 + i / 4 for i in range(8)],
                                                             "short_factor": [1.0 + i / 16 for i in range(8)]}),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                            bos_token_id=0, eos_token_id=0),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "gemma3_text": lambda: gemma3_config(num_hidden_layers=2),
}


def gemma3_config(**changes: Any) -> Any:
    """A tiny Gemma 3 whose query scale is 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim), as nextoken's
    Gemma 3 takes it."""
    values = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=7, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=512,
                  sliding_window=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return transformers.Gemma3TextConfig(**{**values, **changes})
# Each type's block tensors under llama.cpp's names, as its converter writes them.
_ATTN = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
         "ffn_norm.weight"}
_MLP = {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}
_EXPERTS = {"ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"}
_BIASES = {"attn_q.bias", "attn_k.bias", "attn_v.bias"}
BLOCK_TENSORS = {
    "llama": _ATTN | _MLP, "mistral": _ATTN | _MLP, "mixtral": _ATTN | _EXPERTS,
    "qwen2": _ATTN | _MLP | _BIASES, "qwen3": _ATTN | _MLP | {"attn_q_norm.weight", "attn_k_norm.weight"},
    "qwen2_moe": _ATTN | _EXPERTS | _BIASES | {"ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                                              "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight"},
    "phi3": {"attn_norm.weight", "attn_qkv.weight", "attn_output.weight", "ffn_norm.weight", "ffn_up.weight",
             "ffn_down.weight"},
    "gpt2": {f"{t}.{p}" for t in ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
             for p in ("weight", "bias")},
    "gemma3_text": _ATTN | _MLP | {"attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight",
                                   "post_ffw_norm.weight"},
}
GLOBAL_TENSORS = {"gpt2": {"token_embd.weight", "position_embd.weight", "output_norm.weight", "output_norm.bias"},
                  "phi3": {"token_embd.weight", "output_norm.weight", "output.weight", "rope_factors_long.weight",
                           "rope_factors_short.weight"},
                  "llama": {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"},
                  "gemma3_text": {"token_embd.weight", "output_norm.weight"}}


@pytest.fixture(scope="module")
def views(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """model_type -> (its directory, its transformers config), random fp32 weights."""
    torch.manual_seed(0)
    out = {}
    for model_type, make in CONFIGS.items():
        directory = tmp_path_factory.mktemp(model_type)
        config = make()
        save(AutoModelForCausalLM.from_config(config), directory)
        tiny_tokenizer(directory)
        out[model_type] = (directory, config)
    return out


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A two-layer Llama with SmolLM2's tokenizer (so a real vocabulary), and its transformers model."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.05, bos_token_id=1, eos_token_id=2,
                                      tie_word_embeddings=False, attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(config).eval()
    directory = save(model, tmp_path_factory.mktemp("tiny-llama"))
    smollm2_tokenizer(directory)
    return directory, model


# --- the view: names, layouts, metadata ----------------------------------------------------------------------------

def undo(model_type: str, name: str, values: torch.Tensor, config: Any) -> list[torch.Tensor]:
    """The Hugging Face tensors a GGUF tensor was made from: llama.cpp's layout change inverted, written apart from
    the loader (a permutation's inverse, a transpose, the experts unstacked)."""
    if name.endswith(("_exps.weight",)):
        return list(values)
    if model_type == "gpt2" and name.endswith(("attn_qkv.weight", "attn_output.weight", "ffn_up.weight",
                                               "ffn_down.weight")):
        return [values.t()]
    if model_type in ("llama", "mistral", "mixtral") and name.split(".")[-2] in ("attn_q", "attn_k"):
        heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
        rows = values.shape[0]
        return [values.reshape(heads, rows // heads // 2, 2, *values.shape[1:]).transpose(1, 2).reshape(
            values.shape)]
    return [values]


def redo(model_type: str, name: str, stored: torch.Tensor) -> torch.Tensor:
    """What llama.cpp makes of a stored tensor beyond its layout: Gemma's norms hold 1 + w, and its token table only
    the tokenizer's rows (tiny_tokenizer's 269 and its 3 added tokens, counted as llama.cpp counts them)."""
    if model_type == "gemma3_text" and name.endswith("norm.weight"):
        return stored.float() + 1
    if model_type == "gemma3_text" and name == "token_embd.weight":
        return stored[:272]
    return stored


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_view_names_layouts_and_values(views: dict, model_type: str) -> None:
    directory, config = views[model_type]
    view = read_hf_directory(directory)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    # Every stored tensor makes exactly one GGUF tensor, under llama.cpp's names.
    used = [n for names in view.sources.values() for n in names]
    assert sorted(used) == sorted(stored)
    want = {f"blk.{i}.{t}" for i in range(2) for t in BLOCK_TENSORS[model_type]}  # every view model has 2 layers
    want |= GLOBAL_TENSORS.get(model_type, {"token_embd.weight", "output_norm.weight", "output.weight"})
    assert set(view.tensors) == want
    for name, info in view.tensors.items():
        raw = view.raw(name)
        assert raw.nbytes == info.nbytes and not raw.flags.writeable
        values = dequantize(raw, info.qtype, info.shape)
        assert tuple(values.shape) == info.shape
        if not view.sources[name]:
            continue  # computed from config.json: checked below
        originals = undo(model_type, name, values, config)
        assert len(originals) == len(view.sources[name])
        for original, hf_name in zip(originals, view.sources[name]):
            assert torch.equal(original, redo(model_type, name, stored[hf_name]).float()), f"{name} <- {hf_name}"


def _expected_metadata(model_type: str, c: Any) -> dict[str, Any]:
    """The {arch}.* keys llama.cpp's converter writes for this config, from the config's own attributes."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731 - GGUF holds floats as float32
    if model_type == "gpt2":
        return {"gpt2.block_count": c.n_layer, "gpt2.context_length": c.n_positions, "gpt2.embedding_length": c.n_embd,
                "gpt2.feed_forward_length": 4 * c.n_embd, "gpt2.attention.head_count": c.n_head,
                "gpt2.attention.layer_norm_epsilon": f32(c.layer_norm_epsilon)}
    arch = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2_moe": "qwen2moe",
            "gemma3_text": "gemma3"}.get(model_type, model_type)
    md = {f"{arch}.{k}": v for k, v in {
        "block_count": c.num_hidden_layers, "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size, "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads, "attention.head_count_kv": c.num_key_value_heads,
        "rope.freq_base": f32(c.rope_parameters.get("full_attention", c.rope_parameters)["rope_theta"]),
        "attention.layer_norm_rms_epsilon": f32(c.rms_norm_eps),
    }.items()}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch == "llama":
        md |= {"llama.vocab_size": c.vocab_size, "llama.rope.dimension_count": head_dim}
    if model_type == "mistral":
        md["llama.attention.sliding_window"] = c.sliding_window
    if model_type in ("mixtral", "qwen2_moe"):
        md |= {f"{arch}.expert_count": 4, f"{arch}.expert_used_count": c.num_experts_per_tok}
    if model_type == "qwen2_moe":
        md |= {"qwen2moe.expert_feed_forward_length": c.moe_intermediate_size,
               "qwen2moe.expert_shared_feed_forward_length": c.shared_expert_intermediate_size}
    if model_type in ("qwen3", "gemma3_text"):
        md |= {f"{arch}.attention.key_length": c.head_dim, f"{arch}.attention.value_length": c.head_dim}
    if model_type == "gemma3_text":
        md |= {"gemma3.rope.freq_base_swa": c.rope_parameters["sliding_attention"]["rope_theta"],
               "gemma3.attention.sliding_window": c.sliding_window,
               "gemma3.attention.sliding_window_pattern": [t == "sliding_attention" for t in c.layer_types]}
    if model_type == "phi3":
        original = c.rope_parameters.get("original_max_position_embeddings", c.original_max_position_embeddings)
        scale = c.max_position_embeddings / original
        md |= {"phi3.rope.dimension_count": head_dim, "phi3.attention.sliding_window": 0,
               "phi3.rope.scaling.original_context_length": original,
               "phi3.rope.scaling.attn_factor": f32(math.sqrt(1 + math.log(scale) / math.log(original)))}
    return md


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_view_metadata(views: dict, model_type: str) -> None:
    directory, config = views[model_type]
    md = read_hf_directory(directory).metadata
    for key, value in _expected_metadata(model_type, config).items():
        assert md.get(key) == pytest.approx(value), key
    assert md["general.file_type"] == 0  # all F32
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "gpt-2"
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    num = 272 if model_type == "gemma3_text" else 300  # Gemma 3: the tokenizer's ids alone (llama.cpp's count)
    assert len(tokens) == len(types) == num and tokens[-1] == f"[PAD{num - 1}]" and types[-1] == 5
    assert [types[i] for i in range(3)] == [3, 3, 3] and md["tokenizer.ggml.merges"][0] == "Ġ t"
    assert md["tokenizer.ggml.eos_token_id"] == 2


def test_llama3_rope_freqs_match_transformers(views: dict) -> None:
    directory, config = views["llama"]
    view = read_hf_directory(directory)
    factors = dequantize(view.raw("rope_freqs.weight"), view.tensors["rope_freqs.weight"].qtype, (8,))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    base = 1.0 / (10_000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.allclose(factors, base / scaled, rtol=1e-5)
    assert factors[0] == 1 and factors[-1] == 8 and 1 < factors[1] < 8  # both bands and the blend between


def test_phi3_longrope_factors(views: dict) -> None:
    directory, config = views["phi3"]
    view = read_hf_directory(directory)
    for which in ("long", "short"):
        name = f"rope_factors_{which}.weight"
        values = dequantize(view.raw(name), view.tensors[name].qtype, view.tensors[name].shape)
        assert values.tolist() == config.rope_parameters[f"{which}_factor"]


def test_bf16_directory_keeps_bf16_matrices(views: dict, tmp_path: Path) -> None:
    source, _ = views["qwen2"]
    model = AutoModelForCausalLM.from_pretrained(source).to(torch.bfloat16)
    directory = save(model, tmp_path / "bf16")
    tiny_tokenizer(directory)
    view = read_hf_directory(directory)
    qtypes = {name: info.qtype.name for name, info in view.tensors.items()}
    assert qtypes["blk.0.attn_q.weight"] == qtypes["token_embd.weight"] == "BF16"
    assert qtypes["blk.0.attn_norm.weight"] == qtypes["blk.0.attn_q.bias"] == "F32"  # vectors: F32, as llama.cpp
    assert view.metadata["general.file_type"] == 32
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        for name in ("blk.1.ffn_down.weight", "blk.1.attn_k.bias"):
            stored = f.get_tensor(view.sources[name][0])
            assert torch.equal(dequantize(view.raw(name), view.tensors[name].qtype, view.tensors[name].shape),
                               stored.float())


def test_sharded_directory_reads_the_same(views: dict, tmp_path: Path) -> None:
    source, _ = views["mixtral"]
    directory = save(AutoModelForCausalLM.from_pretrained(source), tmp_path / "sharded", max_shard_size="20KB")
    tiny_tokenizer(directory)
    assert (directory / "model.safetensors.index.json").is_file()
    whole, sharded = read_hf_directory(source), read_hf_directory(directory)
    assert len(list(directory.glob("model-*.safetensors"))) > 3
    assert whole.tensors == sharded.tensors
    for name in whole.tensors:
        assert np.array_equal(whole.raw(name), sharded.raw(name)), name


# --- a Llama directory through the engine -------------------------------------------------------------------------

def test_llama_directory_matches_transformers(tiny_llama: tuple[Path, Any]) -> None:
    directory, model = tiny_llama
    llm = LLM(str(directory), dtype="float32", kv_cache_bytes=16 << 20)
    ids = llm.encode("The quick brown fox jumps over the lazy dog. Über 9000 éclairs, 日本!")
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    ours = llm.engine.runner.score(ids).log_softmax(-1)
    assert (ours - reference).abs().max() < 1e-4
    # Greedy: the reference's argmax at each step, over the whole sequence.
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    seq = list(ids)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out.token_ids == seq[len(ids):]


def test_gemma3_directory_matches_transformers(tmp_path: Path) -> None:
    """Seven layers (one global), a 16-token window and a longer prompt: Gemma's norms, local RoPE and window."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gemma3_config(initializer_range=0.05),
                                             attn_implementation="eager").eval()
    directory = save(model, tmp_path / "gemma3")
    tiny_tokenizer(directory)
    llm = LLM(str(directory), dtype="float32", kv_cache_bytes=16 << 20)
    ids = llm.encode("the then there at on in en er sat the hen the at then ether " * 2)
    assert len(ids) > 40
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0, :, :272]  # the rows llama.cpp keeps
    assert (llm.engine.runner.score(ids) - reference).abs().max() < 1e-4
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    seq = list(ids)
    with torch.no_grad():
        for _ in range(8):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1, :272].argmax()))
    assert out.token_ids == seq[len(ids):]


@pytest.mark.parametrize(("weights", "max_kl"), [("bf16", 1e-4), ("int8", 1e-3), ("int4", 1e-2)])
def test_llama_directory_runs_requantized(tiny_llama: tuple[Path, Any], weights: str, max_kl: float) -> None:
    """The float32 directory's projections made bf16, int8 or int4 at load (measured KL: 1.7e-6, 1.7e-5, 1.6e-3)."""
    directory, model = tiny_llama
    llm = LLM(str(directory), weights=weights, kv_cache_bytes=16 << 20)
    assert llm.engine.runner.weights == weights
    ids = llm.encode("Hello there, how are you today?")
    with torch.no_grad():
        reference = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    ours = llm.engine.runner.score(ids).log_softmax(-1)
    assert float((reference.exp() * (reference - ours)).sum(-1).mean()) < max_kl
    assert len(llm.generate(["Hi"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].token_ids) == 4


def smollm2_with_tool_token(directory: Path, bos: bool = False, tool_id: int = 49152) -> None:
    """SmolLM2's tokenizer and "<|tool|>" at `tool_id`: an added token the file does not mark special but that looks
    special (so control, as llama.cpp types it)."""
    smollm2_tokenizer(directory, bos_by_post_processor=bos)
    tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_tokens([AddedToken("<|tool|>", special=False, normalized=False)])
    data = json.loads(tok.to_str())
    data["added_tokens"][-1]["id"] = tool_id
    (directory / "tokenizer.json").write_text(json.dumps(data))


@pytest.mark.parametrize("bos", [False, True])
def test_tokenizer_matches_transformers(tmp_path: Path, bos: bool) -> None:
    tool_id = 49152
    smollm2_with_tool_token(tmp_path, bos, tool_id)
    files = read_hf_tokenizer(tmp_path, {}, 49160)  # 49153 tokens, padded to 49160 embedding rows
    ours = Tokenizer.from_hf(files.spec, files.json_text)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    assert ours.add_bos is bos and ours.vocab_size == 49160
    for text in [*TEXTS, "call <|tool|> now"]:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids), text
        if "<|tool|>" not in text:  # a control token to nextoken, skipped; an ordinary added one to transformers
            assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.special_ids >= {0, 1, 2, tool_id} and files.spec.types[49159] == 5 and ours.encode("<|tool|>") == [
        *([1] if bos else []), tool_id]
    # Untrusted text never becomes a control token.
    for text in ("<|im_start|>", "<|tool|>"):
        plain = ours.encode(text, add_special_tokens=False, plain_spans=[(0, len(text))])
        assert len(plain) > 1 and not set(plain) & ours.special_ids


def test_sentencepiece_style_tokenizer_matches_transformers(tiny_gemma: Path, tmp_path: Path) -> None:
    """A Llama 2 / Mistral style tokenizer.json (BPE with byte fallback, "▁" for spaces, one prepended, BOS added
    by the post-processor), from tests/tiny.py's SentencePiece vocabulary."""
    metadata = {**read_gguf(tiny_gemma).metadata, "tokenizer.ggml.add_space_prefix": True}
    tok = Tokenizer.from_gguf(metadata)._hf
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 2)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "unk_token": "<unk>"}))
    num_tokens = len(metadata["tokenizer.ggml.tokens"])
    files = read_hf_tokenizer(tmp_path, {}, num_tokens)
    assert files.metadata["tokenizer.ggml.model"] == "llama" and files.spec.add_space_prefix
    assert files.spec.types[files.spec.token_index["<0x41>"]] == 6  # byte tokens typed as llama.cpp types them
    ours = Tokenizer.from_hf(files.spec, files.json_text)
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    for text in ["the hen sat on a mat", " the  then", "naïve 日本 🤗", "<start_of_turn>user\nhe<end_of_turn>"]:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids and ids[0] == 2, text
        assert ours.decode(ids[1:]) == theirs.decode(ids[1:]), text


def test_added_token_ids_the_library_would_move_are_refused(tmp_path: Path) -> None:
    smollm2_with_tool_token(tmp_path, tool_id=49157)  # past a gap: the tokenizers library would make it 49152
    files = read_hf_tokenizer(tmp_path, {}, 49160)
    with pytest.raises(ModelLoadError) as info:
        Tokenizer.from_hf(files.spec, files.json_text)
    assert info.value.path == str(tmp_path / "tokenizer.json") and "49157" in info.value.reason


def test_chat_template_and_eos_come_from_the_directory(tiny_llama: tuple[Path, Any]) -> None:
    directory, _ = tiny_llama
    view = read_hf_directory(directory)
    config = ModelConfig.from_gguf(view)
    assert config.eos_id == 2 and config.bos_id == 1
    assert set(config.eog_ids) >= {0, 2}  # tokenizer_config's EOS and generation_config's list
    tokenizer, template = load_text_side(view, config)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reference = AutoTokenizer.from_pretrained(directory).apply_chat_template(messages, tokenize=False,
                                                                             add_generation_prompt=True)
    assert template.render(messages, add_generation_prompt=True) == reference


# --- errors --------------------------------------------------------------------------------------------------------

def _broken(views: dict, tmp_path: Path, model_type: str = "llama") -> Path:
    directory = tmp_path / "model"
    shutil.copytree(views[model_type][0], directory)
    return directory


def _edit_config(directory: Path, **changes: Any) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:24] = b"\xff" * 16  # inside the JSON header
    path.write_bytes(bytes(data))


def _pickle_only(directory: Path) -> None:
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")


ERRORS = {
    "missing config.json": (lambda d: (d / "config.json").unlink(), "config.json", "missing"),
    "truncated safetensors": (lambda d: _truncate(d / "model.safetensors"), "model.safetensors", "safetensors"),
    "corrupt safetensors": (lambda d: _corrupt(d / "model.safetensors"), "model.safetensors", "safetensors"),
    "shape against config.json": (lambda d: _edit_config(d, intermediate_size=96), "model.safetensors",
                                  "config.json gives"),
    "unknown model_type": (lambda d: _edit_config(d, model_type="bert"), "config.json", "model_type 'bert'"),
    "pickle weights only": (_pickle_only, "pytorch_model.bin", "pickle"),
    "missing tokenizer.json": (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json", "missing"),
    "EOS outside the vocabulary": (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": [2, 999]}'),
                                   "generation_config.json", "999"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_name_the_file(views: dict, tmp_path: Path, case: str) -> None:
    directory = _broken(views, tmp_path)
    damage, file, words = ERRORS[case]
    damage(directory)
    with pytest.raises(ModelLoadError) as info:
        read_hf_directory(directory)
    assert info.value.path == str(directory / file) and words in str(info.value), str(info.value)


def test_missing_shard_names_the_shard(views: dict, tmp_path: Path) -> None:
    directory = save(AutoModelForCausalLM.from_pretrained(views["llama"][0]), tmp_path / "s", max_shard_size="20KB")
    tiny_tokenizer(directory)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError) as info:
        read_hf_directory(directory)
    assert info.value.path == str(shard) and "index" in info.value.reason


def test_cli_bad_directory_is_one_line(views: dict, tmp_path: Path) -> None:
    directory = _broken(views, tmp_path)
    (directory / "config.json").unlink()
    out = subprocess.run([sys.executable, "-m", "nextoken", "run", "--model", str(directory), "hi"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0 and str(directory / "config.json") in out.stderr


def test_directory_is_a_model_path(views: dict) -> None:
    directory, _ = views["llama"]
    assert resolve_model(str(directory)) == directory
    assert isinstance(read_hf_directory(directory), HFDirectory)

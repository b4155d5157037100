"""CUDA graph decode steps (engine/graphs.py), without a GPU: the padded, fixed-shape step a graph records runs
eagerly here (`capture=False`) and is held to the normal path: the same logits and cache contents for a decode
batch padded to its row and width buckets (tiny Llama and Gemma 3, every KV format, across Gemma's sliding window),
and the same greedy tokens through the engine while the batch shrinks through the buckets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nextoken import LLM, SamplingParams
from nextoken.cache.kv_pool import KV_DTYPES, KVPool, KVShape
from nextoken.engine.batch import ForwardBatch
from nextoken.engine.graphs import DecodeGraphs, bucket, width_buckets
from nextoken.engine.model_loader import load_model
from nextoken.loader.gguf import read_gguf
from nextoken.models.config import ModelConfig
from nextoken.ops.attention import AttentionMetadata

BLOCK = 4
CONTEXTS = [3, 9, 21]  # Gemma's tiny window is 8: the longest reaches past it

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (scripts/device_check.sh)")


def test_buckets() -> None:
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert width_buckets(3) == (3,) and width_buckets(20) == (4, 8, 16, 20) and width_buckets(16) == (4, 8, 16)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("arch", ["llama", "gemma"])
@torch.inference_mode()
def test_padded_static_step_matches_the_model(arch: str, kv_dtype: str, device: str, tiny_llama: Path,
                                              tiny_gemma: Path) -> None:
    """On CPU the padded step runs eagerly; on a GPU it is captured and replayed, against eager steps there."""
    dev = torch.device(device)
    gguf = read_gguf(tiny_llama if arch == "llama" else tiny_gemma)
    cfg = ModelConfig.from_gguf(gguf)
    net = load_model(gguf, cfg, device=dev)
    per_seq = 8  # blocks per sequence: sequence s owns blocks 8s..8s+7
    pad = per_seq * len(CONTEXTS)  # the block after them
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, KV_DTYPES[kv_dtype]), pad + 1, BLOCK, dev)
    graphs = DecodeGraphs(net, pool.layers, BLOCK, pad_block=pad, max_blocks=per_seq, max_rows=8,
                          max_model_len=per_seq * BLOCK, device=dev, capture=device == "cuda")
    gen = torch.Generator().manual_seed(3)
    for s, length in enumerate(CONTEXTS):  # prefill through the modules
        ids = torch.randint(3, cfg.vocab_size, (length,), generator=gen).to(dev)
        table = torch.arange(per_seq * s, per_seq * (s + 1))
        meta = AttentionMetadata((table[torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK).to(dev),
                                 [0, length], [length], table[None].to(dev), BLOCK)
        net(ids, torch.arange(length, device=dev), pool.layers, meta)
    lengths = list(CONTEXTS)
    for _ in range(3):
        n = len(lengths)
        tokens = torch.randint(3, cfg.vocab_size, (n,), generator=gen).to(dev)
        used = max(-(-(length + 1) // BLOCK) for length in lengths)  # the batch's table width, in blocks
        tables = torch.stack([torch.arange(per_seq * s, per_seq * s + used) for s in range(n)])
        slots = torch.tensor([tables[s, length // BLOCK] * BLOCK + length % BLOCK for s, length in enumerate(lengths)])
        meta = AttentionMetadata(slots.to(dev), list(range(n + 1)), [length + 1 for length in lengths], tables.to(dev),
                                 BLOCK)
        twin = KVPool(pool.shape, pool.num_blocks, BLOCK, dev)
        for mine, other in zip(pool.layers, twin.layers):
            for name in ("k", "v", "k_scale", "v_scale"):
                if getattr(mine, name) is not None:
                    getattr(other, name).copy_(getattr(mine, name))
        positions = torch.tensor(lengths, device=dev)
        expected = net(tokens, positions, twin.layers, meta)
        batch = ForwardBatch(tokens, positions, meta, torch.arange(n, device=dev), list(range(n)), [None] * n)
        got = graphs.run(batch)
        assert got is not None and got.shape == expected.shape
        # The two attend differently (masked SDPA, the native kernel), so later layers' new K/V differ in their last
        # bits, and a narrow cache may round one of them to its neighbour: one bf16 step moves a tiny model's logits
        # by up to about 1e-3.
        tol = 1e-4 if kv_dtype == "fp32" else 2e-3
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
        for mine, other in zip(pool.layers, twin.layers):
            for name in ("k", "v", "k_scale", "v_scale"):
                if getattr(mine, name) is not None:  # every real block as the normal path left it (layers past
                    # the first see hidden states from another attention kernel: the last bits, an int8 code by one)
                    a, b = getattr(mine, name)[:pad].float(), getattr(other, name)[:pad].float()
                    codes = getattr(mine, name).dtype == torch.int8
                    torch.testing.assert_close(a, b, rtol=0 if codes else 1e-2, atol=1 if codes else 1e-4)
        lengths = [length + 1 for length in lengths]
    assert set(graphs.steps) == {(4, 8)}  # 3 rows padded to 4; widths 6 and 7 blocks to 8
    assert all(step is not None and (step.graph is not None) == (device == "cuda") for step in graphs.steps.values())


@torch.inference_mode()
def test_steps_that_are_not_pure_decode_are_left_to_the_model(tiny_llama: Path) -> None:
    gguf = read_gguf(tiny_llama)
    cfg = ModelConfig.from_gguf(gguf)
    net = load_model(gguf, cfg)
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32), 5, BLOCK,
                  torch.device("cpu"))
    graphs = DecodeGraphs(net, pool.layers, BLOCK, pad_block=4, max_blocks=4, max_rows=2, max_model_len=16,
                          device=torch.device("cpu"), capture=False)
    table = torch.arange(4)[None]
    prefill = AttentionMetadata(torch.arange(3), [0, 3], [3], table, BLOCK)
    assert graphs.run(ForwardBatch(torch.ones(3, dtype=torch.long), torch.arange(3), prefill, torch.tensor([2]),
                                   [0], [None])) is None
    decode = AttentionMetadata(torch.tensor([3]), [0, 1], [4], table, BLOCK)
    with_prompt_logprobs = ForwardBatch(torch.ones(1, dtype=torch.long), torch.tensor([3]), decode,
                                        torch.tensor([0]), [0], [(0, 1, 3)])
    assert graphs.run(with_prompt_logprobs) is None
    three = AttentionMetadata(torch.tensor([3, 7, 11]), [0, 1, 2, 3], [4, 4, 4], torch.arange(3)[:, None], BLOCK)
    assert graphs.run(ForwardBatch(torch.ones(3, dtype=torch.long), torch.full((3,), 3), three, torch.arange(3),
                                   [0, 1, 2], [None] * 3)) is None  # more rows than the largest bucket
    assert not graphs.steps


# Greedy requests of different lengths (6, 11, 16, 21, 26 tokens): as they finish, a batch shrinks through the buckets.
PROMPTS = [[5 + i, 9, 17 + 2 * i, 33] * (1 + i) for i in range(5)]
PARAMS = [SamplingParams(temperature=0, max_tokens=6 + 5 * i, ignore_eos=True) for i in range(5)]


def generate(llm: LLM) -> list[list[int]]:
    """PROMPTS through the engine, all added at once: each request's tokens."""
    ids = [llm.engine.add_request(prompt, p) for prompt, p in zip(PROMPTS, PARAMS)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while llm.engine.has_unfinished():
        for out in llm.engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


def test_engine_tokens_are_the_same_through_the_padded_steps(tiny_gemma: Path) -> None:
    """Greedy requests of different lengths: as they finish the batch shrinks through the row buckets (5 -> 8,
    4, 2, 1 rows) and the tables grow through the widths; every token is the one the normal path gives."""
    plain = LLM(str(tiny_gemma), dtype="float32", device="cpu", kv_cache_bytes=8 << 20, enable_prefix_caching=False)
    expected = generate(plain)
    assert [len(t) for t in expected] == [6, 11, 16, 21, 26]
    llm = LLM(str(tiny_gemma), dtype="float32", device="cpu", kv_cache_bytes=8 << 20, enable_prefix_caching=False)
    runner = llm.engine.runner
    for layer in runner.kv_pool.layers:  # as the runner fills a pool for graphs (this CPU pool skipped it)
        layer.k.zero_()
        layer.v.zero_()
    pad = runner.num_blocks - 1  # not handed out by so small a workload (checked below)
    runner.graphs = DecodeGraphs(runner.model, runner.kv_pool.layers, runner.block_size, pad_block=pad,
                                 max_blocks=16, max_rows=8, max_model_len=16 * runner.block_size,
                                 device=torch.device("cpu"), capture=False)
    seen: list[tuple[int, int]] = []
    real_run = runner.graphs.run

    def run(batch: ForwardBatch) -> torch.Tensor | None:
        assert not (batch.attn.block_tables == pad).any()
        out = real_run(batch)
        if out is not None:
            seen.append((batch.attn.num_seqs, batch.attn.block_tables.shape[1]))
        return out

    runner.graphs.run = run  # type: ignore[method-assign]
    assert generate(llm) == expected
    assert {rows for rows, _ in seen} == {5, 4, 3, 2, 1}
    assert set(runner.graphs.steps) >= {(8, 4), (4, 4), (2, 4), (1, 4)}


@cuda
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_captured_steps_give_the_eager_tokens_on_cuda(arch: str, tiny_llama: Path, tiny_gemma: Path) -> None:
    """On a GPU: greedy tokens with decode steps replayed from CUDA graphs equal those of eager steps while the
    batch shrinks through the buckets; the graphs were captured, not skipped. (fp32: with bf16 weights, different
    attention kernels could flip a near-tied token of these random models; the logits test covers bf16 KV.)"""
    path = str(tiny_llama if arch == "llama" else tiny_gemma)
    eager = LLM(path, dtype="float32", device="cuda", kv_cache_bytes=8 << 20, cuda_graphs=False)
    graphs = LLM(path, dtype="float32", device="cuda", kv_cache_bytes=8 << 20)
    assert eager.engine.runner.graphs is None and graphs.engine.runner.graphs is not None
    assert generate(graphs) == generate(eager)
    captured = graphs.engine.runner.graphs.steps
    assert captured and all(step is not None and step.graph is not None for step in captured.values())

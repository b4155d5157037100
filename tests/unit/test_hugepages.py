"""The weights a decode step reads are moved onto huge pages at load: copies equal to the originals, shared tensors
kept shared, every block tensor of the loaded model inside one advised arena, and (where the kernel has transparent
huge pages for advised memory) that arena backed by 2 MB pages."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from nextoken import LLM, SamplingParams
from nextoken.ops.hugepages import ALIGN, gather
from nextoken.ops.quant_head import BlockEmbedding, Int8GroupHead
from nextoken.ops.quant_linear import BlockLinear
from tests.tiny import write_tiny_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_for_advised_memory() -> bool:
    """Whether this kernel gives huge pages to memory advised for them ([always] or [madvise])."""
    return THP.exists() and re.search(r"\[(always|madvise)\]", THP.read_text()) is not None


def anon_huge_bytes(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head[1], 16) <= address < int(head[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_gather_copies_aligned_and_shared() -> None:
    a = torch.randint(-128, 128, (300, 7), dtype=torch.int8)
    b = torch.randn(5, 3).half()
    c = torch.randn(1000)
    copies = gather([a, b, a, c])
    assert len(copies) == 3  # `a` twice: one copy
    for original in (a, b, c):
        copy = copies[id(original)]
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original)
        assert copy.data_ptr() % ALIGN == 0 and copy.data_ptr() != original.data_ptr()
    starts = sorted(t.data_ptr() for t in copies.values())
    assert starts[-1] - starts[0] < 4096  # one arena
    assert gather([]) == {}
    with pytest.raises(ValueError, match="contiguous CPU tensors"):
        gather([c[::2]])


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads Linux's /proc/self/smaps")
def test_gathered_arena_is_on_huge_pages_where_the_kernel_has_them() -> None:
    big = torch.randint(-128, 128, (6 << 20,), dtype=torch.int8)
    copy = gather([big])[id(big)]
    huge = anon_huge_bytes(copy.data_ptr())
    if thp_for_advised_memory():
        assert huge >= 4 << 20  # 6 MB from a 2 MB boundary: at least two whole huge pages
    assert torch.equal(copy, big)


def block_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    tensors = []
    for module in model.modules():
        if isinstance(module, BlockLinear):
            tensors += [t for p in module.parts for t in (p.qs, p.d, p.m) if t is not None]
        elif isinstance(module, Int8GroupHead):
            tensors += [module.blocks.qs, module.blocks.d]
        elif isinstance(module, BlockEmbedding):
            tensors += [module.codes, module.scales]
    return tensors


def test_loaded_model_blocks_move_into_one_arena_between_steps(tmp_path: Path) -> None:
    """The move runs in the background from load, and is applied by the first step after it is ready: every block
    tensor then lies in one arena, the tied head still reads the table's own codes, the fused decoder points at the
    copies, and greedy decoding gives the same tokens as before the move."""
    path = write_tiny_model(tmp_path / "tiny-gemma3-q8-table.gguf", "gemma3", projections=GGMLQuantizationType.Q5_0,
                            table=GGMLQuantizationType.Q8_0)
    llm = LLM(str(path), weights="int4", device="cpu", kv_cache_bytes=8 << 20)
    runner = llm.engine.runner
    model = runner.model
    assert any(isinstance(m, BlockEmbedding) for m in model.modules())  # the Q8_0 table, kept in its blocks
    before = {t.data_ptr() for t in block_tensors(model)}
    move = runner.huge_pages
    assert move is not None and move.bytes > 0
    params = SamplingParams(temperature=0, max_tokens=8)
    while not move.ready:  # steps before the copies are ready run on the originals
        time.sleep(0.01)
    expected = llm.generate("the cat sat", params, use_tqdm=False)[0].token_ids  # its first step applies the move
    assert runner.huge_pages is None
    tensors = block_tensors(model)
    starts = sorted(t.data_ptr() for t in tensors)
    assert not before & set(starts)
    assert all(s % ALIGN == 0 for s in starts)
    ends = max(t.data_ptr() + t.nbytes for t in tensors)
    assert ends - starts[0] <= sum(-(-t.nbytes // ALIGN) * ALIGN for t in {id(t): t for t in tensors}.values())
    assert model.quantized_head.blocks.qs.data_ptr() == model.embed_tokens.codes.data_ptr()
    assert model.fused.layers[0].qkv.parts[0].qs == model.layers[0].attn.qkv_proj.parts[0].qs.data_ptr()
    assert llm.generate("the cat sat", params, use_tqdm=False)[0].token_ids == expected


def test_decoding_is_the_same_before_and_after_the_move(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "tiny-llama-q4.gguf", "llama", projections=GGMLQuantizationType.Q4_0,
                            table=GGMLQuantizationType.Q8_0)
    llm = LLM(str(path), weights="int4", device="cpu", kv_cache_bytes=8 << 20)
    runner = llm.engine.runner
    move, runner.huge_pages = runner.huge_pages, None  # held back: these steps run on the originals
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    before = llm.generate(["the cat sat", "a dog"], params, use_tqdm=False)
    runner.huge_pages = move
    runner.settle()
    assert runner.huge_pages is None and move.applied
    after = llm.generate(["the cat sat", "a dog"], params, use_tqdm=False)
    for a, b in zip(before, after):
        assert a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs

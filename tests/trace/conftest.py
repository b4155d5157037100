"""Fixtures for the tracer's tests: tiny-model LLMs shared per module, run on one CPU thread: fp32 ones (the module
path, whose candidates a dense recomputation reproduces bit for bit) and ones on the fused paths (int4 projections and
a Q8_0 token table: the prompt's blocks in one native call where the CPU has AVX-512, every decode step in one).

One thread because CI machines here have two cores shared with other jobs: with two OpenMP threads every small op
waits for a descheduled partner, and the tiny models run ten times slower (measured), which the timing tests only
make noisier. The setting is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType

from nextoken import LLM
from tests.tiny import write_tiny_model


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_llm(path: Path) -> LLM:
    # No prefix caching: a traced run after an untraced one must compute the whole prompt again.
    # fp32 weights: the tests compare traced candidates with a dense recomputation (score), bit for bit.
    return LLM(str(path), weights="fp32", device="cpu", kv_cache_bytes=4 << 20, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def llama_llm(tiny_llama: Path) -> LLM:
    return make_llm(tiny_llama)


@pytest.fixture(scope="module")
def gemma_llm(tiny_gemma: Path) -> LLM:
    return make_llm(tiny_gemma)


def make_fused_llm(path: Path) -> LLM:
    return LLM(str(path), weights="int4", device="cpu", kv_cache_bytes=4 << 20, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def q8_llama_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return make_fused_llm(write_tiny_model(tmp_path_factory.mktemp("q8") / "tiny-llama-q8.gguf", "llama",
                                           table=GGMLQuantizationType.Q8_0))


@pytest.fixture(scope="module")
def q8_gemma_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return make_fused_llm(write_tiny_model(tmp_path_factory.mktemp("q8") / "tiny-gemma3-q8.gguf", "gemma3",
                                           table=GGMLQuantizationType.Q8_0))

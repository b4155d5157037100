"""Shared fixtures: tiny generated models (fast unit tests) and the real packaged models (integration tests).

Real models are loaded once per session and shared; their KV pools are kept small so several fit in memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# Where several xdist workers share the machine (one per core), each computes on one thread: a worker's parallel
# regions would otherwise wait on threads that the other worker's work has descheduled. A value already in the
# environment is kept; the tests of thread counts set their own.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import nextoken  # noqa: E402, F401 - before torch loads: its OpenMP setting (GOMP_SPINCOUNT) counts only then
from tests.tiny import write_tiny_model

if "TRITON_INTERPRET" not in os.environ:  # the block formats' CUDA kernel (ops/cuda_blocks.py) runs interpreted on CPU
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

DATA = Path(__file__).parent / "data"
REAL_MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma-3-270m"}
TEST_KV_BYTES = 64 << 20
# Tests of what only the native kernels do (fused steps, exact block formats without an fp32 copy): skipped in the
# run with them switched off (NEXTOKEN_NATIVE=0, tests/integration/test_torch_kernels.py), never where they merely fail
# to build, which fails those tests instead.
needs_native = pytest.mark.skipif(os.environ.get("NEXTOKEN_NATIVE") == "0", reason="the native kernels are switched off")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", "llama")


@pytest.fixture(scope="session")
def tiny_gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-gemma3.gguf", "gemma3")


def load_reference(model: str, name: str) -> dict:
    return json.loads((DATA / "reference" / model / name).read_text())


_LLMS: dict[tuple[str, str, str, str, str], object] = {}


def real_llm(model: str, dtype: str = "float32", kv_dtype: str = "fp32",  # noqa: ANN201 - returns nextoken.LLM
             device: str = "cpu", weights: str = "auto"):
    """One shared LLM per (model, dtype, kv_dtype, device, weights) for the whole session."""
    from nextoken import LLM

    key = (model, dtype, kv_dtype, device, weights)
    if key not in _LLMS:
        _LLMS[key] = LLM(REAL_MODELS[model], dtype=dtype, kv_dtype=kv_dtype, device=device, weights=weights,
                         kv_cache_bytes=TEST_KV_BYTES)
    return _LLMS[key]


def real_tokenizer(name: str, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - a nextoken Tokenizer
    """A real model's tokenizer built into a private cache directory (so its merges cache is exercised cold).

    The model file is resolved first: Gemma's assembled file lives in the regular cache directory. A missing model
    fails the test (setup installs both), it is never skipped.
    """
    from nextoken.loader.gguf import read_gguf
    from nextoken.loader.registry import resolve_model
    from nextoken.tokenizer.tokenizer import Tokenizer

    path = resolve_model(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXTOKEN_CACHE_DIR", str(tmp_path_factory.mktemp("tokcache")))
        return Tokenizer.from_gguf(read_gguf(path).metadata, source=str(path))


def agreement_and_kl(model: str, logprobs_of, prompts: list[dict] | None = None) -> tuple[float, float]:  # noqa: ANN001
    """Teacher-forced quality of a weight format: top-1 agreement of `logprobs_of(ids)` ([len, vocab] log-probs)
    with the reference's top-1 at every position, and the mean KL(fp32 || format) in nats against our fp32 model."""
    return agreements_and_kls(model, {"": logprobs_of}, prompts)[""]


def agreements_and_kls(model: str, variants: dict, prompts: list[dict] | None = None  # noqa: ANN001
                       ) -> dict[str, tuple[float, float]]:
    """`agreement_and_kl` for several variants at once, scoring each prompt in fp32 only once."""
    import torch

    fp32 = real_llm(model)
    agree = dict.fromkeys(variants, 0)
    kls: dict[str, list] = {name: [] for name in variants}
    total = 0
    for prompt in prompts if prompts is not None else load_reference(model, "hf_top5.json")["prompts"]:
        ids = prompt["seq_ids"]
        lp32 = fp32.engine.runner.score(ids).log_softmax(-1)
        top1 = torch.tensor([row[0] for row in prompt["top5_ids"]])
        total += len(ids)
        for name, logprobs_of in variants.items():
            lp = logprobs_of(ids).float().cpu()  # a GPU model's too
            agree[name] += int((lp.argmax(-1) == top1).sum())
            kls[name].append((lp32.exp() * (lp32 - lp)).sum(-1))
    return {name: (agree[name] / total, float(torch.cat(kls[name]).mean())) for name in variants}
